"""Storages exchanging their memory in place (``moe_compile/experts/_storage_swap.py``): the shim against torch's
own."""

from __future__ import annotations

import pytest
import torch

from moe_compile.experts import _storage_swap

DEVICES = pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])


@pytest.fixture(scope="module")
def shim():
    swap = _storage_swap.shim_swapper()
    if swap is None:
        pytest.skip("the storage swap shim does not build here (no C++ compiler?)")
    return swap


def _pair(device: str, empty_first: bool) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """A tensor with live views (its storage freed to 0 bytes if ``empty_first``) and a fresh random one."""
    first = torch.randn(5, 7, device=device)
    views = list(first.unbind(0))
    if empty_first:
        first.untyped_storage().resize_(0)
    return first, views, torch.randn(5, 7, device=device)


@DEVICES
@pytest.mark.parametrize("empty_first", [False, True], ids=["same_size", "first_freed"])
def test_shim_swaps_as_torch_does(shim, device, empty_first):
    """After the swap the first tensor's views read the second's values (no copy: the second's data pointer
    moved), and the second holds what the first held; the same as torch's binding where there is one."""
    swaps = {"shim": shim}
    if _storage_swap.torch_swapper() is not None:
        swaps["torch"] = _storage_swap.torch_swapper()
    for name, swap in swaps.items():
        first, views, second = _pair(device, empty_first)
        want, pointer = second.clone(), second.data_ptr()
        old_bytes, old_values = first.untyped_storage().nbytes(), None if empty_first else first.clone()
        swap(first.untyped_storage(), second.untyped_storage())
        assert first.data_ptr() == pointer, name
        assert all(torch.equal(v, w) for v, w in zip(views, want)), name
        assert second.untyped_storage().nbytes() == old_bytes, name
        if old_values is not None:
            assert torch.equal(second, old_values), name


def test_shim_refuses_what_torch_refuses(shim):
    """Sizes that differ (neither 0) and storages of different devices raise, naming why; nothing moved."""
    first, second = torch.randn(4), torch.randn(5)
    kept = first.clone()
    with pytest.raises(RuntimeError, match="different sizes"):
        shim(first.untyped_storage(), second.untyped_storage())
    assert torch.equal(first, kept)
    with pytest.raises(RuntimeError, match="different devices"):
        shim(first.untyped_storage(), torch.empty(4, device="meta").untyped_storage())


def test_storage_swapper_prefers_torch(monkeypatch):
    """Torch's binding when it has one; the shim otherwise, unless ``MOE_COMPILE_STORAGE_SHIM=0``."""
    if _storage_swap.torch_swapper() is not None:
        assert _storage_swap.storage_swapper() is _storage_swap.torch_swapper()
    else:
        assert _storage_swap.storage_swapper() is _storage_swap.shim_swapper()
    _storage_swap.storage_swapper.cache_clear()
    try:
        monkeypatch.setattr(_storage_swap, "torch_swapper", lambda: None)
        monkeypatch.setenv("MOE_COMPILE_STORAGE_SHIM", "0")
        assert _storage_swap.storage_swapper() is None
        _storage_swap.storage_swapper.cache_clear()
        monkeypatch.setenv("MOE_COMPILE_STORAGE_SHIM", "1")
        assert _storage_swap.storage_swapper() is _storage_swap.shim_swapper()
    finally:
        _storage_swap.storage_swapper.cache_clear()
