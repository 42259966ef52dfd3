"""Triton kernels for the grouped GEMM ops in ``moe_compile.ops.grouped_mm`` (kernels only, no allocation).

Shape suffixes: ``M`` rows of the expert-major buffer, ``K`` reduction dim, ``N`` output dim, ``E`` experts.
``offs_E`` holds int32 cumulative END offsets: expert ``e`` owns rows ``[offs[e-1], offs[e])``.

NOTE [static grid over M tiles]
The host never reads ``offs``. The grid covers a static bound on the number of row tiles,
``cdiv(M, BLOCK_M) + min(E, M) + 1``: every non-empty expert wastes at most one partial tile, plus the
tail tiles past ``offs[-1]``. Each program loads ``offs`` once, turns it into per-expert tile counts
and their inclusive prefix sum, and finds its expert with one vector compare:

    offs = [3, 3, 7]  BLOCK_M = 2     counts = [3, 0, 4]   tiles = [2, 0, 2]   tiles_end = [2, 2, 4]
    pid 0 -> e0 rows 0-1 | pid 1 -> e0 row 2 | pid 2 -> e2 rows 3-4 | pid 3 -> e2 rows 5-6
    pid 4.. -> tail: rows >= offs[-1] = 7 are written as zeros (if M > 7), later pids do nothing.

Weight formats (``W_FORMAT``): 0 plain (``w`` already in the compute dtype, any strides), 1 MXFP8
(``w`` float8_e4m3fn ``[E, N, K]``, ``w_scale`` uint8 e8m0 ``[E, N, K/32]``), 2 NVFP4 (``w`` uint8
``[E, N, K/2]``, two e2m1 codes per byte, low nibble first; ``w_scale`` float8_e4m3fn ``[E, N, K/16]``;
``w_gscale`` fp32 ``[E]`` per-expert scale). Quantised tiles are decoded in registers with the same
fp32 arithmetic as the PyTorch reference, so the dequantised tile is bitwise the reference's.

``IEEE_DOT``: upcast both operands to fp32 and multiply without TF32. Used for fp32 data and always
under ``TRITON_INTERPRET=1`` (the triton 3.9 interpreter's ``tl.dot`` returns garbage for bf16).
"""

from __future__ import annotations

import triton
import triton.language as tl

W_PLAIN: tl.constexpr = tl.constexpr(0)
W_MXFP8: tl.constexpr = tl.constexpr(1)
W_NVFP4: tl.constexpr = tl.constexpr(2)
MX_BLOCK: tl.constexpr = tl.constexpr(32)  # MXFP8: one e8m0 scale per 32 values along K
NV_BLOCK: tl.constexpr = tl.constexpr(16)  # NVFP4: one e4m3 scale per 16 values along K


@triton.jit
def _expert_tile(offs_ptr, E, M, pid_m, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """Map row-tile slot ``pid_m`` to ``(is_work, row0, row_hi, e)``; see NOTE [static grid over M tiles].

    ``is_work`` False means a tail slot: zero rows ``[row0, row0 + BLOCK_M)`` (clipped to ``M``).
    """
    e_idx = tl.arange(0, BLOCK_E)
    e_mask = e_idx < E
    ends = tl.load(offs_ptr + e_idx, mask=e_mask, other=0)
    starts = tl.load(offs_ptr + e_idx - 1, mask=e_mask & (e_idx > 0), other=0)
    ends = tl.minimum(ends, M)  # offs[-1] > M is invalid input; never read past the buffer
    starts = tl.minimum(starts, M)
    counts = tl.maximum(ends - starts, 0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tiles_end = tl.cumsum(tiles, 0)
    total = tl.sum(tiles, 0)
    last = tl.max(ends, 0)
    e = tl.sum((tiles_end <= pid_m).to(tl.int32), 0)
    sel = e_idx == e
    tile0 = tl.sum(tl.where(sel, tiles_end - tiles, 0), 0)
    row_lo = tl.sum(tl.where(sel, starts, 0), 0)
    row_hi = tl.sum(tl.where(sel, ends, 0), 0)
    is_work = pid_m < total
    row0 = tl.where(is_work, row_lo + (pid_m - tile0) * BLOCK_M, last + (pid_m - total) * BLOCK_M)
    row_hi = tl.where(is_work, row_hi, M)
    return is_work, row0, row_hi, e


@triton.jit
def _decode_e8m0(s):
    """uint8 biased exponent -> fp32 ``2**(s - 127)``; 0 -> 2**-127, 255 -> NaN (torchao's ``get_fp_scale``)."""
    scale = (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    scale = tl.where(s == 0, 5.877471754111438e-39, scale)
    return tl.where(s == 255, float("nan"), scale)


@triton.jit
def _decode_e2m1_pairs(packed):
    """``[R, C]`` bytes of two e2m1 codes (low nibble first) -> fp32 ``[R, 2C]`` in memory order.

    A code's 3 magnitude bits land on fp32 bits 22-24 (top mantissa bit + two lowest exponent bits)
    and its sign on bit 31: that is exactly ``value * 2**-126`` (code 1 is the denormal ``2**-127``),
    so one exact multiply by ``2**126`` finishes it. Both codes are taken straight from the byte
    (low: bits 0-2 and 3, high: bits 4-6 and 7), with no nibble split first: integer ops per value
    bound the NVFP4 kernels on sm90 (64 INT32 lanes per SM against 128 FP32).
    """
    p = packed.to(tl.int32)
    lo = ((p << 22) & 0x01C00000) | ((p << 28) & -2147483648)
    hi = ((p << 18) & 0x01C00000) | ((p << 24) & -2147483648)
    values = tl.join(lo, hi).to(tl.float32, bitcast=True) * 8.507059173023462e37  # 2**126
    return values.reshape(packed.shape[0], 2 * packed.shape[1])


@triton.jit
def _dequant_tile(
    w_base, s_base, gscale, k0, K, col_mask, stride_wk, stride_sk,
    W_FORMAT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, OUT_DTYPE: tl.constexpr,
):  # fmt: skip
    """The ``[BLOCK_N, BLOCK_K]`` weight tile at ``k0`` in ``OUT_DTYPE`` (zeros past ``K``/``N``).

    ``w_base`` / ``s_base`` are ``[BLOCK_N, 1]`` pointer columns of one expert's rows. Quantised
    tiles are decoded once per tile with the reference's fp32 arithmetic (bitwise the reference).
    """
    if W_FORMAT == W_PLAIN:
        ks = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_base + ks[None, :] * stride_wk, mask=col_mask[:, None] & (ks[None, :] < K), other=0.0)
        return w.to(OUT_DTYPE)
    elif W_FORMAT == W_MXFP8:
        ks = k0 + tl.arange(0, BLOCK_K)
        q = tl.load(w_base + ks[None, :] * stride_wk, mask=col_mask[:, None] & (ks[None, :] < K), other=0.0)
        sk = k0 // MX_BLOCK + tl.arange(0, BLOCK_K // MX_BLOCK)
        s = tl.load(s_base + sk[None, :] * stride_sk, mask=col_mask[:, None] & (sk[None, :] < K // MX_BLOCK), other=127)
        w = q.to(tl.float32).reshape(BLOCK_N, BLOCK_K // MX_BLOCK, MX_BLOCK) * _decode_e8m0(s)[:, :, None]
        return w.reshape(BLOCK_N, BLOCK_K).to(OUT_DTYPE)
    else:
        kp = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(w_base + kp[None, :] * stride_wk, mask=col_mask[:, None] & (kp[None, :] < K // 2), other=0)
        sk = k0 // NV_BLOCK + tl.arange(0, BLOCK_K // NV_BLOCK)
        s = tl.load(s_base + sk[None, :] * stride_sk, mask=col_mask[:, None] & (sk[None, :] < K // NV_BLOCK), other=0.0)
        scale = gscale * s.to(tl.float32)  # same order as torchao: per_tensor_scale * e4m3 scale
        w = _decode_e2m1_pairs(packed).reshape(BLOCK_N, BLOCK_K // NV_BLOCK, NV_BLOCK) * scale[:, :, None]
        return w.reshape(BLOCK_N, BLOCK_K).to(OUT_DTYPE)


@triton.jit
def _expert_operands(
    x_ptr, w_ptr, w_scale_ptr, w_gscale_ptr, rows, cols, e,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, W_FORMAT: tl.constexpr,
):  # fmt: skip
    """Pointer columns of the tile's activation rows and of expert ``e``'s weight / scale rows, and the
    NVFP4 per-expert scale (1.0 for the other formats)."""
    x_base = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    w_base = w_ptr + e.to(tl.int64) * stride_we + cols[:, None].to(tl.int64) * stride_wn
    s_base = w_scale_ptr + e.to(tl.int64) * stride_se + cols[:, None].to(tl.int64) * stride_sn
    if W_FORMAT == W_NVFP4:
        gscale = tl.load(w_gscale_ptr + e)
    else:
        gscale = 1.0
    return x_base, w_base, s_base, gscale


@triton.jit
def _grouped_mm_kernel(
    x_ptr, w_ptr, w_scale_ptr, w_gscale_ptr, offs_ptr, y_ptr,
    M, N, K, E,
    stride_xm, stride_xk,
    stride_we, stride_wn, stride_wk,
    stride_se, stride_sn, stride_sk,
    stride_ym, stride_yn,
    NUM_M_SLOTS,
    W_FORMAT: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    """``y[r, :] = x[r, :] @ W[e]^T`` for rows ``r`` of expert ``e``; rows ``>= offs[-1]`` are zeroed.

    1-D grid of ``NUM_M_SLOTS * cdiv(N, BLOCK_N)`` programs, ordered in groups of ``GROUP_M`` row
    tiles so that neighbouring programs share activation and weight tiles in L2 (prefill).
    """
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = tl.minimum(NUM_M_SLOTS - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m
    is_work, row0, row_hi, e = _expert_tile(offs_ptr, E, M, pid_m, BLOCK_M, BLOCK_E)
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = (rows < row_hi) & (rows < M)
    col_mask = cols < N
    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :] * stride_yn
    out_mask = row_mask[:, None] & col_mask[None, :]
    # tail slots run zero K iterations and store zeros (no scf.if: keeps the K loop pipelinable)
    k_end = tl.where(is_work, K, 0)
    e = tl.minimum(e, E - 1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_base, w_base, s_base, gscale = _expert_operands(
        x_ptr, w_ptr, w_scale_ptr, w_gscale_ptr, rows, cols, e,
        stride_xm, stride_we, stride_wn, stride_se, stride_sn, W_FORMAT,
    )  # fmt: skip
    for k0 in range(0, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_base + ks[None, :] * stride_xk, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = _dequant_tile(
            w_base, s_base, gscale, k0, K, col_mask, stride_wk, stride_sk,
            W_FORMAT, BLOCK_N, BLOCK_K, x_ptr.dtype.element_ty,
        )  # fmt: skip
        if IEEE_DOT:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _grouped_mm_decode_kernel(
    x_ptr, w_ptr, w_scale_ptr, w_gscale_ptr, offs_ptr, y_ptr,
    M, N, K, E, K_PER_SPLIT,
    stride_xm, stride_xk,
    stride_we, stride_wn, stride_wk,
    stride_se, stride_sn, stride_sk,
    stride_ys, stride_ym, stride_yn,
    W_FORMAT: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    SWAP_AB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """Decode-shaped (few rows per expert) weight-streaming variant of ``_grouped_mm_kernel``.

    Grid ``(cdiv(N, BLOCK_N), NUM_M_SLOTS, SPLIT_K)``: program ``(n, m, s)`` takes row tile ``m``
    (one expert's rows, NOTE [static grid over M tiles]) and streams that expert's
    ``[BLOCK_N, K_PER_SPLIT]`` weight slice once, dequantising each ``[BLOCK_N, BLOCK_K]`` tile once
    for all its rows. Only experts that own rows are read. Split-K spreads a few active experts over
    the SMs: each split writes its fp32 partial to ``y[s]`` (``stride_ys``) and
    ``_splitk_reduce_kernel`` sums them in a fixed order (deterministic, no atomics). ``SWAP_AB``
    computes ``(W x^T)^T`` so the weight tile is the MMA's wide operand.
    """
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    is_work, row0, row_hi, e = _expert_tile(offs_ptr, E, M, pid_m, BLOCK_M, BLOCK_E)
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = (rows < row_hi) & (rows < M)
    col_mask = cols < N
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.where(is_work, tl.minimum(k_lo + K_PER_SPLIT, K), k_lo)  # tail slots: store zeros
    e = tl.minimum(e, E - 1)
    x_base, w_base, s_base, gscale = _expert_operands(
        x_ptr, w_ptr, w_scale_ptr, w_gscale_ptr, rows, cols, e,
        stride_xm, stride_we, stride_wn, stride_se, stride_sn, W_FORMAT,
    )  # fmt: skip
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_base + ks[None, :] * stride_xk, mask=row_mask[:, None] & (ks[None, :] < K), other=0.0)
        w = _dequant_tile(
            w_base, s_base, gscale, k0, K, col_mask, stride_wk, stride_sk,
            W_FORMAT, BLOCK_N, BLOCK_K, x_ptr.dtype.element_ty,
        )  # fmt: skip
        if IEEE_DOT:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        if SWAP_AB:
            if IEEE_DOT:
                acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
            else:
                acc = tl.dot(w, tl.trans(x), acc)
        else:
            if IEEE_DOT:
                acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w), acc)
    if SWAP_AB:
        out = tl.trans(acc)
    else:
        out = acc
    y_ptrs = y_ptr + pid_k * stride_ys + rows[:, None].to(tl.int64) * stride_ym + cols[None, :] * stride_yn
    tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _splitk_reduce_kernel(part_ptr, y_ptr, M, N, SPLIT_K, stride_ym, stride_yn, BLOCK: tl.constexpr):
    """``y[m, n] = sum_s part[s, m, n]`` over contiguous fp32 partials ``[SPLIT_K, M, N]``, s ascending."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(part_ptr + s * M * N + idx, mask=mask, other=0.0)
    m, n = idx // N, idx % N
    tl.store(y_ptr + m * stride_ym + n * stride_yn, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _grouped_mm_wgrad_kernel(
    dy_ptr, x_ptr, offs_ptr, dw_ptr,
    M, N, K, E,
    stride_dym, stride_dyn,
    stride_xm, stride_xk,
    stride_we, stride_wn, stride_wk,
    IEEE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``dW[e] = dY[rows of e]^T @ X[rows of e]``: one program per (expert, N tile, K tile).

    The rows of an expert are reduced in a fixed order by one program (no atomics, deterministic);
    an empty expert writes zeros.
    """
    e = tl.program_id(0)
    pid_nk = tl.program_id(1)
    num_k_tiles = tl.cdiv(K, BLOCK_K)
    pid_n = pid_nk // num_k_tiles
    pid_k = pid_nk % num_k_tiles
    row_hi = tl.minimum(tl.load(offs_ptr + e), M)
    row_lo = tl.minimum(tl.load(offs_ptr + e - 1, mask=e > 0, other=0), M)
    cols_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    n_mask = cols_n < N
    k_mask = cols_k < K
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for r0 in range(row_lo, row_hi, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        r_mask = rows < row_hi
        dy = tl.load(
            dy_ptr + rows[:, None].to(tl.int64) * stride_dym + cols_n[None, :] * stride_dyn,
            mask=r_mask[:, None] & n_mask[None, :],
            other=0.0,
        )
        x = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols_k[None, :] * stride_xk,
            mask=r_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        if IEEE_DOT:
            acc = tl.dot(tl.trans(dy.to(tl.float32)), x.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(tl.trans(dy), x, acc)
    dw_ptrs = dw_ptr + e.to(tl.int64) * stride_we + cols_n[:, None] * stride_wn + cols_k[None, :] * stride_wk
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=n_mask[:, None] & k_mask[None, :])
