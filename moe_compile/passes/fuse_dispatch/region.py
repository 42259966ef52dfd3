"""Steps 5 and 6 of the dispatch proof (:mod:`moe_compile.passes.fuse_dispatch.match`): the row-wise region between
the gathers and the combine, and the combine.

Every node reachable from the permuted rows (row space ``S``, the sorted order) or from the padded buffers (row
space ``M``) up to the combine must map row ``r`` of its region operands to row ``r`` of its result; operands
from outside the region may only broadcast along rows or depend on the sorted ids alone. The combine is an
un-permute + top-k sum, or an accumulate (``index_add_`` / ``scatter_add_`` / ``index_put_(accumulate=True)``)
into zeros at ``perm // K`` (:mod:`moe_compile.passes.forms.combine` reads its spellings). Also here: the row
gathers and buffers both steps recognise, which the matcher imports.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

from moe_compile.passes import NoMatch
from moe_compile.passes._graph import (
    arg,
    is_inplace,
    known_int,
    op_name,
    same_int,
    same_shape,
    tensor_val,
)
from moe_compile.passes.forms import index_algebra as ia
from moe_compile.passes.forms.combine import (
    expanded_index,
    match_unpermute_sum,
    read_accumulate,
)
from moe_compile.passes.forms.ops import BINARY, CASTS, GROUPED_MM, UNARY
from moe_compile.passes.forms.rowwise import DISPATCH, RowwiseProof


@dataclasses.dataclass
class Combine:
    kind: str  # "inverse_perm_sum" | "index_add" | "scatter_add" | "index_put"
    source: fx.Node  # the region node combined ([S, H] sorted rows)
    result: fx.Node  # the node whose value is the combined [T, H]
    inplace_buffer: fx.Node | None  # the zeros buffer an in-place accumulate mutated
    nodes: list[fx.Node]  # combine nodes to erase after rewiring
    # routing weight applied after un-permuting, in [T, K] order ((y.view(T, K, H) * w[..., None]).sum(1))
    weight_TK: fx.Node | None = None


@dataclasses.dataclass
class Padding:
    align: int
    num_rows: Any  # M of the user's buffer (int or SymInt)
    dest: fx.Node  # padded destination rows of the sorted rows [S]
    seeds: list[fx.Node]  # padded [M, H] row buffers (replaced by rows_MH)
    prob_seeds: list[fx.Node]  # padded [M] probs buffers (replaced by probs_M)
    writes: list[fx.Node]  # in-place writes that build the padded buffers (erased)
    unpads: list[fx.Node]  # Y[dest] gathers back to sorted rows (replaced by Y)
    # seeds written with the token rows weighted before the experts (x[perm // K] * w[perm][:, None]):
    # replaced by rows_MH * probs_M[:, None] in the rows' dtype
    weighted_seeds: list[fx.Node] = dataclasses.field(default_factory=list)


def is_int_tensor(node: Any, ndim: int | None = None) -> bool:
    v = tensor_val(node)
    if v is None or v.is_floating_point() or v.is_complex() or v.dtype == torch.bool:
        return False
    return ndim is None or v.dim() == ndim


def index_of_floordiv(node: Any, perm: fx.Node) -> Any:
    """If ``node`` is ``perm // K`` in any spelling, return ``K`` (int or SymInt node), else None."""
    if not isinstance(node, fx.Node):
        return None
    name = op_name(node)
    if name in ("floordiv", "floor_divide") or (
        name in ("div", "div_") and node.kwargs.get("rounding_mode") == "floor"
    ):
        if node.args[0] is perm:
            return node.args[1]
    return None


def gather_parts(node: fx.Node) -> tuple[Any, Any] | None:
    """``(src, idx)`` for a row gather ``src[idx]`` / ``index_select(src, 0, idx)`` / ``gather(src, 0, idx2d)``."""
    name = op_name(node)
    if name == "getitem":
        idx = node.args[1]
        if isinstance(idx, fx.Node) and is_int_tensor(idx, 1):
            return node.args[0], idx
        return None
    if name == "index_select":
        if known_int(arg(node, 1, "dim")) == 0:
            return node.args[0], arg(node, 2, "index")
        return None
    if name == "gather":
        if known_int(arg(node, 1, "dim")) != 0:
            return None
        idx = arg(node, 2, "index")
        src = node.args[0]
        sv = tensor_val(src)
        if sv is not None and sv.dim() == 1:
            return src, idx
        inner = expanded_index(idx)
        return (src, inner) if inner is not None else None
    return None


def zeros_buffer_shape(node: Any) -> tuple[Any, ...] | None:
    if not ia.is_zeros_creation(node):
        return None
    v = tensor_val(node)
    return tuple(v.shape) if v is not None else None


def unpermute_sum_candidate(u: fx.Node, y: fx.Node) -> fx.Node | None:
    """The top-k sum an un-permutation of ``y`` by ``u`` feeds (``u`` is ``y[inv]`` or ``buf[perm] = y``):
    the ``sum`` reached through a ``[T, K, H]`` view and an optional weight multiply, else None."""
    name = op_name(u)
    if name == "getitem" and u.args[0] is y and isinstance(u.args[1], fx.Node):
        start = u
    elif name in ("setitem", "index_put_") and u.args[0] is not y and isinstance(u.args[0], fx.Node) \
            and (u.args[2] if name == "setitem" else arg(u, 2, "values")) is y:
        start = u.args[0]
    else:
        return None
    views = [v for v in start.users if op_name(v) in ("view", "reshape", "unflatten")]
    if len(views) != 1:
        return None
    node = views[0]
    for _ in range(2):
        if len(node.users) != 1:
            return None
        node = next(iter(node.users))
        if op_name(node) == "sum":
            return node
    return None



class RegionProof:
    """The region and combine steps of :class:`~moe_compile.passes.fuse_dispatch.match.Matcher` (a mixin).

    Reads what the matcher's earlier steps set: ``order`` (node -> topological index), ``perm``, ``S`` (sorted
    rows), ``top_k``, ``sorted_ids``, ``matched`` (the proof's log) and ``_num_tokens()``.
    """

    def _region(self, token_gathers, weight_gathers, padding: Padding | None):
        region: dict[fx.Node, str] = {}
        skip_users: set[fx.Node] = set()
        seeds: dict[fx.Node, str] = {}
        if padding is not None:
            skip_users.update(padding.writes)
            for s in padding.seeds + padding.prob_seeds:
                seeds[s] = "M"
        for g in token_gathers + weight_gathers:
            seeds[g] = "S"
        # 1. everything reachable from the seeds, stopping at combines
        reach: set[fx.Node] = set()
        combines: list[Combine] = []
        work = list(seeds)
        while work:
            node = work.pop()
            for u in node.users:
                if u in reach or u in seeds or u in skip_users:
                    continue
                if u.op == "output":
                    raise NoMatch("rows_escape_region", f"permuted rows {node.name} are a graph output")
                combine = self._combine(node, u)
                if combine is not None:
                    combines.append(combine)
                    skip_users.update(combine.nodes)
                    continue
                reach.add(u)
                work.append(u)
        # 2. classify in topological order, so every operand from the region is known first
        region.update(seeds)
        grouped_mms: list[fx.Node] = []
        n_rowwise = 0
        for u in sorted(reach, key=self.order.__getitem__):
            if u in skip_users:
                continue
            node = next((a for a in u.all_input_nodes if a in region), None)
            if padding is not None and node is not None and region[node] == "M" and self._is_unpad(u, node, padding):
                padding.unpads.append(u)
                region[u] = "S"
                continue
            region[u] = self._rowwise(u, region)
            if op_name(u) in GROUPED_MM:
                grouped_mms.append(u)
            n_rowwise += 1
            if is_inplace(u) and u.args and isinstance(u.args[0], fx.Node) and u.args[0] not in region:
                raise NoMatch("region_not_rowwise", f"{u.name} writes routed rows into {u.args[0].name}")
        if not combines:
            raise NoMatch("combine_not_matched", "no inverse-permutation gather + sum, index_add_, scatter_add_ "
                          "or index_put_(accumulate=True) of the expert outputs")
        if len(combines) > 1:
            raise NoMatch("combine_not_matched", f"{len(combines)} combines of one dispatch")
        combine = combines[0]
        if region[combine.source] != "S" and padding is not None:
            raise NoMatch("combine_not_matched", "combine reads padded rows directly")
        if not grouped_mms:
            raise NoMatch("no_grouped_gemm", "no grouped GEMM between the gathers and the combine")
        if padding is not None and not padding.unpads:
            raise NoMatch("padding_not_proven", "padded rows never gathered back at dest")
        self.matched.append(f"{len(grouped_mms)}x grouped_mm")
        self.matched.append(f"row-wise region ({n_rowwise} ops)")
        self.matched.append(f"combine({combine.kind})")
        return region, grouped_mms, combine

    def _is_unpad(self, u: fx.Node, node: fx.Node, padding: Padding) -> bool:
        parts = gather_parts(u)
        return parts is not None and parts[0] is node and parts[1] is padding.dest

    def _is_sorted_ids_function(self, node: Any, depth: int = 0) -> bool:
        """Values that only depend on the sorted ids (identical in any expert-sorted row order)."""
        if depth > 12 or not isinstance(node, fx.Node):
            return not isinstance(node, fx.Node)
        if node in self.sorted_ids:
            return True
        name = op_name(node)
        if name == "getitem" and isinstance(node.args[1], fx.Node):
            table = tensor_val(node.args[0])
            return table is not None and self._is_sorted_ids_function(node.args[1], depth + 1) \
                and not self._depends_on_rows(node.args[0])
        if name in UNARY | BINARY | CASTS | {"unsqueeze"}:
            return all(
                self._is_sorted_ids_function(a, depth + 1) or (isinstance(a, fx.Node) and tensor_val(a) is not None
                                                               and tensor_val(a).dim() == 0)
                for a in node.args if isinstance(a, fx.Node)
            )
        return False

    def _depends_on_rows(self, node: fx.Node) -> bool:
        v = tensor_val(node)
        return v is not None and v.dim() >= 1 and same_int(v.shape[0], self.S)

    def _rowwise(self, u: fx.Node, region: dict[fx.Node, str]) -> str:
        """The row space of ``u`` if it is row-wise in its region inputs, else raise NoMatch (the one prover,
        :class:`~moe_compile.passes.forms.rowwise.RowwiseProof`, under fuse_dispatch's policy)."""
        return RowwiseProof(DISPATCH, region, row_independent=self._is_sorted_ids_function).check(u).space

    # -- combine ------------------------------------------------------------------------------------
    def _combine(self, y: fx.Node, u: fx.Node) -> Combine | None:
        yv = tensor_val(y)
        if yv is None or yv.dim() != 2:
            return None
        # (a) un-permute + sum over the top-k slots (the spellings in _combine_forms)
        total = unpermute_sum_candidate(u, y)
        if total is not None:
            found = match_unpermute_sum(total, self.top_k, lambda order: order is self.perm)
            if found is None or found.rows is not y:
                raise NoMatch("combine_not_matched", f"{u.name} un-permutes the rows, but {total.name} is not "
                              "a (weighted) sum of their [T, K, H] view")
            return Combine(found.kind, y, total, None, found.nodes, weight_TK=found.weight_TK)
        # (b) zeros[T, H] accumulated at perm // K
        acc = read_accumulate(u)
        if acc is None or acc.src is not y or acc.buffer is y:
            return None
        return self._accumulate(u, y, acc.index, acc.kind)

    def _accumulate(self, u: fx.Node, y: fx.Node, index: Any, kind: str) -> Combine:
        k = index_of_floordiv(index, self.perm)
        if k is None or not same_int(k, self.top_k):
            raise NoMatch("combine_not_matched", f"{u.name} ({kind}) does not accumulate at perm // K")
        buf = u.args[0]
        shape = zeros_buffer_shape(buf)
        if shape is None:
            raise NoMatch("combine_not_matched", f"{u.name} ({kind}) accumulates into a non-zero buffer")
        if not same_shape(shape, (self._num_tokens(), tensor_val(y).shape[1])):
            raise NoMatch("combine_not_matched", f"{u.name} ({kind}) buffer is not [T, H]")
        if tensor_val(buf).dtype != tensor_val(y).dtype:
            raise NoMatch("combine_not_matched", f"{u.name} ({kind}) buffer dtype differs from the rows")
        inplace = op_name(u).endswith("_")
        if inplace:
            for other in buf.users:
                if other is not u and self.order[other] < self.order[u]:
                    raise NoMatch("combine_not_matched", f"zeros buffer {buf.name} is used before the accumulate")
        return Combine(kind, y, u, buf if inplace else None, [u])
