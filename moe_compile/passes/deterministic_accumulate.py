"""Accumulating scatters into fresh zeros that need no accumulation, or no atomics, in the joint graph.

Inductor lowers every ``index_put(accumulate=True)`` / ``scatter_add`` / ``index_add`` to atomic adds on
the GPU: run-to-run differences in the gradients. Next to MoE layers they come from backward formulas:
the router's ``scores.gather(-1, topk_idx)`` (backward: ``scatter_add`` into zeros at the top-k
indices), a gather by a sort permutation (``w[perm]``), a per-expert bias or scale gathered by expert
id (``bias_EN[ids]``: ``index_put(accumulate=True)`` into ``[E, N]``).

Matches (one :class:`~moe_compile.passes.forms.accumulate.Accumulate` per node, into a fresh zero tensor):
    (a) indices distinct along the scatter dim (``topk`` / ``sort`` indices; see ``distinct_along``)::

        z = full([T, E], 0); g = scatter_add(z, 1, topk_idx_TK, grad_TK)

    (b) a 1-D index into a small first dim (``E <= MAX_ONE_HOT_ROWS``) that is a routing choice (the expert ids
    a ``topk`` over ``E`` scores picks: ``forms.accumulate.routing_choice``) and that a forward gather of a tensor
    with that first dim uses: an expert dispatch's backward (a per-expert bias or scale gathered by expert id)::

        b_M = index(bias_EN, [ids_M]) ...  z = full([E, N], 0); g = index_put(z, [ids_M], grad_MN, True)

    The same gather by the user's own indices (an embedding-like table: ``table[idx]``, ``index_add_`` into a
    5-row table) is no expert dispatch and is left to Inductor: rule (b) sums in another order than Inductor's
    scatter, so it would change the gradient's bits where the model has no MoE layer at all (issue 35).

Outside MoE layers only rule (a) fires: it stores the values Inductor's scatter-add into zeros computes (each
element takes one add to zero), bitwise the same up to the sign of a zero, which Inductor's own code does not keep
either (its C++ is compiled with ``-fno-signed-zeros``). Its records say ``moe=False`` (``explain`` lists them
apart from the MoE rewrites): it is no MoE rewrite, wherever it happens.

    A ``scatter_add`` into a live tensor with indices as in (a) (a custom router backward: PhiMoE's
    ``grad.scatter_add_(-1, selected_experts, g)``) is left as it is: it adds at most once into each element,
    so it is reproducible, and rewriting it changed its bits under Inductor
    (NOTE [one add into a live tensor] (moe_compile/passes/forms/accumulate.py)).

Rewrites to:
    (a) ``scatter(z, 1, topk_idx_TK, grad_TK)`` / ``index_put(z, [perm], src, False)``: plain stores, the
    same values, no atomics. (b) ``mm(one_hot_ME.T, grad_MN)``: each ``g[e]`` is a GEMM's fixed-order
    fp32 sum over the rows of expert ``e`` (bitwise reproducible; ``one_hot`` is exact in any dtype);
    ``E*M*N`` multiply-adds, memory-bound like the scatter for ``E <= 256``.

Skips when (reason tags): ``base_not_zeros`` (accumulating into a live tensor), ``index_not_distinct``
(neither rule proves the rewrite), ``not_expert_ids`` (rule (b)'s gather, by indices that are no routing choice),
``too_many_rows`` (rule (b) past ``MAX_ONE_HOT_ROWS``). Accumulations
outside any module (``<graph>``) are skipped silently, as is the token embedding's backward
(``embedding_dense_backward``), which is left to Inductor.

Stage:
    joint (ATen, functional): the only stage that sees backward formulas before the partitioner.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from moe_compile.passes import PassContext
from moe_compile.passes._graph import (
    erase_dead,
    graph_call,
    insert_traced,
    known_int,
    layer_name,
    op_name,
    tensor_val,
)
from moe_compile.passes.forms import accumulate as acc

aten = torch.ops.aten

# Rule (b) costs E multiply-adds per element of src: memory-bound (like the scatter it replaces) up to
# ~E = 256 on current datacenter GPUs (their bf16 MMA rate over their bandwidth in 2-byte reads is a few hundred
# flops per element read).
MAX_ONE_HOT_ROWS = 256


def run(graph: fx.Graph, ctx: PassContext) -> None:
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in acc.ACCUMULATING_FORMS:
            continue
        a = acc.read(node)
        if a is None or (acc.adds_at_most_once(node) and not acc.is_zeros(a.base)):
            # reproducible as it is (NOTE [one add into a live tensor] (moe_compile/passes/forms/accumulate.py))
            continue
        layer = layer_name(node)
        reason, detail = _rewrite(graph, a)
        if reason is None:
            one_hot = detail.startswith("one-hot")  # rule (b): proven an expert dispatch's backward
            ctx.rewrite(layer, f"{a.kind}(accumulate) [{_index_desc(a)}]", detail, moe=one_hot)
        elif layer != "<graph>":
            ctx.skip(layer, reason, detail)


def _index_desc(a: acc.Accumulate) -> str:
    src = a.index.args[0] if isinstance(a.index, fx.Node) and op_name(a.index) == "getitem" else a.index
    return (op_name(src) or src.name) if isinstance(src, fx.Node) else "?"


def _rewrite(graph: fx.Graph, a: acc.Accumulate) -> tuple[str | None, str]:
    if not acc.is_zeros(a.base):
        return "base_not_zeros", f"{a.kind} adds into a live tensor ({a.base}) at indices that may repeat"
    base = tensor_val(a.base)
    if acc.distinct_along(a.index, a.dim):
        with graph.inserting_before(a.node):
            if a.kind == "scatter_add":
                new = graph_call(graph, aten.scatter.src, a.base, a.dim, a.index, a.src, meta_from=a.node)
            elif a.dim == 0 and tensor_val(a.index) is not None and tensor_val(a.index).dim() == 1:
                new = graph_call(graph, aten.index_put.default, a.base, [a.index], a.src, False, meta_from=a.node)
            else:
                return "index_not_distinct", f"{a.kind} along dim {a.dim}"
        _replace(graph, a.node, new)
        return None, "scatter (distinct indices, no accumulation)" if a.kind == "scatter_add" else \
            "index_put (distinct indices, no accumulation)"
    rows = known_int(base.shape[0]) if base is not None and base.dim() >= 1 else None
    index = tensor_val(a.index)
    if a.kind != "index_put" or rows is None or index is None or not _bounded_by_gather(a.index, base):
        return "index_not_distinct", f"{a.kind} with indices that may repeat ({_index_desc(a)})"
    if rows > MAX_ONE_HOT_ROWS:
        return "too_many_rows", f"{a.kind} into {rows} rows (one-hot GEMM limit {MAX_ONE_HOT_ROWS})"
    if not acc.routing_choice(a.index, rows):
        return "not_expert_ids", f"{a.kind} into {rows} rows by indices that are no routing choice " \
                                 f"({_index_desc(a)}): not an expert dispatch, left to Inductor"
    with graph.inserting_before(a.node):
        new = _one_hot_sum(graph, a, rows)
    _replace(graph, a.node, new)
    return None, f"one-hot GEMM over {rows} rows (fixed-order sum, no atomics)"


def _bounded_by_gather(index: fx.Node, base: torch.Tensor) -> bool:
    """Whether a forward ``aten.index(t, [index])`` of a tensor with ``base``'s first dim uses ``index``:
    that gather raises on out-of-range values, so every value is in ``[-rows, rows)``."""
    for user in index.users:
        if user.target == aten.index.Tensor and isinstance(user.args[1], (list, tuple)) \
                and len(user.args[1]) == 1 and user.args[1][0] is index:
            src = tensor_val(user.args[0])
            if src is not None and src.dim() >= 1 and known_int(src.shape[0]) == known_int(base.shape[0]):
                return True
    return False


def _one_hot_sum(graph: fx.Graph, a: acc.Accumulate, rows: int) -> fx.Node:
    base = tensor_val(a.base)
    # the row width from the table's static shape: reshape(M, -1) with an unbacked M (rows from a per-expert
    # torch.where) makes the tracer assume M != 0, a runtime assert that fires for an expert with no token
    width = math.prod(base.shape[1:])

    def one_hot_sum(index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        idx_M = index.reshape(-1).remainder(rows)  # index_put wraps negative indices
        one_hot_ME = (idx_M.unsqueeze(1) == torch.arange(rows, device=idx_M.device)).to(src.dtype)
        summed = one_hot_ME.t() @ src.reshape(idx_M.shape[0], width)
        return summed.reshape(base.shape).to(base.dtype)

    return insert_traced(graph, one_hot_sum, (a.index, a.src), meta_from=a.node)


def _replace(graph: fx.Graph, old: fx.Node, new: fx.Node) -> None:
    old.replace_all_uses_with(new)
    erase_dead(graph, [old])
