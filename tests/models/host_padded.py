"""Tiny MoE layers that size their expert padding on the host (what ``strip_host_padding`` and
``fuse_expert_loop`` rewrite).

Shape suffixes: ``T`` tokens, ``H`` hidden, ``E`` experts, ``K`` top-k, ``N = T*K`` routed rows,
``I`` expert intermediate size, ``P`` padded rows (host-sized).

* :class:`SplitPadGroupedMoE` (layer 1): argsort permute, ``counts.tolist()``, ``torch.split`` by the
  counts, ``F.pad`` of every chunk to a multiple of ``align``, ``cat``, offsets from
  ``torch.tensor(host sizes)``, two grouped GEMMs, unpad by ``split`` + ``narrow`` + ``cat``,
  ``index_add_`` combine (torchao / legacy torchtitan style).
* :class:`MaskedSelectMoE` (layer 2): permute by ``masked_select`` over the ``[E, T]`` routing map,
  padding by ``cat`` with zeros, unpad by slicing, ``scatter_add_`` combine (Megatron's unfused path).
* :class:`ExpertLoopMoE` (layer 3): a Python loop over ``torch.split`` chunks, each through its own
  expert MLP (``ModuleList`` of ``nn.Linear``, or slices ``w1[e]`` of stacked weights).
* :class:`SortHistcPadMoE` (layer 4): ``sort``, ``histc(...).long().tolist()`` counts, split + ``F.pad`` +
  cat, three grouped GEMMs, split + slice unpad, un-permute by ``y[order] = ys`` (or ``ys[argsort(order)]``)
  and a weighted sum over the top-k view.
* :class:`PrePaddedMoE`: routing already aligned by ``moe_compile.ops.permute_pad``; the model still
  pads on the host (a no-op), which the pass must not pad again.

Every layer is ``forward(x_TH) -> y_TH``; weights are parameters so that training tests get grads.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn


def grouped_mm(x_MK: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` for bf16, ``torch.ops.moe.grouped_mm`` (if built) for other dtypes."""
    if x_MK.dtype != torch.bfloat16 and hasattr(torch.ops.moe, "grouped_mm"):
        return torch.ops.moe.grouped_mm(x_MK, w_EKN, offs_E)
    return torch._grouped_mm(x_MK, w_EKN, offs=offs_E)


class _RoutedExperts(nn.Module):
    """Router (softmax -> top-k -> renormalise) plus stacked SwiGLU expert weights."""

    def __init__(
        self, hidden: int, inter: int, num_experts: int, top_k: int, align: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.align = num_experts, top_k, align
        self.router = nn.Linear(hidden, num_experts, bias=False, dtype=dtype)
        scale_in, scale_out = hidden**-0.5, inter**-0.5
        self.w13_EIH = nn.Parameter(torch.randn(num_experts, 2 * inter, hidden, dtype=dtype) * scale_in)
        self.w2_EHI = nn.Parameter(torch.randn(num_experts, hidden, inter, dtype=dtype) * scale_out)

    def route(self, x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs_TE = self.router(x_TH).float().softmax(dim=-1)
        probs_TK, idx_TK = torch.topk(probs_TE, self.top_k, dim=-1)
        return probs_TK / probs_TK.sum(dim=-1, keepdim=True), idx_TK

    def expert_mlp(self, x_PH: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
        gate_up_PI = grouped_mm(x_PH, self.w13_EIH.transpose(-2, -1), offs_E)
        gate_PI, up_PI = gate_up_PI.chunk(2, dim=-1)
        return grouped_mm(F.silu(gate_PI) * up_PI, self.w2_EHI.transpose(-2, -1), offs_E)


class SplitPadGroupedMoE(_RoutedExperts):
    """Layer 1: host split + ``F.pad`` + cat, grouped GEMMs, split/narrow/cat unpad, ``index_add_``.

    ``variant`` breaks one step so that a pass must not fire (the layer still runs in eager):
    ``"descending"`` sort, ``"bad_pad"`` (pads to ``n + 1`` rows), ``"unpermuted_probs"`` (the combine
    weight is not permuted with the rows), ``"row_mixing"`` (a ``cumsum`` over rows between the GEMMs),
    ``"wrong_counts"`` (split sizes counted from other ids), ``"escape"`` (the padded rows are also
    used outside the expert region); ``"shared_scale"`` multiplies the padded expert output by a trained
    per-channel scale shared by all rows (rewritten in inference, refused in training).
    """

    VARIANTS = ("", "descending", "bad_pad", "unpermuted_probs", "row_mixing", "wrong_counts", "escape", "shared_scale")

    def __init__(self, *args, variant: str = "", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if variant not in self.VARIANTS:
            raise ValueError(f"variant must be one of {self.VARIANTS}, got {variant!r}")
        self.variant = variant
        if variant == "shared_scale":
            self.out_scale_H = nn.Parameter(torch.ones(self.w2_EHI.shape[1], dtype=self.w2_EHI.dtype))

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        E, K, a, variant = self.num_experts, self.top_k, self.align, self.variant
        probs_TK, idx_TK = self.route(x_TH)
        order_N = torch.argsort(idx_TK.reshape(-1), stable=True, descending=variant == "descending")
        token_N = order_N // K
        x_NH = x_TH[token_N]
        count_ids_TK = idx_TK.flip(0) if variant == "wrong_counts" else idx_TK
        counts_E = F.one_hot(count_ids_TK.reshape(-1), E).sum(dim=0)
        sizes = counts_E.tolist()
        padded = [n + 1 if variant == "bad_pad" else (n + a - 1) // a * a for n in sizes]
        chunks = torch.split(x_NH, sizes)
        x_PH = torch.cat([F.pad(c, (0, 0, 0, p - n)) for c, n, p in zip(chunks, sizes, padded)])
        offs_E = torch.tensor(list(itertools.accumulate(padded)), dtype=torch.int32, device=x_TH.device)
        y_PH = self.expert_mlp(x_PH, offs_E)
        if variant == "row_mixing":
            y_PH = y_PH.cumsum(dim=0)
        if variant == "shared_scale":
            y_PH = y_PH * self.out_scale_H
        y_NH = torch.cat([y.narrow(0, 0, n) for y, n in zip(torch.split(y_PH, padded), sizes)])
        probs_N = probs_TK.reshape(-1) if variant == "unpermuted_probs" else probs_TK.reshape(-1)[order_N]
        y_NH = (y_NH * probs_N.unsqueeze(-1)).to(x_TH.dtype)
        out_TH = torch.zeros_like(x_TH).index_add_(0, token_N, y_NH)
        if variant == "escape":
            out_TH = out_TH + x_PH.float().mean().to(x_TH.dtype)
        return out_TH


class MaskedSelectMoE(_RoutedExperts):
    """Layer 2: ``masked_select`` permute, cat-with-zeros pad, slicing unpad, ``scatter_add_``."""

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        T, H = x_TH.shape
        E, a = self.num_experts, self.align
        probs_TK, idx_TK = self.route(x_TH)
        routing_map_TE = torch.zeros(T, E, dtype=torch.bool, device=x_TH.device).scatter(1, idx_TK, True)
        probs_TE = torch.zeros(T, E, dtype=probs_TK.dtype, device=x_TH.device).scatter(1, idx_TK, probs_TK)
        routing_map_ET = routing_map_TE.T.contiguous()
        token_ET = torch.arange(T, device=x_TH.device).unsqueeze(0).expand(E, -1)
        token_N = token_ET.masked_select(routing_map_ET)
        x_NH = x_TH.index_select(0, token_N)
        probs_N = probs_TE.T.contiguous().masked_select(routing_map_ET)
        sizes = routing_map_TE.sum(dim=0).tolist()
        padded = [-(-n // a) * a for n in sizes]
        x_PH = torch.cat(
            [torch.cat([c, c.new_zeros(p - n, H)]) for c, n, p in zip(torch.split(x_NH, sizes), sizes, padded)]
        )
        offs_E = torch.tensor(padded, device=x_TH.device).cumsum(0).to(torch.int32)
        y_PH = self.expert_mlp(x_PH, offs_E)
        y_NH = torch.cat([y[:n] for y, n in zip(torch.split(y_PH, padded), sizes)])
        y_NH = (y_NH * probs_N.unsqueeze(-1)).to(x_TH.dtype)
        index_NH = token_N.unsqueeze(1).expand(-1, H)
        return torch.zeros_like(x_TH).scatter_add_(0, index_NH, y_NH)


class SortHistcPadMoE(_RoutedExperts):
    """Layer 4: ``sort``; counts by ``histc(...).long().tolist()``; ``torch.split`` + ``F.pad`` to a
    multiple of ``align`` + ``cat``; offsets from ``torch.tensor(sizes).cumsum(0)``; three grouped GEMMs
    (separate gate and up weights); unpad by split + slice + ``cat``; then un-permute and weight per
    token after the experts.

    ``combine="scatter"``: ``y = empty_like(ys); y[order] = ys``; ``"gather"``: ``y = ys[argsort(order)]``;
    both then ``(y.view(T, K, H) * w.unsqueeze(-1)).sum(1)``.
    """

    def __init__(self, *args, combine: str = "scatter", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if combine not in ("scatter", "gather"):
            raise ValueError(f"combine must be 'scatter' or 'gather', got {combine!r}")
        self.combine = combine
        inter = self.w2_EHI.shape[2]
        self.w1_EIH = nn.Parameter(self.w13_EIH.detach()[:, :inter].clone())
        self.w3_EIH = nn.Parameter(self.w13_EIH.detach()[:, inter:].clone())
        del self.w13_EIH

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        T, H = x_TH.shape
        E, K, a = self.num_experts, self.top_k, self.align
        probs_TK, idx_TK = self.route(x_TH)
        ids_sorted_N, order_N = torch.sort(idx_TK.reshape(-1))
        x_NH = x_TH[order_N // K]
        sizes = torch.histc(ids_sorted_N.float(), bins=E, min=0, max=E - 1).long().tolist()
        padded = [(n + a - 1) // a * a for n in sizes]
        x_PH = torch.cat([F.pad(c, (0, 0, 0, p - n)) for c, n, p in zip(torch.split(x_NH, sizes), sizes, padded)])
        offs_E = torch.tensor(padded, device=x_TH.device).cumsum(0).to(torch.int32)
        gate_PI = grouped_mm(x_PH, self.w1_EIH.transpose(-2, -1), offs_E)
        up_PI = grouped_mm(x_PH, self.w3_EIH.transpose(-2, -1), offs_E)
        y_PH = grouped_mm(F.silu(gate_PI) * up_PI, self.w2_EHI.transpose(-2, -1), offs_E)
        y_NH = torch.cat([c[:n] for c, n in zip(torch.split(y_PH, padded), sizes)])
        if self.combine == "scatter":
            y_unsorted_NH = torch.empty_like(y_NH)
            y_unsorted_NH[order_N] = y_NH
        else:
            y_unsorted_NH = y_NH[torch.argsort(order_N)]
        return (y_unsorted_NH.view(T, K, H) * probs_TK.unsqueeze(-1).to(y_NH.dtype)).sum(1)


class SwiGLUExpert(nn.Module):
    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, act: str = "silu", bias: bool = False) -> None:
        super().__init__()
        self.act = F.silu if act == "silu" else F.gelu
        self.gate = nn.Linear(hidden, inter, bias=bias, dtype=dtype)
        self.up = nn.Linear(hidden, inter, bias=bias, dtype=dtype)
        self.down = nn.Linear(inter, hidden, bias=bias, dtype=dtype)

    def forward(self, x_NH: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate(x_NH)) * self.up(x_NH))


class ExpertLoopMoE(_RoutedExperts):
    """Layer 3: a Python loop over ``torch.split`` chunks through per-expert MLPs.

    ``stacked=False``: a ``ModuleList`` of :class:`SwiGLUExpert`; ``stacked=True``: slices ``w13[e]``,
    ``w2[e]`` of the stacked weights. ``permute="masked_select"`` permutes as Megatron's unfused path
    (unbacked row count). ``variant``: ``"mixed_act"`` (expert 1 uses GELU: experts differ) or
    ``"bias"`` (per-expert biases): the loop must not be fused.
    """

    def __init__(self, *args, stacked: bool = False, permute: str = "argsort", variant: str = "", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stacked, self.permute = stacked, permute
        hidden, inter = self.w2_EHI.shape[1], self.w2_EHI.shape[2]
        if not stacked:
            self.experts = nn.ModuleList(
                SwiGLUExpert(
                    hidden,
                    inter,
                    self.w2_EHI.dtype,
                    act="gelu" if variant == "mixed_act" and e == 1 else "silu",
                    bias=variant == "bias",
                )
                for e in range(self.num_experts)
            )

    def _expert(self, e: int, x_nH: torch.Tensor) -> torch.Tensor:
        if not self.stacked:
            return self.experts[e](x_nH)
        gate_nI, up_nI = (x_nH @ self.w13_EIH[e].T).chunk(2, dim=-1)
        return (F.silu(gate_nI) * up_nI) @ self.w2_EHI[e].T

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        T, H = x_TH.shape
        E, K = self.num_experts, self.top_k
        probs_TK, idx_TK = self.route(x_TH)
        if self.permute == "masked_select":
            routing_map_TE = torch.zeros(T, E, dtype=torch.bool, device=x_TH.device).scatter(1, idx_TK, True)
            probs_TE = torch.zeros(T, E, dtype=probs_TK.dtype, device=x_TH.device).scatter(1, idx_TK, probs_TK)
            routing_map_ET = routing_map_TE.T.contiguous()
            token_N = torch.arange(T, device=x_TH.device).unsqueeze(0).expand(E, -1).masked_select(routing_map_ET)
            x_NH = x_TH.index_select(0, token_N)
            probs_N = probs_TE.T.contiguous().masked_select(routing_map_ET)
            counts_E = routing_map_TE.sum(dim=0)
        else:
            flat_idx_N = idx_TK.reshape(-1)
            order_N = torch.argsort(flat_idx_N, stable=True)
            token_N = order_N // K
            x_NH = x_TH[token_N]
            probs_N = probs_TK.reshape(-1)[order_N]
            counts_E = (flat_idx_N.unsqueeze(1) == torch.arange(E, device=x_TH.device)).sum(dim=0)
        sizes = counts_E.tolist()
        y_NH = torch.cat([self._expert(e, c) for e, c in enumerate(torch.split(x_NH, sizes))])
        y_NH = (y_NH * probs_N.unsqueeze(-1)).to(x_TH.dtype)
        if self.permute == "masked_select":
            return torch.zeros_like(x_TH).scatter_add_(0, token_N.unsqueeze(1).expand(-1, H), y_NH)
        return torch.zeros_like(x_TH).index_add_(0, token_N, y_NH)


class PrePaddedMoE(_RoutedExperts):
    """Routing already aligned by ``moe_compile.ops.permute_pad``; the host pad that follows is a no-op.

    ``ceil_div=True`` derives the host sizes from ``ceil_div(counts, a) * a`` on the device instead of
    from the op's offsets.
    """

    def __init__(self, *args, ceil_div: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.ceil_div = ceil_div

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        from moe_compile.ops import permute_pad, unpad_unpermute

        E, a = self.num_experts, self.align
        probs_TK, idx_TK = self.route(x_TH)
        out = permute_pad(x_TH, idx_TK, probs_TK=None, num_experts=E, align=a)
        if self.ceil_div:
            padded_E = (out.counts_E + (a - 1)) // a * a
        else:
            padded_E = torch.diff(out.offs_E, prepend=out.offs_E.new_zeros(1))
        padded = padded_E.tolist()
        used = sum(padded)
        rows_PH = out.rows_MH[:used]
        # what an FP8 padding helper does on top (pads every group to a multiple of a again)
        x_PH = torch.cat([F.pad(c, (0, 0, 0, (-n) % a)) for c, n in zip(torch.split(rows_PH, padded), padded)])
        offs_E = torch.tensor(list(itertools.accumulate(padded)), dtype=torch.int32, device=x_TH.device)
        y_PH = self.expert_mlp(x_PH, offs_E)
        y_MH = F.pad(y_PH, (0, 0, 0, out.rows_MH.shape[0] - used))
        return unpad_unpermute(y_MH, out.row_map, probs_TK)


LAYERS = {
    "split_pad": SplitPadGroupedMoE,
    "sort_histc_pad": SortHistcPadMoE,
    "masked_select": MaskedSelectMoE,
    "loop": ExpertLoopMoE,
}


def make_layer(
    kind: str,
    hidden: int = 16,
    inter: int = 32,
    num_experts: int = 4,
    top_k: int = 2,
    align: int = 8,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    seed: int = 0,
    **kwargs,
) -> nn.Module:
    """One of :data:`LAYERS` (or ``"loop_stacked"``, ``"pre_padded"``, ``"pre_padded_ceil"``) with seeded weights."""
    torch.manual_seed(seed)
    if kind == "loop_stacked":
        cls, kwargs = ExpertLoopMoE, {**kwargs, "stacked": True}
    elif kind in ("pre_padded", "pre_padded_ceil"):
        cls, kwargs = PrePaddedMoE, {**kwargs, "ceil_div": kind == "pre_padded_ceil"}
    else:
        cls = LAYERS[kind]
    return cls(hidden, inter, num_experts, top_k, align, dtype, **kwargs).to(device)
