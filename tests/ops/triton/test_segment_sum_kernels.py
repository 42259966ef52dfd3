"""The ``moe.segment_sum`` Triton kernel on CPU tensors under ``TRITON_INTERPRET=1``, against the reference.

Run in a fresh subprocess (``_segment_sum_interp_worker.py``; ``_interp.py`` says why).
Floats within the derived summation bound (the kernel sums tiles as trees, the reference one entry at a
time), bitwise with ``BLOCK_J = 1`` and for integers; every case twice more, bitwise. ``moe.gather_segment_sum``'s
cases (gathered, weighted, masked, sorted keys) the same way.
"""

from __future__ import annotations

import pytest

from ._interp import run_worker
from ._segment_sum_interp_worker import CASES, DEBUG_CASES, GATHER_CASES, SEQUENTIAL_CASES


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    return run_worker("_segment_sum_interp_worker", timeout=900)


def test_kernel_is_interpreted(interpreter_results):
    assert interpreter_results["_interpreted"] is True


@pytest.mark.parametrize("case", sorted(CASES) + sorted(SEQUENTIAL_CASES) + list(DEBUG_CASES) + sorted(GATHER_CASES))
def test_kernel_case(interpreter_results, case):
    assert interpreter_results[case] == "ok", interpreter_results[case]
