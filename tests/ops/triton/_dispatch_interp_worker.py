"""Runs every dispatch Triton kernel through its launcher on CPU tensors under ``TRITON_INTERPRET=1``.

Started in a fresh interpreter by ``test_dispatch_kernels.py`` (the variable must be set before
``triton`` is first imported, which a pytest process cannot guarantee). Prints one JSON line:
``{case name: "ok" | traceback}``. ``CASES`` is plain data so the parent can import it cheaply.
"""

from __future__ import annotations

# name: (T, H, E, K, align, dtype name, with_probs, routing, block_n, block_h)
CASES = {
    "multi_block_h_not_multiple": (13, 40, 7, 5, 16, "bfloat16", True, "uniform", 16, 16),
    "e7_k5_default_blocks": (9, 24, 7, 5, 32, "float16", True, "uniform", None, None),
    "t0": (0, 16, 7, 2, 32, "float32", True, "uniform", None, None),
    "t1_e1_k1_a1": (1, 8, 1, 1, 1, "float32", True, "uniform", None, None),
    "no_probs_a128": (10, 20, 4, 2, 128, "float16", False, "uniform", 16, None),
    "e64_k8_many_blocks": (9, 8, 64, 8, 8, "float32", True, "uniform", 16, None),
    "all_tokens_one_expert": (12, 24, 8, 1, 16, "bfloat16", True, "one_expert", None, 16),
    "fewer_rows_than_experts": (3, 16, 64, 2, 8, "bfloat16", True, "uniform", None, None),
    "fp64_int32_ids": (7, 12, 5, 3, 8, "float64", True, "int32_ids", 16, 8),
    "strided_x": (6, 24, 6, 2, 16, "float32", True, "strided_x", None, None),
    # K_PAD = 64 caps the rank loop's chunk at 64 ids < BLOCK_N + K - 1: several chunks per token
    "k40_rank_loop_chunks": (5, 8, 40, 40, 8, "float32", True, "uniform", 64, None),
    # 40 blocks of 8 entries: past PARALLEL_HISTOGRAM_BLOCKS, so the histograms come from their own kernel
    "many_blocks_parallel_histogram": (40, 8, 16, 8, 8, "float32", True, "uniform", 8, None),
}
DEBUG_CASES = ("debug_assert_expert_idx", "debug_assert_expert_idx_parallel_histogram", "debug_assert_row_map",
               "debug_assert_row_map_slot")
# the index kernel's loop over table blocks, SUB at a time: (T, E, K, align, block_n, sub, parallel_histogram)
INDEX_LOOP_CASES = {
    "index_loop_sub2_partial_last": (37, 6, 3, 16, 16, 2, False),  # 7 blocks: 4 iterations, the last half empty
    "index_loop_sub1": (20, 9, 2, 8, 16, 1, False),
    "index_loop_sub4_e64": (40, 64, 4, 32, 32, 4, False),
    # the histograms from _block_histogram_kernel, then the scan over the table
    "parallel_histogram_sub2_partial_last": (37, 6, 3, 16, 16, 2, True),
    "parallel_histogram_plan_sub_e64": (40, 64, 4, 32, 32, None, True),
    "parallel_histogram_sub1_int32_ids": (20, 9, 2, 8, 16, 1, True),
}
# issue 35: bad input in the default mode (tests/ops/_poison_cases.py, which the GPU tests run too):
# name: (check, keyword arguments; "launch": _launch_triton overrides for the permute)
POISON_CASES = {
    **{f"poison_ids_{kind}": ("ids", dict(kind=kind)) for kind in ("id_E", "id_minus_1", "id_2_pow_40")},
    "poison_ids_k1_align1": ("ids", dict(kind="id_E", K=1, align=1)),  # no zero programs (M = N)
    # K_PAD 64: the dropped entries' branch reads the table in two chunks of 64 experts (E_PAD 128)
    "poison_ids_k40_two_expert_chunks": ("ids", dict(kind="id_2_pow_40", T=6, H=8, E=100, K=40, align=8)),
    "poison_ids_int32_ids_fp16_a128": ("ids", dict(kind="id_minus_1", ids_dtype="int32", dtype="float16", align=128)),
    # several blocks of ids: dropped entries ranked across blocks; the histograms in their own kernel
    "poison_ids_parallel_histogram": ("ids", dict(kind="id_minus_1", T=37, launch=dict(block_n=8,
                                                                                      parallel_histogram=True))),
    # the traced path's int32 copy of the ids (torch 2.11): 2**40 must not wrap into [0, E)
    "poison_ids_copy_ids_serial": ("ids", dict(kind="id_2_pow_40", T=37, launch=dict(block_n=8, sub=2,
                                                                                     copy_ids=True))),
    "poison_ids_copy_ids_parallel": ("ids", dict(kind="id_E", T=37, launch=dict(block_n=8, parallel_histogram=True,
                                                                                copy_ids=True))),
    **{f"poison_map_{kind}": ("map", dict(kind=kind)) for kind in
       ("row_R", "row_R_plus_1000", "row_minus_5", "slot_K", "slot_K_plus_1000", "slot_minus_1")},
    "poison_map_row_R_fp16_k1": ("map", dict(kind="row_R", K=1, dtype="float16")),
}
# the four slowest under the interpreter (~45 s of ~100): in the slow run (`-m slow`, a second worker: `main slow`);
# the GPU tests run every poison case
SLOW_POISON_CASES = ("poison_ids_k40_two_expert_chunks", "poison_ids_parallel_histogram", "poison_ids_copy_ids_serial",
                     "poison_ids_copy_ids_parallel")
# kernel launches per op call (issue 14: the permute is at most two)
LAUNCH_COUNTS = {"permute_pad": 2, "unpad_unpermute": 1, "permute_pad_backward": 1, "unpad_unpermute_backward": 2}


def _inputs(T, H, E, K, dtype, routing, seed):
    import torch

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(dtype)
    ids = torch.rand(T, E, generator=gen).argsort(1)[:, :K]
    if routing == "one_expert":
        ids = torch.full((T, K), E // 2, dtype=torch.int64)
    if routing == "int32_ids":
        ids = ids.to(torch.int32)
    if routing == "strided_x":
        x = torch.randn(T, 2 * H, generator=gen).to(dtype)[:, :H]  # row stride 2H, unit column stride
    probs = torch.rand(T, K, generator=gen).to(dtype)
    return x, ids, probs


def _run_case(name, T, H, E, K, a, dtype_name, with_probs, routing, block_n, block_h):
    import importlib

    import torch

    pp = importlib.import_module("moe_compile.ops.permute_pad")
    uu = importlib.import_module("moe_compile.ops.unpad_unpermute")
    dtype = getattr(torch, dtype_name)
    x, ids, probs = _inputs(T, H, E, K, dtype, routing, seed=len(name))
    probs = probs if with_probs else None
    if routing == "strided_x":
        assert x.stride(0) == 2 * H and x.stride(1) == 1

    # The CUDA kernel functions (fallbacks included) with default blocks, or the launchers with the
    # case's small blocks (several blocks per axis); compared with the references.
    use_launchers = T > 0 and (block_n is not None or block_h is not None)
    ref = pp.permute_pad_reference(x, ids, probs, E, a)
    ref = (ref.rows_MH, ref.probs_M if probs is not None else x.new_empty(0), ref.offs_E, ref.row_map, ref.counts_E)
    if use_launchers:
        out = pp._launch_triton(x, ids, probs, E, a, block_n=block_n, block_h=block_h)
    else:
        out = pp._permute_pad_cuda(x, ids, probs, E, a)
    for got, want, what in zip(out, ref, ("rows", "probs", "offs", "row_map", "counts")):
        assert got.dtype == want.dtype and got.shape == want.shape, (what, got.shape, want.shape)
        assert torch.equal(got, want), what  # data movement: bitwise
    rows, _, _, row_map, _ = ref
    M = rows.shape[0]
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(M, H, generator=gen).to(dtype)  # pad rows nonzero too: they must never be read

    def computed_equal(got, want):
        """Bitwise, except bf16: the interpreter casts fp32 -> bf16 by truncation (the GPU rounds to
        nearest even), so computed bf16 values may differ by one ulp there."""
        if dtype != torch.bfloat16:
            return torch.equal(got, want)
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=0)
        return True

    # unpad_unpermute forward: fixed order, separate multiply and add
    y_ref = uu.unpad_unpermute_reference(z, row_map, probs)
    if use_launchers:
        y = uu.launch_gather_sum_triton(z, row_map, probs, block_h=block_h)[0]
    else:
        y = uu._unpad_unpermute_cuda(z, row_map, probs)
    assert computed_equal(y, y_ref)

    # permute_pad backward: gather-sum of grad rows + prob gather (bitwise)
    g_rows = torch.randn(M, H, generator=gen).to(dtype)
    g_probs = torch.randn(M, generator=gen).to(dtype) if probs is not None else None
    gx_ref, gp_ref = pp.permute_pad_backward_reference(g_rows, g_probs, row_map)
    if use_launchers:
        gx, gp = uu.launch_gather_sum_triton(g_rows, row_map, None, grad_probs_M=g_probs, block_h=block_h)
    else:
        gx, gp = pp._permute_pad_backward_cuda(g_rows, g_probs, row_map)
    assert computed_equal(gx, gx_ref)
    assert torch.equal(gp, gp_ref) if probs is not None else gp is None or gp.numel() == 0

    # unpad_unpermute backward, with and without the prob gradient: grad rows (unreferenced rows zero;
    # a copy without probs), prob grads to fp32-dot tolerance (the reduction order over H differs)
    g_y = torch.randn(T, H, generator=gen).to(dtype)
    for saved_rows in ((z, None) if probs is not None else (None,)):
        dz_ref, dp_ref = uu.unpad_unpermute_backward_reference(g_y, row_map, probs, saved_rows, M)
        if use_launchers:
            dz, dp = uu.launch_unpad_unpermute_backward_triton(g_y, row_map, probs, saved_rows, M, block_h=block_h)
        else:
            dz, dp = uu._unpad_unpermute_backward_cuda(g_y, row_map, probs, saved_rows, M)
        assert computed_equal(dz, dz_ref) if probs is not None else torch.equal(dz, dz_ref)
        if dp_ref is None:
            assert dp is None or dp.numel() == 0
        else:
            tol = 1e-12 if dtype == torch.float64 else 2e-2 if dtype != torch.float32 else 1e-5
            torch.testing.assert_close(dp.double(), dp_ref.double(), rtol=tol, atol=tol)


def _run_index_loop_case(T, E, K, a, block_n, sub, parallel_histogram):
    import importlib

    import torch

    pp = importlib.import_module("moe_compile.ops.permute_pad")
    x, ids, probs = _inputs(T, 8, E, K, torch.float32, "int32_ids" if sub == 1 else "uniform", seed=T + E)
    got = pp._launch_triton(x, ids, probs, E, a, block_n=block_n, sub=sub, parallel_histogram=parallel_histogram)
    ref = pp._reference_tuple(x, ids, probs, E, a)
    for g, want, what in zip(got, ref, ("rows", "probs", "offs", "row_map", "counts")):
        assert torch.equal(g, want), what


def _run_eager_autograd_case():
    """The eager fast path's autograd.Functions (NOTE [eager fast path] (moe_compile/ops/_common.py)) on the kernels:
    output and gradients of x, probs and the expert rows vs autograd through the pure-PyTorch references (float64)."""
    import importlib

    import torch

    pp = importlib.import_module("moe_compile.ops.permute_pad")
    uu = importlib.import_module("moe_compile.ops.unpad_unpermute")
    T, H, E, K, a = 11, 12, 5, 3, 8
    x0, ids, p0 = _inputs(T, H, E, K, torch.float64, "uniform", seed=21)
    gen = torch.Generator().manual_seed(22)
    w = torch.randn(H, generator=gen, dtype=torch.float64)
    g = torch.randn(T, H, generator=gen, dtype=torch.float64)
    results = []
    for permute, unpermute in (
        (lambda x, p: pp._EagerPermutePad.apply(x, ids, p, E, a, False),
         lambda r, m, p: uu._EagerUnpadUnpermute.apply(r, m, p, False)),
        (lambda x, p: pp.permute_pad_reference(x, ids, p, E, a), uu.unpad_unpermute_reference),
    ):
        x, p = x0.clone().requires_grad_(True), p0.clone().requires_grad_(True)
        out = permute(x, p)
        rows = out[0] * w
        rows.retain_grad()
        y = unpermute(rows * out[1][:, None], out[3], p)  # probs used before (probs_M) and after (combine)
        y.backward(g)
        results.append((y.detach(), x.grad, p.grad, rows.grad))
    for got, want, what in zip(*results, ("y", "x.grad", "probs.grad", "rows.grad")):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=what)
    # like the op, the backward is once differentiable
    x, p = x0.clone().requires_grad_(True), p0.clone().requires_grad_(True)
    y = uu._EagerUnpadUnpermute.apply(pp._EagerPermutePad.apply(x, ids, p, E, a, False)[0], out[3], p, False)
    (grad_x,) = torch.autograd.grad(y, x, g, create_graph=True)
    try:
        grad_x.sum().backward()
    except RuntimeError as e:
        assert "once_differentiable" in str(e) or "does not require grad" in str(e), str(e)
    else:
        raise AssertionError("double backward through the eager autograd.Function did not raise")


def _run_poison_case(check: str, kwargs: dict) -> None:
    """A POISON_CASES case: every output buffer starts as a sentinel (so an element no program writes shows), and
    the permute runs with the case's launch overrides."""
    import contextlib
    import functools
    import importlib

    import torch

    from moe_compile.ops import _common
    from tests.ops import _poison_cases as cases

    pp = importlib.import_module("moe_compile.ops.permute_pad")
    kwargs = dict(kwargs)
    launch = kwargs.pop("launch", {})
    for key in ("dtype", "ids_dtype"):
        if key in kwargs:
            kwargs[key] = getattr(torch, kwargs[key])

    def sentinel_allocator(t, traced):
        def alloc(shape, dtype):
            return torch.full(shape, 777 if not dtype.is_floating_point else 7.77e3, dtype=dtype, device=t.device)
        return alloc

    saved_alloc, saved_launch = _common.eager_cuda_allocator, pp._launch_triton
    with contextlib.ExitStack() as stack:
        stack.callback(setattr, _common, "eager_cuda_allocator", saved_alloc)
        stack.callback(setattr, pp, "_launch_triton", saved_launch)
        _common.eager_cuda_allocator = sentinel_allocator
        pp._launch_triton = functools.partial(saved_launch, **launch)
        if check == "ids":
            cases.check_bad_expert_ids("cpu", seed=len(str(kwargs)), **kwargs)
        else:
            cases.check_bad_row_map("cpu", seed=len(str(kwargs)), **kwargs)


def _count_launches() -> dict:
    """Launches per op call, counted by wrapping every kernel of the dispatch module."""
    import importlib

    import torch

    from moe_compile.ops.triton import dispatch

    pp = importlib.import_module("moe_compile.ops.permute_pad")
    uu = importlib.import_module("moe_compile.ops.unpad_unpermute")
    launches = []

    class Counting:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            launches.append(self.name)
            return self.kernel[grid]

    saved = {k: getattr(dispatch, k) for k in vars(dispatch) if k.endswith("_kernel")}
    counts = {}
    try:
        for k, v in saved.items():
            setattr(dispatch, k, Counting(k, v))
        x, ids, probs = _inputs(12, 16, 6, 2, torch.float32, "uniform", seed=3)
        rows, probs_M, _, row_map, _ = pp._permute_pad_cuda(x, ids, probs, 6, 16)
        counts["permute_pad"] = len(launches)
        launches.clear()
        uu._unpad_unpermute_cuda(rows, row_map, probs)
        counts["unpad_unpermute"] = len(launches)
        launches.clear()
        pp._permute_pad_backward_cuda(rows, probs_M, row_map)
        counts["permute_pad_backward"] = len(launches)
        launches.clear()
        uu._unpad_unpermute_backward_cuda(x, row_map, probs, rows, rows.shape[0])
        counts["unpad_unpermute_backward"] = len(launches)
    finally:
        for k, v in saved.items():
            setattr(dispatch, k, v)
    return counts


def _run_debug_case(name):
    import dataclasses
    import importlib

    import torch
    from triton.runtime import interpreter

    pp = importlib.import_module("moe_compile.ops.permute_pad")
    uu = importlib.import_module("moe_compile.ops.unpad_unpermute")
    builder = interpreter.interpreter_builder
    saved = builder.options
    builder.options = dataclasses.replace(saved, debug=True)  # the interpreter's device_assert switch
    try:
        x = torch.randn(4, 8)
        if name.startswith("debug_assert_expert_idx"):
            parallel = dict(block_n=2, parallel_histogram=name.endswith("parallel_histogram"))
            pp._launch_triton(x, torch.tensor([[0, 1], [2, 3], [4, 7], [0, 1]]), None, 8, 16, debug=True, **parallel)
            bad = torch.tensor([[0, 1], [2, 3], [4, 9], [0, 1]])
        else:
            rows, _, _, row_map, _ = pp._launch_triton(x, torch.tensor([[0, 1], [2, 3], [4, 7], [0, 1]]), None, 8, 16)
            probs = torch.rand(4, 2) if name.endswith("slot") else None
            uu.launch_gather_sum_triton(rows, row_map, probs, debug=True)  # ok rows
            bad_map = row_map.clone()
            if name.endswith("slot"):
                bad_map[2, 3] = 2  # a slot past K = 2
            else:
                bad_map[2, 1] = rows.shape[0]
        try:
            if name.startswith("debug_assert_expert_idx"):
                pp._launch_triton(x, bad, None, 8, 16, debug=True, **parallel)
            else:
                uu.launch_gather_sum_triton(rows, bad_map, probs, debug=True)
        except Exception as e:  # noqa: BLE001 - the interpreter raises the assert as an InterpreterError (message checked)
            expected = (
                "expert_idx out of range" if name.startswith("debug_assert_expert_idx")
                else "row_map slot out of range" if name.endswith("slot") else "row_map row out of range"
            )  # fmt: skip
            assert expected in str(e), str(e)
        else:
            raise AssertionError("device_assert did not fire")
    finally:
        builder.options = saved


def main() -> None:
    import json
    import os
    import sys
    import time
    import traceback

    from tests.ops.triton._interp import run_cases

    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    import torch
    import triton

    torch.set_num_threads(1)  # tiny numpy/torch ops only

    from triton.runtime.interpreter import InterpretedFunction

    from moe_compile.ops.triton import dispatch

    if sys.argv[1:] == ["slow"]:
        results = run_cases([(name, lambda name=name: _run_poison_case(*POISON_CASES[name]))
                             for name in SLOW_POISON_CASES], {})
        print(json.dumps(results))
        return

    kernels = [k for k in vars(dispatch) if k.endswith("_kernel")]
    assert all(isinstance(getattr(dispatch, k), InterpretedFunction) for k in kernels), triton.__version__
    results = {"_kernels": sorted(kernels)}
    timings = results["_seconds"] = {}
    for name, case in CASES.items():
        try:
            t0 = time.perf_counter()
            _run_case(name, *case)
            results[name] = "ok"
            timings[name] = round(time.perf_counter() - t0, 2)
        except Exception:  # noqa: BLE001 - the worker reports any failure to the parent test
            results[name] = traceback.format_exc()
    run_cases([(name, lambda case=case: _run_index_loop_case(*case)) for name, case in INDEX_LOOP_CASES.items()],
              results)
    run_cases([("eager_autograd_function", _run_eager_autograd_case)], results)
    try:
        results["_launches"] = _count_launches()
    except Exception:  # noqa: BLE001 - the worker reports any failure to the parent test
        results["_launches"] = traceback.format_exc()
    run_cases([(name, lambda name=name: _run_debug_case(name)) for name in DEBUG_CASES], results)
    run_cases([(name, lambda case=case: _run_poison_case(*case)) for name, case in POISON_CASES.items()
               if name not in SLOW_POISON_CASES], results)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
