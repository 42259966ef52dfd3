"""What the probe before a swap must see (NOTE [probe before swap] (moe_compile/experts/swap.py)): blocks whose
forward the fused path matches on a small eval-mode probe but not in use, found by the fuzzer (``tests/fuzz``).

Each block is a generated expert loop (``tests/fuzz/emit.py``: a ``gate`` router, ``nn.ModuleList`` experts, a
loop over the experts hit; its forward takes ``[B, S, H]``) with one thing the fused path does not do.
``moe_compile.compile`` must leave it alone with the tag, and the compiled layer must then match eager (forward and
backward) within the fuzzer's bound.
"""

from __future__ import annotations

import random

import pytest
import torch

from moe_compile.experts._probe import path_dtypes
from moe_compile.experts.swap import swap_expert_loops
from tests.fuzz.emit import build
from tests.fuzz.grammar import Spec
from tests.fuzz.harness import check

BLOCK = dict(tokens=8, batch3d=True, hidden=16, inter=16, experts=4, top_k=2, dispatch="hit_loop", select="one_hot",
             combine="index_add", weight="rows_act", layout="module_list", router="linear", entry="moe_compile",
             renorm="none", weights_dtype="act", mlp="swiglu_manual")

CASES = {
    # the block's forward reads [T, H] tokens only: the [2, 3, H] probe raised out of moe_compile.compile
    "tokens_only": ({"batch3d": False}, None),
    # a custom autograd function in the router (a gradient scaled by 0.5): the forward is the candidate's
    "grad_scale_logits": ({"router_fn": "grad_scale_logits"}, "probe_grad_mismatch"),
    "grad_scale_weights": ({"router_fn": "grad_scale_weights"}, "probe_grad_mismatch"),
    "grad_scale_expert_rows": ({"rows_fn": "grad_scale"}, "probe_grad_mismatch"),
    # a load-balancing loss returned in training only: the eval probe never saw it
    "aux_loss_in_training": ({"aux_loss": True}, "probe_mismatch"),
    # DeepSeek-V3's selection bias (0.1 * randn per expert): changes some tokens' experts, at times none of a
    # 256-token probe's (fuzzer run of 2026-11-27, layer 396). On softmax scores the fused path reads it (the choice
    # on scores + bias, the weights the scores), probed with the bias perturbed so that it moves the choice
    "selection_bias": ({"expert_bias": True, "top_k": 1, "score": "softmax"}, None),
    # on sigmoid scores (DeepSeek-V3's own) that reading is not the block's: the perturbed probe refuses it
    "selection_bias_sigmoid": ({"expert_bias": True, "top_k": 1, "score": "sigmoid"},
                               ("probe_mismatch", "probe_grad_mismatch")),
}


def _spec(changes: dict) -> Spec:
    return Spec(seed=random.SystemRandom().randrange(2**16), **{**BLOCK, **changes})


@pytest.mark.parametrize("case", CASES)
def test_swap_refuses_what_the_fused_path_does_not_compute(case):
    changes, tag = CASES[case]
    spec = _spec(changes)
    records = swap_expert_loops(build(spec))
    tags = (tag,) if isinstance(tag, str) else tag
    if tag is None:
        assert [r[1:3] for r in records] == [("rewrite", "expert_loop_swapped")], records
    else:
        assert len(records) == 1 and records[0][1] == "skip" and records[0][2] in tags, records
    result = check(spec, "passes")
    assert result.kind == "ok", result.failure_message()
    assert ("swap_expert_loops" in result.rewrites) == (tag is None), result.summary()


def test_path_dtypes_is_the_lowest_precision_on_each_gradients_path():
    """NOTE [gradient precision] (moe_compile/experts/_probe.py): each leaf's unit is the lowest floating precision
    among the tensors its gradient flows through from the output, not its own dtype nor the graph's lowest. A float32
    weight whose product is rounded to bf16 gets bfloat16 (so does the float64 input of that product); a float32
    weight in the same graph whose gradient flows through float32 nodes only (``h * w + exp(w)``: the mul, the add and
    the exp) keeps float32; a float64 leaf cast to float32 gets float32; a leaf the output does not reach gets None."""
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    through_bf16 = torch.randn(8, 4, requires_grad=True)
    in_fp32 = torch.randn(4, requires_grad=True)
    unused = torch.randn(3, requires_grad=True)
    h = (x.float() @ through_bf16).to(torch.bfloat16).float()
    out = h * in_fp32 + in_fp32.exp()
    assert path_dtypes(out, (x, through_bf16, in_fp32, unused)) == [
        torch.bfloat16, torch.bfloat16, torch.float32, None]
    assert path_dtypes(x.float().sum(), (x,)) == [torch.float32]


# top-1 of the logits, then a softmax over that one logit: the weight is exactly 1 and the router's gradient exactly
# zero in eager (softmax's backward y * (g - y * g) at y = 1); renormalised softmax top-k is the same in exact
# arithmetic, but its backward leaves rounding residue there (fuzzer, CI of 232f10f, seed 1296)
TOP1_OF_LOGITS = {"top_k": 1, "topk_on": "logits", "batch3d": False, "tokens": 16}


def _router_grads(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = block(x)
    out = out[0] if isinstance(out, tuple) else out
    (grad,) = torch.autograd.grad(out, block.gate.weight, torch.randn_like(out))
    return grad


def test_top1_softmax_of_topk_logits_keeps_the_router_gradient_exactly_zero():
    spec = _spec(TOP1_OF_LOGITS)
    block = build(spec)
    x = torch.randn(spec.tokens, spec.hidden, dtype=next(block.parameters()).dtype)
    assert not _router_grads(block, x).any()
    records = swap_expert_loops(block)
    assert [r[1:3] for r in records] == [("rewrite", "expert_loop_swapped")], records
    assert block._moe_compile_plan.gate_weights == "topk_softmax"
    assert not _router_grads(block, x).any()


def test_probe_refuses_residue_where_the_blocks_gradient_is_exactly_zero(monkeypatch):
    """Without the exact form among the candidates, the renormalised one matches the forward (1 == 1) and the
    gradients within ulps, but leaves residue in the router's gradient that the block's own has as exact zeros."""
    from moe_compile.experts import swap

    candidates = swap._candidates
    monkeypatch.setattr(swap, "_candidates", lambda block, plan: [
        c for c in candidates(block, plan) if c["gate_weights"] != "topk_softmax"])
    records = swap_expert_loops(build(_spec(TOP1_OF_LOGITS)))
    assert len(records) == 1 and records[0][1:3] == ("skip", "probe_grad_mismatch"), records
    assert "exactly zero in the block's own" in records[0][3], records


@pytest.mark.parametrize("batch3d", [False, True])
def test_probe_on_a_gpu_tries_each_shape_on_cpu_copies_first(batch3d):
    """NOTE [probe shapes on a GPU] (moe_compile/experts/_probe.py): a block written for ``[T, H]`` and given
    ``[B, S, H]`` indexes past the batch dim, on CUDA a device-side assert that loses the CUDA context (the
    expert-parallel GPU test died so on 2026-11-28). Off the CPU, the shapes run first on CPU copies of the block's
    tensors, and the device sees only the first that ran there: here the device is ``meta`` (where the block's CPU
    weights make every call fail, so the probe ends refused), and what matters is which shapes reached it."""
    from moe_compile.experts._probe import NotSwappable, probe_input

    spec = _spec({"batch3d": batch3d})
    block = build(spec)
    seen = []
    forward = block.forward
    block.forward = lambda x, *a, **k: (seen.append((x.device.type, x.dim())), forward(x, *a, **k))[1]
    with pytest.raises(NotSwappable, match="probe_failed"):
        probe_input(block, spec.hidden, next(block.parameters()).dtype, torch.device("meta"))
    assert [d for t, d in seen if t == "cpu"] == ([3] if batch3d else [3, 2]), seen  # up to the first that runs
    assert [d for t, d in seen if t == "meta"] == ([3] if batch3d else [2]), seen
