"""GPU tests of the Triton path of ``moe::permute_pad`` / ``moe::unpad_unpermute`` (skipped without CUDA)."""

from __future__ import annotations

import sys

import pytest
import torch

from moe_compile.ops import (
    permute_pad,
    permute_pad_backward_reference,
    permute_pad_reference,
    static_row_bound,
    unpad_unpermute,
    unpad_unpermute_backward_reference,
    unpad_unpermute_reference,
)
from tests._subprocess import run_python

from ._dispatch_reference import DOT_TOLS, DTYPE_TOLS, check_invariants, make_routing
from ._poison_cases import BAD_IDS, BAD_MAPS, check_bad_expert_ids, check_bad_row_map

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = "cuda"

# (T, H, E, K, align, dtype); H=70: not a multiple of the vector width or the block
SHAPES = [
    (1, 8, 1, 1, 1, torch.float32),
    (37, 70, 7, 5, 16, torch.bfloat16),
    (513, 1280, 16, 2, 32, torch.float16),
    (4096, 1280, 256, 8, 32, torch.bfloat16),
    (4096, 1280, 64, 8, 128, torch.float32),
    (3000, 2048, 8, 2, 1, torch.bfloat16),
    (2, 512, 256, 8, 128, torch.bfloat16),  # T*K < E
    (8192, 256, 8, 2, 32, torch.bfloat16),  # parallel histograms, few experts: blocks of 512 ids
]


def _inputs(T, H, E, K, dtype, routing="uniform", seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(dtype)
    ids = make_routing(T, K, E, routing, gen)
    probs = torch.rand(T, K, generator=gen).to(dtype)
    return x.to(DEV), ids.to(DEV), probs.to(DEV)


def _ref_tuple(x, ids, probs, E, a):
    out = permute_pad_reference(x, ids, probs, E, a)
    return out.rows_MH, out.probs_M, out.offs_E, out.row_map, out.counts_E


@pytest.mark.parametrize("T,H,E,K,a,dtype", SHAPES, ids=str)
def test_forward_matches_reference_bitwise(T, H, E, K, a, dtype):
    x, ids, probs = _inputs(T, H, E, K, dtype, seed=T + E)
    out = permute_pad(x, ids, probs, num_experts=E, align=a)
    for got, want in zip(out, _ref_tuple(x, ids, probs, E, a)):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
    check_invariants(out, ids.cpu(), E, a)
    out_np = permute_pad(x, ids.to(torch.int32), None, num_experts=E, align=a)
    assert out_np.probs_M is None and torch.equal(out_np.rows_MH, out.rows_MH)
    z = torch.randn_like(out.rows_MH)
    for p in (probs, None):
        # launched with fp fusion off: the fixed-order fp32 combine equals the reference bitwise
        y = unpad_unpermute(z, out.row_map, p)
        assert torch.equal(y, unpad_unpermute_reference(z, out.row_map, p))


@pytest.mark.parametrize("T,H,E,K,a,dtype", SHAPES, ids=str)
def test_backward_matches_reference(T, H, E, K, a, dtype):
    x, ids, probs = _inputs(T, H, E, K, dtype, seed=T + E + 1)
    out = permute_pad(x, ids, probs, num_experts=E, align=a)
    M = out.rows_MH.shape[0]
    g_rows, g_probs = torch.randn_like(out.rows_MH), torch.randn_like(out.probs_M)
    gx, gp = torch.ops.moe.permute_pad_backward(g_rows, g_probs, out.row_map)
    gx_ref, gp_ref = permute_pad_backward_reference(g_rows, g_probs, out.row_map)
    assert torch.equal(gx, gx_ref) and torch.equal(gp, gp_ref)

    z, g_y = torch.randn_like(out.rows_MH), torch.randn_like(x)
    for p, rows in ((probs, z), (probs, None), (None, None)):
        dz, dp = torch.ops.moe.unpad_unpermute_backward(g_y, out.row_map, p, rows, M)
        dz_ref, dp_ref = unpad_unpermute_backward_reference(g_y, out.row_map, p, rows, M)
        assert torch.equal(dz, dz_ref)  # unreferenced rows zero, one multiply and cast per element
        if dp_ref is None:
            assert dp.numel() == 0
        else:
            torch.testing.assert_close(dp, dp_ref, **DOT_TOLS[dtype])


@pytest.mark.parametrize(
    "T,H,E,K,block_n,block_h,num_warps,use_pdl",
    [
        (999, 200, 7, 5, 64, 64, 2, None),  # tokens straddle blocks (64 % 5 != 0), 4 H tiles
        (700, 96, 40, 33, 64, None, None, None),  # K_PAD = 64: the rank loop runs over several chunks
        (2048, 1024, 256, 8, 2048, 256, 8, None),
        (4096, 512, 64, 8, None, None, None, False),  # without programmatic dependent launch
    ],
    ids=str,
)
def test_launcher_block_overrides_bitwise(T, H, E, K, block_n, block_h, num_warps, use_pdl):
    from moe_compile.ops.permute_pad import _launch_triton

    x, ids, probs = _inputs(T, H, E, K, torch.bfloat16, seed=T + K)
    got = _launch_triton(
        x, ids, probs, E, 32, block_n=block_n, block_h=block_h, num_warps=num_warps, use_pdl=use_pdl
    )
    for g, want in zip(got, _ref_tuple(x, ids, probs, E, 32)):
        assert torch.equal(g, want)


def test_programmatic_dependent_launch_on_hopper():
    from moe_compile.ops._common import pdl_supported

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90+")
    assert pdl_supported(torch.device(DEV)), "Triton lacks launch_pdl / gdc_wait: the permute runs without PDL"


def test_cuda_graph_replay_new_routing_bitwise():
    # NOTE [overlapping the launches] (moe_compile/ops/triton/dispatch.py): captured with PDL edges; each replay must
    # see the new ids
    T, H, E, K, a = 4096, 1024, 64, 8, 32
    x, ids, probs = _inputs(T, H, E, K, torch.bfloat16, seed=21)
    static_x, static_ids, static_probs = x.clone(), ids.clone(), probs.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        permute_pad(static_x, static_ids, static_probs, num_experts=E, align=a)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = permute_pad(static_x, static_ids, static_probs, num_experts=E, align=a)
        y = unpad_unpermute(out.rows_MH, out.row_map, static_probs)
    for seed in range(3):
        x, ids, probs = _inputs(T, H, E, K, torch.bfloat16, seed=30 + seed)
        static_x.copy_(x), static_ids.copy_(ids), static_probs.copy_(probs)
        graph.replay()
        for got, want in zip(out, _ref_tuple(x, ids, probs, E, a)):
            assert torch.equal(got, want)
        assert torch.equal(y, unpad_unpermute_reference(out.rows_MH, out.row_map, probs))


def test_eager_fast_path_skips_dispatcher_only_when_unobservable(monkeypatch):
    import moe_compile.ops.permute_pad  # noqa: F401  (the module, not the function)

    pp = sys.modules["moe_compile.ops.permute_pad"]
    uu = sys.modules["moe_compile.ops.unpad_unpermute"]
    x, ids, probs = _inputs(64, 32, 8, 2, torch.float32, seed=4)
    via_op = torch.ops.moe.permute_pad(x, ids, probs, 8, 16)
    calls = []
    monkeypatch.setattr(pp, "_PERMUTE_PAD", lambda *a: calls.append("op") or torch.ops.moe.permute_pad(*a))
    monkeypatch.setattr(uu, "_UNPAD_UNPERMUTE", lambda *a: calls.append("op") or torch.ops.moe.unpad_unpermute(*a))
    out = permute_pad(x, ids, probs, num_experts=8, align=16)  # plain CUDA tensors: direct
    y = unpad_unpermute(out.rows_MH, out.row_map, probs)
    assert calls == []
    for got, want in zip(out, via_op):
        assert torch.equal(got, want)
    assert torch.equal(y, torch.ops.moe.unpad_unpermute(out.rows_MH, out.row_map, probs))
    with torch.autograd.profiler.profile():
        unpad_unpermute(out.rows_MH, out.row_map, probs)  # profiled: through the op (named in traces)
    assert calls == ["op"]
    # with gradients: the op's autograd formula around the same kernels, still past the dispatcher; outputs and
    # gradients bitwise equal to the op's
    g = torch.randn(x.shape, device=DEV)
    grads = []
    for direct in (True, False):
        calls.clear()
        xx, pp_ = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
        if direct:
            out = permute_pad(xx, ids, pp_, num_experts=8, align=16)
            y = unpad_unpermute(out.rows_MH.sin(), out.row_map, pp_)
            assert calls == []
        else:
            out = torch.ops.moe.permute_pad(xx, ids, pp_, 8, 16)
            y = torch.ops.moe.unpad_unpermute(out[0].sin(), out[3], pp_)
        y.backward(g)
        grads.append((y, xx.grad, pp_.grad))
    for got, want in zip(*grads):
        assert torch.equal(got, want)


def test_autograd_end_to_end_matches_cpu():
    x, ids, probs = _inputs(300, 256, 16, 4, torch.float32, seed=5)
    w = torch.randn(256, 256, device=DEV) / 16

    def run(x, ids, probs, w):
        x = x.clone().requires_grad_(True)
        probs = probs.clone().requires_grad_(True)
        out = permute_pad(x, ids, probs, num_experts=16, align=32)
        h = torch.tanh(out.rows_MH @ w) * out.probs_M.unsqueeze(1)
        y = unpad_unpermute(h, out.row_map, probs)
        y.square().sum().backward()
        return y, x.grad, probs.grad

    got = run(x, ids, probs, w)
    want = run(x.cpu(), ids.cpu(), probs.cpu(), w.cpu())
    for g, w_ in zip(got, want):
        torch.testing.assert_close(g.cpu(), w_, rtol=1e-4, atol=1e-4)


def test_bitwise_deterministic_forward_backward_k8():
    x, ids, probs = _inputs(4096, 2048, 64, 8, torch.bfloat16, seed=9)
    g_y = torch.randn_like(x)

    def run():
        xx, pp = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
        out = permute_pad(xx, ids, pp, num_experts=64, align=32)
        h = out.rows_MH * out.probs_M.unsqueeze(1)
        y = unpad_unpermute(h, out.row_map, pp)
        y.backward(g_y)
        return [y, xx.grad, pp.grad, *out]

    first = run()
    for _ in range(2):
        for a, b in zip(first, run()):
            assert torch.equal(a, b)


def test_large_offsets_int64_addressing():
    # N * H > 2^31 elements: row offsets must be computed in int64
    T, H, E, K = 32768, 8448, 8, 8
    x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
    ids = torch.arange(K, device=DEV).expand(T, K).contiguous()  # every token to every expert
    out = permute_pad(x, ids, None, num_experts=E, align=32)
    assert out.rows_MH.shape[0] * H > 2**31
    last = out.row_map[-4:, :K].long()  # the highest rows belong to the last tokens
    assert int(last.max()) * H > 2**31
    for j in range(K):
        assert torch.equal(out.rows_MH[last[:, j]], x[-4:])
    y = unpad_unpermute(out.rows_MH, out.row_map)
    torch.testing.assert_close(y[-4:].float(), K * x[-4:].float(), **DTYPE_TOLS[torch.bfloat16])
    del out, y


@pytest.mark.parametrize("with_probs", (True, False))
def test_opcheck_cuda(with_probs):
    x, ids, probs = _inputs(40, 64, 7, 2, torch.float32, seed=3)
    p = probs if with_probs else None
    torch.library.opcheck(torch.ops.moe.permute_pad.default, (x, ids, p, 7, 16, False))
    out = permute_pad(x, ids, p, num_experts=7, align=16)
    torch.library.opcheck(torch.ops.moe.unpad_unpermute.default, (out.rows_MH, out.row_map, p, False))


def test_empty_and_tiny_cases():
    for T, E, K, a in ((0, 8, 2, 32), (1, 1, 1, 1), (3, 64, 2, 16)):
        x, ids, probs = _inputs(T, 32, E, K, torch.float16, seed=T)
        out = permute_pad(x, ids, probs, num_experts=E, align=a)
        assert out.rows_MH.shape == (static_row_bound(T * K, E, a), 32)
        for got, want in zip(out, _ref_tuple(x, ids, probs, E, a)):
            assert torch.equal(got, want)
        assert unpad_unpermute(out.rows_MH, out.row_map, probs).shape == (T, 32)


@pytest.mark.parametrize("T", [256, 4096])  # 4096: the histogram kernel too (PARALLEL_HISTOGRAM_BLOCKS)
def test_compile_reduce_overhead_strict_cudagraph(T):
    import torch._inductor.cudagraph_trees
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor_config

    H, E, K, a = 128, 16, 2, 32
    w = torch.randn(H, H, device=DEV, dtype=torch.bfloat16) / 8

    def layer(x, ids, probs):
        out = permute_pad(x, ids, probs, num_experts=E, align=a)
        h = torch.nn.functional.silu(out.rows_MH @ w)
        return unpad_unpermute(h, out.row_map, probs), out.offs_E

    torch._dynamo.reset()
    counters.clear()
    with inductor_config.patch({"graph_partition": False, "triton.cudagraph_or_error": True}):
        compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
        for step in range(4):  # warm-up, record, replays with new routing
            x, ids, probs = _inputs(T, H, E, K, torch.bfloat16, seed=100 + step)
            torch.compiler.cudagraph_mark_step_begin()
            y, offs = compiled(x, ids, probs)
            y, offs = y.clone(), offs.clone()
            y_ref, offs_ref = layer(x, ids, probs)
            assert torch.equal(offs, offs_ref)
            torch.testing.assert_close(y, y_ref, **DTYPE_TOLS[torch.bfloat16])
    assert counters["inductor"]["cudagraph_skips"] == 0
    manager = torch._inductor.cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    assert manager is not None and manager.new_graph_id().id >= 1
    torch._dynamo.reset()


def test_compile_training_fullgraph_matches_eager():
    T, H, E, K, a = 128, 64, 8, 2, 16
    x, ids, probs = _inputs(T, H, E, K, torch.float32, seed=7)

    def step(x, probs):
        out = permute_pad(x, ids, probs, num_experts=E, align=a)
        return unpad_unpermute(out.rows_MH.sin(), out.row_map, probs).sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    grads = []
    for fn in (step, compiled):
        xx, pp = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
        fn(xx, pp).backward()
        grads.append((xx.grad, pp.grad))
    torch.testing.assert_close(grads[0], grads[1])
    torch._dynamo.reset()


@pytest.mark.parametrize("op", ("permute_pad", "unpad_unpermute"))
def test_debug_device_assert(op):
    # a device-side assert poisons the CUDA context: run it in a subprocess
    script = """
        import torch
        from moe_compile.ops import permute_pad, unpad_unpermute
        x = torch.randn(8, 64, device="cuda")
        ids = torch.randint(0, 4, (8, 2), device="cuda")
        {bad}
        out = permute_pad(x, ids, None, num_experts=4, align=16, debug={debug_pp})
        row_map = out.row_map.clone()
        {bad_map}
        unpad_unpermute(out.rows_MH, row_map, None, debug={debug_uu})
        torch.cuda.synchronize()
        print("finished")
    """
    if op == "permute_pad":
        fmt = dict(bad="ids[3, 1] = 9", bad_map="", debug_uu=False)
        key = "debug_pp"
    else:
        fmt = dict(bad="", bad_map="row_map[2, 0] = out.rows_MH.shape[0] + 5", debug_pp=False)
        key = "debug_uu"
    ok = run_python(script.format(**fmt, **{key: False}))  # no debug: memory-safe, no assert
    assert ok.returncode == 0 and "finished" in ok.stdout, ok.stderr[-3000:]
    bad = run_python(script.format(**fmt, **{key: True}))
    assert bad.returncode != 0 and "finished" not in bad.stdout
    assert "assert" in bad.stderr.lower(), bad.stderr[-3000:]


@pytest.mark.parametrize("T", [512, 8192])
def test_eager_permute_pad_launches(T):
    # issue 14: the index kernel (histogram + scan) and the permute kernel, nothing else; from
    # PARALLEL_HISTOGRAM_BLOCKS blocks of ids on (T 8192: 16 blocks), the histogram kernel first
    from torch.autograd import DeviceType

    x, ids, probs = _inputs(T, 256, 16, 2, torch.bfloat16, seed=12)
    permute_pad(x, ids, probs, num_experts=16, align=32)  # compile the kernels first
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        permute_pad(x, ids, probs, num_experts=16, align=32)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
    want = ["_expert_offsets_kernel", "_permute_rows_kernel"]
    assert kernels == (["_block_histogram_kernel", *want] if T == 8192 else want), kernels


@pytest.mark.parametrize("dtype,T", [(torch.bfloat16, 96), (torch.float32, 96), (torch.bfloat16, 4096)], ids=str)
def test_compiled_layer_launches_the_kernels_from_generated_code(dtype, T):
    """Inductor's own code launches our kernels: no Python custom-op call, no atomics (fwd and bwd). T 4096:
    8192 ids, past PARALLEL_HISTOGRAM_BLOCKS (the histogram kernel's launch too)."""
    from torch._inductor.utils import run_and_get_code

    from moe_compile.ops.permute_pad import PARALLEL_HISTOGRAM_BLOCKS, _permute_plan

    H, E, K, a = 128, 8, 2, 16
    parallel = _permute_plan(T, H, K, E, a, 2).parallel_histogram
    assert parallel == (T == 4096) and PARALLEL_HISTOGRAM_BLOCKS <= 8
    x, ids, probs = _inputs(T, H, E, K, dtype, seed=13)
    w = (torch.randn(H, H, device=DEV) / 8).to(dtype)

    def layer(x, ids, probs):
        out = permute_pad(x, ids, probs, num_experts=E, align=a)
        h = torch.nn.functional.silu(out.rows_MH @ w)
        return unpad_unpermute(h, out.row_map, probs)

    def step(fn):
        xx, pp = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
        y = fn(xx, ids, pp)
        y.float().square().sum().backward()
        return y.detach(), xx.grad, pp.grad

    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    got, codes = run_and_get_code(step, compiled)
    again = step(compiled)
    torch._dynamo.reset()
    want = step(layer)
    for g, a2, w_ in zip(got, again, want):
        assert torch.equal(g, a2)  # deterministic
        torch.testing.assert_close(g.float(), w_.float(), **DTYPE_TOLS[dtype])
    joined = "\n".join(codes)
    assert len(codes) == 2  # forward and backward
    for kernel in ("_expert_offsets_kernel", "_permute_rows_kernel", "_unpermute_rows_kernel",
                   "_mark_used_rows_kernel", "_unpermute_backward_kernel"):  # fmt: skip
        assert kernel in joined, kernel
    assert ("def _block_histogram_kernel" in joined) == parallel  # (the index kernel's comments name it)
    assert "torch.ops.moe." not in joined
    assert "tl.atomic_add" not in joined


@pytest.mark.parametrize("T", [1, 4096])
def test_compiled_layer_has_no_input_copies(T):
    """torch 2.11's mutation analysis must not turn ``expert_idx`` into a mutated graph input
    (NOTE [no load-derived store addresses on graph inputs] (moe_compile/ops/triton/dispatch.py)): no ``copy_`` back
    into an input in the code (T 4096: the histogram kernel reads the ids)."""
    from torch._inductor.utils import run_and_get_code

    x, ids, probs = _inputs(T, 256, 8, 2, torch.bfloat16, seed=14)

    def layer(x, ids, probs):
        out = permute_pad(x, ids, probs, num_experts=8, align=16)
        return unpad_unpermute(out.rows_MH * 2, out.row_map, probs)

    torch._dynamo.reset()
    with torch.no_grad():
        y, (code,) = run_and_get_code(torch.compile(layer, fullgraph=True), x, ids, probs)
    torch._dynamo.reset()
    torch.testing.assert_close(y, layer(x, ids, probs))
    assert ".copy_(" not in code, code


def test_debug_device_assert_under_compile():
    # the traced path: Inductor launches the kernels; DEBUG is a constexpr, Inductor compiles user kernels
    # with device asserts enabled (a subprocess: the assert poisons the CUDA context)
    script = """
        import torch
        from moe_compile.ops import permute_pad
        f = torch.compile(lambda x, ids: permute_pad(x, ids, None, num_experts=4, align=16, debug={debug}).rows_MH,
                          fullgraph=True)
        x = torch.randn(8, 64, device="cuda")
        ids = torch.randint(0, 4, (8, 2), device="cuda")
        f(x, ids)
        torch.cuda.synchronize()
        ids[3, 1] = 9
        f(x, ids)
        torch.cuda.synchronize()
        print("finished")
    """
    ok = run_python(script.format(debug=False))
    assert ok.returncode == 0 and "finished" in ok.stdout, ok.stderr[-3000:]
    bad = run_python(script.format(debug=True))
    assert bad.returncode != 0 and "finished" not in bad.stdout
    assert "assert" in bad.stderr.lower(), bad.stderr[-3000:]


# ===== issue 35: bad input with debug=False is visible: NaN in the output and gradients, counted on the device =====
# (tests/ops/_poison_cases.py: the same checks run on CPU tensors under the interpreter in
# tests/ops/triton/test_dispatch_kernels.py, so these have run before they reach a GPU)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("kind", sorted(BAD_IDS))
def test_bad_expert_ids_poison_their_tokens(kind, dtype):
    """permute_pad given an expert id E, -1 or 2**40: the token's combine is NaN (probs in the combine, applied to
    the rows, or none), its gradients too; every other token bitwise as without the bad entries; counted by
    ``invalid_ids()`` and the router metrics."""
    check_bad_expert_ids(DEV, kind, dtype=dtype, seed=int(torch.seed() % 2**31))
    # many blocks of ids: the histograms in their own kernel, dropped entries ranked across blocks
    check_bad_expert_ids(DEV, kind, T=3000, H=136, E=64, K=8, align=32, dtype=dtype, seed=int(torch.seed() % 2**31))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("kind", sorted(BAD_MAPS))
def test_bad_row_map_poisons_its_token(kind, dtype):
    """unpad_unpermute given a row past the rows (or negative), or with probs a slot past K (or negative): the token's
    output and gradients are NaN, nothing is read past rows or probs, every other token is bitwise unchanged."""
    check_bad_row_map(DEV, kind, dtype=dtype, seed=int(torch.seed() % 2**31))
    check_bad_row_map(DEV, kind, T=2000, H=264, E=32, K=4, align=16, dtype=dtype, seed=int(torch.seed() % 2**31))


@pytest.mark.parametrize("T", (96, 4096))  # 4096: the histogram kernel too
@pytest.mark.parametrize("kind", sorted(BAD_IDS))
def test_bad_expert_ids_poison_under_compile(kind, T):
    """The kernels launched by Inductor's generated code (on torch 2.11 the permute reads the int32 copy of the
    ids, where 2**40 must not wrap into [0, E)): the bad tokens' outputs and gradients NaN, the others as eager."""
    H, E, K, a = 128, 8, 2, 16
    x, ids, probs = _inputs(T, H, E, K, torch.bfloat16, seed=int(torch.seed() % 2**31))
    w = (torch.randn(H, H, device=DEV) / 8).to(torch.bfloat16)
    bad_value = {"id_E": E, "id_minus_1": -1, "id_2_pow_40": 2**40}[kind]
    ids[T // 3, 1] = ids[T // 2, 0] = bad_value
    bad_T = torch.zeros(T, dtype=torch.bool)
    bad_T[[T // 3, T // 2]] = True

    def layer(x, ids, probs):
        out = permute_pad(x, ids, probs, num_experts=E, align=a)
        return unpad_unpermute(torch.nn.functional.silu(out.rows_MH @ w), out.row_map, probs)

    def step(fn):
        xx, pp = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
        y = fn(xx, ids, pp)
        y.backward(torch.ones_like(y))
        return y.detach().cpu(), xx.grad.cpu(), pp.grad.cpu()

    torch._dynamo.reset()
    got = step(torch.compile(layer, fullgraph=True))
    torch._dynamo.reset()
    want = step(layer)
    for g, w_, what in zip(got, want, ("y", "grad x", "grad probs")):
        assert bool(g[bad_T].isnan().all()), (what, "a bad token is not all NaN")
        assert not bool(g[~bad_T].isnan().any()), (what, "NaN outside the bad tokens")
        torch.testing.assert_close(g[~bad_T].float(), w_[~bad_T].float(), **DTYPE_TOLS[torch.bfloat16])


@pytest.mark.parametrize("kind", ("row_R", "slot_K"))
def test_bad_row_map_poisons_under_compile(kind):
    T, H, E, K, a = 256, 64, 8, 2, 16
    x, ids, probs = _inputs(T, H, E, K, torch.float32, seed=int(torch.seed() % 2**31))
    out = permute_pad(x, ids, probs, num_experts=E, align=a)
    row_map = out.row_map.clone()
    row_map[7, 0 if kind == "row_R" else K] = out.rows_MH.shape[0] if kind == "row_R" else K
    f = torch.compile(lambda z, m, p: unpad_unpermute(z * 2, m, p), fullgraph=True)
    z = out.rows_MH.clone().requires_grad_(True)
    y = f(z, row_map, probs)
    (gz,) = torch.autograd.grad(y, z, torch.ones_like(y))
    torch._dynamo.reset()
    assert bool(y[7].isnan().all()) and not bool(y[torch.arange(T, device=DEV) != 7].isnan().any())
    rows = row_map[7, :K].long()
    rows = rows[(rows >= 0) & (rows < z.shape[0])]
    assert rows.numel() and bool(gz[rows].isnan().all())


def test_bad_ids_in_a_cuda_graph_replay_are_poisoned_and_counted():
    """No host sync: a graph captured on good ids, replayed with bad ones, shows them (NaN rows, the count); the
    router metrics count them too (eager, in sync debug mode); replayed with good ids again, bitwise the reference."""
    from moe_compile import metrics
    from moe_compile.ops.router_metrics import router_metrics_

    metrics.forget()
    T, H, E, K, a = 1024, 256, 16, 4, 32
    x, ids, probs = _inputs(T, H, E, K, torch.bfloat16, seed=41)
    logits = torch.randn(T, E, device=DEV)
    entry = metrics.accumulator("model.layers.0.mlp.gate", E, DEV)
    static_ids = ids.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: every kernel compiled before the capture
        warm = permute_pad(x, static_ids, probs, num_experts=E, align=a)
        unpad_unpermute(warm.rows_MH, warm.row_map, probs)
        warm.invalid_ids()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = permute_pad(x, static_ids, probs, num_experts=E, align=a)
        y = unpad_unpermute(out.rows_MH, out.row_map, probs)
        n_invalid = out.invalid_ids()
    bad = ids.clone()
    bad[5, 2], bad[900, 0], bad[901, 3] = E, -1, 2**40
    static_ids.copy_(bad)
    graph.replay()
    bad_T = torch.zeros(T, dtype=torch.bool, device=DEV)
    bad_T[[5, 900, 901]] = True
    assert bool(y[bad_T].isnan().all()) and not bool(y[~bad_T].isnan().any())
    assert int(n_invalid) == 3
    router_metrics_(entry.acc_S, logits, static_ids)  # warm-up, then counted once more without a host sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        router_metrics_(entry.acc_S, logits, static_ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert metrics.collect()["moe/invalid_ids"] == 3  # per step (two calls, 6 bad ids)
    static_ids.copy_(ids)
    graph.replay()
    for got, want in zip(out, _ref_tuple(x, ids, probs, E, a)):
        assert torch.equal(got, want)
    assert torch.equal(y, unpad_unpermute_reference(out.rows_MH, out.row_map, probs)) and int(n_invalid) == 0
    metrics.forget()


def test_poisoning_needs_no_host_sync():
    """Eager, with bad input: no call synchronises with the host (torch's sync debug mode raises on one)."""
    T, H, E, K = 512, 128, 8, 2
    x, ids, probs = _inputs(T, H, E, K, torch.bfloat16, seed=42)
    ids[3, 1] = -1

    def step():
        xx, pp = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
        out = permute_pad(xx, ids, pp, num_experts=E, align=16)
        y = unpad_unpermute(out.rows_MH * out.probs_M[:, None], out.row_map, pp)
        y.backward(torch.ones_like(y))
        return y, xx.grad, out.invalid_ids()

    step()  # every kernel compiled first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y, grad_x, count = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert int(count) == 1 and bool(y[3].isnan().all()) and bool(grad_x[3].isnan().all())
