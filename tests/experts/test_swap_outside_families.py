"""The MoE blocks of transformers families outside the experts interface that the expert-loop swap rewrites
(issue 36): DBRX (``DbrxFFN``: 2-D ``[E*I, H]`` expert weights, an eager loop over the experts hit, routed by
``route_tokens_to_experts(router(x))``), Llama4 (``Llama4TextMoe``: every token through every expert, scaled by
sigmoid scores that are zero outside the top-k, NOTE [dense experts] (moe_compile/experts/swap.py); a shared expert;
returns ``(out [T, H], router_logits)``) and Step3p7 (``Step3p7SparseMoeBlock``: an eager loop over stacked
``[E, 2I, H]`` weights, a router returning ``(logits, weights, ids)``, a shared expert). The blocks are transformers'
own classes, built from the tiny configs of the family matrix (``tests/models/hf_families.py``) with fresh random
weights.

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
    if family == "dbrx":
        from transformers.models.dbrx.modeling_dbrx import DbrxFFN

        block = DbrxFFN(config)
    elif family == "llama4":
        from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

        block = Llama4TextMoe(config)
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
}


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
    eager = tol.layer_step(eager_model, eager_model, x, cot)
    ref = tol.layer_step(ref_model, ref_model, x, cot, torch.float64)
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
    return got, eager, ref, swapped.block, original, records, rep


def original_hidden(block: nn.Module) -> int:
    return next(m for m in block.modules() if isinstance(m, nn.Linear)).in_features


def _assert_swapped_and_within_bound(family: str, got, eager, ref, records) -> None:
    assert [r[1:3] for r in records] == [("rewrite", "expert_loop_swapped")], records
    for part in SWAPPED[family]:
        assert part in records[0][3], records[0][3]
    ok, worst, unjudged = tol.within_eager_bound(got, eager, ref, dtype=torch.float32, always_judged=tuple(ref))
    assert ok and not unjudged, (worst, [(r.name, r.compiled, r.bound, r.note) for r in tol.eager_bound_errors(
        got, eager, ref, dtype=torch.float32) if r.ratio > 1])
    # the step judged every parameter the original block trains
    assert {n for n in got if n.startswith("grad:")} == {n for n in eager if n.startswith("grad:")}


@pytest.mark.parametrize("family", SWAPPED)
def test_swapped_block_step_within_eager_bound(family):
    got, eager, ref, _, _, records, _ = _steps(family, compiled=False)
    _assert_swapped_and_within_bound(family, got, eager, ref, records)


@pytest.mark.slow
@pytest.mark.parametrize("family", SWAPPED)
def test_compiled_block_one_graph_within_eager_bound(family):
    """Through ``moe_compile.compile``: swapped before compiling, the step is one graph (``fullgraph``; the eager
    loop's ``nonzero`` would break it) with no host read or accumulating scatter left. Slow (20-60 s each on 2 CPU
    cores); the family matrix (``-m slow``) checks the same of the whole models."""
    got, eager, ref, _, _, records, rep = _steps(family, compiled=True)
    _assert_swapped_and_within_bound(family, got, eager, ref, records)
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
    eager = copy.deepcopy(block)
    params = dict(block.named_parameters())
    keys = {k: v.shape for k, v in block.state_dict().items()}
    assert [r[1] for r in swap_expert_loops(block)] == ["rewrite"]
    assert dict(block.named_parameters()) == params and {k: v.shape for k, v in block.state_dict().items()} == keys

    H = original_hidden(block)
    k_dims = tol.gemm_k_dims([block.experts.mlp.w1, block.experts.mlp.w2.T])
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (block, eager)]
    for _ in range(2):
        x = torch.randn(2, 6, H, generator=gen)
        for model, opt in zip((block, eager), opts):
            opt.zero_grad()
            model(x).square().mean().backward()
            assert model.experts.mlp.w1.grad.shape == model.experts.mlp.w1.shape
            opt.step()
    for name, p in block.named_parameters():
        tol.assert_layer_close(p, eager.get_parameter(name), k_dims, backward=True, rows=12, what=name)
    block.load_state_dict(other.state_dict())
    x = torch.randn(2, 6, H, generator=gen)
    tol.assert_layer_close(block(x), other(x), k_dims, what="after load_state_dict")


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
