"""Capacity-factor MoE layers, written as GShard / Switch / DeepSpeed-MoE write them: each expert takes at most
``C = ceil(capacity_factor * T * K / E)`` routed rows, slots given by a running count (first choices before second
choices), the rest dropped; dispatch and combine are einsums over one-hot ``[T, E, C]`` tensors, the experts a batched
MLP over ``[E, C, H]``.

``CapacityMoE(style=...)``:

* ``"gshard"``: ``top_k`` by ``topk``; per choice ``k`` a ``one_hot(ids[:, k], E)`` mask, positions ``cumsum - 1`` plus
  the earlier choices' counts, ``one_hot(pos, C) * keep.unsqueeze(-1)`` summed over the choices (dispatch), the same
  weighted by the gates (combine).
* ``"deepspeed"``: top-2 by ``argmax`` (the second over the logits with the first masked out), each token's slot
  ``(loc * mask).sum(1)``, ``combine = gates.unsqueeze(2) * one_hot(loc_s, C).unsqueeze(1)`` summed over the two
  choices, and the dispatch mask ``combine.bool()``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

STYLES = ("gshard", "deepspeed")


class CapacityMoE(nn.Module):
    def __init__(self, hidden: int = 16, inter: int = 32, num_experts: int = 4, top_k: int = 2,
                 capacity_factor: float = 1.0, style: str = "gshard", dtype: torch.dtype = torch.bfloat16,
                 seed: int = 0) -> None:
        super().__init__()
        if style not in STYLES:
            raise ValueError(f"style must be one of {STYLES}, got {style!r}")
        if style == "deepspeed" and top_k != 2:
            raise ValueError(f"the deepspeed style routes top-2, got top_k={top_k}")
        gen = torch.Generator().manual_seed(seed)
        self.num_experts, self.top_k, self.capacity_factor, self.style = num_experts, top_k, capacity_factor, style
        self.router = nn.Parameter(torch.randn(num_experts, hidden, generator=gen) * hidden ** -0.5)
        self.w1 = nn.Parameter(torch.randn(num_experts, hidden, inter, generator=gen) * hidden ** -0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, inter, hidden, generator=gen) * inter ** -0.5)
        self.to(dtype)

    def capacity(self, tokens: int) -> int:
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)

    def experts(self, x_ECH: torch.Tensor) -> torch.Tensor:
        h = F.gelu(torch.einsum("ech,ehi->eci", x_ECH, self.w1))
        return torch.einsum("eci,eih->ech", h, self.w2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x_TH = x.reshape(-1, shape[-1])
        logits_TE = F.linear(x_TH, self.router).float()
        route = self._gshard if self.style == "gshard" else self._deepspeed
        dispatch_TEC, combine_TEC = route(logits_TE, self.capacity(x_TH.shape[0]))
        x_ECH = torch.einsum("tec,th->ech", dispatch_TEC.to(x_TH.dtype), x_TH)
        y_ECH = self.experts(x_ECH)
        out_TH = torch.einsum("tec,ech->th", combine_TEC.to(y_ECH.dtype), y_ECH)
        return out_TH.reshape(shape)

    def _gshard(self, logits_TE: torch.Tensor, C: int) -> tuple[torch.Tensor, torch.Tensor]:
        E = self.num_experts
        gates_TK, ids_TK = logits_TE.softmax(-1).topk(self.top_k, dim=-1)
        gates_TK = gates_TK / gates_TK.sum(-1, keepdim=True)
        taken_E = torch.zeros(1, E, dtype=torch.long, device=logits_TE.device)
        dispatch = combine = None
        for k in range(self.top_k):
            mask_TE = F.one_hot(ids_TK[:, k], E)
            pos_TE = torch.cumsum(mask_TE, dim=0) - 1 + taken_E
            taken_E = taken_E + mask_TE.sum(0, keepdim=True)
            keep_TE = mask_TE * (pos_TE < C)
            d_TEC = F.one_hot(pos_TE.clamp(0, C - 1), C) * keep_TE.unsqueeze(-1)
            c_TEC = d_TEC * gates_TK[:, k].reshape(-1, 1, 1)
            dispatch = d_TEC if dispatch is None else dispatch + d_TEC
            combine = c_TEC if combine is None else combine + c_TEC
        return dispatch, combine

    def _deepspeed(self, logits_TE: torch.Tensor, C: int) -> tuple[torch.Tensor, torch.Tensor]:
        E = self.num_experts
        gates_TE = logits_TE.softmax(-1)
        ids1_T = gates_TE.argmax(dim=1)
        mask1_TE = F.one_hot(ids1_T, E)
        ids2_T = logits_TE.masked_fill(mask1_TE.bool(), float("-inf")).argmax(dim=1)
        mask2_TE = F.one_hot(ids2_T, E)
        loc1_TE = torch.cumsum(mask1_TE, dim=0) - 1
        loc2_TE = torch.cumsum(mask2_TE, dim=0) - 1 + mask1_TE.sum(dim=0, keepdim=True)
        mask1_TE = mask1_TE * torch.lt(loc1_TE, C)
        mask2_TE = mask2_TE * torch.lt(loc2_TE, C)
        loc1_T = torch.sum(loc1_TE * mask1_TE, dim=1)
        loc2_T = torch.sum(loc2_TE * mask2_TE, dim=1)
        g1_T = (gates_TE * mask1_TE).sum(dim=1)
        g2_T = (gates_TE * mask2_TE).sum(dim=1)
        denom_T = (g1_T + g2_T).clamp(min=torch.finfo(g1_T.dtype).eps)
        g1_TE = (g1_T / denom_T).unsqueeze(-1) * mask1_TE
        g2_TE = (g2_T / denom_T).unsqueeze(-1) * mask2_TE
        combine = g1_TE.unsqueeze(2) * F.one_hot(loc1_T, C).unsqueeze(1) \
            + g2_TE.unsqueeze(2) * F.one_hot(loc2_T, C).unsqueeze(1)
        return combine.bool(), combine


class DroplessSortMoE(CapacityMoE):
    """The same router and experts as :class:`CapacityMoE` (GShard gates: softmax, top-k, renormalised), dispatched
    without capacity: choices sorted by expert, ``index_select`` of the rows, the experts as grouped GEMMs over the
    sorted rows (``torch._grouped_mm``), ``scatter_add_`` back. What the capacity layer computes when nothing is
    dropped, on the sort path (the benchmark's comparison)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**{**kwargs, "style": "gshard"})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x_TH = x.reshape(-1, shape[-1])
        logits_TE = F.linear(x_TH, self.router).float()
        gates_TK, ids_TK = logits_TE.softmax(-1).topk(self.top_k, dim=-1)
        gates_TK = gates_TK / gates_TK.sum(-1, keepdim=True)
        ids_S = ids_TK.reshape(-1)
        _, perm_S = torch.sort(ids_S, stable=True)
        token_S = perm_S // self.top_k
        rows_SH = x_TH.index_select(0, token_S)
        offs_E = torch.cumsum(torch.bincount(ids_S, minlength=self.num_experts), 0).to(torch.int32)
        h_SI = F.gelu(torch._grouped_mm(rows_SH, self.w1, offs=offs_E))
        y_SH = torch._grouped_mm(h_SI, self.w2, offs=offs_E)
        y_SH = y_SH * gates_TK.reshape(-1)[perm_S].unsqueeze(-1).to(y_SH.dtype)
        out_TH = torch.zeros_like(x_TH).scatter_add_(0, token_S.unsqueeze(-1).expand(-1, shape[-1]), y_SH)
        return out_TH.reshape(shape)


class MegatronDropAndPadMoE(CapacityMoE):
    """Megatron-LM's drop-and-pad mode (``moe_expert_capacity_factor`` with ``moe_pad_expert_input_to_capacity``),
    written as its router and ``moe_utils.permute`` / ``unpermute`` write it: top-k gates scattered into ``[T, E]``,
    each expert keeps its ``C`` tokens of largest gate (``topk`` over tokens, the ``"probs"`` drop policy; with fewer
    routed tokens it is padded with unrouted tokens of gate 0), the routing map turned ``[E, T]`` and
    ``argsort(descending=True, stable=True)[:, :C]`` giving each expert's ``C`` tokens in token order, the rows
    gathered by ``index_select``, the experts batched over ``[E, C, H]``, weighted by the gates gathered through
    flat ``[E*T]`` indices, and ``scatter_add_`` into a zero ``[T, H]`` buffer (in fp32: bf16 rows times fp32 gates)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**{**kwargs, "style": "gshard"})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x_TH = x.reshape(-1, shape[-1])
        T, H, E = x_TH.shape[0], x_TH.shape[1], self.num_experts
        C = self.capacity(T)
        logits_TE = F.linear(x_TH, self.router).float()
        gates_TK, ids_TK = logits_TE.softmax(-1).topk(self.top_k, dim=-1)
        gates_TK = gates_TK / gates_TK.sum(-1, keepdim=True)
        masked_gates_TE = torch.zeros_like(logits_TE).scatter(1, ids_TK, gates_TK)
        _, capacity_idx = torch.topk(masked_gates_TE, k=C, dim=0, sorted=False)
        routing_map_TE = torch.zeros_like(logits_TE).scatter(0, capacity_idx, 1).bool()
        probs_TE = masked_gates_TE * routing_map_TE
        # permute(..., drop_and_pad=True)
        map_ET = routing_map_TE.to(torch.int8).T.contiguous()
        sorted_indices = map_ET.argsort(dim=-1, descending=True, stable=True)[:, :C].contiguous().view(-1)
        probs_flat = probs_TE.T.contiguous().view(-1)
        indices_flat = (torch.arange(E, device=x.device).unsqueeze(-1) * T + sorted_indices.view(E, C)).view(-1)
        permuted_probs = probs_flat.index_select(0, indices_flat)
        rows = x_TH.index_select(0, sorted_indices)
        y = self.experts(rows.view(E, C, H)).view(E * C, H)
        # unpermute(..., drop_and_pad=True)
        y = y * permuted_probs.unsqueeze(-1)
        out = torch.zeros(T, H, dtype=y.dtype, device=x.device)
        out.scatter_add_(0, sorted_indices.unsqueeze(1).expand(-1, H), y)
        return out.to(x.dtype).reshape(shape)
