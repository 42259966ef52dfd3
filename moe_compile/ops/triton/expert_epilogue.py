"""Triton kernels of the standalone expert-MLP epilogues (``moe_compile.ops.expert_epilogue``; kernels only).

NOTE [standalone epilogues]: where ``torch._grouped_mm`` (CUTLASS) runs the GEMM, eager calls apply the gated epilogue
(and the row weight) with ``_epilogue_kernel``, one pass over ``pre [M, N_w]`` with the same fp32 math as the fused
epilogue; the backward of the epilogue (any GEMM choice) is ``_epilogue_backward_kernel``, one program per row:
``dz = [dh * u * act'(g) | dh * act(g)]`` (``dh = dy * rw``) and the row weight's gradient ``sum(act(g) * u * dy)``
reduced in a fixed order; the row weight's own backward (``y = rw * (a @ W)``: ``dx = rw * dxu``,
``d rw = sum(a * dxu)``) is ``_row_scale_backward_kernel``. Traced calls keep the PyTorch expressions (Inductor fuses
them into its own kernels).
"""

from __future__ import annotations

import triton
import triton.language as tl

from moe_compile.ops.triton.expert_gemm import ACT_NONE, ACT_SWIGLU, _act


@triton.jit
def _act_grad(g, ACT: tl.constexpr):
    """fp32 ``d act / d g`` of :func:`_act`."""
    if ACT == ACT_SWIGLU:
        s = 1.0 / (1.0 + tl.exp(-g))
        return s * (1.0 + g * (1.0 - s))
    else:
        return 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476)) + g * tl.exp(-0.5 * g * g) * 0.3989422804014327


@triton.jit
def _epilogue_kernel(
    pre_ptr, rw_ptr, out_ptr, N, stride_pre, stride_out,
    ACT: tl.constexpr, ROW_SCALE: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """``out[r] = rw[r] * act(pre[r, :N]) * pre[r, N:]`` (``ACT`` 0: ``rw[r] * pre[r]``), fp32 math, one cast;
    grid ``(M, cdiv(N, BLOCK_N))`` (NOTE [standalone epilogues])."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    row = pre_ptr + r * stride_pre
    out = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT != ACT_NONE:
        out = _act(out, ACT) * tl.load(row + N + cols, mask=mask, other=0.0).to(tl.float32)
    if ROW_SCALE:
        out = out * tl.load(rw_ptr + r).to(tl.float32)
    tl.store(out_ptr + r * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _epilogue_backward_kernel(
    pre_ptr, dy_ptr, rw_ptr, dpre_ptr, dz_ptr, drw_ptr, N, stride_pre, stride_dy, stride_dpre, stride_dz,
    ACT: tl.constexpr, ROW_SCALE: tl.constexpr, NEED_DRW: tl.constexpr, HAS_DPRE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One program per row ``r`` (NOTE [standalone epilogues]), ``BLOCK_N`` columns at a time (a fixed order):
    ``dz[r] = [dh * u * act'(g) | dh * act(g)] (+ dpre[r])`` with ``g, u = pre[r, :N], pre[r, N:]``,
    ``dh = dy[r] * rw[r]``; ``drw[r] = sum(act(g) * u * dy[r])`` in fp32."""
    r = tl.program_id(0).to(tl.int64)
    pre_row, dz_row = pre_ptr + r * stride_pre, dz_ptr + r * stride_dz
    drw = tl.zeros([BLOCK_N], dtype=tl.float32)
    for c0 in range(0, N, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        mask = cols < N
        g = tl.load(pre_row + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(pre_row + N + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + r * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        a = _act(g, ACT)
        if NEED_DRW:
            drw += a * u * dy
        dh = dy
        if ROW_SCALE:
            dh = dy * tl.load(rw_ptr + r).to(tl.float32)
        dz_g = dh * u * _act_grad(g, ACT)
        dz_u = dh * a
        if HAS_DPRE:
            dz_g += tl.load(dpre_ptr + r * stride_dpre + cols, mask=mask, other=0.0).to(tl.float32)
            dz_u += tl.load(dpre_ptr + r * stride_dpre + N + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(dz_row + cols, dz_g.to(dz_ptr.dtype.element_ty), mask=mask)
        tl.store(dz_row + N + cols, dz_u.to(dz_ptr.dtype.element_ty), mask=mask)
    if NEED_DRW:
        tl.store(drw_ptr + r, tl.sum(drw, 0))


@triton.jit
def _row_scale_backward_kernel(
    a_ptr, dxu_ptr, rw_ptr, dx_ptr, drw_ptr, N, stride_a, stride_dxu, stride_dx, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """NOTE [standalone epilogues], the backward of ``y = rw * (a @ W)``'s row weight: one program per row ``r``,
    ``BLOCK_N`` columns at a time: ``dx[r] = rw[r] * dxu[r]``, ``drw[r] = sum(a[r] * dxu[r])`` in fp32."""
    r = tl.program_id(0).to(tl.int64)
    rw = tl.load(rw_ptr + r).to(tl.float32)
    drw = tl.zeros([BLOCK_N], dtype=tl.float32)
    for c0 in range(0, N, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        mask = cols < N
        dxu = tl.load(dxu_ptr + r * stride_dxu + cols, mask=mask, other=0.0).to(tl.float32)
        drw += tl.load(a_ptr + r * stride_a + cols, mask=mask, other=0.0).to(tl.float32) * dxu
        tl.store(dx_ptr + r * stride_dx + cols, (dxu * rw).to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(drw_ptr + r, tl.sum(drw, 0))
