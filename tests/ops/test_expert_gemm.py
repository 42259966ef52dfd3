"""``torch.ops.moe.expert_gemm`` (+ quantised variants, ``expert_wgrad``) on CPU: reference semantics,
autograd, opcheck, argument errors, compile. The Triton kernels: ``tests/ops/triton/test_expert_gemm_kernels.py``."""

from __future__ import annotations

import pytest
import torch

from moe_compile.ops import expert_gemm as eg
from moe_compile.ops import grouped_mm as gmm
from moe_compile.ops import permute_pad
from tests import _tolerance as tol

F64 = torch.float64


def _dispatch(T=7, H=16, E=4, K=2, align=8, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(dtype)
    ids = torch.rand(T, E, generator=gen).argsort(1)[:, :K]
    probs = torch.rand(T, K, generator=gen).to(dtype)
    return x, permute_pad(x, ids, probs, E, align)


@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_gated_matches_permute_then_grouped_mm(activation, dtype):
    """Gathering through the row map equals ``grouped_mm`` on permute_pad's rows, then act(gate) * up * prob."""
    x, d = _dispatch(dtype=dtype, seed=1)
    M, I = d.rows_MH.shape[0], 8  # noqa: E741 - I: expert intermediate size
    w = torch.randn(4, 2 * I, x.shape[1], dtype=dtype)
    y, pre = eg.expert_gemm(x, w, d.offs_E, row_map=d.row_map, row_weight_M=d.probs_M, activation=activation,
                            num_rows=M, store_preact=True)  # fmt: skip
    gu = gmm.grouped_mm(d.rows_MH, w, d.offs_E)
    assert torch.equal(pre, gu)  # the same fp32 reference sums on the same rows
    act = torch.nn.functional.silu if activation == "swiglu" else torch.nn.functional.gelu
    want = (act(gu[:, :I].double()) * gu[:, I:].double() * d.probs_M.double()[:, None])
    mag = tol.grouped_abs_matmul(d.rows_MH, w, d.offs_E)
    # y is computed from the fp32 sums, want from the rounded ones: the rounding of gu moves act(g) * u
    # by at most (1.13 |u| + |act(g)|) u_dtype |gu| (times the prob), plus the fp32 epilogue and the casts
    u = tol.unit_roundoff(dtype) if dtype != torch.float32 else 0.0
    g_abs, u_abs = gu[:, :I].double().abs(), gu[:, I:].double().abs()
    inner = (1.13 * u_abs * (g_abs * u + tol.accumulation_rel(16) * mag[:, :I])
             + (act(gu[:, :I].double()).abs() + 1.13 * g_abs) * (u_abs * u + tol.accumulation_rel(16) * mag[:, I:]))
    inner = inner * d.probs_M.double().abs()[:, None] + 8 * tol.unit_roundoff(torch.float32) * want.abs()
    tol.assert_within(y, want, inner + tol.rounding_bound(want, dtype, inner=inner))
    assert torch.all(y[int(d.offs_E[-1]):] == 0)


@pytest.mark.parametrize("case", ["gather_swiglu_rw", "none_rw", "geglu_recompute", "none_gather"])
def test_gradcheck_fp64(case):
    x, d = _dispatch(T=5, H=6, E=3, align=8, dtype=F64, seed=2)
    M = d.rows_MH.shape[0]
    x = x.requires_grad_()
    rw = d.probs_M.clone().requires_grad_()
    if case == "gather_swiglu_rw":
        w = torch.randn(3, 8, 6, dtype=F64, requires_grad=True)
        fn = lambda a, b, c: eg.expert_gemm(  # noqa: E731
            a, b, d.offs_E, row_map=d.row_map, row_weight_M=c, activation="swiglu", num_rows=M
        )[0]
        args = (x, w, rw)
    elif case == "none_rw":
        h, w = torch.randn(M, 4, dtype=F64, requires_grad=True), torch.randn(3, 6, 4, dtype=F64, requires_grad=True)
        fn = lambda a, b, c: eg.expert_gemm(a, b, d.offs_E, row_weight_M=c)[0]  # noqa: E731
        args = (h, w, rw)
    elif case == "geglu_recompute":
        w = torch.randn(3, 8, 6, dtype=F64, requires_grad=True)
        fn = lambda a, b: eg.expert_gemm(  # noqa: E731
            a, b, d.offs_E, row_map=d.row_map, num_rows=M, activation="geglu", store_preact=False
        )[0]
        args = (x, w)
    else:
        w = torch.randn(3, 5, 6, dtype=F64, requires_grad=True)
        fn = lambda a, b: eg.expert_gemm(a, b, d.offs_E, row_map=d.row_map, num_rows=M)[0]  # noqa: E731
        args = (x, w)
    assert torch.autograd.gradcheck(fn, args)


def test_backward_bitwise_reproducible_bf16():
    x, d = _dispatch(T=9, H=32, E=4, dtype=torch.bfloat16, seed=3)
    M = d.rows_MH.shape[0]
    wgu = torch.randn(4, 16, 32, dtype=torch.bfloat16, requires_grad=True)
    wd = torch.randn(4, 32, 8, dtype=torch.bfloat16, requires_grad=True)
    x = x.requires_grad_()
    grads = []
    for _ in range(2):
        h, _ = eg.expert_gemm(x, wgu, d.offs_E, row_map=d.row_map, activation="swiglu", num_rows=M)
        y, _ = eg.expert_gemm(h, wd, d.offs_E, row_weight_M=d.probs_M)
        out = torch.ops.moe.unpad_unpermute(y, d.row_map, None, False)
        grads.append((out, *torch.autograd.grad(out.float().square().sum(), (x, wgu, wd))))
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_quantised_equals_dequantised_plain(fmt):
    x, d = _dispatch(T=6, H=64, E=4, seed=4)
    M = d.rows_MH.shape[0]
    from moe_compile.experts.grouped_weight import quantize_stored

    w = torch.randn(4, 16, 64) * 0.1
    q = quantize_stored(w.to(torch.bfloat16), fmt)
    dense = eg._dense_weight(q[0], q[1], q[2] if fmt == "nvfp4" else None, fmt, torch.float32)
    kw = dict(row_map=d.row_map, num_rows=M, activation="swiglu", row_weight_M=d.probs_M)
    got = eg.expert_gemm(
        x, q[0], d.offs_E, w_scale=q[1], expert_scale_E=q[2] if fmt == "nvfp4" else None, fmt=fmt, **kw
    )[0]
    assert torch.equal(got, eg.expert_gemm(x, dense, d.offs_E, **kw)[0])
    xg = x.clone().requires_grad_()
    y = eg.expert_gemm(
        xg, q[0], d.offs_E, w_scale=q[1], expert_scale_E=q[2] if fmt == "nvfp4" else None, fmt=fmt, **kw
    )[0]
    (gx,) = torch.autograd.grad(y.sum(), xg)
    xr = x.clone().requires_grad_()
    (gr,) = torch.autograd.grad(eg.expert_gemm(xr, dense, d.offs_E, **kw)[0].sum(), xr)
    assert torch.equal(gx, gr)


def test_opcheck():
    x, d = _dispatch(T=5, H=8, E=3, align=8, seed=5)
    M = d.rows_MH.shape[0]
    w = torch.randn(3, 6, 8, requires_grad=True)
    xr = x.clone().requires_grad_()
    torch.library.opcheck(torch.ops.moe.expert_gemm.default, (xr, w, d.offs_E, d.row_map, d.probs_M, "swiglu", M, True))
    h = torch.randn(M, 3, requires_grad=True)
    torch.library.opcheck(
        torch.ops.moe.expert_gemm.default,
        (h, w.detach()[:, :, :3].contiguous(), d.offs_E, None, d.probs_M, "none", M, False),
    )
    torch.library.opcheck(torch.ops.moe.expert_wgrad.default, (torch.randn(M, 6), x, d.offs_E, d.row_map, d.probs_M))


def test_compile_matches_eager():
    x, d = _dispatch(T=6, H=16, E=4, seed=6)
    M = d.rows_MH.shape[0]
    wgu, wd = torch.randn(4, 16, 16, requires_grad=True), torch.randn(4, 16, 8, requires_grad=True)

    def block(x, wgu, wd):
        h, _ = eg.expert_gemm(x, wgu, d.offs_E, row_map=d.row_map, activation="swiglu", num_rows=M)
        return eg.expert_gemm(h, wd, d.offs_E, row_weight_M=d.probs_M)[0]

    xr = x.clone().requires_grad_()
    eager = block(xr, wgu, wd)
    g_eager = torch.autograd.grad(eager.sum(), (xr, wgu, wd))
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")(xr, wgu, wd)
    g_comp = torch.autograd.grad(compiled.sum(), (xr, wgu, wd))
    assert torch.equal(compiled, eager) and all(torch.equal(a, b) for a, b in zip(g_comp, g_eager))


def test_bad_arguments_name_the_argument():
    x, d = _dispatch(seed=7)
    w = torch.randn(4, 16, 16)
    M = d.rows_MH.shape[0]
    with pytest.raises(ValueError, match="activation"):
        eg.expert_gemm(x, w, d.offs_E, activation="relu")
    with pytest.raises(ValueError, match="num_rows"):
        eg.expert_gemm(x, w, d.offs_E, row_map=d.row_map)
    with pytest.raises(ValueError, match="offs_E"):
        eg.expert_gemm(x, w, d.offs_E.long(), row_map=d.row_map, num_rows=M)
    with pytest.raises(ValueError, match="x_SK.shape"):
        eg.expert_gemm(x[:, :8], w, d.offs_E, row_map=d.row_map, num_rows=M)
    with pytest.raises(ValueError, match="row_weight_M"):
        eg.expert_gemm(x, w, d.offs_E, row_map=d.row_map, num_rows=M, row_weight_M=torch.ones(3))
    with pytest.raises(ValueError, match="w_scale"):
        eg.expert_gemm(x, w.to(torch.float8_e4m3fn), d.offs_E, row_map=d.row_map, num_rows=M, fmt="mxfp8")


def test_heuristic_cpu_and_table():
    assert eg.use_triton_grouped_gemm(4096, 1536, 2048, 128, torch.bfloat16, torch.device("cpu"))
    assert eg.use_triton_grouped_gemm(4096, 1536, 2048, 128, torch.float32, torch.device("cuda"))  # no CUTLASS fp32


def test_heuristic_per_kind_of_gemm(monkeypatch):
    """NOTE [grouped GEMM choice] (moe_compile/ops/_expert_gemm_tuning.py): the measured H100 decisions, read through
    the table for an sm90 bf16 GEMM."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.delenv("MOE_COMPILE_GROUPED_GEMM", raising=False)
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    use = eg.use_triton_grouped_gemm
    # Qwen3-like at T4096 (256 rows per expert): gate_up, the row-weighted down and dX win; an un-weighted down and
    # the wgrad stay on CUTLASS
    assert use(32768, 1536, 2048, 128, bf16, cuda, kind="gated")
    assert use(32768, 2048, 768, 128, bf16, cuda, kind="weighted")
    assert not use(32768, 2048, 768, 128, bf16, cuda, kind="plain")
    assert use(2048, 2048, 768, 128, bf16, cuda, kind="plain")  # T256: 16 rows per expert
    assert use(32768, 2048, 1536, 128, bf16, cuda, kind="dx")
    assert use(131072, 2048, 1536, 128, bf16, cuda, kind="dx")  # T16384: 1024 rows per expert
    assert not use(32768, 1536, 2048, 128, bf16, cuda, kind="wgrad")
    # Mixtral-like: gate_up on Triton only at decode-like row counts; the row-weighted down and dX from
    # prefill-sized row counts (T4096 and T16384 with K 2: 1024 and 4096 rows per expert)
    assert use(512, 7168, 4096, 8, bf16, cuda, kind="gated")
    assert not use(8192, 7168, 4096, 8, bf16, cuda, kind="gated")
    assert not use(512, 4096, 3584, 8, bf16, cuda, kind="weighted")
    assert use(8192, 4096, 3584, 8, bf16, cuda, kind="weighted")
    assert not use(8192, 4096, 7168, 8, bf16, cuda, kind="dx")
    assert use(32768, 4096, 7168, 8, bf16, cuda, kind="dx")
    # quantised weights (no CUTLASS): the family for the gated GEMM from 256 rows per expert, the weight-only
    # kernels otherwise (QUANT_FAMILY_ROWS_FROM)
    for fmt in ("mxfp8", "nvfp4"):
        assert use(32768, 1536, 2048, 128, bf16, cuda, fmt, kind="gated")
        assert not use(512, 1536, 2048, 128, bf16, cuda, fmt, kind="gated")  # T64: 4 rows per expert
        assert not use(32768, 2048, 768, 128, bf16, cuda, fmt, kind="weighted")
    monkeypatch.setenv("MOE_COMPILE_GROUPED_GEMM", "cutlass")
    assert not use(32768, 1536, 2048, 128, bf16, cuda, "mxfp8", kind="gated")
    monkeypatch.setenv("MOE_COMPILE_GROUPED_GEMM", "triton")
    assert use(32768, 1536, 2048, 128, bf16, cuda, kind="wgrad")
    with pytest.raises(ValueError, match="kind"):
        use(1, 1, 1, 1, bf16, cuda, kind="fwd")


def test_gemm_kind_reads_the_weight_layout():
    w = torch.randn(4, 8, 16)
    assert eg.gemm_kind(w, "swiglu") == "gated"
    assert eg.gemm_kind(w, "none") == "plain"
    assert eg.gemm_kind(w, "none", weighted=True) == "weighted"
    assert eg.gemm_kind(w, "swiglu", weighted=True) == "gated"
    assert eg.gemm_kind(w.transpose(1, 2), "none") == "dx"


def test_tma_layout_of_traced_tensors():
    """NOTE [TMA loads] (moe_compile/ops/triton/expert_gemm.py): which operands get tensor descriptors, decided from
    shapes, strides and storage offsets. Traced tensors (fake, and functional as Dynamo hands them to the op) have no
    address: a traced launch once called ``data_ptr`` on them and failed under ``torch.compile``. Fake CUDA tensors need
    no GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

    off = dict(USE_TMA=False, W_KN=False, X_TMA=False)
    with FakeTensorMode():
        w = torch.empty(4, 48, 32, dtype=torch.bfloat16, device="cuda")
        x = torch.empty(64, 32, dtype=torch.bfloat16, device="cuda")
        src = torch.empty(64, dtype=torch.int32, device="cuda")
        w33 = torch.empty(4, 48, 33, dtype=torch.bfloat16, device="cuda")  # 66-byte rows
        odd_rows = torch.empty_strided((64, 32), (33, 1), dtype=torch.bfloat16, device="cuda")
        shifted = torch.empty(65 * 32, dtype=torch.bfloat16, device="cuda").as_strided((64, 32), (32, 1), 1)
        with FunctionalTensorMode():
            for wrap in (lambda t: t, FunctionalTensor.to_functional):
                w_, x_, src_, w33_, odd_, shifted_ = map(wrap, (w, x, src, w33, odd_rows, shifted))
                assert eg._tma_layout(x_, None, w_, False, True) == dict(USE_TMA=True, W_KN=False, X_TMA=True)
                assert eg._tma_layout(x_, src_, w_, True, True) == dict(USE_TMA=True, W_KN=False, X_TMA=False)
                # the backward's w.transpose(1, 2): [E, K, N] storage, un-gated only
                w_kn = w_.transpose(1, 2)
                assert eg._tma_layout(x_, None, w_kn, False, True) == dict(USE_TMA=True, W_KN=True, X_TMA=True)
                assert eg._tma_layout(x_, None, w_kn, True, True) == off
                # rows that are not 16-byte multiples, or start off a 16-byte boundary, keep pointer loads
                assert eg._tma_layout(x_, None, w33_, False, True) == off
                assert eg._tma_layout(odd_, None, w_, False, True) == dict(USE_TMA=True, W_KN=False, X_TMA=False)
                assert not eg._tma_layout(shifted_, None, w_, False, True)["X_TMA"]
                # the rows' descriptor spans the output's rows: x must have exactly that many
                assert eg._tma_layout(x_, None, w_, False, True, rows=64)["X_TMA"]
                assert not eg._tma_layout(x_, None, w_, False, True, rows=65)["X_TMA"]
                assert eg._tma_layout(x_, None, w_, False, False) == off
    assert not eg._tma_enabled(torch.empty(4, 4, dtype=torch.bfloat16), "plain")  # CPU tensors: never


# ===== issue 35: every argument checked on CPU, naming it; values too =====


def test_more_bad_arguments_name_the_argument():
    x, d = _dispatch(seed=int(torch.seed() % 2**31))
    w = torch.randn(4, 16, 16)
    M = d.rows_MH.shape[0]
    kw = dict(row_map=d.row_map, num_rows=M)
    bad_map = d.row_map.clone()
    bad_map[3, 1] = M
    cases = [
        # a row map for other tokens than x's: the gather would read x past its end
        (lambda: eg.expert_gemm(x[:5], w, d.offs_E, **kw), "row_map must have one row per token of x_SK"),
        (lambda: torch.ops.moe.expert_gemm(x[:5], w, d.offs_E, d.row_map, None, "none", M, False),
         "row_map must have one row per token of x_SK"),
        (lambda: eg.expert_gemm(x.to(torch.float8_e4m3fn), w, d.offs_E, **kw), "x_SK must be a 2-D bf16"),
        (lambda: eg.expert_gemm(x, w, d.offs_E, row_map=d.row_map, num_rows=-1), "num_rows must be an int >= 0"),
        (lambda: eg.expert_gemm(x, w, d.offs_E, row_map=d.row_map, num_rows=True), "num_rows must be an int >= 0"),
        (lambda: eg.expert_gemm(x, w, d.offs_E, store_preact="yes", **kw), "store_preact must be a bool"),
        (lambda: eg.expert_gemm(x, w, d.offs_E, row_weight_M=torch.ones(M, dtype=torch.int64), **kw),
         "row_weight_M must have a float dtype"),
        (lambda: eg.expert_gemm(x, w, d.offs_E, row_weight_M=torch.ones(M, device="meta"), **kw), "one device"),
        (lambda: eg.expert_gemm(x, w.to(torch.float8_e4m3fn), d.offs_E, w_scale=torch.zeros(4, 16, 2), fmt="mxfp8",
                                **kw), "qdata_ENK's K=16 must be a multiple of 32"),
        (lambda: eg.expert_gemm(x, torch.zeros(4, 16, 8, dtype=torch.uint8), d.offs_E,
                                w_scale=torch.zeros(4, 16, 1).to(torch.float8_e4m3fn), fmt="nvfp4", **kw),
         "expert_scale_E are required"),
        # values, on CPU: offsets outside the rows, map rows outside the rows
        (lambda: eg.expert_gemm(x, w, torch.tensor([2, 4, 6, M + 1], dtype=torch.int32), **kw),
         rf"offs_E values must be in \[0, {M}\]"),
        (lambda: eg.expert_gemm(x, w, d.offs_E, row_map=bad_map, num_rows=M),
         rf"row_map \(rows\) values must be in \[0, {M}\)"),
    ]
    for call, match in cases:
        with pytest.raises((ValueError, TypeError), match=match):
            call()


def test_epilogue_launchers_name_the_argument():
    """The standalone epilogues' launchers (eager CUDA paths of expert_gemm) check shapes before a kernel could read
    past a tensor; on CPU the checks raise before any launch."""
    from moe_compile.ops import expert_epilogue as ee

    pre, rw = torch.randn(6, 8), torch.rand(6)
    cases = [
        (lambda: ee.launch_epilogue(pre, 8, "swiglu", rw, torch.float32),
         r"pre_MW must be a float tensor of shape \[6, 16\]"),
        (lambda: ee.launch_epilogue(pre, 4, "relu", rw, torch.float32), "activation='relu'"),
        (lambda: ee.launch_epilogue(pre, 4, "swiglu", torch.rand(5), torch.float32), r"row_weight_M .* \[6\]"),
        (lambda: ee.launch_epilogue(pre, 4, "swiglu", rw, torch.int32), "out_dtype must be a float dtype"),
        (lambda: ee.launch_epilogue_backward(pre, torch.randn(6, 3), rw, None, "swiglu", True),
         r"dy_MN must be a float tensor of shape \[6, 4\]"),
        (lambda: ee.launch_epilogue_backward(pre, torch.randn(6, 4), rw, torch.randn(6, 4), "geglu", False),
         r"dpre_MW must be a float tensor of shape \[6, 8\]"),
        (lambda: ee.launch_epilogue_backward(pre, torch.randn(6, 4), rw, None, "swiglu", 1), "need_row_weight_grad"),
        (lambda: ee.launch_row_scale_backward(torch.randn(6, 7), pre, rw),
         r"a_MK must be a float tensor of shape \[6, 8\]"),
        (lambda: ee.launch_row_scale_backward(pre, pre, None), "row_weight_M is required"),
    ]
    for call, match in cases:
        with pytest.raises((ValueError, TypeError), match=match):
            call()
