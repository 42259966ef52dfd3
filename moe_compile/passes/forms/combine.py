"""The ways MoE code writes "un-permute the expert rows and sum each token's top-k rows", in Dynamo IR.

One place for every pass: :func:`match_unpermute_sum` reads an un-permute + top-k sum combine from its
last node, :func:`read_accumulate` an accumulate into a ``[T, H]`` buffer at token indices
(``index_add_`` / ``scatter_add_`` / ``index_put_(accumulate=True)``).
``S = T*K`` sorted rows ``ys_SH``, ``order_S`` the ascending sort of the flattened expert ids::

    scatter       y = empty_like(ys); y[order] = ys          (setitem / index_put_ / scatter_)
    index_copy    y = zeros_like(ys).index_copy_(0, order, ys)   (Megatron's un-permute; ``index_copy`` too)
    gather        y = ys[inv] with inv = argsort(order), or inv = empty(S); inv[order] = arange(S)
    then          y_TH = (y.view(T, K, H) [* w_TK[..., None]]).sum(1)

Both put row ``i`` of ``ys`` at position ``order[i]``, so ``y.view(T, K, H)[t, k]`` is the row of slot
``t*K + k``: the combine is ``sum_k w[t, k] * ys[row(t, k)]``, what ``moe.unpad_unpermute`` computes.
A new spelling is a new reader here; every pass then knows it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch.fx as fx

from moe_compile.passes._graph import arg, known_int, op_name, same_int, same_shape, tensor_val
from moe_compile.passes.forms import index_algebra as ia

_VIEWS_TKH = ("view", "reshape", "unflatten")
_WEIGHT_CASTS = ("to", "float", "bfloat16", "half", "type_as", "double")
_FRESH = ("empty_like", "zeros_like", "empty", "zeros", "new_empty", "new_zeros")


@dataclasses.dataclass
class UnpermuteSum:
    """``y_TH = sum_k w_TK[t, k] * ys[row(t, k)]`` read from the graph."""

    kind: str  # "scatter_unpermute_sum" | "index_copy_unpermute_sum" | "inverse_perm_sum"
    rows: fx.Node  # ys_SH, sorted rows
    order: fx.Node  # the permutation (sort indices)
    weight_TK: fx.Node | None  # routing weight applied after un-permuting (in [T, K] order), if any
    result: fx.Node  # the sum over the top-k slots
    nodes: list[fx.Node]  # the combine's own nodes (erased by a rewrite)


_WRITES = ("setitem", "index_put_", "scatter_")


@dataclasses.dataclass
class AccumulateCombine:
    """``buffer`` (``[T, H]``) with ``src`` rows added at the 1-D token index ``index`` along dim 0."""

    kind: str  # "index_add" | "scatter_add" | "index_put"
    node: fx.Node
    buffer: Any
    index: Any
    src: Any
    inplace: bool


def expanded_index(node: Any) -> Any:
    """``idx`` for ``idx.unsqueeze(-1).expand(-1, H)`` (also ``view(-1, 1)``, ``idx[:, None]``, ``expand_as``,
    ``repeat``); else None."""
    if not isinstance(node, fx.Node) or op_name(node) not in ("expand", "expand_as", "repeat"):
        return None
    inner = node.args[0]
    if not isinstance(inner, fx.Node):
        return None
    name = op_name(inner)
    iv = tensor_val(inner)
    if iv is None or iv.dim() != 2 or iv.shape[1] != 1:
        return None
    if name == "unsqueeze" and arg(inner, 1, "dim") in (1, -1):
        return inner.args[0]
    if name in ("view", "reshape"):
        return inner.args[0]
    if name == "getitem" and isinstance(inner.args[1], tuple) and len(inner.args[1]) == 2 \
            and inner.args[1][0] == slice(None) and inner.args[1][1] is None:
        return inner.args[0]
    return None


def read_accumulate(node: fx.Node) -> AccumulateCombine | None:
    """An accumulate of rows into a buffer along dim 0 (``index_add_``, ``scatter_add_`` with an expanded
    row index, ``index_put_(..., accumulate=True)``, in-place or not); None for anything else. A
    ``scatter_add`` whose index is not an expanded row index reads with ``index=None``."""
    name = op_name(node)
    if name in ("index_add_", "index_add"):
        if known_int(arg(node, 1, "dim")) != 0 or arg(node, 4, "alpha", 1) != 1:
            return None
        return AccumulateCombine("index_add", node, node.args[0], arg(node, 2, "index"), arg(node, 3, "source"),
                                 name.endswith("_"))
    if name in ("scatter_add_", "scatter_add"):
        if known_int(arg(node, 1, "dim")) != 0:
            return None
        return AccumulateCombine("scatter_add", node, node.args[0], expanded_index(arg(node, 2, "index")),
                                 arg(node, 3, "src"), name.endswith("_"))
    if name in ("index_put_", "index_put"):
        idx = arg(node, 1, "indices")
        if not arg(node, 3, "accumulate", False) or not isinstance(idx, (list, tuple)) or len(idx) != 1:
            return None
        return AccumulateCombine("index_put", node, node.args[0], idx[0], arg(node, 2, "values"), name.endswith("_"))
    return None


def _written_by_permutation(buf: fx.Node, order: fx.Node, exclude: fx.Node | None = None) -> Any:
    """``values`` when ``buf`` is a fresh tensor written once, as ``buf[order] = values`` (else None);
    ``exclude`` is its one reader (the others must all be that write)."""
    if op_name(buf) not in _FRESH:
        return None
    writes = [w for w in buf.users if w is not exclude and op_name(w) in _WRITES and w.args[0] is buf]
    if len(writes) != 1 or any(u is not exclude and u not in writes for u in buf.users if exclude is not None):
        return None
    w = writes[0]
    name = op_name(w)
    if name == "setitem" and w.args[0] is buf and w.args[1] is order:
        return w.args[2]
    if name == "index_put_" and w.args[0] is buf and tuple(arg(w, 1, "indices")) == (order,) \
            and not arg(w, 3, "accumulate", False):
        return arg(w, 2, "values")
    if name == "scatter_" and w.args[0] is buf and known_int(arg(w, 1, "dim")) == 0 and arg(w, 2, "index") is order:
        return arg(w, 3, "src")
    return None


def _is_arange(values: Any, n: Any) -> bool:
    try:
        return ia.LinearForms(lambda _: False, lambda _: False, lambda r: same_int(r, n))(values) == \
            ia.Form.atom(ia.ARANGE)
    except ia.NotLinear:
        return False


def is_inverse_of(inv: Any, order: fx.Node, reader: fx.Node) -> bool:
    """``inv`` is the inverse permutation of ``order``: ``argsort(order)`` or ``inv[order] = arange(S)``."""
    if not isinstance(inv, fx.Node):
        return False
    if op_name(inv) == "argsort" and inv.args[0] is order and not arg(inv, 2, "descending", False):
        return True
    values = _written_by_permutation(inv, order, reader)
    return values is not None and _is_arange(values, tensor_val(order).shape[0])


def _scatter_unpermute(y: fx.Node) -> tuple[fx.Node, fx.Node, list[fx.Node]] | None:
    """``(ys, order, nodes)`` for ``y = empty_like(ys); y[order] = ys`` (read at ``y``'s view)."""
    for w in y.users:
        if op_name(w) in ("setitem", "index_put_", "scatter_") and w.args[0] is y:
            order = w.args[1] if op_name(w) == "setitem" else (
                arg(w, 1, "indices")[0] if op_name(w) == "index_put_" else arg(w, 2, "index"))
            if isinstance(order, fx.Node):
                ys = _written_by_permutation(y, order)
                if isinstance(ys, fx.Node):
                    return ys, order, [w, y]
    return None


def _index_copy_unpermute(y: fx.Node) -> tuple[fx.Node, fx.Node, list[fx.Node]] | None:
    """``(ys, order, nodes)`` for ``y = fresh.index_copy_(0, order, ys)`` (or ``index_copy``) where the fresh
    buffer has ``ys``'s shape and no other reader: every row is written once when ``order`` is a permutation."""
    if op_name(y) not in ("index_copy_", "index_copy") or known_int(arg(y, 1, "dim")) != 0:
        return None
    buf, order, ys = y.args[0], arg(y, 2, "index"), arg(y, 3, "source")
    if not all(isinstance(n, fx.Node) for n in (buf, order, ys)) or op_name(buf) not in _FRESH \
            or len(buf.users) != 1 or not same_shape(tensor_val(buf).shape, tensor_val(ys).shape):
        return None
    return ys, order, [y, buf]


def _inverse_gather(y: fx.Node, is_permutation: Callable[[fx.Node], bool]) -> tuple[fx.Node, fx.Node, list] | None:
    """``(ys, order, nodes)`` for ``y = ys[inv]`` with ``inv`` the inverse of a permutation ``order``."""
    if op_name(y) != "getitem" or not isinstance(y.args[1], fx.Node):
        return None
    inv = y.args[1]
    candidates = [inv.args[0]] if op_name(inv) == "argsort" else \
        [w.args[1] for w in inv.users if w is not y and op_name(w) in ("setitem",) and w.args[0] is inv]
    candidates += [arg(w, 1, "indices")[0] for w in inv.users
                   if w is not y and op_name(w) == "index_put_" and w.args[0] is inv]
    for order in candidates:
        if isinstance(order, fx.Node) and is_permutation(order) and is_inverse_of(inv, order, y):
            return y.args[0], order, [y, *(w for w in inv.users if w is not y)]
    return None


def match_unpermute_sum(total: fx.Node, top_k: Any, is_permutation: Callable[[fx.Node], bool]) -> UnpermuteSum | None:
    """Read ``total`` as ``(y.view(T, K, H) [* w_TK[..., None]]).sum(1)`` over an un-permuted ``y``
    (``top_k=None``: any ``K``); ``is_permutation(order)`` must accept the permutation."""
    dims = arg(total, 1, "dim")
    dims = dims if isinstance(dims, (list, tuple)) else (dims,)
    if op_name(total) != "sum" or len(dims) != 1 or not isinstance(dims[0], int) or dims[0] % 3 != 1 \
            or arg(total, 2, "keepdim", False) or total.kwargs.get("dtype") is not None:
        return None
    body = total.args[0]
    if not isinstance(body, fx.Node):
        return None
    nodes, weight = [total], None
    if op_name(body) == "mul" and len(body.args) == 2 and all(isinstance(a, fx.Node) for a in body.args):
        for view, col in (body.args, body.args[::-1]):
            w = _weight_column(col)
            if op_name(view) in _VIEWS_TKH and w is not None:
                nodes += [body, *_chain(col, w)]
                body, weight = view, w
                break
        else:
            return None
    if op_name(body) not in _VIEWS_TKH or len(body.users) != 1:
        return None
    view, y = body, body.args[0]
    vv, yv = tensor_val(view), tensor_val(y)
    if vv is None or yv is None or vv.dim() != 3 or yv.dim() != 2 \
            or (top_k is not None and not same_int(vv.shape[1], top_k)) or not same_int(vv.shape[2], yv.shape[1]):
        return None
    if weight is not None:
        wv = tensor_val(weight)
        if wv is None or not same_shape(wv.shape, vv.shape[:2]) or not wv.dtype.is_floating_point:
            return None
    nodes.append(view)
    for kind, reader in (("scatter_unpermute_sum", lambda n: _scatter_unpermute(n)),
                         ("index_copy_unpermute_sum", _index_copy_unpermute),
                         ("inverse_perm_sum", lambda n: _inverse_gather(n, is_permutation))):
        found = reader(y)
        if found is not None:
            ys, order, own = found
            if not is_permutation(order) or len(y.users) != 1 + (kind == "scatter_unpermute_sum"):
                continue
            return UnpermuteSum(kind, ys, order, weight, total, nodes + own)
    return None


def _weight_column(col: fx.Node) -> fx.Node | None:
    """``w_TK`` for ``w_TK.unsqueeze(-1)`` / ``w_TK[..., None]`` / ``w_TK.view(T, K, 1)`` (through casts)."""
    node = col
    while op_name(node) in _WEIGHT_CASTS and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    name = op_name(node)
    if name == "unsqueeze" and arg(node, 1, "dim") in (2, -1):  # dim positional or keyword (vLLM: dim=-1)
        return node.args[0]
    if name == "getitem" and isinstance(node.args[1], tuple) and node.args[1][-1] is None \
            and all(s == slice(None) or s is Ellipsis for s in node.args[1][:-1]):
        return node.args[0]
    if name in ("view", "reshape"):
        wv = tensor_val(node)
        if wv is not None and wv.dim() == 3 and known_int(wv.shape[2]) == 1:
            return node.args[0]
    return None


def _chain(col: fx.Node, w: fx.Node) -> list[fx.Node]:
    out, node = [], col
    while node is not w:
        out.append(node)
        node = node.args[0]
    return out


__all__ = ["AccumulateCombine", "UnpermuteSum", "expanded_index", "is_inverse_of", "match_unpermute_sum",
           "read_accumulate"]
