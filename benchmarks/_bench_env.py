"""What every benchmark records beside its numbers: the device and versions, and the copy bandwidth; and how the
host-cost benchmarks time back-to-back calls (:func:`timed_calls`).

The benchmarks' memory floors are bytes / :func:`copy_bandwidth` (a device-to-device copy of 1 GiB,
read + write), measured in the same run as the numbers they bound.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import torch


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), median of a 1 GiB copy."""
    from triton.testing import do_bench

    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=50, return_mode="median")
    return 2 * 2**30 / (ms * 1e-3)


def device_env(**extra: Any) -> dict[str, Any]:
    """``{"device", "torch", "triton", **extra}`` for a results JSON."""
    import triton

    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__, **extra}


def sync(device: str) -> None:
    """Wait for the GPU (nothing on CPU)."""
    if device == "cuda":
        torch.cuda.synchronize()


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
