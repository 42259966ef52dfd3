"""The ``moe.segment_sum`` Triton kernel on CPU tensors under ``TRITON_INTERPRET=1``, against the reference.

Run in a fresh subprocess (``_segment_sum_interp_worker.py``; see ``test_dispatch_kernels.py`` for why).
Floats within the derived summation bound (the kernel sums tiles as trees, the reference one entry at a
time), bitwise with ``BLOCK_J = 1`` and for integers; every case twice more, bitwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ._segment_sum_interp_worker import CASES, DEBUG_CASES, SEQUENTIAL_CASES

WORKER = Path(__file__).with_name("_segment_sum_interp_worker.py")
REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "tests.ops.triton._segment_sum_interp_worker"], env=env, capture_output=True,
        text=True, timeout=900, cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, f"interpreter worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_kernel_is_interpreted(interpreter_results):
    assert interpreter_results["_interpreted"] is True


@pytest.mark.parametrize("case", sorted(CASES) + sorted(SEQUENTIAL_CASES) + list(DEBUG_CASES))
def test_kernel_case(interpreter_results, case):
    assert interpreter_results[case] == "ok", interpreter_results[case]
