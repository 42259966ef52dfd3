"""NOTE [recorded router call] (moe_compile/experts/_swap_router_call.py): the swap calls a block's routing module as
the block's own forward does, read from the call: a router that takes only ``[B, S, H]``, a selection-only expert
bias passed to the router (torchtitan), a counter buffer the block adds the router's counts to; and what it refuses
(a buffer written otherwise, a tensor computed from the input passed to the router). Small layers of our own, on
fresh random inputs each run."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moe_compile.experts.swap import swap_expert_loops

H, FFN, E, K = 16, 24, 6, 2


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(H, FFN, bias=False), nn.Linear(H, FFN, bias=False)
        self.down_proj = nn.Linear(FFN, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Gate3D(nn.Module):
    """Takes ``[B, S, H]`` only (unpacks its shape); returns ``(ids, weights, None)`` as DeepSeek-V2's ``MoEGate``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(E, H) * 0.3)

    def forward(self, x: torch.Tensor):
        b, s, h = x.shape
        scores = F.linear(x.reshape(b * s, h), self.weight).softmax(-1)
        w, ids = scores.topk(K, dim=-1)
        return ids, w, None


class _Router(nn.Module):
    """Selection by ``scores + expert_bias``, weights from the unbiased scores (torchtitan's
    ``TokenChoiceTopKRouter``); also returns per-expert counts."""

    def __init__(self, top_k: int) -> None:
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.top_k = top_k

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None = None):
        scores = torch.sigmoid(self.gate(x).float())
        biased = scores + expert_bias if expert_bias is not None else scores
        ids = biased.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        counts = torch.histc(ids.flatten().float(), bins=E, min=0, max=E)
        return weights, ids, counts


def _loop(experts: nn.ModuleList, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    y = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        tok, slot = torch.where(ids == e)
        if tok.numel():
            y.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None].to(x.dtype))
    return y


class Block3DGate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate, self.experts = _Gate3D(), nn.ModuleList(_MLP() for _ in range(E))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        ids, weights, _ = self.gate(hidden)
        x = hidden.reshape(-1, hidden.shape[-1])
        return _loop(self.experts, x, ids, weights).reshape(hidden.shape)


class BiasedBlock(nn.Module):
    """torchtitan's ``MoE.forward``: ``router(x, self.expert_bias)``, ``tokens_per_expert.add_(counts)``."""

    def __init__(self, top_k: int = K, count: str = "router", router_arg: str = "bias") -> None:
        super().__init__()
        self.router, self.experts = _Router(top_k), nn.ModuleList(_MLP() for _ in range(E))
        self.count, self.router_arg = count, router_arg
        self.register_buffer("expert_bias", torch.randn(E) * 0.3)
        self.register_buffer("tokens_per_expert", torch.zeros(E), persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.reshape(-1, hidden.shape[-1])
        arg = self.expert_bias if self.router_arg == "bias" else x.pow(2).mean(0)[:E] * 0.1
        weights, ids, counts = self.router(x, arg)
        with torch.no_grad():
            self.tokens_per_expert.add_(counts if self.count == "router" else torch.ones_like(counts))
        return _loop(self.experts, x, ids, weights).reshape(hidden.shape)


def _swapped(block: nn.Module) -> tuple[nn.Module, list]:
    reference = copy.deepcopy(block)
    records = swap_expert_loops(block)
    return reference, records


def _same_step(reference: nn.Module, block: nn.Module, x: torch.Tensor, rtol: float = 1e-5) -> None:
    """Forward and backward (input and every parameter) of the swapped block against the unswapped copy."""
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = reference(xa), block(xb)
    torch.testing.assert_close(got, want, rtol=rtol, atol=1e-5)
    cot = torch.randn_like(want)
    want.backward(cot)
    got.backward(cot)
    torch.testing.assert_close(xb.grad, xa.grad, rtol=rtol, atol=1e-5)
    for (name, p), (_, q) in zip(reference.named_parameters(), block.named_parameters()):
        torch.testing.assert_close(q.grad if q.grad is not None else torch.zeros_like(q),
                                   p.grad if p.grad is not None else torch.zeros_like(p), rtol=rtol, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_router_taking_only_bsh_input_is_called_with_the_blocks_input():
    block = Block3DGate()
    reference, records = _swapped(block)
    assert [r[1:3] for r in records] == [("rewrite", "expert_loop_swapped")], records
    assert block._moe_compile_plan.call.on_hidden
    assert "gate([B, S, H])" in records[0][3]
    for _ in range(2):
        _same_step(reference, block, torch.randn(3, 5, H))


@pytest.mark.parametrize("top_k", [1, 2])
def test_selection_only_expert_bias_is_passed_to_the_router(top_k):
    block = BiasedBlock(top_k)
    with torch.no_grad():  # a bias that moves tokens' experts: the unbiased top-k would differ
        block.expert_bias.copy_(torch.linspace(-0.5, 0.5, E)[torch.randperm(E)])
    reference, records = _swapped(block)
    assert [r[1:3] for r in records] == [("rewrite", "expert_loop_swapped")], records
    call = block._moe_compile_plan.call
    assert call.args == (("state", "expert_bias"),) and call.counters == (("tokens_per_expert", 2),)
    assert not block.tokens_per_expert.any(), "the probe's counts were left in the buffer"
    x = torch.randn(4, 7, H)
    scores = torch.sigmoid(block.router.gate(x.reshape(-1, H)))
    assert not torch.equal((scores + block.expert_bias).topk(top_k, -1).indices, scores.topk(top_k, -1).indices)
    _same_step(reference, block, x)
    torch.testing.assert_close(block.tokens_per_expert, reference.tokens_per_expert)
    # the bias is read on every call: an update after the swap (torchtitan's load balancing) is followed
    with torch.no_grad():
        for m in (block, reference):
            m.expert_bias.copy_(-m.expert_bias)
    _same_step(reference, block, torch.randn(2, 9, H))
    torch.testing.assert_close(block.tokens_per_expert, reference.tokens_per_expert)


@pytest.mark.parametrize(("changes", "tag"), [
    ({"count": "other"}, "block_state_written"),  # a buffer written by something the router did not return
    ({"router_arg": "computed"}, "router_input_unknown"),  # a tensor computed from the input, passed to the router
])
def test_router_call_the_fused_path_cannot_reproduce_is_refused(changes, tag):
    block = BiasedBlock(**changes)
    before = {n: b.clone() for n, b in block.named_buffers()}
    records = swap_expert_loops(block)
    assert len(records) == 1 and records[0][1:3] == ("skip", tag), records
    assert getattr(block, "_moe_compile_original_forward", None) is None
    for n, b in block.named_buffers():
        assert torch.equal(b, before[n]), n
