"""``strip_host_padding``'s entry point, :func:`run`: the pass as the package docstring states it."""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import sympy
import torch
import torch.fx as fx

from moe_compile.ops._common import SUPPORTED_ALIGNMENTS
from moe_compile.passes import NoMatch, PassContext
from moe_compile.passes._graph import (
    erase_dead,
    graph_call,
    has_unbacked_shape,
    is_call,
    layer_name,
    op_name,
    ops_available,
    outside_users,
    refresh_example_values,
    replace_uses_after,
    tensor_val,
    topo_index,
)
from moe_compile.passes._host_sync import (
    HostRead,
    IntVectorEval,
    ceil_align,
    erase_dead_host_reads,
    host_reads,
    int_vector,
    leaf_vector,
    same_on_samples,
    sym_expr,
)
from moe_compile.passes.forms.combine import (
    UnpermuteSum,
    match_unpermute_sum,
    read_accumulate,
)
from moe_compile.passes.forms.counts import expert_counts, ids_base
from moe_compile.passes.forms.ops import GROUPED_MM, is_zeros, strip_casts
from moe_compile.passes.forms.rowwise import rowwise_region
from moe_compile.passes.strip_host_padding.after_permute_pad import (
    strip_pad_after_permute_pad,
)
from moe_compile.passes.strip_host_padding.padding import (
    Pad,
    Unpad,
    match_pad,
    match_unpad,
)
from moe_compile.passes.strip_host_padding.permute import (
    Permute,
    argsort_of,
    match_permute,
    probs_source,
    token_index,
    weighted_rows,
)

COMBINES = {"index_add_", "index_add", "scatter_add_", "scatter_add", "index_put_", "index_put"}


@dataclasses.dataclass(frozen=True)
class Region:
    layer: str
    sink: fx.Node
    dest: fx.Node | None  # the zeros buffer of an accumulate combine (None for un-permute + sum)
    permute: Permute
    X: fx.Node  # first padded tensor (the pad cat), or x_NH without pad block
    Y: fx.Node  # last padded tensor (input of the unpad split), or the unpadded expert output
    middle: list[fx.Node]
    offs_uses: list[fx.Node]  # grouped GEMMs whose offs are replaced
    probs_TK: fx.Node | None
    probs_TE_gather: fx.Node | None  # dense [T, E] probs to gather with idx_TK
    align: int
    pad_was_noop: bool
    matched: list[str]
    dead: list[fx.Node]
    # the permuted rows weighted before the experts (``x_NH * probs_N[:, None]``): (multiply, probs_TK or None,
    # probs_TE or None); rebuilt as ``rows_MH * probs_M[:, None]`` from permute_pad's permuted probs
    pre_weight: tuple[fx.Node, fx.Node | None, fx.Node | None] | None = None


# ---------------------------------------------------------------------------------------------------
# counts
# ---------------------------------------------------------------------------------------------------


def run(graph: fx.Graph, ctx: PassContext) -> None:
    """Rewrite every provable host-padded MoE region of ``graph`` (see the module docstring)."""
    reads = host_reads(graph)
    sinks = [n for n in graph.nodes if (op_name(n) in COMBINES or op_name(n) == "sum") and _host_sized(n)]
    touched: list[str] = []
    for sink in sinks:
        if sink.graph is not graph or getattr(sink, "_erased", False):
            continue
        layer = layer_name(sink)
        try:
            region = _Matcher(graph, reads).match(sink)
        except NoMatch as skip:
            ctx.skip(layer, skip.reason, skip.detail)
            touched.append(layer)
            continue
        if not ops_available("permute_pad", "unpad_unpermute"):
            ctx.skip(layer, "ops_unavailable", "torch.ops.moe.permute_pad / unpad_unpermute not registered")
            continue
        if region.pad_was_noop:
            ctx.skip(layer, "already_aligned", "host pad lengths are provably 0: pad removed, not padded again")
        ctx.rewrite(layer, " + ".join(region.matched), _rewrite(graph, region))
        touched.append(layer)
        reads = host_reads(graph)
    touched += strip_pad_after_permute_pad(graph, ctx)
    remaining = erase_dead_host_reads(graph)
    if remaining and touched:
        ctx.skip(touched[0], "host_read_kept", f"{len(remaining)} host read(s) still feed tensor ops: "
                 + ", ".join(n.name for n in remaining[:4]))


def _histogram_of(counts: Any, idx_TK: fx.Node) -> int | None:
    """``E`` when ``counts`` is the per-expert count of the ids in ``idx_TK`` (forms in ``_count_forms``)."""
    counts = strip_casts(counts)
    value = tensor_val(counts)
    if value is None or value.dim() != 1 or not isinstance(value.shape[0], int):
        return None
    found = expert_counts(counts, lambda n: ids_base(n) is idx_TK)
    return found[0] if found is not None and found[0] == value.shape[0] else None


# ---------------------------------------------------------------------------------------------------
# region matching
# ---------------------------------------------------------------------------------------------------


def _combine_parts(sink: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node]:
    """``(dest, token_N, src)`` of a row accumulate along dim 0 (forms in ``_combine_forms``)."""
    acc = read_accumulate(sink)
    if acc is None or not isinstance(acc.index, fx.Node) or not isinstance(acc.src, fx.Node):
        raise NoMatch("combine_index_not_matched", f"{sink.name}: not a row combine along dim 0 at a token index")
    return acc.buffer, acc.index, acc.src


def _unpermute_sum(sink: fx.Node) -> UnpermuteSum | None:
    """The sink as an un-permute + top-k sum combine (``y[order] = ys`` or ``ys[inverse(order)]``)."""
    if op_name(sink) != "sum":
        return None
    return match_unpermute_sum(sink, None, lambda order: argsort_of(order) is not None)


class _Matcher:
    def __init__(self, graph: fx.Graph, reads: dict[sympy.Symbol, HostRead]) -> None:
        self.graph = graph
        self.reads = reads
        self.counts_node: fx.Node | None = None
        self.counts: list[sympy.Expr] | None = None

    def match(self, sink: fx.Node) -> Region:
        unpermute = _unpermute_sum(sink)
        if unpermute is not None:
            dest, src = None, unpermute.rows
            token_N = token_index(unpermute.order)
            perm = match_permute(token_N)
            matched = [perm.kind, unpermute.kind]
        else:
            dest, token_N, src = _combine_parts(sink)
            order = topo_index(self.graph)
            if not is_zeros(dest):
                raise NoMatch(
                    "combine_buffer_reused", f"{sink.name} accumulates into {dest.name}, not a fresh zeros buffer"
                )
            if any(order[u] < order[sink] for u in dest.users if u is not sink):
                raise NoMatch("combine_buffer_reused", f"{dest.name} is used before the combine")
            perm = match_permute(token_N)
            matched = [perm.kind, op_name(sink)]

        # combine source: casts, optional probs multiply, casts
        tail = {src}
        y = strip_casts(src)
        tail |= _chain_to(src, y)
        probs_TK = probs_TE = None
        if unpermute is not None:
            tail |= set(unpermute.nodes)
            if unpermute.weight_TK is not None:
                w, ids = tensor_val(unpermute.weight_TK), tensor_val(perm.idx_TK)
                if tuple(w.shape) != tuple(ids.shape):
                    raise NoMatch("probs_not_matched", f"combine weight {tuple(w.shape)} is not [T, K]")
                probs_TK = unpermute.weight_TK
        if probs_TK is None and is_call(y, "mul", "__mul__") and len(y.args) == 2 \
                and all(isinstance(a, fx.Node) for a in y.args):
            a, b = y.args
            va, vb = tensor_val(a), tensor_val(b)
            if vb is not None and vb.dim() == 2 and vb.shape[1] == 1:
                y, col = a, b
            elif va is not None and va.dim() == 2 and va.shape[1] == 1:
                y, col = b, a
            else:
                raise NoMatch("probs_not_matched", f"{y.name}: neither operand is a [N, 1] column")
            probs_TK, probs_TE = probs_source(col, perm)
            tail.add(next(u for u in y.users if is_call(u, "mul", "__mul__") and col in u.args))
            y0 = y
            y = strip_casts(y)
            tail |= _chain_to(y0, y)

        # unpad block (optional), the expert region, the pad block (optional) or x_NH
        unpad = match_unpad(y)
        if unpad is not None:
            # the unpad splits by the old host sizes: nothing else may read it once the rows are static
            pieces = list(unpad.cat.args[0])
            chunks = [p.args[0] for p in pieces]
            inner = set(pieces) | set(chunks) | {unpad.cat}
            bad = outside_users([unpad.split, *chunks, *pieces], inner)
            bad += outside_users([unpad.cat], tail | {sink})
            if bad:
                raise NoMatch("expert_region_escapes", f"the unpadded rows are also used by {bad[0].name}")
        pre_weight = weighted_rows(perm)
        rows_NH = pre_weight[0] if pre_weight is not None else perm.x_NH
        pad = match_pad(rows_NH)
        Y = unpad.split.args[0] if unpad is not None else y
        X = pad.cat if pad is not None else rows_NH
        if unpad is None and pad is not None:
            raise NoMatch("unpad_not_matched", f"{y.name}: padded rows reach the combine without an unpad")
        E_hint = perm.num_experts if perm.num_experts > 0 else None
        y_consumers = {unpad.split} if unpad is not None else tail | {sink}
        middle, offs_uses, offs_nodes = rowwise_region(X, Y, E_hint, y_consumers)
        inside = set(middle) | {X}
        escaping = outside_users([X], inside)
        if escaping:
            raise NoMatch("expert_region_escapes", f"{X.name} is also used by {escaping[0].name}")
        if not offs_uses:
            raise NoMatch("offsets_not_matched", "no grouped GEMM in the expert region")

        sizes = pad.sizes if pad is not None else unpad.lengths if unpad is not None else None
        E = self._counts(sizes, perm, offs_nodes)
        perm.num_experts = E
        for node in offs_uses:
            w = tensor_val(node.args[1])
            if w.shape[0] != E:
                raise NoMatch("offsets_not_matched", f"{node.name}: weight has {w.shape[0]} groups for {E} experts")
        align, noop = self._check_sizes(pad, unpad, offs_nodes, E)
        if align not in SUPPORTED_ALIGNMENTS:
            raise NoMatch("alignment_unsupported", f"alignment {align} not in {SUPPORTED_ALIGNMENTS}")
        if pad is not None:
            matched.append(f"split+pad(a={align})")
        if unpad is not None:
            matched.append("split+narrow+cat")
        if probs_TK is not None or probs_TE is not None:
            matched.append("probs")
        if pre_weight is not None:
            matched.append("probs before experts")
        dead = [perm.x_NH, *offs_nodes, *tail] + ([pre_weight[0]] if pre_weight is not None else [])
        return Region(
            layer=layer_name(sink), sink=sink, dest=dest, permute=perm, X=X, Y=Y, middle=middle,
            offs_uses=offs_uses, probs_TK=probs_TK, probs_TE_gather=probs_TE, align=align, pad_was_noop=noop,
            matched=matched, dead=dead, pre_weight=pre_weight,
        )

    def _counts(self, sizes: list[Any] | None, perm: Permute, offs_nodes: list[fx.Node]) -> int:
        """Prove the split sizes (or the device offsets' counts) are the per-expert counts of the ids."""
        read_tensors = _host_read_tensors(offs_nodes[0], self.reads)
        if sizes is None and read_tensors:
            # no host split, offsets from host sizes (torch.tensor(counts.tolist()).cumsum(0))
            if len(read_tensors) != 1:
                raise NoMatch("counts_not_histogram", f"offsets read from {len(read_tensors)} tensors")
            counts_node = read_tensors.pop()
        elif sizes is None:
            # no host split: the offsets must be a cumsum of a device histogram of the ids
            base = strip_casts(offs_nodes[0], frozenset({"to", "int", "long", "type", "contiguous"}))
            if not is_call(base, "cumsum"):
                raise NoMatch("offsets_not_matched", f"{offs_nodes[0].name} is not a cumsum of device counts")
            counts_node = base.args[0]
        else:
            tensors = set()
            for s in sizes:
                expr = sym_expr(s)
                if expr is None:
                    raise NoMatch("counts_not_histogram", f"split size {s} is not an int")
                for sym in expr.free_symbols:
                    read = self.reads.get(sym)
                    if read is None or read.index is None:
                        raise NoMatch("counts_not_histogram", f"split size {expr} is not read from a device tensor")
                    tensors.add(read.tensor)
            if len(tensors) != 1:
                raise NoMatch("counts_not_histogram", f"split sizes read from {len(tensors)} tensors")
            counts_node = tensors.pop()
        E = _histogram_of(counts_node, perm.idx_TK)
        if E is None:
            raise NoMatch(
                "counts_not_histogram", f"{counts_node.name} is not the per-expert count of {perm.idx_TK.name}"
            )
        if perm.num_experts > 0 and perm.num_experts != E:
            raise NoMatch("counts_not_histogram", f"{E} counts for {perm.num_experts} experts")
        self.counts_node, self.counts = counts_node, leaf_vector(counts_node, E)
        if sizes is not None:
            if len(sizes) != E:
                raise NoMatch("counts_not_histogram", f"{len(sizes)} split sizes for {E} experts")
            got = [self._scalar(s) for s in sizes]
            if not same_on_samples(list(zip(got, self.counts)), self.counts):
                raise NoMatch("counts_not_histogram", "split sizes are not counts[0..E-1] in order")
        return E

    def _leaves(self, node: fx.Node) -> list[sympy.Expr] | None:
        return self.counts if node is self.counts_node else None

    def _scalar(self, value: Any) -> sympy.Expr:
        expr = IntVectorEval(self.reads, self._leaves).scalar(value)
        if expr is None:
            raise NoMatch("pad_not_matched", f"size {value} is not an expression of the device counts")
        return expr

    def _check_sizes(
        self, pad: Pad | None, unpad: Unpad | None, offs_nodes: list[fx.Node], E: int
    ) -> tuple[int, bool]:
        """Prove pad lengths, padded sizes, unpad lengths and offsets; returns (alignment, pad was a no-op)."""
        counts = self.counts
        padded = counts
        if pad is not None:
            padded = [self._scalar(s) + self._scalar(q) for s, q in zip(pad.sizes, pad.pads)]
        if unpad is not None:
            got_padded = [self._scalar(s) for s in unpad.padded_sizes]
            got_lengths = [self._scalar(n) for n in unpad.lengths]
            if not same_on_samples(list(zip(got_padded, padded)) + list(zip(got_lengths, counts)), counts):
                raise NoMatch("unpad_not_matched", "unpad sizes are not the padded sizes, or lengths not the counts")
        for a in SUPPORTED_ALIGNMENTS:
            if same_on_samples([(p, ceil_align(c, a)) for p, c in zip(padded, counts)], counts):
                align = a
                break
        else:
            raise NoMatch("pad_not_matched", "padded sizes are not ceil(count / a) * a for a supported a")
        noop = pad is not None and align == 1 and bool(pad.nodes)
        for offs in offs_nodes:
            vec = int_vector(offs, self.reads, self._leaves)
            value = tensor_val(offs)
            if vec is None or len(vec) != E or value is None or value.dtype != torch.int32:
                raise NoMatch("offsets_not_matched", f"{offs.name} is not an int32 [E] expression of the counts")
            expected = [sympy.Add(*padded[: i + 1]) for i in range(E)]
            symbols = set(counts).union(*(v.free_symbols for v in vec))
            if not same_on_samples(list(zip(vec, expected)), symbols):
                raise NoMatch("offsets_not_matched", f"{offs.name} is not the cumsum of the padded counts")
        return align, noop


def _chain_to(src: fx.Node, y: fx.Node) -> set[fx.Node]:
    """Nodes from ``y`` (exclusive) to ``src`` (inclusive) along first arguments."""
    chain, node = set(), src
    while isinstance(node, fx.Node) and node is not y:
        chain.add(node)
        node = node.args[0] if node.args else None
    return chain


# ---------------------------------------------------------------------------------------------------
# rewrite
# ---------------------------------------------------------------------------------------------------


def _rewrite(graph: fx.Graph, r: Region) -> str:
    perm = r.permute
    order = topo_index(graph)
    first_middle = min(r.middle, key=order.__getitem__)
    meta = r.sink
    with graph.inserting_before(first_middle):
        pre_probs = None
        if r.pre_weight is not None:
            _, pre_probs, pre_probs_TE = r.pre_weight
            if pre_probs_TE is not None:
                pre_probs = graph_call(graph, torch.gather, pre_probs_TE, 1, perm.idx_TK, meta_from=meta)
        pp = graph_call(graph, torch.ops.moe.permute_pad.default, perm.x_TH, perm.idx_TK, pre_probs,
                        perm.num_experts, r.align, meta_from=meta)
        rows = graph_call(graph, operator.getitem, pp, 0, meta_from=meta)
        offs = graph_call(graph, operator.getitem, pp, 2, meta_from=meta)
        row_map = graph_call(graph, operator.getitem, pp, 3, meta_from=meta)
        if pre_probs is not None:
            # pad rows: 0 * 0; real rows: the user's x * w[perm] in the rows' dtype
            probs_M = graph_call(graph, operator.getitem, pp, 1, meta_from=meta)
            column = graph_call(graph, torch.Tensor.unsqueeze, probs_M, -1, meta_from=meta)
            column = graph_call(graph, torch.Tensor.to, column, tensor_val(perm.x_NH).dtype, meta_from=meta)
            rows = graph_call(graph, torch.mul, rows, column, meta_from=meta)
    for node in r.middle:
        node.replace_input_with(r.X, rows)
    for node in r.offs_uses:
        if len(node.args) > 2:
            node.update_arg(2, offs)
        else:
            node.update_kwarg("offs", offs)
    refresh_example_values(r.middle)
    with graph.inserting_after(r.Y if order[r.Y] > order[r.sink] else r.sink):
        probs = r.probs_TK
        if r.probs_TE_gather is not None:
            probs = graph_call(graph, torch.gather, r.probs_TE_gather, 1, perm.idx_TK, meta_from=meta)
        y = graph_call(graph, torch.ops.moe.unpad_unpermute.default, r.Y, row_map, probs, meta_from=meta)
        out_dtype = tensor_val(r.sink).dtype
        if tensor_val(y).dtype != out_dtype:
            y = graph_call(graph, torch.Tensor.to, y, out_dtype, meta_from=meta)
    r.sink.replace_all_uses_with(y)
    if r.dest is not None:
        replace_uses_after(r.dest, y, r.sink)
    inputs = list(r.sink.all_input_nodes)
    graph.erase_node(r.sink)
    erase_dead(graph, inputs + r.dead + [r.X])
    from torch._inductor.pattern_matcher import stable_topological_sort

    stable_topological_sort(graph)
    probs_note = ", probs" if (r.probs_TK is not None or r.probs_TE_gather is not None) else ""
    return f"moe.permute_pad(align={r.align}) + offs_E + moe.unpad_unpermute{probs_note}"


# ---------------------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------------------


def _host_read_tensors(node: fx.Node, reads: dict[sympy.Symbol, HostRead], limit: int = 64) -> set[fx.Node]:
    """The device tensors whose host reads (``item``) ``node`` is computed from (a bounded backward walk)."""
    by_item = {r.item: r.tensor for r in reads.values()}
    found, seen, work = set(), set(), [node]
    while work and len(seen) < limit:
        n = work.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in by_item:
            found.add(by_item[n])
            continue
        work.extend(n.all_input_nodes)
    return found


def _offsets_from_host(rows: fx.Node, limit: int = 256) -> bool:
    """Whether a grouped GEMM that ``rows`` is computed from takes offsets built from host reads."""
    seen, work = set(), [rows]
    while work and len(seen) < limit:
        n = work.pop()
        if n in seen:
            continue
        seen.add(n)
        if op_name(n) in GROUPED_MM:
            offs = n.args[2] if len(n.args) > 2 else n.kwargs.get("offs")
            if isinstance(offs, fx.Node) and _host_read_tensors(offs, host_reads(n.graph)):
                return True
        work.extend(n.all_input_nodes)
    return False


def _host_sized(sink: fx.Node) -> bool:
    unpermute = _unpermute_sum(sink)
    if unpermute is not None:
        src, token = unpermute.rows, None
    elif op_name(sink) in COMBINES:
        try:
            _, token, src = _combine_parts(sink)
        except NoMatch:
            return False
    else:
        return False
    return has_unbacked_shape(src) or has_unbacked_shape(token) or _offsets_from_host(src)
