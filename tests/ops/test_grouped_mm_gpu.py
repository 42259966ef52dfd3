"""Grouped GEMM ops, Triton weight-only kernels and ``GroupedQuantWeight`` on CUDA (written for the H100).

References: bf16 ``torch._grouped_mm`` on dequantised weights, or the fp64 PyTorch reference. Outputs
are compared by norm-relative error over the rows below ``offs[-1]`` (accumulation order differs
between kernels); rows past ``offs[-1]`` must be exactly zero.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from moe_compile.ops import grouped_mm as gmm  # noqa: E402

DEV = "cuda"


def _offs(counts: list[int]) -> torch.Tensor:
    return torch.cumsum(torch.tensor(counts), 0).to(torch.int32).to(DEV)


def _uniform_counts(T: int, E: int, K: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(T, E, generator=gen).argsort(1)[:, :K]
    return torch.bincount(ids.flatten(), minlength=E).tolist()


# name -> (E, N, K, counts, extra tail rows)
SHAPES = {
    "decode_e128": (128, 256, 512, _uniform_counts(2, 128, 8, 0), 3),
    "small_e64": (64, 384, 256, _uniform_counts(16, 64, 8, 1), 0),
    "prefill_e8": (8, 512, 1024, _uniform_counts(512, 8, 2, 2), 5),
    "skewed_e8": (8, 256, 512, [0, 0, 1000, 0, 3, 0, 0, 21], 7),
}


def _rel(y: torch.Tensor, ref: torch.Tensor, rows: int) -> float:
    y, ref = y[:rows].double(), ref[:rows].double()
    return float((y - ref).norm() / ref.norm().clamp_min(1e-30))


def _inputs(shape: str, dtype=torch.bfloat16, seed=0):
    E, N, K, counts, tail = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    M = sum(counts) + tail
    x = torch.randn(M, K, generator=gen).to(dtype).to(DEV)
    w = (torch.randn(E, N, K, generator=gen) * K**-0.5).to(dtype).to(DEV)
    return x, w, _offs(counts), sum(counts)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_plain_bf16_matches_torch_grouped_mm(shape):
    x, w, offs, rows = _inputs(shape)
    y = gmm.grouped_mm(x, w, offs)
    ref = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    assert _rel(y, ref, rows) < 1e-2
    assert torch.all(y[rows:] == 0)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_zero_tail_false_leaves_only_the_tail_unspecified(shape):
    """``zero_tail=False`` skips only the zeroing: the rows below ``offs[-1]`` of ``y``, ``dX`` and all of ``dW``
    are bit for bit those of the default call; the default's tail rows are zero."""
    x, w, offs, rows = _inputs(shape)
    dy = torch.randn(x.shape[0], w.shape[1], device=DEV, dtype=x.dtype)
    outs = {}
    for zero_tail in (True, False):
        xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y = gmm.grouped_mm(xg, wg, offs, zero_tail=zero_tail)
        y.backward(dy)
        outs[zero_tail] = (y.detach(), xg.grad, wg.grad)
    (y0, dx0, dw0), (y1, dx1, dw1) = outs[True], outs[False]
    assert torch.equal(y0[:rows], y1[:rows]) and torch.equal(dx0[:rows], dx1[:rows]) and torch.equal(dw0, dw1)
    assert torch.all(y0[rows:] == 0) and torch.all(dx0[rows:] == 0)


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.float32, 1e-5)])
@pytest.mark.parametrize("shape", ["decode_e128", "skewed_e8"])
def test_plain_triton_fp16_fp32(shape, dtype, tol):
    x, w, offs, rows = _inputs(shape, dtype)
    y = gmm.grouped_mm(x, w, offs)
    ref = gmm.grouped_mm_reference(x.double(), w.double(), offs)
    assert y.dtype == dtype and _rel(y, ref, rows) < tol
    assert torch.all(y[rows:] == 0)


def _stored(w: torch.Tensor, recipe: str):
    """``(qdata, scale, expert_scale or None, dequantised bf16 weight)``."""
    from moe_compile.experts.grouped_weight import quantize_stored

    qdata, scale, expert_scale = quantize_stored(w, recipe)
    if recipe == "mxfp8":
        return qdata, scale, None, gmm.dequantize_mxfp8(qdata, scale, torch.bfloat16)
    return qdata, scale, expert_scale, gmm.dequantize_nvfp4(qdata, scale, expert_scale, torch.bfloat16)


def _quantized(w: torch.Tensor, recipe: str):
    qdata, scale, expert_scale, deq = _stored(w, recipe)
    if recipe == "mxfp8":
        return (lambda x, offs: gmm.grouped_mm_mxfp8(x, qdata, scale, offs)), deq
    return (lambda x, offs: gmm.grouped_mm_nvfp4(x, qdata, scale, expert_scale, offs)), deq


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_weight_only_kernel_matches_dequant_then_grouped_mm(recipe, shape):
    x, w, offs, rows = _inputs(shape)
    op, deq = _quantized(w, recipe)
    y = op(x, offs)
    ref = torch._grouped_mm(x, deq.transpose(-2, -1), offs=offs)
    assert _rel(y, ref, rows) < 1e-2
    assert torch.all(y[rows:] == 0)
    assert torch.equal(y, op(x, offs))  # deterministic


@pytest.mark.parametrize(
    "recipe,K", [("nvfp4", 48), ("nvfp4", 336), ("nvfp4", 2064), ("mxfp8", 96), ("mxfp8", 352), ("mxfp8", 2080)]
)
@pytest.mark.parametrize("kernel", ["decode", "decode_split3", "tiled"])
def test_weight_only_kernel_ragged_k(recipe, K, kernel):
    """K not a multiple of the K tile (nor of 32 / 64 for some): the last step's masked weight, scale
    and activation loads (NOTE [scale prefetch] (moe_compile/ops/triton/grouped_mm.py), ``K_ALIGN``), with and without
    split-K."""
    gen = torch.Generator().manual_seed(K)
    E, N, counts = 16, 192, _uniform_counts(8, 16, 4, K)
    M = sum(counts) + 2
    x = torch.randn(M, K, generator=gen).bfloat16().to(DEV)
    w = (torch.randn(E, N, K, generator=gen) * K**-0.5).bfloat16().to(DEV)
    offs = _offs(counts)
    qdata, scale, gscale, deq = _stored(w, recipe)
    if kernel == "tiled":
        cfg = gmm._pick_config(M, E, N, K, recipe, 132, False)
    else:
        cfg = dict(
            gmm._pick_decode_config(M, E, N, K, recipe, 132, False), SPLIT_K=3 if kernel == "decode_split3" else 1
        )
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=DEV)
    y = gmm.launch_grouped_mm(x, qdata, scale, gscale, offs, out, recipe, config=cfg)
    ref = torch._grouped_mm(x, deq.transpose(-2, -1), offs=offs)
    assert _rel(y, ref, sum(counts)) < 1e-2
    assert torch.all(y[sum(counts) :] == 0)


@pytest.mark.parametrize(
    "shape,kernel",
    [("decode_e128", "decode"), ("small_e64", "decode"), ("skewed_e8", "tiled"), ("prefill_e8", "tiled")],
)
def test_nvfp4_ptx_decode_bitwise_equals_triton_decode(shape, kernel):
    """NOTE [NVFP4 decode] (moe_compile/ops/triton/grouped_mm.py): the inline-PTX bit moves + bf16x2 scale multiply give
    the same tile as the fp32 Triton ops, over every e2m1 code and e4m3 scales from denormal to 448 (incl. zero)."""
    E, N, K, counts, tail = SHAPES[shape]
    gen = torch.Generator().manual_seed(5)
    M = sum(counts) + tail
    x = torch.randn(M, K, generator=gen).bfloat16().to(DEV)
    qdata = torch.randint(0, 256, (E, N, K // 2), generator=gen, dtype=torch.int32).to(torch.uint8).to(DEV)
    scale_bits = torch.randint(0, 0x7F, (E, N, K // 16), generator=gen, dtype=torch.int32)  # no NaN code
    scale = scale_bits.to(torch.uint8).view(torch.float8_e4m3fn).to(DEV)
    expert_scale = (torch.rand(E, generator=gen) + 0.5).to(DEV)
    offs = _offs(counts)
    if kernel == "decode":
        cfg = gmm._pick_decode_config(M, E, N, K, "nvfp4", 132, False)
        assert cfg is not None
    else:
        cfg = gmm._pick_config(M, E, N, K, "nvfp4", 132, False)
    ys = []
    for ptx in (True, False):
        out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=DEV)
        ys.append(
            gmm.launch_grouped_mm(x, qdata, scale, expert_scale, offs, out, "nvfp4", config=dict(cfg, PTX_DECODE=ptx))
        )
    assert torch.equal(ys[0], ys[1])
    ref = gmm.grouped_mm_reference(x.double(), gmm.dequantize_nvfp4(qdata, scale, expert_scale, torch.float64), offs)
    assert _rel(ys[0], ref, sum(counts)) < 1e-2


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_weight_only_kernel_fp16_activations(recipe):
    x, w, offs, rows = _inputs("small_e64")
    op, deq = _quantized(w, recipe)
    y = op(x.half(), offs)
    ref = gmm.grouped_mm_reference(x.half().double(), deq.double(), offs)
    assert y.dtype == torch.float16 and _rel(y, ref, rows) < 2e-3


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3), (torch.float32, 1e-5)])
def test_wgrad(dtype, tol):
    E, N, K, counts, tail = SHAPES["skewed_e8"]
    gen = torch.Generator().manual_seed(3)
    M = sum(counts) + tail
    dy = torch.randn(M, N, generator=gen).to(dtype).to(DEV)
    x = torch.randn(M, K, generator=gen).to(dtype).to(DEV)
    offs = _offs(counts)
    dw = torch.ops.moe.grouped_mm_wgrad(dy, x, offs)
    ref = gmm.grouped_mm_wgrad_reference(dy.double(), x.double(), offs)
    nonempty = torch.tensor(counts, device=DEV) > 0
    assert _rel(dw[nonempty].flatten(0, 1), ref[nonempty].flatten(0, 1), int(nonempty.sum()) * N) < tol
    assert torch.all(dw[~nonempty] == 0)


def test_autograd_fp32():
    x, w, offs, rows = _inputs("skewed_e8", torch.float32)
    x.requires_grad_()
    w.requires_grad_()
    dy = torch.randn(x.shape[0], w.shape[1], device=DEV)
    gx, gw = torch.autograd.grad(gmm.grouped_mm(x, w, offs), (x, w), dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    gx64, gw64 = torch.autograd.grad(gmm.grouped_mm_reference(x64, w64, offs), (x64, w64), dy.double())
    assert _rel(gx, gx64, rows) < 1e-5 and _rel(gw.flatten(0, 1), gw64.flatten(0, 1), gw.shape[0] * gw.shape[1]) < 1e-5


def test_cuda_graph_capture_is_sync_free():
    """Every op captures in a CUDA graph (a host read of offs would abort the capture) and replays
    correctly with new routing written into the captured offs buffer."""
    E, N, K = 16, 256, 256
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(200, K, generator=gen).to(torch.bfloat16).to(DEV)
    w = (torch.randn(E, N, K, generator=gen) * K**-0.5).to(torch.bfloat16).to(DEV)
    offs = _offs(_uniform_counts(25, E, 8, 5))
    mx_op, _ = _quantized(w, "mxfp8")
    nv_op, _ = _quantized(w, "nvfp4")

    def step():
        return (
            mx_op(x, offs),
            nv_op(x, offs),
            gmm.grouped_mm(x, w, offs),
            gmm.grouped_mm(x.half(), w.half(), offs),
            torch.ops.moe.grouped_mm_wgrad(x[:, :N].contiguous(), x, offs),
            torch.ops.moe.grouped_mm_wgrad(x[:, :N].half().contiguous(), x.half(), offs),
        )

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    offs.copy_(_offs(_uniform_counts(25, E, 8, 6)))
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, step()):
        assert torch.equal(got, want)


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_grouped_quant_weight_on_cuda(recipe):
    from moe_compile.experts.grouped_weight import GroupedQuantWeight

    x, w, offs, rows = _inputs("small_e64")
    q = GroupedQuantWeight.from_hp(w, recipe)
    deq = q.dequantize()
    y = torch._grouped_mm(x, q.transpose(-2, -1), offs=offs)
    assert _rel(y, torch._grouped_mm(x, deq.transpose(-2, -1), offs=offs), rows) < 1e-2
    y1 = F.linear(x[:7], q[3])  # one expert: the same kernel with a single group
    assert _rel(y1, F.linear(x[:7], deq[3]), 7) < 1e-2


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_quantize_experts_hf_block_cuda(recipe):
    import copy

    from moe_compile.experts.quantize import quantize_experts
    from tests.models.hf_models import block_output, build_sparse_moe_block

    original = build_sparse_moe_block("qwen3_moe", dtype=torch.bfloat16, device=DEV)
    block = quantize_experts(copy.deepcopy(original), recipe)
    ref = copy.deepcopy(original)
    with torch.no_grad():
        ref.experts.gate_up_proj.copy_(block.experts.gate_up_proj.dequantize())
        ref.experts.down_proj.copy_(block.experts.down_proj.dequantize())
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16, device=DEV)
    y, y_ref = block_output(block(x)), block_output(ref(x))
    assert _rel(y.flatten(0, 1), y_ref.flatten(0, 1), 16) < 2e-2


class _Experts(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = torch.nn.Parameter(w)

    def forward(self, x, offs):
        return torch._grouped_mm(x, self.w.transpose(-2, -1), offs=offs)


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_compile_training_step_cuda(recipe):
    from moe_compile.experts.grouped_weight import GroupedQuantWeight

    torch._dynamo.reset()
    x, w, offs, rows = _inputs("small_e64")
    model = _Experts(GroupedQuantWeight.from_hp(w, recipe, keep_master=True))
    x.requires_grad_()
    eager = model(x, offs)
    eager[:rows].float().pow(2).sum().backward()
    grads = (x.grad.clone(), model.w.grad.clone())
    x.grad = model.w.grad = None
    out = torch.compile(model, fullgraph=True)(x, offs)
    out[:rows].float().pow(2).sum().backward()
    assert _rel(out, eager, rows) < 1e-2
    assert _rel(x.grad, grads[0], rows) < 1e-2
    assert _rel(model.w.grad.flatten(0, 1), grads[1].flatten(0, 1), grads[1].shape[0] * grads[1].shape[1]) < 1e-2


def test_compile_reduce_overhead_no_cudagraph_skips():
    """Inference with quantised weights under cudagraph trees: no skipped graph (capture-safe)."""
    from torch._dynamo.utils import counters

    from moe_compile.experts.grouped_weight import GroupedQuantWeight

    torch._dynamo.reset()
    counters.clear()
    x, w, offs, rows = _inputs("small_e64")
    model = _Experts(GroupedQuantWeight.from_hp(w, "mxfp8"))
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        eager = model(x, offs)
        for _ in range(3):
            out = compiled(x, offs)
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert _rel(out, eager, rows) < 1e-2
