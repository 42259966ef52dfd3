"""Per-expert ``torch.where`` selection loops (unrolled by Dynamo under ``fullgraph=True``) go through the
dispatch recogniser: ``fuse_expert_loop`` canonicalises them into a sort-based dispatch with grouped
GEMMs, ``fuse_dispatch`` turns that into ``moe.permute_pad`` / ``moe.unpad_unpermute``.

Each case checks numerics against eager (forward and every gradient, training and inference), the two
rewrites in the report, and that the parameters (``state_dict``) are the same tensors with the same
values afterwards. One Inductor case checks the generated code: one grouped GEMM per projection instead
of ``E`` GEMMs, no atomic / scatter add, no host sync.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.models.expert_loops import EXPERTS, SELECTS, WEIGHTS, SelectionLoopMoE
from tests.passes._harness import check_rewrite, compile_and_run, no_accumulation

# (E, K): one expert, a non-power-of-two E, and K in {1, 2, E}
SIZES = [(1, 1), (6, 2), (8, 1), (6, 6)]
CASES = [(experts, select, weight, E, K) for (experts, select, weight), (E, K) in
         zip(itertools.product(EXPERTS, SELECTS, WEIGHTS), itertools.cycle(SIZES))]


def _case_id(case) -> str:
    return "-".join(str(c) for c in case)


@pytest.mark.parametrize("experts,select,weight,E,K", CASES, ids=[_case_id(c) for c in CASES])
@pytest.mark.parametrize("train", [True, False], ids=["train", "infer"])
def test_selection_loop_rewrites_and_matches_eager(experts, select, weight, E, K, train):
    layer = SelectionLoopMoE(num_experts=E, top_k=K, experts=experts, select=select, weight=weight, seed=E + K)
    before = {k: (v, v.clone()) for k, v in layer.state_dict(keep_vars=True).items()}
    x = torch.randn(12, 16, dtype=torch.bfloat16, requires_grad=train)
    check_rewrite(layer, (x,), {"fuse_expert_loop": 1, "fuse_dispatch": 1}, train=train, fullgraph=True)
    after = layer.state_dict(keep_vars=True)
    assert list(after) == list(before)
    for name, (tensor, value) in before.items():
        assert after[name] is tensor and torch.equal(after[name].detach(), value.detach()), name


def test_experts_that_differ_are_left_alone_with_a_reason():
    """Expert 1 uses another activation: the iterations differ, so the loop is not vectorised."""
    layer = SelectionLoopMoE(num_experts=4, top_k=2, experts="swiglu_list")
    layer.experts[1].forward = lambda x, m=layer.experts[1]: m.down(torch.nn.functional.gelu(m.gate(x)) * m.up(x))
    x = torch.randn(12, 16, dtype=torch.bfloat16)
    run = check_rewrite(layer, (x,), {"fuse_expert_loop": 0, "fuse_dispatch": 0}, train=False, fullgraph=True,
                        expected_skips={"fuse_expert_loop": ["experts_not_identical"]})
    assert "expert 1" in run.report.skips[0].detail


def test_generated_code_one_grouped_gemm_per_projection():
    layer = SelectionLoopMoE(num_experts=8, top_k=2, experts="swiglu_list")
    x = torch.randn(16, 16, dtype=torch.bfloat16, requires_grad=True)
    run = compile_and_run(layer, (x,), backend="moe_compile", train=True, get_code=True, fullgraph=True)
    fwd = run.code[0]
    # gate, up and down: three grouped GEMMs in the forward, none of the 3*E per-expert mm calls
    assert fwd.count("extern_kernels._grouped_mm(") == 3, fwd
    assert fwd.count("extern_kernels.mm(") == 1, fwd  # the router's linear only
    for code in run.code:
        no_accumulation(code)
        assert "_local_scalar_dense" not in code and "nonzero" not in code
