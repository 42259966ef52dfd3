"""Hand-written MoE layers in the dispatch styles ``fuse_dispatch`` must (and must not) rewrite.

All layers share one router (linear -> softmax in fp32 -> top-k -> renormalise) and SwiGLU experts
``w_gate_up[E, 2I, H]``, ``w_down[E, H, I]`` run with ``torch._grouped_mm`` (bf16 under compile on CPU).
``forward(x_TH) -> [T, H]``. Shapes: ``T`` tokens, ``H`` hidden, ``E`` experts, ``K`` top-k, ``S = T*K``.

=============================  ==================================================================
class                          dispatch style
=============================  ==================================================================
``SortIndexSelectScatterAdd``  stable ``sort`` + ``index_select`` + ``one_hot.sum`` counts,
                               weight after the MLP in the activation dtype, ``scatter_add_``
``ArgsortGatherIndexAdd``      ``argsort`` + ``gather`` + ``(ids == arange(E)).sum`` counts,
                               weight after the MLP in fp32, fp32 ``index_add_``
``WeightBetweenGemms``         unstable ``sort`` + ``x[perm // K]`` + ``histc``, weight applied
                               between the two GEMMs, ``index_put_(accumulate=True)``
``UnpermuteScatterWeightedSum``  ``y[perm] = ys`` un-permute, weight after it, sum over the top-k view
``UnpermuteGatherWeightedSum``   ``ys[argsort(perm)]`` un-permute, same weighted sum
``PaddedIndexPut``             FP8-style device padding to ``align`` rows per expert with a static
                               bound: padded destinations, ``index_put`` into zeros, ``Y[dest]``
``PaddedSentinelRow``          same padding via a ``full(M, T)`` index buffer and a zero sentinel row
``WeightsBeforeGather``        must NOT fire: rows are weighted before the gather
``RowMixingRegion``            must NOT fire: an op between the GEMMs mixes rows (mean over rows)
=============================  ==================================================================
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_compile.ops import static_row_bound


class _MoEBase(nn.Module):
    def __init__(self, hidden: int = 32, inter: int = 16, experts: int = 8, top_k: int = 2, seed: int = 0,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.num_experts, self.top_k = experts, top_k
        self.router = nn.Parameter((0.3 * torch.randn(experts, hidden, generator=gen)).to(dtype))
        self.w_gate_up = nn.Parameter((0.2 * torch.randn(experts, 2 * inter, hidden, generator=gen)).to(dtype))
        self.w_down = nn.Parameter((0.2 * torch.randn(experts, hidden, inter, generator=gen)).to(dtype))

    def route(self, x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.softmax(F.linear(x_TH, self.router).float(), dim=-1)
        weights_TK, ids_TK = torch.topk(probs, self.top_k, dim=-1)
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        return weights_TK, ids_TK

    def mlp(self, rows: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        h = torch._grouped_mm(rows, self.w_gate_up.transpose(-2, -1), offs=offs)
        gate, up = h.chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, self.w_down.transpose(-2, -1), offs=offs)


class SortIndexSelectScatterAdd(_MoEBase):
    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        weights_TK, ids_TK = self.route(x_TH)
        ids_S = ids_TK.view(-1)
        _, perm_S = torch.sort(ids_S, stable=True)
        token_S = perm_S // self.top_k
        rows = x_TH.index_select(0, token_S)
        counts_E = F.one_hot(ids_S, self.num_experts).sum(0)
        offs_E = torch.cumsum(counts_E, 0).to(torch.int32)
        y = self.mlp(rows, offs_E)
        y = y * weights_TK.view(-1)[perm_S].unsqueeze(-1).to(y.dtype)
        out = torch.zeros_like(x_TH)
        out.scatter_add_(0, token_S.unsqueeze(-1).expand(-1, x_TH.shape[-1]), y)
        return out


class ArgsortGatherIndexAdd(_MoEBase):
    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        weights_TK, ids_TK = self.route(x_TH)
        ids_S = ids_TK.reshape(-1)
        perm_S = torch.argsort(ids_S, stable=True)
        rows = torch.gather(x_TH, 0, (perm_S // self.top_k).unsqueeze(-1).expand(-1, x_TH.shape[1]))
        experts_E = torch.arange(self.num_experts, device=x_TH.device)
        counts_E = (ids_S.unsqueeze(-1) == experts_E).sum(0)
        offs_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
        y = self.mlp(rows, offs_E).float() * torch.gather(weights_TK.reshape(-1), 0, perm_S).unsqueeze(-1)
        out = torch.zeros(x_TH.shape[0], x_TH.shape[1], dtype=torch.float32, device=x_TH.device)
        out.index_add_(0, perm_S // self.top_k, y)
        return out.to(x_TH.dtype)


class WeightBetweenGemms(_MoEBase):
    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        weights_TK, ids_TK = self.route(x_TH)
        ids_S = ids_TK.reshape(-1)
        ids_sorted, perm_S = torch.sort(ids_S)
        rows = x_TH[perm_S // self.top_k]
        counts_E = torch.histc(ids_sorted.float(), bins=self.num_experts, min=0, max=self.num_experts - 1)
        offs_E = torch.cumsum(counts_E, dim=0, dtype=torch.int32)
        h = torch._grouped_mm(rows, self.w_gate_up.transpose(-2, -1), offs=offs_E)
        gate, up = h.chunk(2, dim=-1)
        h = (F.silu(gate) * up) * weights_TK.reshape(-1)[perm_S].unsqueeze(-1).to(h.dtype)
        y = torch._grouped_mm(h, self.w_down.transpose(-2, -1), offs=offs_E)
        out = x_TH.new_zeros(x_TH.shape)
        out.index_put_((perm_S // self.top_k,), y, accumulate=True)
        return out


class UnpermuteScatterWeightedSum(_MoEBase):
    """Un-permute by ``y[perm] = ys`` (or ``ys[argsort(perm)]`` with ``gather=True``), then weight and sum the
    ``[T, K, H]`` view (the routing weight applied after un-permuting)."""

    def __init__(self, *args, gather: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gather = gather

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        T, H = x_TH.shape
        weights_TK, ids_TK = self.route(x_TH)
        ids_sorted, perm_S = torch.sort(ids_TK.reshape(-1))
        counts_E = torch.histc(ids_sorted.float(), bins=self.num_experts, min=0, max=self.num_experts - 1)
        ys = self.mlp(x_TH[perm_S // self.top_k], torch.cumsum(counts_E, 0, dtype=torch.int32))
        if self.gather:
            y = ys[torch.argsort(perm_S)]
        else:
            y = torch.empty_like(ys)
            y[perm_S] = ys
        return (y.view(T, self.top_k, H) * weights_TK.unsqueeze(-1).to(ys.dtype)).sum(1)


class UnpermuteGatherWeightedSum(UnpermuteScatterWeightedSum):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, gather=True, **kwargs)


class _Padded(_MoEBase):
    def __init__(self, *args, align: int = 16, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.align = align

    def padded_layout(self, ids_S: torch.Tensor, num_rows: int):
        """Sorted order, padded destination of each sorted row, and padded int32 offsets (all on device)."""
        ids_sorted, perm_S = torch.sort(ids_S, stable=True)
        counts_E = torch.histc(ids_S.float(), bins=self.num_experts, min=0, max=self.num_experts - 1).long()
        padded_E = (counts_E + self.align - 1) // self.align * self.align
        pad_end_E = torch.cumsum(padded_E, 0)
        pad_start_E = pad_end_E - padded_E
        start_E = torch.cumsum(counts_E, 0) - counts_E
        rank_S = torch.arange(num_rows, device=ids_S.device) - start_E[ids_sorted]
        dest_S = pad_start_E[ids_sorted] + rank_S
        return perm_S, dest_S, pad_end_E.to(torch.int32)


class PaddedIndexPut(_Padded):
    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        T, H = x_TH.shape
        S = T * self.top_k
        M = static_row_bound(S, self.num_experts, self.align)
        weights_TK, ids_TK = self.route(x_TH)
        perm_S, dest_S, offs_E = self.padded_layout(ids_TK.reshape(-1), S)
        token_S = perm_S // self.top_k
        rows_MH = x_TH.new_zeros(M, H)
        rows_MH[dest_S] = x_TH[token_S]
        y_MH = self.mlp(rows_MH, offs_E)
        y_S = y_MH[dest_S].float() * weights_TK.reshape(-1)[perm_S].unsqueeze(-1)
        out = torch.zeros(T, H, dtype=torch.float32, device=x_TH.device).index_add_(0, token_S, y_S)
        return out.to(x_TH.dtype)


class PaddedSentinelRow(_Padded):
    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        T, H = x_TH.shape
        S = T * self.top_k
        M = static_row_bound(S, self.num_experts, self.align)
        weights_TK, ids_TK = self.route(x_TH)
        perm_S, dest_S, offs_E = self.padded_layout(ids_TK.reshape(-1), S)
        source_M = torch.full((M,), T, dtype=torch.long, device=x_TH.device)
        source_M[dest_S] = perm_S // self.top_k
        x_ext = torch.cat([x_TH, x_TH.new_zeros(1, H)])
        y_MH = self.mlp(x_ext[source_M], offs_E)
        y_S = y_MH[dest_S] * weights_TK.reshape(-1)[perm_S].unsqueeze(-1).to(x_TH.dtype)
        out = torch.zeros_like(x_TH)
        out.index_add_(0, perm_S // self.top_k, y_S)
        return out


class WeightsBeforeGather(_MoEBase):
    """Must not fire: ``x * w`` is formed per (token, slot) before the permutation."""

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        T, H = x_TH.shape
        weights_TK, ids_TK = self.route(x_TH)
        ids_S = ids_TK.reshape(-1)
        ids_sorted, perm_S = torch.sort(ids_S)
        weighted_SH = (x_TH.unsqueeze(1) * weights_TK.unsqueeze(-1).to(x_TH.dtype)).reshape(-1, H)
        rows = weighted_SH[perm_S]
        counts_E = torch.histc(ids_sorted.float(), bins=self.num_experts, min=0, max=self.num_experts - 1)
        y = self.mlp(rows, torch.cumsum(counts_E, 0, dtype=torch.int32))
        out = torch.zeros_like(x_TH)
        out.index_add_(0, perm_S // self.top_k, y)
        return out


class RowMixingRegion(_MoEBase):
    """Must not fire: ``h - h.mean(0)`` between the GEMMs depends on every row."""

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        weights_TK, ids_TK = self.route(x_TH)
        ids_S = ids_TK.reshape(-1)
        ids_sorted, perm_S = torch.sort(ids_S)
        rows = x_TH[perm_S // self.top_k]
        counts_E = torch.histc(ids_sorted.float(), bins=self.num_experts, min=0, max=self.num_experts - 1)
        offs_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
        h = torch._grouped_mm(rows, self.w_gate_up.transpose(-2, -1), offs=offs_E)
        gate, up = h.chunk(2, dim=-1)
        h = F.silu(gate) * up
        h = h - h.mean(0, keepdim=True)
        y = torch._grouped_mm(h, self.w_down.transpose(-2, -1), offs=offs_E)
        y = y * weights_TK.reshape(-1)[perm_S].unsqueeze(-1).to(y.dtype)
        out = torch.zeros_like(x_TH)
        out.index_add_(0, perm_S // self.top_k, y)
        return out


REWRITTEN = (SortIndexSelectScatterAdd, ArgsortGatherIndexAdd, WeightBetweenGemms, PaddedIndexPut, PaddedSentinelRow,
             UnpermuteScatterWeightedSum, UnpermuteGatherWeightedSum)
NOT_REWRITTEN = {WeightsBeforeGather: "weights_before_gather", RowMixingRegion: "region_not_rowwise"}
