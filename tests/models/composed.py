"""MoE layers composed from tables of dispatch forms: every way of permuting, counting, padding and
combining that the dispatch recogniser knows, in any combination (what the cross-product test compiles).

A :class:`Forms` picks one row of each table; :class:`ComposedMoE` runs

    route -> permute (PERMUTES) -> counts (COUNTS, on the device or read to the host)
          -> padding (PADDINGS) -> SwiGLU experts by grouped GEMMs -> unpad
          -> combine (COMBINES) with the routing weight applied where WEIGHTS says.

Shapes: ``T`` tokens, ``H`` hidden, ``E`` experts, ``K`` top-k, ``S = T*K`` routed rows, ``M`` padded rows.
Add a row to a table here and the cross-product test covers it against every other form.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe_compile.ops import static_row_bound

# ---- permutation: (ids_S) -> (ids_sorted_S, perm_S) -----------------------------------------------
PERMUTES: dict[str, Callable[[Tensor], tuple[Tensor, Tensor]] | None] = {
    "sort": lambda ids: torch.sort(ids),
    "sort_stable": lambda ids: torch.sort(ids, stable=True),
    "argsort_stable": lambda ids: (lambda p: (ids[p], p))(torch.argsort(ids, stable=True)),
    # Megatron's unfused permute: tokens of each expert by masked_select over the [E, T] routing map
    # (data-dependent length: host-sized layers only, accumulate combines only; see ComposedMoE)
    "masked_select": None,
}

# ---- counts per expert: (ids_S, ids_sorted_S, E) -> counts_E ---------------------------------------
COUNTS: dict[str, Callable[[Tensor, Tensor, int], Tensor]] = {
    "histc": lambda ids, srt, E: torch.histc(ids.float(), bins=E, min=0, max=E - 1),
    "histc_sorted": lambda ids, srt, E: torch.histc(srt.float(), bins=E, min=0, max=E - 1),
    "one_hot_sum": lambda ids, srt, E: F.one_hot(ids, E).sum(0),
    "eq_arange_sum": lambda ids, srt, E: (ids.unsqueeze(1) == torch.arange(E, device=ids.device)).sum(0),
}
COUNT_PLACES = ("device", "host")  # host: counts.long().tolist(), sizes as Python ints

# ---- padding of each expert's rows to a multiple of ``align`` ----------------------------------------
PADDINGS = (
    "none",
    "device_static",  # zeros[M, H][dest] = rows (static bound M), Y[dest] back
    "host_pad",  # split by host sizes, F.pad each chunk, cat; unpad by split + narrow + cat
    "host_cat",  # split, cat([chunk, zeros]), cat; unpad by split + slice + cat
)

# ---- combine of the sorted expert rows into [T, H] --------------------------------------------------
COMBINES = ("index_add", "scatter_add", "index_put_acc", "inverse_gather_sum", "scatter_unpermute_sum",
            "argsort_gather_sum")
SUM_COMBINES = ("inverse_gather_sum", "scatter_unpermute_sum", "argsort_gather_sum")
# where the routing weight multiplies: the sorted expert outputs in fp32 / in the activation dtype, the
# sorted rows before the experts, or (sum combines only) the un-permuted [T, K, H] view
WEIGHTS = ("rows_fp32", "rows_act", "before_experts", "after_unpermute")


@dataclasses.dataclass(frozen=True)
class Forms:
    permute: str
    counts: str
    count_place: str
    padding: str
    combine: str
    weight: str

    def __str__(self) -> str:
        return "-".join(dataclasses.astuple(self))

    @property
    def host(self) -> bool:
        return self.count_place == "host"


def valid(f: Forms) -> bool:
    """Combinations that are one coherent layer: host padding needs host sizes, device padding device
    counts; the post-unpermute weight exists only for the sum combines."""
    if f.padding.startswith("host") and not f.host:
        return False
    if f.padding == "device_static" and f.host:
        return False
    if f.weight == "after_unpermute" and f.combine not in SUM_COMBINES:
        return False
    if f.permute == "masked_select":
        return f.host and f.combine not in SUM_COMBINES and f.counts != "histc_sorted"
    return True


def all_forms() -> Iterator[Forms]:
    for combo in itertools.product(PERMUTES, COUNTS, COUNT_PLACES, PADDINGS, COMBINES, WEIGHTS):
        f = Forms(*combo)
        if valid(f):
            yield f


class ComposedMoE(nn.Module):
    """Softmax top-k router + stacked SwiGLU experts, dispatched in the given :class:`Forms`."""

    def __init__(self, forms: Forms, hidden: int = 16, inter: int = 32, num_experts: int = 4, top_k: int = 2,
                 align: int = 8, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.forms, self.num_experts, self.top_k, self.align = forms, num_experts, top_k, align
        self.router = nn.Parameter((hidden**-0.5 * torch.randn(num_experts, hidden, generator=gen)).to(dtype))
        self.w13_EIH = nn.Parameter(
            (hidden**-0.5 * torch.randn(num_experts, 2 * inter, hidden, generator=gen)).to(dtype)
        )
        self.w2_EHI = nn.Parameter((inter**-0.5 * torch.randn(num_experts, hidden, inter, generator=gen)).to(dtype))

    def _experts(self, rows: Tensor, offs_E: Tensor) -> Tensor:
        h = torch._grouped_mm(rows, self.w13_EIH.transpose(-2, -1), offs=offs_E)
        gate, up = h.chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, self.w2_EHI.transpose(-2, -1), offs=offs_E)

    def forward(self, x_TH: Tensor) -> Tensor:
        f, E, K = self.forms, self.num_experts, self.top_k
        T, H = x_TH.shape
        probs_TK, idx_TK = torch.topk(F.linear(x_TH, self.router).float().softmax(-1), K, dim=-1)
        probs_TK = probs_TK / probs_TK.sum(-1, keepdim=True)
        ids_S = idx_TK.reshape(-1)
        if f.permute == "masked_select":
            map_ET = torch.zeros(T, E, dtype=torch.bool, device=x_TH.device).scatter(1, idx_TK, True).T.contiguous()
            token_S = torch.arange(T, device=x_TH.device).unsqueeze(0).expand(E, -1).masked_select(map_ET)
            probs_TE = torch.zeros(T, E, dtype=probs_TK.dtype, device=x_TH.device).scatter(1, idx_TK, probs_TK)
            w_S = probs_TE.T.contiguous().masked_select(map_ET)
            rows_SH, ids_sorted_S, perm_S = x_TH.index_select(0, token_S), None, None
        else:
            ids_sorted_S, perm_S = PERMUTES[f.permute](ids_S)
            token_S = perm_S // K
            w_S = probs_TK.reshape(-1)[perm_S]
            rows_SH = x_TH[token_S]
        if f.weight == "before_experts":
            rows_SH = rows_SH * w_S.unsqueeze(-1).to(rows_SH.dtype)
        counts_E = COUNTS[f.counts](ids_S, ids_sorted_S, E)
        if f.padding == "device_static":
            ys_SH = self._device_padded(rows_SH, ids_sorted_S, counts_E.long(), T * K)
        elif f.host:
            ys_SH = self._host_sized(rows_SH, counts_E.long().tolist())
        else:
            ys_SH = self._experts(rows_SH, torch.cumsum(counts_E, 0, dtype=torch.int32))
        return self._combine(ys_SH, perm_S, token_S, w_S, probs_TK, T, H, x_TH.dtype)

    def _device_padded(self, rows_SH: Tensor, ids_sorted_S: Tensor, counts_E: Tensor, S: int) -> Tensor:
        a = self.align
        M = static_row_bound(S, self.num_experts, a)
        padded_E = (counts_E + a - 1) // a * a
        pad_end_E = torch.cumsum(padded_E, 0)
        start_E = torch.cumsum(counts_E, 0) - counts_E
        dest_S = (pad_end_E - padded_E)[ids_sorted_S] + torch.arange(S, device=rows_SH.device) - start_E[ids_sorted_S]
        rows_MH = rows_SH.new_zeros(M, rows_SH.shape[1])
        rows_MH[dest_S] = rows_SH
        return self._experts(rows_MH, pad_end_E.to(torch.int32))[dest_S]

    def _host_sized(self, rows_SH: Tensor, sizes: list[int]) -> Tensor:
        f, a = self.forms, self.align
        if f.padding == "none":
            offs_E = torch.tensor(sizes, device=rows_SH.device).cumsum(0).to(torch.int32)
            return self._experts(rows_SH, offs_E)
        padded = [(n + a - 1) // a * a for n in sizes]
        chunks = torch.split(rows_SH, sizes)
        if f.padding == "host_pad":
            rows_PH = torch.cat([F.pad(c, (0, 0, 0, p - n)) for c, n, p in zip(chunks, sizes, padded)])
        else:
            rows_PH = torch.cat(
                [torch.cat([c, c.new_zeros(p - n, c.shape[1])]) for c, n, p in zip(chunks, sizes, padded)]
            )
        offs_E = torch.tensor(list(itertools.accumulate(padded)), dtype=torch.int32, device=rows_SH.device)
        y_PH = self._experts(rows_PH, offs_E)
        pieces = torch.split(y_PH, padded)
        if f.padding == "host_pad":
            return torch.cat([y.narrow(0, 0, n) for y, n in zip(pieces, sizes)])
        return torch.cat([y[:n] for y, n in zip(pieces, sizes)])

    def _combine(self, ys_SH: Tensor, perm_S: Tensor | None, token_S: Tensor, w_S: Tensor, probs_TK: Tensor,
                 T: int, H: int, dtype: torch.dtype) -> Tensor:
        f, K = self.forms, self.top_k
        if f.weight == "rows_fp32":
            ys_SH = ys_SH.float() * w_S.unsqueeze(-1)
        elif f.weight == "rows_act":
            ys_SH = ys_SH * w_S.unsqueeze(-1).to(ys_SH.dtype)
        if f.combine in SUM_COMBINES:
            if f.combine == "scatter_unpermute_sum":
                y_SH = torch.empty_like(ys_SH)
                y_SH[perm_S] = ys_SH
            elif f.combine == "argsort_gather_sum":
                y_SH = ys_SH[torch.argsort(perm_S)]
            else:
                inv_S = torch.empty_like(perm_S)
                inv_S[perm_S] = torch.arange(perm_S.shape[0], device=perm_S.device)
                y_SH = ys_SH[inv_S]
            y_TKH = y_SH.view(T, K, H)
            if f.weight == "after_unpermute":
                y_TKH = y_TKH * probs_TK.unsqueeze(-1).to(y_TKH.dtype)
            return y_TKH.sum(1).to(dtype)
        out_TH = torch.zeros(T, H, dtype=ys_SH.dtype, device=ys_SH.device)
        if f.combine == "index_add":
            out_TH.index_add_(0, token_S, ys_SH)
        elif f.combine == "scatter_add":
            out_TH.scatter_add_(0, token_S.unsqueeze(1).expand(-1, H), ys_SH)
        else:
            out_TH.index_put_((token_S,), ys_SH, accumulate=True)
        return out_TH.to(dtype)
