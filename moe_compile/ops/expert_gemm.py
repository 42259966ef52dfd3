"""``torch.ops.moe.expert_gemm`` (+ ``_mxfp8`` / ``_nvfp4``): one expert-MLP GEMM with fused gather and epilogue.

Shape suffixes: ``S`` source rows (tokens ``T`` when gathering, else ``M``), ``M`` rows of the
expert-major padded buffer (``num_rows``), ``K`` reduction dim, ``N`` weight rows, ``E`` experts.
For each expert ``e`` and row ``r`` in ``[offs[e-1], offs[e])``:

    a[r]   = x[src(r)] if row_map is given (src(r): the token of permuted row r; pad rows read 0) else x[r]
    pre[r] = a[r] @ w[e]^T                        (fp32 accumulate)
    y[r]   = rw[r] * act(pre[r, :N/2]) * pre[r, N/2:]   (activation "swiglu" / "geglu": gate; up stacked)
    y[r]   = rw[r] * pre[r]                        (activation "none")

``rw`` (``row_weight``, ``[M]``) is optional (1); rows ``>= offs[-1]`` of ``y`` are zero. ``pre`` (in
``x``'s dtype) is returned when ``store_preact`` (the gated backward reads it), else an empty tensor.
``row_map`` is ``permute_pad``'s ``[T, 2K]`` map (dispatch contract), so the permuted copy of ``x`` is
never written (NOTE [gather prologue] (moe_compile/ops/triton/expert_gemm.py)).

CUDA: the persistent Triton kernel family of ``ops/triton/expert_gemm.py``, unless
:func:`use_triton_grouped_gemm` says the library wins for the shape (bf16 plain weights on sm90/sm100:
``torch._grouped_mm``; quantised weights: the weight-only ``moe::grouped_mm_<fmt>`` kernels; either plus a
PyTorch gather and the epilogue: one Triton pass in eager, PyTorch expressions that Inductor fuses when traced,
NOTE [standalone epilogues] (moe_compile/ops/triton/expert_epilogue.py); same semantics). CPU: the reference.

Autograd (plain weights; quantised ops differentiate w.r.t. ``x`` and ``row_weight``): the epilogue's
backward is one Triton pass in eager on CUDA, elementwise PyTorch otherwise (Inductor fuses it), ``dX`` is
an ``expert_gemm`` against ``w.transpose(1, 2)`` followed, when gathering, by the deterministic gather-sum of
``unpad_unpermute``; ``dW`` is ``moe::expert_wgrad`` (persistent, fixed order, the ``x`` operand gathered through the
row map). Every step is deterministic.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
from torch.library import triton_op, wrap_triton
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from moe_compile.config import env_setting
from moe_compile.ops import _common
from moe_compile.ops import grouped_mm as gmm
from moe_compile.ops._expert_gemm_tuning import gemm_kind, pick_config, use_triton_grouped_gemm, wgrad_config
from moe_compile.ops.expert_epilogue import (
    ACTIVATIONS,
    launch_epilogue,
    launch_epilogue_backward,
    launch_row_scale_backward,
)
from moe_compile.ops.triton import expert_gemm as _kernels
from moe_compile.ops.unpad_unpermute import unpad_unpermute

# ===== references (pure PyTorch, sync-free) =====


def source_rows_reference(row_map: torch.Tensor, num_rows: int) -> torch.Tensor:
    """int32 ``[num_rows]``: the token of each permuted row, ``-1`` for pad and tail rows. Rows of the map outside
    ``[0, num_rows)`` (a dropped entry's ``-1``) are skipped, as the kernel skips them."""
    T, K = row_map.shape[0], row_map.shape[1] // 2
    src = torch.full((num_rows + 1,), -1, dtype=torch.int32, device=row_map.device)
    tokens = torch.arange(T, device=row_map.device, dtype=torch.int32).repeat_interleave(K)
    rows = row_map[:, :K].reshape(-1).long()
    rows = torch.where((rows >= 0) & (rows < num_rows), rows, num_rows)  # into the extra last slot, dropped
    return src.index_put((rows,), tokens)[:num_rows]  # rows are unique: no accumulation


# the gated activations the kernels fuse (``activation`` names), each with the function of the gate it stands for
GLU_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "swiglu": torch.nn.functional.silu,
    "geglu": torch.nn.functional.gelu,  # erf GELU; the tanh approximation is another function
}


def _act_fp32(g: torch.Tensor, activation: str) -> torch.Tensor:
    return GLU_ACTIVATIONS[activation](g)


def _act_grad_fp32(g: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "swiglu":
        s = torch.sigmoid(g)
        return s * (1 + g * (1 - s))
    return 0.5 * (1 + torch.erf(g * 0.5**0.5)) + g * torch.exp(-0.5 * g * g) * (2 * torch.pi) ** -0.5


def gather_rows(x_SK: torch.Tensor, src_M: torch.Tensor | None) -> torch.Tensor:
    """``x[src]`` with zero rows where ``src < 0`` (the permuted copy the gather prologue avoids); ``x`` itself
    when there is no row map (``src`` None)."""
    if src_M is None:
        return x_SK
    # one gather from x with a zero row appended (pad rows read it): one pass over the M rows, not two
    x_zero = torch.cat([x_SK, x_SK.new_zeros(1, x_SK.shape[1])])
    return x_zero.index_select(0, torch.where(src_M >= 0, src_M, x_SK.shape[0]).long())


def expert_gemm_reference(
    x_SK: torch.Tensor,
    w_ENK: torch.Tensor,
    offs_E: torch.Tensor,
    src_M: torch.Tensor | None,
    row_weight_M: torch.Tensor | None,
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, pre)`` in ``x``'s dtype; fp32 (fp64 for fp64) math, one cast per output."""
    a = gather_rows(x_SK, src_M)
    acc = torch.float64 if x_SK.dtype == torch.float64 else torch.float32
    pre = gmm.grouped_mm_reference(a.to(acc), w_ENK.to(acc), offs_E)  # rows past offs[-1] are 0
    if activation != "none":
        n = pre.shape[1] // 2
        out = _act_fp32(pre[:, :n], activation) * pre[:, n:]
    else:
        out = pre
    if row_weight_M is not None:
        out = out * row_weight_M.to(acc)[:, None]
    return out.to(x_SK.dtype), pre.to(x_SK.dtype)


# ===== launchers =====


@functools.lru_cache(maxsize=8)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _tma_enabled(x: torch.Tensor, fmt: str) -> bool:
    """TMA loads (NOTE [TMA loads] (moe_compile/ops/triton/expert_gemm.py)) on sm90+; ``MOE_COMPILE_TMA=0`` turns
    them off. The descriptors' scratch memory comes from Triton's allocator: ``_set_tma_allocator`` in eager, and
    Inductor sets its own around the kernels it launches (torch 2.11 and 2.13 both do)."""
    if not env_setting("tma") or fmt != "plain" or not x.is_cuda or x.dtype == torch.float32:
        return False
    return hasattr(triton, "set_allocator") and torch.cuda.get_device_capability(x.device)[0] >= 9


def _tma_layout(
    x: torch.Tensor, src: torch.Tensor | None, w: torch.Tensor, gated: bool, enabled: bool, rows: int | None = None
) -> dict:
    """``USE_TMA`` / ``W_KN`` / ``X_TMA``: which operands come through tensor descriptors. The weight when its
    storage is ``[E, N, K]`` or (un-gated) ``[E, K, N]`` with 16-byte rows; the activations when, in addition,
    they are not gathered, have 16-byte rows and exactly the ``rows`` of the output (default: ``x``'s) that the
    descriptor spans."""
    off = dict(USE_TMA=False, W_KN=False, X_TMA=False)
    if not enabled:
        return off

    def aligned(t: torch.Tensor, stride: int) -> bool:
        # traced (fake tensors have no address): the storage's base is taken as aligned, as Inductor takes it
        base = t.storage_offset() * t.element_size() if _common.is_traced(t) else t.data_ptr()
        return stride * t.element_size() % 16 == 0 and base % 16 == 0

    if w.is_contiguous():
        w_kn = False
    elif not gated and w.transpose(1, 2).is_contiguous():
        w_kn = True
    else:
        return off
    if not (aligned(w, w.stride(2) if w_kn else w.stride(1)) and aligned(w, w.stride(0))):
        return off
    spans_rows = rows is None or x.shape[0] == rows
    x_tma = src is None and spans_rows and x.stride(1) == 1 and aligned(x, x.stride(0))
    return dict(USE_TMA=True, W_KN=w_kn, X_TMA=x_tma)


def _set_tma_allocator() -> None:
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))


def launch_expert_gemm(
    x_SK: torch.Tensor,
    src_M: torch.Tensor | None,
    w: torch.Tensor,
    w_scale: torch.Tensor | None,
    w_gscale: torch.Tensor | None,
    offs_E: torch.Tensor,
    row_weight_M: torch.Tensor | None,
    y_MN: torch.Tensor,
    pre_MW: torch.Tensor | None,
    activation: str,
    fmt: str,
    kernels=None,
    config: dict | None = None,
) -> torch.Tensor:
    """Launch ``_expert_gemm_kernel`` into ``y_MN`` (and ``pre_MW``); ``kernels`` swaps in an interpreted module.

    ``w`` is ``[E, N_w, K]`` (``N_w = 2 N`` when gated; NVFP4: packed uint8 ``[E, N_w, K/2]``).
    ``config`` adds ``USE_TMA`` (the operands' layouts then say which come through descriptors; ``X_TMA`` /
    ``W_KN`` override that) / ``NUM_PROGS`` / tile keys over :func:`pick_config`'s choice.
    """
    kernels = kernels or _kernels
    M, N = y_MN.shape
    K = x_SK.shape[1]
    E = offs_E.shape[0]
    gated = activation != "none"
    fp32 = x_SK.dtype == torch.float32
    if x_SK.is_cuda and _common.is_traced(offs_E):
        offs_E = offs_E.clone()  # NOTE [offs copy] (moe_compile/ops/grouped_mm.py)
    config = dict(config or {})
    want_tma = config.pop("USE_TMA", None)
    enabled = _tma_enabled(x_SK, fmt) if want_tma is None else want_tma
    tma = _tma_layout(x_SK, src_M, w, gated, enabled and fmt == "plain", rows=M)  # the kernel's TMA path: plain
    tma.update({k: config.pop(k) for k in ("W_KN", "X_TMA") if k in config})
    cfg = pick_config(M, E, N, K, fmt, fp32, gated, x_SK.is_cuda, tma_nk=tma["USE_TMA"] and not tma["W_KN"])
    cfg.update(config)
    if fmt == "nvfp4":  # int16 words of four codes (NOTE [NVFP4 decode] (moe_compile/ops/triton/grouped_mm.py))
        if w.stride(-1) != 1 or w.storage_offset() % 2:
            w = w.contiguous()
        w = w.view(torch.int16)
    if (tma["USE_TMA"] or tma["X_TMA"]) and x_SK.is_cuda:
        _set_tma_allocator()
    num_progs = cfg.pop("NUM_PROGS", None)
    if num_progs is None:
        if x_SK.is_cuda:
            # at most one program per tile of a balanced routing; about one (big tiles) or two per SM
            per_sm = 1 if cfg["BLOCK_M"] * cfg["BLOCK_N"] >= 128 * 128 or gated else 2
            num_progs = per_sm * _num_sms(x_SK.device.index or 0)
        else:
            num_progs = 3  # interpreter: a few programs, each walking several tiles
    bound = gmm.grid_m_slots(M, E, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"])
    num_progs = max(1, min(num_progs, bound))
    scale = w_scale if w_scale is not None else w
    gscale = w_gscale if w_gscale is not None else offs_E
    src = src_M if src_M is not None else offs_E
    rw = _common.unit_last_stride(row_weight_M) if row_weight_M is not None else offs_E
    pre = pre_MW
    if pre is None:  # an unused dummy; traced, not y itself: an output passed twice breaks a failed mutation analysis
        pre = y_MN.new_empty(1, 1) if _common.is_traced(y_MN) and x_SK.is_cuda else y_MN
    ptx = cfg.pop("PTX_DECODE", fmt == "nvfp4" and gmm._ptx_decode_supported(x_SK))
    wrap = wrap_triton if x_SK.is_cuda else (lambda k: k)
    wrap(kernels._expert_gemm_kernel)[(num_progs,)](
        x_SK, src, w, scale, gscale, offs_E, rw, y_MN, pre,
        M, N, K, E, num_progs,
        x_SK.stride(0), x_SK.stride(1),
        w.stride(0), w.stride(1), w.stride(2),
        scale.stride(0), scale.stride(1), scale.stride(-1),
        y_MN.stride(0), y_MN.stride(1),
        pre.stride(0), pre.stride(1),
        GATHER=src_M is not None, ACT=ACTIVATIONS[activation], ROW_SCALE=row_weight_M is not None,
        STORE_PRE=pre_MW is not None, W_FORMAT=gmm._FORMATS[fmt], IEEE_DOT=fp32 or not x_SK.is_cuda,
        PTX_DECODE=ptx, K_ALIGN=gmm.k_align(K), BLOCK_E=max(gmm._next_pow2(E), 16), **tma, **cfg,
    )  # fmt: skip
    return y_MN


def launch_expert_wgrad(
    dy_MN: torch.Tensor,
    x_SK: torch.Tensor,
    src_M: torch.Tensor | None,
    row_weight_M: torch.Tensor | None,
    offs_E: torch.Tensor,
    out_ENK: torch.Tensor,
    kernels=None,
    config: dict | None = None,
) -> torch.Tensor:
    """Launch ``_expert_wgrad_kernel``: ``dW[e] = (rw * dy)[rows of e]^T @ x[src(rows of e)]``."""
    kernels = kernels or _kernels
    M, N = dy_MN.shape
    K, E = x_SK.shape[1], offs_E.shape[0]
    fp32 = x_SK.dtype == torch.float32 or not x_SK.is_cuda
    cfg = wgrad_config(N, K, fp32, x_SK.is_cuda, row_weight_M is not None)
    cfg.update(config or {})
    tiles = E * triton.cdiv(N, cfg["BLOCK_N"]) * triton.cdiv(K, cfg["BLOCK_K"])
    num_progs = cfg.pop("NUM_PROGS", None) or (_num_sms(x_SK.device.index or 0) if x_SK.is_cuda else 3)
    num_progs = max(1, min(num_progs, tiles))
    wrap = wrap_triton if x_SK.is_cuda else (lambda k: k)
    src = src_M if src_M is not None else offs_E
    rw = _common.unit_last_stride(row_weight_M) if row_weight_M is not None else offs_E
    wrap(kernels._expert_wgrad_kernel)[(num_progs,)](
        dy_MN, x_SK, src, rw, offs_E, out_ENK,
        M, N, K, E, num_progs,
        dy_MN.stride(0), dy_MN.stride(1),
        x_SK.stride(0), x_SK.stride(1),
        out_ENK.stride(0), out_ENK.stride(1), out_ENK.stride(2),
        GATHER_X=src_M is not None, ROW_SCALE=row_weight_M is not None, IEEE_DOT=fp32, **cfg,
    )  # fmt: skip
    return out_ENK


def source_rows(row_map: torch.Tensor | None, num_rows: int, kernels=None) -> torch.Tensor | None:
    """int32 ``[num_rows]``: token of each permuted row (``-1``: pad / tail); one scatter of unique rows
    (the reference off CUDA). None without a row map (rows not permuted: :func:`gather_rows` reads ``x``)."""
    if row_map is None:
        return None
    if not row_map.is_cuda:
        return source_rows_reference(row_map, num_rows)
    kernels = kernels or _kernels
    T, K = row_map.shape[0], row_map.shape[1] // 2
    src = torch.full((num_rows,), -1, dtype=torch.int32, device=row_map.device)
    row_map = _common.unit_last_stride(row_map)
    block = 1024
    wrap_triton(kernels._source_rows_kernel)[(max(triton.cdiv(T * K, block), 1),)](
        row_map, src, T, K, row_map.stride(0), num_rows, BLOCK=block
    )
    return src


# ===== ops =====


def _out_cols(w: torch.Tensor, activation: str, fmt: str) -> tuple[int, int]:
    """``(N, N_w)``: output columns and weight rows."""
    n_w = w.shape[1]
    return (n_w // 2 if activation != "none" else n_w), n_w


def _dense_weight(w, w_scale, w_gscale, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    if fmt == "mxfp8":
        return gmm.dequantize_mxfp8(w, w_scale, dtype)
    if fmt == "nvfp4":
        return gmm.dequantize_nvfp4(w, w_scale, w_gscale, dtype)
    return w


def _check_op_args(x_SK: torch.Tensor, offs_E: torch.Tensor, row_map: torch.Tensor | None, num_rows: int) -> None:
    """What every call of the ops checks (the wrapper checks the rest): the gather reads ``x_SK`` rows ``< T``, so
    ``row_map`` must have one row per row of ``x_SK``; eager CPU also checks the values (``offs_E`` non-decreasing in
    ``[0, num_rows]``, ``row_map`` rows in ``[0, num_rows)``). On CUDA the kernels clamp offsets into ``[0, M]`` and
    skip map rows outside ``[0, M)`` (a dropped entry's ``-1``,
    NOTE [dropped entries] (moe_compile/ops/permute_pad.py)), so nothing outside a tensor is read."""
    if row_map is not None and row_map.shape[0] != x_SK.shape[0]:
        raise ValueError(f"row_map must have one row per token of x_SK: row_map.shape={tuple(row_map.shape)}, "
                         f"x_SK.shape={tuple(x_SK.shape)}")
    if _common.host_values(offs_E, row_map):
        _common.check_offsets(offs_E, num_rows)
        if row_map is not None:
            _common.check_ids_in_range(row_map[:, : row_map.shape[1] // 2], 0, num_rows, "row_map (rows)")


def _expert_gemm_body(
    x_SK, w, w_scale, w_gscale, offs_E, row_map, row_weight_M, activation, num_rows, store_preact, fmt
):
    _check_op_args(x_SK, offs_E, row_map, num_rows)
    N, N_w = _out_cols(w, activation, fmt)
    store = store_preact and activation != "none"
    src = source_rows(row_map, num_rows)
    if x_SK.device.type != "cuda":
        dense = _dense_weight(w, w_scale, w_gscale, fmt, x_SK.dtype)
        y, pre = expert_gemm_reference(x_SK, dense, offs_E, src, row_weight_M, activation)
        return y, (pre if store else x_SK.new_empty(0, N_w))
    K, E = x_SK.shape[1], offs_E.shape[0]
    if not use_triton_grouped_gemm(num_rows, N_w, K, E, x_SK.dtype, x_SK.device, fmt,
                                   gemm_kind(w, activation, row_weight_M is not None)):
        # CUTLASS (quantised: the weight-only kernels) on the materialised rows, the epilogue after (same semantics)
        a = gather_rows(x_SK, src)
        pre = (gmm.grouped_mm(a, w, offs_E) if fmt == "plain"
               else gmm.weight_only_grouped_mm(a, w, w_scale, w_gscale, offs_E, fmt))
        if activation == "none" and row_weight_M is None:  # the GEMM's own output, no epilogue passes
            return pre, x_SK.new_empty(0, N_w)
        if _standalone_epilogue(x_SK):
            return launch_epilogue(pre, N, activation, row_weight_M, x_SK.dtype), (
                pre if store else x_SK.new_empty(0, N_w)
            )
        out = pre.float()
        if activation != "none":
            out = _act_fp32(out[:, :N], activation) * out[:, N:]
        if row_weight_M is not None:
            out = out * row_weight_M.float()[:, None]
        return out.to(x_SK.dtype), (pre if store else x_SK.new_empty(0, N_w))
    y = x_SK.new_empty(num_rows, N)
    pre = x_SK.new_empty(num_rows, N_w) if store else None
    launch_expert_gemm(x_SK, src, w, w_scale, w_gscale, offs_E, row_weight_M, y, pre, activation, fmt)
    return y, (pre if store else x_SK.new_empty(0, N_w))


@triton_op("moe::expert_gemm", mutates_args=())
def _expert_gemm_op(
    x_SK: torch.Tensor,
    w_ENK: torch.Tensor,
    offs_E: torch.Tensor,
    row_map: torch.Tensor | None,
    row_weight_M: torch.Tensor | None,
    activation: str,
    num_rows: int,
    store_preact: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _expert_gemm_body(
        x_SK, w_ENK, None, None, offs_E, row_map, row_weight_M, activation, num_rows, store_preact, "plain"
    )


@triton_op("moe::expert_gemm_mxfp8", mutates_args=())
def _expert_gemm_mxfp8_op(
    x_SK: torch.Tensor,
    qdata_ENK: torch.Tensor,
    scale_ENB: torch.Tensor,
    offs_E: torch.Tensor,
    row_map: torch.Tensor | None,
    row_weight_M: torch.Tensor | None,
    activation: str,
    num_rows: int,
    store_preact: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _expert_gemm_body(
        x_SK, qdata_ENK, scale_ENB, None, offs_E, row_map, row_weight_M, activation, num_rows, store_preact, "mxfp8"
    )


@triton_op("moe::expert_gemm_nvfp4", mutates_args=())
def _expert_gemm_nvfp4_op(
    x_SK: torch.Tensor,
    qdata_ENP: torch.Tensor,
    scale_ENB: torch.Tensor,
    expert_scale_E: torch.Tensor,
    offs_E: torch.Tensor,
    row_map: torch.Tensor | None,
    row_weight_M: torch.Tensor | None,
    activation: str,
    num_rows: int,
    store_preact: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _expert_gemm_body(
        x_SK, qdata_ENP, scale_ENB, expert_scale_E, offs_E, row_map, row_weight_M, activation, num_rows, store_preact,
        "nvfp4",
    )  # fmt: skip


def _standalone_epilogue(t: torch.Tensor) -> bool:
    """Whether the epilogue math on ``t`` runs as one Triton pass
    (NOTE [standalone epilogues] (moe_compile/ops/triton/expert_epilogue.py)): eager on CUDA, fp32 math (not fp64).
    Traced, the PyTorch expressions stay for Inductor to fuse."""
    return t.is_cuda and t.dtype != torch.float64 and not _common.is_traced(t)


def _row_weighted(dy_MN: torch.Tensor, row_weight_M: torch.Tensor | None) -> torch.Tensor:
    """``dy * row_weight[:, None]`` computed in fp32 (fp64 for fp64 ``dy``), in ``dy``'s dtype."""
    if row_weight_M is None:
        return dy_MN
    if _standalone_epilogue(dy_MN):
        return launch_epilogue(dy_MN, dy_MN.shape[1], "none", row_weight_M, dy_MN.dtype)
    acc = torch.float64 if dy_MN.dtype == torch.float64 else torch.float32
    return (dy_MN.to(acc) * row_weight_M[:, None]).to(dy_MN.dtype)


@triton_op("moe::expert_wgrad", mutates_args=())
def _expert_wgrad_op(
    dy_MN: torch.Tensor,
    x_SK: torch.Tensor,
    offs_E: torch.Tensor,
    row_map: torch.Tensor | None,
    row_weight_M: torch.Tensor | None,
) -> torch.Tensor:
    M, N, K, E = dy_MN.shape[0], dy_MN.shape[1], x_SK.shape[1], offs_E.shape[0]
    _check_op_args(x_SK, offs_E, row_map, M)
    cuda = x_SK.device.type == "cuda"
    src = source_rows(row_map, M)
    if cuda and use_triton_grouped_gemm(M, N, K, E, x_SK.dtype, x_SK.device, kind="wgrad"):
        return launch_expert_wgrad(dy_MN, x_SK, src, row_weight_M, offs_E, x_SK.new_empty(E, N, K))
    a = gather_rows(x_SK, src)
    wgrad = torch.ops.moe.grouped_mm_wgrad if cuda else gmm.grouped_mm_wgrad_reference
    return wgrad(_row_weighted(dy_MN, row_weight_M), a, offs_E)


# ===== autograd =====


def _setup_context(ctx, inputs, output, fmt: str) -> None:
    n_w = {"plain": 8, "mxfp8": 9, "nvfp4": 10}[fmt]
    activation, num_rows, store_preact = inputs[n_w - 3 : n_w]
    ctx.fmt, ctx.activation, ctx.num_rows = fmt, activation, num_rows
    ctx.has_row_map, ctx.has_rw = inputs[n_w - 5] is not None, inputs[n_w - 4] is not None
    tensors = [t for t in inputs[: n_w - 3] if t is not None]
    pre = output[1] if store_preact and activation != "none" else None
    ctx.has_pre = pre is not None
    ctx.save_for_backward(*tensors, *([pre] if pre is not None else []))


def _expert_backward(ctx, dy, dpre):
    saved = list(ctx.saved_tensors)
    pre = saved.pop() if ctx.has_pre else None
    rw = saved.pop() if ctx.has_rw else None
    row_map = saved.pop() if ctx.has_row_map else None
    offs_E = saved.pop()
    x_SK, w, *scales = saved
    w_scale = scales[0] if scales else None
    w_gscale = scales[1] if len(scales) > 1 else None
    dense = _dense_weight(w, w_scale, w_gscale, ctx.fmt, x_SK.dtype)
    M, act, dtype = ctx.num_rows, ctx.activation, x_SK.dtype
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1] and ctx.fmt == "plain"
    need_rw = rw is not None and ctx.needs_input_grad[len(ctx.needs_input_grad) - 4]
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    d_rw = None
    if act != "none":
        if pre is None:  # not stored: recompute the pre-activations (one more GEMM)
            pre = _expert_gemm_op(x_SK, dense, offs_E, row_map, None, "none", M, False)[0]
        dpre = dpre if dpre is not None and dpre.numel() else None
        if _standalone_epilogue(dy):
            dz, d_rw = launch_epilogue_backward(pre, dy, rw, dpre, act, need_rw)
        else:
            n = pre.shape[1] // 2
            g, u = pre[:, :n].to(acc), pre[:, n:].to(acc)
            a_g, dh = _act_fp32(g, act), dy.to(acc)
            if need_rw:
                d_rw = (a_g * u * dh).sum(1)
            if rw is not None:
                dh = dh * rw.to(acc)[:, None]
            dz = torch.cat([dh * u * _act_grad_fp32(g, act), dh * a_g], 1)
            if dpre is not None:
                dz = dz + dpre.to(acc)
            dz = dz.to(dtype)
        dz_rw = None
    else:
        dz, dz_rw = dy.contiguous(), rw
    dx = None
    if need_x or need_rw and act == "none":
        if need_rw and act == "none":  # d rw[r] = <a[r], dy[r] @ W[e]>: the dX GEMM before its row scale
            dx_u = _expert_gemm_op(dz, dense.transpose(1, 2), offs_E, None, None, "none", M, False)[0]
            src = source_rows(row_map, M)
            a = gather_rows(x_SK, src)
            if _standalone_epilogue(dy):
                dx_perm, d_rw = launch_row_scale_backward(a, dx_u, rw)
            else:
                d_rw = (a.to(acc) * dx_u.to(acc)).sum(1)
                dx_perm = (dx_u.to(acc) * rw.to(acc)[:, None]).to(dtype)
        else:
            dx_perm = _expert_gemm_op(dz, dense.transpose(1, 2), offs_E, None, dz_rw, "none", M, False)[0]
        if need_x:
            dx = unpad_unpermute(dx_perm, row_map) if row_map is not None else dx_perm
    dw = _expert_wgrad_op(dz, x_SK, offs_E, row_map, dz_rw) if need_w else None
    d_rw = d_rw.to(rw.dtype) if d_rw is not None else None
    grads = [dx, dw] + [None] * {"plain": 0, "mxfp8": 1, "nvfp4": 2}[ctx.fmt] + [None, None, d_rw, None, None, None]
    return tuple(grads)


_expert_gemm_op.register_autograd(_expert_backward, setup_context=functools.partial(_setup_context, fmt="plain"))
_expert_gemm_mxfp8_op.register_autograd(_expert_backward, setup_context=functools.partial(_setup_context, fmt="mxfp8"))
_expert_gemm_nvfp4_op.register_autograd(_expert_backward, setup_context=functools.partial(_setup_context, fmt="nvfp4"))


# ===== public wrapper =====


def runs_on_weight(w: torch.Tensor) -> bool:
    """Whether ``moe::expert_gemm`` runs on ``w`` itself: a plain tensor, or a tensor subclass that declares
    ``handles_expert_gemm`` (``GroupedQuantWeight`` maps the op to its MXFP8 / NVFP4 op); another subclass (sharded
    weights) would run it on a dense copy, so callers keep that weight's own GEMM."""
    return not is_traceable_wrapper_subclass(w) or bool(getattr(type(w), "handles_expert_gemm", False))


def expert_gemm(
    x_SK: torch.Tensor,
    w: torch.Tensor,
    offs_E: torch.Tensor,
    *,
    row_map: torch.Tensor | None = None,
    row_weight_M: torch.Tensor | None = None,
    activation: str = "none",
    num_rows: int | None = None,
    store_preact: bool | None = None,
    w_scale: torch.Tensor | None = None,
    expert_scale_E: torch.Tensor | None = None,
    fmt: str = "plain",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert-MLP GEMM with fused gather / activation / row weight (module docstring).

    Args:
        x_SK: ``[S, K]`` bf16/fp16/fp32 (fp64 on CPU for gradcheck): tokens when ``row_map`` is given,
            else expert-major rows.
        w: ``[E, N_w, K]`` in ``x``'s dtype (``fmt="plain"``), float8_e4m3fn (``"mxfp8"``) or packed
            uint8 ``[E, N_w, K/2]`` (``"nvfp4"``); gated activations stack ``[gate; up]`` along ``N_w``.
        offs_E: int32 ``[E]`` cumulative end offsets.
        row_map: ``permute_pad``'s int32 ``[T, 2K]`` map: gather ``x`` through it.
        row_weight_M: optional ``[M]`` per-row weight (e.g. ``permute_pad``'s ``probs_M``).
        activation: ``"none"``, ``"swiglu"`` or ``"geglu"``.
        num_rows: ``M``; required with ``row_map``, else ``x_SK.shape[0]``.
        store_preact: return the pre-activations (default: when autograd will need them).
        w_scale / expert_scale_E: the quantised formats' scales (as ``grouped_mm_mxfp8/_nvfp4``).

    Returns:
        ``(y [M, N], pre [M, N_w] or empty)`` in ``x``'s dtype.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not supported; use one of {tuple(ACTIVATIONS)}")
    if fmt not in ("plain", "mxfp8", "nvfp4"):
        raise ValueError(f"fmt={fmt!r} is not supported; use 'plain', 'mxfp8' or 'nvfp4'")
    for name, t in (("x_SK", x_SK), ("w", w), ("offs_E", offs_E)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x_SK.dim() != 2 or x_SK.dtype not in _common.FLOAT_DTYPE_SET:
        raise ValueError(f"x_SK must be a 2-D bf16/fp16/fp32 (fp64) tensor, got {x_SK.dtype} {tuple(x_SK.shape)}")
    if w.dim() != 3:
        raise ValueError(f"w must be 3-D [E, N_w, K], got shape {tuple(w.shape)}")
    if offs_E.dim() != 1 or offs_E.dtype != torch.int32 or offs_E.shape[0] != w.shape[0]:
        raise ValueError(f"offs_E must be int32 [{w.shape[0]}], got {offs_E.dtype} {tuple(offs_E.shape)}")
    k_w = w.shape[2] * (2 if fmt == "nvfp4" else 1)
    if x_SK.shape[1] != k_w:
        raise ValueError(f"x_SK.shape[1]={x_SK.shape[1]} does not match the weight's K={k_w}")
    if fmt == "plain" and w.dtype != x_SK.dtype:
        raise ValueError(f"w.dtype={w.dtype} must equal x_SK.dtype={x_SK.dtype}")
    if activation != "none" and w.shape[1] % 2:
        raise ValueError(f"a gated activation needs an even number of weight rows, got w.shape[1]={w.shape[1]}")
    if row_map is not None:
        if not isinstance(row_map, torch.Tensor) or row_map.dim() != 2 or row_map.dtype != torch.int32 \
                or row_map.shape[1] % 2 or row_map.shape[1] == 0:
            got = f"{row_map.dtype} {tuple(row_map.shape)}" if isinstance(row_map, torch.Tensor) else row_map
            raise ValueError(f"row_map must be int32 [T, 2K], got {got}")
        if row_map.shape[0] != x_SK.shape[0]:
            raise ValueError(f"row_map must have one row per token of x_SK: row_map.shape={tuple(row_map.shape)}, "
                             f"x_SK.shape={tuple(x_SK.shape)}")
        if num_rows is None:
            raise ValueError("num_rows is required with row_map (the static row bound of permute_pad)")
    if num_rows is not None:
        _common.check_count(num_rows, "num_rows")
    num_rows = x_SK.shape[0] if num_rows is None else num_rows
    if row_map is None and num_rows != x_SK.shape[0]:
        raise ValueError(f"num_rows={num_rows} must equal x_SK.shape[0]={x_SK.shape[0]} without row_map")
    if row_weight_M is not None:
        if not isinstance(row_weight_M, torch.Tensor) or tuple(row_weight_M.shape) != (num_rows,):
            got = tuple(getattr(row_weight_M, "shape", ()))
            raise ValueError(f"row_weight_M must have shape ({num_rows},), got {got}")
        if row_weight_M.dtype not in _common.FLOAT_DTYPE_SET:
            raise ValueError(f"row_weight_M must have a float dtype, got {row_weight_M.dtype}")
    if store_preact is not None:
        _common.check_bool(store_preact, "store_preact")
    if fmt == "mxfp8":
        if w_scale is None:
            raise ValueError("w_scale is required for fmt='mxfp8'")
        gmm.check_mxfp8_weight(w, w_scale)
    elif fmt == "nvfp4":
        if w_scale is None or expert_scale_E is None:
            raise ValueError(f"w_scale and expert_scale_E are required for fmt='nvfp4', got w_scale={type(w_scale)}, "
                             f"expert_scale_E={type(expert_scale_E)}")
        gmm.check_nvfp4_weight(w, w_scale, expert_scale_E)
    _common.check_same_device(x_SK=x_SK, w=w, offs_E=offs_E, row_map=row_map, row_weight_M=row_weight_M,
                              w_scale=w_scale, expert_scale_E=expert_scale_E)
    if store_preact is None:
        grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x_SK, w, row_weight_M))
        store_preact = grad and activation != "none"
    store_preact = bool(store_preact) and activation != "none"
    if fmt == "plain":
        return _expert_gemm_op(x_SK, w, offs_E, row_map, row_weight_M, activation, num_rows, store_preact)
    if w_scale is None:
        raise ValueError(f"w_scale is required for fmt={fmt!r}")
    if fmt == "mxfp8":
        return _expert_gemm_mxfp8_op(
            x_SK, w, w_scale.view(torch.uint8), offs_E, row_map, row_weight_M, activation, num_rows, store_preact
        )
    if expert_scale_E is None:
        raise ValueError("expert_scale_E is required for fmt='nvfp4'")
    return _expert_gemm_nvfp4_op(
        x_SK, w, w_scale, expert_scale_E.reshape(-1), offs_E, row_map, row_weight_M, activation, num_rows, store_preact
    )  # fmt: skip
