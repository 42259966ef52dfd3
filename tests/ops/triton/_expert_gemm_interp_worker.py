"""Runs the expert-GEMM Triton kernels (``moe_compile/ops/triton/expert_gemm.py``) through their launchers on
CPU tensors under TRITON_INTERPRET=1 and compares them with ``expert_gemm_reference``.

Started in a fresh interpreter by ``test_expert_gemm_kernels.py`` (the variable must be set before ``triton``
is imported). Prints one JSON line ``{case: "ok" | traceback}``. Bounds come from ``tests/_tolerance.py``
(NOTE [derived tolerances] (tests/_tolerance.py)): two fp32 sums of K products; for gated outputs that error goes
through the epilogue (``|act'| <= 1.13`` for SiLU and erf-GELU), plus the fp32 evaluation of exp / erf and the output
casts (the interpreter truncates). ``--sm90`` compiles the CUDA launch configs for sm_90 instead.
"""

from __future__ import annotations

# name: (kind, counts per expert, extra tail rows, N (output), K, dtype, options)
# options: g = gather through a row map, r = row weight, p = store pre-activations, t = TMA weight loads,
# 1 = one persistent program, s = swiglu, e = geglu, v = the row weight a strided view, x = swapped MMA operands
# (NOTE [swapped operands] (moe_compile/ops/triton/expert_gemm.py))
CASES = {
    "plain_fp32_empty_experts_tail": ("plain", [3, 0, 5, 2], 3, 24, 40, "float32", ""),
    "plain_bf16_gather_swiglu_rw_pre": ("plain", [2, 0, 0, 1, 4, 0, 3], 2, 24, 40, "bfloat16", "grps"),
    "plain_fp16_gather_geglu": ("plain", [0, 0, 9], 0, 16, 24, "float16", "ge"),
    "plain_fp32_gather_rw_one_program": ("plain", [4, 1, 0, 6], 5, 40, 32, "float32", "gr1"),
    "plain_fp32_no_rows": ("plain", [0, 0, 0], 4, 16, 16, "float32", "gs"),
    "plain_fp32_strided_weight": ("strided", [4, 0, 5], 1, 24, 40, "float32", "r"),
    "tma_fp32_gather_swiglu": ("plain", [3, 0, 5, 2], 2, 24, 40, "float32", "gst"),
    "tma_bf16_rw": ("plain", [2, 5, 0], 3, 40, 48, "bfloat16", "rt"),
    "mxfp8_bf16_gather_swiglu": ("mxfp8", [2, 0, 0, 1, 4, 0, 3], 2, 24, 64, "bfloat16", "gsp"),
    "mxfp8_fp32_rw": ("mxfp8", [3, 0, 5, 2], 1, 24, 96, "float32", "r"),
    "nvfp4_fp32_gather_geglu": ("nvfp4", [3, 0, 5, 2], 2, 24, 96, "float32", "ge"),
    "nvfp4_bf16_rw": ("nvfp4", [2, 0, 0, 1, 4, 0, 3], 0, 24, 64, "bfloat16", "r"),
    "swapped_bf16_gather_swiglu_rw_pre": ("plain", [2, 0, 0, 1, 4, 0, 3], 2, 24, 40, "bfloat16", "grpsx"),
    "swapped_mxfp8_bf16_gather_geglu": ("mxfp8", [3, 0, 5, 2], 2, 24, 64, "bfloat16", "gex"),
    "swapped_nvfp4_fp32_rw": ("nvfp4", [2, 0, 0, 1, 4, 0, 3], 1, 24, 96, "float32", "rx"),
    "swapped_tma_fp32_gather_swiglu": ("plain", [3, 0, 5, 2], 2, 24, 40, "float32", "gstx"),
    # TMA with the activations through a descriptor too (not gathered), and a [E, K, N] weight (the dX GEMM)
    "tma_x_bf16_rw": ("plain", [2, 5, 0, 7], 3, 40, 48, "bfloat16", "rt"),
    "tma_x_kn_weight_fp32": ("strided", [4, 0, 5, 3], 2, 24, 40, "float32", "t"),
    "tma_x_kn_weight_bf16_swapped_rw": ("strided", [3, 6, 0], 1, 40, 48, "bfloat16", "rtx"),
    "wgrad_fp32_gather_rw": ("wgrad", [3, 0, 5, 2], 2, 24, 40, "float32", "gr"),
    "wgrad_bf16_plain": ("wgrad", [2, 0, 0, 1, 4, 0, 3], 1, 16, 24, "bfloat16", ""),
    "wgrad_fp32_one_program_empty": ("wgrad", [0, 6, 0], 0, 16, 32, "float32", "g1"),
    "wgrad_bf16_partial_column_group": ("wgrad", [5, 3, 0, 4], 1, 40, 24, "bfloat16", "g"),
    "source_rows": ("source_rows", [3, 0, 5, 2], 3, 8, 8, "float32", ""),
    # issue 35: offsets outside [0, M] (invalid; CPU raises) are clamped, no row outside x / dy is read
    "bad_offs_fp32_plain_and_wgrad": ("bad_offs", [3, 0, 5, 2], 3, 24, 40, "float32", ""),
    # bitwise: same inputs twice, and 1 vs many persistent programs (each tile has one fixed owner)
    "deterministic_bf16_gather_swiglu": ("repeat", [3, 0, 5, 2], 2, 24, 64, "bfloat16", "gsr"),
    # deliberate bug: the row map shifted by one row must FAIL the derived comparison
    "bug_gather_row_map_shifted": ("bug", [3, 0, 5, 2], 2, 24, 40, "float32", "g"),
    # NOTE [standalone epilogues] (moe_compile/ops/triton/expert_epilogue.py) (K unused; N > 16 columns: several column
    # blocks in the forward, several trips of the backward's column loop at the test's BLOCK_N); d = upstream grad of
    # pre, w = d row weight
    "epilogue_bf16_swiglu_rw": ("epilogue", [3, 0, 5], 2, 40, 0, "bfloat16", "sr"),
    "epilogue_fp32_geglu": ("epilogue", [4, 2], 0, 24, 0, "float32", "e"),
    "epilogue_fp16_none_rw": ("epilogue", [2, 3], 1, 40, 0, "float16", "r"),
    "epilogue_backward_fp32_swiglu_rw_drw_dpre": ("epilogue_backward", [3, 0, 5], 2, 40, 0, "float32", "srwd"),
    "epilogue_backward_bf16_geglu": ("epilogue_backward", [4, 2], 1, 24, 0, "bfloat16", "e"),
    "epilogue_backward_fp32_geglu_drw": ("epilogue_backward", [1, 5], 0, 16, 0, "float32", "ew"),
    "row_scale_backward_fp32": ("row_scale_backward", [3, 0, 5], 2, 40, 0, "float32", "r"),
    "row_scale_backward_bf16": ("row_scale_backward", [4, 2], 1, 24, 0, "bfloat16", "r"),
    # a strided row weight (probs[:, 0]) must be read as its values, not its storage
    "plain_fp32_gather_rw_strided": ("plain", [3, 0, 5, 2], 2, 24, 40, "float32", "grv"),
    "wgrad_fp32_rw_strided": ("wgrad", [3, 0, 5, 2], 2, 24, 40, "float32", "rv"),
    "epilogue_fp32_swiglu_rw_strided": ("epilogue", [3, 0, 5], 2, 40, 0, "float32", "srv"),
    "epilogue_backward_fp32_swiglu_rw_strided": ("epilogue_backward", [3, 0, 5], 2, 40, 0, "float32", "srwv"),
    "row_scale_backward_fp32_strided": ("row_scale_backward", [3, 0, 5], 2, 40, 0, "float32", "rv"),
    # expert_gemm's autograd with the standalone epilogues switched on for CPU tensors (on the GPU they run in
    # eager): output and gradients of x, w and the row weight vs the float64 reference
    "standalone_autograd_swiglu_rw": ("standalone_autograd", [3, 0, 5, 2], 2, 24, 40, "float32", "gsr"),
    "standalone_autograd_none_rw": ("standalone_autograd", [2, 4, 0], 1, 24, 40, "float32", "gr"),
}
ACT_RATE = 1.13  # max |d act / dg| for SiLU (1.0998) and erf-GELU (1.1289)


def _setup(torch, gen, counts, extra, K, dtype, opts):
    """x (tokens when gathering, else expert-major rows), offs, row map (or None), src, row weight, M."""
    E, K_top = len(counts), 2
    offs = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    used = int(offs[-1]) if E else 0
    M = used + extra
    if "g" in opts:  # a row map: every used row belongs to one (token, slot); pad rows: every 3rd row
        real = [r for r in range(used) if r % 3 != 2]
        T = (len(real) + K_top - 1) // K_top
        real = real[: T * K_top] if T * K_top <= len(real) else real
        T = len(real) // K_top
        perm = torch.randperm(len(real), generator=gen)[: T * K_top]
        rows = torch.tensor(real)[perm].view(T, K_top).sort(1).values
        row_map = torch.cat([rows, torch.arange(K_top).expand(T, K_top)], 1).to(torch.int32)
        x = torch.randn(max(T, 1), K, generator=gen).to(dtype)[:T]
    else:
        row_map = None
        x = torch.randn(M, K, generator=gen).to(dtype)
    rw = torch.rand(M, generator=gen) if "r" in opts else None
    if rw is not None and "v" in opts:  # a strided view, as probs[:, 0]
        rw = torch.stack([rw, torch.full_like(rw, float("nan"))], 1)[:, 0]
    return x, offs, row_map, rw, M


def _inner_bound(torch, tol, mag, K, act, pre_ref, operand_rel=0.0):
    """Bound on the fp32 epilogue result before the output cast (no row weight)."""
    inner = (tol.accumulation_rel(K) + operand_rel) * mag
    if act == "none":
        return inner
    n = mag.shape[1] // 2
    g, u = pre_ref[:, :n].double(), pre_ref[:, n:].double()
    a_g = torch.nn.functional.silu(g) if act == "swiglu" else torch.nn.functional.gelu(g)
    ig, iu = inner[:, :n], inner[:, n:]
    # act(g + dg) (u + du) - act(g) u, plus exp / erf / product in fp32 (a few ulps of the result)
    return (
        ACT_RATE * ig * (u.abs() + iu)
        + (a_g.abs() + ACT_RATE * ig) * iu
        + 8 * tol.unit_roundoff(torch.float32) * (a_g * u).abs()
    )


def _run_case(eg, gmm, kind, counts, extra, N, K, dtype_name, opts):
    import importlib

    import torch

    ee = importlib.import_module("moe_compile.ops.expert_epilogue")  # (imported by main, without the packages)

    from tests import _tolerance as tol
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(len(kind) * 7 + N + K)
    x, offs, row_map, rw, M = _setup(torch, gen, counts, extra, K, dtype, opts)
    E = len(counts)
    src = eg.source_rows_reference(row_map, M) if row_map is not None else None
    act = "swiglu" if "s" in opts else "geglu" if "e" in opts else "none"
    config = {"NUM_PROGS": 1} if "1" in opts else {}
    if "t" in opts:
        config["USE_TMA"] = True
    if "x" in opts:
        config["SWAP_AB"] = True
    if kind == "source_rows":
        x, offs, row_map, rw, M = _setup(torch, gen, counts, extra, K, dtype, "g")
        got = eg.source_rows(row_map, M)  # CPU: the reference; the kernel directly:
        src_k = torch.full((M,), -1, dtype=torch.int32)
        eg._kernels._source_rows_kernel[(1,)](row_map, src_k, row_map.shape[0], 2, row_map.stride(0), M, BLOCK=64)
        assert torch.equal(src_k, got), (src_k, got)
        a = eg.gather_rows(x, got)
        for t in range(row_map.shape[0]):
            for k in range(2):
                assert torch.equal(a[row_map[t, k]], x[t])
        # rows outside [0, M) (a dropped entry's -1, a corrupt map): skipped, never written past src
        bad_map = row_map.clone()
        bad_map[0, 1], bad_map[1, 0] = -1, M + 3
        guard = torch.full((M + 8,), -7, dtype=torch.int32)  # src is guard[4:4 + M]: stores past it would show
        src_k = guard[4 : 4 + M].fill_(-1)
        eg._kernels._source_rows_kernel[(1,)](bad_map, src_k, bad_map.shape[0], 2, bad_map.stride(0), M, BLOCK=64)
        want = got.clone()
        want[row_map[0, 1]] = want[row_map[1, 0]] = -1
        assert torch.equal(src_k, want) and torch.equal(eg.source_rows_reference(bad_map, M), want)
        assert (guard[:4] == -7).all() and (guard[4 + M :] == -7).all()
        return
    if kind == "bad_offs":
        bad = offs.clone()
        bad[0], bad[-1] = -3, M + 5
        huge = torch.finfo(dtype).max / 4

        def padded(t):
            buf = torch.full((t.shape[0] + 16, t.shape[1]), huge, dtype=dtype)
            buf[8 : 8 + t.shape[0]] = t
            return buf[8 : 8 + t.shape[0]]

        w = torch.randn(E, N, K, generator=gen).to(dtype)
        y = torch.full((M, N), float("nan"), dtype=dtype)
        eg.launch_expert_gemm(padded(x), None, w, None, None, bad, None, y, None, "none", "plain", config={})
        want = eg.expert_gemm_reference(x, w, bad, None, None, "none")[0]
        assert bool(torch.isfinite(y).all()), "a row outside x was read"
        mag = tol.grouped_abs_matmul(x, w, bad)
        tol.assert_within(y, want, tol.matmul_bound(mag, K, want, got_dtype=dtype, want_dtype=dtype))
        dy = torch.randn(M, N, generator=gen).to(dtype)
        out = torch.full((E, N, K), float("nan"), dtype=dtype)
        eg.launch_expert_wgrad(padded(dy), padded(x), None, None, bad, out)
        assert bool(torch.isfinite(out).all()), "a row outside dy / x was read"
        want = gmm.grouped_mm_wgrad_reference(dy, x, bad)
        tol.assert_within(out, want, tol.matmul_bound(tol.grouped_wgrad_abs(dy, x, bad), M, want, got_dtype=dtype,
                                                      want_dtype=dtype))
        return
    if kind == "row_scale_backward":
        # NOTE [standalone epilogues] (moe_compile/ops/triton/expert_epilogue.py): dx = rw * dxu, d rw = sum(a * dxu)
        a, dxu = torch.randn(M, N, generator=gen).to(dtype), torch.randn(M, N, generator=gen).to(dtype)
        dx, drw = ee.launch_row_scale_backward(a, dxu, rw, block_n=16)
        want = dxu.double() * rw.double()[:, None]
        inner = tol.unit_roundoff(torch.float32) * want.abs()
        tol.assert_within(dx, want, inner + tol.rounding_bound(want, dtype, inner=inner, truncate=True), "dx")
        terms = a.double() * dxu.double()
        tol.assert_within(drw, terms.sum(1), tol.gamma(N) * terms.abs().sum(1), "d row weight")
        return
    if kind == "standalone_autograd":
        _run_standalone_autograd_case(torch, tol, eg, x, offs, row_map, rw, M, N, K, act, gen)
        return
    if kind in ("epilogue", "epilogue_backward"):
        _run_epilogue_case(torch, tol, ee, kind, M, N, dtype, act, rw, opts, gen)
        return
    if kind == "wgrad":
        dy = torch.randn(M, N, generator=gen).to(dtype)
        out = torch.full((E, N, K), float("nan"), dtype=dtype)
        eg.launch_expert_wgrad(dy, x, src, rw, offs, out, config=config)
        a = eg.gather_rows(x, src)
        dys = dy if rw is None else (dy.float() * rw[:, None]).to(dtype)
        want = gmm.grouped_mm_wgrad_reference(dys, a, offs)
        mag = tol.grouped_wgrad_abs(dys, a, offs)
        tol.assert_within(
            out,
            want,
            tol.matmul_bound(mag, max(max(counts), 1), want, got_dtype=dtype, want_dtype=dtype, got_truncates=True),
        )
        assert torch.all(out[torch.tensor(counts) == 0] == 0)
        if "1" in opts:
            again = torch.full_like(out, float("nan"))
            eg.launch_expert_wgrad(dy, x, src, rw, offs, again)
            assert torch.equal(out, again), "wgrad depends on the number of persistent programs"
        return
    n_w = 2 * N if act != "none" else N
    fmt, scale, gscale = "plain", None, None
    if kind == "strided":  # a w.transpose(1, 2) view (the dX operand of the backward)
        w = torch.randn(E, K, n_w, generator=gen).to(dtype).transpose(1, 2)
        dense = w
    elif kind == "mxfp8":
        fmt = "mxfp8"
        w = (torch.randn(E, n_w, K, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        scale = torch.randint(120, 135, (E, n_w, K // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
        dense = gmm.dequantize_mxfp8(w, scale, dtype)
    elif kind == "nvfp4":
        fmt = "nvfp4"
        w = torch.randint(0, 256, (E, n_w, K // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
        scale = (torch.rand(E, n_w, K // 16, generator=gen) * 8 + 0.01).to(torch.float8_e4m3fn)
        gscale = torch.rand(E, generator=gen) + 0.5
        dense = gmm.dequantize_nvfp4(w, scale, gscale, dtype)
    else:
        w = torch.randn(E, n_w, K, generator=gen).to(dtype)
        dense = w

    def launch(src_in, cfg=config):
        y = torch.full((M, N), float("nan"), dtype=dtype)
        pre = torch.full((M, n_w), float("nan"), dtype=dtype) if "p" in opts else None
        eg.launch_expert_gemm(x, src_in, w, scale, gscale, offs, rw, y, pre, act, fmt, config=dict(cfg))
        return y, pre

    y, pre = launch(src)
    want, pre_want = eg.expert_gemm_reference(x, dense, offs, src, rw, act)
    a = eg.gather_rows(x, src)
    mag = tol.grouped_abs_matmul(a, dense, offs)
    operand_rel = 0.0
    if fmt == "nvfp4":  # as _grouped_mm_interp_worker._operand_rel
        operand_rel = 4 * tol.unit_roundoff(torch.float32) + (
            tol.unit_roundoff(dtype) if dtype in tol.LOW_PRECISION else 0.0
        )
    pre_ref = gmm.grouped_mm_reference(a.double(), dense.double(), offs)
    inner = _inner_bound(torch, tol, mag, K, act, pre_ref, operand_rel)
    if rw is not None:  # times the row weight in fp32: one more rounding
        inner = inner * rw.double()[:, None] + tol.unit_roundoff(torch.float32) * want.double().abs()
    bound = (
        inner
        + tol.rounding_bound(want, dtype, inner=inner, truncate=True)
        + tol.rounding_bound(want, dtype, inner=inner)
    )
    if kind == "bug":
        tol.assert_within(y, want, bound)
        bad = src.clone()
        used = bad >= 0
        bad[used] = (bad[used] + 1) % x.shape[0]
        y_bad, _ = launch(bad)
        try:
            tol.assert_within(y_bad, want, bound)
        except AssertionError:
            return
        raise AssertionError("a shifted row map passed the derived comparison")
    tol.assert_within(y, want, bound)
    if pre is not None:
        pb = tol.matmul_bound(
            mag, K, pre_want, operand_rel=operand_rel, got_dtype=dtype, want_dtype=dtype, got_truncates=True
        )
        tol.assert_within(pre, pre_want, pb)
    assert torch.all(y[int(offs[-1]) :] == 0), "rows past offs[-1] must be zero"
    if kind == "repeat":
        assert torch.equal(y, launch(src)[0]), "not reproducible"
        assert torch.equal(y, launch(src, {"NUM_PROGS": 1})[0]), "depends on the number of persistent programs"


def _run_standalone_autograd_case(torch, tol, eg, x, offs, row_map, rw, M, N, K, act, gen):
    """``expert_gemm`` + autograd with ``_standalone_epilogue`` forced on (the epilogue kernels under the
    interpreter) against the float64 reference, within the layer bound (``tests/_tolerance.py::layer_rel``)."""
    E = offs.shape[0]
    w = torch.randn(E, 2 * N if act != "none" else N, K, generator=gen)
    dy = torch.randn(M, N, generator=gen)
    src = eg.source_rows_reference(row_map, M)
    xd, wd, rwd = x.double().requires_grad_(), w.double().requires_grad_(), rw.double().requires_grad_()
    want_y = eg.expert_gemm_reference(xd, wd, offs, src, rwd, act)[0]
    want = (want_y, *torch.autograd.grad(want_y, (xd, wd, rwd), dy.double()))
    forced = eg._standalone_epilogue
    eg._standalone_epilogue = lambda t: True
    try:
        xg, wg, rwg = x.clone().requires_grad_(), w.clone().requires_grad_(), rw.clone().requires_grad_()
        y, _ = eg.expert_gemm(xg, wg, offs, row_map=row_map, row_weight_M=rwg, activation=act, num_rows=M)
        got = (y, *torch.autograd.grad(y, (xg, wg, rwg), dy))
    finally:
        eg._standalone_epilogue = forced
    rows = max(int(offs.diff(prepend=offs.new_zeros(1)).max()), 1)
    for g, ref, what, k_dims in zip(got, want, ("y", "dX", "dW", "d row weight"), ([K], [K, N], [K, N], [K, N])):
        tol.assert_layer_close(g, ref, k_dims, torch.float32, backward=what != "y", rows=rows, what=what)


def _run_epilogue_case(torch, tol, ee, kind, M, N, dtype, act, rw, opts, gen):
    """NOTE [standalone epilogues] (moe_compile/ops/triton/expert_epilogue.py) against the same formulas in float64.
    Bounds: 16 fp32 rounding errors of each term's magnitude, where the magnitude of ``act(g)`` and ``act'(g)`` includes
    the cancellations of their fp32 evaluation (``1 + erf(g / sqrt 2)`` for GELU: ``|g| / 2`` more; ``1 - sigmoid(g)``
    in SiLU's derivative: ``|g|`` more), then the output cast (the interpreter truncates); the row weight's gradient
    adds a length-N fp32 sum."""
    n_w = 2 * N if act != "none" else N
    pre = torch.randn(M, n_w, generator=gen).to(dtype)
    u32 = tol.unit_roundoff(torch.float32)
    scale = rw.double()[:, None] if rw is not None else torch.ones(M, 1, dtype=torch.float64)
    p64 = pre.double()
    g, u = (p64[:, :N], p64[:, N:]) if act != "none" else (p64, None)
    if act == "swiglu":
        a, s = torch.nn.functional.silu(g), torch.sigmoid(g)
        mag_a, da = a.abs(), s * (1 + g * (1 - s))
        mag_da = da.abs() + g.abs()
    else:
        a = torch.nn.functional.gelu(g)
        mag_a = a.abs() + 0.5 * g.abs()
        da = 0.5 * (1 + torch.erf(g / 2**0.5)) + g * torch.exp(-0.5 * g * g) / (2 * torch.pi) ** 0.5
        mag_da = da.abs() + 1
    if kind == "epilogue":
        got = ee.launch_epilogue(pre, N, act, rw, dtype, block_n=16)
        if act == "none":
            want, inner = p64 * scale, 2 * u32 * (p64 * scale).abs()
        else:
            want, inner = a * u * scale, 16 * u32 * mag_a * (u * scale).abs()
        tol.assert_within(got, want, inner + tol.rounding_bound(want, dtype, inner=inner, truncate=True))
        return
    dy = torch.randn(M, N, generator=gen).to(dtype)
    dpre = torch.randn(M, n_w, generator=gen).to(dtype) if "d" in opts else None
    dz, drw = ee.launch_epilogue_backward(pre, dy, rw, dpre, act, "w" in opts, block_n=16)
    dh = dy.double() * scale
    want = torch.cat([dh * u * da, dh * a], 1)
    inner = 16 * u32 * torch.cat([(dh * u).abs() * mag_da, dh.abs() * mag_a], 1)
    if dpre is not None:
        want = want + dpre.double()
        inner = inner + u32 * want.abs()
    tol.assert_within(dz, want, inner + tol.rounding_bound(want, dtype, inner=inner, truncate=True), "dz")
    if "w" in opts:
        want_rw = (a * u * dy.double()).sum(1)
        bound = (16 * u32 + tol.gamma(N)) * (mag_a * (u * dy.double()).abs()).sum(1)
        tol.assert_within(drw, want_rw, bound, "d row weight")
        again = ee.launch_epilogue_backward(pre, dy, rw, dpre, act, True, block_n=16)[1]
        assert torch.equal(drw, again), "the row weight's gradient is not reproducible"
    else:
        assert drw is None


# (M, E, N_out, K, activation, gather, row weight): Qwen3-MoE-like gate_up / down and Mixtral-like at T 4096
SM90_SHAPES = (
    (32768, 128, 768, 2048, "swiglu", True, False),
    (32768, 128, 2048, 768, "none", False, True),
    (8192, 8, 3584, 4096, "swiglu", True, False),
    (512, 128, 768, 2048, "swiglu", True, False),
)
_SM90_TYPES = {  # format -> (x/y, weight, scale, per-expert scale) pointer types, bf16 activations
    "plain": ("*bf16", "*bf16", "*bf16", "*i32"),
    "mxfp8": ("*bf16", "*fp8e4nv", "*u8", "*i32"),
    "nvfp4": ("*bf16", "*i16", "*fp8e4nv", "*fp32"),
}


def compile_sm90() -> dict:
    """Compile the CUDA launch configs (bf16 ``tl.dot``, TMA, PTX decode) for sm_90; no GPU needed."""
    from tests.ops.triton._interp import compile_for_sm90, import_ops_only

    eg, gmm = import_ops_only("expert_gemm", "grouped_mm")
    kernel, jobs = eg._kernels._expert_gemm_kernel, {}
    for M, E, N, K, act, gather, rw in SM90_SHAPES:
        for fmt, (x_t, w_t, s_t, g_t) in _SM90_TYPES.items():
            # TMA: weights through descriptors, activations too when not gathered; un-gated also the dX layout
            tmas = [(False, False)] + (
                [(True, False)] + ([(True, True)] if act == "none" else []) if fmt == "plain" else []
            )
            for tma, w_kn in tmas:
                cfg = eg.pick_config(M, E, N, K, fmt, False, act != "none", True, tma_nk=tma and not w_kn)
                consts = dict(GATHER=gather, ACT=eg.ACTIVATIONS[act], ROW_SCALE=rw, STORE_PRE=act != "none",
                              W_FORMAT=gmm._FORMATS[fmt], IEEE_DOT=False, PTX_DECODE=fmt == "nvfp4",
                              K_ALIGN=gmm.k_align(K),
                              USE_TMA=tma, W_KN=w_kn, X_TMA=tma and not gather,
                              BLOCK_E=max(gmm._next_pow2(E), 16))  # fmt: skip
                consts.update({k: v for k, v in cfg.items() if k.isupper()})
                ptrs = dict(x_ptr=x_t, src_ptr="*i32", w_ptr=w_t, w_scale_ptr=s_t, w_gscale_ptr=g_t, offs_ptr="*i32",
                            rw_ptr="*fp32", y_ptr=x_t, pre_ptr=x_t)  # fmt: skip
                sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in kernel.arg_names}
                opts = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
                jobs[f"gemm_{fmt}_{M}_{E}_{N}_{K}_{act}_tma{tma}{'_kn' if w_kn else ''}"] = (kernel, sig, consts, opts)
    wgrad = eg._kernels._expert_wgrad_kernel
    for gather, rw in ((True, False), (False, True)):
        cfg = eg.wgrad_config(1536, 2048, False, True, rw)
        consts = dict(GATHER_X=gather, ROW_SCALE=rw, IEEE_DOT=False, **{k: v for k, v in cfg.items() if k.isupper()})
        sig = {n: "constexpr" if n in consts else "*bf16" if n.endswith("_ptr") else "i32" for n in wgrad.arg_names}
        sig.update(src_ptr="*i32", offs_ptr="*i32", rw_ptr="*fp32")
        jobs[f"wgrad_gather{gather}_rw{rw}"] = (
            wgrad,
            sig,
            consts,
            dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]),
        )
    (ee,) = import_ops_only("expert_epilogue")
    epi = ee._kernels._epilogue_kernel
    for act, rw in (("swiglu", True), ("none", True), ("geglu", False)):
        consts = dict(ACT=ee.ACTIVATIONS[act], ROW_SCALE=rw, BLOCK_N=ee.EPILOGUE_BLOCK_N)
        sig = dict(
            pre_ptr="*bf16", rw_ptr="*bf16", out_ptr="*bf16", N="i32", stride_pre="i32", stride_out="i32", **consts
        )
        jobs[f"epilogue_{act}_rw{rw}"] = (
            epi,
            {n: "constexpr" if n in consts else t for n, t in sig.items()},
            consts,
            dict(num_warps=4),
        )
    epi_b = ee._kernels._epilogue_backward_kernel
    for act in ("swiglu", "geglu"):
        consts = dict(
            ACT=ee.ACTIVATIONS[act], ROW_SCALE=True, NEED_DRW=True, HAS_DPRE=False, BLOCK_N=ee.EPILOGUE_BLOCK_N
        )
        sig = {
            n: "constexpr" if n in consts else "*fp32" if n == "drw_ptr" else "*bf16" if n.endswith("_ptr") else "i32"
            for n in epi_b.arg_names
        }
        jobs[f"epilogue_backward_{act}"] = (epi_b, sig, consts, dict(num_warps=4))
    rsb = ee._kernels._row_scale_backward_kernel
    consts = dict(BLOCK_N=ee.EPILOGUE_BLOCK_N)
    sig = {n: "constexpr" if n in consts else "*fp32" if n in ("rw_ptr", "drw_ptr")
           else "*bf16" if n.endswith("_ptr") else "i32"
           for n in rsb.arg_names}
    jobs["row_scale_backward"] = (rsb, sig, consts, dict(num_warps=4))
    src_k = eg._kernels._source_rows_kernel
    sig = dict(row_map_ptr="*i32", src_ptr="*i32", T="i32", K="i32", stride_t="i32", num_rows="i32",
               BLOCK="constexpr")
    jobs["source_rows"] = (src_k, sig, dict(BLOCK=1024), dict(num_warps=4))
    return compile_for_sm90(jobs)


def main() -> None:
    import json
    import os
    import sys

    from tests.ops.triton._interp import import_ops_only, run_cases

    if "--sm90" in sys.argv:
        print(json.dumps(compile_sm90()))
        return
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    eg, gmm, ee = import_ops_only("expert_gemm", "grouped_mm", "expert_epilogue")
    only = [a for a in sys.argv[1:] if not a.startswith("-")]
    kernels = [*vars(eg._kernels).items(), *vars(ee._kernels).items()]
    assert all(type(v).__name__ == "InterpretedFunction" for k, v in kernels if k.endswith("_kernel"))
    results = {"_kernels": sorted({k for k, _ in kernels if k.endswith("_kernel")})}
    jobs = [(name, lambda case=case: _run_case(eg, gmm, *case)) for name, case in CASES.items()
            if not only or name in only]
    print(json.dumps(run_cases(jobs, results)))


if __name__ == "__main__":
    main()
