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


def test_one_order_table_for_combine_and_gather_backward():
    """The combine and the token gather's backward accumulate at the same topk indices in the same entry order: the
    compiled step (forward and backward) builds their order table once, as many prefix sums as one
    ``group_order`` traces, not one table per accumulation."""
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.utils import run_and_get_code
    from torch.fx.experimental.proxy_tensor import make_fx

    from moe_compile.ops.segment_sum import group_order
    from tests.models.expert_choice import ExpertChoiceMoE
    from tests.passes._harness import fresh_cache

    model = ExpertChoiceMoE(hidden=32, ffn=64, experts=8)
    x = torch.randn(2, 16, 32, requires_grad=True)
    idx, group = torch.randint(0, 32, (16,)), torch.arange(16) // 2
    one_table = make_fx(lambda i, g: group_order(i, 32, g, 8), decomposition_table=select_decomp_table())(idx, group)
    cumsums = sum(n.target == torch.ops.aten.cumsum.default for n in one_table.graph.nodes)
    assert cumsums > 0
    torch._dynamo.reset()
    with report.collecting() as rep, fresh_cache():
        compiled = torch.compile(model, backend="moe_compile")
        _, codes = run_and_get_code(lambda: compiled(x).sum().backward())
    torch._dynamo.reset()
    assert len([r for r in rep.records if r.pass_name == "expert_choice" and r.kind == "rewrite"]) == 2, rep.table()
    assert sum(code.count("aten.cumsum.default(") for code in codes) == cumsums, rep.table()
