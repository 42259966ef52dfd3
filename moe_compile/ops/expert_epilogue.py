"""Standalone expert-MLP epilogues: the gated activation / row weight of a GEMM output, and their backward,
one Triton pass each (NOTE [standalone epilogues] (moe_compile/ops/triton/expert_epilogue.py)).

:mod:`moe_compile.ops.expert_gemm` calls them in eager on CUDA where ``torch._grouped_mm`` (CUTLASS) runs the
GEMM, and for the backward of every gated epilogue; traced calls keep PyTorch expressions that Inductor fuses.
Shapes: ``M`` rows, ``N`` output columns, ``W = 2N`` (gated: ``[gate | up]``) pre-activation columns.
The math is fp32; the PyTorch expressions in ``expert_gemm`` (``expert_gemm_reference`` and the autograd) are
the reference; ``tests/ops/triton/_expert_gemm_interp_worker.py`` runs these kernels under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton

from moe_compile.ops import _common
from moe_compile.ops.triton import expert_epilogue as _kernels

ACTIVATIONS = {"none": 0, "swiglu": 1, "geglu": 2}  # the kernels' ACT codes (ACT_* in ops/triton/expert_gemm.py)

EPILOGUE_BLOCK_N = 1024  # columns per program (pass) of the standalone epilogues


def _epilogue_block(N: int) -> int:
    return min(EPILOGUE_BLOCK_N, max(16, triton.next_power_of_2(N)))


def _check_rows(name: str, t: torch.Tensor | None, M: int, cols: int | None) -> None:
    """``t`` is ``[M, cols]`` (``[M]`` when ``cols`` is None) of a float dtype: the kernels read ``cols`` columns of
    each of ``M`` rows (and one value per row of a row weight), so anything smaller would be read past its end."""
    if t is None:
        return
    shape = (M,) if cols is None else (M, cols)
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype not in _common.FLOAT_DTYPE_SET:
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a float tensor of shape {list(shape)}, got {got}")


def _check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not supported; use one of {tuple(ACTIVATIONS)}")


def launch_epilogue(
    pre_MW: torch.Tensor, N: int, activation: str, row_weight_M: torch.Tensor | None, out_dtype: torch.dtype,
    kernels=None, block_n: int | None = None,
) -> torch.Tensor:
    """NOTE [standalone epilogues] (moe_compile/ops/triton/expert_epilogue.py): ``rw * act(pre[:, :N]) * pre[:, N:]``
    (``activation="none"``: ``rw * pre``) in ``out_dtype``, one pass, fp32 math; the eager CUTLASS path of
    :func:`expert_gemm`."""
    kernels = kernels or _kernels
    _check_activation(activation)
    _common.check_count(N, "N")
    if out_dtype not in _common.FLOAT_DTYPE_SET:
        raise ValueError(f"out_dtype must be a float dtype, got {out_dtype!r}")
    if not isinstance(pre_MW, torch.Tensor) or pre_MW.dim() != 2:
        raise ValueError(f"pre_MW must be a 2-D tensor, got {getattr(pre_MW, 'shape', type(pre_MW).__name__)}")
    M = pre_MW.shape[0]
    _check_rows("pre_MW", pre_MW, M, 2 * N if activation != "none" else N)
    _check_rows("row_weight_M", row_weight_M, M, None)
    _common.check_same_device(pre_MW=pre_MW, row_weight_M=row_weight_M)
    pre_MW, row_weight_M = map(_common.unit_last_stride, (pre_MW, row_weight_M))
    out = pre_MW.new_empty(M, N, dtype=out_dtype)
    if M == 0 or N == 0:
        return out
    block = block_n or _epilogue_block(N)
    _common.launch_kernel(
        kernels._epilogue_kernel, (M, triton.cdiv(N, block)),
        pre_MW, row_weight_M if row_weight_M is not None else pre_MW, out, N, pre_MW.stride(0), out.stride(0),
        ACT=ACTIVATIONS[activation], ROW_SCALE=row_weight_M is not None, BLOCK_N=block,
        traced=False, options=dict(num_warps=4),
    )  # fmt: skip
    return out


def launch_epilogue_backward(
    pre_MW: torch.Tensor, dy_MN: torch.Tensor, row_weight_M: torch.Tensor | None, dpre_MW: torch.Tensor | None,
    activation: str, need_row_weight_grad: bool, kernels=None, block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """NOTE [standalone epilogues] (moe_compile/ops/triton/expert_epilogue.py):
    ``(dz [M, 2N] in pre's dtype, d rw [M] fp32 or None)`` for a gated epilogue:
    ``dz = [dh * u * act'(g) | dh * act(g)] + dpre`` with ``dh = dy * rw``, ``d rw = sum(act(g) * u * dy)``."""
    kernels = kernels or _kernels
    _check_activation(activation)
    if activation == "none":
        raise ValueError("activation='none' has no gated epilogue to differentiate; use 'swiglu' or 'geglu'")
    if not isinstance(pre_MW, torch.Tensor) or pre_MW.dim() != 2 or pre_MW.shape[1] % 2:
        raise ValueError(f"pre_MW must be a 2-D [M, 2N] tensor, got {getattr(pre_MW, 'shape', type(pre_MW).__name__)}")
    M, n_w = pre_MW.shape
    _check_rows("pre_MW", pre_MW, M, n_w)
    _check_rows("dy_MN", dy_MN, M, n_w // 2)
    _check_rows("dpre_MW", dpre_MW, M, n_w)
    _check_rows("row_weight_M", row_weight_M, M, None)
    _common.check_bool(need_row_weight_grad, "need_row_weight_grad")
    _common.check_same_device(pre_MW=pre_MW, dy_MN=dy_MN, dpre_MW=dpre_MW, row_weight_M=row_weight_M)
    pre_MW, dy_MN, dpre_MW, row_weight_M = map(_common.unit_last_stride, (pre_MW, dy_MN, dpre_MW, row_weight_M))
    dz = pre_MW.new_empty(M, n_w)
    d_rw = torch.empty(M, dtype=torch.float32, device=pre_MW.device) if need_row_weight_grad else None
    if M == 0:
        return dz, d_rw
    _common.launch_kernel(
        kernels._epilogue_backward_kernel, (M,),
        pre_MW, dy_MN, row_weight_M if row_weight_M is not None else pre_MW, dpre_MW if dpre_MW is not None else pre_MW,
        dz, d_rw if d_rw is not None else dz, n_w // 2, pre_MW.stride(0), dy_MN.stride(0),
        dpre_MW.stride(0) if dpre_MW is not None else 0, dz.stride(0),
        ACT=ACTIVATIONS[activation], ROW_SCALE=row_weight_M is not None, NEED_DRW=need_row_weight_grad,
        HAS_DPRE=dpre_MW is not None, BLOCK_N=block_n or _epilogue_block(n_w // 2), traced=False,
        options=dict(num_warps=4),
    )  # fmt: skip
    return dz, d_rw


def launch_row_scale_backward(
    a_MK: torch.Tensor,
    dx_unscaled_MK: torch.Tensor,
    row_weight_M: torch.Tensor,
    kernels=None,
    block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NOTE [standalone epilogues] (moe_compile/ops/triton/expert_epilogue.py):
    ``(rw * dxu in dxu's dtype, sum(a * dxu, 1) in fp32)``, one pass: the row weight's share of the backward of
    ``y = rw * (a @ W)``."""
    kernels = kernels or _kernels
    if not isinstance(dx_unscaled_MK, torch.Tensor) or dx_unscaled_MK.dim() != 2:
        got = getattr(dx_unscaled_MK, "shape", type(dx_unscaled_MK).__name__)
        raise ValueError(f"dx_unscaled_MK must be a 2-D tensor, got {got}")
    M, K = dx_unscaled_MK.shape
    _check_rows("dx_unscaled_MK", dx_unscaled_MK, M, K)
    _check_rows("a_MK", a_MK, M, K)
    if row_weight_M is None:
        raise ValueError("row_weight_M is required (the row weight whose backward this is)")
    _check_rows("row_weight_M", row_weight_M, M, None)
    _common.check_same_device(a_MK=a_MK, dx_unscaled_MK=dx_unscaled_MK, row_weight_M=row_weight_M)
    a_MK, dxu, row_weight_M = map(_common.unit_last_stride, (a_MK, dx_unscaled_MK, row_weight_M))
    dx = torch.empty_like(dxu, memory_format=torch.contiguous_format)
    d_rw = torch.empty(M, dtype=torch.float32, device=dxu.device)
    if M == 0:
        return dx, d_rw
    _common.launch_kernel(
        kernels._row_scale_backward_kernel, (M,), a_MK, dxu, row_weight_M, dx, d_rw, K,
        a_MK.stride(0), dxu.stride(0), dx.stride(0), BLOCK_N=block_n or _epilogue_block(K),
        traced=False, options=dict(num_warps=4),
    )  # fmt: skip
    return dx, d_rw
