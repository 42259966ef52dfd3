"""Megatron-LM's drop-and-pad dispatch: gathers and a ``scatter_add_`` at argsort slots -> fixed-order gathers and sums.

Megatron's capacity mode with ``moe_pad_expert_input_to_capacity`` gives every expert exactly ``C`` rows: the routing
map (``[T, E]``, ``C`` tokens per expert after the capacity drop) turned ``[E, T]``, ``argsort(descending=True,
stable=True)[:, :C]`` for each expert's tokens in token order, the rows gathered at those tokens, the experts run over
``[E, C, H]``, and the combine a ``scatter_add_`` of the weighted rows into a zero ``[T, H]`` buffer. Eager and plain
Inductor add with atomics there (forward: the combine; backward: the gathers' ``index_add``), so neither direction is
reproducible on the GPU.

Matches (Dynamo's Torch IR)::

    slots_EC = argsort(map_ET, dim=-1, descending=True, ...)[:, :C]          (sorted along the token dim, T entries)
    idx_N    = a view of slots_EC (N = E*C), or an index computed from it (the gates' flat ``e*T + t``)
    rows     = src.index_select(0, idx_N)   /  src[idx_N]                     (any such gather)
    out_TH   = zeros(T, H).scatter_add_(0, slots_N.unsqueeze(1).expand(-1, H), y_NH)   (index_add_(0, slots_N, y_NH))

Rewrites to::

    rows     = gather_segment_sum(src, idx_N, arange(N), N, idx_sorted=True)   (the same gather; backward: a
                                                                                 fixed-order sum per source row)
    out_TH   = segment_sum(y_NH, slots_N, T)                                     (each token's rows in slot order)

Both are the ops they replace for any index values: the gathers bitwise, the combine up to the order of its adds
(fp32 accumulation, one rounding). No atomics forward or backward, no host sync.

Skips when (reason tags): ``symbolic_shape`` (the tokens or slots are not numbers: a dynamic-shape compile),
``combine_buffer_reused`` (the zero buffer is read or written elsewhere before the
combine), ``unexpected_signature`` (a gather along another dim, a combine whose rows or buffer do not match).

Metrics: the capacity ``C`` is recorded on the router's ``topk`` over the experts that the routing map comes from;
with ``metrics=True`` ``router_metrics`` reports the choices past ``C`` (``moe/dropped_fraction``).

Stage: pre-grad (AOTAutograd differentiates the ops' registered backward).

Seen in: ``tests/models/capacity_layers.py::MegatronDropAndPadMoE`` (Megatron-LM ``moe_utils.permute`` /
``unpermute`` with ``drop_and_pad=True``).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from moe_compile.ops.segment_sum import gather_segment_sum, segment_sum
from moe_compile.passes import NoMatch, PassContext
from moe_compile.passes._graph import (
    CAPACITY_META,
    arg,
    erase_dead,
    graph_call,
    known_int,
    layer_name,
    op_name,
    tensor_val,
    topo_index,
    transitive_users,
)
from moe_compile.passes.forms.combine import read_accumulate
from moe_compile.passes.forms.ops import is_zeros

_GATHERS = ("index_select", "getitem")


def run(graph: fx.Graph, ctx: PassContext) -> None:
    for node in list(graph.nodes):
        slots = _slot_sort(node)
        if slots is None:
            continue
        layer = layer_name(node)
        derived = transitive_users(slots)
        order = topo_index(graph)
        done = []
        for user in sorted(derived, key=order.__getitem__):
            if user.graph is not graph:
                continue
            try:
                what = _rewrite_combine(graph, user, derived) or _rewrite_gather(graph, user, derived)
            except NoMatch as skip:
                ctx.skip(layer, skip.reason, skip.detail)
                continue
            if what:
                done.append(what)
        if done:
            _mark_capacity(node)
            ctx.rewrite(layer, f"drop-and-pad dispatch at argsort slots ({node.name}): " + "; ".join(done),
                        "moe_compile.passes.drop_and_pad: moe.gather_segment_sum gathers and a moe.segment_sum "
                        "combine (fixed order, no atomics)")


def _slot_sort(node: fx.Node) -> fx.Node | None:
    """``argsort(m, descending=True)[:, :C]`` over the last dim of a 2-D ``m``: the slice node, else None."""
    if op_name(node) != "getitem" or not isinstance(node.args[0], fx.Node):
        return None
    sort = node.args[0]
    if op_name(sort) != "argsort" or not arg(sort, 2, "descending", False):
        return None
    m = tensor_val(sort.args[0]) if isinstance(sort.args[0], fx.Node) else None
    if m is None or m.dim() != 2 or known_int(arg(sort, 1, "dim", -1)) not in (-1, 1):
        return None
    index = node.args[1]
    if not (isinstance(index, tuple) and len(index) == 2 and index[0] == slice(None)
            and isinstance(index[1], slice) and index[1].start in (None, 0) and index[1].step in (None, 1)):
        return None
    return node


def _mark_capacity(slots: fx.Node, depth: int = 12) -> None:
    """Record ``C`` (the slots' count per expert) on the router's ``topk`` over the experts (last dim) that the
    routing map comes from, found by walking up from the argsort: ``router_metrics`` then reports the choices past
    ``C`` (``moe/dropped_fraction``), whatever the drop policy picked."""
    C = known_int(tensor_val(slots).shape[-1])
    if C is None:
        return
    frontier, seen = [slots.args[0]], set()
    for _ in range(depth):
        nxt = []
        for n in frontier:
            if not isinstance(n, fx.Node) or n in seen:
                continue
            seen.add(n)
            if op_name(n) == "topk" and known_int(arg(n, 2, "dim", -1)) in (-1, tensor_val(n.args[0]).dim() - 1):
                n.meta.setdefault(CAPACITY_META, C)
                return
            nxt.extend(a for a in n.all_input_nodes)
        frontier = nxt


def _gather_rows(src: torch.Tensor, idx_N: torch.Tensor) -> torch.Tensor:
    """``src[idx_N]`` (rows along dim 0) with a fixed-order backward."""
    flat = src.reshape(src.shape[0], -1)
    n = idx_N.shape[0]
    entries = torch.arange(n, device=idx_N.device)
    return gather_segment_sum(flat, idx_N, entries, n, idx_sorted=True).view(n, *src.shape[1:])


def _rewrite_gather(graph: fx.Graph, node: fx.Node, derived: set[fx.Node]) -> str | None:
    name = op_name(node)
    if name not in _GATHERS or not isinstance(node.args[0], fx.Node):
        return None
    if name == "index_select":
        if known_int(arg(node, 1, "dim")) != 0:
            raise NoMatch("unexpected_signature", f"{node.name}: a gather along dim {arg(node, 1, 'dim')}")
        idx = arg(node, 2, "index")
    else:
        idx = node.args[1]
    if not isinstance(idx, fx.Node) or idx not in derived:
        return None
    src, iv = tensor_val(node.args[0]), tensor_val(idx)
    if src is None or iv is None or iv.dim() != 1 or iv.dtype.is_floating_point or iv.dtype == torch.bool \
            or not src.is_floating_point() or src.dim() == 0:
        return None
    if known_int(iv.shape[0]) is None:
        raise NoMatch("symbolic_shape", f"{node.name}: {iv.shape[0]} gathered rows (a dynamic-shape compile)")
    what = f"gather {name}({node.args[0].name})"
    with graph.inserting_before(node):
        new = graph_call(graph, _gather_rows, node.args[0], idx, meta_from=node)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return what


def _rewrite_combine(graph: fx.Graph, node: fx.Node, derived: set[fx.Node]) -> str | None:
    acc = read_accumulate(node)
    if acc is None or acc.kind not in ("scatter_add", "index_add") or not isinstance(acc.index, fx.Node) \
            or acc.index not in derived:
        return None
    buf, y = acc.buffer, acc.src
    bv, yv, iv = tensor_val(buf), tensor_val(y), tensor_val(acc.index)
    if not isinstance(buf, fx.Node) or not is_zeros(buf) or bv is None or yv is None or iv is None \
            or bv.dim() != 2 or yv.dim() != 2 or bv.shape[1] != yv.shape[1] or yv.shape[0] != iv.shape[0] \
            or bv.dtype != yv.dtype:
        raise NoMatch("unexpected_signature", f"{node.name}: the combine's buffer or rows do not match "
                      f"(buffer {getattr(bv, 'shape', None)}, rows {getattr(yv, 'shape', None)})")
    if known_int(bv.shape[0]) is None or known_int(yv.shape[0]) is None:
        raise NoMatch("symbolic_shape", f"{node.name}: {bv.shape[0]} tokens, {yv.shape[0]} slots "
                      "(a dynamic-shape compile)")
    order = topo_index(graph)
    early = [u for u in buf.users if u is not node and order[u] < order[node]]
    if early or (not acc.inplace and len(buf.users) > 1):
        raise NoMatch("combine_buffer_reused", f"{buf.name} is used before or beside {node.name}")
    what = f"combine {op_name(node)} into {buf.name}"
    with graph.inserting_before(node):
        new = graph_call(graph, segment_sum, y, acc.index, known_int(bv.shape[0]), meta_from=node)
    for user in list(buf.users):
        if user is not node:
            user.replace_input_with(buf, new)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    erase_dead(graph, [buf])
    return what


__all__ = ["run"]

