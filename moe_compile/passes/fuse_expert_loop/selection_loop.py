"""Per-expert selection loops, canonicalised into the sort-based dispatch the recogniser proves.

The most common MoE code: a Python loop over experts that selects expert ``e``'s tokens with
``torch.where`` / ``nonzero`` (data-dependent sizes), runs expert ``e``'s MLP on them, weights them and
``index_add_``s them into the output. Under ``fullgraph=True`` Dynamo unrolls the loop (``E`` copies,
one unbacked row count each)::

    out = zeros_like(x_TH)
    mask_EKT = one_hot(idx_TK, E).permute(2, 1, 0)           (or sel_TK = idx_TK == e)
    for e in range(E):
        kpos, tok = torch.where(mask_EKT[e])                   (tok, kpos = torch.where(idx_TK == e))
        y = MLP_e(x_TH[tok]) [* w_TK[tok, kpos, None]]
        out.index_add_(0, tok, y)

:func:`canonicalize` rewrites it into one copy of the body over the rows sorted by expert::

    ids_sorted_S, order_S = sort(idx_TK.flatten(), stable=True); tok_S = order_S // K
    offs_E = cumsum(one_hot(idx_TK.flatten(), E).sum(0)).int()
    y_S = MLP(x_TH[tok_S]) with grouped GEMMs (offs_E) [+ bias_EN[ids_sorted_S]] [* w_TK.flatten()[order_S][:, None]]
    out = zeros_like(x_TH).index_add(0, tok_S, y_S)

which ``fuse_dispatch`` then turns into ``moe.permute_pad`` / ``moe.unpad_unpermute`` like any other
sort-based layer: the loop goes through the same dispatch recogniser as every other form. Rows inside
an expert come in another order than ``where`` gives them (token-major instead of slot-major for the
one-hot form), which the row-wise body and the summing combine make irrelevant (up to the summation
order of the combine, which ``unpad_unpermute`` fixes in fp32).

Identical bodies, per-expert weights (stacked ``[E, ...]`` slices or an ``nn.ModuleList`` of MLPs) and
the GEMM plan are ``fuse_expert_loop``'s (:mod:`~moe_compile.passes.fuse_expert_loop.loop`).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx

from moe_compile.passes import NoMatch
from moe_compile.passes._graph import (
    erase_dead,
    graph_call,
    known_int,
    op_name,
    outside_users,
    tensor_val,
    topo_index,
    transitive_users,
)
from moe_compile.passes.forms.combine import read_accumulate
from moe_compile.passes.fuse_expert_loop.loop import Loop, rewrite_loop, signatures


@dataclasses.dataclass
class Selection:
    """One unrolled iteration: expert ``expert``'s tokens ``tok`` (and top-k slots ``kpos``)."""

    expert: int
    idx_TK: fx.Node
    tok: fx.Node
    kpos: fx.Node | None
    acc: fx.Node  # out.index_add_(0, tok, value)
    value: fx.Node


def _where_outputs(node: fx.Node) -> tuple[fx.Node, int] | None:
    """``(selection, i)`` for ``getitem(where(sel), i)`` / ``getitem(nonzero(sel, as_tuple=True), i)``."""
    if op_name(node) != "getitem" or not isinstance(node.args[1], int) or not isinstance(node.args[0], fx.Node):
        return None
    w = node.args[0]
    if op_name(w) == "where" and len(w.args) == 1 and not w.kwargs:
        return w.args[0], node.args[1]
    if op_name(w) == "nonzero" and w.kwargs.get("as_tuple") is True:
        return w.args[0], node.args[1]
    return None


def _selected(sel: Any) -> tuple[fx.Node, int, int] | None:
    """``(idx_TK, e, tok_position)``: ``sel`` is expert ``e``'s routing mask, and ``where(sel)[tok_position]``
    holds its tokens. Forms: ``one_hot(idx, C).permute(2, 1, 0)[e]`` ([K, T]: tokens second) and
    ``idx == e`` ([T, K]: tokens first)."""
    if not isinstance(sel, fx.Node):
        return None
    if op_name(sel) == "getitem" and isinstance(sel.args[1], int) and op_name(sel.args[0]) == "permute":
        perm = sel.args[0]
        dims = tuple(perm.args[1]) if len(perm.args) == 2 and isinstance(perm.args[1], (list, tuple)) \
            else tuple(perm.args[1:])
        one_hot = perm.args[0]
        if dims == (2, 1, 0) and op_name(one_hot) == "one_hot" and isinstance(one_hot.args[0], fx.Node):
            return one_hot.args[0], sel.args[1], 1
    if op_name(sel) in ("eq", "__eq__") and isinstance(sel.args[0], fx.Node) and isinstance(sel.args[1], int) \
            and not isinstance(sel.args[1], bool):
        return sel.args[0], sel.args[1], 0
    return None


def _selection_of(acc: fx.Node) -> Selection | None:
    a = read_accumulate(acc)
    if a is None or a.kind != "index_add" or not a.inplace or not isinstance(a.index, fx.Node):
        return None
    found = _where_outputs(a.index)
    if found is None:
        return None
    sel, i = found
    parsed = _selected(sel)
    if parsed is None or parsed[2] != i:
        return None
    idx_TK, e, _ = parsed
    iv = tensor_val(idx_TK)
    if iv is None or iv.dim() != 2 or iv.dtype.is_floating_point:
        return None
    kpos = next((u for u in a.index.args[0].users if op_name(u) == "getitem" and u.args[1] == 1 - i), None)
    return Selection(e, idx_TK, a.index, kpos, acc, a.src)


def find_selection_loops(graph: fx.Graph) -> list[tuple[fx.Node, list[Selection]]]:
    """Buffers accumulated by ``index_add_`` at per-expert ``where`` selections, with their iterations."""
    loops: dict[fx.Node, list[Selection]] = {}
    for node in graph.nodes:
        if op_name(node) != "index_add_":
            continue
        s = _selection_of(node)
        if s is not None:
            loops.setdefault(node.args[0], []).append(s)
    return list(loops.items())


def _row_gather(tok: fx.Node) -> fx.Node | None:
    """The gather of token rows by ``tok``: ``x[tok]`` / ``x.index_select(0, tok)`` of a 2-D ``x``."""
    for u in tok.users:
        if op_name(u) == "getitem" and u.args[1] is tok:
            pass
        elif op_name(u) == "index_select" and u.args[2] is tok and known_int(u.args[1]) == 0:
            pass
        else:
            continue
        xv = tensor_val(u.args[0])
        if xv is not None and xv.dim() == 2:
            return u
    return None


def _weight_gather(s: Selection) -> tuple[fx.Node, fx.Node, bool] | None:
    """``(gather, w_TK, column)`` for ``w_TK[tok, kpos]`` (``column``: ``w_TK[tok, kpos, None]``)."""
    if s.kpos is None:
        return None
    for u in s.tok.users:
        if op_name(u) != "getitem" or not isinstance(u.args[1], tuple):
            continue
        index = u.args[1]
        if index[:2] == (s.tok, s.kpos) and (len(index) == 2 or (len(index) == 3 and index[2] is None)):
            wv = tensor_val(u.args[0])
            if wv is not None and wv.dim() == 2 and wv.dtype.is_floating_point:
                return u, u.args[0], len(index) == 3
    return None


def canonicalize(graph: fx.Graph, out: fx.Node, sels: list[Selection]) -> str:
    """Rewrite one selection loop (see the module docstring); raises NoMatch before any edit."""

    sels = sorted(sels, key=lambda s: s.expert)
    E = len(sels)
    idx_TK = sels[0].idx_TK
    if [s.expert for s in sels] != list(range(E)) or any(s.idx_TK is not idx_TK for s in sels):
        raise NoMatch("loop_not_matched", f"{out.name} accumulates selections of experts "
                      f"{[s.expert for s in sels]} of {len({s.idx_TK for s in sels})} id tensor(s), not 0..E-1")
    if op_name(out) not in ("zeros_like", "zeros", "new_zeros"):
        raise NoMatch("loop_not_matched", f"{out.name} is not a fresh zeros buffer")
    order = topo_index(graph)
    accs = [s.acc for s in sels]
    last = max(accs, key=order.__getitem__)
    if any(order[u] < order[last] and u not in accs for u in out.users):
        raise NoMatch("combine_buffer_reused", f"{out.name} is read between the experts' index_add_")
    chunks, weight_gathers, w_TK, column = [], [], None, None
    for s in sels:
        g = _row_gather(s.tok)
        if g is None:
            raise NoMatch("loop_not_matched", f"expert {s.expert}: no token-row gather by {s.tok.name}")
        chunks.append(g)
        wg = _weight_gather(s)
        if wg is not None:
            if w_TK is not None and (wg[1] is not w_TK or wg[2] != column):
                raise NoMatch("experts_not_identical", "experts gather different routing weights")
            w_TK, column = wg[1], wg[2]
            weight_gathers.append(wg[0])
    x_TH = chunks[0].args[0]
    if any(c.args[0] is not x_TH for c in chunks) or (weight_gathers and len(weight_gathers) != E):
        raise NoMatch("experts_not_identical", "experts gather different token rows or weights")
    bodies = []
    for s, chunk in zip(sels, chunks):
        sources = {chunk, *(g for g in weight_gathers if s.tok in g.all_input_nodes)}
        forward = set().union(*(transitive_users(n) for n in sources)) | sources
        body, stack = set(), [s.value]
        while stack:
            n = stack.pop()
            if n in body or n in sources:
                continue
            if n not in forward:
                raise NoMatch("loop_not_matched", f"expert {s.expert}'s output depends on {n.name} outside its body")
            body.add(n)
            stack.extend(a for a in n.all_input_nodes if a in forward)
        for n in body | sources:
            bad = outside_users([n], body | {s.acc})
            if bad:
                raise NoMatch("expert_region_escapes", f"{n.name} (expert {s.expert}) is also used by {bad[0].name}")
        bodies.append(sorted(body, key=order.__getitem__))

    K = tensor_val(idx_TK).shape[1]
    anchor = max([idx_TK, x_TH] + ([w_TK] if w_TK is not None else []), key=order.__getitem__)
    meta = sels[0].acc
    with graph.inserting_before(anchor.next):
        ids_S = graph_call(graph, torch.reshape, idx_TK, (-1,), meta_from=meta)
        sort = graph_call(graph, torch.sort, ids_S, stable=True, meta_from=meta)
        ids_sorted_S = graph_call(graph, operator.getitem, sort, 0, meta_from=meta)
        order_S = graph_call(graph, operator.getitem, sort, 1, meta_from=meta)
        tok_S = graph_call(graph, operator.floordiv, order_S, K, meta_from=meta)
        x_SH = graph_call(graph, operator.getitem, x_TH, tok_S, meta_from=meta)
        one_hot = graph_call(graph, torch.nn.functional.one_hot, ids_S, E, meta_from=meta)
        counts_E = graph_call(graph, torch.sum, one_hot, 0, meta_from=meta)
        cumsum = graph_call(graph, torch.cumsum, counts_E, 0, meta_from=meta)
        offs_E = graph_call(graph, torch.Tensor.to, cumsum, torch.int32, meta_from=meta)
        row_inputs = {}
        if w_TK is not None:
            w_flat = graph_call(graph, torch.reshape, w_TK, (-1,), meta_from=meta)
            w_S = graph_call(graph, operator.getitem, w_flat, order_S, meta_from=meta)
            w_rows = graph_call(graph, torch.unsqueeze, w_S, -1, meta_from=meta) if column else w_S
            row_inputs[weight_gathers[0]] = w_rows
    with graph.inserting_before(last):
        values_cat = graph_call(graph, torch.cat, [s.value for s in sels], meta_from=meta)
        combined = graph_call(graph, torch.Tensor.index_add, out, 0, tok_S, values_cat, meta_from=meta)
    loop = Loop(split=x_SH, x_NH=x_SH, cat=values_cat, bodies=bodies, chunks=chunks, outputs=[s.value for s in sels])
    try:
        _, slots = signatures(loop)
        replaced_by = rewrite_loop(graph, loop, slots, offs=offs_E, row_inputs=row_inputs, row_expert=ids_sorted_S)
    except NoMatch:
        graph.erase_node(combined)
        graph.erase_node(values_cat)
        erase_dead(graph, list(row_inputs.values()) + [offs_E, x_SH, ids_sorted_S])
        raise
    erase_dead(graph, [ids_sorted_S])
    order = topo_index(graph)
    for u in list(out.users):
        if u is not combined and u not in accs and order[u] > order[combined]:
            u.replace_input_with(out, combined)
    wheres = [s.tok.args[0] for s in sels]
    for acc in accs:  # the in-place accumulates are replaced by `combined`; nothing reads their result
        if not acc.users:
            graph.erase_node(acc)
    erase_dead(graph, [s.value for s in sels] + chunks + weight_gathers + [n for b in bodies for n in b])
    _erase_selections(graph, wheres)
    return f"{E} where-selections -> argsort dispatch + " + replaced_by


_SIZE_CHECKS = {"getitem", "sym_size", "sym_size.int", "aten.sym_size", "ge", "le", "lt", "gt", "eq", "and",
                "aten._assert_scalar", "_assert_scalar", "_check", "_check_is_size", "sym_constrain_range_for_size"}


def _erase_selections(graph: fx.Graph, wheres: list[fx.Node]) -> None:
    """Erase the ``where`` / ``nonzero`` nodes once only their unbacked-size checks use them (the
    ``_assert_scalar`` nodes are side-effecting, so dead-code elimination keeps them)."""
    order = topo_index(graph)
    for w in wheres:
        if getattr(w, "_erased", False):
            continue
        users = transitive_users(w)
        if all(op_name(u) in _SIZE_CHECKS or u.target is torch.ops.aten.sym_size.int for u in users):
            for u in sorted(users, key=order.__getitem__, reverse=True):
                u.users.clear()
                graph.erase_node(u)
            erase_dead(graph, [w])


__all__ = ["Selection", "canonicalize", "find_selection_loops"]
