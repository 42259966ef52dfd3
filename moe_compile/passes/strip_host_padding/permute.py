"""The ways MoE code permutes token rows by expert, in Dynamo IR (Torch IR, before AOTAutograd).

One place for the permute forms a pass proves before it replaces them with ``moe.permute_pad``::

    argsort        x_NH = x_TH[order // K]  (or index_select(0, order // K)),
                   order = argsort(idx_TK.flatten()) | sort(idx_TK.flatten())[1], ascending
                   (:func:`~moe_compile.passes.forms.counts.permutation_of` knows the sort)

and the routing probs permuted alongside the rows (:func:`probs_source`)::

    argsort        probs_N = probs_TK.flatten()[order]  |  probs_TE[order // K, ids[order]]

A selection by a routing map (Megatron's ``arange(T).expand(E, T).masked_select(map_TE.T)``, ``probs_TE.T
.masked_select(map_TE.T)``) reaches these forms through ``normalize``'s rule 6.

Add a form here (with a ``kind`` of :class:`Permute`) to teach every pass that reads permutes through it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.fx as fx

from moe_compile.passes import NoMatch
from moe_compile.passes._graph import arg, is_call, op_name, tensor_val
from moe_compile.passes.forms.counts import permutation_of
from moe_compile.passes.forms.ops import strip_casts


@dataclasses.dataclass
class Permute:
    x_TH: fx.Node
    idx_TK: fx.Node
    num_experts: int
    x_NH: fx.Node
    kind: str  # "argsort"
    order: fx.Node | None = None  # argsort result (for probs_N = probs.flatten()[order])




def flat_base(node: Any) -> Any:
    """``idx_TK`` for ``idx_TK.reshape(-1)`` / ``.view(-1)`` / ``.flatten()``; else the node."""
    node = strip_casts(node, frozenset({"contiguous"}))
    if is_call(node, "reshape", "view", "flatten", "ravel"):
        value, base = tensor_val(node), tensor_val(node.args[0])
        if value is not None and base is not None and value.dim() == 1 and base.dim() == 2:
            return node.args[0]
    return node


def argsort_of(order: Any) -> fx.Node | None:
    """The 1-D ids sorted by ``order`` (an ascending ``argsort`` / ``sort(...)[1]`` along the last dim), or None."""
    ids = permutation_of(order)
    if ids is None:
        return None
    sort = order if op_name(order) == "argsort" else order.args[0]
    ascending = arg(sort, 2, "descending", False) is False
    return ids if ascending and arg(sort, 1, "dim", -1) in (0, -1) else None


def floordiv_by(node: Any) -> tuple[fx.Node, int] | None:
    if is_call(node, "floordiv", "__floordiv__") and isinstance(node.args[1], int):
        return node.args[0], node.args[1]
    if is_call(node, "div") and arg(node, "rounding_mode") == "floor" and isinstance(node.args[1], int):
        return node.args[0], node.args[1]
    return None


def _pair_of_sorted_rows(index: tuple[Any, Any], order: fx.Node) -> bool:
    """``(order // K, ids[order])``: the token and the expert of each sorted row, as ``order`` sorts ``ids``."""
    tokens, experts = index
    split = floordiv_by(tokens)
    if split is None or split[0] is not order or not isinstance(experts, fx.Node):
        return False
    sort = order.args[0] if op_name(order) == "getitem" else None
    return (op_name(experts) == "getitem" and experts.args[0] is sort and experts.args[1] == 0) or \
        (op_name(experts) == "getitem" and experts.args[1] is order and experts.args[0] is argsort_of(order))


def match_permute(token_N: fx.Node) -> Permute:
    """Prove how ``token_N`` (source token of each permuted row) and the gathered rows were built."""
    gathers = [
        u for u in token_N.users
        if (is_call(u, "getitem") and u.args[1] is token_N)
        or (is_call(u, "index_select") and u.args[2] is token_N and arg(u, 1, "dim") == 0)
    ]
    if len(gathers) != 1:
        raise NoMatch("permute_not_matched", f"{len(gathers)} row gathers by {token_N.name}")
    x_NH = gathers[0]
    x_TH = x_NH.args[0]
    if tensor_val(x_TH) is None or tensor_val(x_TH).dim() != 2:
        raise NoMatch("permute_not_matched", "gathered tensor is not [T, H]")
    split = floordiv_by(token_N)
    if split is not None:
        order, K = split
        ids = argsort_of(order)
        idx_TK = flat_base(ids) if ids is not None else None
        value = tensor_val(idx_TK)
        if idx_TK is None or value is None or value.dim() != 2 or value.shape[1] != K:
            raise NoMatch("permute_not_matched", f"{token_N.name} is not argsort(ids.flatten()) // K")
        return Permute(x_TH, idx_TK, -1, x_NH, "argsort", order=order)
    raise NoMatch("permute_not_matched", f"{token_N.name} is not argsort(ids.flatten()) // K")


def token_index(order: fx.Node) -> fx.Node:
    """``order // K``, the source token of each sorted row, as the graph computes it for the row gather."""
    for u in order.users:
        split = floordiv_by(u)
        if split is not None and split[0] is order:
            return u
    raise NoMatch("permute_not_matched", f"no token index {order.name} // K gathers the rows")


def weighted_rows(perm: Permute) -> tuple[fx.Node, fx.Node | None, fx.Node | None] | None:
    """``(x_NH * probs_N[:, None], probs_TK, probs_TE)`` when the permuted rows' only use is that
    multiply by the routing probs permuted alongside them (weights applied before the experts)."""
    users = list(perm.x_NH.users)
    if len(users) != 1 or not is_call(users[0], "mul", "__mul__") or len(users[0].args) != 2:
        return None
    mul = users[0]
    col = mul.args[1] if mul.args[0] is perm.x_NH else mul.args[0]
    cv = tensor_val(col) if isinstance(col, fx.Node) else None
    if cv is None or cv.dim() != 2 or cv.shape[1] != 1:
        return None
    try:
        probs_TK, probs_TE = probs_source(col, perm)
    except NoMatch:
        return None
    return mul, probs_TK, probs_TE


def probs_source(probs_col: fx.Node, perm: Permute) -> tuple[fx.Node | None, fx.Node | None]:
    """``(probs_TK, None)`` or ``(None, probs_TE)`` for the permuted combine weight ``probs_col`` ([N, 1])."""
    node = strip_casts(probs_col)
    if is_call(node, "unsqueeze") and arg(node, 1, "dim") in (1, -1):
        node = node.args[0]
    elif is_call(node, "view", "reshape") and tuple(node.args[1:]) in ((-1, 1), ((-1, 1),)):
        node = node.args[0]
    elif is_call(node, "getitem") and isinstance(node.args[1], tuple) and len(node.args[1]) == 2 \
            and node.args[1][1] is None and node.args[1][0] == slice(None):
        node = node.args[0]
    else:
        raise NoMatch("probs_not_matched", f"{probs_col.name} is not a column of permuted probs")
    node = strip_casts(node)
    if perm.kind == "argsort" and is_call(node, "getitem") and node.args[1] is perm.order:
        probs_TK = flat_base(node.args[0])
        value, ids = tensor_val(probs_TK), tensor_val(perm.idx_TK)
        if value is not None and value.dim() == 2 and tuple(value.shape) == tuple(ids.shape):
            return probs_TK, None
    if perm.kind == "argsort" and is_call(node, "getitem") and isinstance(node.args[1], tuple) \
            and len(node.args[1]) == 2 and _pair_of_sorted_rows(node.args[1], perm.order):
        value = tensor_val(node.args[0])  # probs_TE[order // K, ids[order]] (normalize's rule 6)
        if value is not None and value.dim() == 2 and value.dtype.is_floating_point:
            return None, node.args[0]
    raise NoMatch("probs_not_matched", f"{probs_col.name} is not the routing probs permuted alongside the rows")
