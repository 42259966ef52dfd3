"""Grouped GEMM Triton kernels (plain, MXFP8, NVFP4, wgrad) under TRITON_INTERPRET=1 vs the references.

The cases live in ``_grouped_mm_interp_worker.py`` and run in one fresh interpreter (the variable
must be set before ``triton`` is imported); each case is reported as its own test here.
"""

from __future__ import annotations

import pytest

from tests.ops.triton._grouped_mm_interp_worker import CASES
from tests.ops.triton._interp import run_worker


@pytest.fixture(scope="module")
def results() -> dict:
    return run_worker("_grouped_mm_interp_worker", timeout=600)


def test_all_kernels_interpreted(results):
    assert results["_kernels"] == [
        "_grouped_mm_decode_kernel",
        "_grouped_mm_kernel",
        "_grouped_mm_wgrad_kernel",
        "_splitk_reduce_kernel",
        "_zero_empty_groups_kernel",
        "_zero_rows_past_kernel",
    ]


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_case(results, case):
    assert results[case] == "ok", results[case]


# the expert-GEMM kernels' sm90 compile check stays in the default run; this one, as long, in the slow run
@pytest.mark.slow
def test_gpu_configs_compile_for_sm90():
    """The tile configs the CUDA launchers pick (bf16/fp16 dots included, which the interpreter never
    runs) lower to sm_90 cubins; needs Triton's NVIDIA backend, not a GPU."""
    pytest.importorskip("triton.backends.nvidia")
    results = run_worker("_grouped_mm_interp_worker", "--sm90", interpret=False, timeout=600)
    failed = {k: v for k, v in results.items() if v != "ok"}
    assert not failed and len(results) >= 8, failed
