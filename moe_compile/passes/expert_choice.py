"""Expert-choice routing: the accumulations into the tokens' rows become fixed-order segment sums, without atomics.

In expert-choice routing (Zhou et al. 2022) every expert takes its top-``C`` tokens by router score, so a token is
taken by 0 to ``E`` experts. Its combine adds each expert's rows into the tokens' rows, and the backward of the
gather of the tokens' rows does the same with the gradients: accumulations with repeated indices, which Inductor
emits as atomic adds (results that change from run to run on a GPU).

Matches (ATen joint graph; ``T`` tokens, ``C`` per expert)::

    w_EC, tok_EC = topk(scores_TE.t(), C)          (or topk(scores_TE, C, dim=0); views and int casts after it)
    out_TH = index_add(zeros(T, H), 0, tok.view(-1), rows)            combine
    grad_x = index_put(zeros(T, H), [tok], grad_rows, accumulate=True)  backward of x[tok]

i.e. any accumulation into a fresh ``zeros`` along its rows whose index is the indices output of a ``topk`` along
the rows of a ``[rows, E]`` matrix (directly, ``dim=0``, or along the last dim of its transpose) with as many rows
as the target (a choice of rows among the target's rows).

Rewrites to (each such accumulation; ``N = E*C`` entries, each expert's ``C`` tokens distinct)::

    present_TE = zeros(T*E + 1, bool).scatter(0, tok*E + expert, True)       (which expert took which token)
    dest_N     = (cumsum(present_TE) - 1)[tok*E + expert]     (each entry's place, sorted by (token, expert))
    out_TH     = moe.gather_segment_sum(rows, entry at dest, tok at dest, T, idx_sorted=True)
                                           (a token's contributions summed in expert order, in fp32)

The table (``moe_compile.ops.segment_sum.group_order``) is built once per topk: the combine and the token gather's
backward read the same entries in the same order, so both sum by one ``(entry, tok)`` pair (the partitioner saves it
or recomputes it); a masked accumulation builds its own. This is deterministic_scatter's lowering with the sort
replaced by a table and a prefix sum: the same sums, bitwise, for ``[E, C]`` indices (expert order is entry order
there); ``moe.segment_sum`` (the sort, and explain says so) for integer rows or a table past ``MAX_GROUP_TABLE`` cells.

The rewrite is the same values in another order of the adds, for any index; what the match decides is only where
moe_compile spends a sort by default (``deterministic=True`` rewrites every accumulation anyway). A token-choice
layer's ``topk`` runs along the last dim of ``[T, E]`` scores (it chooses experts; what its indices index, a per-expert
table, is no token's row) and is not matched.

Skips when (reason tags): those of ``deterministic_scatter`` for the accumulation (``dtype``, ``symbolic_rows``, ...).

Stage: joint, first (before ``deterministic_accumulate``, whose one-hot GEMM would cost ``T*E*C*H``); records MoE
rewrites.

Seen in: ``tests/test_cpu_miscompile.py::ExpertChoiceMoE`` (expert-choice as public code writes it).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

from moe_compile.ops.segment_sum import MAX_GROUP_TABLE, gather_segment_sum, group_order, segment_sum_by_groups
from moe_compile.passes import NoMatch, PassContext
from moe_compile.passes._graph import arg, erase_dead, insert_traced, known_int, layer_name, op_name, tensor_val
from moe_compile.passes.deterministic_scatter import REPLACED_BY, Lowering, rewrite_accumulation
from moe_compile.passes.forms import accumulate as acc

BY_GROUPS = ("moe.gather_segment_sum over the entries ordered by a [T, E] presence table and its prefix sum (each "
             "expert's tokens are distinct: no sort, no atomics)")
# views and copies an index may pass through between topk and the accumulation
_THROUGH = {"aten.view", "aten.reshape", "aten._unsafe_view", "aten.clone", "aten._to_copy", "aten.alias",
            "prims.convert_element_type", "aten.flatten", "aten.contiguous"}


def run(graph: fx.Graph, ctx: PassContext) -> None:
    orders: dict[fx.Node, tuple[fx.Node, fx.Node]] = {}  # per topk indices: the entries' order, built once
    for node in list(graph.nodes):
        if not acc.order_dependent(node):
            continue
        a = acc.read(node)
        if a is None or a.dim != 0 or not acc.is_zeros(a.base):
            continue
        base = tensor_val(a.base)
        rows = known_int(base.shape[0]) if base is not None and base.dim() >= 1 else None
        choice = _choice(a.index)
        if rows is None or choice is None or choice.rows != rows:
            continue
        layer = layer_name(node)
        lowering = choice.lowering(tensor_val(node).dtype)
        if lowering is not None and choice.indices not in orders:
            with graph.inserting_before(node):
                orders[choice.indices] = tuple(insert_traced(graph, choice.order, (choice.indices,), meta_from=node))
        try:
            detail = rewrite_accumulation(graph, node, lowering and lowering._replace(args=orders[choice.indices]))
        except NoMatch as skip:
            ctx.skip(layer, skip.reason, skip.detail)
            continue
        ctx.rewrite(layer, f"{op_name(node)} into the tokens' rows at expert-choice topk indices",
                    detail or REPLACED_BY)
    erase_dead(graph, [n for pair in orders.values() for n in pair])


@dataclasses.dataclass(frozen=True)
class _Choice:
    """An expert-choice ``topk``'s ``indices`` node: ``rows`` chosen among, ``experts`` groups of distinct rows,
    laid out ``[E, C]`` (``expert_major``: ``topk(scores.t(), C)``) or ``[C, E]`` (``topk(scores, C, dim=0)``)."""

    indices: fx.Node
    rows: int
    experts: int
    expert_major: bool

    def lowering(self, dtype: torch.dtype) -> Lowering | None:
        """The table lowering where it applies (float rows, a table within ``MAX_GROUP_TABLE`` cells); None: the
        sort (``segment_sum_by_groups`` would take it there anyway, and explain then says so)."""
        if not dtype.is_floating_point or self.rows * self.experts > MAX_GROUP_TABLE:
            return None
        return Lowering(self._segment_sum, BY_GROUPS)

    def _groups(self, n: int, device: torch.device) -> torch.Tensor:
        """The expert of each of the ``n`` flat (row-major) entries."""
        entry = torch.arange(n, device=device)
        return entry // (n // self.experts) if self.expert_major else entry % self.experts

    def order(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``group_order`` of the topk's indices, flat: one table for every accumulation at them (the combine and
        the token gather's backward read the same entries in the same row-major order)."""
        idx_N = indices.reshape(-1)
        return group_order(idx_N, self.rows, self._groups(idx_N.shape[0], idx_N.device), self.experts)

    def _segment_sum(self, src_ND: torch.Tensor, idx_N: torch.Tensor, rows: int, mask_N: torch.Tensor | None,
                     entry_N: torch.Tensor, idx_sorted_N: torch.Tensor):
        """The accumulation over the flat (row-major) indices, each token's contributions in expert order. Its
        ``idx_N`` is the topk's indices flattened (through views and int casts, never negative), so the shared
        order applies; a masked accumulation keeps its own table."""
        if mask_N is not None:
            return segment_sum_by_groups(src_ND, idx_N, rows, self._groups(idx_N.shape[0], idx_N.device),
                                         self.experts, mask_N)
        return gather_segment_sum(src_ND, entry_N, idx_sorted_N, rows, idx_sorted=True)


def _choice(index: Any) -> _Choice | None:
    """Where ``index`` is the indices output of a ``topk`` (through views and int casts) along the rows of a
    ``[rows, E]`` matrix, as expert choice selects (``topk(scores_TE.t(), C)`` or ``topk(scores_TE, C, dim=0)``):
    what it chose; None otherwise: a token-choice ``topk`` runs along the matrix's last dim (the experts), and what
    it indexes (a per-expert table) is no token's row."""
    node = index
    while isinstance(node, fx.Node) and op_name(node) in _THROUGH and node.args:
        node = node.args[0]
    if not (isinstance(node, fx.Node) and op_name(node) in ("getitem", "operator.getitem") and node.args[1] == 1):
        return None
    index_node, topk = node, node.args[0]
    if not isinstance(topk, fx.Node) or op_name(topk) != "aten.topk" or not isinstance(topk.args[0], fx.Node):
        return None
    src = tensor_val(topk.args[0])
    if src is None or src.dim() != 2:
        return None
    dim = arg(topk, 2, "dim", -1) % 2
    base = topk.args[0]
    if op_name(base) in ("aten.t", "aten.transpose", "aten.permute"):  # a [E, T] view of the [T, E] scores
        perm = base.args[1] if op_name(base) == "aten.permute" else [1, 0]
        if list(perm) not in ([1, 0], [-1, -2], [1, -2], [-1, 0]) and op_name(base) == "aten.permute":
            return None
        dim = 1 - dim
    if dim != 0:
        return None
    along = arg(topk, 2, "dim", -1) % 2
    rows, experts = known_int(src.shape[along]), known_int(src.shape[1 - along])
    if rows is None or experts is None:
        return None
    return _Choice(index_node, rows, experts, expert_major=along == 1)


__all__ = ["run"]
