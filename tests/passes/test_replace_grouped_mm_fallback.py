"""replace_grouped_mm_fallback: transformers' fallback op (offs.tolist() host sync) -> moe.grouped_mm.

The rewrite fires on fp32 (the dtype that takes the fallback under compile), matches eager in forward and
grads, and no AOT forward or backward graph calls the fallback or its backward op afterwards (the control
without the pass does). A fallback called with int64 offsets is left alone with a reason tag.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers.integrations.moe")

from moe_compile.config import MoECompileConfig  # noqa: E402
from moe_compile.passes import StagePass  # noqa: E402
from tests.passes._harness import check_rewrite  # noqa: E402


def experts(x_SH, w1_EIH, w2_EHI, offs_E):
    fallback = torch.ops.transformers.grouped_mm_fallback
    h = F.silu(fallback(x_SH, w1_EIH.transpose(-2, -1), offs=offs_E))
    return fallback(h, w2_EHI.transpose(-2, -1), offs=offs_E)


def _inputs(offs_dtype=torch.int32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(9, 16, generator=g, requires_grad=True)
    w1 = torch.randn(4, 8, 16, generator=g, requires_grad=True)
    w2 = torch.randn(4, 16, 8, generator=g, requires_grad=True)
    offs = torch.tensor([2, 2, 7, 8], dtype=offs_dtype)  # one empty expert; row 8 past offs[-1]
    return x, w1, w2, offs


def test_fallback_replaced_and_matches_eager():
    check_rewrite(experts, _inputs(), {"replace_grouped_mm_fallback": 2},
                  expected_skips={"replace_grouped_mm_fallback": []})


def test_int64_offsets_left_alone():
    check_rewrite(experts, _inputs(torch.int64), {"replace_grouped_mm_fallback": 0},
                  expected_skips={"replace_grouped_mm_fallback": ["unexpected_signature"] * 2})


@pytest.mark.parametrize("enabled", [True, False])
def test_no_fallback_op_left_in_forward_or_backward(enabled):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    config = MoECompileConfig(passes=(("replace_grouped_mm_fallback", enabled),))
    stage = StagePass("pre_grad", config)
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    def backend(gm, example_inputs):
        stage(gm.graph)
        gm.recompile()
        return aot_autograd(fw_compiler=record, bw_compiler=record)(gm, example_inputs)

    torch._dynamo.reset()
    x, w1, w2, offs = _inputs()
    torch.compile(experts, backend=backend)(x, w1, w2, offs).pow(2).mean().backward()
    torch._dynamo.reset()
    assert len(graphs) == 2
    targets = [str(n.target) for gm in graphs for n in gm.graph.nodes]
    has_fallback = any("grouped_mm_fallback" in t for t in targets)
    assert has_fallback is not enabled
