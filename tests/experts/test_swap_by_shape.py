"""The swap reads experts and routers by what they are, not by their names (issue 51): projections by their shapes
(``experts/_swap_layout.py::mlp_readings``; the probe picks gate from up and the weights' orientation), a router as the
block's one ``nn.Linear(H, E)`` child whatever its name, with the top-k from any int attribute the probe confirms.

Each block below is written in the spelling of public code that no name table knows; each is swapped, and its step
(output, input gradient, every parameter gradient) is within eager's distance from a float64 run, tensor by tensor."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moe_compile.experts.swap import swap_expert_loops
from tests import _tolerance as tol

H, F_, E = 32, 24, 6


class _PlainExpert(nn.Module):
    """Megatron's unfused expert MLP: ``linear_fc1`` -> gelu -> ``linear_fc2``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(H, F_, bias=False)
        self.linear_fc2 = nn.Linear(F_, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class _GatedExpert(nn.Module):
    """A SwiGLU expert whose projections are named for neither role: ``proj_b`` is the gate, ``proj_a`` the up."""

    def __init__(self) -> None:
        super().__init__()
        self.proj_a = nn.Linear(H, F_, bias=False)
        self.proj_b = nn.Linear(H, F_, bias=False)
        self.proj_out = nn.Linear(F_, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj_out(F.silu(self.proj_b(x)) * self.proj_a(x))


class LoopBlock(nn.Module):
    """A where-loop over a ModuleList of experts, routed by a ``Linear`` named ``wg`` (fairseq's name) with its top-k
    kept as ``self.k`` (no ``top_k`` attribute): softmax -> top-k -> renormalise."""

    def __init__(self, expert: type[nn.Module]) -> None:
        super().__init__()
        self.k = 2
        self.wg = nn.Linear(H, E, bias=False)
        self.local_experts = nn.ModuleList(expert() for _ in range(E))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.reshape(-1, H)
        probs = torch.softmax(self.wg(x).float(), dim=-1)
        w, idx = torch.topk(probs, self.k, dim=-1)
        w = (w / w.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for e in range(E):
            tok, slot = torch.where(idx == e)
            if tok.numel():
                out[tok] += self.local_experts[e](x[tok]) * w[tok, slot, None]
        return out.reshape(hidden.shape)


class StackedBlock(nn.Module):
    """Stacked expert weights on the block itself, stored ``[E, H, F]`` / ``[E, F, H]`` and applied as ``x @ w[e]``
    (MegaBlocks' and the expert-choice paper's layout), routed by ``self.router``."""

    def __init__(self) -> None:
        super().__init__()
        self.top_k = 2
        self.router = nn.Linear(H, E, bias=False)
        self.W_in = nn.Parameter(torch.randn(E, H, F_) * H**-0.5)
        self.W_out = nn.Parameter(torch.randn(E, F_, H) * F_**-0.5)
        self.num_experts = E

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.reshape(-1, H)
        w, idx = torch.topk(torch.softmax(self.router(x), dim=-1), self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for e in range(E):
            tok, slot = torch.where(idx == e)
            out.index_add_(0, tok, F.relu(x[tok] @ self.W_in[e]) @ self.W_out[e] * w[tok, slot, None])
        return out.reshape(hidden.shape)


class _DenseExperts(nn.Module):
    """vLLM's ``FusedMoE`` on its torch fallback: stacked ``w13`` / ``w2``, takes the router's logits and picks the
    top-k itself; every expert runs on every token, weighted by ``(weights * (ids == e)).sum(-1)``."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.choose = k  # no top_k attribute, and none on the block: only the forward's topk says what K is
        self.w13 = nn.Parameter(torch.randn(E, 2 * F_, H) * H**-0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, F_) * F_**-0.5)

    def forward(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        w, ids = logits.softmax(-1).topk(self.choose, -1)
        out = torch.zeros_like(x)
        for e in range(E):
            h = F.linear(x, self.w13[e])
            out = out + F.linear(F.silu(h[:, :F_]) * h[:, F_:], self.w2[e]) * (w * (ids == e)).sum(-1, keepdim=True)
        return out


class DenseBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = _DenseExperts(k=3)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.reshape(-1, H)
        return self.experts(x, self.gate(x)).reshape(hidden.shape)


class _TableRouter(nn.Module):
    """GPT-OSS's router (transformers 4.5x): a bias-carrying projection, softmax over the top-k logits, the weights
    scattered into a zero ``[T, E]`` table, returned with the ids: ``(scores_TE, ids_TK)``."""

    def __init__(self) -> None:
        super().__init__()
        self.top_k = 2
        self.weight = nn.Parameter(torch.randn(E, H) * H**-0.5)
        self.bias = nn.Parameter(torch.randn(E) * 0.1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.reshape(-1, H), self.weight, self.bias)
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        return torch.zeros_like(logits).scatter_(1, ids, top.softmax(-1)), ids


class TableRoutedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = _TableRouter()
        self.experts = nn.ModuleList(_GatedExpert() for _ in range(E))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.reshape(-1, H)
        scores, ids = self.router(x)
        out = torch.zeros_like(x)
        for e in range(E):
            tok, _ = torch.where(ids == e)
            out.index_add_(0, tok, self.experts[e](x[tok]) * scores[tok, e, None])
        return out.reshape(hidden.shape)


class _HalvedGLU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


class MaskAssignBlock(nn.Module):
    """vLLM's torch reference for ``fused_moe``: weights ``wa [E, 2F, H]`` / ``wb [E, H, F]`` on the block under no
    experts-like name or count, every token repeated K times, ``out[ids == e] = mlp_e(x[ids == e])`` with a host
    read of the mask's sum, then the weighted sum over the K copies."""

    def __init__(self) -> None:
        super().__init__()
        self.n_pick = 2
        self.scorer = nn.Linear(H, E, bias=False)
        self.wa = nn.Parameter(torch.randn(E, 2 * F_, H) * H**-0.5)
        self.wb = nn.Parameter(torch.randn(E, H, F_) * F_**-0.5)
        self.glu = _HalvedGLU()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.reshape(-1, H)
        probs = torch.softmax(self.scorer(x), dim=-1, dtype=torch.float32)
        w, ids = torch.topk(probs, self.n_pick)
        x_rep = x.repeat_interleave(self.n_pick, dim=0)
        out = x.new_zeros(x_rep.shape)
        ids = ids.reshape(-1)
        for e in range(E):
            mask = ids == e
            if mask.sum():
                out[mask] = self.glu(x_rep[mask] @ self.wa[e].t()) @ self.wb[e].t()
        return (out.view(-1, self.n_pick, H) * w.unsqueeze(-1).to(out.dtype)).sum(1).reshape(hidden.shape)


class _StackedGemm(nn.Module):
    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(E, k, n) * k**-0.5)


class _SplitExperts(nn.Module):
    """Aria's grouped experts: each projection a module of one ``[E, K, N]`` weight, applied as ``x @ w[e]`` over
    contiguous runs of sorted rows (``fc_in`` gate-then-up, ``fc_out`` down)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc_in = _StackedGemm(H, 2 * F_)
        self.fc_out = _StackedGemm(F_, H)

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        outs = []
        for e, chunk in enumerate(torch.split(rows, counts)):
            gate, up = (chunk @ self.fc_in.weight[e]).chunk(2, dim=-1)
            outs.append((F.silu(gate) * up) @ self.fc_out.weight[e])
        return torch.cat(outs)


class SplitExpertsBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pick = 2
        self.router = nn.Linear(H, E, bias=False)
        self.experts = _SplitExperts()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.reshape(-1, H)
        top, ids = torch.topk(self.router(x), self.pick, dim=-1)
        order = ids.reshape(-1).argsort(stable=True)
        counts = torch.bincount(ids.reshape(-1), minlength=E).tolist()
        y = self.experts(x[order // self.pick], counts)
        out = torch.zeros_like(y).index_copy_(0, order, y).view(-1, self.pick, H)
        return (out * top.softmax(-1).unsqueeze(-1)).sum(1).reshape(hidden.shape)


class _IdsPastExperts(nn.Module):
    """Stacked experts over ``E`` ids of ``E + 3`` routed (no count of the others on any attribute): ids past ``E``
    return the token itself (LongCat-Flash's identity experts), or nothing (``drop``: zero experts)."""

    def __init__(self, drop: bool = False) -> None:
        super().__init__()
        self.drop = drop
        self.gate_up = nn.Parameter(torch.randn(E, 2 * F_, H) * H**-0.5)
        self.down = nn.Parameter(torch.randn(E, H, F_) * F_**-0.5)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(E + 3):
            tok, slot = torch.where(ids == e)
            if e >= E:
                y = x[tok] * (0.0 if self.drop else 1.0)
            else:
                gate, up = F.linear(x[tok], self.gate_up[e]).chunk(2, dim=-1)
                y = F.linear(F.silu(gate) * up, self.down[e])
            out.index_add_(0, tok, y * w[tok, slot, None])
        return out


class IdsPastExpertsBlock(nn.Module):
    def __init__(self, drop: bool = False) -> None:
        super().__init__()
        self.top_k = 2
        self.scorer = nn.Linear(H, E + 3, bias=False)
        self.experts = _IdsPastExperts(drop)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.reshape(-1, H)
        w, ids = torch.topk(self.scorer(x).softmax(-1), self.top_k, dim=-1)
        return self.experts(x, ids, w).reshape(hidden.shape)


@pytest.mark.parametrize("make", [lambda: LoopBlock(_PlainExpert), lambda: LoopBlock(_GatedExpert), StackedBlock,
                                  DenseBlock, TableRoutedBlock, MaskAssignBlock, SplitExpertsBlock,
                                  IdsPastExpertsBlock],
                         ids=["plain_unnamed", "gated_unnamed", "stacked_transposed", "top_k_seen_in_forward",
                              "scores_table_router", "unnamed_stacked_on_block", "one_weight_per_child_module",
                              "identity_ids_past_the_experts"])
def test_block_with_unknown_names_is_swapped_within_eager_bound(make):
    torch.manual_seed(torch.seed() % 2**31)
    block = make()
    ref_block = copy.deepcopy(block).double()
    x = torch.randn(2, 7, H)
    cot = torch.randn(2, 7, H)
    eager = tol.layer_step(block, block, x, cot)
    ref = tol.layer_step(ref_block, ref_block, x, cot, torch.float64)
    swapped = copy.deepcopy(block)
    records = swap_expert_loops(swapped)
    assert [r[1:3] for r in records] == [("rewrite", "expert_loop_swapped")], records
    got = tol.layer_step(swapped, swapped, x, cot)
    for step in (got, eager, ref):  # an expert no token reached: no gradient in the eager loop, zeros swapped
        for name, p in block.named_parameters():
            step.setdefault(f"grad:{name}", torch.zeros_like(p, dtype=step["out"].dtype))
    ok, worst, unjudged = tol.within_eager_bound(got, eager, ref, dtype=torch.float32, always_judged=tuple(ref))
    assert ok and not unjudged, (worst, unjudged)


def test_gate_and_up_are_told_apart_by_the_probe():
    """Both orders of two ``(F, H)`` projections fit a gated MLP by shape; only the one the block computes (gate
    ``proj_b``, up ``proj_a``) passes the probe, and the record names it."""
    block = LoopBlock(_GatedExpert)
    (record,) = swap_expert_loops(block)
    assert "gated proj_b/proj_a/proj_out" in record[3], record


class _MapRouter(nn.Module):
    """Megatron's ``TopKRouter``: a raw ``weight [E, H]``, ``topk`` (not ``top_k``), returning ``(probs [T, E],
    routing_map [T, E] bool)``, the probs zero outside the map."""

    def __init__(self) -> None:
        super().__init__()
        self.topk = 2
        self.weight = nn.Parameter(torch.randn(E, H) * H**-0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores, idx = torch.topk(F.linear(x.float(), self.weight.float()), self.topk, dim=-1)
        probs = torch.zeros(x.shape[0], E).scatter(1, idx, torch.softmax(scores, dim=-1))
        return probs, torch.zeros(x.shape[0], E, dtype=torch.bool).scatter(1, idx, True)


class _SequentialMLP(nn.Module):
    """Megatron's ``SequentialMLP``: experts of one gate-then-up ``linear_fc1 [2F, H]``, run on tokens already
    permuted, split by host counts; it holds no router."""

    def __init__(self) -> None:
        super().__init__()
        self.local_experts = nn.ModuleList(nn.ModuleDict({"linear_fc1": nn.Linear(H, 2 * F_, bias=False),
                                                          "linear_fc2": nn.Linear(F_, H, bias=False)})
                                           for _ in range(E))

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        outs = []
        for expert, chunk in zip(self.local_experts, torch.split(rows, counts)):
            gate, up = expert["linear_fc1"](chunk).chunk(2, dim=-1)
            outs.append(expert["linear_fc2"](F.silu(gate) * up))
        return torch.cat(outs)


class MegatronStyleLayer(nn.Module):
    """A map router, a ``masked_select``-style permute by expert, the experts one level down, and Megatron's return
    convention ``(output, mlp_bias=None)``."""

    def __init__(self) -> None:
        super().__init__()
        self.router = _MapRouter()
        self.experts = _SequentialMLP()

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, None]:
        x = hidden.reshape(-1, H)
        probs, routing_map = self.router(x)
        tokens = torch.arange(x.shape[0]).unsqueeze(0).expand(E, -1).masked_select(routing_map.T)
        y = self.experts(x[tokens], routing_map.sum(0).tolist())
        weights = probs.T.masked_select(routing_map.T).unsqueeze(-1)
        out = torch.zeros_like(x).index_add_(0, tokens, (y * weights).to(x.dtype))
        return out.reshape(hidden.shape), None


def test_routing_map_router_one_level_up_is_swapped_within_eager_bound():
    """The router is found on the experts container's parent's parent (the container holds none), its top-k from
    ``topk``, its ``(probs, map)`` read as each token's K mapped experts; the layer's ``(output, None)`` is kept."""
    torch.manual_seed(torch.seed() % 2**31)
    block = MegatronStyleLayer()
    x, cot = torch.randn(2, 7, H), torch.randn(2, 7, H)

    def first(model):
        return lambda t: model(t)[0]

    ref_block = copy.deepcopy(block).double()
    ref_block.router.float()  # its float32 casts are its own: the wide run keeps the router's spelling
    eager = tol.layer_step(first(block), block, x, cot)
    ref = tol.layer_step(first(ref_block), ref_block, x, cot, torch.float64)
    swapped = copy.deepcopy(block)
    records = swap_expert_loops(swapped)
    assert [r[:3] for r in records] == [("<root>", "rewrite", "expert_loop_swapped")], records
    assert "routed by router_call (map)" in records[0][3] and "gated linear_fc1/linear_fc2" in records[0][3]
    assert swapped(x)[1] is None
    got = tol.layer_step(first(swapped), swapped, x, cot)
    for step in (got, eager, ref):
        for name, p in block.named_parameters():
            step.setdefault(f"grad:{name}", torch.zeros_like(p, dtype=step["out"].dtype))
    ok, worst, unjudged = tol.within_eager_bound(got, eager, ref, dtype=torch.float32, always_judged=tuple(ref))
    assert ok and not unjudged, (worst, unjudged)


class _StackedHeads(nn.Module):
    """Rank-3 parameters of one leading size that are not experts (per-head projections, no router)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Parameter(torch.randn(4, H, 8) * H**-0.5)
        self.o = nn.Parameter(torch.randn(4, 8, H) * 8**-0.5)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bsh,nhd,ndk->bsk", hidden, self.q, self.o)


def test_rank3_parameters_without_a_router_are_left_alone_silently():
    """By-shape discovery proposes any module with two rank-3 parameters of one leading size; where nothing routes
    them, the swap leaves the module as written and says nothing (it is no MoE layer)."""
    module = _StackedHeads()
    forward = module.forward
    assert swap_expert_loops(module) == []
    assert module.forward == forward


def test_ids_past_the_experts_that_drop_the_token_are_not_swapped():
    """The probe, not the router's width, says what ids past ``E`` compute: where they drop the token (zero experts)
    the fused path's identity experts do not match and the block stays as written."""
    block = IdsPastExpertsBlock(drop=True)
    forward = block.forward
    records = swap_expert_loops(block)
    assert [r[1] for r in records] == ["skip"], records
    assert block.forward == forward


class _Statics(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.correction = nn.Parameter(torch.zeros(1, E), requires_grad=False)  # zeros, as a model initialises it

    def forward(self, probs: torch.Tensor) -> torch.Tensor:
        return probs + self.correction.squeeze()


class SelectionBiasBlock(nn.Module):
    """ERNIE 4.5's routing: the choice on the probabilities plus a bias held by a child module, the weights the
    unbiased probabilities renormalised; ``logits_bias``: the same tensor added to the logits instead (it then moves
    the weights too, which the fused path's reading does not do)."""

    def __init__(self, logits_bias: bool = False) -> None:
        super().__init__()
        self.logits_bias = logits_bias
        self.k = 2
        self.gate = nn.Linear(H, E, bias=False)
        self.stats = _Statics()
        self.experts = nn.ModuleList(_GatedExpert() for _ in range(E))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.reshape(-1, H)
        logits = self.gate(x)
        if self.logits_bias:
            probs = self.stats(logits).softmax(-1)
            w, ids = probs.topk(self.k, dim=-1)
        else:
            probs = logits.softmax(-1)
            ids = self.stats(probs).topk(self.k, dim=-1).indices
            w = probs.gather(1, ids)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(E):
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, slot, None])
        return out.reshape(hidden.shape)


def test_selection_bias_in_a_child_module_is_read_and_probed_perturbed():
    """A zero selection bias, as initialised, is swapped as what it is: the probe ran with it perturbed (and put it
    back). Trained to other values afterwards, the swapped block follows it (within eager's bound); the same tensor
    added to the logits instead is refused, though at zero it changes nothing the probe would see."""
    torch.manual_seed(torch.seed() % 2**31)
    block = SelectionBiasBlock()
    records = swap_expert_loops(block)
    assert [r[1:3] for r in records] == [("rewrite", "expert_loop_swapped")], records
    assert torch.equal(block.stats.correction, torch.zeros(1, E))
    with torch.no_grad():
        block.stats.correction.uniform_(-0.2, 0.2)  # large enough to move the choice of some tokens
    eager = SelectionBiasBlock()
    eager.load_state_dict(block.state_dict())
    x, cot = torch.randn(2, 7, H), torch.randn(2, 7, H)
    ref_block = copy.deepcopy(eager).double()
    want = tol.layer_step(eager, eager, x, cot)
    ref = tol.layer_step(ref_block, ref_block, x, cot, torch.float64)
    got = tol.layer_step(block, block, x, cot)
    for step in (got, want, ref):
        for name, p in eager.named_parameters():
            if p.requires_grad:
                step.setdefault(f"grad:{name}", torch.zeros_like(p, dtype=step["out"].dtype))
    ok, worst, unjudged = tol.within_eager_bound(got, want, ref, dtype=torch.float32, always_judged=tuple(ref))
    assert ok and not unjudged, (worst, unjudged)

    other = SelectionBiasBlock(logits_bias=True)
    forward = other.forward
    assert [r[1] for r in swap_expert_loops(other)] == ["skip"]
    assert other.forward == forward and torch.equal(other.stats.correction, torch.zeros(1, E))
