"""Triton kernel cases in a fresh interpreter: the pytest side (:func:`run_worker`) and the worker side.

``TRITON_INTERPRET=1`` must be set before ``triton`` is first imported, and setting it in the pytest process
would also turn every other Triton kernel (Inductor's included) into the interpreter on a GPU machine. So each
kernel family's cases run in one subprocess, a worker module (``_<family>_interp_worker.py``) run with ``-m``
from the repository root, whose last output line is a JSON dict ``{case: "ok" | traceback, ...}``; the test
module reports each case as its own test. Standard library only: workers import this before torch.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import traceback
import types
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[3]


def run_worker(module: str, *args: str, interpret: bool = True, timeout: float = 900) -> dict[str, Any]:
    """Run ``tests.ops.triton.<module>`` (under the interpreter on CPU, or without it: ``--sm90`` compiles)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", f"tests.ops.triton.{module}", *args], env=env, capture_output=True, text=True,
        timeout=timeout, cwd=REPO_ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, f"{module} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_cases(jobs: Iterable[tuple[str, Callable[[], Any]]], results: dict[str, Any]) -> dict[str, Any]:
    """Worker side: ``results[name] = "ok"`` or the traceback, for each ``(name, job)``."""
    for name, job in jobs:
        try:
            job()
            results[name] = "ok"
        except Exception:  # noqa: BLE001 - the worker reports any failure to the parent test
            results[name] = traceback.format_exc()
    return results


def import_ops_only(*modules: str) -> list[types.ModuleType]:
    """Import ``moe_compile.ops.<module>`` without the package ``__init__`` files (which pull in Inductor)."""
    root = REPO_ROOT / "moe_compile"
    packages = {"moe_compile": root, "moe_compile.ops": root / "ops", "moe_compile.ops.triton": root / "ops" / "triton"}
    for name, path in packages.items():
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(path)]
            sys.modules[name] = package
    return [importlib.import_module(f"moe_compile.ops.{m}") for m in modules]


def compile_for_sm90(jobs: dict[str, tuple[Any, dict, dict, dict]]) -> dict[str, Any]:
    """Worker side: lower each ``name: (kernel, signature, constexprs, options)`` to an sm_90 cubin (Triton's
    NVIDIA backend; no GPU), for the paths the interpreter never runs (bf16 ``tl.dot``, TMA, inline PTX)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    return run_cases(
        [(name, lambda job=job: triton.compile(ASTSource(*job[:3]), target=target, options=job[3]))
         for name, job in jobs.items()], {},
    )  # fmt: skip
