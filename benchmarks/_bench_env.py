"""What every benchmark records beside its numbers (:func:`device_env`: device, versions, commit, date, command)
and where it writes them (:func:`write_results`); the copy bandwidth; and how the host-cost benchmarks time
back-to-back calls (:func:`timed_calls`).

Every results file has one shape, ``{"env": {...}, "rows": [...]}``: ``env`` holds at least :data:`ENV_KEYS`
(``None`` where a run did not record one) and whatever the benchmark adds (copy bandwidth, wall time, targets);
``rows`` holds one flat dict per measured configuration and variant (values are numbers, strings, booleans,
``None`` or lists of those). A benchmark writes ``benchmarks/results/<benchmark>[_<configuration>].json`` and
overwrites it on each run: git keeps the history, and each file says which commit it measured.

The benchmarks' memory floors are bytes / :func:`copy_bandwidth` (a device-to-device copy of 1 GiB,
read + write), measured in the same run as the numbers they bound.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import pathlib
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
# what every results file's env records; "dirty": uncommitted changes to tracked files when it ran
ENV_KEYS = ("device", "torch", "triton", "commit", "dirty", "date", "command")


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), median of a 1 GiB copy."""
    from triton.testing import do_bench

    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=50, return_mode="median")
    return 2 * 2**30 / (ms * 1e-3)


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_state() -> tuple[str | None, bool | None]:
    """(commit, dirty) of the checkout the benchmark runs from. ``$BENCH_COMMIT`` wins where it is set (dirty is
    then unknown): a device machine gets a copy of the working tree whose ``.git``, if any, can be an older
    commit than the tree it carries."""
    if os.environ.get("BENCH_COMMIT"):
        commit = os.environ["BENCH_COMMIT"]
        if not re.fullmatch(r"[0-9a-f]{40}", commit):  # the results schema (tests/test_benchmarks.py) wants it whole
            raise ValueError(f"BENCH_COMMIT={commit!r}: give the full 40-digit hash (git rev-parse HEAD)")
        return commit, None
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        return None, None
    status = _git("status", "--porcelain", "--untracked-files=no")
    return commit, None if status is None else bool(status)


def device_env(device: str | None = None, **extra: Any) -> dict[str, Any]:
    """``{"device", "torch", "triton", "commit", "dirty", "date", "command", **extra}`` for a results file:
    the CUDA device's name (``device`` overrides it, e.g. for a CPU smoke run), the versions, the commit and
    whether tracked files differed from it, the UTC date and the command line."""
    import triton

    if device is None:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    commit, dirty = git_state()
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    command = shlex.join(getattr(sys, "orig_argv", sys.argv))
    return {"device": device, "torch": torch.__version__, "triton": triton.__version__, "commit": commit,
            "dirty": dirty, "date": date, "command": command, **extra}


def add_results_args(parser: argparse.ArgumentParser) -> None:
    """The options every benchmark takes for its results file (:func:`write_results`)."""
    parser.add_argument("--save", action="store_true",
                        help="write benchmarks/results/<benchmark>[_<configuration>].json (overwritten)")
    parser.add_argument("--results-dir", type=pathlib.Path, default=RESULTS_DIR,
                        help="folder for --save (default benchmarks/results)")
    parser.add_argument("--tag", default=None,
                        help="configuration name appended to the file name, for a run that is not the default one")


def results_name(benchmark: str, *configuration: str | None) -> str:
    """``<benchmark>[_<configuration>...]``: the stem of a results file."""
    return "_".join([benchmark, *(c for c in configuration if c)])


def results_path(args: argparse.Namespace, benchmark: str, configuration: str | None = None) -> pathlib.Path:
    """Where :func:`write_results` puts this run's file, from the options of :func:`add_results_args`."""
    return args.results_dir / f"{results_name(benchmark, configuration, args.tag)}.json"


def _check_flat(rows: list[dict[str, Any]]) -> None:
    scalar = (str, int, float, bool, type(None))
    for row in rows:
        for key, value in row.items():
            items = value if isinstance(value, (list, tuple)) else [value]
            if not all(isinstance(v, scalar) for v in items):
                raise TypeError(f"results row field {key!r} is not flat: {value!r}")


def write_results(path: pathlib.Path, rows: list[dict[str, Any]], env: dict[str, Any]) -> pathlib.Path:
    """Write ``{"env": env, "rows": rows}`` to ``path`` (:func:`results_path`), replacing what was there."""
    missing = [k for k in ENV_KEYS if k not in env]
    if missing:
        raise ValueError(f"env lacks {missing}")
    _check_flat(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"env": env, "rows": rows}, indent=1) + "\n")
    print(f"results: {path}")
    return path


def read_rows(path: pathlib.Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(env, rows) of a results file; ``({}, [])`` when there is none."""
    if not path.exists():
        return {}, []
    data = json.loads(path.read_text())
    return data.get("env", {}), data.get("rows", [])


def sync(device: str) -> None:
    """Wait for the GPU (nothing on CPU)."""
    if device == "cuda":
        torch.cuda.synchronize()


def measured_mm_tflops(device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> float:
    """This device's dense matmul rate in TFLOP/s: one square GEMM in ``dtype`` (8192 on CUDA, timed by
    ``triton.testing.do_bench``; 512 on CPU, median of 5 calls). The divisor of the benchmarks' FLOP floors."""
    n = 8192 if device == "cuda" else 512
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    if device == "cuda":
        import triton.testing

        ms = triton.testing.do_bench(lambda: a @ b, warmup=10, rep=50)
    else:
        times = []
        for _ in range(6):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        ms = statistics.median(times[1:]) * 1e3
    return 2 * n**3 / (ms * 1e-3) / 1e12


def timed_calls(step: Callable[[], object], device: str, calls: int) -> tuple[float, float, float]:
    """(wall, issue, host CPU) microseconds per call over ``calls`` back-to-back calls, one synchronisation at
    the end. Host CPU is the process's CPU time while issuing (every thread: the autograd engine's included);
    unlike wall time it does not grow when the shared machine takes the core away. The garbage collector is off
    while timing, as in ``timeit``."""
    sync(device)
    gc.collect()
    gc.disable()
    try:
        cpu_start = time.process_time()
        start = time.perf_counter()
        for _ in range(calls):
            step()
        issued = time.perf_counter()
        cpu = time.process_time() - cpu_start
        sync(device)
        end = time.perf_counter()
    finally:
        gc.enable()
    return (end - start) / calls * 1e6, (issued - start) / calls * 1e6, cpu / calls * 1e6
