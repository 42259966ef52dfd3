"""Triton kernel for ``moe::gather_rows`` (the expert-parallel exchange's row gathers).

Kernel only: the launcher (flattening, grid, block sizes) lives in ``moe_compile/ops/expert_parallel.py``.

NOTE [row gather with vector loads]:
Inductor compiles ``where(valid, src.index_select(0, index.clamp(...)), 0)`` as a pointwise kernel over the output's
elements, each loading its own ``index`` entry; the source address then depends on a loaded value per element, so
Triton cannot prove consecutive elements contiguous and loads two bytes at a time (about 1 TB/s on an H200 for
bf16 rows of 2048). Here a program owns ``BLOCK_R`` output rows and ``BLOCK_D`` columns: one ``index`` load per row,
broadcast along the columns, so the column offsets stay a contiguous ``arange`` and the loads and stores are 16-byte
vectors. A row whose index is out of ``[0, n)`` is written as zeros and its source is never read. Every output
element has one writer and is a copy: bitwise reproducible, and the same bits as the PyTorch body.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _gather_rows_kernel(
    src_ptr,  # [n, D] contiguous
    index_ptr,  # [m] any integer dtype
    out_ptr,  # [m, D] contiguous
    n,
    m,
    D,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = rows < m
    col_ok = cols < D
    idx = tl.load(index_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
    valid = row_ok & (idx >= 0) & (idx < n)
    src_row = tl.where(valid, idx, 0)
    vals = tl.load(src_ptr + src_row[:, None] * D + cols[None, :], mask=valid[:, None] & col_ok[None, :], other=0)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], vals, mask=row_ok[:, None] & col_ok[None, :])
