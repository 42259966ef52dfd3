"""Expert-GEMM Triton kernels (persistent; gather, gated epilogue, row weight, TMA, MXFP8/NVFP4, wgrad)
under TRITON_INTERPRET=1 vs the PyTorch reference, and their CUDA launch configs compiled for sm_90.

The cases live in ``_expert_gemm_interp_worker.py`` and run in one fresh interpreter (the variable must be
set before ``triton`` is imported); each case is reported as its own test here.
"""

from __future__ import annotations

import pytest

from tests.ops.triton._expert_gemm_interp_worker import CASES
from tests.ops.triton._interp import run_worker


@pytest.fixture(scope="module")
def results() -> dict:
    return run_worker("_expert_gemm_interp_worker", timeout=600)


def test_all_kernels_interpreted(results):
    assert results["_kernels"] == [
        "_epilogue_backward_kernel", "_epilogue_kernel", "_expert_gemm_kernel", "_expert_wgrad_kernel",
        "_row_scale_backward_kernel", "_source_rows_kernel",
    ]


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_case(results, case):
    assert results[case] == "ok", results[case]


# ~90 s on the 2-core CI: in the slow run (the GPU tests, tests/ops/test_expert_gemm_gpu.py, run the kernels)
@pytest.mark.slow
def test_gpu_configs_compile_for_sm90():
    """Every CUDA launch config of the benchmark shapes (bf16 dots, TMA descriptors, NVFP4 PTX decode,
    which the interpreter never runs) lowers to an sm_90 cubin; needs Triton's NVIDIA backend, not a GPU."""
    pytest.importorskip("triton.backends.nvidia")
    results = run_worker("_expert_gemm_interp_worker", "--sm90", interpret=False, timeout=900)
    failed = {k: v for k, v in results.items() if v != "ok"}
    assert not failed and len(results) >= 25, failed
