"""Eager CUDA launches of Triton kernels without ``JITFunction.run``'s per-call binding.

NOTE [cached eager launch]: ``kernel[grid](*args)`` binds and specialises every argument in Python on every
call (``binder``, the cache key, the current device and stream), on the order of ten microseconds per launch
(triton 3.6; benchmarks/results/host_cost.json), as much as a small kernel runs. Inductor avoids this with its
static launcher; the dispatch ops' eager calls (the public wrappers, the ops under autograd) went through
``JITFunction.run``. Here the first launch of a kernel for a given specialisation goes through
``JITFunction.run`` (which compiles or finds the kernel) and the ``CompiledKernel`` it returns is kept under a
key at least as fine as Triton's own:

* a tensor: its dtype and whether its address is a multiple of 16 (Triton's pointer specialisation);
* an int: ``== 1``, ``% 16 == 0`` and whether it fits int32 / int64 (Triton's integer specialisation and
  its argument type); a bool, a float or ``None``: its type (a bool's value too);
* a ``tl.constexpr`` parameter and every keyword argument (constexprs, ``num_warps``, ``debug``,
  ``launch_pdl``...): its value.

Later launches with the same key call the compiled kernel's launcher directly, with the arguments in the
signature's order, as ``JITFunction.run`` does, except that a tensor is passed as its address (an int): for a
tensor the launcher calls ``data_ptr()`` and asks the driver whether the address is a device pointer
(``cuPointerGetAttribute``), about a microsecond per tensor argument, while an int it takes as is. That check is
the launcher's only guard against a CPU tensor or a tensor of another device; here every tensor argument must
be a CUDA tensor of the current device, and a launch where one is not takes Triton's path (which raises or
launches as it always did). Not cached (the plain path every time): kernels that are not
plain ``JITFunction`` objects (the interpreter, autotuners), launches while Triton launch hooks are set (a
profiler), and anything whose key cannot be hashed. Kernels launched this way must not read mutable Python
globals (``JITFunction.run`` re-checks those per call; none of ours do). ``MOE_COMPILE_CACHED_LAUNCH=0`` turns
it off.

NOTE [replayed eager launches]: even a cached launch spends microseconds building its key (every argument's
specialisation) and the caller as much again building keyword arguments, for each of an op's launches. A
launcher that knows what its launches depend on keeps a :class:`Replays` under a :func:`replay_key`: one that
fixes every launch's grid, keyword arguments, integer arguments and tensor dtypes, and the 16-byte alignment of
every tensor argument it did not allocate itself (its own outputs come from the caching allocator). The first
call with a key launches as above and records the compiled kernels; later calls replay them with the tensors'
addresses, one list comprehension per launch. A replay runs only where a cached launch would (cache on, no
launch hooks, the launcher's device current) and only when every launch of the recorded call was cached.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch

from moe_compile.config import env_setting

ENABLED: bool = env_setting("cached_launch")  # MOE_COMPILE_CACHED_LAUNCH, read at import

_INT32 = (-(2**31), 2**31)
_INT64 = (-(2**63), 2**63)


class _KernelLaunches:
    """Per kernel: its parameters (names, which are constexpr, defaults) and the compiled kernels by key."""

    def __init__(self, kernel) -> None:
        params = kernel.params
        self.names = tuple(p.name for p in params)
        self.constexpr = tuple(bool(p.is_constexpr) for p in params)
        self.defaults = {p.name: p.default for p in params if p.has_default}
        self.first_constexpr = next((i for i, c in enumerate(self.constexpr) if c), len(params))
        self.compiled: dict[tuple, tuple] = {}  # key -> (launcher, function, packed metadata, trailing args)


_LAUNCHES: dict[Any, _KernelLaunches | None] = {}
_runtime = None  # (triton.knobs.runtime, driver.active), bound on first use


def arg_key(arg: Any, constexpr: bool) -> Any:
    """The part of the launch key for one positional argument (see NOTE [cached eager launch])."""
    if constexpr:
        return ("c", arg)
    kind = type(arg)
    if kind is int:
        if _INT32[0] <= arg < _INT32[1]:  # the common case, as one small int: == 1, % 16 == 0, else
            return 1 if arg == 1 else -16 if arg % 16 == 0 else -1
        return ("i", arg % 16 == 0, _INT64[0] <= arg < _INT64[1])
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if kind is bool:
        return ("b", arg)
    if kind is float:
        return "f"
    if arg is None:
        return None
    return ("v", kind, arg)  # anything else by value (raises TypeError when unhashable: not cached)


def key_and_pointers(
    launches: _KernelLaunches, device: int, args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[tuple, list[Any] | None]:
    """The cache key of one launch (device, every positional argument's :func:`arg_key`, the keywords) and
    ``args`` with every tensor replaced by its address (None when a tensor is not on CUDA ``device``)."""
    if len(args) > launches.first_constexpr:  # a constexpr passed by position (ours pass them by keyword)
        keys = tuple(map(arg_key, args, launches.constexpr))
        on_device = all(a.get_device() == device for a in args if isinstance(a, torch.Tensor))
        pointers = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args] if on_device else None
        return (device, keys, tuple(kwargs.items())), pointers
    keys, pointers, on_device = [], [], True
    for arg in args:  # (hot: most of a cached launch's Python; the int32 case is arg_key's, inlined)
        if type(arg) is int and -2147483648 <= arg < 2147483648:
            keys.append(1 if arg == 1 else -16 if arg % 16 == 0 else -1)
            pointers.append(arg)
        elif isinstance(arg, torch.Tensor):
            address = arg.data_ptr()
            keys.append((arg.dtype, address % 16 == 0))
            if arg.get_device() != device:  # (-1 for a CPU tensor)
                on_device = False
            pointers.append(address)
        else:
            keys.append(arg_key(arg, False))
            pointers.append(arg)
    return (device, tuple(keys), tuple(kwargs.items())), (pointers if on_device else None)


def _no_hook(hook: Any) -> bool:
    # Triton >= 3.5 keeps launch hooks in a ``HookChain``, empty unless something (a profiler) added one
    return hook is None or (isinstance(getattr(hook, "calls", None), list) and not hook.calls)


def _launches_of(kernel) -> _KernelLaunches | None:
    try:
        return _LAUNCHES[kernel]
    except KeyError:
        from triton.runtime.jit import JITFunction

        launches = _KernelLaunches(kernel) if type(kernel) is JITFunction else None
        _LAUNCHES[kernel] = launches
        return launches


def _unhooked_driver() -> Any | None:
    """Triton's active driver, or None while launch hooks are set (a profiler): launches then take Triton's path."""
    global _runtime
    if _runtime is None:
        from triton import knobs
        from triton.runtime import driver

        _runtime = (knobs.runtime, driver.active)
    runtime, driver = _runtime
    return driver if _no_hook(runtime.launch_enter_hook) and _no_hook(runtime.launch_exit_hook) else None


def launch(
    kernel, grid: tuple[int, ...], args: Sequence[Any], kwargs: dict[str, Any], record: list | None = None
) -> None:
    """``kernel[grid](*args, **kwargs)`` on CUDA tensors, through the cached compiled kernel when there is one.

    ``record`` (NOTE [replayed eager launches]): the launch is appended to it, as what :func:`replay` needs, or
    ``None`` when it went through Triton's own path.
    """
    launches = _launches_of(kernel) if ENABLED else None
    if launches is None:
        kernel[grid](*args, **kwargs)
        _append(record, None)
        return
    driver = _unhooked_driver()
    if driver is None:
        kernel[grid](*args, **kwargs)
        _append(record, None)
        return
    device = driver.get_current_device()
    try:
        key, pointers = key_and_pointers(launches, device, args, kwargs)
        compiled = launches.compiled.get(key)
    except TypeError:  # an unhashable argument: Triton's own path
        kernel[grid](*args, **kwargs)
        _append(record, None)
        return
    grid_3 = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
    if compiled is None or pointers is None:  # (a tensor off the current CUDA device: Triton checks it)
        launched = kernel[grid](*args, **kwargs)
        if pointers is not None and hasattr(launched, "packed_metadata") and hasattr(launched, "function"):
            # the arguments after the positional ones (constexprs, defaults) are fixed by the key
            tail = tuple(kwargs[n] if n in kwargs else launches.defaults[n] for n in launches.names[len(args):])
            compiled = launches.compiled[key] = (launched.run, launched.function, launched.packed_metadata, tail)
            _append(record, (*compiled, *grid_3))
        else:
            _append(record, None)
        return
    run, function, metadata, tail = compiled
    run(*grid_3, driver.get_current_stream(device), function, metadata, None, None, None, *pointers, *tail)
    _append(record, (*compiled, *grid_3))


def _append(record: list | None, launch: tuple | None) -> None:
    if record is not None:
        record.append(launch)


class Replays:
    """Recorded launches of one launcher by its key (NOTE [replayed eager launches])."""

    def __init__(self, max_keys: int = 1024) -> None:
        self.max_keys = max_keys  # keys hold shapes: a launcher called with ever new shapes starts over
        self.recorded: dict[Hashable, tuple[tuple, ...]] = {}

    def get(self, key: Hashable, device: int) -> tuple[tuple[tuple, ...], int] | None:
        """``(launches, stream)`` to :func:`replay` for ``key`` on CUDA ``device``, or None: take the full path."""
        launches = self.recorded.get(key)
        if launches is None or not ENABLED:
            return None
        driver = _unhooked_driver()
        if driver is None or driver.get_current_device() != device:
            return None
        return launches, driver.get_current_stream(device)

    def keep(self, key: Hashable, record: list, count: int) -> None:
        """Keep ``record`` (filled by ``count`` launches of one call) under ``key`` when every launch was cached."""
        if len(record) == count and all(r is not None for r in record):
            if len(self.recorded) >= self.max_keys:
                self.recorded.clear()
            self.recorded[key] = tuple(record)


def replay_key(sizes: Hashable, *tensors: torch.Tensor | None) -> tuple:
    """A launcher's replay key: the first tensor's device (compiled kernels are per device), ``sizes`` (its sizes,
    strides and flags: whatever fixes the grids, the integer arguments and the keyword arguments) and the dtype
    and address modulo 16 of each tensor it was given (None for an absent one). Triton specialises pointers on
    16-byte alignment; outputs the launcher allocates are aligned."""
    return (
        tensors[0].get_device(),
        sizes,
        tuple([t.dtype if t is not None else None for t in tensors]),
        tuple([t.data_ptr() & 15 if t is not None else -1 for t in tensors]),
    )


def replay(launches: tuple[tuple, ...], stream: int, *arg_lists: Sequence[Any]) -> None:
    """Launch each recorded kernel with its positional arguments (tensors passed as their addresses)."""
    for (run, function, metadata, tail, g0, g1, g2), args in zip(launches, arg_lists, strict=True):
        pointers = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
        run(g0, g1, g2, stream, function, metadata, None, None, None, *pointers, *tail)


def cached_kernels(kernel) -> int:
    """How many compiled specialisations of ``kernel`` the cache holds (tests)."""
    launches = _LAUNCHES.get(kernel)
    return len(launches.compiled) if launches is not None else 0
