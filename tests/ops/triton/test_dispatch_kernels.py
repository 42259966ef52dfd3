"""Every dispatch Triton kernel on CPU tensors under ``TRITON_INTERPRET=1``, against the PyTorch references.

The kernels run in one fresh subprocess (``_dispatch_interp_worker.py``; ``_interp.py`` says why) and each case is
reported here as its own test. Data movement is compared bitwise; see the worker for the one bf16 rounding exception.
"""

from __future__ import annotations

import pytest

from ._dispatch_interp_worker import (
    CASES,
    DEBUG_CASES,
    INDEX_LOOP_CASES,
    LAUNCH_COUNTS,
    POISON_CASES,
    SLOW_POISON_CASES,
)
from ._interp import run_worker

KERNELS = (
    "_block_histogram_kernel",
    "_expert_offsets_kernel",
    "_mark_used_rows_kernel",
    "_permute_rows_kernel",
    "_unpermute_backward_kernel",
    "_unpermute_rows_kernel",
)


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    return run_worker("_dispatch_interp_worker", timeout=900)


def test_all_kernels_are_interpreted_and_covered(interpreter_results):
    # the worker asserts each kernel is an InterpretedFunction; here: the list is the one we cover
    assert tuple(interpreter_results["_kernels"]) == KERNELS


def test_launches_per_op(interpreter_results):
    # issue 14: permute_pad is two launches (index kernel, permute) below PARALLEL_HISTOGRAM_BLOCKS; the others as
    # listed
    assert interpreter_results["_launches"] == LAUNCH_COUNTS


@pytest.mark.parametrize(
    "case",
    sorted(CASES) + list(DEBUG_CASES) + list(INDEX_LOOP_CASES) + ["eager_autograd_function"]
    + [name for name in POISON_CASES if name not in SLOW_POISON_CASES],
)
def test_kernel_case(interpreter_results, case):
    assert interpreter_results[case] == "ok", interpreter_results[case]


@pytest.fixture(scope="module")
def slow_interpreter_results() -> dict:
    return run_worker("_dispatch_interp_worker", "slow", timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_POISON_CASES)
def test_slow_kernel_case(slow_interpreter_results, case):
    assert slow_interpreter_results[case] == "ok", slow_interpreter_results[case]
