"""Ops of the static expert-parallel exchange (``moe_compile/passes/expert_parallel``): row gathers whose backward is
the inverse gather, and the device indices they use. No host reads, no atomics: forward and backward are
deterministic. Like the dispatch ops, each decomposes into its body when AOTAutograd traces it
(NOTE [device-decomposed triton ops] (moe_compile/ops/_common.py)): compiled, a gather is one fused pass of
Inductor's, not a custom-op call.

* ``moe.gather_rows(src [n, ...], index [m], inverse [n]) -> [m, ...]``: ``out[j] = src[index[j]]`` where
  ``0 <= index[j] < n``, else a zero row. Contract: the valid entries of ``index`` are distinct and ``inverse`` is
  their inverse (``inverse[index[j]] = j``; ``inverse[i]`` out of ``[0, m)`` for a row ``i`` no entry reads). The
  backward is then ``gather_rows(grad, inverse, index)``: each gradient row is read once, unread rows get zero.
* ``moe.ep_send_index(send_counts [W], num_rows N, capacity S) -> (pack [W*S], slot [N])``: rows ``[N, ...]``
  grouped by destination (``send_counts[w]`` rows for rank ``w``, in order) into a buffer of ``W`` blocks of ``S``
  rows; block ``w`` holds the first ``min(send_counts[w], S)`` rows of destination ``w``, then padding. ``pack`` is
  the buffer's gather index (sentinel ``N``), ``slot`` its inverse (sentinel ``W*S``: a dropped row).
* ``moe.ep_regroup_index(counts [W, L], capacity S) -> (regroup [W*S], inverse [W*S], offs [L] int32)``: the
  received buffer (block ``s`` from source rank ``s``: its rows for local experts ``0..L-1`` in order, ``counts[s]``
  of them, truncated to ``S``) in local-expert-major order: by local expert, then source rank, then row. Kept rows
  first, padding (sentinel ``W*S``) after ``offs[-1]``; ``offs`` the cumulative group ends for ``torch._grouped_mm``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from moe_compile.ops._common import dispatch_triton_op


def ep_capacity(bound: int, num_rows: int, world: int, factor: float | None) -> int:
    """``S``, the rows one rank sends one rank: ``factor=None`` the ``bound`` (no row dropped); a float ``f``
    ``ceil(f * num_rows / world)`` (a multiple of an even share), at least 1 and at most the bound."""
    if factor is None:
        return bound
    if not factor > 0:
        raise ValueError(f"ep_capacity_factor must be > 0 or None, got {factor!r}")
    return max(1, min(bound, math.ceil(factor * num_rows / world)))


def _gather_rows(src: Tensor, index: Tensor, inverse: Tensor) -> Tensor:
    """``src[index]`` with a zero row wherever ``index`` is out of ``[0, len(src))`` (module docstring)."""
    torch._check(inverse.shape[0] == src.shape[0], lambda: "gather_rows: inverse must have one entry per src row")
    n = src.shape[0]
    index = index.long()
    if n == 0:
        return src.new_zeros((index.shape[0], *src.shape[1:]))
    valid = ((index >= 0) & (index < n)).view(-1, *[1] * (src.dim() - 1))
    # a clamped read and a select, not a zero row concatenated to src (a copy of all of src): compiled, the two
    # are one pass over the output rows (NOTE [device-decomposed triton ops] (moe_compile/ops/_common.py))
    return torch.where(valid, src.index_select(0, index.clamp(0, n - 1)), src.new_zeros(()))


def _gather_rows_fake(src: Tensor, index: Tensor, inverse: Tensor) -> Tensor:
    torch._check(inverse.shape[0] == src.shape[0], lambda: "gather_rows: inverse must have one entry per src row")
    return src.new_empty((index.shape[0], *src.shape[1:]))


gather_rows = dispatch_triton_op("moe::gather_rows", _gather_rows, fake=_gather_rows_fake,
                                 schema="(Tensor src, Tensor index, Tensor inverse) -> Tensor")


def _gather_rows_setup(ctx, inputs, output) -> None:  # noqa: ANN001 - torch.library's signature
    _, index, inverse = inputs
    ctx.save_for_backward(index, inverse)


def _gather_rows_backward(ctx, grad: Tensor):  # noqa: ANN001, ANN202
    index, inverse = ctx.saved_tensors
    return gather_rows(grad, inverse, index), None, None


gather_rows.register_autograd(_gather_rows_backward, setup_context=_gather_rows_setup)


def _exclusive_cumsum(x: Tensor, dim: int = -1) -> Tensor:
    return x.cumsum(dim) - x


def _ep_send_index(send_counts: Tensor, num_rows: int, capacity: int) -> tuple[Tensor, Tensor]:
    """``(pack [W*S], slot [N])`` of the padded send buffer (module docstring)."""
    W, S, N = send_counts.shape[0], capacity, num_rows
    counts = send_counts.long()
    start = _exclusive_cumsum(counts)
    j = torch.arange(W * S, device=counts.device)
    w, p = j // S, j % S
    pack = torch.where(p < counts[w], start[w] + p, N)
    i = torch.arange(N, device=counts.device)
    dest = torch.searchsorted(counts.cumsum(0), i, right=True)  # W for rows past the last split
    dest_c = dest.clamp(max=W - 1)
    q = i - start[dest_c]
    slot = torch.where((dest < W) & (q < S), dest_c * S + q, W * S)
    return pack, slot


def _ep_send_index_fake(send_counts: Tensor, num_rows: int, capacity: int) -> tuple[Tensor, Tensor]:
    W = send_counts.shape[0]
    new = send_counts.new_empty
    return new(W * capacity, dtype=torch.long), new(num_rows, dtype=torch.long)


ep_send_index = dispatch_triton_op("moe::ep_send_index", _ep_send_index, fake=_ep_send_index_fake,
                                   schema="(Tensor send_counts, int num_rows, int capacity) -> (Tensor, Tensor)")


def _ep_regroup_index(counts: Tensor, capacity: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(regroup [W*S], inverse [W*S], offs [L])``: the received buffer in local-expert-major order (module
    docstring)."""
    W, L = counts.shape
    S = capacity
    c = counts.long()
    before = _exclusive_cumsum(c, 1)  # rows of source s ahead of local expert l in its block
    kept = torch.minimum(c, (S - before).clamp(min=0))  # [W, L] rows that fit in the block
    # segments in regrouped order (local expert l, then source s): flat index l * W + s
    seg_len = kept.t().flatten()
    seg_end = seg_len.cumsum(0)
    seg_start = seg_end - seg_len
    device = c.device
    # regroup: position d -> the received slot it reads (s * S + before[s, l] + row)
    d = torch.arange(W * S, device=device)
    seg = torch.searchsorted(seg_end, d, right=True)  # L * W for padding
    seg_c = seg.clamp(max=L * W - 1)
    expert, s = seg_c // W, seg_c % W
    regroup = torch.where(seg < L * W, s * S + before[s, expert] + d - seg_start[seg_c], W * S)
    # inverse: received slot (s, q) -> its position in the regrouped buffer
    q = torch.arange(S, device=device).expand(W, S).contiguous()
    local = torch.searchsorted((before + c).contiguous(), q, right=True)  # [W, S]; L past the block's rows
    local_c = local.clamp(max=L - 1)
    within = q - before.gather(1, local_c)
    src = torch.arange(W, device=device)[:, None]
    valid = (local < L) & (within < kept.gather(1, local_c))
    inverse = torch.where(valid, seg_start[local_c * W + src] + within, W * S).flatten()
    offs = kept.sum(0).cumsum(0)
    return regroup, inverse, offs.to(torch.int32)


def _ep_regroup_index_fake(counts: Tensor, capacity: int) -> tuple[Tensor, Tensor, Tensor]:
    W, L = counts.shape
    new = counts.new_empty
    return new(W * capacity, dtype=torch.long), new(W * capacity, dtype=torch.long), new(L, dtype=torch.int32)


ep_regroup_index = dispatch_triton_op("moe::ep_regroup_index", _ep_regroup_index, fake=_ep_regroup_index_fake,
                                      schema="(Tensor counts, int capacity) -> (Tensor, Tensor, Tensor)")


__all__ = ["ep_capacity", "ep_regroup_index", "ep_send_index", "gather_rows"]
