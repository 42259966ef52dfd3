"""The MoE blocks of transformers families outside the experts interface that the expert-loop swap rewrites
(issue 36): DBRX (``DbrxFFN``: 2-D ``[E*I, H]`` expert weights, an eager loop over the experts hit, routed by
``route_tokens_to_experts(router(x))``), Llama4 (``Llama4TextMoe``: every token through every expert, scaled by
sigmoid scores that are zero outside the top-k, NOTE [dense experts] (moe_compile/experts/swap.py); a shared expert;
returns ``(out [T, H], router_logits)``) and Step3p7 (``Step3p7SparseMoeBlock``: an eager loop over stacked
``[E, 2I, H]`` weights, a router returning ``(logits, weights, ids)``, a shared expert) and SwitchTransformers
(``SwitchTransformersSparseMLP``: top-1 capacity routing that drops tokens, a ModuleDict of ``wi/wo`` experts,
NOTE [capacity swap] (moe_compile/experts/_swap_capacity.py)) and LongCat-Flash (``LongcatFlashMoE``: stacked experts
beside identity experts, NOTE [identity experts] (moe_compile/experts/interface.py)); NLLB-MoE is left alone (its
eager loop runs other experts than its router chose). The blocks are transformers' own
classes, built from the tiny configs of the family matrix (``tests/models/hf_families.py``) with fresh random
weights.

Each block is swapped, and its step (output and every gradient) must be as close to a float64 eager run of the
original block as float32 eager is (:func:`tests._tolerance.within_eager_bound`; float32 so that no token sits
within rounding of a routing tie), exact zeros included. Blocks the fused path does not compute are left alone
with their tag.
"""

from __future__ import annotations

import copy
import functools
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moe_compile
from moe_compile import report
from moe_compile.experts.swap import swap_expert_loops
from tests import _tolerance as tol

pytest.importorskip("transformers")


class _Out(nn.Module):
    """The block's output tensor (Llama4TextMoe returns ``(out, router_logits)``; the logits are compared apart)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return out[0] if isinstance(out, tuple) else out


def _fill(block: nn.Module, gen: torch.Generator) -> None:
    """Fresh weights ``randn / sqrt(last dim)`` (DBRX's and Step3p7's expert weights are ``torch.empty``)."""
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)


def _block(family: str, gen: torch.Generator) -> nn.Module:
    from tests.models.hf_families import tiny_config

    config = tiny_config(family)
    if family == "switch_transformers":
        from transformers.models.switch_transformers.modeling_switch_transformers import SwitchTransformersSparseMLP

        config.expert_capacity = SWITCH_CAPACITY
        block = SwitchTransformersSparseMLP(config)
    elif family == "dbrx":
        from transformers.models.dbrx.modeling_dbrx import DbrxFFN

        block = DbrxFFN(config)
    elif family == "llama4":
        from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

        block = Llama4TextMoe(config)
    elif family == "longcat_flash":
        from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashMoE

        block = LongcatFlashMoE(config)
        # a selection bias the router reads itself (zeros at init, trained in released checkpoints)
        block.router.e_score_correction_bias.copy_(torch.randn(block.router.n_routed_experts, generator=gen) * 0.05)
    else:
        from transformers.models.step3p7.modeling_step3p7 import Step3p7SparseMoeBlock

        block = Step3p7SparseMoeBlock(config, layer_idx=0)
    _fill(block, gen)
    return block.train()


# what the swap's record says it read: the layout, the projections, the weights' position, the router's form
SWAPPED = {
    "dbrx": ("flat experts (8, gated w1/v1/w2)", "weights after the MLP", "routed by router_route (pair)"),
    "llama4": ("stacked experts (8, gated gate_up_proj/down_proj)", "weights before the MLP",
               "routed by router_call (dense)", "+ shared_expert"),
    "step3p7": ("stacked experts (8, gated gate_up_proj/down_proj)", "weights after the MLP",
                "routed by gate_call (triple)", "+ shared_experts"),
    "longcat_flash": ("stacked experts (8, gated gate_up_proj/down_proj)", "weights after the MLP",
                      "routed by router_call (triple)", "+ 2 identity experts"),
    "switch_transformers": ("module_dict experts (8, plain wi/wo)", "top-1 capacity routing by the block's router "
                            "on its input", "dropped choices exact zeros"),
}
# Switch's capacity per sequence: 12 tokens over 8 experts at capacity 2 drop tokens in almost every draw (asserted)
SWITCH_CAPACITY = 2


def _steps(family: str, compiled: bool, tokens: tuple[int, int] = (2, 12)):
    """``(swapped step, eager step, float64 step, swapped block, original block, swap records, report or None)``."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    original = _block(family, gen)
    ref_model = _Out(copy.deepcopy(original).double())
    x = torch.randn(*tokens, original_hidden(original), generator=gen)
    cot = torch.randn(*tokens, original_hidden(original), generator=gen)
    if family == "llama4":  # [T, H] out
        cot = cot.reshape(-1, cot.shape[-1])
    eager_model = _Out(original)
    eager = _with_zero_grads(tol.layer_step(eager_model, eager_model, x, cot), eager_model)
    ref = _with_zero_grads(tol.layer_step(ref_model, ref_model, x, cot, torch.float64), ref_model)
    swapped = _Out(copy.deepcopy(original))
    rep = None
    if compiled:
        torch._dynamo.reset()
        try:
            with report.collecting() as rep, torch._inductor.config.patch(force_disable_caches=True):
                got = tol.layer_step(moe_compile.compile(swapped, fullgraph=True), swapped, x, cot)
        finally:
            torch._dynamo.reset()
        records = [(r.layer, r.kind, r.what, r.detail) for r in report.module_records(swapped)
                   if r.pass_name == "swap_expert_loops"]
    else:
        records = swap_expert_loops(swapped)
        got = tol.layer_step(swapped, swapped, x, cot)
    return _with_zero_grads(got, swapped), eager, ref, swapped.block, original, records, rep


def _with_zero_grads(step: dict, model: nn.Module) -> dict:
    """``step`` with an exactly zero gradient for every trained parameter that got none: an expert no kept token
    reached has none in the eager loop (it never ran) and zeros swapped (its rows of the grouped gradient); both are
    zero, and the zeros are then judged as exact zeros."""
    for name, p in model.named_parameters():
        if p.requires_grad:
            step.setdefault(f"grad:{name}", torch.zeros_like(p))
    return step


def original_hidden(block: nn.Module) -> int:
    return next(m for m in block.modules() if isinstance(m, nn.Linear)).in_features


def _assert_swapped_and_within_bound(parts: tuple[str, ...], got, eager, ref, records, dtype=torch.float32) -> None:
    """Swapped (its record naming each of ``parts``), the step within eager's bound from the wider run."""
    assert [r[1:3] for r in records] == [("rewrite", "expert_loop_swapped")], records
    for part in parts:
        assert part in records[0][3], records[0][3]
    # one expert's own gradient (ModuleList / ModuleDict experts) sums the few rows routed to it: eager's error there
    # is one draw of a few roundings (seen: Switch's expert_4.wo at 1.13x a bound eager met by luck); the step's
    # noise is its floor, as in test_swap_skip_loops.py (few_samples)
    few = {n for n in ref if re.search(r"\.experts\.(expert_)?\d+\.", n)}
    ok, worst, unjudged = tol.within_eager_bound(got, eager, ref, dtype=dtype, always_judged=tuple(ref),
                                                 few_samples=few)
    assert ok and not unjudged, (worst, [(r.name, r.compiled, r.bound, r.note) for r in tol.eager_bound_errors(
        got, eager, ref, dtype=dtype, few_samples=few) if r.ratio > 1])
    # the step judged every parameter the original block trains
    assert {n for n in got if n.startswith("grad:")} == {n for n in eager if n.startswith("grad:")}


@pytest.mark.parametrize("family", SWAPPED)
def test_swapped_block_step_within_eager_bound(family):
    got, eager, ref, _, _, records, _ = _steps(family, compiled=False)
    _assert_swapped_and_within_bound(SWAPPED[family], got, eager, ref, records)


@pytest.mark.slow
@pytest.mark.parametrize("family", SWAPPED)
def test_compiled_block_one_graph_within_eager_bound(family):
    """Through ``moe_compile.compile``: swapped before compiling, the step is one graph (``fullgraph``; the eager
    loop's ``nonzero`` would break it) with no host read or accumulating scatter left. Slow (20-60 s each on 2 CPU
    cores); the family matrix (``-m slow``) checks the same of the whole models."""
    got, eager, ref, _, _, records, rep = _steps(family, compiled=True)
    _assert_swapped_and_within_bound(SWAPPED[family], got, eager, ref, records)
    assert rep.graphs == 1 and rep.clean, rep.table()


def test_llama4_dropped_experts_are_exact_zeros():
    """NOTE [dense experts] (moe_compile/experts/swap.py) on Llama4TextMoe itself: the router's scores are exactly 0
    outside the top-k of its logits, and with 3 tokens of top-2 at most 6 of the 8 experts are reached: their
    weights' gradients are exactly zero in the dense eager block, and stay exactly zero swapped (the router's too,
    outside the chosen rows)."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    block = _block("llama4", gen)
    x = torch.randn(1, 3, original_hidden(block), generator=gen)
    scores, logits = block.router(x.reshape(-1, x.shape[-1]))
    ids = torch.topk(logits, block.top_k, dim=1).indices
    assert torch.all(scores.scatter(1, ids, 0) == 0) and torch.all(scores.gather(1, ids) > 0)
    unused = sorted(set(range(block.num_experts)) - set(ids.flatten().tolist()))
    assert unused, ids

    swapped = copy.deepcopy(block)
    assert [r[1] for r in swap_expert_loops(swapped)] == ["rewrite"]
    cot = torch.randn(3, x.shape[-1], generator=gen)
    for model in (block, swapped):
        out, router_logits = model(x)
        assert torch.equal(router_logits, logits)
        (out * cot).sum().backward()
    for name in ("experts.gate_up_proj", "experts.down_proj"):
        want, got = block.get_parameter(name).grad, swapped.get_parameter(name).grad
        assert torch.all(want[unused] == 0) and torch.all(got[unused] == 0), name
        assert torch.all((got == 0) == (want == 0)), name


def test_dbrx_keeps_its_parameters():
    """DBRX's experts are read as ``[E, I, H]`` views of its ``[E*I, H]`` parameters on every call: the same
    parameter objects, ``state_dict`` keys and shapes; gradients land in ``p.grad`` ``[E*I, H]``; an optimizer step
    and ``load_state_dict`` reach the swapped forward."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    block = _block("dbrx", gen)
    other = _block("dbrx", gen)
    eager, opts = _swap_keeping_parameters(block)
    k_dims = tol.gemm_k_dims([block.experts.mlp.w1, block.experts.mlp.w2.T])

    def grads_in_place(model: nn.Module) -> None:
        assert model.experts.mlp.w1.grad.shape == model.experts.mlp.w1.shape

    _trains_and_loads_like_eager(block, eager, other, opts, k_dims, (2, 6), gen, grads_in_place)


def test_dense_router_with_softmax_scores_is_left_alone():
    """A Llama4 block whose router's scores are a softmax over every expert (no zeros): dropping the other experts
    would change the output, so the block is left alone (``dense_scores_not_topk``) and runs as written."""
    from transformers.models.llama4.modeling_llama4 import Llama4Router

    class SoftRouter(Llama4Router):
        def forward(self, hidden_states):
            logits = nn.Linear.forward(self, hidden_states)
            return torch.softmax(logits, dim=1), logits

    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    block = _block("llama4", gen)
    soft = SoftRouter(_llama4_config())
    soft.load_state_dict(block.router.state_dict())
    block.router = soft
    x = torch.randn(2, 5, original_hidden(block), generator=gen)
    want = block(x)[0]
    records = swap_expert_loops(block)
    assert [r[1:3] for r in records] == [("skip", "dense_scores_not_topk")], records
    assert torch.equal(block(x)[0], want)


def test_dense_experts_with_bias_are_left_alone():
    """A Llama4 block whose experts add a bias to ``gate_up``: an expert whose score is 0 adds ``down(act(b_g) *
    b_u)``, so dropping it is not exact (``dense_experts_biased``)."""
    from transformers.models.llama4.modeling_llama4 import Llama4TextExperts

    class BiasedExperts(Llama4TextExperts):
        def __init__(self, config):
            super().__init__(config)
            self.gate_up_proj_bias = nn.Parameter(torch.randn(self.num_experts, 2 * self.expert_dim) * 0.1)

        def forward(self, hidden_states):
            hidden_states = hidden_states.view(self.gate_up_proj.shape[0], -1, self.hidden_size)
            gate, up = (torch.bmm(hidden_states, self.gate_up_proj) + self.gate_up_proj_bias[:, None]).chunk(2, -1)
            return torch.bmm(up * self.act_fn(gate), self.down_proj).view(-1, self.hidden_size)

    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    block = _block("llama4", gen)
    experts = BiasedExperts(_llama4_config())
    experts.load_state_dict(block.experts.state_dict(), strict=False)
    block.experts = experts
    records = swap_expert_loops(block)
    assert [r[1:3] for r in records] == [("skip", "dense_experts_biased")], records


def _llama4_config():
    from tests.models.hf_families import tiny_config

    return tiny_config("llama4")


def test_dbrx_router_jitter_is_left_alone():
    """DBRX's router with ``moe_jitter_eps`` scales its input by uniform noise in training (in place): an output the
    fused path cannot reproduce draw for draw, seen by the probe's training-mode forward (``probe_mismatch``); the
    block is left as written."""
    from transformers.models.dbrx.modeling_dbrx import DbrxFFN

    from tests.models.hf_families import tiny_config

    config = tiny_config("dbrx")
    config.ffn_config.moe_jitter_eps = 0.01
    block = DbrxFFN(config)
    _fill(block, torch.Generator().manual_seed(torch.seed() % 2**31))
    forward = block.forward
    records = swap_expert_loops(block)
    assert [r[1:3] for r in records] == [("skip", "probe_mismatch")], records
    assert "training mode" in records[0][3] and block.forward == forward


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


def _swapped_eager_ref(original: nn.Module, x: torch.Tensor, cot: torch.Tensor):
    """``(swapped step, its repeat, eager step, float64 step, swap records)`` of ``original`` (left as it is)."""
    ref_model = _Out(copy.deepcopy(original).double())
    eager_model, swapped = _Out(original), _Out(copy.deepcopy(original))
    eager = _with_zero_grads(tol.layer_step(eager_model, eager_model, x, cot), eager_model)
    ref = _with_zero_grads(tol.layer_step(ref_model, ref_model, x, cot, torch.float64), ref_model)
    records = swap_expert_loops(swapped)
    got = _with_zero_grads(tol.layer_step(swapped, swapped, x, cot), swapped)
    again = _with_zero_grads(tol.layer_step(swapped, swapped, x, cot), swapped)
    return got, again, eager, ref, records


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


def _swap_keeping_parameters(block: nn.Module) -> tuple[nn.Module, list]:
    """Swap ``block`` (asserted: rewritten, the same parameter objects, ``state_dict`` keys and shapes); returns its
    eager copy and an SGD optimizer for each, built before the swap."""
    eager = copy.deepcopy(block)
    params = dict(block.named_parameters())
    keys = {k: v.shape for k, v in block.state_dict().items()}
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (block, eager)]
    assert [r[1] for r in swap_expert_loops(block)] == ["rewrite"]
    assert dict(block.named_parameters()) == params and {k: v.shape for k, v in block.state_dict().items()} == keys
    return eager, opts


def _trains_and_loads_like_eager(block: nn.Module, eager: nn.Module, other: nn.Module, opts: list, k_dims, shape,
                                 gen: torch.Generator, check=None) -> None:
    """Two optimizer steps (built before the swap) of the swapped ``block`` and its eager copy land on the same
    parameters; ``load_state_dict`` of ``other``'s weights then reaches the swapped forward."""
    H = original_hidden(block)
    for _ in range(2):
        x = torch.randn(*shape, H, generator=gen)
        for model, opt in zip((block, eager), opts):
            opt.zero_grad()
            model(x).square().mean().backward()
            if check is not None:
                check(model)
            opt.step()
    rows = shape[0] * shape[1]
    for name, p in block.named_parameters():
        tol.assert_layer_close(p, eager.get_parameter(name), k_dims, backward=True, rows=rows, what=name)
    block.load_state_dict(other.state_dict())
    x = torch.randn(*shape, H, generator=gen)
    tol.assert_layer_close(block(x), other(x), k_dims, what="after load_state_dict")


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


# ===== LongCat-Flash: identity experts, NOTE [identity experts] (moe_compile/experts/interface.py) =====


def test_longcat_identity_experts_within_eager_bound():
    """LongCat-Flash's experts include ``zero_expert_num`` identity experts (an id past the 8 MLP experts adds the
    token times its weight; the tiny config has 2): swapped, with tokens routed to them (asserted: some choices, not
    all), the output and every gradient (router, experts, the ``gate_up_proj`` rows of the identity experts that no
    id reads: exact zeros) are within eager's bound from a float64 run; a repeated step is bitwise the same."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    original = _block("longcat_flash", gen)
    E = original.experts.num_routed_experts
    x = torch.randn(2, 12, original_hidden(original), generator=gen)
    cot = torch.randn(x.shape, generator=gen)
    with torch.no_grad():
        identity = original.router(x)[2] >= E
    assert 0 < int(identity.sum()) < identity.numel(), identity
    got, again, eager, ref, records = _swapped_eager_ref(original, x, cot)
    _assert_swapped_and_within_bound(SWAPPED["longcat_flash"], got, eager, ref, records)
    assert torch.all(got["grad:block.experts.gate_up_proj"][E:] == 0)
    for name, value in got.items():
        assert torch.equal(value, again[name]), name


class _Halve(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0.5


def test_longcat_other_identity_form_is_left_alone():
    """A LongCat block whose "zero-compute" experts are not the identity (here: half the token): the fused path's
    identity rows do not compute it, the probe sees it, and the block is left alone with the family's tag
    (``zero_compute_experts``, the probe's reason in its detail) and runs as written. The unmodified block swaps
    (``test_longcat_identity_experts_within_eager_bound``), so this is the probe's doing."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    block = _block("longcat_flash", gen)
    block.experts.identity_expert = _Halve()
    x = torch.randn(2, 12, original_hidden(block), generator=gen)
    with torch.no_grad():
        assert bool((block.router(x)[2] >= block.experts.num_routed_experts).any())
        want = block(x)
    forward = block.forward
    records = swap_expert_loops(block)
    assert [r[1:3] for r in records] == [("skip", "zero_compute_experts")], records
    assert "probe_mismatch" in records[0][3] and block.forward == forward
    with torch.no_grad():
        assert torch.equal(block(x), want)
