"""SwitchTransformers' top-1 capacity routing through the expert-loop swap
(NOTE [capacity swap] (moe_compile/experts/_swap_capacity.py)): the block's own router runs, dropped tokens are exact
zeros, forward and backward, in float32 and bf16, and what the fused path cannot compute (expert dropout, a wrong
router gradient) is left alone; NLLB-MoE is left alone (its eager loop runs other experts than its router chose).
The blocks are transformers' own classes (``tests/experts/_outside_blocks.py``); each step is judged against a
float64 eager run of the original block (:func:`tests._tolerance.within_eager_bound`)."""


from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moe_compile.experts.swap import swap_expert_loops
from tests import _tolerance as tol

pytest.importorskip("transformers")

from tests.experts._outside_blocks import (
    SWAPPED,
    _assert_swapped_and_within_bound,
    _block,
    _fill,
    _swap_keeping_parameters,
    _swapped_eager_ref,
    _trains_and_loads_like_eager,
    _with_zero_grads,
    original_hidden,
)

# ===== SwitchTransformers: top-1 capacity routing, NOTE [capacity swap] (moe_compile/experts/_swap_capacity.py) =====


def _switch_dropped(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``[T]`` bool: the tokens of ``x`` that ``block``'s router drops (its dispatch mask, the integer tensor it
    returns: first in transformers 5.24, second in 5.17)."""
    with torch.no_grad():
        mask = next(t for t in block.router(x.clone()) if not t.is_floating_point())
    return ~(mask.reshape(-1, block.router.num_experts) != 0).any(-1)


@functools.cache
def _switch_router_drops() -> bool:
    """Whether the installed transformers' Switch router drops tokens at all: at capacity 1, a sequence of 12 tokens
    over 8 experts must drop 4 or more. transformers 5.17's counts capacity over the size-1 dim of its ``[.., 1, E]``
    mask and drops none at any capacity >= 1 (the swap then probes its drops at capacity 0:
    NOTE [capacity swap] (moe_compile/experts/_swap_capacity.py))."""
    gen = torch.Generator().manual_seed(0)
    block = _block("switch_transformers", gen).eval()
    block.router.expert_capacity = 1
    return bool(_switch_dropped(block, torch.randn(1, 12, original_hidden(block), generator=gen)).any())


def _switch_block_that_drops(gen: torch.Generator, dtype: torch.dtype = torch.float32, train: bool = True):
    """``(block, x, cotangent, dropped [T] bool)``: a Switch block at capacity :data:`SWITCH_CAPACITY` and tokens it
    routes with some dropped, not all (a draw where capacity drops none, or all, is drawn again); none dropped where
    the router never drops (:func:`_switch_router_drops`)."""
    for _ in range(32):
        block = _block("switch_transformers", gen).to(dtype).train(train)
        x = torch.randn(2, 12, original_hidden(block), generator=gen).to(dtype)
        cot = torch.randn(x.shape, generator=gen)
        dropped = _switch_dropped(block, x)
        if 0 < int(dropped.sum()) < dropped.numel() or not _switch_router_drops():
            return block, x, cot, dropped
    raise AssertionError("32 draws of a Switch block: none dropped some tokens and kept others")


def _switch_steps(train: bool, gen: torch.Generator):
    """``(swapped step, its repeat, eager step, float64 step, records, dropped [T] bool)`` of a Switch block that
    drops some tokens, in training or eval mode (gradients in both)."""
    original, x, cot, dropped = _switch_block_that_drops(gen, train=train)
    return (*_swapped_eager_ref(original, x, cot), dropped)


def _assert_drops_exact_and_repeat_bitwise(dropped, got, again, eager) -> None:
    """Some tokens dropped, not all (none where the router never drops); their outputs and input gradients exact
    zeros (compiled and eager); a repeated step bitwise the same."""
    if _switch_router_drops():
        assert 0 < int(dropped.sum()) < dropped.numel(), dropped
    else:
        assert not dropped.any(), dropped
    for step in (got, eager):
        assert torch.all(step["out"].reshape(-1, step["out"].shape[-1])[dropped] == 0)
        assert torch.all(step["grad:x"].reshape(-1, step["grad:x"].shape[-1])[dropped] == 0)
    for name, value in got.items():
        assert torch.equal(value, again[name]), name


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_switch_capacity_drops_within_eager_bound(train):
    """A Switch block whose router drops tokens (asserted: some, not all): swapped, its output and every gradient
    (router and experts) within eager's bound from a float64 run, exact zeros exact (the dropped tokens' outputs and
    input gradients, an expert no kept token reached); a repeated step is bitwise the same. The router's jitter is 0
    here (the family matrix's config): with jitter, transformers' router scales a float32 input in place, so float32
    eager's experts see the jittered tokens and the float64 reference's (a cast copy) do not, and no bound from that
    reference means anything; ``test_switch_router_jitter_draws_match`` covers it against eager."""
    if not _switch_router_drops():
        pytest.skip("this transformers release's Switch router drops no token at any capacity >= 1 (5.17)")
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    got, again, eager, ref, records, dropped = _switch_steps(train, gen)
    _assert_swapped_and_within_bound(SWAPPED["switch_transformers"], got, eager, ref, records)
    _assert_drops_exact_and_repeat_bitwise(dropped, got, again, eager)


def test_switch_bf16_is_swapped_within_eager_bound():
    """Switch in bf16 (the family matrix's dtype): its router casts the bf16 tokens and its classifier to float32 and
    its probabilities back to bf16 before they weight the experts, so the float32 classifier's gradient carries bf16
    roundings. The probe judges it in bf16 ulps (NOTE [gradient precision] (moe_compile/experts/_probe.py); in
    float32 ulps it was 2e3-5e3x past the tolerance and the block was refused), so the block is swapped, and its
    step (output and every gradient, the float32 classifier's included) is within bf16 eager's bound from a float64
    run, exact zeros exact (the dropped tokens' outputs and input gradients). The router computes in float32 on the
    same bf16 tokens in every run here, so eager, swapped and the reference route alike (asserted: some tokens
    dropped, not all, where the router drops at all: not transformers 5.17's)."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    original, x, cot, dropped = _switch_block_that_drops(gen, torch.bfloat16)
    assert original.router.classifier.weight.dtype == torch.float32  # the router's own cast, on its first call
    got, again, eager, ref, records = _swapped_eager_ref(original, x, cot)
    _assert_swapped_and_within_bound(SWAPPED["switch_transformers"], got, eager, ref, records, dtype=torch.bfloat16)
    _assert_drops_exact_and_repeat_bitwise(dropped, got, again, eager)


class _Top1Router517(nn.Module):
    """transformers 5.17's Switch router, as it reads (written here: CI has 5.24): a ``[.., 1, E]`` one-hot of the
    top-1 expert whose capacity cumsum runs over that size-1 dim (it never drops at capacity >= 1), returning
    ``(kept expert's prob, mask, kept expert's prob)``. ``third="logits"``: a form the swap does not know."""

    def __init__(self, hidden: int, experts: int, capacity: int, third: str = "probs") -> None:
        super().__init__()
        self.num_experts, self.expert_capacity, self.third = experts, capacity, third
        self.classifier = nn.Linear(hidden, experts, bias=False)

    def forward(self, x: torch.Tensor):
        logits = self.classifier(x)
        probs = torch.softmax(logits, dim=-1)
        top, index = torch.max(probs, dim=-1, keepdim=True)
        one_hot = F.one_hot(index, num_classes=self.num_experts)
        one_hot = one_hot * (torch.cumsum(one_hot, dim=-2) <= self.expert_capacity)
        kept = torch.max(probs, dim=-1).values.unsqueeze(-1)
        return kept, one_hot, (top if self.third == "probs" else logits)


class _DenseActDense(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.wi, self.wo, self.act = nn.Linear(hidden, ffn, bias=False), nn.Linear(ffn, hidden, bias=False), nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(self.act(self.wi(x)))


class _SparseMLP517(nn.Module):
    """transformers 5.17's ``SwitchTransformersSparseMLP`` and its ModuleDict experts' loop, as they read: the router
    on the flattened tokens, the experts weighted by its third output."""

    def __init__(self, hidden: int, ffn: int, experts: int, capacity: int, third: str = "probs") -> None:
        super().__init__()
        self.router = _Top1Router517(hidden, experts, capacity, third)
        self.experts = nn.ModuleDict({f"expert_{e}": _DenseActDense(hidden, ffn) for e in range(experts)})

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = hidden_states.shape
        x = hidden_states.view(-1, hidden)
        _, selected, weights = self.router(x)
        out = torch.zeros_like(x)
        mask = selected.permute(2, 1, 0)
        for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
            idx, top_x = torch.where(mask[e].squeeze(0))
            y = self.experts[f"expert_{e[0]}"](x[None, top_x].reshape(-1, hidden)) * weights[top_x, idx, None]
            out.index_add_(0, top_x, y.to(x.dtype))
        return out.reshape(batch, seq, hidden)


def test_switch_517_router_form_is_swapped_within_eager_bound():
    """transformers 5.17's Switch form (the GPU machine's release), written here: its router never drops at capacity
    >= 1, so the probe compares drops at capacity 0 (NOTE [capacity swap] (moe_compile/experts/_swap_capacity.py));
    swapped, the step within eager's bound from a float64 run; a router whose third output is not the kept prob
    again is left alone (``capacity_router_form``)."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    original = _SparseMLP517(hidden=16, ffn=32, experts=8, capacity=2)
    _fill(original, gen)
    x = torch.randn(2, 12, 16, generator=gen)
    cot = torch.randn(x.shape, generator=gen)
    got, again, eager, ref, records = _swapped_eager_ref(original, x, cot)
    _assert_swapped_and_within_bound(("module_dict experts (8, plain wi/wo)", "(probs, mask, probs)",
                                      "dropped choices exact zeros"), got, eager, ref, records)
    for name, value in got.items():
        assert torch.equal(value, again[name]), name
    other = _SparseMLP517(hidden=16, ffn=32, experts=8, capacity=2, third="logits")
    assert [r[1:3] for r in swap_expert_loops(other)] == [("skip", "capacity_router_form")]


class _ScaleGrad(torch.autograd.Function):
    """The identity, whose backward scales the gradient by ``factor``."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return t.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def test_switch_bf16_wrong_router_gradient_is_refused():
    """The bf16 unit of NOTE [gradient precision] (moe_compile/experts/_probe.py) still refuses a wrong backward: a
    Switch block whose experts loop scales its routing weights' gradient by ``1 + 32 eps_bf16`` (1.25; the forward
    unchanged) gets a float32 classifier gradient 32 bf16 ulps of each element away from the fused path's, where the
    probe allows 8 of the row's largest value plus 4 of the largest gradient's: the block is left alone
    (``probe_grad_mismatch``, in bfloat16 ulps) and runs as written. The same block unscaled is swapped
    (``test_switch_bf16_is_swapped_within_eager_bound``)."""
    from transformers.models.switch_transformers.modeling_switch_transformers import SwitchTransformersExperts

    from tests.models.hf_families import tiny_config

    factor = 1 + 32 * torch.finfo(torch.bfloat16).eps

    class ScaledExperts(SwitchTransformersExperts):
        def forward(self, hidden_states, selected_experts, routing_weights):
            return super().forward(hidden_states, selected_experts, _ScaleGrad.apply(routing_weights, factor))

    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    block = _block("switch_transformers", gen)
    experts = ScaledExperts(tiny_config("switch_transformers"))
    experts.load_state_dict(block.experts.state_dict())
    block.experts = experts
    block = block.to(torch.bfloat16)
    forward = block.forward
    records = swap_expert_loops(block)
    assert [r[1:3] for r in records] == [("skip", "probe_grad_mismatch")], records
    assert "router.classifier.weight" in records[0][3] and "bfloat16 ulps" in records[0][3], records[0][3]
    assert block.forward == forward


def test_switch_router_jitter_draws_match():
    """With router jitter in training, the swapped block calls the router itself, so from one random state it draws
    the noise eager draws: the same tokens dropped, output and gradients within the layer's bound of eager's. From
    another random state it is not (the check can fail)."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    block = _block("switch_transformers", gen)
    block.router.jitter_noise = 0.05
    swapped = copy.deepcopy(block)
    assert [r[1] for r in swap_expert_loops(swapped)] == ["rewrite"]
    x = torch.randn(2, 12, original_hidden(block), generator=gen)
    cot = torch.randn(x.shape, generator=gen)
    k_dims = tol.gemm_k_dims([block.experts.expert_0.wi.weight, block.experts.expert_0.wo.weight])

    def step(model: nn.Module, seed: int):
        torch.manual_seed(seed)
        # ``t * 1``: the router scales a float32 input in place, which a leaf that requires grad refuses
        return _with_zero_grads(tol.layer_step(lambda t: model(t * 1), model, x, cot), model)

    seed = torch.seed() % 2**31
    want, got, other = step(block, seed), step(swapped, seed), step(swapped, seed + 1)
    assert torch.equal(got["out"] == 0, want["out"] == 0)
    for name, w in want.items():
        name_ = name.replace("grad:", "")
        tol.assert_layer_close(got[name], w, k_dims, backward=name != "out", rows=24, what=name_)
    with pytest.raises(AssertionError):
        tol.assert_layer_close(other["out"], want["out"], k_dims, what="another draw")


def test_switch_keeps_its_parameters():
    """The ModuleDict experts keep their parameter objects and ``state_dict`` keys
    (NOTE [grouped views] (moe_compile/experts/swap.py)); an optimizer built before the swap steps the swapped
    forward's weights, and ``load_state_dict`` reaches it."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    block, other = _block("switch_transformers", gen), _block("switch_transformers", gen)
    eager, opts = _swap_keeping_parameters(block)
    k_dims = tol.gemm_k_dims([block.experts.expert_0.wi.weight, block.experts.expert_0.wo.weight])
    _trains_and_loads_like_eager(block, eager, other, opts, k_dims, (2, 12), gen)


def test_switch_expert_dropout_is_left_alone():
    """Switch's experts hold a dropout (``dropout_rate``, 0.1 in released configs): in training it draws per expert
    in the eager loop's order, which the fused path cannot reproduce, so the block is left alone
    (``expert_dropout``) and runs as written."""
    from transformers.models.switch_transformers.modeling_switch_transformers import SwitchTransformersSparseMLP

    from tests.models.hf_families import tiny_config

    config = tiny_config("switch_transformers")
    config.dropout_rate = 0.1
    block = SwitchTransformersSparseMLP(config)
    forward = block.forward
    records = swap_expert_loops(block)
    assert [r[1:3] for r in records] == [("skip", "expert_dropout")], records
    assert block.forward == forward


def test_nllb_is_left_alone_its_eager_runs_experts_by_mask_value():
    """NLLB-MoE (transformers 5.24): ``NllbMoeExperts`` one-hots the router's ``[T, E]`` top-1 mask a second time,
    so its loop runs ``expert_1`` on every token's kept top-1 weight and ``expert_0`` on the rest of its combine
    weights (the mask's values 1 and 0 taken as expert ids), not the experts the router chose. No routed reading
    computes that: the block is left alone (``capacity_eager_mismatch``). Checked here on the block itself: when
    transformers computes the routing it returns, this test fails, and the block is worth another look."""
    from transformers.models.nllb_moe.modeling_nllb_moe import NllbMoeSparseMLP

    from tests.models.hf_families import tiny_config

    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    block = NllbMoeSparseMLP(tiny_config("nllb_moe"), 64)
    _fill(block, gen)
    x = torch.randn(24, 64, generator=gen)
    with torch.no_grad():
        mask, combine, _ = block.router(x)
        experts = block.experts
        by_value = experts["expert_1"](x) * (combine * mask).sum(-1, keepdim=True) \
            + experts["expert_0"](x) * (combine * (1 - mask)).sum(-1, keepdim=True)
        routed = sum(combine[:, e, None] * experts[f"expert_{e}"](x) for e in range(8))
        out = block(x[None])[0]
    k_dims = tol.gemm_k_dims([experts["expert_0"].fc1.weight, experts["expert_0"].fc2.weight])
    tol.assert_layer_close(out, by_value, k_dims, rows=8, what="the eager loop, read by mask value")
    assert (out - routed).abs().max() > 0.1 * routed.abs().max()
    forward = block.forward
    records = swap_expert_loops(block)
    assert [r[1:3] for r in records] == [("skip", "capacity_eager_mismatch")], records
    assert block.forward == forward
