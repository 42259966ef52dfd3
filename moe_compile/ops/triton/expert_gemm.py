"""Persistent grouped-GEMM kernels for the expert MLP (``moe_compile.ops.expert_gemm``; kernels only).

Shape suffixes: ``M`` rows of the expert-major (permuted, padded) buffer, ``S`` rows of a gathered
source (tokens), ``K`` reduction dim, ``N`` output dim, ``E`` experts. ``offs_E`` holds int32
cumulative END offsets (NOTE [static grid over M tiles] (moe_compile/ops/triton/grouped_mm.py)).

NOTE [persistent tile schedule]:
The grid is ``NUM_PROGS`` programs (about the SM count), fixed on the host. Each program loads
``offs`` once and derives, on the device, the per-expert row-tile counts, their prefix sum, the
number of work tiles ``total`` and the tail tiles past ``offs[-1]`` (written as zeros). It then walks
tiles ``pid, pid + NUM_PROGS, ...`` of the ``(total + tail) x cdiv(N, BLOCK_N)`` tile space (in
groups of ``GROUP_M`` row tiles for L2 reuse). Uneven experts only change how many row tiles there
are: no program waits for a wave of a static per-expert grid, and no slot is launched for nothing.

NOTE [gather prologue]:
With ``GATHER``, activation row ``r`` of the tile is read from ``x[src[r]]`` (``src`` int32 ``[M]``:
the source token of each permuted row, ``-1`` for pad and tail rows, which read as zeros), so the
permuted copy of ``x`` is never written. ``tests`` compare against ``x[src]`` materialised.

NOTE [gated epilogue]:
``ACT`` 1 (SwiGLU) / 2 (GeGLU, erf GELU): the weight holds ``[gate; up]`` stacked along N (rows
``[0, N)`` gate, ``[N, 2N)`` up: the Hugging Face ``gate_up_proj [E, 2I, H]`` layout). Each tile runs
two accumulators over one activation tile and stores ``act(gate) * up`` (times the row weight with
``ROW_SCALE``) in ``y``'s dtype, and with ``STORE_PRE`` the pre-activations ``[gate | up]`` for the
backward. Everything in the epilogue is fp32; one cast per stored value.

NOTE [TMA loads]:
``USE_TMA`` (plain 16-bit weights, sm90+; the launcher's ``_tma_layout``): the weight tile comes through a
device-side tensor descriptor (``tl.make_tensor_descriptor``, made once per program). Weights stored
``[E, N, K]`` (the forward): a descriptor over ``[E * N_w, K]``; rows of a tile past ``N`` read the next rows
(their output columns are masked), columns past ``K`` are zero. ``W_KN``, weights stored ``[E, K, N]`` (the
backward's ``w.transpose(1, 2)``): a ``[E, K, N]`` descriptor with ``[1, BLOCK_K, BLOCK_N]`` boxes, zeros past
the expert's ``K`` and past ``N``, transposed in shared memory for the MMA. ``X_TMA``: activations that are
not gathered come through a ``[M, K]`` descriptor too; a tile's rows past its expert's end are read and
multiplied, and only their output rows are masked (an output row depends on its own input row alone).
Gathered rows keep pointer loads (sm90 has no TMA gather). No value changes: the loads bring the same
elements to the same MMA. TMA is faster than pointer loads for every forward GEMM tried and no slower for
dX (benchmarks/results/grouped_gemm.json). Tried for MXFP8 (the e4m3 tile through the descriptor, decoded in
registers): faster for down, slower for the swapped-operand gate_up, and one benchmark run returned NaN from the
MXFP8 block with it, which a run of the same GEMMs alone did not reproduce
(benchmarks/results/grouped_gemm_mxfp8_tma_nan.json): quantised weights keep pointer loads.

NOTE [swapped operands]:
With ``SWAP_AB`` each tile computes ``(W x^T)^T``: the accumulators are ``[BLOCK_N, BLOCK_M]`` and are
transposed once before the epilogue. On sm90 the MMA's first operand may come from registers, the second
only from shared memory: a weight tile decoded in registers (MXFP8, NVFP4) then feeds the MMA directly
instead of being written back to shared memory first. Same products, same K steps (in the ``--sweep`` run at
commit 96b9c81 the outputs were bitwise those of the unswapped tiles of the same size).

``IEEE_DOT`` (fp32 data, and always under ``TRITON_INTERPRET=1``): see ``grouped_mm.py``'s kernels.

"""

from __future__ import annotations

import triton
import triton.language as tl

from moe_compile.ops.triton.grouped_mm import W_NVFP4, _dot, _load_scales, _w_dot

ACT_NONE: tl.constexpr = tl.constexpr(0)
ACT_SWIGLU: tl.constexpr = tl.constexpr(1)
ACT_GEGLU: tl.constexpr = tl.constexpr(2)


@triton.jit
def _act(g, ACT: tl.constexpr):
    """fp32 ``silu(g)`` (ACT 1) or erf ``gelu(g)`` (ACT 2)."""
    if ACT == ACT_SWIGLU:
        return g / (1.0 + tl.exp(-g))
    else:
        return 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))


@triton.jit
def _expert_gemm_kernel(
    x_ptr, src_ptr, w_ptr, w_scale_ptr, w_gscale_ptr, offs_ptr, rw_ptr, y_ptr, pre_ptr,
    M, N, K, E, NUM_PROGS,
    stride_xm, stride_xk,
    stride_we, stride_wn, stride_wk,
    stride_se, stride_sn, stride_sk,
    stride_ym, stride_yn,
    stride_pm, stride_pn,
    GATHER: tl.constexpr, ACT: tl.constexpr, ROW_SCALE: tl.constexpr, STORE_PRE: tl.constexpr,
    W_FORMAT: tl.constexpr, IEEE_DOT: tl.constexpr, PTX_DECODE: tl.constexpr, K_ALIGN: tl.constexpr,
    USE_TMA: tl.constexpr, W_KN: tl.constexpr, X_TMA: tl.constexpr, SWAP_AB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    """``y[r] = epilogue(x[src(r)] @ W[e]^T)`` for rows ``r`` of expert ``e``; rows ``>= offs[-1]`` are zero.

    NOTE [persistent tile schedule], NOTE [gather prologue], NOTE [gated epilogue]. ``N`` is the
    output width (``I`` when gated: the weight then has ``2N`` rows). NVFP4's per-expert scale is
    applied to the fp32 accumulators (NOTE [NVFP4 decode] (moe_compile/ops/triton/grouped_mm.py)).
    """
    K = K // K_ALIGN * K_ALIGN  # == K; shows the compiler K_ALIGN divides K
    pid = tl.program_id(0)
    # ---- schedule, once per program (NOTE [persistent tile schedule])
    e_idx = tl.arange(0, BLOCK_E)
    e_mask = e_idx < E
    # offsets outside [0, M] are invalid input (checked on CPU): clamped, so no row outside the buffer is read
    ends = tl.minimum(tl.maximum(tl.load(offs_ptr + e_idx, mask=e_mask, other=0), 0), M)
    starts = tl.minimum(tl.maximum(tl.load(offs_ptr + e_idx - 1, mask=e_mask & (e_idx > 0), other=0), 0), M)
    counts = tl.maximum(ends - starts, 0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tiles_end = tl.cumsum(tiles, 0)
    total = tl.sum(tiles, 0)
    last = tl.max(ends, 0)
    num_m = total + (M - last + BLOCK_M - 1) // BLOCK_M
    num_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_m * num_n
    if ACT != ACT_NONE:
        N_W = 2 * N
    else:
        N_W = N
    if USE_TMA:
        if W_KN:  # the weight's storage is [E, K, N] (the backward's w.transpose(1, 2)): zeros past K and N
            w_desc = tl.make_tensor_descriptor(
                w_ptr, shape=[E, K, N_W], strides=[stride_we, stride_wk, 1], block_shape=[1, BLOCK_K, BLOCK_N]
            )  # fmt: skip
        else:
            w_desc = tl.make_tensor_descriptor(
                w_ptr, shape=[E * N_W, K], strides=[stride_wn, 1], block_shape=[BLOCK_N, BLOCK_K]
            )  # fmt: skip
    if X_TMA:  # rows past the expert's end are read and multiplied; their output rows are never stored
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_K])
    for tile in tl.range(pid, num_tiles, NUM_PROGS):
        # grouped order: GROUP_M row tiles share each weight tile while it is in L2
        per_group = GROUP_M * num_n
        first_m = (tile // per_group) * GROUP_M
        group_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (tile % per_group) % group_m
        pid_n = (tile % per_group) // group_m
        e = tl.sum((tiles_end <= pid_m).to(tl.int32), 0)
        sel = e_idx == e
        tile0 = tl.sum(tl.where(sel, tiles_end - tiles, 0), 0)
        row_lo = tl.sum(tl.where(sel, starts, 0), 0)
        row_end = tl.sum(tl.where(sel, ends, 0), 0)
        is_work = pid_m < total
        row0 = tl.where(is_work, row_lo + (pid_m - tile0) * BLOCK_M, last + (pid_m - total) * BLOCK_M)
        row_hi = tl.where(is_work, row_end, M)
        e = tl.minimum(e, E - 1)
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = (rows < row_hi) & (rows < M)
        col_mask = cols < N
        # ---- prologue: activation rows (NOTE [gather prologue])
        if GATHER:
            src = tl.load(src_ptr + rows, mask=row_mask, other=-1)
            a_mask = row_mask & (src >= 0)
            x_base = x_ptr + tl.maximum(src, 0)[:, None].to(tl.int64) * stride_xm
        else:
            a_mask = row_mask
            x_base = x_ptr + rows[:, None].to(tl.int64) * stride_xm
        w_base = w_ptr + e.to(tl.int64) * stride_we + cols[:, None].to(tl.int64) * stride_wn
        s_base = w_scale_ptr + e.to(tl.int64) * stride_se + cols[:, None].to(tl.int64) * stride_sn
        up_off_w = tl.cast(N, tl.int64) * stride_wn  # tl.cast: N may be a constant (a traced launch specialises it)
        up_off_s = tl.cast(N, tl.int64) * stride_sn
        if SWAP_AB:  # NOTE [swapped operands]
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_end = tl.where(is_work, K, 0)  # tail tiles: no K steps, store zeros
        s = _load_scales(s_base, 0, K, col_mask, stride_sk, W_FORMAT, BLOCK_N, BLOCK_K)
        if ACT != ACT_NONE:
            s_u = _load_scales(s_base + up_off_s, 0, K, col_mask, stride_sk, W_FORMAT, BLOCK_N, BLOCK_K)
        else:
            s_u = s
        for k0 in tl.range(0, k_end, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            if X_TMA:
                x = x_desc.load([row0, k0])
            else:
                x = tl.load(x_base + ks[None, :] * stride_xk, mask=a_mask[:, None] & (ks[None, :] < K), other=0.0)
            if USE_TMA:
                if W_KN:
                    w_t = w_desc.load([e, k0, pid_n * BLOCK_N]).reshape(BLOCK_K, BLOCK_N)
                    acc = _dot(acc, x, tl.trans(w_t), IEEE_DOT, SWAP_AB)
                else:
                    w_row = e * N_W + pid_n * BLOCK_N
                    acc = _dot(acc, x, w_desc.load([w_row, k0]), IEEE_DOT, SWAP_AB)
                    if ACT != ACT_NONE:
                        acc_u = _dot(acc_u, x, w_desc.load([w_row + N, k0]), IEEE_DOT, SWAP_AB)
            else:
                s_next = _load_scales(s_base, k0 + BLOCK_K, K, col_mask, stride_sk, W_FORMAT, BLOCK_N, BLOCK_K)
                acc = _w_dot(
                    acc, x, w_base, s, k0, K, col_mask, stride_wk,
                    W_FORMAT, IEEE_DOT, SWAP_AB, PTX_DECODE, BLOCK_M, BLOCK_N, BLOCK_K,
                )  # fmt: skip
                s = s_next  # NOTE [scale prefetch] (moe_compile/ops/triton/grouped_mm.py)
                if ACT != ACT_NONE:
                    s_u_next = _load_scales(
                        s_base + up_off_s, k0 + BLOCK_K, K, col_mask, stride_sk, W_FORMAT, BLOCK_N, BLOCK_K
                    )  # fmt: skip
                    acc_u = _w_dot(
                        acc_u, x, w_base + up_off_w, s_u, k0, K, col_mask, stride_wk,
                        W_FORMAT, IEEE_DOT, SWAP_AB, PTX_DECODE, BLOCK_M, BLOCK_N, BLOCK_K,
                    )  # fmt: skip
                    s_u = s_u_next
        # ---- epilogue (NOTE [gated epilogue])
        if SWAP_AB:
            acc = tl.trans(acc)
            acc_u = tl.trans(acc_u)
        if W_FORMAT == W_NVFP4:
            g_scale = tl.load(w_gscale_ptr + e) * 128.0
            acc = acc * g_scale
            acc_u = acc_u * g_scale
        out_mask = row_mask[:, None] & col_mask[None, :]
        if ACT != ACT_NONE:
            if STORE_PRE:
                p_ptrs = pre_ptr + rows[:, None].to(tl.int64) * stride_pm + cols[None, :] * stride_pn
                tl.store(p_ptrs, acc.to(pre_ptr.dtype.element_ty), mask=out_mask)
                tl.store(p_ptrs + N * stride_pn, acc_u.to(pre_ptr.dtype.element_ty), mask=out_mask)
            out = _act(acc, ACT) * acc_u
        else:
            out = acc
        if ROW_SCALE:
            p = tl.load(rw_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
            out = out * p[:, None]
        y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :] * stride_yn
        tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _expert_wgrad_kernel(
    dy_ptr, x_ptr, src_ptr, rw_ptr, offs_ptr, dw_ptr,
    M, N, K, E, NUM_PROGS,
    stride_dym, stride_dyn,
    stride_xm, stride_xk,
    stride_we, stride_wn, stride_wk,
    GATHER_X: tl.constexpr, ROW_SCALE: tl.constexpr, IEEE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
):  # fmt: skip
    """``dW[e] = sum over rows r of e of (p[r] dy[r])^T x[r']`` (``r'``: ``src[r]`` with ``GATHER_X``, else
    ``r``; ``p`` with ``ROW_SCALE``).

    Persistent over the ``E x cdiv(N, BLOCK_N) x cdiv(K, BLOCK_K)`` output tiles, expert by expert; within
    an expert, ``GROUP_N`` column tiles of ``dy`` take turns over each ``x`` tile while both are in L2.
    Each tile's rows are reduced by one program in ascending row order (fp32 accumulator, no atomics:
    bitwise reproducible). Empty experts write zeros. With ``ROW_SCALE`` the scaled ``dy`` is rounded to
    the MMA's operand dtype, as the unfused path stores ``g * p``.
    """
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    num_k = tl.cdiv(K, BLOCK_K)
    per_expert = num_n * num_k
    num_tiles = E * per_expert
    for tile in tl.range(pid, num_tiles, NUM_PROGS):
        e = tile // per_expert
        t = tile % per_expert
        per_group = GROUP_N * num_k
        first_n = (t // per_group) * GROUP_N
        group_n = tl.minimum(num_n - first_n, GROUP_N)
        pid_n = first_n + (t % per_group) % group_n
        pid_k = (t % per_group) // group_n
        row_hi = tl.minimum(tl.maximum(tl.load(offs_ptr + e), 0), M)  # (offsets outside [0, M] clamped)
        row_lo = tl.minimum(tl.maximum(tl.load(offs_ptr + e - 1, mask=e > 0, other=0), 0), M)
        cols_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cols_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        n_mask = cols_n < N
        k_mask = cols_k < K
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for r0 in tl.range(row_lo, row_hi, BLOCK_M):
            rows = r0 + tl.arange(0, BLOCK_M)
            r_mask = rows < row_hi
            x_rows, x_mask = rows, r_mask
            if GATHER_X:  # x's row src[r]; -1 (a pad row) reads zeros
                src = tl.load(src_ptr + rows, mask=r_mask, other=-1)
                x_rows, x_mask = tl.maximum(src, 0), r_mask & (src >= 0)
            dy = tl.load(
                dy_ptr + rows[:, None].to(tl.int64) * stride_dym + cols_n[None, :] * stride_dyn,
                mask=r_mask[:, None] & n_mask[None, :], other=0.0,
            )  # fmt: skip
            x = tl.load(
                x_ptr + x_rows[:, None].to(tl.int64) * stride_xm + cols_k[None, :] * stride_xk,
                mask=x_mask[:, None] & k_mask[None, :], other=0.0,
            )  # fmt: skip
            if ROW_SCALE:
                p = tl.load(rw_ptr + rows, mask=r_mask, other=0.0).to(tl.float32)
                dy = (dy.to(tl.float32) * p[:, None]).to(dy_ptr.dtype.element_ty)
            if IEEE_DOT:
                acc = tl.dot(tl.trans(dy.to(tl.float32)), x.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(tl.trans(dy), x, acc)
        dw_ptrs = dw_ptr + e.to(tl.int64) * stride_we + cols_n[:, None] * stride_wn + cols_k[None, :] * stride_wk
        tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=n_mask[:, None] & k_mask[None, :])


@triton.jit
def _source_rows_kernel(row_map_ptr, src_ptr, T, K, stride_t, num_rows, BLOCK: tl.constexpr):
    """``src[row_map[t, k]] = t`` for ``k < K`` (rows are unique: plain stores, no atomics); ``src``
    must be pre-filled with ``-1`` (pad and tail rows). A row outside ``[0, num_rows)`` (``permute_pad``'s ``-1``
    for a dropped expert id, NOTE [dropped entries] (moe_compile/ops/permute_pad.py)) is skipped: the token's combine
    is NaN already (NOTE [poisoned tokens] (moe_compile/ops/unpad_unpermute.py))."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < T * K
    t = idx // K
    row = tl.load(row_map_ptr + t * stride_t + idx % K, mask=mask, other=-1)
    tl.store(src_ptr + row, t.to(tl.int32), mask=mask & (row >= 0) & (row < num_rows))
