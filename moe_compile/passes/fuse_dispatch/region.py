"""Steps 5 and 6 of the dispatch proof (:mod:`moe_compile.passes.fuse_dispatch.match`): the row-wise region between
the gathers and the combine, and the combine.

Every node reachable from the permuted rows (row space ``S``, the sorted order) or from the padded buffers (row
space ``M``) up to the combine must map row ``r`` of its region operands to row ``r`` of its result; operands
from outside the region may only broadcast along rows or depend on the sorted ids alone. The combine is an
un-permute + top-k sum, or an accumulate (``index_add_`` / ``scatter_add_`` / ``index_put_(accumulate=True)``)
into zeros at ``perm // K`` (:mod:`moe_compile.passes.forms.combine` reads its spellings). Also here: the row
gathers and buffers both steps recognise, which the matcher imports.

    RegionProof(order, SortedIds, Gathers, Padding | None).prove() -> RowRegion
        before: gathered rows x[perm // K], w[perm] (space S) and padded buffers (space M), each op below them
        after:  RowRegion.spaces (node -> "S" | "M"), .grouped_mms, .unpads (Y[dest_S]), .combine (Combine)

The offsets of ``RowRegion.grouped_mms`` are proven next (:mod:`moe_compile.passes.fuse_dispatch.offsets`).
"""

from __future__ import annotations

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
from moe_compile.passes.forms.combine import (
    expanded_index,
    match_unpermute_sum,
    read_accumulate,
)
from moe_compile.passes.forms.ops import BINARY, CASTS, GROUPED_MM, UNARY, is_zeros
from moe_compile.passes.forms.rowwise import DISPATCH, RowwiseProof
from moe_compile.passes.fuse_dispatch.steps import Combine, Gathers, Padding, RowRegion, SortedIds


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
    if not is_zeros(node):
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
    elif name in ("index_copy_", "index_copy") and arg(u, 3, "source") is y:
        start = u  # read through the op's result (the buffer it wrote)
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
    """Steps 5 and 6: :meth:`prove` walks from the gathered (and padded) rows to the combine.

    Built from the earlier steps' results: ``order`` (node -> topological index), :class:`SortedIds` (``perm``,
    ``S`` the sorted rows), :class:`Gathers` (the seeds, ``top_k``, ``T``, ``sorted_ids``) and the
    :class:`Padding` found, if any.
    """

    def __init__(self, order: dict[fx.Node, int], sorted_ids: SortedIds, gathers: Gathers,
                 padding: Padding | None) -> None:
        self.order = order
        self.perm = sorted_ids.perm
        self.S = sorted_ids.num_rows
        self.top_k = gathers.top_k
        self.num_tokens = gathers.num_tokens
        self.sorted_ids = gathers.sorted_ids
        self.gathers = gathers
        self.padding = padding

    def prove(self) -> RowRegion:
        """The row-wise region and its one combine, else raise :class:`NoMatch`."""
        token_gathers, weight_gathers = self.gathers.token_gathers, self.gathers.weight_gathers
        padding = self.padding
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
        unpads: list[fx.Node] = []
        n_rowwise = 0
        for u in sorted(reach, key=self.order.__getitem__):
            if u in skip_users:
                continue
            node = next((a for a in u.all_input_nodes if a in region), None)
            if padding is not None and node is not None and region[node] == "M" and self._is_unpad(u, node, padding):
                unpads.append(u)
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
        if padding is not None and not unpads:
            raise NoMatch("padding_not_proven", "padded rows never gathered back at dest")
        matched = (f"{len(grouped_mms)}x grouped_mm", f"row-wise region ({n_rowwise} ops)",
                   f"combine({combine.kind})")
        return RowRegion(spaces=region, grouped_mms=tuple(grouped_mms), unpads=tuple(unpads), combine=combine,
                         matched=matched)

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
        training = bool(getattr(tensor_val(u), "requires_grad", False))
        return RowwiseProof(DISPATCH, region, training=training,
                            row_independent=self._is_sorted_ids_function).check(u).space

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
            return Combine(kind=found.kind, source=y, result=total, inplace_buffer=None, nodes=tuple(found.nodes),
                           weight_TK=found.weight_TK)
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
        if not same_shape(shape, (self.num_tokens, tensor_val(y).shape[1])):
            raise NoMatch("combine_not_matched", f"{u.name} ({kind}) buffer is not [T, H]")
        if tensor_val(buf).dtype != tensor_val(y).dtype:
            raise NoMatch("combine_not_matched", f"{u.name} ({kind}) buffer dtype differs from the rows")
        inplace = op_name(u).endswith("_")
        if inplace:
            for other in buf.users:
                if other is not u and self.order[other] < self.order[u]:
                    raise NoMatch("combine_not_matched", f"zeros buffer {buf.name} is used before the accumulate")
        return Combine(kind=kind, source=y, result=u, inplace_buffer=buf if inplace else None, nodes=(u,))
