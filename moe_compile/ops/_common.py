"""Helpers shared by the dispatch ops: the static row bound and argument checks.

Shape suffixes used across ``moe_compile.ops``: ``T`` tokens, ``H`` hidden, ``E`` experts, ``K`` top-k,
``N = T*K`` routed rows, ``M`` the static padded row bound, ``I`` expert intermediate size.
"""

from __future__ import annotations

import functools
import os

import torch

SUPPORTED_ALIGNMENTS = (1, 8, 16, 32, 64, 128, 256)


def static_row_bound(num_routed: int, num_experts: int, align: int) -> int:
    """Rows of the padded permuted buffer: ``floor((N + E*(a-1)) / a) * a`` (``N`` when ``a == 1``).

    Tight worst case (TransformerEngine-JAX): every expert's segment is rounded up to a multiple of
    ``a`` and at most ``min(E, N)`` experts are non-empty, so ``E`` could be ``min(E, N)``; we keep
    ``E`` as the contract states it. Works with SymInts.
    """
    if align == 1:
        return num_routed
    return (num_routed + num_experts * (align - 1)) // align * align


def check_alignment(align: int, arg: str = "align") -> None:
    if not isinstance(align, int) or align not in SUPPORTED_ALIGNMENTS:
        raise ValueError(f"{arg}={align!r} is not supported; use one of {SUPPORTED_ALIGNMENTS}")


FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
FLOAT_DTYPE_SET = frozenset(FLOAT_DTYPES)  # for the wrappers' fast argument checks
# every integer dtype (what ``check_int_tensor`` accepts without a ``dtypes`` list); for fast checks
INT_DTYPES = frozenset(
    d
    for d in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
    + tuple(getattr(torch, name) for name in ("uint16", "uint32", "uint64") if hasattr(torch, name))
)


def next_power_of_2(n: int) -> int:
    """Smallest power of two ``>= max(n, 1)``."""
    return 1 << max(int(n) - 1, 0).bit_length()


def check_float_tensor(t: torch.Tensor, arg: str, ndim: int) -> None:
    """Raise ``ValueError`` unless ``t`` is a ``ndim``-D tensor of a supported floating dtype.

    bf16/fp16/fp32 are the supported activation dtypes; fp64 is accepted too (for ``gradcheck``).
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{arg} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{arg} must have dtype bfloat16, float16 or float32 (float64 for gradcheck), got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{arg} must be {ndim}-D, got shape {tuple(t.shape)}")


def check_int_tensor(t: torch.Tensor, arg: str, ndim: int, dtypes: tuple[torch.dtype, ...] | None = None) -> None:
    """Raise ``ValueError`` unless ``t`` is a ``ndim``-D integer tensor (of one of ``dtypes`` if given)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{arg} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{arg} must have dtype in {dtypes}, got {t.dtype}")
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise ValueError(f"{arg} must have an integer dtype, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{arg} must be {ndim}-D, got shape {tuple(t.shape)}")


def check_same_device(**tensors: torch.Tensor | None) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")


def check_ids_in_range(ids: torch.Tensor, low: int, high: int, arg: str) -> None:
    """Host-side range check ``low <= ids < high`` (reads the values: use on CPU tensors only)."""
    if ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < low or hi >= high:
        raise ValueError(f"{arg} values must be in [{low}, {high}), got min {lo}, max {hi}")


@functools.lru_cache(maxsize=256)
def row_block(H: int, elem_size: int, max_bytes: int = 8192) -> tuple[int, int]:
    """``(BLOCK_H, num_warps)`` for kernels that stream one row slice per program.

    Up to ``max_bytes`` per program (8 KiB: two 16-byte vectors per thread at 8 warps), so each
    program has enough bytes in flight while short rows still get one program per row.
    """
    block = min(next_power_of_2(H), max(16, max_bytes // elem_size))
    return block, min(8, max(1, block * elem_size // 1024))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pdl_supported(device: torch.device) -> bool:
    """Whether the dispatch kernels may use programmatic dependent launch on ``device`` (CUDA, sm_90+,
    a Triton with ``launch_pdl`` and ``gdc_wait``; never under ``TRITON_INTERPRET=1``)."""
    return device.type == "cuda" and _pdl_supported_on(device.index)


@functools.lru_cache(maxsize=None)
def _pdl_supported_on(index: int | None) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions

        from moe_compile.ops.triton import dispatch
    except ImportError:
        return False
    if dispatch.gdc_wait is None or "launch_pdl" not in getattr(CUDAOptions, "__dataclass_fields__", {}):
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9


def use_eager_fast_path(*tensors: torch.Tensor | None) -> bool:
    """NOTE [eager fast path]: whether a public wrapper may call the op's CUDA kernel directly.

    The custom-op dispatcher costs 30-60 us of Python per call on an H200 host (autograd wrapper,
    redispatch, aliasing check), comparable to the GPU time of a mid-sized dispatch. When nothing can
    observe the difference, the wrappers skip it: eager (not traced), plain ``torch.Tensor`` inputs on
    CUDA, no gradient needed, no dispatch or function mode, no functorch transform, no profiler (and the
    CUDA kernel not disabled through ``set_kernel_enabled``, checked by the callers). Everything else
    (tracing, ``torch.compile``, fake tensors, subclasses, autograd) goes through ``torch.ops.moe.*``.
    """
    first = tensors[0]
    if type(first) is not torch.Tensor or not first.is_cuda:
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is not None and (type(t) is not torch.Tensor or (grad and t.requires_grad)):
            return False
    return not (
        torch.compiler.is_compiling()
        or torch._C._len_torch_dispatch_stack() > 0
        or torch._C._is_torch_function_mode_enabled()
        or torch._C._functorch.peek_interpreter_stack() is not None
        or torch.autograd._profiler_enabled()
    )
