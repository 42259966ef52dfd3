"""``expert_choice``: an expert-choice layer's combine and the backward of its token gather (accumulations into the
tokens' rows at topk-over-tokens indices) become fixed-order segment sums ordered by a presence table (no sort);
token-choice layers are not matched."""

from __future__ import annotations

import pytest
import torch

from moe_compile import report
from moe_compile.passes.expert_choice import BY_GROUPS
from tests._tolerance import eager_bound_errors, within_eager_bound
from tests.test_cpu_miscompile import _layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_expert_choice_accumulations_rewritten_within_eager_bound(dtype):
    got, eager, ref, seed, rep = _layer(dtype, "moe_compile")
    rewrites = [r for r in rep.records if r.pass_name == "expert_choice" and r.kind == "rewrite"]
    assert len(rewrites) == 2, rep.table()  # the combine and the token gather's backward
    assert all(r.detail.startswith(BY_GROUPS) for r in rewrites), rep.table()
    assert rep.clean and rep.deterministic, rep.table()  # no atomic add left, forward or backward
    ok, worst, unjudged = within_eager_bound(got, eager, ref, dtype=dtype)
    assert ok and not unjudged, f"seed {seed}: {worst}: {eager_bound_errors(got, eager, ref, dtype=dtype)}"


@pytest.mark.parametrize("which", ["sort_dispatch", "expert_bias"])
def test_token_choice_not_matched(which):
    """A token-choice layer's topk chooses among experts: its accumulations are left to the other passes, also the
    backward of a per-expert bias table gathered at the topk's expert ids (a topk over as many entries as the table
    has rows, but along the experts)."""
    from tests.models.handwritten import SortIndexSelectScatterAdd
    from tests.passes.test_deterministic_accumulate import ExpertBias

    if which == "sort_dispatch":
        layer = SortIndexSelectScatterAdd()
        x = torch.randn(12, layer.router.shape[1], dtype=torch.bfloat16, requires_grad=True)
    else:
        layer, x = ExpertBias(sort=False), torch.randn(10, 12, requires_grad=True)
    torch._dynamo.reset()
    with report.collecting() as rep, torch._inductor.config.patch(force_disable_caches=True):  # the passes must run
        torch.compile(layer, backend="moe_compile", fullgraph=True)(x).float().sum().backward()
    assert rep.records, "no pass ran (a cache hit?)"
    torch._dynamo.reset()
    assert not [r for r in rep.records if r.pass_name == "expert_choice"], rep.table()
