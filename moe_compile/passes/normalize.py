"""Normalise row moves before any recogniser runs: one spelling per meaning (issue 51's front end, its first rules).

The recognisers read a token gather as ``x[perm // K]`` and a combine as an accumulation at ``perm // K``. Public code
reaches the same values in other steps; this pass rewrites them onto that form, once per graph, before the other
pre-grad passes. Each rule is local and exact in value (the same rows moved; rule 3 reorders the terms of an
accumulation), checked by a test per rule and by translation validation.

Matches (``S = T*K`` rows, ``p`` a permutation: the indices of a ``sort`` / ``argsort``)::

    0. the token of each sorted row, truncated:  div(p, K, rounding_mode="trunc")
    1. the token of each row:   arange(T).unsqueeze(1).expand(-1, K).reshape(-1),  arange(T).repeat_interleave(K)
    2. composed gathers:        x[a][b], ``a`` the token of each row
    3. a combine through the inverse order:   zeros.index_add_(0, idx, y[argsort(p)])
    4. an einsum of three or more operands
    5. counts sized by their values:   bincount(ids, minlength=E), ids a router's top-k over E scores (sorted or not)
    6. a selection by a routing map:   X.masked_select(M), M = zeros(T, E).scatter(1, topk_ids, True) or its ``.T``

Rewrites to::

    0.    p // K (p is non-negative: truncation is the floor)
    1, 2. x[a[b]], where (token of each row)[b] is b // K: x[token_idx][perm] -> x[perm // K]
    3.    zeros.index_add_(0, idx[p], y):   index_add_(0, token_idx, y[argsort(perm)]) -> index_add_(0, perm // K, y)
    4.    two-operand einsums, left to right (the expert-choice paper's ``"geks,gek,gekm->gsm"`` combine)
    5.    (ids.unsqueeze(-1) == arange(E)).sum(0): the same ``[E]`` counts with a size known at trace time (under
          the capture flags ``bincount``'s length is an unbacked size, a host sync: MaxText's ``sparse_matmul``)
    6.    X[rows, cols] at the ``T*K`` pairs the map selects, in its row-major order: for ``M.T`` (Megatron's
          ``permute``) ``(ids[p], p // K)`` with ``p`` the stable sort of the flat ids, for ``M`` ``(s // K,
          sort(ids, 1)[s])``; ``p // K`` itself where ``X`` is ``arange(T)`` broadcast (the token of each row).
          ``masked_select``'s length is data-dependent to the compiler; a top-k map selects exactly ``K`` per token

so transformers' ``grouped_mm`` spelling written out by hand (``x[token_idx][perm]`` ... ``index_add_(0, token_idx,
y[inv_perm])``) reads ``x[perm // K]`` ... ``index_add_(0, perm // K, y)``, the form ``fuse_dispatch`` proves.

Why a graph rewrite rather than a read-only view: the recognisers then need no second reading of each spelling, and
translation validation checks the normal form itself (the pass is validated like any other). Rule 3 changes the order
in which ``index_add_`` adds a token's rows (it is registered not exact); where nothing else rewrites the combine,
that order is as arbitrary as the original's, whose atomics on the GPU fix none.

Stage: pre-grad (Dynamo's Torch IR), first. Records: one non-MoE rewrite per layer and rule.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from moe_compile.passes import PassContext
from moe_compile.passes._graph import (
    arg,
    einsum_terms,
    erase_dead,
    fake_mode_of,
    graph_call,
    known_int,
    layer_name,
    op_name,
    tensor_val,
)
from moe_compile.passes.forms.counts import ids_base, routing_map_ids
from moe_compile.passes.forms.ops import ids_below, is_zeros, strip_casts

_ARGSORTS = ("argsort",)


def run(graph: fx.Graph, ctx: PassContext) -> None:
    done: dict[tuple[str, str], int] = {}
    for node in list(graph.nodes):
        if node.op not in ("call_function", "call_method") or getattr(node, "_erased", False):
            continue
        rule = _trunc_of_order(graph, node) or _compose_gathers(graph, node) or \
            _token_of_gathered_rows(graph, node) or _combine_through_inverse(graph, node) or \
            _einsum_in_pairs(graph, node) or _counts_of_known_size(graph, node) or _routing_map_select(graph, node)
        if rule:
            key = (layer_name(node), rule)
            done[key] = done.get(key, 0) + 1
    for (layer, rule), n in done.items():
        ctx.rewrite(layer, rule + (f" x{n}" if n > 1 else ""), "normal form (passes/normalize.py)", moe=False)


def _einsum_in_pairs(graph: fx.Graph, node: fx.Node) -> str | None:
    """Rule 4: ``einsum("ab,bc,cd->ad", x, y, z)`` -> ``einsum("ac,cd->ad", einsum("ab,bc->ac", x, y), z)``, left to
    right (torch.einsum's own order without opt_einsum), each step keeping the indices a later operand or the output
    needs, so that every product is one of two operands."""
    spec = einsum_terms(node)
    if spec is None or len(spec[0]) < 3:
        return None
    terms, out, operands = spec
    acc, acc_term = operands[0], terms[0]
    with graph.inserting_before(node):
        for i in range(1, len(terms)):
            if i == len(terms) - 1:
                step_out = out
            else:
                later = set("".join(terms[i + 1:])) | set(out)
                step_out = "".join(dict.fromkeys(ch for ch in acc_term + terms[i] if ch in later))
            acc = graph_call(graph, torch.einsum, f"{acc_term},{terms[i]}->{step_out}", acc, operands[i],
                             meta_from=node)
            acc_term = step_out
    node.replace_all_uses_with(acc)
    graph.erase_node(node)
    return "einsum of 3+ operands -> pairwise einsums"


def _counts_of_known_size(graph: fx.Graph, node: fx.Node) -> str | None:
    """Rule 5: ``bincount(ids, minlength=E)`` with ``ids`` in ``[0, E)`` (:func:`ids_below`) -> the ``eq_arange_sum``
    count (``forms/counts.py``'s table reads both spellings)."""
    if op_name(node) != "bincount" or arg(node, 1, "weights") is not None:
        return None
    E, ids = known_int(arg(node, 2, "minlength", 0)), node.args[0]
    if not E or not _int_vector(ids) or not ids_below(ids_base(ids), E):  # through sorts, casts, flattening
        return None
    with graph.inserting_before(node), fake_mode_of([tensor_val(ids)]):  # arange's example value: a fake tensor
        experts = graph_call(graph, torch.arange, E, device=tensor_val(ids).device, meta_from=node)
        column = graph_call(graph, torch.unsqueeze, ids, -1, meta_from=node)
        hits = graph_call(graph, torch.eq, column, experts, meta_from=node)
        counts = graph_call(graph, torch.sum, hits, 0, meta_from=node)
    node.replace_all_uses_with(counts)
    graph.erase_node(node)
    return "bincount(ids, minlength=E) -> (ids[:, None] == arange(E)).sum(0)"


def _swaps_two_dims(node: fx.Node) -> bool:
    """``node`` is a 2-D tensor's transpose: ``.t()``, ``.T``, ``.mT``, ``transpose(0, 1)``, ``permute(1, 0)`` (a
    ``transpose(0, 0)`` or ``permute(0, 1)`` is no transpose)."""
    v = tensor_val(node)
    if v is None or v.dim() != 2:
        return False
    name = op_name(node)
    if name in ("t", "T", "mT") or (node.op == "call_function" and node.target is getattr
                                    and node.args[1] in ("T", "mT")):
        return True
    dims = node.args[1:]
    if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
        dims = tuple(dims[0])
    if not all(isinstance(d, int) for d in dims):
        return False
    if name == "transpose":
        return len(dims) == 2 and dims[0] % 2 != dims[1] % 2
    return name == "permute" and tuple(d % 2 for d in dims) == (1, 0)


def _transposed_2d(node: Any) -> tuple[bool, Any]:
    """``(transposed, base)``: ``node`` through ``contiguous`` / ``bool`` and 2-D transposes."""
    flipped = False
    while isinstance(node, fx.Node):
        name = op_name(node)
        if name in ("contiguous", "bool", "clone"):
            node = node.args[0]
        elif _swaps_two_dims(node):
            flipped, node = not flipped, node.args[0]
        else:
            break
    return flipped, node


def _token_column(x: Any, transposed: bool, T: int) -> bool:
    """``x`` is ``arange(T)`` broadcast along the map's expert axis (Megatron's ``token_indices``)."""
    while isinstance(x, fx.Node) and op_name(x) in ("expand", "contiguous"):
        x = x.args[0]
    if not isinstance(x, fx.Node) or op_name(x) != "unsqueeze":
        return False
    return _is_arange(x.args[0]) and known_int(tensor_val(x.args[0]).shape[0]) == T and \
        known_int(arg(x, 1, "dim")) in ((0, -2) if transposed else (1, -1))


def _sorted_pairs(graph: fx.Graph, idx_TK: fx.Node, K: int, at: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node]:
    """``(ids[p], p, p // K)``, ``p`` the stable sort of ``idx_TK``'s flat ids: the ones an earlier selection by the
    same map made (one order: the recognisers prove a permute and its probs by the same ``p``), else new ones."""
    for flat in idx_TK.users:
        if flat.target is torch.reshape and flat.args[1:] == ((-1,),):
            for order in flat.users:
                if order.target is torch.sort and order.kwargs.get("stable"):
                    parts = {u.args[1]: u for u in order.users if u.target is operator.getitem}
                    perm = parts.get(1)
                    tokens = None if perm is None else next(
                        (u for u in perm.users if u.target is operator.floordiv and u.args[1] == K), None)
                    if 0 in parts and tokens is not None:
                        return parts[0], perm, tokens
    flat = graph_call(graph, torch.reshape, idx_TK, (-1,), meta_from=at)
    order = graph_call(graph, torch.sort, flat, stable=True, meta_from=at)
    experts = graph_call(graph, operator.getitem, order, 0, meta_from=at)
    perm = graph_call(graph, operator.getitem, order, 1, meta_from=at)
    return experts, perm, graph_call(graph, operator.floordiv, perm, K, meta_from=at)


def _scattered_values(x_TE: Any, idx_TK: fx.Node) -> fx.Node | None:
    """``v_TK`` where ``x_TE`` is ``zeros(T, E).scatter(1, idx_TK, v_TK)`` (a routing-probs table)."""
    if not isinstance(x_TE, fx.Node) or op_name(x_TE) not in ("scatter", "scatter_") or \
            arg(x_TE, 1, "dim") not in (1, -1) or x_TE.args[2] is not idx_TK or not is_zeros(strip_casts(x_TE.args[0])):
        return None
    src = x_TE.args[3] if len(x_TE.args) > 3 else x_TE.kwargs.get("src")
    return src if isinstance(src, fx.Node) and tensor_val(src) is not None and \
        tuple(tensor_val(src).shape) == tuple(tensor_val(idx_TK).shape) else None


def _broadcasts_to(shape: Any, target: tuple[int, ...]) -> bool:
    try:
        return tuple(torch.broadcast_shapes(tuple(shape), target)) == target
    except RuntimeError:  # not broadcastable at all
        return False


def _routing_map_select(graph: fx.Graph, node: fx.Node) -> str | None:
    """Rule 6: ``X.masked_select(M)``, ``M`` (or ``M.T``) a routing map of a top-k over ``E`` (``K`` distinct ids per
    token: ``T*K`` selected, :func:`~moe_compile.passes.forms.counts.routing_map_ids`) -> ``X`` at those pairs."""
    if op_name(node) != "masked_select" or len(node.args) < 2 and "mask" not in node.kwargs:
        return None
    x, mask = node.args[0], arg(node, 1, "mask")
    transposed, routing_map = _transposed_2d(mask)
    idx_TK = routing_map_ids(routing_map)
    mv, iv, xv = tensor_val(routing_map), tensor_val(idx_TK), tensor_val(x)
    if idx_TK is None or mv is None or iv is None or xv is None or mv.dim() != 2 or iv.dim() != 2:
        return None
    T, E, K = known_int(mv.shape[0]), known_int(mv.shape[1]), known_int(iv.shape[1])
    shape = (E, T) if transposed else (T, E)
    if None in (T, E, K) or not ids_below(idx_TK, E) or xv.dim() > 2 or not _broadcasts_to(xv.shape, shape):
        return None
    with graph.inserting_before(node):
        if transposed:
            experts, perm, tokens = _sorted_pairs(graph, idx_TK, K, node)
            index = (experts, tokens)
        else:
            row_ids = graph_call(graph, operator.getitem, graph_call(graph, torch.sort, idx_TK, 1, meta_from=node), 0,
                                 meta_from=node)
            experts = graph_call(graph, torch.reshape, row_ids, (-1,), meta_from=node)
            with fake_mode_of([iv]):
                rows = graph_call(graph, torch.arange, T * K, device=iv.device, meta_from=node)
            tokens = graph_call(graph, operator.floordiv, rows, K, meta_from=node)
            index = (tokens, experts)
        x_flipped, x_TE = _transposed_2d(x)
        values_TK = _scattered_values(x_TE, idx_TK) if transposed and x_flipped else None
        if _token_column(x, transposed, T):
            picked = tokens
        elif values_TK is not None:  # zeros(T, E).scatter(1, ids, v_TK): the pairs' values in sorted order
            flat_values = graph_call(graph, torch.reshape, values_TK, (-1,), meta_from=node)
            picked = graph_call(graph, operator.getitem, flat_values, perm, meta_from=node)
        elif x_flipped == transposed and (v := tensor_val(x_TE)) is not None and tuple(v.shape) == (T, E):
            # index the [T, E] tensor itself
            picked = graph_call(graph, operator.getitem, x_TE, (tokens, experts), meta_from=node)
        else:
            if tuple(xv.shape) != shape:
                x = graph_call(graph, torch.Tensor.expand, x, shape, meta_from=node)
            picked = graph_call(graph, operator.getitem, x, index, meta_from=node)
    node.replace_all_uses_with(picked)
    erase_dead(graph, [node])
    return "X.masked_select(routing map) -> X[rows, cols] of the top-k pairs"


def _int_vector(node: object) -> bool:
    t = tensor_val(node)
    return t is not None and t.dim() == 1 and not t.is_floating_point() and t.dtype != torch.bool


def token_of_rows(node: object) -> int | None:
    """``K`` where ``node`` is ``s // K`` for ``s`` in ``[0, T*K)`` (the token of each of ``T*K`` rows, top-k choice
    minor), spelt ``arange(T).unsqueeze(1).expand(-1, K).reshape(-1)``, ``arange(T).repeat_interleave(K)`` or
    ``arange(T*K) // K``; else None."""
    if not isinstance(node, fx.Node):
        return None
    name = op_name(node)
    if name in ("floordiv", "floor_divide") and _is_arange(node.args[0]):
        return known_int(node.args[1])
    if name == "repeat_interleave" and _is_arange(node.args[0]):
        return known_int(arg(node, 1, "repeats"))
    if name in ("reshape", "view", "flatten") and _int_vector(node):
        expand = node.args[0]
        if isinstance(expand, fx.Node) and op_name(expand) == "expand":
            col = expand.args[0]
            if isinstance(col, fx.Node) and op_name(col) == "unsqueeze" and known_int(arg(col, 1, "dim")) in (1, -1) \
                    and _is_arange(col.args[0]):
                shape = tensor_val(expand).shape
                return known_int(shape[1]) if len(shape) == 2 else None
    return None


def _is_arange(node: object) -> bool:
    """``arange(n)``: one argument, start 0, step 1."""
    return isinstance(node, fx.Node) and op_name(node) == "arange" and len(node.args) == 1 and \
        "start" not in node.kwargs and "step" not in node.kwargs


def _is_permutation(node: object) -> bool:
    """The indices of a ``sort`` or an ``argsort`` (of a 1-D tensor): a permutation of ``[0, n)``."""
    if not isinstance(node, fx.Node):
        return False
    if op_name(node) in _ARGSORTS:
        return _int_vector(node)
    if op_name(node) == "getitem" and node.args[1] == 1 and isinstance(node.args[0], fx.Node):
        return op_name(node.args[0]) == "sort" and _int_vector(node)
    return False


def _gather(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(src, idx)`` of a row gather ``src[idx]`` with a 1-D integer index."""
    if op_name(node) == "getitem" and isinstance(node.args[1], fx.Node) and _int_vector(node.args[1]):
        return node.args[0], node.args[1]
    return None


def _composed_index(graph: fx.Graph, a: fx.Node, b: fx.Node, at: fx.Node) -> fx.Node:
    """``a[b]`` as a new node before ``at``: ``b // K`` where ``a`` is the token of each row (rule 2)."""
    with graph.inserting_before(at):
        K = token_of_rows(a)
        if K is not None:
            return graph_call(graph, operator.floordiv, b, K, meta_from=at)
        return graph_call(graph, operator.getitem, a, b, meta_from=at)


def _compose_gathers(graph: fx.Graph, node: fx.Node) -> str | None:
    """Rule 2: ``x[a][b] -> x[a[b] = b // K]`` where ``a`` is the token of each row (the inner gather kept if something
    else reads it)."""
    outer = _gather(node)
    if outer is None or not isinstance(outer[0], fx.Node):
        return None
    inner = _gather(outer[0])
    # composed only where the index becomes a normal form (b // K): another composition (w[perm][inv]) would only
    # hide a form the recognisers read as it is
    if inner is None or token_of_rows(inner[1]) is None:
        return None
    (_, b), (x, a) = outer, inner
    index = _composed_index(graph, a, b, node)
    with graph.inserting_before(node):
        moved = graph_call(graph, operator.getitem, x, index, meta_from=node)
    node.replace_all_uses_with(moved)
    erase_dead(graph, [node])
    return "x[a][b] -> x[a[b]]"


def _trunc_of_order(graph: fx.Graph, node: fx.Node) -> str | None:
    """Rule 0: ``div(p, K, rounding_mode="trunc") -> p // K`` for a permutation ``p``: its values are non-negative,
    where truncation and floor agree (JetMoE's ``index_sorted_experts.div(k, rounding_mode="trunc")``)."""
    if op_name(node) != "div" or node.kwargs.get("rounding_mode") != "trunc" or len(node.args) != 2 or \
            not _is_permutation(node.args[0]) or known_int(node.args[1]) is None or known_int(node.args[1]) < 1:
        return None
    with graph.inserting_before(node):
        floor = graph_call(graph, operator.floordiv, node.args[0], known_int(node.args[1]), meta_from=node)
    node.replace_all_uses_with(floor)
    erase_dead(graph, [node])
    return "div(p, K, trunc) -> p // K"


def _token_of_gathered_rows(graph: fx.Graph, node: fx.Node) -> str | None:
    """Rule 2 on an index alone: ``(token of each row)[b] -> b // K``
    (vLLM's ``token_indices[topk_argsort_indices]``)."""
    moved = _gather(node)
    if moved is None or token_of_rows(moved[0]) is None:
        return None
    index = _composed_index(graph, moved[0], moved[1], node)
    node.replace_all_uses_with(index)
    erase_dead(graph, [node])
    return "(arange(S) // K)[b] -> b // K"


def _combine_through_inverse(graph: fx.Graph, node: fx.Node) -> str | None:
    """Rule 3: ``buf.index_add_(0, idx, y[argsort(p)]) -> buf.index_add_(0, idx[p], y)`` for a permutation ``p``."""
    if op_name(node) not in ("index_add_", "index_add") or known_int(arg(node, 1, "dim")) != 0:
        return None
    idx, src = arg(node, 2, "index"), arg(node, 3, "source")
    if not isinstance(src, fx.Node) or not _int_vector(idx):
        return None
    through = src
    cast = None
    if op_name(through) in ("to", "float", "type_as", "bfloat16", "half") and isinstance(through.args[0], fx.Node):
        cast, through = through, through.args[0]
    moved = _gather(through)
    if moved is None:
        return None
    y, inv = moved
    if op_name(inv) not in _ARGSORTS or not _is_permutation(inv.args[0]) or len(through.users) != 1 or \
            (cast is not None and len(cast.users) != 1):
        return None
    p = inv.args[0]
    new_idx = _composed_index(graph, idx, p, node)
    with graph.inserting_before(node):
        new_src = y if cast is None else graph.node_copy(cast, lambda n: y if n is through else n)
    args = list(node.args)
    if len(args) > 2:
        args[2] = new_idx
    else:
        node.kwargs = {**node.kwargs, "index": new_idx}
    if len(args) > 3:
        args[3] = new_src
    else:
        node.kwargs = {**node.kwargs, "source": new_src}
    node.args = tuple(args)
    erase_dead(graph, [c for c in (cast, through) if c is not None])
    return "index_add_(idx, y[argsort(p)]) -> index_add_(idx[p], y)"
