"""Triton kernel for ``moe::segment_sum``: each output row sums its segment of sorted entries, in order.

Kernels only: the launcher (sort, segment offsets, grid, block sizes) lives in
``moe_compile/ops/segment_sum.py``. Shapes: ``N`` entries of ``D`` columns, ``R`` output rows.

NOTE [segment sum in a fixed order]:
The launcher sorts the entries' row keys stably (``order_N``) and finds each row's segment
``[offsets[r], offsets[r + 1])`` of sorted positions. Program ``(r, d)`` walks its segment ``BLOCK_J``
entries at a time: it gathers ``[BLOCK_J, BLOCK_D]`` source values, sums the tile over its rows
(``tl.sum``: a fixed tree) and adds that to its accumulator. Every output element has exactly one
writer and the order of its adds depends only on the keys, so results are bitwise reproducible
(no atomics). Worked example, ``R = 3``, ``BLOCK_J = 2``, keys ``[2, 0, 2, 2, 0]``:

    order   = [1, 4, 0, 2, 3]          (stable: rows of key 0 in entry order, then key 1, then key 2)
    offsets = [0, 2, 2, 5]             (row 1 is empty)
    row 0: (src[1] + src[4])           one tile
    row 1: 0                           no tile
    row 2: (src[0] + src[2]) + src[3]  two tiles, the second half masked

Entries whose key is outside ``[0, R)`` (masked-out entries get key ``R``) lie outside every segment
and are never read.

``moe::gather_segment_sum`` runs the same loop with each entry reading source row ``gather[i]`` times
``weight[i]`` (in the accumulator dtype), and, where its keys come sorted (``ORDERED``), with no sort:
sorted position ``j`` is entry ``j``, and masked entries inside a segment are skipped by ``mask``.
"""

from __future__ import annotations

import triton
import triton.language as tl

# accumulator kinds (the ACC constexpr): fp32 for bf16/fp16/fp32, fp64 for fp64, int64 for integers
ACC_FP32 = 0
ACC_FP64 = 1
ACC_INT64 = 2


@triton.jit
def _segment_sum_kernel(
    src_ptr,  # [S, D] source rows (row stride src_stride, unit column stride)
    order_ptr,  # [N] entry index at each sorted position (stable sort of the keys); unused when ORDERED
    offsets_ptr,  # [R + 1] row r sums sorted positions [offsets[r], offsets[r + 1])
    gather_ptr,  # [N] source row of each entry (HAS_GATHER; else entry i reads src row i)
    weight_ptr,  # [N] float weight of each entry (HAS_WEIGHT), multiplied in the accumulator dtype
    mask_ptr,  # [N] bool, entries to skip inside a segment (HAS_MASK: only when ORDERED)
    out_ptr,  # [R, D] out, contiguous
    D,
    src_stride,
    ACC: tl.constexpr,
    ORDERED: tl.constexpr,  # the keys are sorted already: sorted position j is entry j
    HAS_GATHER: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    start = tl.load(offsets_ptr + r).to(tl.int64)
    end = tl.load(offsets_ptr + r + 1).to(tl.int64)
    if ACC == 2:
        acc = tl.zeros([BLOCK_D], dtype=tl.int64)
    elif ACC == 1:
        acc = tl.zeros([BLOCK_D], dtype=tl.float64)
    else:
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j0 in range(start, end, BLOCK_J):
        js = j0 + tl.arange(0, BLOCK_J)
        j_ok = js < end
        if ORDERED:
            entries = js
        else:
            entries = tl.load(order_ptr + js, mask=j_ok, other=0).to(tl.int64)
        if HAS_MASK:
            j_ok = j_ok & (tl.load(mask_ptr + entries, mask=j_ok, other=0) != 0)
        if HAS_GATHER:
            rows = tl.load(gather_ptr + entries, mask=j_ok, other=0).to(tl.int64)
        else:
            rows = entries
        tile = tl.load(src_ptr + rows[:, None] * src_stride + cols[None, :], mask=j_ok[:, None] & col_ok[None, :],
                       other=0).to(acc.dtype)
        if HAS_WEIGHT:
            tile = tile * tl.load(weight_ptr + entries, mask=j_ok, other=0).to(acc.dtype)[:, None]
        acc += tl.sum(tile, axis=0)
    tl.store(out_ptr + r * D + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _lower_bound_kernel(
    sorted_ptr,  # [N] non-decreasing integers
    out_ptr,  # int64 [Q]: for query q (= its position), the first position whose value is >= q (N if none)
    N,
    Q,
    STEPS: tl.constexpr,  # >= bit length of N + 1: enough halvings to close every interval
    BLOCK: tl.constexpr,
):
    q = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    lo = tl.zeros([BLOCK], dtype=tl.int64)
    hi = tl.zeros([BLOCK], dtype=tl.int64) + N
    for _ in tl.static_range(STEPS):
        open_ = lo < hi
        mid = (lo + hi) // 2
        v = tl.load(sorted_ptr + mid, mask=open_, other=0)
        right = open_ & (v < q)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(open_ & ~right, mid, hi)
    tl.store(out_ptr + q, lo, mask=q < Q)
