"""``moe::expert_gemm`` / ``moe::expert_wgrad`` on CUDA with the production tile configs (written for the H100).

The interpreter tests (``tests/ops/triton/test_expert_gemm_kernels.py``) run the kernels at tiny tiles; these
run the GPU configs (``pick_config`` / ``wgrad_config``) at a Qwen3-like width with uneven and empty experts,
the Triton family forced, against the fp64 reference within the derived bounds (``tests/_tolerance.py``).
"""

from __future__ import annotations

import logging

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from moe_compile.ops import expert_gemm as eg  # noqa: E402
from moe_compile.ops import grouped_mm as gmm  # noqa: E402
from moe_compile.ops.permute_pad import permute_pad  # noqa: E402
from tests import _tolerance as tol  # noqa: E402

DEV = "cuda"
T, H, I, E, K = 512, 1024, 384, 16, 4  # noqa: E741 - 128 rows per expert on average


@pytest.fixture
def forced_triton(monkeypatch):
    monkeypatch.setenv("MOE_COMPILE_GROUPED_GEMM", "triton")


def _dispatch(seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(DEV)
    scores = torch.rand(T, E, generator=gen)
    scores[:, 3] = -1  # expert 3 gets no rows
    scores[:, 5] += 0.5  # expert 5 gets many
    ids = scores.argsort(1, descending=True)[:, :K].to(DEV)
    probs = torch.rand(T, K, generator=gen).to(DEV)
    return x, permute_pad(x, ids, probs, num_experts=E, align=16), gen


@pytest.mark.parametrize("gathered", [True, False], ids=["gate_up_gathered", "down_rows"])
@pytest.mark.parametrize("rw_dtype", [None, torch.bfloat16, torch.float32])
def test_wgrad(forced_triton, gathered, rw_dtype):
    """Both wgrad layouts of the block (gate_up: x gathered through the row map; down: the expert rows of h,
    ``K = I``), with and without the row weight, within the bound and bitwise equal over repeated runs."""
    x, d, gen = _dispatch(0)
    M = d.rows_MH.shape[0]
    n, src_x = (2 * I, x) if gathered else (H, torch.randn(M, I, generator=gen).to(torch.bfloat16).to(DEV))
    row_map = d.row_map if gathered else None
    dz = torch.randn(M, n, generator=gen).to(torch.bfloat16).to(DEV)
    rw = d.probs_M.to(rw_dtype) if rw_dtype is not None else None
    runs = [torch.ops.moe.expert_wgrad(dz, src_x, d.offs_E, row_map, rw) for _ in range(3)]
    a = eg.gather_rows(x, eg.source_rows(d.row_map, M)) if gathered else src_x
    # the kernel rounds the scaled dy to the MMA dtype
    dys = dz if rw is None else (dz.float() * rw.float()[:, None]).to(torch.bfloat16)
    want = gmm.grouped_mm_wgrad_reference(dys.double(), a.double(), d.offs_E)
    counts = d.counts_E.tolist()
    bound = tol.matmul_bound(tol.grouped_wgrad_abs(dys, a, d.offs_E), max(counts), want, got_dtype=torch.bfloat16)
    tol.assert_within(runs[0], want, bound, "expert_wgrad")
    assert counts[3] == 0 and torch.all(runs[0][3] == 0)
    assert all(torch.equal(runs[0], r) for r in runs[1:]), "not bitwise reproducible"


def test_gated_forward_and_dx(forced_triton):
    x, d, gen = _dispatch(1)
    M = d.rows_MH.shape[0]
    w = (torch.randn(E, 2 * I, H, generator=gen) * H**-0.5).to(torch.bfloat16).to(DEV)
    y, pre = eg.expert_gemm(x, w, d.offs_E, row_map=d.row_map, activation="swiglu", num_rows=M, store_preact=True)
    a = eg.gather_rows(x, eg.source_rows(d.row_map, M))
    want_pre = gmm.grouped_mm_reference(a.double(), w.double(), d.offs_E)
    bound = tol.grouped_mm_bound(a, w, d.offs_E, want_pre, got_dtype=torch.bfloat16)
    tol.assert_within(pre, want_pre, bound, "gate_up pre-activations")
    # the epilogue reads the fp32 accumulators, the reference the stored bf16 pre: with g' = g (1 + d1),
    # u' = u (1 + d2), |d| <= u_bf16, |silu(g) u - silu(g') u'| <= (1.1 + 1) u_bf16 |g| |u| (|silu'| <= 1.1,
    # |silu(g)| <= |g|); doubled for the first-order slack and the fp32 evaluation of the epilogue
    g, u = pre[:, :I].double(), pre[:, I:].double()
    want_y = torch.nn.functional.silu(g) * u
    slack = 2 * 2.1 * tol.unit_roundoff(torch.bfloat16) * g.abs() * u.abs()
    tol.assert_within(y, want_y, tol.rounding_bound(want_y, torch.bfloat16, inner=slack) + slack, "swiglu output")
    # dX against the transposed weights (the backward's input-gradient GEMM)
    dz = torch.randn(M, 2 * I, generator=gen).to(torch.bfloat16).to(DEV)
    dx = eg.expert_gemm(dz, w.transpose(1, 2), d.offs_E)[0]
    want_dx = gmm.grouped_mm_reference(dz.double(), w.transpose(1, 2).double(), d.offs_E)
    tol.assert_within(
        dx, want_dx, tol.grouped_mm_bound(dz, w.transpose(1, 2), d.offs_E, want_dx, got_dtype=torch.bfloat16), "dX"
    )


def test_every_choice_trains_the_same_gated_gemm(monkeypatch):
    """Forced Triton, forced CUTLASS and the shipped per-GEMM choice (Triton forward, CUTLASS dX / wgrad here) all
    give the fp64 reference's output and gradients within the layer bound (``tests/_tolerance.py::layer_rel``)."""
    x, d, gen = _dispatch(2)
    M = d.rows_MH.shape[0]
    w = (torch.randn(E, 2 * I, H, generator=gen) * H**-0.5).to(torch.bfloat16).to(DEV)
    dy = torch.randn(M, I, generator=gen).to(torch.bfloat16).to(DEV)
    src = eg.source_rows(d.row_map, M)
    valid = src >= 0  # pad and tail rows are zero on every path
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    want_y = eg.expert_gemm_reference(xd, wd, d.offs_E, src, None, "swiglu")[0]
    want = (want_y, *torch.autograd.grad(want_y, (xd, wd), dy.double()))
    rows = int(d.counts_E.max())
    for choice in ("triton", "cutlass", ""):
        monkeypatch.setenv("MOE_COMPILE_GROUPED_GEMM", choice)
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        y, _ = eg.expert_gemm(xg, wg, d.offs_E, row_map=d.row_map, activation="swiglu", num_rows=M)
        got = (y, *torch.autograd.grad(y, (xg, wg), dy))
        name = choice or "auto"
        tol.assert_layer_close(got[0][valid], want[0][valid], [H], torch.bfloat16, what=f"{name} y")
        for g, ref, what in zip(got[1:], want[1:], ("dX", "dW")):
            tol.assert_layer_close(g, ref, [H, 2 * I], torch.bfloat16, backward=True, rows=rows, what=f"{name} {what}")


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_quantised_choices_agree(monkeypatch, fmt):
    """Quantised gate_up + SwiGLU and the row-weighted down through the public op on each path: the family
    (``triton``), the weight-only kernels plus the standalone epilogue (``cutlass``) and the shipped choice, against
    the fp64 reference on the dequantised weights within the derived layer bound; bitwise over runs."""
    from moe_compile.experts.grouped_weight import quantize_stored

    x, d, gen = _dispatch(5)
    M = d.rows_MH.shape[0]
    w1 = (torch.randn(E, 2 * I, H, generator=gen) * H**-0.5).to(torch.bfloat16).to(DEV)
    w2 = (torch.randn(E, H, I, generator=gen) * I**-0.5).to(torch.bfloat16).to(DEV)
    q1, q2 = quantize_stored(w1, fmt), quantize_stored(w2, fmt)
    src = eg.source_rows(d.row_map, M)
    valid = src >= 0
    deq1, deq2 = (eg._dense_weight(*q, fmt, torch.float32).double() for q in (q1, q2))
    rw = d.probs_M.float()
    want_h = eg.expert_gemm_reference(x.double(), deq1, d.offs_E, src, None, "swiglu")[0]

    def block():
        kw = dict(fmt=fmt)
        h, _ = eg.expert_gemm(x, q1[0], d.offs_E, row_map=d.row_map, activation="swiglu", num_rows=M,
                              w_scale=q1[1], expert_scale_E=q1[2], **kw)
        y, _ = eg.expert_gemm(h, q2[0], d.offs_E, row_weight_M=rw, w_scale=q2[1], expert_scale_E=q2[2], **kw)
        return h, y

    # NVFP4's block scale times the per-expert scale, and the accumulator times it, are fp32 roundings; the row
    # weight's fp32 product one more (|rw| <= 1)
    operand = (3 if fmt == "nvfp4" else 1) * tol.unit_roundoff(torch.float32)
    for choice in ("triton", "cutlass", ""):
        monkeypatch.setenv("MOE_COMPILE_GROUPED_GEMM", choice)
        (h, y), (h2, y2) = block(), block()
        assert torch.equal(h, h2) and torch.equal(y, y2), f"{choice or 'auto'}: not bitwise reproducible"
        want_y = eg.expert_gemm_reference(h.double(), deq2, d.offs_E, None, rw.double(), "none")[0]
        name = choice or "auto"
        tol.assert_layer_close(h[valid], want_h[valid], [H], torch.bfloat16, what=f"{fmt} {name} h")
        # the weight-only route stores the GEMM in bf16 before the row weight: one more rounding of |acc|
        library = not eg.use_triton_grouped_gemm(M, H, I, E, torch.bfloat16, x.device, fmt, kind="weighted")
        rel = operand + (tol.unit_roundoff(torch.bfloat16) if library else 0.0)
        bound = tol.grouped_mm_bound(h, deq2, d.offs_E, want_y, got_dtype=torch.bfloat16, operand_rel=rel)
        tol.assert_within(y, want_y, bound, f"{fmt} {name} y")


@pytest.mark.parametrize("activation", ["swiglu", "geglu", "none"])
def test_standalone_epilogues_with_row_weight(monkeypatch, activation):
    """NOTE [standalone epilogues] (moe_compile/ops/triton/expert_epilogue.py): the CUTLASS forward's epilogue kernel
    and the backward's, with a row weight: output and gradients (x, w, row weight) within the layer bound of the fp64
    reference, bitwise over runs."""
    monkeypatch.setenv("MOE_COMPILE_GROUPED_GEMM", "cutlass")
    x, d, gen = _dispatch(3)
    M = d.rows_MH.shape[0]
    w = (torch.randn(E, 2 * I, H, generator=gen) * H**-0.5).to(torch.bfloat16).to(DEV)
    rw = d.probs_M.float()
    n_out = I if activation != "none" else 2 * I
    dy = torch.randn(M, n_out, generator=gen).to(torch.bfloat16).to(DEV)
    src = eg.source_rows(d.row_map, M)
    valid = src >= 0
    xd, wd, rwd = x.double().requires_grad_(), w.double().requires_grad_(), rw.double().requires_grad_()
    want_y = eg.expert_gemm_reference(xd, wd, d.offs_E, src, rwd, activation)[0]
    want = (want_y, *torch.autograd.grad(want_y, (xd, wd, rwd), dy.double()))
    runs = []
    for _ in range(3):
        xg, wg, rwg = x.clone().requires_grad_(), w.clone().requires_grad_(), rw.clone().requires_grad_()
        y, _ = eg.expert_gemm(xg, wg, d.offs_E, row_map=d.row_map, row_weight_M=rwg, activation=activation, num_rows=M)
        runs.append((y, *torch.autograd.grad(y, (xg, wg, rwg), dy)))
    got = runs[0]
    rows = int(d.counts_E.max())
    tol.assert_layer_close(got[0][valid], want[0][valid], [H], torch.bfloat16, what="y")
    tol.assert_layer_close(got[1], want[1], [H, 2 * I], torch.bfloat16, backward=True, rows=rows, what="dX")
    tol.assert_layer_close(got[2], want[2], [H, 2 * I], torch.bfloat16, backward=True, rows=rows, what="dW")
    tol.assert_layer_close(
        got[3][valid], want[3][valid], [H, n_out], torch.bfloat16, backward=True, what="d row weight"
    )
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(run, got)), "not bitwise reproducible"


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("gated", [True, False], ids=["gate_up_swapped", "down_wide"])
def test_quantised_forward_production_tiles(fmt, gated):
    """Weight-only MXFP8 / NVFP4 at prefill rows with the shipped tiles
    (NOTE [expert GEMM tiles] (moe_compile/ops/_expert_gemm_tuning.py): gate_up and the MXFP8 down with swapped MMA
    operands, the NVFP4 down with ``[128, 256]`` tiles) against the fp64 reference on the dequantised weights (computed
    in fp32, as the kernels scale), within the derived bound; bitwise over repeated runs."""
    from moe_compile.experts.grouped_weight import quantize_stored

    x, d, gen = _dispatch(4)
    M = d.rows_MH.shape[0]
    src = eg.source_rows(d.row_map, M)
    n_out = I if gated else 2 * I
    w = (torch.randn(E, 2 * I, H, generator=gen) * H**-0.5).to(torch.bfloat16).to(DEV)
    qdata, scale, expert_scale = quantize_stored(w, fmt)
    cfg = eg.pick_config(M, E, n_out, H, fmt, False, gated, True)
    assert cfg["SWAP_AB"] == (gated or fmt == "mxfp8") and cfg["BLOCK_M"] * cfg["BLOCK_N"] >= 128 * 128, cfg
    runs = []
    for _ in range(2):
        y = torch.full((M, n_out), float("nan"), dtype=torch.bfloat16, device=DEV)
        pre = torch.full((M, 2 * I), float("nan"), dtype=torch.bfloat16, device=DEV) if gated else None
        eg.launch_expert_gemm(x, src, qdata, scale, expert_scale, d.offs_E, None, y, pre,
                              "swiglu" if gated else "none", fmt)
        runs.append((y, pre))
    assert torch.equal(runs[0][0], runs[1][0]), "not bitwise reproducible"
    deq = eg._dense_weight(qdata, scale, expert_scale, fmt, torch.float32).double()
    a = eg.gather_rows(x, src)
    want_pre = gmm.grouped_mm_reference(a.double(), deq, d.offs_E)
    # NVFP4: the block scale times the per-expert scale, and the accumulator times it, are fp32 roundings
    operand_rel = 2 * tol.unit_roundoff(torch.float32) if fmt == "nvfp4" else 0.0
    bound = tol.grouped_mm_bound(a, deq, d.offs_E, want_pre, got_dtype=torch.bfloat16, operand_rel=operand_rel)
    if not gated:
        tol.assert_within(runs[0][0], want_pre, bound, f"{fmt} y")
        return
    pre = runs[0][1]
    tol.assert_within(pre, want_pre, bound, f"{fmt} gate_up pre-activations")
    g, u = pre[:, :I].double(), pre[:, I:].double()
    want_y = torch.nn.functional.silu(g) * u
    # as in test_gated_forward_and_dx: the epilogue reads the fp32 accumulators, the reference the stored bf16 pre
    slack = 2 * 2.1 * tol.unit_roundoff(torch.bfloat16) * g.abs() * u.abs()
    tol.assert_within(runs[0][0], want_y, tol.rounding_bound(want_y, torch.bfloat16, inner=slack) + slack, f"{fmt} y")


def _block(xg, w1, w2, rw, offs, row_map, num_rows):
    """Gate_up (gathered rows, SwiGLU) then down (row weight), as the rewritten MoE block runs them."""
    h, _ = eg.expert_gemm(xg, w1, offs, row_map=row_map, activation="swiglu", num_rows=num_rows)
    return eg.expert_gemm(h, w2, offs, row_weight_M=rw)[0]


def _block_inputs(seed: int):
    x, d, gen = _dispatch(seed)
    M = d.rows_MH.shape[0]
    w1 = (torch.randn(E, 2 * I, H, generator=gen) * H**-0.5).to(torch.bfloat16).to(DEV)
    w2 = (torch.randn(E, H, I, generator=gen) * I**-0.5).to(torch.bfloat16).to(DEV)
    dy = torch.randn(M, H, generator=gen).to(torch.bfloat16).to(DEV)
    return x, d, w1, w2, dy


def _block_step(fn, x, d, w1, w2, dy):
    """The block's output and the gradients of x, both weights and the row weight, through ``fn``."""
    xg, w1g, w2g, rwg = (t.clone().requires_grad_() for t in (x, w1, w2, d.probs_M.float()))
    y = fn(xg, w1g, w2g, rwg, d.offs_E, d.row_map, d.rows_MH.shape[0])
    return (y, *torch.autograd.grad(y, (xg, w1g, w2g, rwg), dy))


_GRADS = ("y", "dX", "dW gate_up", "dW down", "d row weight")


def test_tma_loads_change_no_bits(forced_triton, monkeypatch):
    """NOTE [TMA loads] (moe_compile/ops/triton/expert_gemm.py): the forward (weights through descriptors, gathered rows
    through pointers), the down GEMM (weights and rows through descriptors) and both dX GEMMs (``[E, K, N]`` weights)
    give the bits of pointer loads, forward and backward; and the production launch picks the descriptors here."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs sm90+")
    x, d, w1, w2, dy = _block_inputs(5)
    picked = [eg._tma_layout(dy, None, w2, False, eg._tma_enabled(dy, "plain")),
              eg._tma_layout(dy, None, w2.transpose(1, 2), False, eg._tma_enabled(dy, "plain")),
              eg._tma_layout(x, d.row_map, w1, True, eg._tma_enabled(x, "plain"))]
    assert picked == [dict(USE_TMA=True, W_KN=False, X_TMA=True), dict(USE_TMA=True, W_KN=True, X_TMA=True),
                      dict(USE_TMA=True, W_KN=False, X_TMA=False)], picked
    with_tma = _block_step(_block, x, d, w1, w2, dy)
    monkeypatch.setenv("MOE_COMPILE_TMA", "0")
    assert not eg._tma_enabled(dy, "plain")
    without = _block_step(_block, x, d, w1, w2, dy)
    for got, want, what in zip(with_tma, without, _GRADS):
        assert torch.equal(got, want), f"{what} changed with TMA loads"


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_block_matches_eager(forced_triton, mode):
    """The kernels traced into an Inductor graph (TMA descriptors' scratch from Inductor's allocator; CUDA graphs
    with ``reduce-overhead``): the output and the down weight's gradient are the eager block's bits; every
    gradient is within the layer bound of the fp64 reference. (The epilogue backward and the combine's gather-sum
    are compiled by Inductor with fp contraction on, which may move them by a rounding:
    NOTE [expert-order gather-sum] (moe_compile/ops/unpad_unpermute.py).)"""
    x, d, w1, w2, dy = _block_inputs(6)
    M = d.rows_MH.shape[0]
    want = _block_step(_block, x, d, w1, w2, dy)
    torch._dynamo.reset()
    compiled = torch.compile(_block, mode=mode, fullgraph=True)
    # Inductor's mutation analysis of every kernel must succeed: on failure ``triton_kernel_wrap`` warns (through
    # the ``torch._dynamo`` logger, which does not propagate to pytest's capture) and takes every argument as written
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    loggers = [logging.getLogger(n) for n in ("torch._dynamo", "torch._higher_order_ops.triton_kernel_wrap")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        for _ in range(3):  # warm-up and recording runs, then a replay
            got = [t.clone() for t in _block_step(compiled, x, d, w1, w2, dy)]
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
    failed = [r.getMessage()[:300] for r in records if "triton_kernel_wrap" in r.pathname]
    assert not failed, failed
    assert torch.equal(got[0], want[0]), f"y: compiled ({mode}) differs from eager"
    assert torch.equal(got[3], want[3]), f"dW down: compiled ({mode}) differs from eager"
    src = eg.source_rows(d.row_map, M)
    xd, w1d, w2d, rwd = (t.double().requires_grad_() for t in (x, w1, w2, d.probs_M.float()))
    h = eg.expert_gemm_reference(xd, w1d, d.offs_E, src, None, "swiglu")[0]
    y = eg.expert_gemm_reference(h, w2d, d.offs_E, None, rwd, "none")[0]
    ref = (y, *torch.autograd.grad(y, (xd, w1d, w2d, rwd), dy.double()))
    valid = src >= 0
    rows = int(d.counts_E.max())
    for g, r, what in zip(got, ref, _GRADS):
        if what in ("y", "d row weight"):
            g, r = g[valid], r[valid]
        tol.assert_layer_close(g, r, [H, I], torch.bfloat16, backward=what != "y", rows=rows, what=f"{mode} {what}")
