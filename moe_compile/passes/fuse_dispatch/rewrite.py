"""``fuse_dispatch``'s entry point, :func:`run`: the pass as the package docstring states it."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from moe_compile.passes import NoMatch, PassContext
from moe_compile.passes._graph import (
    arg,
    erase_dead,
    graph_call,
    layer_name,
    op_name,
    ops_available,
    same_int,
    tensor_val,
    topo_index,
)
from moe_compile.passes.fuse_dispatch.match import (
    Dispatch,
    find_dispatch_anchors,
    looks_like_dispatch,
    match_dispatch,
)


def run(graph: fx.Graph, ctx: PassContext) -> None:
    """Find and rewrite every provable dispatch region of ``graph``."""
    for sort in find_dispatch_anchors(graph):
        if sort.graph is not graph or getattr(sort, "_erased", False):
            continue
        try:
            dispatch = match_dispatch(sort, topo_index(graph))  # analysis only: the graph is not touched yet
        except NoMatch as exc:
            if looks_like_dispatch(sort):  # only then is the detail formatted
                ctx.skip(layer_name(sort), exc.reason, exc.detail)
            continue
        except Exception as exc:  # noqa: BLE001 - a matcher bug must not undo other layers' rewrites
            if ctx.config.strict:
                raise
            ctx.skip(layer_name(sort), "internal_error", f"matcher raised {type(exc).__name__}: {exc}")
            continue
        if not ops_available("permute_pad", "unpad_unpermute"):
            ctx.skip(dispatch.layer, "ops_unavailable", "torch.ops.moe.permute_pad / unpad_unpermute not registered")
            continue
        replaced_by = rewrite(graph, dispatch, debug=ctx.config.debug)
        ctx.rewrite(dispatch.layer, " + ".join(dispatch.matched), replaced_by)


def _call(graph: fx.Graph, meta_from: fx.Node, target: Any, *args: Any, name: str | None = None,
          **kwargs: Any) -> fx.Node:
    return graph_call(graph, target, *args, meta_from=meta_from, name=name, **kwargs)


def rewrite(graph: fx.Graph, d: Dispatch, debug: bool = False) -> str:
    """Apply the rewrite for a proven :class:`Dispatch`; returns a description of what replaced it.

    ``debug`` (``moe.debug``) turns on the ops' device-side range asserts.
    """
    extra = {"debug": True} if debug else {}
    order = topo_index(graph)
    inputs = [n for n in (d.x_TH, d.ids_TK or d.ids_flat, d.probs_TK or d.probs_flat, d.top_k)
              if isinstance(n, fx.Node)]
    anchor = max(inputs, key=order.__getitem__)
    meta = d.sort

    with graph.inserting_before(anchor.next):
        ids_TK = d.ids_TK
        if ids_TK is None:
            ids_TK = _call(graph, meta, torch.reshape, d.ids_flat, (-1, d.top_k))
        probs_TK = d.probs_TK
        if probs_TK is None and d.probs_flat is not None:
            probs_TK = _call(graph, meta, torch.reshape, d.probs_flat, (-1, d.top_k))
        gathered_weights = [g for g in d.weight_gathers if d.fold is None or g is not d.fold.weight_gather]
        use_probs = probs_TK is not None and bool(
            gathered_weights or (d.padding and (d.padding.prob_seeds or d.padding.weighted_seeds)))
        pp = _call(graph, meta, torch.ops.moe.permute_pad.default, d.x_TH, ids_TK,
                   probs_TK if use_probs else None, d.num_experts, d.align, name="permute_pad", **extra)
        rows = _call(graph, meta, operator.getitem, pp, 0, name="rows_MH")
        probs_M = _call(graph, meta, operator.getitem, pp, 1, name="probs_M") if use_probs else None
        offs = _call(graph, meta, operator.getitem, pp, 2, name="offs_E")
        row_map = _call(graph, meta, operator.getitem, pp, 3, name="row_map")

    dead: list[fx.Node] = []
    padding = d.padding
    if padding is not None:
        for w in padding.writes:  # the padded buffers are rebuilt by permute_pad
            dead.append(w)
        rows_in_user_buffer = rows
        if not same_int(tensor_val(rows).shape[0], padding.num_rows):
            with graph.inserting_after(row_map):
                extra_rows = padding.num_rows - tensor_val(rows).shape[0]
                rows_in_user_buffer = _call(graph, meta, torch.nn.functional.pad, rows, (0, 0, 0, extra_rows))
                if probs_M is not None:
                    probs_M = _call(graph, meta, torch.nn.functional.pad, probs_M, (0, extra_rows))
        weighted_rows = None
        if padding.weighted_seeds:
            if probs_M is None:
                raise AssertionError("rows weighted before the experts without probs")
            with graph.inserting_before((rows_in_user_buffer if rows_in_user_buffer is not rows else row_map).next):
                column = _call(graph, meta, torch.Tensor.unsqueeze, probs_M, -1)
                column = _call(graph, meta, torch.Tensor.to, column, tensor_val(rows).dtype)
                weighted_rows = _call(graph, meta, torch.mul, rows_in_user_buffer, column)
        for seed in padding.seeds:
            _replace(seed, weighted_rows if seed in padding.weighted_seeds else rows_in_user_buffer, dead)
        for seed in padding.prob_seeds:
            _replace(seed, probs_M, dead)
        for unpad in d.unpads:
            _replace(unpad, unpad.args[0], dead)
        if not same_int(padding.num_rows, tensor_val(d.perm).shape[0]):
            _fix_row_counts(d)
    for g in d.token_gathers:
        _replace(g, rows, dead)
    for g in gathered_weights:
        if probs_M is None:
            raise AssertionError("weight gather without probs")
        _replace(g, probs_M, dead)
    for mm in d.grouped_mms:
        old = arg(mm, 2, "offs")
        if len(mm.args) > 2:
            mm.update_arg(2, offs)
        else:
            mm.update_kwarg("offs", offs)
        dead.append(old)

    c = d.combine
    with graph.inserting_before(c.result):
        if d.fold is None:
            source = c.source
            if source in d.unpads:
                source = source.args[0]
            combined = _call(graph, c.result, torch.ops.moe.unpad_unpermute.default, source, row_map, c.weight_TK,
                             name="combined", **extra)
            if tensor_val(combined).dtype != tensor_val(c.result).dtype:
                combined = _call(graph, c.result, torch.Tensor.to, combined, tensor_val(c.result).dtype)
        else:
            # NOTE [weight fold]: y[t] = sum_k w[t, k] * rows[row(t, k)] in fp32, cast once to the rows'
            # dtype; the matcher checked that the combined result is only used at that dtype.
            rows_to_combine = d.fold.rows
            if rows_to_combine in d.unpads:
                rows_to_combine = rows_to_combine.args[0]  # Y[dest] was replaced by Y
            combined = _call(graph, c.result, torch.ops.moe.unpad_unpermute.default, rows_to_combine, row_map,
                             probs_TK, name="combined", **extra)
            dead.extend(d.fold.nodes)
            dead.append(d.fold.weight_gather)
    c.result.replace_all_uses_with(combined)
    if c.inplace_buffer is not None:
        after = {n for n in c.inplace_buffer.users if n is not c.result}
        order = topo_index(graph)
        for user in after:
            if order[user] > order[c.result]:
                user.replace_input_with(c.inplace_buffer, combined)
        dead.append(c.inplace_buffer)
    dead.extend(c.nodes)
    dropped = _drop_sentinel_masks(graph, d, dead)
    dead.extend(d.id_clamps)
    dead.append(d.sort)
    erase_dead(graph, dead)

    parts = [f"moe.permute_pad(E={d.num_experts}, align={d.align}{', probs' if probs_M is not None else ''})",
             f"{len(d.grouped_mms)}x grouped_mm(offs_E)",
             "moe.unpad_unpermute" + ("(probs: weight folded, fp32 accumulate)" if d.fold else "")]
    if dropped:
        parts.append(f"{dropped} sentinel masked_fill dropped")
    return " + ".join(parts)


_MASK_VIEWS = ("unsqueeze", "view", "reshape", "expand", "expand_as")


def _drop_sentinel_masks(graph: fx.Graph, d: Dispatch, dead: list[fx.Node]) -> int:
    """Remove ``masked_fill(rows, ids_sorted >= E, v)`` (and its in-place form): returns how many.

    transformers masks the rows of expert-parallel sentinel ids (``>= E``) around each grouped GEMM.
    The matcher proved the ids in ``[0, E)`` (a router's top-k over ``E`` scores; ``permute_pad``'s
    contract) and found the tests (``d.sentinel_tests``), so such a mask is all False and the fill is
    the identity. Without this, each fill is a full extra pass over the routed rows (and another in the
    backward), and the sort stays alive for the mask.
    """
    dropped = 0
    for cmp in d.sentinel_tests:
        masks, fills, work = {cmp}, [], [cmp]
        while work:
            for u in work.pop().users:
                name = op_name(u)
                if name in _MASK_VIEWS and u.args and u.args[0] in masks:
                    masks.add(u)
                    work.append(u)
                elif name in ("masked_fill", "masked_fill_") and arg(u, 1, "mask") in masks \
                        and arg(u, 0, "input") not in masks:
                    fills.append(u)
        for fill in fills:
            fill.replace_all_uses_with(arg(fill, 0, "input"))
            graph.erase_node(fill)
            dropped += 1
        dead.extend(masks)
    return dropped


def _replace(old: fx.Node, new: fx.Node, dead: list[fx.Node]) -> None:
    dead_set = set(dead)
    old.replace_all_uses_with(new, delete_user_cb=lambda user: user not in dead_set)
    dead.append(old)


def _fix_row_counts(d: Dispatch) -> None:
    """Views in sorted-row space that name the row count get ``-1`` (rows are now the padded rows)."""
    for node, space in d.region.items():
        if space != "S" or op_name(node) not in ("view", "reshape"):
            continue
        shape = list(node.args[1:])
        if len(shape) == 1 and isinstance(shape[0], (list, tuple)):
            shape = list(shape[0])
            node.args = (node.args[0], tuple([-1, *shape[1:]]))
        else:
            node.args = (node.args[0], -1, *shape[1:])
