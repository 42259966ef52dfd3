"""``expert_parallel``'s entry point, :func:`run`: the pass as the package docstring states it."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from moe_compile.ops.expert_parallel import ep_capacity
from moe_compile.passes import NoMatch, PassContext
from moe_compile.passes._graph import (
    arg,
    erase_dead,
    fake_mode_of,
    graph_call,
    layer_name,
    op_name,
    ops_available,
    refresh_example_values,
    same_int,
    tensor_val,
    topo_index,
    transitive_users,
)
from moe_compile.passes._host_sync import erase_dead_host_reads, host_reads
from moe_compile.passes.expert_parallel.autograd_exchange import canonicalise, wait_with_grad
from moe_compile.passes.expert_parallel.match import Exchange, has_host_splits, match_exchange
from moe_compile.passes.forms.counts import mark_capacity


def run(graph: fx.Graph, ctx: PassContext) -> None:
    """Find and rewrite every provable expert-parallel exchange of ``graph``."""
    _mark_static_exchanges(graph)
    # autograd-function exchanges (Megatron's _AllToAll) -> the functional autograd collective
    for hop in canonicalise(graph):
        ctx.skip(layer_name(hop), "autograd_exchange_unproven", f"{hop.name}: an autograd.Function whose forward "
                 "calls all_to_all_single, not proven to be one exchange with the reverse exchange as its backward")
    candidates = [n for n in graph.nodes if has_host_splits(n)]
    if not candidates:
        return
    reads = host_reads(graph)
    done: set[fx.Node] = set()
    skipped: set[str] = set()
    rewrote = False
    for send in candidates:
        if send in done or send.graph is not graph:
            continue
        try:
            ex = match_exchange(send, topo_index(graph), reads)  # analysis only: the graph is not touched yet
        except NoMatch as exc:
            layer = layer_name(send)
            if layer not in skipped:  # the return exchange of a refused layer fails the same way: one record
                skipped.add(layer)
                ctx.skip(layer, exc.reason, exc.detail)
            continue
        except Exception as exc:  # noqa: BLE001 - a matcher bug must not undo other layers' rewrites
            if ctx.config.strict:
                raise
            ctx.skip(layer_name(send), "internal_error", f"matcher raised {type(exc).__name__}: {exc}")
            continue
        done.update((ex.send, ex.ret))
        if not ops_available("gather_rows", "ep_send_index", "ep_regroup_index"):
            ctx.skip(ex.layer, "ops_unavailable", "torch.ops.moe.gather_rows / ep_send_index / ep_regroup_index "
                     "not registered")
            continue
        S = ep_capacity(ex.bound, ex.num_rows, ex.world, ctx.config.ep_capacity_factor)
        replaced_by = rewrite(graph, ex, S)
        ctx.rewrite(ex.layer, ex.matched, replaced_by)
        rewrote = True
    if rewrote:
        erase_dead_host_reads(graph)


def _mark_static_exchanges(graph: fx.Graph) -> None:
    """A static exchange already in the graph (``experts/expert_parallel.py``'s ``ep_experts_forward``: swapped
    expert-parallel blocks, transformers' ``"moe_compile"`` implementation): mark its ``S`` on the router top-k whose
    ids its ``permute_pad`` groups, so that ``router_metrics`` reports the rows past ``S`` (``moe/dropped_fraction``),
    as for the exchanges this pass writes. Its send counts are ``permute_pad(x, ids).counts_E.view(W, L).sum(1)``."""
    for send in graph.nodes:
        if send.target is not torch.ops.moe.ep_send_index.default:
            continue
        per_rank = send.args[0]
        by_rank = per_rank.args[0] if isinstance(per_rank, fx.Node) and op_name(per_rank) == "sum" else None
        counts = by_rank.args[0] if isinstance(by_rank, fx.Node) and op_name(by_rank) == "view" else None
        if not (isinstance(counts, fx.Node) and op_name(counts) == "getitem" and counts.args[1] == 4):
            continue
        dispatch = counts.args[0]
        grouped = tensor_val(by_rank)
        if op_name(dispatch) == "moe.permute_pad" and grouped is not None and grouped.dim() == 2:
            mark_capacity(dispatch.args[1], send.args[2], group=int(grouped.shape[1]))


def _call(graph: fx.Graph, meta_from: fx.Node, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
    return graph_call(graph, target, *args, meta_from=meta_from, **kwargs)


def rewrite(graph: fx.Graph, ex: Exchange, S: int) -> str:
    """Apply the rewrite of a proven :class:`Exchange` with ``S`` rows per destination; returns what replaced it."""
    W, L, N = ex.world, ex.local, ex.num_rows
    gather_rows = torch.ops.moe.gather_rows.default
    group = arg(ex.send, 3, "group_name")
    # torch 2.11's autograd all-to-all waits inside an autograd function (its host-read sizes among the
    # function's inputs): the new exchange waits through ours
    wait = ex.send_waits[0].target if op_name(ex.send_waits[0]) != "autograd_function_apply" else wait_with_grad
    splits = [S] * W
    meta = ex.send
    with graph.inserting_before(ex.send):
        by_src = _call(graph, meta, torch.reshape, ex.counts, (W, L))
        send_index = _call(graph, meta, torch.ops.moe.ep_send_index.default, ex.send_counts, N, S)
        pack, slot = (_call(graph, meta, operator.getitem, send_index, i) for i in range(2))
        regroup_index = _call(graph, meta, torch.ops.moe.ep_regroup_index.default, by_src, S)
        regroup, inverse, offs = (_call(graph, meta, operator.getitem, regroup_index, i) for i in range(3))
        send_buf = _call(graph, meta, gather_rows, ex.rows, pack, slot)
        recv_buf = _call(graph, meta, wait, _call(graph, meta, ex.send.target, send_buf, splits, splits, group))
    with graph.inserting_before(ex.gather):
        grouped = _call(graph, ex.gather, gather_rows, recv_buf, regroup, inverse)
    ex.gather.replace_all_uses_with(grouped)
    for mm, old in zip(ex.grouped_mms, ex.offs):
        mm.replace_input_with(old, offs)
    # the region's values first: a fake evaluation that mixes the old (unbacked) row count with the static one would
    # leave a runtime assert on it in the shape env
    refresh_example_values(ex.region[1:])
    source = tensor_val(ex.source)
    if source is None or not same_int(source.shape[0], W * S):
        raise RuntimeError(f"expert_parallel: {ex.source.name}'s example value was not refreshed to {W * S} rows")
    with graph.inserting_before(ex.inverse_nodes[0]):
        back = _call(graph, ex.source, gather_rows, ex.source, inverse, regroup)
    with graph.inserting_before(ex.ret):
        ret_buf = _call(graph, ex.ret, wait, _call(graph, ex.ret, ex.ret.target, back, splits, splits, group))
        returned = _call(graph, ex.ret, gather_rows, ret_buf, slot, pack)
    ex.ret_waits[-1].replace_all_uses_with(returned)
    for node in (*reversed(ex.ret_waits), ex.ret):
        graph.erase_node(node)
    erase_dead(graph, [ex.back, *ex.inverse_nodes, ex.gather])
    for node in (*reversed(ex.send_waits), ex.send):  # collectives: erased by hand (FX may call them impure)
        if not node.users and not getattr(node, "_erased", False):
            graph.erase_node(node)
    erase_dead(graph, [ex.perm, *ex.offs])
    order = topo_index(graph)
    stale = transitive_users(returned)
    refresh_example_values(sorted(stale, key=order.__getitem__))
    # router_metrics (metrics=True) then counts each destination's rows past S: moe/dropped_fraction (0 at the bound)
    reported = ex.topk_ids is not None and mark_capacity(ex.topk_ids, S, group=L)
    static_counts = ex.bincount is not None and _static_histogram(graph, ex.bincount, W * L)
    row_bytes = _row_bytes(ex.rows)
    buffer = f"[{W * S}, {', '.join(str(d) for d in tensor_val(ex.rows).shape[1:])}]"
    drops = "no row dropped" if S >= ex.bound else f"rows past S={S} in a destination's block dropped"
    drops += " (reported as moe/dropped_fraction with metrics=True)" if reported else ""
    drops += "; counts: bincount -> searchsorted of the sorted ids (static length)" if static_counts else ""
    return (f"all_to_all_single x2 of a padded {buffer} buffer at equal splits [{S}]*{W} (S={S}, bound "
            f"{ex.bound_why}; {drops}; {W * S * row_bytes} bytes per buffer) + moe.gather_rows pack / regroup "
            f"(local expert, source rank) / inverse / unpack + offs from the received counts; no host read")


def _row_bytes(rows: fx.Node) -> int:
    v = tensor_val(rows)
    n = 1
    for d in v.shape[1:]:
        n *= int(d)
    return n * v.element_size()


def _static_histogram(graph: fx.Graph, bincount: fx.Node, E: int) -> bool:
    """Replace ``bincount(ids, minlength=E)`` (ids proven in ``[0, E)``: its length is ``E``, but data-dependent to
    the compiler, a host sync on CUDA) by ``diff(searchsorted(sort(ids), arange(E + 1)))``: static, no atomics."""
    ids = bincount.args[0]
    iv = tensor_val(ids)
    with graph.inserting_before(bincount):
        values = _call(graph, bincount, operator.getitem, _call(graph, bincount, torch.sort, ids), 0)
        edges = _call(graph, bincount, torch.arange, E + 1, device=iv.device, dtype=iv.dtype)
        edges.meta["example_value"] = fake_mode_of([iv]).from_tensor(edges.meta["example_value"])  # no tensor in
        counts = _call(graph, bincount, torch.diff, _call(graph, bincount, torch.searchsorted, values, edges))
    bincount.replace_all_uses_with(counts)
    graph.erase_node(bincount)
    order = topo_index(graph)
    refresh_example_values(sorted(transitive_users(counts), key=order.__getitem__))
    return True
