"""The ``moe.gather_rows`` Triton kernel on CPU tensors under ``TRITON_INTERPRET=1``, against the PyTorch body.

Run in a fresh subprocess (``_expert_parallel_interp_worker.py``; ``_interp.py`` says why). A gather is a copy:
every case bitwise, twice, with out-of-range indices (zero rows) among the valid ones.
"""

from __future__ import annotations

import pytest

from ._expert_parallel_interp_worker import CASES
from ._interp import run_worker


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    return run_worker("_expert_parallel_interp_worker", timeout=600)


def test_kernel_is_interpreted(interpreter_results):
    assert interpreter_results["_interpreted"] is True


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_case(interpreter_results, case):
    assert interpreter_results[case] == "ok", interpreter_results[case]
