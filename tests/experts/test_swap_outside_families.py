"""The MoE blocks of transformers families outside the experts interface that the expert-loop swap rewrites
(issue 36): DBRX (``DbrxFFN``: 2-D ``[E*I, H]`` expert weights, an eager loop over the experts hit, routed by
``route_tokens_to_experts(router(x))``), Llama4 (``Llama4TextMoe``: every token through every expert, scaled by
sigmoid scores that are zero outside the top-k, NOTE [dense experts] (moe_compile/experts/swap.py); a shared expert;
returns ``(out [T, H], router_logits)``) and Step3p7 (``Step3p7SparseMoeBlock``: an eager loop over stacked
``[E, 2I, H]`` weights, a router returning ``(logits, weights, ids)``, a shared expert), LongCat-Flash
(``LongcatFlashMoE``: stacked experts beside identity experts,
NOTE [identity experts] (moe_compile/experts/interface.py)) and SwitchTransformers
(``SwitchTransformersSparseMLP``: top-1 capacity routing; its drops, bf16 and what is left alone, with NLLB-MoE, in
``test_swap_capacity.py``). The blocks are transformers' own classes, built from the tiny configs of the family
matrix (``tests/models/hf_families.py``) with fresh random weights (``tests/experts/_outside_blocks.py``).

Each block is swapped, and its step (output and every gradient) must be as close to a float64 eager run of the
original block as float32 eager is (:func:`tests._tolerance.within_eager_bound`; float32 so that no token sits
within rounding of a routing tie), exact zeros included. Blocks the fused path does not compute are left alone
with their tag.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from moe_compile.experts.swap import swap_expert_loops
from tests import _tolerance as tol

pytest.importorskip("transformers")

from tests.experts._outside_blocks import (
    SWAPPED,
    _assert_swapped_and_within_bound,
    _block,
    _fill,
    _steps,
    _swap_keeping_parameters,
    _swapped_eager_ref,
    _trains_and_loads_like_eager,
    expected_rewrite,
    original_hidden,
)


@pytest.mark.parametrize("family", SWAPPED)
def test_swapped_block_step_within_eager_bound(family):
    got, eager, ref, _, original, records, _ = _steps(family, compiled=False)
    record, parts = expected_rewrite(family, original)
    _assert_swapped_and_within_bound(parts, got, eager, ref, records, record=record)


@pytest.mark.slow
@pytest.mark.parametrize("family", SWAPPED)
def test_compiled_block_one_graph_within_eager_bound(family):
    """Through ``moe_compile.compile``: swapped before compiling, the step is one graph (``fullgraph``; the eager
    loop's ``nonzero`` would break it) with no host read or accumulating scatter left. Slow (20-60 s each on 2 CPU
    cores); the family matrix (``-m slow``) checks the same of the whole models."""
    got, eager, ref, _, original, records, rep = _steps(family, compiled=True)
    record, parts = expected_rewrite(family, original)
    _assert_swapped_and_within_bound(parts, got, eager, ref, records, record=record)
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


# ===== LongCat-Flash: identity experts, NOTE [identity experts] (moe_compile/experts/interface.py) =====


def test_longcat_identity_experts_within_eager_bound():
    """LongCat-Flash's router picks among the 8 MLP experts and ``zero_expert_num`` identity experts (an id past the MLP
    experts adds the token times its weight; the tiny config has 2). transformers 5.24 computes them inside its experts
    loop (the swap's NOTE [identity experts] (moe_compile/experts/interface.py)); 5.25 in the block, which sends their
    choices to MLP experts with weight 0 before the experts interface. Either way, with tokens routed to them (asserted:
    some choices, not all), the rewritten step's output and every gradient (router, experts, any ``gate_up_proj`` rows
    of identity experts, which no id reads: exact zeros) are within eager's bound from a float64 run; a repeated step
    is bitwise the same."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    original = _block("longcat_flash", gen)
    E = original.experts.down_proj.shape[0]  # the MLP experts (the router's n_routed_experts counts both kinds)
    x = torch.randn(2, 12, original_hidden(original), generator=gen)
    cot = torch.randn(x.shape, generator=gen)
    with torch.no_grad():
        identity = original.router(x)[2] >= E
    assert 0 < int(identity.sum()) < identity.numel(), identity
    got, again, eager, ref, records = _swapped_eager_ref(original, x, cot)
    record, parts = expected_rewrite("longcat_flash", original)
    _assert_swapped_and_within_bound(parts, got, eager, ref, records, record=record)
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
    if not hasattr(block.experts, "identity_expert"):
        pytest.skip("this transformers computes the identity experts in the block's own forward (plain tensor code, "
                    "compiled as written), not as an experts-loop module the swap would replace")
    block.experts.identity_expert = _Halve()
    x = torch.randn(2, 12, original_hidden(block), generator=gen)
    with torch.no_grad():
        assert bool((block.router(x)[2] >= block.experts.down_proj.shape[0]).any())
        want = block(x)
    forward = block.forward
    records = swap_expert_loops(block)
    assert [r[1:3] for r in records] == [("skip", "zero_compute_experts")], records
    assert "probe_mismatch" in records[0][3] and block.forward == forward
    with torch.no_grad():
        assert torch.equal(block(x), want)
