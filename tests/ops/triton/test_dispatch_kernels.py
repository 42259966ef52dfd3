"""Every dispatch Triton kernel on CPU tensors under ``TRITON_INTERPRET=1``, against the PyTorch references.

The variable must be set before ``triton`` is first imported, and setting it in this pytest process would
also turn every other Triton kernel (Inductor's included) into the interpreter on a GPU machine. So the
kernels run in one fresh subprocess (``_dispatch_interp_worker.py``) and each case is reported here as its
own test. Data movement is compared bitwise; see the worker for the one bf16 rounding exception.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ._dispatch_interp_worker import CASES, DEBUG_CASES, INDEX_LOOP_CASES, LAUNCH_COUNTS

WORKER = Path(__file__).with_name("_dispatch_interp_worker.py")
REPO_ROOT = Path(__file__).resolve().parents[3]
KERNELS = (
    "_expert_offsets_kernel",
    "_mark_used_rows_kernel",
    "_permute_rows_kernel",
    "_unpermute_backward_kernel",
    "_unpermute_rows_kernel",
)


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(WORKER)], env=env, capture_output=True, text=True, timeout=900, cwd=REPO_ROOT
    )
    assert proc.returncode == 0, f"interpreter worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_all_kernels_are_interpreted_and_covered(interpreter_results):
    # the worker asserts each kernel is an InterpretedFunction; here: the list is the one we cover
    assert tuple(interpreter_results["_kernels"]) == KERNELS


def test_launches_per_op(interpreter_results):
    # issue 14: permute_pad is two launches (index kernel, permute); the others as listed
    assert interpreter_results["_launches"] == LAUNCH_COUNTS


@pytest.mark.parametrize("case", sorted(CASES) + list(DEBUG_CASES) + list(INDEX_LOOP_CASES))
def test_kernel_case(interpreter_results, case):
    assert interpreter_results[case] == "ok", interpreter_results[case]
