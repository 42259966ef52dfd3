"""The ``moe.masked_attention`` Triton kernels on CPU tensors under ``TRITON_INTERPRET=1``, against an fp64 SDPA.

Run in a fresh subprocess (``_masked_attention_interp_worker.py``; ``_interp.py`` says why). Output and gradients
within eager's own distance from fp64 (torch's SDPA in the case's dtype); GQA/MQA, MLA head dims, bool and float
masks broadcast over batch or heads; rows the mask allows nothing in exactly zero; every case twice more, bitwise.
"""

from __future__ import annotations

import pytest

from ._interp import run_worker
from ._masked_attention_interp_worker import CASES, EXTRA_CASES


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    return run_worker("_masked_attention_interp_worker", timeout=900)


def test_kernel_is_interpreted(interpreter_results):
    assert interpreter_results["_interpreted"] is True


@pytest.mark.parametrize("case", sorted(CASES) + list(EXTRA_CASES))
def test_kernel_case(interpreter_results, case):
    assert interpreter_results[case] == "ok", interpreter_results[case]
