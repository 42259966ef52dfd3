"""Per-expert ``p.grad`` as views of one grouped gradient (NOTE [grouped views] (moe_compile/experts/swap.py)).

A swapped ``nn.ModuleList`` block computes one gradient ``dG`` per grouped ``[E, ...]`` leaf ``G``; every
per-expert parameter gets its slice of it as ``p.grad``. Handing out ``E`` (or ``2E``) fresh views per step, and
freeing them at the user's ``zero_grad``, is what a loop block costs on the host beyond the grouped block
(microseconds per parameter per step, hundreds of parameters at E = 128; measured at commit 8ea6fac).
NOTE [recycled gradient views] removes most of that cost.

NOTE [recycled gradient views]: the view objects are kept from step to step; the memory under them is not.

* ``_after`` (the gradient has accumulated) moves ``dG``'s memory under the kept views: the two storages swap
  their data pointers (``UntypedStorage._swap_data_ptr_``, what CUDA-graph trees and FSDP use to move memory
  under live views; on a torch without it, NOTE [storage swap shim] (moe_compile/experts/_storage_swap.py)); no copy, no
  new tensor. ``dG``'s storage leaves with the carrier's old memory and frees it.
* ``release`` frees the memory (``storage.resize_(0)``) once every ``p.grad`` was reset to ``None`` and nothing
  else holds a view, as ``zero_grad(set_to_none=True)`` frees a plain gradient. ``moe_compile.compile`` calls it
  before every call of the compiled model, so gradients are not held through the next forward. A block called
  outside the compiled model keeps the last gradient's memory until its next backward swaps it out.
* Semantics are those of fresh views: a view is recycled only if nobody but the parameters' ``.grad`` holds it
  (Python reference counts) and no tensor was made from it (the storage's use count). Otherwise the kept views
  are left to whoever holds them, with their values, and fresh views are handed out.
* Off under CUDA graphs (``recycle=False``): a graph's output memory belongs to its pool, which tracks it by
  the storage it came out in. Off where storages cannot swap their memory (torch 2.11 without a C++ compiler
  for the shim): fresh views every step, as before.
"""

from __future__ import annotations

import functools
import operator
import sys
import weakref

import torch
from torch import Tensor, nn

from moe_compile.experts import _storage_swap

_GRAD = operator.attrgetter("grad")


def per_expert_views(grouped: Tensor, halves: bool) -> list[Tensor]:
    """The per-expert views of a grouped leaf, in the order of its parameters
    (NOTE [grouped views] (moe_compile/experts/swap.py)).

    ``halves``: ``grouped`` is ``[E, 2N, ...]``, gate then up (as transformers' ``gate_up_proj``); the views
    are every expert's gate half, then every expert's up half. Built by ``unbind`` alone (no Python indexing
    per expert).
    """
    if not halves:
        return list(grouped.unbind(0))
    E, two_n = grouped.shape[:2]
    gate, up = grouped.view(E, 2, two_n // 2, *grouped.shape[2:]).unbind(1)
    return [*gate.unbind(0), *up.unbind(0)]


@functools.cache
def _grad_python_refs() -> int | None:
    """How much ``p.grad = t`` adds to ``t``'s Python reference count (0 or 1, by torch version); ``None`` when
    neither, or when storages cannot swap their data (recycling is then off)."""
    if _storage_swap.storage_swapper() is None:
        return None
    p, t = torch.zeros(1, requires_grad=True), torch.zeros(1)
    before = sys.getrefcount(t)
    p.grad = t
    added = sys.getrefcount(t) - before
    return added if added in (0, 1) else None


def _storage_refs(t: Tensor) -> int:
    """Tensors (and storage objects) holding ``t``'s storage, the temporary one made here included."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class GradViews:
    """Every per-expert ``p.grad`` is a view of the grouped leaf's gradient
    (NOTE [grouped views] (moe_compile/experts/swap.py)).

    Before the grouped gradient accumulates (a tensor hook), ``G.grad`` is set to what the per-expert grads
    hold: their common buffer when every ``p.grad`` is still the view it was given (autograd then adds in
    place: accumulation over micro-batches costs no copy), nothing when all were reset to ``None`` (the new
    gradient is taken as is), else a buffer filled from them. After it accumulates, the views are handed out
    again unless they still are, and ``G.grad`` is dropped so that ``zero_grad`` frees it. With ``recycle``,
    the views handed out are the same objects every step (NOTE [recycled gradient views]).
    """

    def __init__(self, grouped: Tensor, params: list[nn.Parameter], halves: bool, recycle: bool = False):
        self.params, self.halves = params, halves
        self.carrier: Tensor | None = None  # recycling: the tensor the kept views are views of
        self.views: tuple[Tensor, ...] = ()
        self._baseline: tuple[int, int] = (0, 0)  # (storage refs, Python refs of a view) when nothing else holds them
        self.buffer: weakref.ref[Tensor] | None = None  # else: the gradient last handed out
        self.recycle = recycle
        self.reused = False  # set by _before: G.grad is the views' buffer, accumulated in place
        grouped.register_hook(functools.partial(self._before, weakref.ref(grouped)))
        grouped.register_post_accumulate_grad_hook(self._after)

    @property
    def recycle(self) -> bool:
        return self._recycle

    @recycle.setter
    def recycle(self, on: bool) -> None:
        self._recycle = bool(on) and _grad_python_refs() is not None
        if not self._recycle and self.carrier is not None:  # the views handed out stay valid; no more recycling
            self.buffer, self.carrier, self.views = weakref.ref(self.carrier), None, ()

    # ----- the two hooks -----

    def _before(self, grouped_ref: weakref.ref[Tensor], grad: Tensor) -> None:
        grouped = grouped_ref()
        buffer = self._intact_buffer()
        self.reused = buffer is not None
        if self.reused:
            grouped.grad = buffer
            return
        grads = list(map(_GRAD, self.params))
        if grads.count(None) == len(grads):
            grouped.grad = None
            return
        buffer = torch.zeros_like(grouped)
        for g, view in zip(grads, per_expert_views(buffer, self.halves)):
            if g is not None:
                view.copy_(g)
        grouped.grad = buffer

    def _after(self, grouped: Tensor) -> None:
        grad, grouped.grad = grouped.grad, None
        if self.reused:  # the views already are views of ``grad``
            return
        if self._move_under_views(grad):
            views = self.views
        else:
            views = tuple(per_expert_views(grad, self.halves))
            self._keep(grad, views)
        for p, view in zip(self.params, views):
            p.grad = view

    # ----- recycling -----

    def _intact_buffer(self) -> Tensor | None:
        """The tensor every ``p.grad`` is still a view of, if so."""
        carrier = self.carrier
        if carrier is not None:
            if not carrier.untyped_storage().nbytes():
                return None
            return carrier if all(p.grad is v for p, v in zip(self.params, self.views)) else None
        buffer = self.buffer() if self.buffer is not None else None
        if buffer is None:
            return None
        return buffer if all(p.grad is not None and p.grad._base is buffer for p in self.params) else None

    def _keep(self, grad: Tensor, views: tuple[Tensor, ...]) -> None:
        """Remember the views just made: as the carrier to recycle, else by a weak reference to their base."""
        if not (self.recycle and _own_storage(grad)):
            self.carrier, self.views, self.buffer = None, (), weakref.ref(grad)
            return
        self.carrier, self.views, self.buffer = grad, views, None
        # what _unshared compares with, measured as it measures: the carrier, the views and the temporary
        # storage object hold the storage; the tuple and map's argument hold a view
        self._baseline = (1 + len(views) + 1, next(map(sys.getrefcount, views)))

    def _unshared(self, grads_hold: bool) -> bool:
        """Whether nothing but this object (and, with ``grads_hold``, the parameters' ``.grad``) holds a kept view
        or its memory. Without ``grads_hold`` a ``p.grad`` still set to its view counts as a holder too, on a
        torch where ``p.grad = t`` adds to ``t``'s Python reference count (``release`` checks it otherwise)."""
        storage_refs, view_refs = self._baseline
        if _storage_refs(self.carrier) != storage_refs:
            return False  # a tensor was made from a view (or from the carrier)
        # getrefcount inside map sees the tuple's reference and map's argument, as the baseline did
        refs = list(map(sys.getrefcount, self.views))
        if grads_hold and _grad_python_refs():
            return all(r == view_refs + (p.grad is v) for r, p, v in zip(refs, self.params, self.views))
        return refs.count(view_refs) == len(refs)

    def _move_under_views(self, grad: Tensor) -> bool:
        """Swap ``grad``'s memory under the kept views (NOTE [recycled gradient views]); False if they cannot be."""
        carrier = self.carrier
        if (carrier is None or not _own_storage(grad) or grad.shape != carrier.shape or grad.dtype != carrier.dtype
                or grad.device != carrier.device):
            return False
        storage = carrier.untyped_storage()
        # released: every p.grad was None and nothing held a view then; nothing can have reached one since
        if storage.nbytes() and not self._unshared(grads_hold=True):
            self.carrier, self.views = None, ()  # left to whoever holds them, with their values
            return False
        _storage_swap.storage_swapper()(storage, grad.untyped_storage())
        return True

    def release(self) -> None:
        """Free the kept views' memory if no ``p.grad`` and nothing else holds one of them (``zero_grad``)."""
        carrier = self.carrier
        if carrier is None or not carrier.untyped_storage().nbytes():
            return
        if carrier.is_cuda and torch.cuda.is_current_stream_capturing():
            return  # a forward captured into a CUDA graph: its memory stays as it was when captured
        if not _grad_python_refs() and any(p.grad is v for p, v in zip(self.params, self.views)):
            return
        if not self._unshared(grads_hold=False):
            return  # still in use: _after hands out fresh views next time if it is not the parameters
        try:
            carrier.untyped_storage().resize_(0)
        except RuntimeError:  # a storage that cannot be resized: stop recycling it
            self.carrier, self.views = None, ()


def _own_storage(grad: Tensor) -> bool:
    """Whether ``grad`` is all of its storage (contiguous, offset 0, no bytes beyond it) and a plain gradient."""
    return (not grad.requires_grad and grad.is_contiguous() and grad.storage_offset() == 0
            and grad.untyped_storage().nbytes() == grad.numel() * grad.element_size())
