"""``torch.ops.moe.grouped_mm`` and the MXFP8/NVFP4 weight-only variants on CPU (reference paths)."""

from __future__ import annotations

import pytest
import torch

from moe_compile.ops import grouped_mm as gmm
from tests import _tolerance as tol

F32, F64 = torch.float32, torch.float64
# counts per expert: empty experts, E=7, everything on one expert, fewer rows than experts
ROUTINGS = [[3, 0, 5, 2], [2, 0, 0, 1, 4, 0, 3], [0, 0, 9], [0, 1, 0, 0, 0, 1, 0, 0]]


def _offs(counts: list[int]) -> torch.Tensor:
    return torch.cumsum(torch.tensor(counts), 0).to(torch.int32)


def _loop_reference(x_MK, w_ENK, counts):
    """Per-expert slices with host offsets (fine in a test): the semantics written out."""
    out, start = torch.zeros(x_MK.shape[0], w_ENK.shape[1], dtype=x_MK.dtype), 0
    for e, c in enumerate(counts):
        out[start : start + c] = (x_MK[start : start + c].double() @ w_ENK[e].double().T).to(x_MK.dtype)
        start += c
    return out


@pytest.mark.parametrize("counts", ROUTINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_matches_loop(counts, dtype):
    torch.manual_seed(0)
    M = sum(counts) + 3  # rows past offs[-1] must come back zero
    x, w = torch.randn(M, 32, dtype=dtype), torch.randn(len(counts), 24, 32, dtype=dtype)
    y, want = gmm.grouped_mm(x, w, _offs(counts)), _loop_reference(x, w, counts)
    mag = tol.grouped_abs_matmul(x, w, _offs(counts))
    bound = tol.matmul_bound(mag, 32, want, acc_dtypes=(F32, F64), got_dtype=dtype, want_dtype=dtype)
    tol.assert_within(y, want, bound)
    assert torch.all(y[sum(counts) :] == 0)


def test_grouped_mm_matches_torch_grouped_mm_bf16():
    torch.manual_seed(1)
    counts = [3, 0, 5, 2]
    x, w = torch.randn(10, 32, dtype=torch.bfloat16), torch.randn(4, 16, 32, dtype=torch.bfloat16)
    ref = torch._grouped_mm(x, w.transpose(-2, -1), offs=_offs(counts))
    bf16 = torch.bfloat16
    bound = tol.grouped_mm_bound(x, w, _offs(counts), ref, got_dtype=bf16, want_dtype=bf16)
    tol.assert_within(gmm.grouped_mm(x, w, _offs(counts)), ref, bound)


def test_grouped_mm_gradcheck_fp64():
    """The op and its backward ops (the reference paths accept fp64) pass gradcheck, empty experts included."""
    torch.manual_seed(2)
    offs = _offs([2, 0, 3])
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: torch.ops.moe.grouped_mm(a, b, offs), (x, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_backward_deterministic_and_correct(dtype):
    torch.manual_seed(3)
    counts = [2, 0, 0, 1, 4, 0, 3]
    offs = _offs(counts)
    x = torch.randn(13, 32, dtype=dtype, requires_grad=True)
    w = torch.randn(7, 16, 32, dtype=dtype, requires_grad=True)
    dy = torch.randn(13, 16, dtype=dtype)
    grads = []
    for _ in range(2):
        gx, gw = torch.autograd.grad(gmm.grouped_mm(x, w, offs), (x, w), dy)
        grads.append((gx, gw))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    x_ref, w_ref = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    gx_ref, gw_ref = torch.autograd.grad(_loop_reference(x_ref, w_ref, counts), (x_ref, w_ref), dy.double())
    # dX = dY @ w[e] (K = N = 16), dW[e] = dY[rows of e]^T X[rows of e] (K = rows of e); fp64 reference
    gx_mag = tol.grouped_abs_matmul(dy, w.transpose(1, 2), offs)
    gw_mag = tol.grouped_wgrad_abs(dy, x, offs)
    for got, want, mag, k in ((grads[0][0], gx_ref, gx_mag, 16), (grads[0][1], gw_ref, gw_mag, max(counts))):
        bound = tol.matmul_bound(mag, k, want, acc_dtypes=(F32, F64), got_dtype=dtype)
        tol.assert_within(got, want, bound, f"grad {tuple(want.shape)}")
    assert torch.all(grads[0][1][torch.tensor(counts) == 0] == 0)  # empty experts: zero weight grad
    assert torch.all(grads[0][0][sum(counts) :] == 0)


def test_opcheck_plain_and_wgrad():
    torch.manual_seed(4)
    offs = _offs([2, 0, 3])
    x, w = torch.randn(6, 8, requires_grad=True), torch.randn(3, 16, 8, requires_grad=True)
    torch.library.opcheck(torch.ops.moe.grouped_mm, (x, w, offs))
    torch.library.opcheck(torch.ops.moe.grouped_mm, (x, w, offs, False))
    torch.library.opcheck(torch.ops.moe.grouped_mm_wgrad, (torch.randn(6, 16), x.detach(), offs))


def _quantized(recipe: str, E=3, N=16, K=64):
    from moe_compile.experts.grouped_weight import quantize_stored

    return quantize_stored(torch.randn(E, N, K, dtype=torch.bfloat16), recipe)


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_quantized_ops_equal_dequantize_then_plain(recipe):
    torch.manual_seed(5)
    qdata, scale, expert_scale = _quantized(recipe)
    offs = _offs([2, 0, 3])
    x = torch.randn(7, 64, dtype=torch.bfloat16, requires_grad=True)
    if recipe == "mxfp8":
        y, w = gmm.grouped_mm_mxfp8(x, qdata, scale, offs), gmm.dequantize_mxfp8(qdata, scale, torch.bfloat16)
    else:
        y = gmm.grouped_mm_nvfp4(x, qdata, scale, expert_scale, offs)
        w = gmm.dequantize_nvfp4(qdata, scale, expert_scale, torch.bfloat16)
    x2 = x.detach().clone().requires_grad_()
    y_ref = gmm.grouped_mm(x2, w, offs)
    assert torch.equal(y, y_ref)
    dy = torch.randn_like(y)
    assert torch.equal(torch.autograd.grad(y, x, dy)[0], torch.autograd.grad(y_ref, x2, dy)[0])


def test_opcheck_quantized_ops():
    """test_schema is left out (it perturbs every input with ``mul``, which CPU lacks for float8); the
    slow AOT check runs for one of the two ops (they share the wrapper and backward structure)."""
    torch.manual_seed(6)
    offs = _offs([2, 0, 3])
    x = torch.randn(6, 64, dtype=torch.bfloat16, requires_grad=True)
    qdata, scale, _ = _quantized("mxfp8")
    torch.library.opcheck(torch.ops.moe.grouped_mm_mxfp8, (x, qdata, scale, offs), test_utils=("test_faketensor",))
    qdata, scale, expert_scale = _quantized("nvfp4")
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.moe.grouped_mm_nvfp4, (x, qdata, scale, expert_scale, offs), test_utils=utils)


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_matches_torchao_bitwise(recipe, dtype):
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    torch.manual_seed(7)
    w = torch.randn(3, 8, 64, dtype=torch.bfloat16)
    w[1, 2, :32] = 0  # an all-zero block
    w[2, 5, 32:] *= 1e-30  # tiny block: e8m0 code near the bottom of the range
    if recipe == "mxfp8":
        mx = MXTensor.to_mx(w, torch.float8_e4m3fn, 32)
        ours, theirs = gmm.dequantize_mxfp8(mx.qdata, mx.scale.view(torch.uint8), dtype), mx.dequantize(dtype)
    else:
        scale = per_tensor_amax_to_scale(w.abs().amax(dim=(1, 2)).float())
        nv = NVFP4Tensor.to_nvfp4(w, 16, per_tensor_scale=scale.view(3, 1, 1))
        ours, theirs = gmm.dequantize_nvfp4(nv.qdata, nv.scale, scale, dtype), nv.dequantize(dtype)
    assert torch.equal(ours, theirs)


def test_compiled_grouped_mm_fp32_static_shapes():
    """Inductor, fullgraph, fp32 (what replaces transformers' syncing fallback): static output, grads match."""
    torch.manual_seed(8)
    offs = _offs([2, 0, 3, 1])
    x = torch.randn(9, 16, requires_grad=True)
    w = torch.randn(4, 8, 16, requires_grad=True)

    def f(x, w, offs):
        return torch.ops.moe.grouped_mm(x, w, offs).pow(2).sum()

    eager = torch.autograd.grad(f(x, w, offs), (x, w))
    compiled = torch.compile(f, fullgraph=True, dynamic=False)
    got = torch.autograd.grad(compiled(x, w, offs), (x, w))
    # y = x @ w^T (K 16) is off by d_y <= 2 gamma_16 (|x| @ |w|^T); dy = 2 y, so dX = 2 y @ w (K 8) is off by
    # 2 |d_y| @ |w| + 2 gamma_8 (2 |y| @ |w|), and dW = 2 y^T x (K = rows of e) likewise
    y_mag = tol.grouped_abs_matmul(x, w, offs)
    d_y = tol.accumulation_rel(16) * y_mag
    gx_bound = 2 * tol.grouped_abs_matmul(d_y, w.transpose(1, 2), offs)
    gx_bound += tol.accumulation_rel(8) * 2 * tol.grouped_abs_matmul(y_mag, w.transpose(1, 2), offs)
    gw_bound = (2 * tol.grouped_wgrad_abs(d_y, x, offs)
                + tol.accumulation_rel(3) * 2 * tol.grouped_wgrad_abs(y_mag, x, offs))
    tol.assert_within(got[0], eager[0], gx_bound, "dX")
    tol.assert_within(got[1], eager[1], gw_bound, "dW")


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: gmm.grouped_mm(torch.randn(2, 3, 8), torch.randn(2, 4, 8), _offs([1, 1])), "x_MK must be 2-D"),
        (lambda: gmm.grouped_mm(torch.randn(2, 8), torch.randn(4, 8), _offs([1, 1])), "w_ENK must be 3-D"),
        (
            lambda: gmm.grouped_mm(torch.randn(2, 8), torch.randn(2, 4, 8), _offs([1, 1]).long()),
            "offs_E must be a 1-D int32",
        ),
        (lambda: gmm.grouped_mm(torch.randn(2, 8), torch.randn(3, 4, 8), _offs([1, 1])), "offs_E has 2 entries"),
        (
            lambda: gmm.grouped_mm(torch.randn(2, 6), torch.randn(2, 4, 8), _offs([1, 1])),
            "does not match the weight's K",
        ),
        (lambda: gmm.grouped_mm(torch.randn(2, 8), torch.randn(2, 4, 8).half(), _offs([1, 1])), "w_ENK.dtype"),
        (
            lambda: gmm.grouped_mm(
                torch.ones(2, 8, dtype=torch.int32), torch.ones(2, 4, 8, dtype=torch.int32), _offs([1, 1])
            ),
            "x_MK.dtype",
        ),
        (
            lambda: gmm.grouped_mm_mxfp8(
                torch.randn(2, 64), torch.zeros(2, 4, 64), torch.zeros(2, 4, 2, dtype=torch.uint8), _offs([1, 1])
            ),
            "qdata_ENK must be float8_e4m3fn",
        ),
        (
            lambda: gmm.grouped_mm_mxfp8(
                torch.randn(2, 64),
                torch.zeros(2, 4, 64).to(torch.float8_e4m3fn),
                torch.zeros(2, 4, 4, dtype=torch.uint8),
                _offs([1, 1]),
            ),
            "scale_ENB must be uint8",
        ),
        (
            lambda: gmm.grouped_mm_nvfp4(
                torch.randn(2, 64),
                torch.zeros(2, 4, 32, dtype=torch.uint8),
                torch.zeros(2, 4, 4).to(torch.float8_e4m3fn),
                torch.ones(3),
                _offs([1, 1]),
            ),
            "expert_scale_E must be fp32 with 2",
        ),
    ],
)
def test_bad_input_errors_name_the_argument(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


# ===== issue 35: every argument checked on CPU, naming it =====


@pytest.mark.parametrize("offs,match", [
    ([-1, 3, 5], r"offs_E values must be in \[0, 8\] \(rows\), got min -1"),
    ([3, 5, 9], r"offs_E values must be in \[0, 8\] \(rows\), got min 3, max 9"),
    ([3, 2, 8], "offs_E must be non-decreasing"),
])
def test_offsets_outside_the_rows_name_the_argument(offs, match):
    # before: accepted silently on CPU (the CUDA kernels read rows before x for a negative offset)
    gen = torch.Generator().manual_seed(int(torch.seed() % 2**31))
    x, w, dy = torch.randn(8, 16, generator=gen), torch.randn(3, 4, 16, generator=gen), torch.randn(8, 4, generator=gen)
    offs_E = torch.tensor(offs, dtype=torch.int32)
    q, s = torch.zeros(3, 4, 32).to(torch.float8_e4m3fn), torch.full((3, 4, 1), 127, dtype=torch.uint8)
    for call in (
        lambda: gmm.grouped_mm(x, w, offs_E),
        lambda: torch.ops.moe.grouped_mm(x, w, offs_E),
        lambda: torch.ops.moe.grouped_mm_wgrad(dy, x, offs_E),
        lambda: gmm.grouped_mm_mxfp8(torch.randn(8, 32, generator=gen), q, s, offs_E),
    ):
        with pytest.raises(ValueError, match=match):
            call()


def test_flags_devices_and_weights_name_the_argument():
    x, w, offs = torch.randn(4, 8), torch.randn(2, 3, 8), _offs([1, 3])
    with pytest.raises(TypeError, match="zero_tail must be a bool"):
        gmm.grouped_mm(x, w, offs, zero_tail="no")
    with pytest.raises(ValueError, match="one device"):
        gmm.grouped_mm(x, w.to("meta"), offs)
    with pytest.raises(TypeError, match="offs_E must be a torch.Tensor"):
        gmm.grouped_mm(x, w, [1, 3])
    with pytest.raises(ValueError, match="qdata_ENK's K=40 must be a multiple of 32"):
        gmm.grouped_mm_mxfp8(torch.randn(4, 40), torch.zeros(2, 3, 40).to(torch.float8_e4m3fn),
                             torch.zeros(2, 3, 1, dtype=torch.uint8), offs)
    with pytest.raises(ValueError, match="expert_scale_E must be fp32 with 2"):
        gmm.grouped_mm_nvfp4(torch.randn(4, 32), torch.zeros(2, 3, 16, dtype=torch.uint8),
                             torch.zeros(2, 3, 2).to(torch.float8_e4m3fn), torch.ones(2, dtype=torch.float64), offs)
