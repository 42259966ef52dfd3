"""The ways MoE code counts tokens per expert, in Dynamo IR: one table for every pass.

:data:`COUNT_FORMS` maps each spelling to a reader ``(node, is_ids) -> E | None``; ``is_ids(n)`` is the
caller's test for "``n`` holds the routed expert ids" (in any order: counts do not depend on it, see
:func:`ids_base`). Add a reader to teach every pass a new spelling::

    histc          histc(ids[.float() | .int()], bins=E, min=0, max=E-1 | E)
    bincount       bincount(ids, minlength=E)                 (capture flags: unbacked length >= E)
    one_hot_sum    one_hot(ids, E).sum(all dims but the last)
    eq_arange_sum  (ids[:, None] == arange(E)).sum(0)
    routing_map    zeros(T, E).scatter(1, idx_TK, 1 | True).sum(0)   (top-k ids: distinct per row)

Counts read to the host (``counts.tolist()``) are the same node to these readers; the passes that
evaluate host lists (``_host_sync``) start from the tensor that was read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.fx as fx

from moe_compile.passes._graph import CAPACITY_GROUP_META, CAPACITY_META, arg, known_int, op_name, tensor_val
from moe_compile.passes.forms.ops import CASTS, FLAT_VIEWS, INDEX_CASTS, is_zeros, strip_casts

IsIds = Callable[[Any], bool]


def permutation_of(order: Any) -> Any:
    """``x`` when ``order`` is an ascending ``argsort(x)`` / ``sort(x)[1]`` (a permutation of ``x``'s
    positions), else None."""
    if not isinstance(order, fx.Node):
        return None
    if op_name(order) == "argsort" and not arg(order, 2, "descending", False):
        return order.args[0]
    if op_name(order) == "getitem" and order.args[1] == 1 and op_name(order.args[0]) == "sort":
        return order.args[0].args[0]
    return None


def ids_base(node: Any) -> Any:
    """``node`` with what does not change a histogram peeled off: casts, flatten views, the values of a
    ``sort``, a gather ``x[perm]`` by a permutation of ``x``."""
    while isinstance(node, fx.Node):
        name = op_name(node)
        if name in CASTS and node.args and strip_casts(node) is not node:
            node = strip_casts(node)
        elif name in FLAT_VIEWS and tensor_val(node) is not None and tensor_val(node).dim() == 1:
            node = node.args[0]
        elif name == "getitem" and node.args[1] == 0 and op_name(node.args[0]) == "sort":
            node = node.args[0].args[0]
        elif name == "getitem" and isinstance(node.args[1], fx.Node) \
                and permutation_of(node.args[1]) is node.args[0]:
            node = node.args[0]
        else:
            break
    return node


def _num_bins(node: fx.Node) -> int | None:
    v = tensor_val(node)
    return known_int(v.shape[-1]) if v is not None and v.dim() >= 1 else None


def _histc(node: fx.Node, is_ids: IsIds) -> int | None:
    bins = known_int(arg(node, 1, "bins", 100))
    lo, hi = arg(node, 2, "min", 0), arg(node, 3, "max", 0)
    if bins and is_ids(node.args[0]) and lo == 0 and hi in (bins - 1, bins):
        return bins
    return None


def _bincount(node: fx.Node, is_ids: IsIds) -> int | None:
    minlength = known_int(arg(node, 2, "minlength", 0))
    if arg(node, 1, "weights") is None and minlength and is_ids(node.args[0]):
        return minlength
    return None


def _sum(node: fx.Node, is_ids: IsIds) -> int | None:
    dims = arg(node, 1, "dim")
    dims = tuple(dims) if isinstance(dims, (list, tuple)) else (dims,)
    inner = strip_casts(node.args[0])
    iv = tensor_val(inner)
    if iv is None or iv.dim() < 2 or not all(isinstance(d, int) for d in dims):
        return None
    E = known_int(iv.shape[-1])
    summed = sorted(d % iv.dim() for d in dims)
    name = op_name(inner)
    if name == "one_hot" and summed == list(range(iv.dim() - 1)):
        return E if is_ids(inner.args[0]) and known_int(arg(inner, 1, "num_classes", -1)) == E else None
    if name == "eq" and summed == [0] and iv.dim() == 2:
        for ids_col, experts in (inner.args, inner.args[::-1]):
            if _is_column(ids_col) and is_ids(ids_col.args[0]) and _is_arange(experts, E):
                return E
        return None
    if summed == [0] and iv.dim() == 2:
        idx_TK = routing_map_ids(inner)
        return E if idx_TK is not None and is_ids(idx_TK) else None
    return None


def _is_column(node: Any) -> bool:
    if not isinstance(node, fx.Node):
        return False
    name = op_name(node)
    if name == "unsqueeze":
        return arg(node, 1, "dim") in (1, -1)
    if name == "getitem" and isinstance(node.args[1], tuple) and node.args[1][-1] is None:
        return all(i in (slice(None), Ellipsis) for i in node.args[1][:-1])
    if name in ("view", "reshape"):
        v = tensor_val(node)
        return v is not None and v.dim() == 2 and known_int(v.shape[1]) == 1
    return False


def _is_arange(node: Any, E: int | None) -> bool:
    node = strip_casts(node)
    while isinstance(node, fx.Node) and op_name(node) in ("view", "reshape", "unsqueeze"):
        node = node.args[0]
    if not isinstance(node, fx.Node) or op_name(node) != "arange" or E is None:
        return False
    a = node.args
    start, end, step = (0, a[0], 1) if len(a) == 1 else (arg(node, 0, "start", 0), arg(node, 1, "end"),
                                                          arg(node, 2, "step", 1))
    return known_int(start) == 0 and known_int(end) == E and known_int(step) == 1


def routing_map_ids(map_TE: Any) -> fx.Node | None:
    """``idx_TK`` when ``map_TE`` is a routing map built from top-k ids: ``zeros(T, E).scatter(1, idx_TK,
    True | 1)`` (through casts) or ``one_hot(idx_TK, E).sum(1)``; else None."""
    map_TE = strip_casts(map_TE)
    while isinstance(map_TE, fx.Node) and op_name(map_TE) == "bool":
        map_TE = map_TE.args[0]
    if not isinstance(map_TE, fx.Node):
        return None
    name = op_name(map_TE)
    if name in ("scatter", "scatter_") and arg(map_TE, 1, "dim") in (1, -1):
        src = map_TE.args[3] if len(map_TE.args) > 3 else map_TE.kwargs.get("value", map_TE.kwargs.get("src"))
        base = map_TE.args[0]
        if src in (True, 1) and is_zeros(strip_casts(base)):
            return map_TE.args[2]
    if name == "sum" and op_name(map_TE.args[0]) == "one_hot" and arg(map_TE, 1, "dim") in (1, -2):
        return map_TE.args[0].args[0]
    return None


COUNT_FORMS: dict[str, Callable[[fx.Node, IsIds], int | None]] = {
    "histc": _histc,
    "bincount": _bincount,
    "sum": _sum,  # one_hot_sum, eq_arange_sum, routing_map
}


def expert_counts(node: Any, is_ids: IsIds) -> tuple[int, str] | None:
    """``(E, kind)`` when ``node`` counts the ids ``is_ids`` accepts per expert, else None."""
    if not isinstance(node, fx.Node):
        return None
    name = op_name(node)
    reader = COUNT_FORMS.get(name)
    E = reader(node, is_ids) if reader is not None else None
    if E is None:
        return None
    if name == "sum":
        inner = op_name(strip_casts(node.args[0]))
        name = "one_hot.sum" if inner == "one_hot" else "(ids == arange(E)).sum" if inner == "eq" else "routing_map.sum"
    return E, name


__all__ = ["COUNT_FORMS", "expert_counts", "ids_base", "permutation_of", "routing_map_ids"]


# what may stand between a router's topk indices and the expert ids a dispatch reads: views, index casts, a column
_ID_VIEWS = FLAT_VIEWS | INDEX_CASTS | {"getitem", "select", "squeeze", "unsqueeze", "t", "transpose"}


def mark_capacity(ids: fx.Node, C: int, group: int = 1) -> bool:
    """Record a static capacity ``C`` (per block of ``group`` consecutive experts) on the router ``topk`` (or
    ``argmax``) whose indices ``ids`` are read from through ``_ID_VIEWS``: ``router_metrics`` then reports the
    choices past it (``moe/dropped_fraction``). Returns whether a router was found."""
    node: Any = ids
    for _ in range(8):
        if not isinstance(node, fx.Node):
            return False
        router = None
        if op_name(node) == "getitem" and isinstance(node.args[0], fx.Node) and op_name(node.args[0]) == "topk":
            if node.args[1] != 1:  # the values
                return False
            router = node.args[0]
        elif op_name(node) == "argmax":  # DeepSpeed's top-2: one argmax per choice (router_metrics stacks them)
            router = node
        if router is not None:
            router.meta[CAPACITY_META] = C
            if group != 1:
                router.meta[CAPACITY_GROUP_META] = group
            return True
        if op_name(node) not in _ID_VIEWS:
            return False
        node = node.args[0]
    return False
