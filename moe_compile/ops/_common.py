"""Helpers shared by the dispatch ops: the static row bound and argument checks.

Shape suffixes used across ``moe_compile.ops``: ``T`` tokens, ``H`` hidden, ``E`` experts, ``K`` top-k,
``N = T*K`` routed rows, ``M`` the static padded row bound, ``I`` expert intermediate size.
"""

from __future__ import annotations

import functools
import os

import torch

from moe_compile.ops import _eager_launch

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
    if isinstance(align, bool) or not isinstance(align, int) or align not in SUPPORTED_ALIGNMENTS:
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


def check_bool(value: object, arg: str) -> None:
    """Raise ``TypeError`` unless ``value`` is a ``bool`` (``debug`` flags: a string like ``"false"`` is truthy)."""
    if not isinstance(value, bool):
        raise TypeError(f"{arg} must be a bool, got {value!r}")


def check_count(value: object, arg: str, low: int = 0) -> None:
    """Raise ``ValueError`` unless ``value`` is a plain ``int >= low`` (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{arg} must be an int >= {low}, got {value!r}")


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


def check_offsets(offs: torch.Tensor, num_rows: int, arg: str = "offs_E") -> None:
    """Host check (CPU tensors, not traced) of cumulative END offsets: non-decreasing, in ``[0, num_rows]``."""
    if offs.numel() == 0:
        return
    lo, hi = int(offs.min()), int(offs.max())
    if lo < 0 or hi > num_rows:
        raise ValueError(f"{arg} values must be in [0, {num_rows}] (rows), got min {lo}, max {hi}")
    if offs.numel() > 1 and bool((offs[1:] < offs[:-1]).any()):
        raise ValueError(f"{arg} must be non-decreasing (cumulative end offsets), got {offs.tolist()}")


def host_values(*tensors: torch.Tensor | None) -> bool:
    """Whether the tensors' values may be read on the host for argument checks: all on CPU and none traced."""
    return all(t is None or (t.device.type == "cpu" and not is_traced(t)) for t in tensors)


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


FAST = "fast"  # eager_fast_path: call the op's CUDA kernel directly
FAST_WITH_GRAD = "fast_with_grad"  # the same under the op's autograd formula (a plain autograd.Function)


def eager_fast_path(*tensors: torch.Tensor | None) -> str | None:
    """NOTE [eager fast path]: whether a public wrapper may call the op's CUDA kernels directly.

    The custom-op dispatcher costs tens of microseconds of Python per call (autograd wrapper,
    redispatch, aliasing check), comparable to the GPU time of a mid-sized dispatch; more with autograd.
    When nothing can observe the difference, the wrappers skip it: eager (not traced), plain ``torch.Tensor``
    inputs on CUDA, no dispatch or function mode, no functorch transform, no profiler (and the CUDA kernel not
    disabled through ``set_kernel_enabled``, checked by the callers). Returns ``FAST`` when no gradient is
    needed, ``FAST_WITH_GRAD`` when one is (the wrapper then applies an ``autograd.Function`` with the op's
    own autograd formula and backward kernels, once differentiable like the op), None otherwise: tracing,
    ``torch.compile``, fake tensors and subclasses go through ``torch.ops.moe.*``.
    """
    first = tensors[0]
    if type(first) is not torch.Tensor or not first.is_cuda:
        return None
    grad = False
    for t in tensors:
        if t is not None:
            if type(t) is not torch.Tensor:
                return None
            grad = grad or t.requires_grad
    if (
        torch.compiler.is_compiling()
        or torch._C._len_torch_dispatch_stack() > 0
        or torch._C._is_torch_function_mode_enabled()
        or torch._C._functorch.peek_interpreter_stack() is not None
        or torch.autograd._profiler_enabled()
    ):
        return None
    return FAST_WITH_GRAD if grad and torch.is_grad_enabled() else FAST


# ===== op construction =====

# NOTE [few library calls]: on CPU the references are traced into the compiled graph
# (NOTE [device-decomposed triton ops]), where each sort, search or scan is a library call with its own host cost
# (several us), while elementwise work fuses into one loop. So at small sizes the references use compares and sums
# instead (the same integers): up to this many compares replace one library call.
SMALL_COMPARES = 1 << 16


def count_at_most(sorted_values: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """int64: for each of ``queries``, how many of the ascending 1-D ``sorted_values`` are ``<=`` it
    (``torch.searchsorted(..., right=True)``); by compares at small sizes (NOTE [few library calls])."""
    if sorted_values.numel() * queries.numel() <= SMALL_COMPARES:
        return (sorted_values[None, :] <= queries[:, None]).sum(1)
    return torch.searchsorted(sorted_values, queries, right=True)

# Devices on which a dispatch op decomposes into its body when AOTAutograd traces it
# (NOTE [device-decomposed triton ops]).
DECOMPOSE_ON_DEVICES = frozenset({"cuda", "cpu"})


def is_traced(t: torch.Tensor) -> bool:
    """Whether ``t`` belongs to a trace (fake / functional tensors, or Dynamo compiling), so that Triton
    kernels must go through ``wrap_triton`` instead of launching directly."""
    return type(t) is not torch.Tensor or torch.compiler.is_compiling()


def dispatch_triton_op(name: str, fn, *, schema: str, fake):
    """Define ``name`` like ``torch.library.triton_op(name, mutates_args=())(fn)``, with an explicit schema
    and fake, and the body visible to the compiler only on ``DECOMPOSE_ON_DEVICES``.

    NOTE [device-decomposed triton ops]:
    ``torch.library.triton_op`` (i) runs ``fn`` as the op's kernel for every device with
    ``wrap_triton`` switched off, so kernels launch directly in eager; (ii) registers ``fn`` as the
    fake; (iii) under ``FunctionalTensorMode`` (AOTAutograd) replaces the op by ``fn``'s body, so that
    on CUDA Inductor sees ``triton_kernel_wrapper_functional`` nodes and launches the kernels from its
    own generated code, with no Python custom-op dispatch (host time per call). We do the same three things, with
    three differences:

    * the schema is the one given (``triton_op`` infers it from annotations, turning ``int`` into
      ``SymInt``; ``E`` and ``align`` stay plain ``int``: they size outputs and pick kernels);
    * the fake is ``fake`` (static shapes, no host reads; ``fn``'s CPU branch checks ids on the host);
    * the body is traced only for tensors on ``DECOMPOSE_ON_DEVICES``. On CPU that is the gather-only
      reference (no scatter, no atomic), which Inductor compiles with the rest of the graph: when the op
      stayed one node, Inductor called its Python kernel, about twice plain Inductor's time per call at
      T16 (benchmarks/results/host_cost.json). Elsewhere the op stays one node.
      ``torch._functorch.config.decompose_custom_triton_ops = False`` (torch.export sets it) keeps every dispatch op
      one node; the tests that read a rewrite's post-grad graph use it.

    ``fn`` branches on the device (static under fake tensors); its CUDA branch launches Triton through
    the launchers, which call ``wrap_triton`` when :func:`is_traced`.
    """
    from torch._library.triton import set_wrap_triton_enabled
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

    def backend_fn(*args, **kwargs):
        with set_wrap_triton_enabled(False):
            return fn(*args, **kwargs)

    backend_fn.__name__ = fn.__name__
    op = torch.library.custom_op(name, backend_fn, mutates_args=(), schema=schema)
    op.register_fake(fake)

    def functional_decomp(mode, func, types, args, kwargs):
        if any(not issubclass(t, FakeTensor) and t not in (torch.Tensor, FunctionalTensor) for t in types):
            return NotImplemented
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        if device.type not in DECOMPOSE_ON_DEVICES or _export_keeps_triton_ops():
            return mode.__torch_dispatch__(func, types, args, kwargs)
        with mode:
            return fn(*args, **kwargs)

    op.register_torch_dispatch(FunctionalTensorMode, functional_decomp)
    return op


def _export_keeps_triton_ops() -> bool:
    """``torch.export`` keeps custom triton ops as ops (PyTorch's note "Export custom triton op", in
    ``torch/_library/triton.py``)."""
    try:
        from torch.export._trace import custom_triton_ops_decomposition_disabled
    except ImportError:  # pragma: no cover - older torch
        return False
    return custom_triton_ops_decomposition_disabled()


@functools.lru_cache(maxsize=None)
def ttir_writes_follow_loads() -> bool:
    """Whether Inductor's ``wrap_triton`` mutation analysis counts a tensor as written when its loaded
    values feed a store address (torch 2.11; 2.13 stops at loads).
    NOTE [no load-derived store addresses on graph inputs] (moe_compile/ops/triton/dispatch.py). Unknown versions:
    assume it does (the safe side)."""
    import inspect

    try:
        from torch._higher_order_ops import triton_kernel_wrap

        return "skip_loads" not in inspect.getsource(triton_kernel_wrap)
    except (ImportError, OSError, TypeError):  # pragma: no cover - no source available
        return True


def unit_last_stride(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` (None stays None) with unit stride along its last dim, copied only when it has not: kernels that read
    rows as ``ptr + row * stride + col``, or a vector as ``ptr + i`` (a row weight ``probs[:, 0]`` is a strided
    view), need it."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def static_ints(*values) -> tuple[int, ...]:
    """Plain ints for launch parameters: symbolic sizes (``dynamic=True``, opcheck) are specialised here,
    since block sizes and grids are chosen from them (the launch plans are cached on plain ints)."""
    return tuple(int(v) for v in values)


try:  # Inductor's generated code allocates every buffer through this (no Python argument parsing)
    from torch._C._dynamo.guards import _empty_strided_cuda
except ImportError:  # pragma: no cover - other torch builds
    _empty_strided_cuda = None


def eager_cuda_allocator(t: torch.Tensor, traced: bool):
    """``alloc(shape, dtype)`` for a launcher's outputs on ``t``'s device: an uninitialised contiguous tensor.

    Eager on the current CUDA device it is Inductor's allocation entry point, about a third of ``torch.empty``'s
    host time (which parses its arguments in Python: microseconds per call, as much as a kernel
    launch); anywhere else (traced, other devices) it is ``torch.empty``.
    """
    device = t.device
    if traced or _empty_strided_cuda is None or device.type != "cuda" or device.index != torch.cuda.current_device():
        return lambda shape, dtype: torch.empty(shape, dtype=dtype, device=device)

    def alloc(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if len(shape) == 1:
            return _empty_strided_cuda(shape, (1,), dtype)
        if len(shape) == 2:
            return _empty_strided_cuda(shape, (shape[1], 1), dtype)
        return torch.empty(shape, dtype=dtype, device=device)

    return alloc


def launch_kernel(kernel, grid, *args, traced: bool, options: dict, record: list | None = None, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs, **options)``; under a trace, through ``wrap_triton``.

    ``options`` are Triton compile/launch options (``num_warps``, ``debug``, ``enable_fp_fusion``,
    ``launch_pdl``). Inductor compiles a wrapped kernel with its own options and takes only
    ``num_warps`` from the call, so a traced launch passes just that: device asserts stay on because
    Inductor compiles user kernels with ``debug`` set (the kernels gate them on a ``DEBUG`` constexpr),
    and fp contraction follows Inductor's default (see
    NOTE [expert-order gather-sum] (moe_compile/ops/unpad_unpermute.py)). Eager CUDA launches reuse the compiled kernel
    without re-binding the arguments (NOTE [cached eager launch] (moe_compile/ops/_eager_launch.py)) and append it to
    ``record`` (NOTE [replayed eager launches] (moe_compile/ops/_eager_launch.py)); other launches append ``None``.
    """
    if traced:
        from torch.library import wrap_triton

        wrap_triton(kernel)[grid](*args, **kwargs, num_warps=options["num_warps"])
    elif args and isinstance(args[0], torch.Tensor) and args[0].is_cuda:
        _eager_launch.launch(kernel, grid, args, {**kwargs, **options}, record)
        return
    else:
        kernel[grid](*args, **kwargs, **options)
    if record is not None:
        record.append(None)
