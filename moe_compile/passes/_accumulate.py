"""What an accumulating scatter looks like in ATen graphs, and when its indices provably never collide.

One table for every pass and check that needs it (:mod:`~moe_compile.passes.deterministic_accumulate`
rewrites these nodes; :mod:`moe_compile.audit` reports the ones left). Each row of
:data:`ACCUMULATING_FORMS` reads one op's ``(base, dim, index, src)``; extend the table to teach every
user a new spelling.

Distinct indices (:func:`distinct_along`) are proven from where the index comes from, never from its
values: the indices of a ``topk`` or of a ``sort`` / ``argsort`` along the scatter's dim are a choice of
distinct positions in every slice, through integer casts and clones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from moe_compile.passes._graph import arg, known_int, op_name, tensor_val

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class Accumulate:
    """``base`` with ``src`` added at ``index`` along ``dim`` (``index`` is a 1-D tensor over ``dim`` for
    ``index_put`` / ``index_add``, an index of ``src``'s shape for ``scatter_add``)."""

    node: fx.Node
    kind: str  # "index_put" | "scatter_add" | "index_add"
    base: Any
    dim: int
    index: Any
    src: Any


def _index_put(node: fx.Node) -> Accumulate | None:
    if not arg(node, 3, "accumulate", False):
        return None
    indices = arg(node, 1, "indices")
    if not isinstance(indices, (list, tuple)) or len(indices) != 1 or not isinstance(indices[0], fx.Node):
        return None  # several index tensors (or None holes): not a row scatter we reason about
    return Accumulate(node, "index_put", node.args[0], 0, indices[0], arg(node, 2, "values"))


def _scatter_add(node: fx.Node) -> Accumulate | None:
    return Accumulate(node, "scatter_add", node.args[0], int(arg(node, 1, "dim")), arg(node, 2, "index"),
                      arg(node, 3, "src"))


def _index_add(node: fx.Node) -> Accumulate | None:
    if arg(node, 4, "alpha", 1) != 1:
        return None
    return Accumulate(node, "index_add", node.args[0], int(arg(node, 1, "dim")), arg(node, 2, "index"),
                      arg(node, 3, "source"))


# op -> reader of (base, dim, index, src); None from a reader means "accumulates, but not in a form we read"
ACCUMULATING_FORMS: dict[Any, Callable[[fx.Node], Accumulate | None]] = {
    aten.index_put.default: _index_put,
    aten.index_put_.default: _index_put,
    aten._unsafe_index_put.default: _index_put,
    aten.scatter_add.default: _scatter_add,
    aten.scatter_add_.default: _scatter_add,
    aten.index_add.default: _index_add,
    aten.index_add_.default: _index_add,
}


def is_accumulating(node: fx.Node) -> bool:
    """Whether ``node`` adds into a tensor at computed indices (atomic adds once Inductor lowers it)."""
    if node.op != "call_function":
        return False
    if node.target in (aten.index_put.default, aten.index_put_.default, aten._unsafe_index_put.default):
        return bool(arg(node, 3, "accumulate", False))
    if node.target in ACCUMULATING_FORMS:
        return True
    if node.target in (aten._index_put_impl_.default, aten.put.default, aten.put_.default):
        return bool(arg(node, 3 if "index_put" in str(node.target) else 2, "accumulate", False))
    return node.target in _ALWAYS_ACCUMULATING


# ops that always add at computed indices (Inductor: atomic adds on the GPU)
_ALWAYS_ACCUMULATING = {
    aten.scatter_reduce.two, aten.scatter_reduce_.two, aten.index_reduce.default, aten.index_reduce_.default,
    aten.embedding_dense_backward.default,
    # what Inductor's decompositions turn the embedding backward into
    aten._unsafe_masked_index_put_accumulate.default,
}


def read(node: fx.Node) -> Accumulate | None:
    reader = ACCUMULATING_FORMS.get(node.target) if node.op == "call_function" else None
    return reader(node) if reader is not None else None


# ops that keep every index value (int casts, copies)
_VALUE_PRESERVING = {"aten.clone", "aten._to_copy", "prims.convert_element_type", "aten.alias"}
_INT_DTYPES = (torch.int16, torch.int32, torch.int64)


def _strip_copies(node: Any) -> Any:
    while isinstance(node, fx.Node) and op_name(node) in _VALUE_PRESERVING and node.args:
        out = tensor_val(node)
        if out is None or out.dtype not in _INT_DTYPES:
            return node
        node = node.args[0]
    return node


def _norm_dim(dim: Any, ndim: int) -> int | None:
    if isinstance(dim, bool) or not isinstance(dim, int):
        return None
    return dim + ndim if dim < 0 else dim


def distinct_along(index: Any, dim: int) -> bool:
    """True when ``index`` holds distinct values in every slice along ``dim`` (so a scatter-add with it
    never adds two values into one element): the indices output of ``topk`` / ``sort`` / ``argsort``
    taken along ``dim``, or any index of size 1 along ``dim``."""
    node = _strip_copies(index)
    if not isinstance(node, fx.Node):
        return False
    out = tensor_val(index)
    if out is None or out.dim() == 0:
        return False
    want = _norm_dim(dim, out.dim())
    if want is not None and want < out.dim() and known_int(out.shape[want]) == 1:
        return True  # one index per slice (a top-1 / max selection): nothing to collide with
    name = op_name(node)
    if name == "getitem" and node.args[1] == 1 and isinstance(node.args[0], fx.Node):
        producer = node.args[0]
        pname = op_name(producer)
        if pname == "aten.topk":
            src_dim = arg(producer, 2, "dim", -1)
        elif pname == "aten.sort":
            src_dim = arg(producer, 1, "dim", -1) if producer.target != aten.sort.stable else \
                producer.kwargs.get("dim", -1)
        else:
            return False
        src = tensor_val(producer.args[0])
        if src is None or src.dim() != out.dim():
            return False
        return _norm_dim(src_dim, src.dim()) == want
    return False


def is_zeros(node: Any) -> bool:
    """A freshly created all-zero tensor (``full(..., 0)``, ``zeros``, ``new_zeros``, ``zeros_like``)."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    if node.target in (aten.zeros.default, aten.new_zeros.default, aten.zeros_like.default):
        return True
    if node.target in (aten.full.default, aten.new_full.default):
        fill = arg(node, 1, "fill_value") if node.target == aten.full.default else arg(node, 2, "fill_value")
        return not isinstance(fill, bool) and fill == 0
    if node.target == aten.full_like.default:
        fill = arg(node, 1, "fill_value")
        return not isinstance(fill, bool) and fill == 0
    return False


__all__ = ["ACCUMULATING_FORMS", "Accumulate", "distinct_along", "is_accumulating", "is_zeros", "read"]
