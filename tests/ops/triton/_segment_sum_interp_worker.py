"""Runs the ``moe.segment_sum`` Triton kernel through its launcher on CPU tensors under ``TRITON_INTERPRET=1``.

Started in a fresh interpreter by ``test_segment_sum_kernels.py`` (the variable must be set before ``triton``
is first imported). Prints one JSON line: ``{case name: "ok" | traceback}``. ``CASES`` is plain data so the
parent can import it cheaply.
"""

from __future__ import annotations

# name: (N, D, R, dtype name, masked, block_d, block_j, index kind)
CASES = {
    "fp32_default_blocks": (40, 24, 9, "float32", False, None, None, "uniform"),
    "fp32_several_tiles_and_d_blocks": (50, 40, 3, "float32", True, 16, 4, "uniform"),
    "bf16_masked": (33, 20, 7, "bfloat16", True, 16, 4, "uniform"),
    "fp16": (17, 8, 5, "float16", False, None, 2, "uniform"),
    "fp64": (21, 3, 4, "float64", True, None, None, "uniform"),
    "int64_counts_d1": (29, 1, 6, "int64", False, None, 4, "uniform"),
    "int32": (15, 5, 4, "int32", True, None, None, "uniform"),
    "one_hot_row": (64, 6, 50, "float32", False, None, 8, "one_row"),  # one long segment, 49 empty rows
    "strided_src": (12, 10, 5, "float32", False, None, None, "strided"),
    "out_of_range_dropped": (20, 4, 6, "float32", False, None, None, "out_of_range"),
    "empty_n": (0, 4, 3, "float32", False, None, None, "uniform"),
    "empty_d": (5, 0, 3, "float32", False, None, None, "uniform"),
    "empty_r": (0, 4, 0, "float32", False, None, None, "uniform"),
}
# with BLOCK_J = 1 the kernel adds one entry at a time in ascending order, as the reference does: bitwise
SEQUENTIAL_CASES = {"sequential_fp32": (45, 12, 6, "float32"), "sequential_fp64": (30, 5, 3, "float64")}
DEBUG_CASES = ("debug_out_of_range", "sorted_offsets")
# moe.gather_segment_sum: name: (S source rows, N, D, R, dtype name, weighted, masked, idx sorted, block_j)
GATHER_CASES = {
    "gather_fp32_weighted_masked": (9, 40, 24, 11, "float32", True, True, False, None),
    "gather_bf16_sorted_masked": (13, 33, 20, 7, "bfloat16", True, True, True, None),
    "gather_fp16_unweighted": (5, 17, 8, 6, "float16", False, False, False, 4),
    "gather_fp64_sorted_tiles": (6, 30, 3, 4, "float64", True, False, True, 4),
    "gather_empty_n": (4, 0, 4, 3, "float32", True, True, True, None),
}


def _inputs(N, D, R, dtype, masked, kind, seed):
    import torch

    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        src = torch.randn(N, 2 * D if kind == "strided" else D, generator=gen).to(dtype)
    else:
        src = torch.randint(-100, 100, (N, D), generator=gen).to(dtype)
    if kind == "strided":
        src = src[:, ::2]
    idx = torch.randint(0, max(R, 1), (N,), generator=gen)
    if kind == "one_row":
        idx = torch.full((N,), R // 2, dtype=torch.int64)
    if kind == "out_of_range":
        idx[::3] = R + 2
        idx[1::5] = -1
    mask = torch.rand(N, generator=gen) > 0.3 if masked else None
    return src, idx, mask


def _bound(src, idx, R, mask, want):
    """``gamma_n`` of the accumulator times ``sum |src|`` per row, twice (kernel and reference sum in
    different orders), plus the output rounding of each side (the interpreter truncates bf16/fp16)."""
    import torch

    from tests import _tolerance as tol

    keep = (idx >= 0) & (idx < R) if mask is None else mask & (idx >= 0) & (idx < R)
    mag = torch.zeros(R, src.shape[1], dtype=torch.float64).index_add_(0, idx[keep], src[keep].double().abs())
    n = int(torch.bincount(idx[keep], minlength=R).max()) if keep.any() else 1
    acc = torch.float64 if src.dtype == torch.float64 else torch.float32
    inner = 2 * tol.gamma(max(n, 1), acc) * mag
    return inner + tol.rounding_bound(want, src.dtype, inner=inner, truncate=True) \
        + tol.rounding_bound(want, src.dtype, inner=inner)


def _run_case(N, D, R, dtype_name, masked, block_d, block_j, kind, seed):
    import importlib

    import torch

    from tests import _tolerance as tol

    ss = importlib.import_module("moe_compile.ops.segment_sum")
    dtype = getattr(torch, dtype_name)
    src, idx, mask = _inputs(N, D, R, dtype, masked, kind, seed)
    want = ss.segment_sum_reference(src, idx, R, mask)
    got = ss._launch_triton(src, idx, R, mask, block_d=block_d, block_j=block_j)
    assert got.dtype == want.dtype and got.shape == want.shape == (R, D), (got.shape, want.shape)
    if not dtype.is_floating_point:
        assert torch.equal(got, want)
    else:
        tol.assert_within(got, want, _bound(src, idx, R, mask, want), "kernel vs reference")
    for _ in range(2):  # run to run: bitwise
        assert torch.equal(ss._launch_triton(src, idx, R, mask, block_d=block_d, block_j=block_j), got)


def _run_sequential_case(N, D, R, dtype_name):
    import importlib

    import torch

    ss = importlib.import_module("moe_compile.ops.segment_sum")
    src, idx, mask = _inputs(N, D, R, getattr(torch, dtype_name), True, "uniform", seed=N)
    assert torch.equal(ss._launch_triton(src, idx, R, mask, block_j=1), ss.segment_sum_reference(src, idx, R, mask))


def _run_debug_case():
    import importlib

    import torch

    ss = importlib.import_module("moe_compile.ops.segment_sum")
    src = torch.randn(4, 3)
    ss._launch_triton(src, torch.tensor([0, 9, 2, 1]), 3, torch.tensor([True, False, True, True]), debug=True)
    try:
        ss._launch_triton(src, torch.tensor([0, 3, 2, 1]), 3, None, debug=True)
    except RuntimeError as e:
        assert "idx values must be in [0, num_rows)" in str(e), str(e)
    else:
        raise AssertionError("debug assert did not fire")


def _run_gather_case(S, N, D, R, dtype_name, weighted, masked, idx_sorted, block_j, seed):
    """Kernel vs ``gather_segment_sum_reference`` (the same rows, the reference one at a time) within the sum's
    bound over ``|weight * src|``; bitwise run to run."""
    import importlib

    import torch

    from tests import _tolerance as tol

    ss = importlib.import_module("moe_compile.ops.segment_sum")
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(seed)
    src = torch.randn(S, D, generator=gen).to(dtype)
    src_idx = torch.randint(0, S, (N,), generator=gen)
    idx = torch.randint(0, R, (N,), generator=gen)
    if idx_sorted:
        idx = idx.sort().values
    weight = torch.randn(N, generator=gen) if weighted else None
    mask = torch.rand(N, generator=gen) > 0.3 if masked else None
    if mask is not None:
        src_idx = torch.where(mask, src_idx, 10**6)  # a skipped entry's row is never read
    want = ss.gather_segment_sum_reference(src, src_idx, idx, R, weight, mask)
    got = ss._launch_triton(src, idx, R, mask, gather=src_idx, weight=weight, idx_sorted=idx_sorted,
                            block_j=block_j)
    assert got.dtype == want.dtype and got.shape == want.shape == (R, D), (got.shape, want.shape)
    keep = torch.ones(N, dtype=torch.bool) if mask is None else mask
    terms = src.double()[torch.where(keep, src_idx, 0)].abs()
    if weight is not None:
        terms = terms * weight.double().abs()[:, None]
    mag = torch.zeros(R, D, dtype=torch.float64).index_add_(0, idx[keep], terms[keep])
    n = int(torch.bincount(idx[keep], minlength=R).max()) if keep.any() else 1
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    inner = 2 * tol.gamma(max(n, 1) + 1, acc) * mag  # the weight's product: one more rounding per term
    bound = inner + tol.rounding_bound(want, dtype, inner=inner, truncate=True) \
        + tol.rounding_bound(want, dtype, inner=inner)
    tol.assert_within(got, want, bound, "gather kernel vs reference")
    assert torch.equal(ss._launch_triton(src, idx, R, mask, gather=src_idx, weight=weight, idx_sorted=idx_sorted,
                                         block_j=block_j), got)


def _run_sorted_offsets_case():
    """The binary search of ``gather_segment_sum``'s sorted path equals ``torch.searchsorted`` (values below 0 and
    past ``R`` included, empty input, one row)."""
    import importlib

    import torch

    ss = importlib.import_module("moe_compile.ops.segment_sum")
    gen = torch.Generator().manual_seed(11)
    for N, R in [(0, 3), (1, 1), (10, 4), (700, 300), (57, 1), (300, 1000)]:
        idx = torch.randint(-2, R + 2, (N,), generator=gen).sort().values
        want = torch.searchsorted(idx, torch.arange(R + 1))
        assert torch.equal(ss._sorted_offsets(idx, R), want), (N, R)


def main() -> None:
    import json
    import os

    from tests.ops.triton._interp import run_cases

    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    torch.set_num_threads(1)
    from moe_compile.ops.triton import segment_sum

    results = {"_interpreted": isinstance(segment_sum._segment_sum_kernel, InterpretedFunction)}
    jobs = [(n, lambda c=c, n=n: _run_case(*c, seed=len(n))) for n, c in CASES.items()]
    jobs += [(n, lambda c=c: _run_sequential_case(*c)) for n, c in SEQUENTIAL_CASES.items()]
    jobs += [("debug_out_of_range", _run_debug_case), ("sorted_offsets", _run_sorted_offsets_case)]
    jobs += [(n, lambda c=c, n=n: _run_gather_case(*c, seed=len(n))) for n, c in GATHER_CASES.items()]
    print(json.dumps(run_cases(jobs, results)))


if __name__ == "__main__":
    main()
