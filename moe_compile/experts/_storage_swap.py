"""Swap the memory of two storages in place: ``UntypedStorage._swap_data_ptr_`` where torch has it.

Used by NOTE [recycled gradient views] (moe_compile/experts/_grad_views.py). Torch 2.13 binds
``c10::StorageImpl::swap_data_ptr`` to Python; torch 2.11 does not, but its ``StorageImpl`` has the public
``set_data_ptr`` / ``set_nbytes`` the swap is made of.

NOTE [storage swap shim]: on a torch without the binding, the function below (C++, a dozen lines, only c10
headers) is compiled once with the host's C++ compiler against the installed torch's headers, as Triton and
Inductor compile their launchers, into a cache directory keyed by the torch version and the source, and called
through ``ctypes`` on the storages' ``_cdata`` (their ``StorageImpl*``). It swaps what torch's swap swaps that a
gradient's storage can differ in: the data pointer (its deleter travels with it, so each block is freed by the
allocator that made it) and the size in bytes. It refuses (returns non-zero) storages of different devices or
allocators, and sizes that differ unless one is 0, as torch's does. No compiler, or a failed build:
:func:`storage_swapper` returns None, logs why once, and callers do without. ``MOE_COMPILE_STORAGE_SHIM=0``
turns the shim off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable

import torch

from moe_compile.config import env_setting

log = logging.getLogger(__name__)

Swapper = Callable[[torch.UntypedStorage, torch.UntypedStorage], None]

_SOURCE = r"""
#include <c10/core/StorageImpl.h>
#include <utility>

extern "C" int moe_compile_swap_storage_data(void* a, void* b) {
  auto* sa = static_cast<c10::StorageImpl*>(a);
  auto* sb = static_cast<c10::StorageImpl*>(b);
  if (sa->device() != sb->device()) return 1;
  if (sa->allocator() != sb->allocator()) return 2;
  const size_t na = sa->nbytes(), nb = sb->nbytes();
  if (na != nb && na != 0 && nb != 0) return 3;
  c10::DataPtr from_a = sa->set_data_ptr(c10::DataPtr(nullptr, sa->device()));
  sa->set_data_ptr_noswap(sb->set_data_ptr(std::move(from_a)));
  sa->set_nbytes(nb);
  sb->set_nbytes(na);
  return 0;
}
"""

_REFUSED = {1: "different devices", 2: "different allocators", 3: "different sizes, neither 0"}


@functools.cache
def storage_swapper() -> Swapper | None:
    """``swap(a, b)``: ``a`` and ``b`` exchange their memory (and sizes); every tensor on either sees the other's.
    Torch's own binding if it has one, else the shim (NOTE [storage swap shim]); None when neither is at hand."""
    native = torch_swapper()
    if native is not None:
        return native
    if not env_setting("storage_shim"):
        return None
    return shim_swapper()


def torch_swapper() -> Swapper | None:
    """Torch's binding (torch >= 2.12), if this torch has it."""
    return getattr(torch.UntypedStorage, "_swap_data_ptr_", None)


@functools.cache
def shim_swapper() -> Swapper | None:
    """The compiled shim (NOTE [storage swap shim]), whatever torch binds; None if it cannot be built or loaded."""
    try:
        function = _load(_build())
    except (OSError, subprocess.SubprocessError, RuntimeError) as err:
        log.warning("moe_compile: gradient views are not recycled: the storage swap shim did not build (%s)", err)
        return None

    def swap(a: torch.UntypedStorage, b: torch.UntypedStorage) -> None:
        status = function(a._cdata, b._cdata)
        if status:
            raise RuntimeError(f"storage swap refused: {_REFUSED.get(status, status)}")

    return swap


def _cache_dir() -> pathlib.Path:
    root = env_setting("cache_dir") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "moe_compile")
    return pathlib.Path(root)


def _build() -> pathlib.Path:
    """The shim's shared library, built into the cache directory unless it is there already."""
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    key = hashlib.sha256(f"{_SOURCE}{torch.__version__}{abi}{sys.platform}".encode()).hexdigest()[:16]
    target = _cache_dir() / f"storage_swap_{key}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (set CXX)")
    target.parent.mkdir(parents=True, exist_ok=True)
    torch_lib = pathlib.Path(torch.__file__).parent / "lib"
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        source, built = pathlib.Path(tmp) / "storage_swap.cpp", pathlib.Path(tmp) / "storage_swap.so"
        source.write_text(_SOURCE)
        include = [f"-I{path}" for path in cpp_extension.include_paths()]
        cmd = [compiler, "-O2", "-shared", "-fPIC", "-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *include,
               str(source), "-o", str(built), f"-L{torch_lib}", "-lc10"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-400:]}")
        os.replace(built, target)  # atomic: a concurrent build of the same key writes the same file
    return target


def _load(path: pathlib.Path):
    function = ctypes.CDLL(str(path)).moe_compile_swap_storage_data
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    function.restype = ctypes.c_int
    return function
