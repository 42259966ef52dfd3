"""Triton kernels for the grouped GEMM ops in ``moe_compile.ops.grouped_mm`` (kernels only, no allocation).

Shape suffixes: ``M`` rows of the expert-major buffer, ``K`` reduction dim, ``N`` output dim, ``E`` experts.
``offs_E`` holds int32 cumulative END offsets: expert ``e`` owns rows ``[offs[e-1], offs[e])``.

NOTE [static grid over M tiles]:
The host never reads ``offs``. The grid covers a static bound on the number of row tiles,
``cdiv(M, BLOCK_M) + min(E, M) + 1``: every non-empty expert wastes at most one partial tile, plus the
tail tiles past ``offs[-1]``. Each program loads ``offs`` once, turns it into per-expert tile counts
and their inclusive prefix sum, and finds its expert with one vector compare:

    offs = [3, 3, 7]  BLOCK_M = 2     counts = [3, 0, 4]   tiles = [2, 0, 2]   tiles_end = [2, 2, 4]
    pid 0 -> e0 rows 0-1 | pid 1 -> e0 row 2 | pid 2 -> e2 rows 3-4 | pid 3 -> e2 rows 5-6
    pid 4.. -> tail: rows >= offs[-1] = 7 are written as zeros (if M > 7), later pids do nothing.

Weight formats (``W_FORMAT``): 0 plain (``w`` already in the compute dtype, any strides), 1 MXFP8
(``w`` float8_e4m3fn ``[E, N, K]``, ``w_scale`` uint8 e8m0 ``[E, N, K/32]``), 2 NVFP4 (``w`` int16
``[E, N, K/4]``: the packed uint8 ``[E, N, K/2]`` (low nibble first) viewed as words of four e2m1
codes; ``w_scale`` float8_e4m3fn ``[E, N, K/16]``; ``w_gscale`` fp32 ``[E]`` per-expert scale). MXFP8
tiles are decoded in registers with the same fp32 arithmetic as the PyTorch reference (bitwise the
reference's dequantised tile). NVFP4: NOTE [NVFP4 decode].

NOTE [NVFP4 decode]:
Dequantising to ``gscale * s * v`` (fp32 multiplies, then a cast) costs ~9 instructions per weight,
which bounds the kernel on sm90 (no FP4 hardware). Instead the tile holds ``v * s * 2**-7`` (e2m1
value times its e4m3 block scale: at most 6 significant bits, exact in bf16, fp16 and fp32) and the
per-expert ``gscale * 2**7`` multiplies the fp32 accumulator once, as hardware block-scaled GEMMs
apply their per-tensor scale (so no weight is rounded to bf16: the result differs from
dequantise-then-bf16 by that reference's rounding). A code's bits moved under the top mantissa bit of
a bf16/fp32 are ``v * 2**-126`` (code 1 is the denormal ``2**-127``); one exact multiply by
``s * 2**119`` finishes it. An int16 word holds codes k = 4j..4j+3: the tile comes back as its four
k-mod-4 column sets, each multiplied with the matching activation columns (no interleave, which would
cost a byte shuffle per pair). For bf16 on CUDA (``PTX_DECODE``) the bit moves run as inline PTX on
two words per 32-bit register (3-4 logic ops per pair of values) with one ``fma.rn.bf16x2`` for the
scale, ~5 instructions per weight in all; elsewhere as fp32 Triton ops (the interpreter has no bf16
arithmetic), bitwise the same tile (GPU test).

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
    # offsets outside [0, M] are invalid input (checked on CPU): clamped, so no row outside the buffer is read
    ends = tl.minimum(tl.maximum(ends, 0), M)
    starts = tl.minimum(tl.maximum(starts, 0), M)
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
def _e2m1x8_to_bf16(words, scale):
    """Inline PTX: int16 words of four e2m1 codes -> their codes 0, 1, 2, 3 as bf16 times ``scale``
    (bf16, broadcast like ``words``); NOTE [NVFP4 decode].

    Per two words ($4 = bytes b0 b1 | b2 b3, $5 = their scales as bf16x2): t = [b0, 0, b2, 0] puts
    one byte per 16-bit half; a low code (bits 0-3) moves to bits 6-8 (magnitude) and 15 (sign), a
    high code (bits 4-7) likewise; -0.0 as the addend keeps the product's sign of zero. One line (no
    newlines): Inductor copies kernel sources into generated modules.
    """
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t0, t1, a, b, nz; mov.b32 nz, 0x80008000; "
        "prmt.b32 t0, $4, 0, 0x4240; prmt.b32 t1, $4, 0, 0x4341; "
        "shl.b32 a, t0, 6; shl.b32 b, t0, 12; or.b32 a, a, b; and.b32 a, a, 0x81C081C0; "
        "fma.rn.bf16x2 $0, a, $5, nz; "
        "shl.b32 a, t0, 2; and.b32 a, a, 0x01C001C0; shl.b32 b, t0, 8; and.b32 b, b, 0x80008000; "
        "or.b32 a, a, b; fma.rn.bf16x2 $1, a, $5, nz; "
        "shl.b32 a, t1, 6; shl.b32 b, t1, 12; or.b32 a, a, b; and.b32 a, a, 0x81C081C0; "
        "fma.rn.bf16x2 $2, a, $5, nz; "
        "shl.b32 a, t1, 2; and.b32 a, a, 0x01C001C0; shl.b32 b, t1, 8; and.b32 b, b, 0x80008000; "
        "or.b32 a, a, b; fma.rn.bf16x2 $3, a, $5, nz; }",
        "=r,=r,=r,=r,r,r",
        [words, scale],
        dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=2,
    )


@triton.jit
def _e2m1_code(word, SHIFT: tl.constexpr):
    """The e2m1 code at bit ``SHIFT`` of int32 ``word`` as fp32 ``v * 2**-126``: its 3 magnitude bits
    on bits 22-24 (top mantissa bit, two lowest exponent bits), its sign on bit 31."""
    code = word >> SHIFT
    return (((code & 7) << 22) | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _nvfp4_tile(
    w_base, s, k0, K, col_mask, stride_wk,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, OUT_DTYPE: tl.constexpr, PTX_DECODE: tl.constexpr,
):  # fmt: skip
    """The NVFP4 ``[BLOCK_N, BLOCK_K]`` tile at ``k0`` as four ``[BLOCK_N, BLOCK_K/4]`` tiles of
    ``v * s * 2**-7`` in ``OUT_DTYPE``, of the k = 0, 1, 2, 3 mod 4 columns (zeros past ``K``/``N``).

    ``w_base`` points at int16 words of four codes, ``s`` is the tile's e4m3 scales (``_load_scales``);
    NOTE [NVFP4 decode].
    """
    # k0 is a multiple of BLOCK_K: the hint keeps 16-byte loads of the words
    kw = tl.multiple_of(k0 // 4, BLOCK_K // 4) + tl.arange(0, BLOCK_K // 4)
    words = tl.load(w_base + kw[None, :] * stride_wk, mask=col_mask[:, None] & (kw[None, :] < K // 4), other=0)
    # [BLOCK_N, blocks, 4 words]: a block's scale broadcasts along the last dim in registers
    words = words.reshape(BLOCK_N, BLOCK_K // NV_BLOCK, NV_BLOCK // 4)
    scale = (s.to(tl.float32) * 6.64613997892457936e35)[:, :, None]  # e4m3 * 2**119: exact, finite
    if PTX_DECODE:
        w0, w1, w2, w3 = _e2m1x8_to_bf16(words, scale.to(tl.bfloat16))
    else:  # v * 2**-126 * s * 2**119: exact in fp32 and in OUT_DTYPE (6 significant bits, in range)
        word = words.to(tl.int32)
        w0 = (_e2m1_code(word, 0) * scale).to(OUT_DTYPE)
        w1 = (_e2m1_code(word, 4) * scale).to(OUT_DTYPE)
        w2 = (_e2m1_code(word, 8) * scale).to(OUT_DTYPE)
        w3 = (_e2m1_code(word, 12) * scale).to(OUT_DTYPE)
    shape: tl.constexpr = (BLOCK_N, BLOCK_K // 4)
    return w0.reshape(shape), w1.reshape(shape), w2.reshape(shape), w3.reshape(shape)


@triton.jit
def _load_scales(
    s_base, k0, K, col_mask, stride_sk, W_FORMAT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):  # fmt: skip
    """The raw block scales of the ``[BLOCK_N, BLOCK_K]`` weight tile at ``k0`` (MXFP8: uint8 e8m0
    ``[BLOCK_N, BLOCK_K/32]``, 127 = 1.0 past ``K``; NVFP4: e4m3 ``[BLOCK_N, BLOCK_K/16]``, 0 past ``K``;
    plain: a dummy scalar).

    NOTE [scale prefetch]: the K loop loads these one step ahead. Byte loads are too narrow for the
    cp.async pipeline that carries the weight and activation tiles, so without the prefetch every
    step waited on a global load (the largest stall in the profile at commit ac9ea2f).
    """
    if W_FORMAT == W_MXFP8:
        sk = k0 // MX_BLOCK + tl.arange(0, BLOCK_K // MX_BLOCK)
        return tl.load(
            s_base + sk[None, :] * stride_sk, mask=col_mask[:, None] & (sk[None, :] < K // MX_BLOCK), other=127
        )
    elif W_FORMAT == W_NVFP4:
        sk = k0 // NV_BLOCK + tl.arange(0, BLOCK_K // NV_BLOCK)
        return tl.load(
            s_base + sk[None, :] * stride_sk, mask=col_mask[:, None] & (sk[None, :] < K // NV_BLOCK), other=0.0
        )
    else:
        return 0


@triton.jit
def _dequant_tile(
    w_base, s, k0, K, col_mask, stride_wk,
    W_FORMAT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, OUT_DTYPE: tl.constexpr,
):  # fmt: skip
    """The ``[BLOCK_N, BLOCK_K]`` weight tile at ``k0`` in ``OUT_DTYPE`` (zeros past ``K``/``N``).

    ``w_base`` is a ``[BLOCK_N, 1]`` pointer column of one expert's rows, ``s`` the tile's scales
    (``_load_scales``). MXFP8 tiles are decoded once per tile with the reference's fp32 arithmetic
    (bitwise the reference).
    """
    ks = k0 + tl.arange(0, BLOCK_K)
    if W_FORMAT == W_PLAIN:
        w = tl.load(w_base + ks[None, :] * stride_wk, mask=col_mask[:, None] & (ks[None, :] < K), other=0.0)
        return w.to(OUT_DTYPE)
    else:
        tl.static_assert(W_FORMAT == W_MXFP8, "NVFP4 tiles come from _nvfp4_tile")
        q = tl.load(w_base + ks[None, :] * stride_wk, mask=col_mask[:, None] & (ks[None, :] < K), other=0.0)
        w = q.to(tl.float32).reshape(BLOCK_N, BLOCK_K // MX_BLOCK, MX_BLOCK) * _decode_e8m0(s)[:, :, None]
        return w.reshape(BLOCK_N, BLOCK_K).to(OUT_DTYPE)


@triton.jit
def _dot(acc, x, w, IEEE_DOT: tl.constexpr, SWAP_AB: tl.constexpr):
    """``acc += x @ w^T`` (``[BLOCK_M, BLOCK_N]``), or its transpose ``w @ x^T`` when ``SWAP_AB``."""
    if IEEE_DOT:
        x = x.to(tl.float32)
        w = w.to(tl.float32)
        if SWAP_AB:
            acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    else:
        if SWAP_AB:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    return acc


@triton.jit
def _w_dot(
    acc, x, w_base, s, k0, K, col_mask, stride_wk,
    W_FORMAT: tl.constexpr, IEEE_DOT: tl.constexpr, SWAP_AB: tl.constexpr, PTX_DECODE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``acc += x @ W[:, k0:k0+BLOCK_K]^T`` for a loaded ``x`` tile, the weight tile decoded in registers
    (any format; NVFP4 without the per-expert scale, which the caller applies once: NOTE [NVFP4 decode])."""
    if W_FORMAT == W_NVFP4:
        w0, w1, w2, w3 = _nvfp4_tile(w_base, s, k0, K, col_mask, stride_wk, BLOCK_N, BLOCK_K, x.dtype, PTX_DECODE)
        # k = 4j + 2h + l: split l, then h
        x_l0, x_l1 = tl.split(x.reshape(BLOCK_M, BLOCK_K // 4, 2, 2))
        x0, x2 = tl.split(x_l0)
        x1, x3 = tl.split(x_l1)
        acc = _dot(acc, x0, w0, IEEE_DOT, SWAP_AB)
        acc = _dot(acc, x1, w1, IEEE_DOT, SWAP_AB)
        acc = _dot(acc, x2, w2, IEEE_DOT, SWAP_AB)
        acc = _dot(acc, x3, w3, IEEE_DOT, SWAP_AB)
    else:
        w = _dequant_tile(w_base, s, k0, K, col_mask, stride_wk, W_FORMAT, BLOCK_N, BLOCK_K, x.dtype)
        acc = _dot(acc, x, w, IEEE_DOT, SWAP_AB)
    return acc


@triton.jit
def _mma_step(
    acc, x_base, w_base, s, k0, K, row_mask, col_mask, stride_xk, stride_wk,
    W_FORMAT: tl.constexpr, IEEE_DOT: tl.constexpr, SWAP_AB: tl.constexpr, PTX_DECODE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One K step: ``acc += x[:, k0:k0+BLOCK_K] @ W[:, k0:k0+BLOCK_K]^T`` given the step's block scales ``s``."""
    ks = k0 + tl.arange(0, BLOCK_K)
    x = tl.load(x_base + ks[None, :] * stride_xk, mask=row_mask[:, None] & (ks[None, :] < K), other=0.0)
    return _w_dot(acc, x, w_base, s, k0, K, col_mask, stride_wk, W_FORMAT, IEEE_DOT, SWAP_AB, PTX_DECODE,
                  BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def _expert_operands(
    x_ptr, w_ptr, w_scale_ptr, w_gscale_ptr, rows, cols, e,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, W_FORMAT: tl.constexpr,
):  # fmt: skip
    """Pointer columns of the tile's activation rows and of expert ``e``'s weight / scale rows, and the
    factor for the fp32 accumulator: NVFP4's per-expert scale times ``2**7`` (NOTE [NVFP4 decode]),
    1.0 for the other formats."""
    x_base = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    w_base = w_ptr + e.to(tl.int64) * stride_we + cols[:, None].to(tl.int64) * stride_wn
    s_base = w_scale_ptr + e.to(tl.int64) * stride_se + cols[:, None].to(tl.int64) * stride_sn
    if W_FORMAT == W_NVFP4:
        acc_scale = tl.load(w_gscale_ptr + e) * 128.0
    else:
        acc_scale = 1.0
    return x_base, w_base, s_base, acc_scale


@triton.jit
def _expert_tile_gemm(
    x_ptr, w_ptr, w_scale_ptr, w_gscale_ptr, rows, cols, e, row_mask, col_mask, k_lo, k_hi, K,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
    W_FORMAT: tl.constexpr, IEEE_DOT: tl.constexpr, SWAP_AB: tl.constexpr, PTX_DECODE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """fp32 ``[BLOCK_M, BLOCK_N]`` = ``x[rows, k_lo:k_hi] @ W[e][cols, k_lo:k_hi]^T`` (NVFP4's
    per-expert scale applied), computed as ``(W x^T)^T`` when ``SWAP_AB``."""
    x_base, w_base, s_base, acc_scale = _expert_operands(
        x_ptr, w_ptr, w_scale_ptr, w_gscale_ptr, rows, cols, e,
        stride_xm, stride_we, stride_wn, stride_se, stride_sn, W_FORMAT,
    )  # fmt: skip
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    s = _load_scales(s_base, k_lo, K, col_mask, stride_sk, W_FORMAT, BLOCK_N, BLOCK_K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        s_next = _load_scales(s_base, k0 + BLOCK_K, K, col_mask, stride_sk, W_FORMAT, BLOCK_N, BLOCK_K)
        acc = _mma_step(
            acc, x_base, w_base, s, k0, K, row_mask, col_mask, stride_xk, stride_wk,
            W_FORMAT, IEEE_DOT, SWAP_AB, PTX_DECODE, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        s = s_next  # NOTE [scale prefetch]
    if W_FORMAT == W_NVFP4:
        acc = acc * acc_scale
    if SWAP_AB:
        out = tl.trans(acc)
    else:
        out = acc
    return out


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
    SWAP_AB: tl.constexpr,
    PTX_DECODE: tl.constexpr,
    K_ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    """``y[r, :] = x[r, :] @ W[e]^T`` for rows ``r`` of expert ``e``; rows ``>= offs[-1]`` are zeroed.

    1-D grid of ``NUM_M_SLOTS * cdiv(N, BLOCK_N)`` programs, ordered in groups of ``GROUP_M`` row
    tiles so that neighbouring programs share activation and weight tiles in L2 (prefill).
    ``SWAP_AB`` computes ``(W x^T)^T``: the decoded weight tile is the MMA's register operand.
    """
    K = K // K_ALIGN * K_ALIGN  # == K; shows the compiler K_ALIGN divides K (vector loads at the K edge)
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
    out = _expert_tile_gemm(
        x_ptr, w_ptr, w_scale_ptr, w_gscale_ptr, rows, cols, tl.minimum(e, E - 1), row_mask, col_mask, 0, k_end, K,
        stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
        W_FORMAT, IEEE_DOT, SWAP_AB, PTX_DECODE, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=out_mask)


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
    PTX_DECODE: tl.constexpr,
    K_ALIGN: tl.constexpr,
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
    K = K // K_ALIGN * K_ALIGN  # == K; shows the compiler K_ALIGN divides K (vector loads at the K edge)
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
    out = _expert_tile_gemm(
        x_ptr, w_ptr, w_scale_ptr, w_gscale_ptr, rows, cols, tl.minimum(e, E - 1), row_mask, col_mask, k_lo, k_hi, K,
        stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
        W_FORMAT, IEEE_DOT, SWAP_AB, PTX_DECODE, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
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
    row_hi = tl.minimum(tl.maximum(tl.load(offs_ptr + e), 0), M)  # (offsets outside [0, M] clamped)
    row_lo = tl.minimum(tl.maximum(tl.load(offs_ptr + e - 1, mask=e > 0, other=0), 0), M)
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


@triton.jit
def _zero_span(ptr, start, stop, BLOCK: tl.constexpr):
    """Zero ``ptr[start:stop]``, ``BLOCK`` elements per step (the tail of the zeroing kernels below)."""
    for i in range(start, stop, BLOCK):
        idx = i + tl.arange(0, BLOCK)
        tl.store(ptr + idx, tl.zeros([BLOCK], dtype=ptr.dtype.element_ty), mask=idx < stop)


@triton.jit
def _zero_empty_groups_kernel(w_ptr, offs_ptr, GROUP_NUMEL, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Zero ``w[e]`` (contiguous ``[E, ...]``) where expert ``e`` has no rows; one program per (expert, chunk).

    Programs of non-empty experts return after two loads, so the cost does not grow with the weights.
    """
    e = tl.program_id(0)
    chunk = tl.program_id(1)
    end = tl.load(offs_ptr + e)
    start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
    if end == start:
        base = w_ptr + e.to(tl.int64) * GROUP_NUMEL
        _zero_span(base, chunk * CHUNK, tl.minimum((chunk + 1) * CHUNK, GROUP_NUMEL), BLOCK)


@triton.jit
def _zero_rows_past_kernel(y_ptr, offs_ptr, NUM_EXPERTS, M, N, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Zero the rows ``>= offs[E - 1]`` of a contiguous ``[M, N]`` ``y``; one program per ``ROWS`` rows.

    Programs whose rows all lie below the end return after one load, so the cost is the tail's, not ``M``'s.
    """
    row0 = tl.program_id(0).to(tl.int64) * ROWS
    end = tl.load(offs_ptr + NUM_EXPERTS - 1).to(tl.int64)
    first = tl.maximum(row0, end)
    last = tl.minimum(row0 + ROWS, M)
    if first < last:
        _zero_span(y_ptr, first * N, last * N, BLOCK)
