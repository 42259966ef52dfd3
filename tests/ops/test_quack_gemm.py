"""The QuACK expert MLP (``moe_compile/ops/quack_gemm.py``): its layouts and autograd on the PyTorch references (CPU,
always), and each QuACK GEMM against the fp32 reference (derived bounds) and bitwise against ``torch._grouped_mm``
(GPU tests: CUDA sm90+ with ``quack`` installed, else skipped).
"""

from __future__ import annotations

import pytest
import torch

from moe_compile.experts.interface import Projection, fused_experts_forward
from moe_compile.ops import grouped_mm as gmm
from moe_compile.ops import quack_gemm as qg
from moe_compile.ops.expert_gemm import gather_rows, source_rows
from moe_compile.ops.permute_pad import permute_pad
from tests._tolerance import (
    assert_layer_close,
    assert_within,
    grouped_abs_matmul,
    grouped_wgrad_abs,
    matmul_bound,
)


def _routing(T: int, E: int, K: int, seed: int, device="cpu", skew: bool = False):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(T, E, generator=gen)
    if skew:  # experts 1 and 3 empty, expert 0 takes most
        scores[:, [1, 3]] = -1
        scores[:, 0] += 0.5
    weights, ids = scores.topk(K, dim=1)
    return ids.to(device), weights.softmax(1).to(device)


def _mlp_inputs(T, H, I, E, K, seed=0, dtype=torch.float32, device="cpu", skew=False):  # noqa: E741
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(dtype).to(device)
    w_gu = (torch.randn(E, 2 * I, H, generator=gen) * H**-0.5).to(dtype).to(device)
    w_dn = (torch.randn(E, H, I, generator=gen) * I**-0.5).to(dtype).to(device)
    ids, weights = _routing(T, E, K, seed, device, skew)
    return x, w_gu, w_dn, ids, weights


def _swiglu(gu: torch.Tensor) -> torch.Tensor:
    g, u = gu.chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u


# ===== CPU: layouts and autograd through the references =====


def test_interleave_round_trip():
    t = torch.arange(24.0).reshape(2, 12)
    il = qg.interleave(t)
    assert torch.equal(il[:, 0::2], t[:, :6]) and torch.equal(il[:, 1::2], t[:, 6:])
    assert torch.equal(qg.deinterleave(il), t)


def test_dswiglu_matches_autograd():
    gen = torch.Generator().manual_seed(0)
    pre = torch.randn(5, 8, generator=gen, dtype=torch.float64)
    dh = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    cat = qg.deinterleave(pre).requires_grad_(True)
    h = _swiglu(cat)
    (dcat,) = torch.autograd.grad(h, cat, dh)
    dz, h2 = qg.dswiglu(dh, pre, torch.float64)
    torch.testing.assert_close(qg.deinterleave(dz), dcat, rtol=1e-6, atol=1e-6)  # fp32 math inside dswiglu
    torch.testing.assert_close(h2, h.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("skew", [False, True])
def test_reference_mlp_matches_grouped_path(skew):
    """``glu_expert_mlp`` on the references (CPU: every GEMM ``impl="reference"``) against the grouped-GEMM path of
    ``fused_experts_forward``, forward and every gradient, fp32, within the layer bound."""
    T, H, I, E, K = 24, 16, 8, 6, 2  # noqa: E741
    x, w_gu, w_dn, ids, weights = _mlp_inputs(T, H, I, E, K, skew=skew)
    outs = []
    for path in ("quack", "grouped"):
        xs, gus, dns = (t.clone().requires_grad_(True) for t in (x, w_gu, w_dn))
        if path == "quack":
            index = permute_pad(xs.detach(), ids, None, num_experts=E)
            y_MH = qg.glu_expert_mlp(xs, index.row_map, index.offs_E, gus, dns, index.rows_MH.shape[0])
            from moe_compile.ops.unpad_unpermute import unpad_unpermute

            y = unpad_unpermute(y_MH, index.row_map, weights)
        else:
            y = fused_experts_forward(xs, ids, weights, Projection(gus), _swiglu, Projection(dns),
                                      num_experts=E)
        gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype)
        y.backward(gy)
        outs.append((y.detach(), xs.grad, gus.grad, dns.grad))
    for got, want, what in zip(outs[0], outs[1], ("y", "dx", "dw_gate_up", "dw_down")):
        assert_layer_close(got, want, [H, I], torch.float32, backward=what != "y", rows=T * K, what=what)


def _cpu_op_args(store_preact=True):
    T, H, I, E, K = 12, 16, 8, 4, 2  # noqa: E741
    x, w_gu, w_dn, ids, _ = _mlp_inputs(T, H, I, E, K)
    index = permute_pad(x, ids, None, num_experts=E)
    src = source_rows(index.row_map, index.rows_MH.shape[0])
    return x, src, index, w_gu, w_dn


def test_opcheck():
    """Fake impls, schemas and autograd registration of both ops (CPU: the reference GEMMs)."""
    x, src, index, w_gu, w_dn = _cpu_op_args()
    x.requires_grad_(True)
    w_gu.requires_grad_(True)
    torch.library.opcheck(torch.ops.moe.quack_glu_up.default, (x, src, index.row_map, index.offs_E, w_gu, True))
    h, pre = torch.ops.moe.quack_glu_up(x.detach(), src, index.row_map, index.offs_E, w_gu.detach(), True)
    torch.library.opcheck(torch.ops.moe.quack_glu_down.default,
                          (h, pre.requires_grad_(True), index.offs_E, w_dn.requires_grad_(True)))


def test_compiled_fullgraph_matches_eager():
    """``glu_expert_mlp`` traced whole (``fullgraph=True``): same forward and gradients as eager."""
    x, src, index, w_gu, w_dn = _cpu_op_args()

    def mlp(x, w_gu, w_dn):
        return qg.glu_expert_mlp(x, index.row_map, index.offs_E, w_gu, w_dn, index.rows_MH.shape[0])

    results = []
    for fn in (mlp, torch.compile(mlp, fullgraph=True)):
        args = [t.clone().requires_grad_(True) for t in (x, w_gu, w_dn)]
        y = fn(*args)
        y.backward(torch.ones_like(y))
        results.append([y.detach(), *(a.grad for a in args)])
    for got, want in zip(*results):
        assert torch.equal(got, want)


def test_choice_table(monkeypatch):
    """NOTE [QuACK GEMM choice] (moe_compile/ops/_expert_gemm_tuning.py). The whole MLP is opt-in (``gated`` has no
    range), the environment forces either way, unknown kinds raise, and nothing is usable off CUDA."""
    from moe_compile.ops._expert_gemm_tuning import use_quack

    monkeypatch.delenv("MOE_COMPILE_GROUPED_GEMM", raising=False)
    assert not use_quack("gated", 32768, 1536, 2048, 128)
    assert use_quack("down", 32768, 2048, 768, 128)
    monkeypatch.setenv("MOE_COMPILE_GROUPED_GEMM", "quack")
    assert use_quack("gated", 32768, 1536, 2048, 128)
    monkeypatch.setenv("MOE_COMPILE_GROUPED_GEMM", "cutlass")
    assert not use_quack("down", 32768, 2048, 768, 128)
    with pytest.raises(ValueError, match="up_dx"):
        use_quack("up_dx", 1, 1, 1, 1)
    assert not qg.quack_usable(32768, 2048, 768, 128, torch.bfloat16, torch.device("cpu"))


def test_cpu_fused_forward_never_takes_quack(monkeypatch):
    """Off CUDA ``fused_experts_forward`` keeps its path and never imports ``quack``."""
    import sys

    T, H, I, E, K = 8, 16, 8, 4, 2  # noqa: E741
    x, w_gu, w_dn, ids, weights = _mlp_inputs(T, H, I, E, K)
    monkeypatch.setenv("MOE_COMPILE_GROUPED_GEMM", "quack")
    y = fused_experts_forward(x, ids, weights, Projection(w_gu), _swiglu, Projection(w_dn), num_experts=E,
                              glu="swiglu")
    assert y.shape == (T, H)
    assert "quack.gemm_interface" not in sys.modules


# ===== GPU: QuACK against the references and torch._grouped_mm =====


def _quack_ready() -> bool:
    return (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] in (9, 10)
            and qg.quack_importable())


requires_quack = pytest.mark.skipif(not _quack_ready(), reason="needs CUDA sm90/sm100 and quack-kernels")
DEV = "cuda"
# name -> (T, H, I, E, K, skewed routing)
SHAPES = {"e8_top2": (256, 256, 128, 8, 2, False), "e16_top4_skewed": (192, 512, 256, 16, 4, True)}


def _rows(shape: str, seed: int = 0):
    T, H, I, E, K, skew = SHAPES[shape]  # noqa: E741
    x, w_gu, w_dn, ids, weights = _mlp_inputs(T, H, I, E, K, seed, torch.bfloat16, DEV, skew)
    index = permute_pad(x, ids, None, num_experts=E)
    src = source_rows(index.row_map, index.rows_MH.shape[0])
    return x, w_gu, w_dn, index, src, weights


@pytest.mark.gpu
@requires_quack
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_gated_within_bound_and_pre_bitwise(shape):
    x, w_gu, _, index, src, _ = _rows(shape)
    pre, h = qg.gated(x, src, index.offs_E, w_gu, True, "quack")
    a = gather_rows(x, src)
    want_pre32 = gmm.grouped_mm_reference(a.double(), w_gu.double(), index.offs_E)
    mag = grouped_abs_matmul(a, w_gu, index.offs_E)
    bound = matmul_bound(mag, x.shape[1], want_pre32, got_dtype=torch.bfloat16)
    assert_within(qg.deinterleave(pre).double(), want_pre32, bound, "pre")
    cutlass = torch._grouped_mm(a, w_gu.mT, offs=index.offs_E)
    assert torch.equal(qg.deinterleave(pre), cutlass), "pre must equal torch._grouped_mm bitwise"
    # h from the fp32 accumulator: silu(g) * u within (accumulation of g and u) * |d h| + one bf16 rounding
    n = want_pre32.shape[1] // 2
    g, u = want_pre32[:, :n], want_pre32[:, n:]
    want_h = torch.nn.functional.silu(g) * u
    sg = torch.sigmoid(g)
    dg, du = (sg * (1 + g * (1 - sg)) * u).abs(), (g * sg).abs()
    inner = bound[:, :n] * dg + bound[:, n:] * du + bound[:, :n] * bound[:, n:] * 2
    assert_within(h.double(), want_h, inner + want_h.abs() * 2**-8 + 1e-30, "h")


def _gpu_case(shape):
    x, w_gu, w_dn, index, src, _ = _rows(shape)
    gen = torch.Generator().manual_seed(3)
    M, H = index.rows_MH.shape
    dy = torch.randn(M, H, generator=gen).to(torch.bfloat16).to(DEV)
    pre, h = qg.gated(x, src, index.offs_E, w_gu, True, "quack")
    return x, w_gu, w_dn, index, src, dy, pre, h


@pytest.mark.gpu
@requires_quack
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_down_and_down_wgrad_bitwise_vs_grouped_mm(shape):
    x, w_gu, w_dn, index, src, dy, pre, h = _gpu_case(shape)
    rows = int(index.offs_E[-1])
    y = qg.down(h, index.offs_E, w_dn, "quack")
    assert torch.equal(y[:rows], qg.down(h, index.offs_E, w_dn, "cutlass")[:rows])
    want = gmm.grouped_mm_reference(h.double(), w_dn.double(), index.offs_E)
    bound = matmul_bound(grouped_abs_matmul(h, w_dn, index.offs_E), h.shape[1], want, got_dtype=torch.bfloat16)
    assert_within(y[:rows].double(), want[:rows], bound[:rows], "down")
    dw = qg.down_wgrad(dy, h, index.offs_E, "quack")
    assert torch.equal(dw, qg.down_wgrad(dy, h, index.offs_E, "cutlass"))
    want_w = gmm.grouped_mm_wgrad_reference(dy.double(), h.double(), index.offs_E)
    bound_w = matmul_bound(grouped_wgrad_abs(dy, h, index.offs_E), rows, want_w, got_dtype=torch.bfloat16)
    assert_within(dw.double(), want_w, bound_w, "down_wgrad")


@pytest.mark.gpu
@requires_quack
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_down_dx_dgated_within_bound(shape):
    x, w_gu, w_dn, index, src, dy, pre, h = _gpu_case(shape)
    rows = int(index.offs_E[-1])
    dz, h2 = qg.down_dx(dy, index.offs_E, w_dn, pre, "quack")
    want_dz, want_h = qg.down_dx(dy.double(), index.offs_E, w_dn.double(), pre.double(), "reference")
    # dh = dy @ W within its accumulation bound; dz = dh * (bounded factors of pre) + one bf16 rounding
    dh_bound = matmul_bound(grouped_abs_matmul(dy, w_dn.mT, index.offs_E), dy.shape[1], None)
    g, u = pre[:, 0::2].double(), pre[:, 1::2].double()
    sg = torch.sigmoid(g)
    fac = qg.interleave(torch.cat([(u * sg * (1 + g * (1 - sg))).abs(), (g * sg).abs()], 1))
    bound = qg.interleave(torch.cat([dh_bound, dh_bound], 1)) * fac + want_dz.abs() * 2**-8 * 1.01 + 1e-6 * fac
    assert_within(dz[:rows].double(), want_dz[:rows], bound[:rows], "down_dx")
    assert_within(h2[:rows].double(), want_h[:rows], want_h[:rows].abs() * 2**-8 * 1.01 + 1e-30, "h recomputed")
    assert torch.equal(dz, qg.down_dx(dy, index.offs_E, w_dn, pre, "quack")[0]), "run twice: bitwise"


@pytest.mark.gpu
@requires_quack
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_up_dx_and_up_wgrad_bitwise_vs_grouped_mm(shape):
    x, w_gu, w_dn, index, src, dy, pre, h = _gpu_case(shape)
    rows = int(index.offs_E[-1])
    dz = pre  # any interleaved [M, 2I] bf16 operand
    dx = qg.up_dx(dz, index.offs_E, w_gu, "quack")
    cat = qg.deinterleave(dz)
    assert torch.equal(dx[:rows], torch._grouped_mm(cat, w_gu, offs=index.offs_E)[:rows])
    want = gmm.grouped_mm_reference(cat.double(), w_gu.mT.double(), index.offs_E)
    bound = matmul_bound(grouped_abs_matmul(cat, w_gu.mT, index.offs_E), cat.shape[1], want,
                         got_dtype=torch.bfloat16)
    assert_within(dx[:rows].double(), want[:rows], bound[:rows], "up_dx")
    dw = qg.up_wgrad(dz, x, src, index.offs_E, "quack")
    a = gather_rows(x, src)
    assert torch.equal(dw, gmm.zero_empty_groups(torch._grouped_mm(cat.t(), a, offs=index.offs_E).contiguous(),
                                                 index.offs_E))
    want_w = gmm.grouped_mm_wgrad_reference(cat.double(), a.double(), index.offs_E)
    bound_w = matmul_bound(grouped_wgrad_abs(cat, a, index.offs_E), rows, want_w, got_dtype=torch.bfloat16)
    assert_within(dw.double(), want_w, bound_w, "up_wgrad")


def _block_step(x, w_gu, w_dn, ids, weights, E, fn=fused_experts_forward):
    xs, gus, dns = (t.detach().clone().requires_grad_(True) for t in (x, w_gu, w_dn))
    y = fn(xs, ids, weights, Projection(gus), _swiglu, Projection(dns), num_experts=E, glu="swiglu")
    gy = torch.randn(y.shape, generator=torch.Generator(device=DEV).manual_seed(5), device=DEV).to(y.dtype)
    y.backward(gy)
    return [y.detach(), xs.grad, gus.grad, dns.grad]


@pytest.mark.gpu
@requires_quack
@pytest.mark.parametrize("compiled", [False, True])
def test_mlp_deterministic_and_close_to_grouped_path(monkeypatch, compiled):
    """The whole MLP (forward and gradients) run twice is bitwise equal, eager and compiled, and within the
    layer bound of the ``torch._grouped_mm`` path."""
    T, H, I, E, K, _ = SHAPES["e16_top4_skewed"]  # noqa: E741
    x, w_gu, w_dn, ids, weights = _mlp_inputs(T, H, I, E, K, 0, torch.bfloat16, DEV, True)
    fn = torch.compile(fused_experts_forward, fullgraph=True) if compiled else fused_experts_forward
    monkeypatch.setenv("MOE_COMPILE_GROUPED_GEMM", "quack")
    torch._dynamo.reset()
    first = _block_step(x, w_gu, w_dn, ids, weights, E, fn)
    second = _block_step(x, w_gu, w_dn, ids, weights, E, fn)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    monkeypatch.setenv("MOE_COMPILE_GROUPED_GEMM", "cutlass")
    torch._dynamo.reset()
    base = _block_step(x, w_gu, w_dn, ids, weights, E, fn)
    for got, want, what in zip(first, base, ("y", "dx", "dw_gate_up", "dw_down")):
        assert_layer_close(got, want, [H, I], torch.bfloat16, backward=what != "y", rows=T * K, what=what)


@pytest.mark.gpu
@requires_quack
def test_mlp_under_cuda_graph_capture(monkeypatch):
    """The forward and backward replay from a CUDA graph bitwise as run eagerly."""
    monkeypatch.setenv("MOE_COMPILE_GROUPED_GEMM", "quack")
    T, H, I, E, K, _ = SHAPES["e8_top2"]  # noqa: E741
    x, w_gu, w_dn, ids, weights = _mlp_inputs(T, H, I, E, K, 0, torch.bfloat16, DEV)
    eager = _block_step(x, w_gu, w_dn, ids, weights, E)
    xs, gus, dns = (t.detach().clone().requires_grad_(True) for t in (x, w_gu, w_dn))
    gy = torch.randn(T, H, generator=torch.Generator(device=DEV).manual_seed(5), device=DEV).to(torch.bfloat16)

    def step():
        for t in (xs, gus, dns):
            t.grad = None
        y = fused_experts_forward(xs, ids, weights, Projection(gus), _swiglu, Projection(dns), num_experts=E,
                                  glu="swiglu")
        y.backward(gy)
        return y

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up: the DSL compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    for t in (xs, gus, dns):
        t.grad = None
    with torch.cuda.graph(graph):
        y = step()
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip([y, xs.grad, gus.grad, dns.grad], eager):
        assert torch.equal(got, want)


