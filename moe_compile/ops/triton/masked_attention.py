"""Triton kernels for ``moe::masked_attention``: attention under a mask tensor, forward and a backward without atomics.

Kernels only: the launcher (layouts, strides, grids, block sizes) lives in ``moe_compile/ops/masked_attention.py``.
Shapes: ``B`` batch, ``H`` query heads, ``G = H / Hkv`` query heads per key/value head, ``M`` queries, ``N`` keys,
``Dk`` query/key head dim, ``Dv`` value head dim. Scores are kept in the base-2 domain (``s * log2(e)``), so the
softmax runs on ``exp2``. The forward stores each row's max ``m`` and ``log2`` of its sum ``l`` apart,
``stats = [m, log2(l)]`` (``[2, B, H, M]``); the backward recomputes ``p = exp2((s - m) - log2(l))``.

NOTE [large finite mask values]:
A mask of ``finfo.min`` (older transformers, much user code) absorbs the scores, and SDPA's backends disagree on a
row that allows only such entries: torch's math backend attends uniformly over the row with the textbook gradient,
its CPU flash kernel attends uniformly with ``N`` times that gradient, and the CUDA memory-efficient kernel (the one
SDPA runs for a masked call on the GPU, which this op replaces) gives 0 and no gradient, as if the entries were
``-inf`` (measured on an H200, torch 2.11: a mask value times ``log2(e)`` overflows fp32 there). The kernels take
the memory-efficient kernel's rule: a mask value whose product with ``log2(e)`` in fp32 is ``-inf`` forbids the
entry. On CPU, translation validation sees the difference from the flash kernel and keeps SDPA there. The row max
and ``log2`` of the row sum are kept apart, so a row of large (not overflowing) negative values still gets the
textbook gradient.

NOTE [attention backward in a fixed order]:
FlashAttention-2 and memory-efficient attention add each key block's share of ``dQ`` into ``dQ`` with atomic adds,
so the order of the adds differs run to run. Here ``dQ`` and ``dK``/``dV`` come from two kernels: a ``dQ`` program
owns a block of queries and walks the key blocks in order; a ``dK``/``dV`` program owns a block of keys and one query
head and walks the query blocks in order, and the launcher sums the ``G`` query heads of each key/value head in head
order (``G`` times the dK/dV memory in fp32, for ``G`` times the programs). Every output element has one writer and a
fixed sequence of adds, so the backward is bitwise reproducible; the price is
computing ``softmax(q k^T)`` once more (each kernel recomputes the probabilities it needs).

NOTE [blocks the mask removes]:
The launcher reduces the mask to blocks (``BLOCK_M x BLOCK_N``, per batch and head of the mask) and gives each
program the range of blocks along its loop that the mask allows anything in: key blocks ``[lo, hi)`` for a block of
queries, query blocks for a block of keys. A program walks only that range (a causal mask: about half the blocks),
with no branch in the loop, so the loads stay pipelined. Inside the range each block's mask tile is applied
elementwise (``BLOCK_M * BLOCK_N`` bytes for a bool mask, far less than the key and value tiles); a block inside the
range that allows nothing is computed and contributes exact zeros (causal and padding masks have none). A row the
mask allows nothing in gets output 0 and ``log2(l) = +inf``, so its probabilities are exactly 0 in the backward and
its gradients exactly 0 (torch's SDPA gives such rows 0 too).
"""

from __future__ import annotations

import triton
import triton.language as tl

MASK_BOOL = 0  # mask tile: nonzero allows (a bool mask viewed as uint8)
MASK_ADDITIVE = 1  # mask tile: a float added to the scores (-inf forbids)

LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, IEEE_DOT: tl.constexpr):
    """``a @ b`` accumulated in fp32; with ``IEEE_DOT`` (fp32 data, and always under ``TRITON_INTERPRET=1``, whose
    ``tl.dot`` returns garbage for bf16) both operands are upcast and multiplied without TF32."""
    if IEEE_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _mask_tile(mask_ptr, offs_m, offs_n, stride_mm, stride_mn, M, N, MASK_KIND: tl.constexpr):
    """``(allowed, bias)`` of the tile ``offs_m x offs_n`` (fp32 bias in the log2 domain); the dK/dV kernel reads it
    transposed by swapping the offsets, strides and bounds."""
    inside = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    ptrs = mask_ptr + offs_m[:, None] * stride_mm + offs_n[None, :] * stride_mn
    if MASK_KIND == 0:
        allowed = (tl.load(ptrs, mask=inside, other=0) != 0) & inside
        bias = tl.zeros(allowed.shape, dtype=tl.float32)
    else:
        # a value whose log2-domain product overflows forbids the entry (NOTE [large finite mask values])
        bias = tl.load(ptrs, mask=inside, other=float("-inf")).to(tl.float32) * 1.4426950408889634
        allowed = (bias > float("-inf")) & inside
    return allowed, bias


@triton.jit
def _query_rows(q_base, do_base, stats_ptr, delta_ptr, row_base, offs_m, offs_dk, offs_dv, sqm, sqd, sdom, sdod,
                M, BHM, DK: tl.constexpr, DV: tl.constexpr):
    """What the backward needs of a block of query rows: ``q``, ``dO``, the row max, ``log2`` of the row sum and
    ``delta = rowsum(dO * O)`` (rows past ``M``: zeros, and ``log2(l) = +inf`` so their probabilities are 0)."""
    row_ok = offs_m < M
    q = tl.load(q_base + offs_m[:, None] * sqm + offs_dk[None, :] * sqd,
                mask=row_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
    do = tl.load(do_base + offs_m[:, None] * sdom + offs_dv[None, :] * sdod,
                 mask=row_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
    m_row = tl.load(stats_ptr + row_base + offs_m, mask=row_ok, other=0.0)
    log_l = tl.load(stats_ptr + BHM + row_base + offs_m, mask=row_ok, other=float("inf"))
    delta = tl.load(delta_ptr + row_base + offs_m, mask=row_ok, other=0.0)
    return q, do, m_row, log_l, delta


@triton.jit
def _masked_attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, o_ptr, stats_ptr, lo_ptr, hi_ptr,
    scale_log2, M, N, H, G, BHM, srb, srh, R,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    smb, smh, smm, smn,
    sob, soh, som, sod,
    DK: tl.constexpr, DV: tl.constexpr, MASK_KIND: tl.constexpr, IEEE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """Program ``(m block, b * H + h)``: online softmax over its key blocks ``[lo, hi)`` in order; writes ``o`` and
    ``stats``. ``lo``/``hi`` are ``[Bm, Hm, R]`` (``R`` query blocks; strides ``srb``/``srh``, 0 where the mask
    broadcasts)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // G
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_dk[None, :] * sqd,
                mask=(offs_m[:, None] < M) & (offs_dk[None, :] < DK), other=0.0)
    k_base = k_ptr + b * skb + hk * skh
    v_base = v_ptr + b * svb + hk * svh
    mask_base = mask_ptr + b * smb + h * smh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    lo = tl.load(lo_ptr + b * srb + h * srh + pid_m)
    hi = tl.load(hi_ptr + b * srb + h * srh + pid_m)
    for block_n in range(lo, hi):
        offs_n = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
        allowed, bias = _mask_tile(mask_base, offs_m, offs_n, smm, smn, M, N, MASK_KIND)
        k = tl.load(k_base + offs_n[:, None] * skn + offs_dk[None, :] * skd,
                    mask=(offs_n[:, None] < N) & (offs_dk[None, :] < DK), other=0.0)
        s = (_dot(q, tl.trans(k), IEEE_DOT) * scale_log2).to(tl.float32) + bias
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs_n[:, None] * svn + offs_dv[None, :] * svd,
                    mask=(offs_n[:, None] < N) & (offs_dv[None, :] < DV), other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE_DOT)
        m_i = m_new
    some = l_i > 0.0
    out = acc / tl.where(some, l_i, 1.0)[:, None]
    m_out = tl.where(some, m_i, 0.0)
    log_l = tl.where(some, tl.log2(tl.where(some, l_i, 1.0)), float("inf"))
    tl.store(o_ptr + b * sob + h * soh + offs_m[:, None] * som + offs_dv[None, :] * sod,
             out.to(o_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_dv[None, :] < DV))
    tl.store(stats_ptr + bh * M + offs_m, m_out, mask=offs_m < M)
    tl.store(stats_ptr + BHM + bh * M + offs_m, log_l, mask=offs_m < M)


@triton.jit
def _masked_attention_dq_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, do_ptr, stats_ptr, delta_ptr, dq_ptr, lo_ptr, hi_ptr,
    scale_log2, scale, M, N, H, G, BHM, srb, srh, R,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    smb, smh, smm, smn,
    sdob, sdoh, sdom, sdod,
    DK: tl.constexpr, DV: tl.constexpr, MASK_KIND: tl.constexpr, IEEE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """Program ``(m block, b * H + h)``: ``dq = scale * sum over key blocks (in order) of ds @ k``; ``dq`` is
    contiguous ``[B, H, M, Dk]``."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // G
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < M
    q, do, m_row, log_l, delta = _query_rows(q_ptr + b * sqb + h * sqh, do_ptr + b * sdob + h * sdoh, stats_ptr,
                                             delta_ptr, bh * M, offs_m, offs_dk, offs_dv, sqm, sqd, sdom, sdod, M,
                                             BHM, DK, DV)
    k_base = k_ptr + b * skb + hk * skh
    v_base = v_ptr + b * svb + hk * svh
    mask_base = mask_ptr + b * smb + h * smh
    dq = tl.zeros([BLOCK_M, BLOCK_DK], dtype=tl.float32)
    lo = tl.load(lo_ptr + b * srb + h * srh + pid_m)
    hi = tl.load(hi_ptr + b * srb + h * srh + pid_m)
    for block_n in range(lo, hi):
        offs_n = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
        allowed, bias = _mask_tile(mask_base, offs_m, offs_n, smm, smn, M, N, MASK_KIND)
        k = tl.load(k_base + offs_n[:, None] * skn + offs_dk[None, :] * skd,
                    mask=(offs_n[:, None] < N) & (offs_dk[None, :] < DK), other=0.0)
        v = tl.load(v_base + offs_n[:, None] * svn + offs_dv[None, :] * svd,
                    mask=(offs_n[:, None] < N) & (offs_dv[None, :] < DV), other=0.0)
        s = (_dot(q, tl.trans(k), IEEE_DOT) * scale_log2).to(tl.float32) + bias
        p = tl.where(allowed, tl.exp2((s - m_row[:, None]) - log_l[:, None]), 0.0)
        dp = _dot(do, tl.trans(v), IEEE_DOT)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, IEEE_DOT)
    dq = (dq * scale).to(tl.float32)
    tl.store(dq_ptr + bh * M * DK + offs_m[:, None] * DK + offs_dk[None, :], dq.to(dq_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dk[None, :] < DK))


@triton.jit
def _masked_attention_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, do_ptr, stats_ptr, delta_ptr, dk_ptr, dv_ptr, lo_ptr, hi_ptr,
    scale_log2, scale, M, N, H, G, BHM, srb, srh, R,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    smb, smh, smm, smn,
    sdob, sdoh, sdom, sdod,
    DK: tl.constexpr, DV: tl.constexpr, MASK_KIND: tl.constexpr, IEEE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """Program ``(n block, b * H + h)``: ``dk``, ``dv`` of a key block from query head ``h``, summed over the query
    blocks in order; ``dk``/``dv`` are contiguous ``[B, H, N, D]`` (the launcher sums each group's heads in order)."""
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // G
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    col_ok = offs_n < N
    k = tl.load(k_ptr + b * skb + hk * skh + offs_n[:, None] * skn + offs_dk[None, :] * skd,
                mask=col_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
    v = tl.load(v_ptr + b * svb + hk * svh + offs_n[:, None] * svn + offs_dv[None, :] * svd,
                mask=col_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_DK], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    q_base = q_ptr + b * sqb + h * sqh
    do_base = do_ptr + b * sdob + h * sdoh
    mask_base = mask_ptr + b * smb + h * smh
    row_base = bh * M
    lo = tl.load(lo_ptr + b * srb + h * srh + pid_n)
    hi = tl.load(hi_ptr + b * srb + h * srh + pid_n)
    for block_m in range(lo, hi):
        # transposed scores [BLOCK_N, BLOCK_M]: every transpose is of a loaded tile, none of a computed one
        offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
        allowed_t, bias_t = _mask_tile(mask_base, offs_n, offs_m, smn, smm, N, M, MASK_KIND)
        q, do, m_row, log_l, delta = _query_rows(q_base, do_base, stats_ptr, delta_ptr, row_base, offs_m, offs_dk,
                                                 offs_dv, sqm, sqd, sdom, sdod, M, BHM, DK, DV)
        s_t = (_dot(k, tl.trans(q), IEEE_DOT) * scale_log2).to(tl.float32) + bias_t
        p_t = tl.where(allowed_t, tl.exp2((s_t - m_row[None, :]) - log_l[None, :]), 0.0)
        dv += _dot(p_t.to(do.dtype), do, IEEE_DOT)
        dp_t = _dot(v, tl.trans(do), IEEE_DOT)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += _dot(ds_t.to(q.dtype), q, IEEE_DOT)
    dk = (dk * scale).to(tl.float32)
    out_row = bh * N + offs_n
    tl.store(dk_ptr + out_row[:, None] * DK + offs_dk[None, :], dk.to(dk_ptr.dtype.element_ty),
             mask=col_ok[:, None] & (offs_dk[None, :] < DK))
    tl.store(dv_ptr + out_row[:, None] * DV + offs_dv[None, :], dv.to(dv_ptr.dtype.element_ty),
             mask=col_ok[:, None] & (offs_dv[None, :] < DV))

