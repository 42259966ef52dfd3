"""Runs the ``moe.gather_rows`` Triton kernel through its launcher on CPU tensors under ``TRITON_INTERPRET=1``.

Started in a fresh interpreter by ``test_expert_parallel_kernels.py`` (``_interp.py`` says why). Prints one JSON
line: ``{case name: "ok" | traceback}``. ``CASES`` is plain data so the parent can import it cheaply.
"""

from __future__ import annotations

# name: (n source rows, m output rows, row shape, dtype name, index dtype name, block_r, block_d)
CASES = {
    "bf16_default_blocks": (37, 50, (24,), "bfloat16", "int64", None, None),
    "fp32_several_row_and_column_blocks": (20, 33, (40,), "float32", "int64", 4, 16),
    "fp16_int32_index": (9, 17, (8,), "float16", "int32", 2, None),
    "rows_of_3d_src": (11, 14, (3, 5), "float32", "int64", None, 8),
    "int64_values": (13, 13, (6,), "int64", "int64", 4, None),
    "one_column": (25, 30, (1,), "float64", "int64", 8, None),
    "empty_src": (0, 6, (4,), "float32", "int64", None, None),
    "empty_index": (5, 0, (4,), "float32", "int64", None, None),
}


def _run_case(n, m, row, dtype_name, index_dtype_name, block_r, block_d, seed):
    import torch

    from moe_compile.ops import expert_parallel as ep

    dtype, index_dtype = getattr(torch, dtype_name), getattr(torch, index_dtype_name)
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        src = torch.randn(n, *row, generator=gen).to(dtype)
    else:
        src = torch.randint(-(2**40), 2**40, (n, *row), generator=gen).to(dtype)
    # a permutation's prefix (the op's contract: valid entries distinct) with sentinels and negatives among it
    index = torch.randperm(max(n, 1), generator=gen)[:m]
    if m > n:
        index = torch.cat([index, torch.full((m - index.numel(),), n)])
    index = index[torch.randperm(m, generator=gen)]
    index[::4] = n
    index[1::7] = -3
    index = index.to(index_dtype)
    for _ in range(2):  # and again: the same bits
        got = ep.gather_rows_triton(src, index, block_r=block_r, block_d=block_d)
        want = ep.gather_rows_reference(src, index)
        assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape)
        assert torch.equal(got.view(m, -1).view(torch.uint8) if got.numel() else got,
                           want.view(m, -1).view(torch.uint8) if want.numel() else want), (got, want)
        zero_rows = (index.long() < 0) | (index.long() >= n)
        assert bool((got[zero_rows] == 0).all())


def main() -> None:
    import json
    import os

    from tests.ops.triton._interp import run_cases

    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    torch.set_num_threads(1)
    from moe_compile.ops.triton import expert_parallel

    results = {"_interpreted": isinstance(expert_parallel._gather_rows_kernel, InterpretedFunction)}
    jobs = [(n, lambda c=c, n=n: _run_case(*c, seed=len(n))) for n, c in CASES.items()]
    print(json.dumps(run_cases(jobs, results)))


if __name__ == "__main__":
    main()
