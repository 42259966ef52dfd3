"""What every benchmark records beside its numbers: the device and versions, and the copy bandwidth.

The benchmarks' memory floors are bytes / :func:`copy_bandwidth` (a device-to-device copy of 1 GiB,
read + write), measured in the same run as the numbers they bound.
"""

from __future__ import annotations

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
