"""Sync-free grouped GEMM ops: ``torch.ops.moe.grouped_mm`` and its weight-only quantised variants.

Shape suffixes: ``M`` rows of an expert-major buffer (static), ``K`` reduction dim, ``N`` output dim,
``E`` experts. Every op computes, for each expert ``e`` and each row ``r`` in ``[offs[e-1], offs[e])``,

    y_MN[r] = x_MK[r] @ w_ENK[e]^T          (fp32 accumulate, one cast to x's dtype)

and writes **zeros** to rows ``>= offs[-1]`` (``torch._grouped_mm`` leaves them uninitialised; a Triton kernel
writes only those rows). ``moe::grouped_mm(..., zero_tail=False)`` leaves them unspecified, for callers that never
read them (the fused experts forward without biases).
``offs_E`` is a device-side int32 tensor of cumulative END offsets (empty experts allowed); no op
ever reads it on the host, and every fake is static (output ``[M, N]``).

The ops (weight; CUDA; CPU):

- ``moe::grouped_mm``: bf16/fp16/fp32 ``[E, N, K]``, any strides; CUDA: bf16 on sm90/sm100 with 16-byte strides:
  ``torch._grouped_mm`` (CUTLASS, sync-free); else Triton; CPU: ``grouped_mm_reference``
- ``moe::grouped_mm_wgrad``: returns ``dW_ENK = dY^T X`` per expert; CUDA: bf16 sm90/sm100: ``torch._grouped_mm``
  2-D x 2-D; else Triton (one program per tile, no atomics); CPU: reference
- ``moe::grouped_mm_mxfp8``: e4m3 ``[E, N, K]`` + e8m0-as-uint8 ``[E, N, K/32]``; CUDA: Triton weight-only (dequantise
  tiles in registers); CPU: dequantise + reference
- ``moe::grouped_mm_nvfp4``: packed e2m1 uint8 ``[E, N, K/2]`` + e4m3 ``[E, N, K/16]`` + fp32 ``[E]``; CUDA: Triton
  weight-only (per-expert scale on the fp32 accumulator); CPU: dequantise + reference

Autograd: ``grouped_mm`` gives ``dX`` (a ``grouped_mm`` against ``w.transpose(1, 2)``) and ``dW``
(``grouped_mm_wgrad``), both deterministic. The quantised ops differentiate w.r.t. ``x`` only.
The dequantisers here reproduce torchao's ``MXTensor.dequantize`` / ``NVFP4Tensor.dequantize`` bit
for bit, with e8m0 scales held as uint8 (CPU Inductor has no C++ type for float8_e8m0fnu).
"""

from __future__ import annotations

import torch
import triton
from torch.library import triton_op, wrap_triton

from moe_compile.ops import _common
from moe_compile.ops.triton import grouped_mm as _kernels

MX_BLOCK = 32
NV_BLOCK = 16
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# e2m1 code (sign bit 3, exponent bits 1-2, mantissa bit 0) -> value
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


# ===== dequantisation and references (pure PyTorch, sync-free) =====


def decode_e8m0(scale_u8: torch.Tensor) -> torch.Tensor:
    """uint8 biased exponents -> fp32 ``2**(s - 127)`` (255 -> NaN), as torchao's ``get_fp_scale``."""
    s = scale_u8.view(torch.uint8).to(torch.int32)
    scale = (s << 23).view(torch.float32)
    scale = torch.where(s == 0, torch.full_like(scale, 2.0**-127), scale)
    return torch.where(s == 255, torch.full_like(scale, float("nan")), scale)


def dequantize_mxfp8(qdata: torch.Tensor, scale_u8: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``qdata`` e4m3 ``[..., N, K]``, ``scale_u8`` ``[..., N, K/32]`` -> ``dtype`` ``[..., N, K]``."""
    blocks = qdata.to(torch.float32).unflatten(-1, (-1, MX_BLOCK))
    return (blocks * decode_e8m0(scale_u8).unsqueeze(-1)).flatten(-2).to(dtype)


def dequantize_nvfp4(
    qdata: torch.Tensor, scale: torch.Tensor, expert_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Packed e2m1 ``[E, N, K/2]`` (low nibble first), e4m3 ``[E, N, K/16]``, fp32 ``[E]`` -> ``[E, N, K]``."""
    codes = torch.stack([qdata & 0xF, qdata >> 4], dim=-1).flatten(-2).to(torch.int32)
    # magnitude bits -> fp32 bits 22-24, sign -> bit 31: exactly value * 2**-126 (no host table, so
    # this captures in CUDA graphs); the Triton kernels decode the same way
    values = (((codes & 7) << 22) | ((codes & 8) << 28)).view(torch.float32) * 2.0**126
    values = values.unflatten(-1, (-1, NV_BLOCK))
    block_scale = expert_scale.view(-1, *([1] * (scale.dim() - 1))) * scale.to(torch.float32)
    return (values * block_scale.unsqueeze(-1)).flatten(-2).to(dtype)


def _expert_row_masks(offs_E: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Bool ``[E, M]``: row ``r`` belongs to expert ``e``."""
    rows = torch.arange(num_rows, device=offs_E.device, dtype=torch.int32)
    ends = offs_E.to(torch.int32)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    return (rows[None, :] >= starts[:, None]) & (rows[None, :] < ends[:, None])


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32  # fp64 only for gradcheck


def grouped_mm_reference(x_MK: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """Loop over experts (not over ``offs`` values): each row takes its own expert's product, fp32."""
    masks_EM = _expert_row_masks(offs_E, x_MK.shape[0])
    acc = _acc_dtype(x_MK.dtype)
    x32 = x_MK.to(acc)
    y = x32.new_zeros(x_MK.shape[0], w_ENK.shape[1])
    for e in range(w_ENK.shape[0]):
        y = torch.where(masks_EM[e, :, None], x32 @ w_ENK[e].to(acc).T, y)
    return y.to(x_MK.dtype)


def grouped_mm_wgrad_reference(dy_MN: torch.Tensor, x_MK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """``dW_ENK[e] = dY[rows of e]^T @ X[rows of e]`` (fp32 accumulate); empty experts give zeros."""
    masks_EM = _expert_row_masks(offs_E, x_MK.shape[0])
    acc = _acc_dtype(x_MK.dtype)
    dy32, x32 = dy_MN.to(acc), x_MK.to(acc)
    dw = [torch.where(masks_EM[e, :, None], dy32, 0.0).T @ x32 for e in range(offs_E.shape[0])]
    return torch.stack(dw).to(x_MK.dtype)


# ===== Triton launchers =====

_FORMATS = {"plain": 0, "mxfp8": 1, "nvfp4": 2}
# smallest BLOCK_K: one MMA K step (16) per operand; MXFP8 one scale block; NVFP4 splits the tile
# into its 4 k-mod-4 column sets (NOTE [NVFP4 decode] (moe_compile/ops/triton/grouped_mm.py)), each a 16-deep MMA at
# least
_MIN_BLOCK_K = {"plain": 16, "mxfp8": MX_BLOCK, "nvfp4": 64}


def _pick_config(M: int, E: int, N: int, K: int, fmt: str, num_sms: int | None, fp32: bool) -> dict:
    """Static tile config from shapes only (no autotune: it would bench inside CUDA graphs / compile).

    BLOCK_M covers about 1.5x the average rows per expert (one row tile per expert when routing is
    balanced: each weight tile is read once). Small BLOCK_M means weight-bandwidth bound: BLOCK_N
    shrinks until the active experts fill about two waves of SMs. Large BLOCK_M is MMA bound:
    128 x 128 tiles. ``benchmarks/bench_grouped_weight.py --sweep`` times alternatives on the GPU.
    """
    if num_sms is None:  # CPU tensors (interpreter): smallest legal tiles keep it fast
        block_k = max(32, _MIN_BLOCK_K[fmt])
        return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=block_k, GROUP_M=4, SWAP_AB=False, num_warps=4, num_stages=1)
    rows_per_expert = M / max(E, 1)
    block_m = min(max(_next_pow2(int(1.5 * rows_per_expert) + 1), 16), 128)
    if block_m <= 32:
        block_n = 128
        while block_n > 32 and min(E, M) * triton.cdiv(N, block_n) < 2 * num_sms:
            block_n //= 2
        # BLOCK_N * BLOCK_K = 8192 keeps the fp32 dequantised tile at 64 registers per thread
        cfg = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=8192 // block_n, GROUP_M=1, num_warps=4, num_stages=4)
    elif block_m == 64:
        cfg = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)
    else:
        cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
    cfg["SWAP_AB"] = False
    if fp32:
        cfg["BLOCK_K"] = 32
    min_k = _MIN_BLOCK_K[fmt]
    cfg["BLOCK_K"] = max(min(cfg["BLOCK_K"], _next_pow2(K)), min_k)
    cfg["BLOCK_N"] = max(min(cfg["BLOCK_N"], _next_pow2(N)), 16)
    return cfg


def _pick_decode_config(M: int, E: int, N: int, K: int, fmt: str, num_sms: int, fp32: bool) -> dict | None:
    """Tiles for ``_grouped_mm_decode_kernel`` when experts get few rows (``None``: use the tiled kernel).

    One row tile per expert (``BLOCK_M`` 16 or 32 covers ~1.5x the mean rows per expert), each
    weight tile streamed once; ``SPLIT_K`` grows until the active row tiles x N tiles fill one wave
    of SMs (at decode only ``min(E, M)`` experts are read), keeping >= 4 K tiles per split: past one
    wave the split-K reduction costs more than it hides (a sweep at commit f3611b3).
    """
    block_m = max(_next_pow2(int(1.5 * M / max(E, 1)) + 1), 16)
    if block_m > 32:
        return None
    active = min(E, M)  # row tiles with work, at most
    if fmt == "nvfp4" and not fp32:
        # 16384-value tiles, 64 x 256 or 128 x 128 (>= 8 K steps per program); never under 64 rows:
        # the swapped MMA takes the weight tile as its 64-row register operand (a sweep at commit 61a78ef, E128
        # H2048 I768, T 1-64)
        block_k = 256 if K >= 8 * 256 else 128
        block_n = 16384 // block_k
        if active * triton.cdiv(N, block_n) < 1.5 * num_sms and block_n > 64:
            block_n, block_k = 64, 256
        block_n = max(min(block_n, _next_pow2(N)), 16)
        block_k = max(min(block_k, _next_pow2(K)), _MIN_BLOCK_K[fmt])
    else:
        block_n = max(min(64, _next_pow2(N)), 16)
        if active * triton.cdiv(N, block_n) < 1.5 * num_sms and block_n > 32:
            block_n = 32  # 1-1.5 waves leave SMs idle in the last one: narrower tiles, more programs
        # 64 x 128 tiles: the fp32 dequantised tile at 64 registers per thread
        block_k = max(min(8192 // block_n, 256, _next_pow2(K)), _MIN_BLOCK_K[fmt])
    programs = active * triton.cdiv(N, block_n)
    split_k = 1
    while programs * split_k < num_sms and K >= 4 * split_k * block_k and split_k * M * N < 2**30:
        split_k *= 2
    return dict(
        KERNEL="decode", BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
        SWAP_AB=not fp32, num_warps=4, num_stages=3,
    )  # fmt: skip


def _ptx_decode_supported(x_MK: torch.Tensor) -> bool:
    """NOTE [NVFP4 decode] (moe_compile/ops/triton/grouped_mm.py): the inline-PTX path needs bf16 activations and
    ``fma.rn.bf16x2`` (sm80+)."""
    return x_MK.is_cuda and x_MK.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x_MK.device) >= (8, 0)


def grid_m_slots(M: int, E: int, block_m: int) -> int:
    """NOTE [static grid over M tiles] (moe_compile/ops/triton/grouped_mm.py): a static bound on the row tiles, tail
    tiles included."""
    return triton.cdiv(M, block_m) + min(E, M) + 1


def k_align(K: int) -> int:
    """The kernels' ``K_ALIGN``: the largest power of two (up to 64) dividing ``K``, so that masks at
    the K edge keep full-width vector loads (an NVFP4 row is int16 words: K % 32 gives 16 bytes)."""
    return min(K & -K, 64) if K else 64


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def launch_grouped_mm(
    x_MK: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor | None,
    w_gscale: torch.Tensor | None,
    offs_E: torch.Tensor,
    out_MN: torch.Tensor,
    fmt: str,
    kernels=None,
    config: dict | None = None,
) -> torch.Tensor:
    """Launch the grouped GEMM into ``out_MN``; ``kernels`` swaps in an interpreted kernel module.

    ``config`` (tiles, from ``_pick_decode_config`` / ``_pick_config`` when ``None``) with
    ``KERNEL="decode"`` runs ``_grouped_mm_decode_kernel`` (plus the split-K reduction), else
    ``_grouped_mm_kernel``.
    """
    kernels = kernels or _kernels
    M, K = x_MK.shape
    E, N = offs_E.shape[0], out_MN.shape[1]
    fp32 = x_MK.dtype == torch.float32
    traced = _common.is_traced(offs_E)
    if x_MK.is_cuda and traced:
        # NOTE [offs copy]: the store addresses depend on values loaded from offs, so Inductor's TTIR
        # analysis counts offs as written: a graph input would then be "mutated", which makes
        # cudagraph trees skip the graph. The kernels read a private copy instead (one tiny copy).
        # Eager calls (plain tensors; CUDA graphs captured from them too) need no copy.
        offs_E = offs_E.clone()
    if config is None and x_MK.is_cuda:
        num_sms = torch.cuda.get_device_properties(x_MK.device).multi_processor_count
        config = _pick_decode_config(M, E, N, K, fmt, num_sms, fp32) or _pick_config(M, E, N, K, fmt, num_sms, fp32)
    cfg = dict(config or _pick_config(M, E, N, K, fmt, None, fp32))
    if fmt == "nvfp4":
        # the kernels read int16 words of four codes (NOTE [NVFP4 decode] (moe_compile/ops/triton/grouped_mm.py))
        if w.stride(-1) != 1 or w.storage_offset() % 2:
            w = w.contiguous()
        w = w.view(torch.int16)
    scale = w_scale if w_scale is not None else w
    gscale = w_gscale if w_gscale is not None else offs_E
    ieee = fp32 or not x_MK.is_cuda
    # NOTE [NVFP4 decode] (moe_compile/ops/triton/grouped_mm.py): inline-PTX bit moves for bf16 on sm80+
    # (fma.rn.bf16x2); elsewhere Triton ops. Only NVFP4 reads it: the other formats skip the device-capability query.
    ptx = cfg.pop("PTX_DECODE", fmt == "nvfp4" and _ptx_decode_supported(x_MK))
    wrap = wrap_triton if x_MK.is_cuda else (lambda k: k)
    m_slots = grid_m_slots(M, E, cfg["BLOCK_M"])
    if cfg.pop("KERNEL", "tiled") == "decode":
        split_k = cfg.pop("SPLIT_K", 1)
        k_per_split = triton.cdiv(triton.cdiv(K, cfg["BLOCK_K"]), split_k) * cfg["BLOCK_K"]
        split_k = triton.cdiv(K, k_per_split)  # no empty splits
        part = out_MN if split_k == 1 else out_MN.new_empty(split_k, M, N, dtype=torch.float32)
        part_strides = (0, *out_MN.stride()) if split_k == 1 else part.stride()
        grid = (triton.cdiv(N, cfg["BLOCK_N"]), m_slots, split_k)
        wrap(kernels._grouped_mm_decode_kernel)[grid](
            x_MK, w, scale, gscale, offs_E, part,
            M, N, K, E, k_per_split,
            x_MK.stride(0), x_MK.stride(1),
            w.stride(0), w.stride(1), w.stride(2),
            scale.stride(0), scale.stride(1), scale.stride(-1),
            *part_strides,
            W_FORMAT=_FORMATS[fmt], IEEE_DOT=ieee, PTX_DECODE=ptx, K_ALIGN=k_align(K), BLOCK_E=max(_next_pow2(E), 16),
            **cfg,
        )  # fmt: skip
        if split_k > 1:
            block = 1024
            wrap(kernels._splitk_reduce_kernel)[(triton.cdiv(M * N, block),)](
                part, out_MN, M, N, split_k, out_MN.stride(0), out_MN.stride(1), BLOCK=block, num_warps=4
            )
        return out_MN
    cfg.setdefault("SWAP_AB", False)
    grid = (m_slots * triton.cdiv(N, cfg["BLOCK_N"]),)
    wrap(kernels._grouped_mm_kernel)[grid](
        x_MK, w, scale, gscale, offs_E, out_MN,
        M, N, K, E,
        x_MK.stride(0), x_MK.stride(1),
        w.stride(0), w.stride(1), w.stride(2),
        scale.stride(0), scale.stride(1), scale.stride(-1),
        out_MN.stride(0), out_MN.stride(1),
        m_slots,
        W_FORMAT=_FORMATS[fmt], IEEE_DOT=ieee, PTX_DECODE=ptx, K_ALIGN=k_align(K),
        BLOCK_E=max(_next_pow2(E), 16), **cfg,
    )  # fmt: skip
    return out_MN


def launch_grouped_mm_wgrad(
    dy_MN: torch.Tensor, x_MK: torch.Tensor, offs_E: torch.Tensor, out_ENK: torch.Tensor, kernels=None
) -> torch.Tensor:
    """Launch ``_grouped_mm_wgrad_kernel`` into ``out_ENK``."""
    kernels = kernels or _kernels
    M, K = x_MK.shape
    N, E = dy_MN.shape[1], offs_E.shape[0]
    fp32 = x_MK.dtype == torch.float32 or not x_MK.is_cuda
    if x_MK.is_cuda:
        bn, bk, bm, warps = (64, 64, 32, 4) if fp32 else (128, 128, 32, 8)
    else:
        bn, bk, bm, warps = 16, 16, 16, 4
    bn, bk = max(min(bn, _next_pow2(N)), 16), max(min(bk, _next_pow2(K)), 16)
    grid = (E, triton.cdiv(N, bn) * triton.cdiv(K, bk))
    kernel = wrap_triton(kernels._grouped_mm_wgrad_kernel) if x_MK.is_cuda else kernels._grouped_mm_wgrad_kernel
    kernel[grid](
        dy_MN, x_MK, offs_E, out_ENK,
        M, N, K, E,
        dy_MN.stride(0), dy_MN.stride(1),
        x_MK.stride(0), x_MK.stride(1),
        out_ENK.stride(0), out_ENK.stride(1), out_ENK.stride(2),
        IEEE_DOT=fp32, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
    )  # fmt: skip
    return out_ENK


def _use_cutlass_bf16(x: torch.Tensor, *mats: torch.Tensor) -> bool:
    """torch._grouped_mm is sync-free only on sm90/sm100 with bf16 operands whose non-unit strides and
    storage offsets are 16-byte multiples and that have a unit stride in one of the last two dims."""
    if not x.is_cuda or any(t.dtype != torch.bfloat16 for t in (x, *mats)):
        return False
    if torch.cuda.get_device_capability(x.device)[0] not in (9, 10):
        return False
    return all(
        1 in t.stride()[-2:] and t.storage_offset() % 8 == 0 and all(s % 8 == 0 for s in t.stride() if s != 1)
        for t in (x, *mats)
    )


def zero_empty_groups(w_ENK: torch.Tensor, offs_E: torch.Tensor, kernels=None) -> torch.Tensor:
    """Zero ``w_ENK[e]`` in place for every expert with no rows (``_grouped_mm`` leaves them unwritten).

    A Triton kernel that touches only the empty groups: the alternative, ``where(counts > 0, w, 0)``, reads
    and writes the whole weight gradient (a few hundred microseconds per projection at Qwen3-MoE's E128 H2048
    I768; measured at commit 9c70d28).
    """
    kernels = kernels or _kernels
    if not w_ENK.is_contiguous():
        raise ValueError(f"w_ENK must be contiguous, got strides {w_ENK.stride()}")
    group = w_ENK[0].numel()
    chunk = 1 << 16
    kernel = wrap_triton(kernels._zero_empty_groups_kernel) if w_ENK.is_cuda else kernels._zero_empty_groups_kernel
    kernel[(offs_E.shape[0], triton.cdiv(group, chunk))](w_ENK, offs_E, group, CHUNK=chunk, BLOCK=1024)
    return w_ENK


def zero_rows_past(y_MN: torch.Tensor, offs_E: torch.Tensor, kernels=None) -> torch.Tensor:
    """Zero ``y_MN[offs_E[-1]:]`` in place (``_grouped_mm`` leaves the rows past the last expert unwritten).

    A Triton kernel that writes only those rows: ``where(rows < offs_E[-1], y, 0)`` reads and writes all of
    ``y`` (about a tenth of a millisecond for the down projection's output at Qwen3-MoE's T4096 H2048 K8;
    measured at commit d7bb9d3).
    """
    kernels = kernels or _kernels
    if not y_MN.is_contiguous():
        raise ValueError(f"y_MN must be contiguous, got strides {y_MN.stride()}")
    M, N = y_MN.shape
    if M == 0 or N == 0:
        return y_MN
    rows = 64
    kernel = wrap_triton(kernels._zero_rows_past_kernel) if y_MN.is_cuda else kernels._zero_rows_past_kernel
    kernel[(triton.cdiv(M, rows),)](y_MN, offs_E, offs_E.shape[0], M, N, ROWS=rows, BLOCK=1024)
    return y_MN


# ===== ops =====


def _check_offsets_on_host(offs_E: torch.Tensor, num_rows: int) -> None:
    """Eager CPU: ``offs_E`` non-decreasing in ``[0, M]`` (``ValueError`` naming it). On CUDA the Triton kernels clamp
    offsets into ``[0, M]`` (no read outside ``x``); ``torch._grouped_mm`` (CUTLASS) checks nothing (its contract)."""
    if _common.host_values(offs_E):
        _common.check_offsets(offs_E, num_rows)


@triton_op("moe::grouped_mm", mutates_args=())
def _grouped_mm_op(
    x_MK: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor, zero_tail: bool = True
) -> torch.Tensor:
    if x_MK.device.type != "cuda":
        _check_offsets_on_host(offs_E, x_MK.shape[0])
        return grouped_mm_reference(x_MK, w_ENK, offs_E)
    if _use_cutlass_bf16(x_MK, w_ENK.transpose(-2, -1)):
        y_MN = torch._grouped_mm(x_MK, w_ENK.transpose(-2, -1), offs=offs_E)
        return zero_rows_past(y_MN, offs_E) if zero_tail else y_MN
    out = x_MK.new_empty(x_MK.shape[0], w_ENK.shape[1])
    return launch_grouped_mm(x_MK, w_ENK, None, None, offs_E, out, "plain")


@triton_op("moe::grouped_mm_wgrad", mutates_args=())
def _grouped_mm_wgrad_op(dy_MN: torch.Tensor, x_MK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    if x_MK.device.type != "cuda":
        _check_offsets_on_host(offs_E, x_MK.shape[0])
        return grouped_mm_wgrad_reference(dy_MN, x_MK, offs_E)
    if _use_cutlass_bf16(dy_MN.t(), x_MK):
        return zero_empty_groups(torch._grouped_mm(dy_MN.t(), x_MK, offs=offs_E).contiguous(), offs_E)
    out = x_MK.new_empty(offs_E.shape[0], dy_MN.shape[1], x_MK.shape[1])
    return launch_grouped_mm_wgrad(dy_MN, x_MK, offs_E, out)


@triton_op("moe::grouped_mm_mxfp8", mutates_args=())
def _grouped_mm_mxfp8_op(
    x_MK: torch.Tensor, qdata_ENK: torch.Tensor, scale_ENB: torch.Tensor, offs_E: torch.Tensor
) -> torch.Tensor:
    if x_MK.device.type != "cuda":
        _check_offsets_on_host(offs_E, x_MK.shape[0])
        return grouped_mm_reference(x_MK, dequantize_mxfp8(qdata_ENK, scale_ENB, x_MK.dtype), offs_E)
    out = x_MK.new_empty(x_MK.shape[0], qdata_ENK.shape[1])
    return launch_grouped_mm(x_MK, qdata_ENK, scale_ENB, None, offs_E, out, "mxfp8")


@triton_op("moe::grouped_mm_nvfp4", mutates_args=())
def _grouped_mm_nvfp4_op(
    x_MK: torch.Tensor,
    qdata_ENP: torch.Tensor,
    scale_ENB: torch.Tensor,
    expert_scale_E: torch.Tensor,
    offs_E: torch.Tensor,
) -> torch.Tensor:
    if x_MK.device.type != "cuda":
        _check_offsets_on_host(offs_E, x_MK.shape[0])
        w = dequantize_nvfp4(qdata_ENP, scale_ENB, expert_scale_E, x_MK.dtype)
        return grouped_mm_reference(x_MK, w, offs_E)
    out = x_MK.new_empty(x_MK.shape[0], qdata_ENP.shape[1])
    return launch_grouped_mm(x_MK, qdata_ENP, scale_ENB, expert_scale_E, offs_E, out, "nvfp4")


# ===== autograd =====


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _grouped_mm_setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[:3])
    ctx.zero_tail = inputs[3] if len(inputs) > 3 else True


def _grouped_mm_backward(ctx, dy_MN):
    x_MK, w_ENK, offs_E = ctx.saved_tensors
    dy_MN = dy_MN.contiguous()
    dx = _grouped_mm_op(dy_MN, w_ENK.transpose(1, 2), offs_E, ctx.zero_tail) if ctx.needs_input_grad[0] else None
    dw = _grouped_mm_wgrad_op(dy_MN, x_MK, offs_E) if ctx.needs_input_grad[1] else None
    return dx, dw, None, None


def _mxfp8_backward(ctx, dy_MN):
    x_MK, qdata, scale, offs_E = ctx.saved_tensors
    w = dequantize_mxfp8(qdata, scale, dy_MN.dtype)
    return _grouped_mm_op(dy_MN.contiguous(), w.transpose(1, 2), offs_E), None, None, None


def _nvfp4_backward(ctx, dy_MN):
    x_MK, qdata, scale, expert_scale, offs_E = ctx.saved_tensors
    w = dequantize_nvfp4(qdata, scale, expert_scale, dy_MN.dtype)
    return _grouped_mm_op(dy_MN.contiguous(), w.transpose(1, 2), offs_E), None, None, None, None


_grouped_mm_op.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup_context)
_grouped_mm_mxfp8_op.register_autograd(_mxfp8_backward, setup_context=_setup_context)
_grouped_mm_nvfp4_op.register_autograd(_nvfp4_backward, setup_context=_setup_context)


# ===== public wrappers =====


def _check_common(x_MK: torch.Tensor, offs_E: torch.Tensor, num_experts: int, k: int) -> None:
    for name, t in (("x_MK", x_MK), ("offs_E", offs_E)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x_MK.dim() != 2:
        raise ValueError(f"x_MK must be 2-D [M, K], got shape {tuple(x_MK.shape)}")
    if x_MK.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"x_MK.dtype={x_MK.dtype} is not supported; use one of {_FLOAT_DTYPES}")
    if offs_E.dim() != 1 or offs_E.dtype != torch.int32:
        raise ValueError(f"offs_E must be a 1-D int32 tensor, got {offs_E.dtype} {tuple(offs_E.shape)}")
    if offs_E.shape[0] != num_experts:
        raise ValueError(f"offs_E has {offs_E.shape[0]} entries but the weight has {num_experts} experts")
    if x_MK.shape[1] != k:
        raise ValueError(f"x_MK.shape[1]={x_MK.shape[1]} does not match the weight's K={k}")


def check_mxfp8_weight(qdata_ENK: torch.Tensor, scale_ENB: torch.Tensor) -> None:
    """Raise naming the argument unless ``qdata`` / ``scale`` are an MXFP8 weight (e4m3 + e8m0 as uint8)."""
    if not isinstance(qdata_ENK, torch.Tensor) or qdata_ENK.dim() != 3 or qdata_ENK.dtype != torch.float8_e4m3fn:
        got = f"{qdata_ENK.dtype} {tuple(qdata_ENK.shape)}" if isinstance(qdata_ENK, torch.Tensor) else qdata_ENK
        raise ValueError(f"qdata_ENK must be float8_e4m3fn [E, N, K], got {got}")
    E, N, K = qdata_ENK.shape
    if K % MX_BLOCK:
        raise ValueError(f"qdata_ENK's K={K} must be a multiple of {MX_BLOCK} (one e8m0 scale per {MX_BLOCK} values)")
    if (
        not isinstance(scale_ENB, torch.Tensor)
        or scale_ENB.dtype not in (torch.uint8, torch.float8_e8m0fnu)
        or tuple(scale_ENB.shape) != (E, N, K // MX_BLOCK)
    ):
        got = f"{scale_ENB.dtype} {tuple(scale_ENB.shape)}" if isinstance(scale_ENB, torch.Tensor) else scale_ENB
        raise ValueError(f"scale_ENB must be uint8 [{E}, {N}, {K // MX_BLOCK}], got {got}")
    _common.check_same_device(qdata_ENK=qdata_ENK, scale_ENB=scale_ENB)


def check_nvfp4_weight(qdata_ENP: torch.Tensor, scale_ENB: torch.Tensor, expert_scale_E: torch.Tensor) -> None:
    """Raise naming the argument unless the three tensors are an NVFP4 weight (packed e2m1, e4m3, fp32 ``[E]``)."""
    if not isinstance(qdata_ENP, torch.Tensor) or qdata_ENP.dim() != 3 or qdata_ENP.dtype != torch.uint8:
        got = f"{qdata_ENP.dtype} {tuple(qdata_ENP.shape)}" if isinstance(qdata_ENP, torch.Tensor) else qdata_ENP
        raise ValueError(f"qdata_ENP must be uint8 [E, N, K/2], got {got}")
    E, N, K = qdata_ENP.shape[0], qdata_ENP.shape[1], qdata_ENP.shape[2] * 2
    if K % NV_BLOCK:
        raise ValueError(f"qdata_ENP's K={K} must be a multiple of {NV_BLOCK} (one e4m3 scale per {NV_BLOCK} values)")
    if (
        not isinstance(scale_ENB, torch.Tensor)
        or scale_ENB.dtype != torch.float8_e4m3fn
        or tuple(scale_ENB.shape) != (E, N, K // NV_BLOCK)
    ):
        got = f"{scale_ENB.dtype} {tuple(scale_ENB.shape)}" if isinstance(scale_ENB, torch.Tensor) else scale_ENB
        raise ValueError(f"scale_ENB must be float8_e4m3fn [{E}, {N}, {K // NV_BLOCK}], got {got}")
    if (
        not isinstance(expert_scale_E, torch.Tensor)
        or expert_scale_E.dtype != torch.float32
        or expert_scale_E.numel() != E
    ):
        got = (f"{expert_scale_E.dtype} {tuple(expert_scale_E.shape)}" if isinstance(expert_scale_E, torch.Tensor)
               else expert_scale_E)
        raise ValueError(f"expert_scale_E must be fp32 with {E} elements, got {got}")
    _common.check_same_device(qdata_ENP=qdata_ENP, scale_ENB=scale_ENB, expert_scale_E=expert_scale_E)


def grouped_mm(
    x_MK: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor, *, zero_tail: bool = True
) -> torch.Tensor:
    """``y_MN = x_MK @ w_ENK[e]^T`` per expert segment of ``offs_E``; rows ``>= offs[-1]`` are zero.

    Args:
        x_MK: ``[M, K]`` bf16/fp16/fp32, expert-major rows.
        w_ENK: ``[E, N, K]``, same dtype as ``x_MK``, any strides (a ``w.transpose(1, 2)`` view works).
        offs_E: int32 ``[E]`` cumulative end offsets, on ``x_MK``'s device, non-decreasing in ``[0, M]``: CPU checks
            (``ValueError``); the Triton kernels clamp them into ``[0, M]`` (never reading outside ``x``);
            ``torch._grouped_mm`` (bf16 on sm90/sm100) takes them as they are, as PyTorch documents.
        zero_tail: ``False`` leaves the rows ``>= offs[-1]`` (and those of ``dX``) unspecified, for callers
            that never read them (one launch less per GEMM where CUTLASS runs it).

    Returns:
        ``[M, N]`` in ``x_MK.dtype``. Differentiable w.r.t. ``x_MK`` and ``w_ENK`` (deterministic).
    """
    if not isinstance(w_ENK, torch.Tensor) or w_ENK.dim() != 3:
        raise ValueError(f"w_ENK must be 3-D [E, N, K], got shape {tuple(getattr(w_ENK, 'shape', ()))}")
    _check_common(x_MK, offs_E, w_ENK.shape[0], w_ENK.shape[2])
    if w_ENK.dtype != x_MK.dtype:
        raise TypeError(f"w_ENK.dtype={w_ENK.dtype} must equal x_MK.dtype={x_MK.dtype}")
    _common.check_same_device(x_MK=x_MK, w_ENK=w_ENK, offs_E=offs_E)
    _common.check_bool(zero_tail, "zero_tail")
    return _grouped_mm_op(x_MK, w_ENK, offs_E, zero_tail)


def grouped_mm_mxfp8(
    x_MK: torch.Tensor, qdata_ENK: torch.Tensor, scale_ENB: torch.Tensor, offs_E: torch.Tensor
) -> torch.Tensor:
    """Weight-only MXFP8 grouped GEMM: ``qdata_ENK`` float8_e4m3fn, ``scale_ENB`` uint8 e8m0 ``[E, N, K/32]``."""
    check_mxfp8_weight(qdata_ENK, scale_ENB)
    E, K = qdata_ENK.shape[0], qdata_ENK.shape[2]
    _check_common(x_MK, offs_E, E, K)
    _common.check_same_device(x_MK=x_MK, qdata_ENK=qdata_ENK, offs_E=offs_E)
    return _grouped_mm_mxfp8_op(x_MK, qdata_ENK, scale_ENB.view(torch.uint8), offs_E)


def grouped_mm_nvfp4(
    x_MK: torch.Tensor,
    qdata_ENP: torch.Tensor,
    scale_ENB: torch.Tensor,
    expert_scale_E: torch.Tensor,
    offs_E: torch.Tensor,
) -> torch.Tensor:
    """Weight-only NVFP4 grouped GEMM: packed uint8 ``[E, N, K/2]``, e4m3 ``[E, N, K/16]``, fp32 ``[E]``."""
    check_nvfp4_weight(qdata_ENP, scale_ENB, expert_scale_E)
    E, K = qdata_ENP.shape[0], qdata_ENP.shape[2] * 2
    _check_common(x_MK, offs_E, E, K)
    _common.check_same_device(x_MK=x_MK, qdata_ENP=qdata_ENP, offs_E=offs_E)
    return _grouped_mm_nvfp4_op(x_MK, qdata_ENP, scale_ENB, expert_scale_E.reshape(E), offs_E)


def weight_only_grouped_mm(
    x_MK: torch.Tensor,
    qdata: torch.Tensor,
    scale: torch.Tensor,
    expert_scale_E: torch.Tensor | None,
    offs_E: torch.Tensor,
    fmt: str,
) -> torch.Tensor:
    """``x @ W[e]^T`` through the weight-only op of ``fmt`` (``moe::grouped_mm_mxfp8``, which takes no
    ``expert_scale_E``, or ``moe::grouped_mm_nvfp4``), on operands the caller already holds in the ops' layouts."""
    if fmt == "mxfp8":
        return torch.ops.moe.grouped_mm_mxfp8(x_MK, qdata, scale, offs_E)
    if fmt == "nvfp4":
        return torch.ops.moe.grouped_mm_nvfp4(x_MK, qdata, scale, expert_scale_E, offs_E)
    raise ValueError(f"fmt={fmt!r} is not a quantised format; use 'mxfp8' or 'nvfp4'")

