"""Finds sort-based MoE dispatch regions in Dynamo's Torch IR and proves them rewritable.

Used by :mod:`moe_compile.passes.fuse_dispatch`. One :class:`Dispatch` per ascending sort/argsort of
flattened integer expert ids whose permutation gathers token rows. The proof, step by step:

1. **Sort.** ``ids_sorted, perm = sort(ids_S)`` or ``perm = argsort(ids_S)`` (any ``stable``), with
   ``ids_S`` a flatten of ``ids_TK`` (or 1-D, then ``K`` comes from the token index).
2. **Gathers.** Token rows ``x_TH[perm // K]`` (``getitem`` / ``index_select`` / ``gather``),
   optionally weights ``w_S[perm]`` and ids ``ids_S[perm]``.
3. **Counts and offsets.** Every grouped GEMM's ``offs`` is, as a linear form
   (:mod:`~moe_compile.passes.forms.index_algebra`), ``cumsum(counts)`` or ``cumsum(ceil(counts/a)*a)``,
   where ``counts`` is ``histc``/``bincount``/``one_hot.sum``/``(ids == arange(E)).sum`` of the ids.
4. **Padding** (optional). The sorted rows are written to padded rows ``dest_S`` of a zero
   ``[M, H]`` buffer (``index_put``), or a zero sentinel row is gathered through a ``full(M, T)`` index
   buffer; ``dest_S`` must equal the canonical padded destination; results come back as ``Y[dest_S]``.
5. **Row-wise region.** Everything between the gathers and the combine only mixes values within a
   row (elementwise ops, per-row scales, grouped GEMMs with the proven ``offs``, reductions over
   non-row dims, ...). Only then may rows be reordered: our op sorts stably, HF's ``torch.sort`` does
   not, and padded layouts differ, but a row-wise region computes the same rows in any order.
6. **Combine.** ``y[inverse(perm)].view(T, K, H).sum(1)``, or ``zeros(T, H)`` accumulated by
   ``index_add_`` / ``scatter_add_`` / ``index_put_(accumulate=True)`` at ``perm // K``; a routing-weight
   multiply right before it is folded into ``unpad_unpermute`` when the result is used at the rows' dtype.

Ids in ``[0, E)`` (``permute_pad``'s contract) are assumed, except where the graph handles sentinel ids
``>= E`` (an in-place clamp of the ids, or a ``ids_sorted >= E`` mask, as transformers does for expert
parallelism): then the ids must be a router's top-k over ``E`` scores.

Each step is a function of earlier steps' results (frozen dataclasses in
:mod:`~moe_compile.passes.fuse_dispatch.steps`); :func:`match_dispatch` runs them in this order:

    prove_sort(sort)                                    -> SortedIds         step 1         (here)
    prove_gathers(SortedIds, order)                     -> Gathers           step 2         (here)
    find_padding(SortedIds, Gathers)                    -> Padding | None    step 4, found  (device_padding)
    RegionProof(order, SortedIds, Gathers, Padding)     -> RowRegion         steps 5, 6     (region)
        .prove()
    prove_offsets(SortedIds, Gathers, RowRegion,        -> Offsets           step 3         (offsets)
                  Padding)
    prove_id_range(SortedIds, Gathers, E)               -> IdRange           ids in [0, E)  (here)
    check_destination(Padding, Offsets, S)              -> None              step 4, proven (device_padding)
    prove_fold(Combine, Gathers, RowRegion)             -> Fold | None       step 6, weight (here)
    => Dispatch (what ``fuse_dispatch.rewrite`` consumes)

The region comes before the offsets because it finds the grouped GEMMs whose offsets are proven; the
padded destination is proven last because it needs the offsets' alignment. Anything unproven raises
:class:`NoMatch` with a reason tag (see ``fuse_dispatch``'s docstring); the first step to fail names it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx

from moe_compile.passes import NoMatch
from moe_compile.passes._graph import (
    arg,
    is_inplace,
    layer_name,
    op_name,
    same_int,
    tensor_val,
    val,
)
from moe_compile.passes.forms.ops import CASTS, FLAT_VIEWS, flat_source, ids_below
from moe_compile.passes.fuse_dispatch.device_padding import (
    check_destination,
    find_padding,
    sentinel_base,
)
from moe_compile.passes.fuse_dispatch.offsets import prove_offsets
from moe_compile.passes.fuse_dispatch.region import (
    RegionProof,
    gather_parts,
    index_of_floordiv,
    is_int_tensor,
)
from moe_compile.passes.fuse_dispatch.steps import (
    Combine,
    Dispatch,
    Fold,
    Gathers,
    IdRange,
    RowRegion,
    SortedIds,
)


def _clamp_bounds(node: fx.Node) -> tuple[int | None, int | None] | None:
    """``(min, max)`` of an in-place ``clamp_`` / ``clamp_min_`` / ``clamp_max_`` with int bounds, else None."""
    name = op_name(node)
    rest, kw = list(node.args[1:]), node.kwargs
    if name == "clamp_":
        low = rest[0] if len(rest) > 0 else kw.get("min")
        high = rest[1] if len(rest) > 1 else kw.get("max")
    elif name == "clamp_max_":
        low, high = None, rest[0] if rest else kw.get("max")
    elif name == "clamp_min_":
        low, high = rest[0] if rest else kw.get("min"), None
    else:
        return None
    if any(b is not None and (isinstance(b, bool) or not isinstance(b, int)) for b in (low, high)):
        return None
    return low, high


def _is_sentinel_test(cmp: fx.Node, ids: fx.Node, num_experts: int) -> bool:
    """``ids >= c`` with ``c >= E`` or ``ids > c`` with ``c >= E - 1``: the test for sentinel ids."""
    name, args = op_name(cmp), cmp.args
    if name not in ("ge", "gt") or len(args) != 2 or args[0] is not ids or cmp.kwargs:
        return False
    bound = args[1]
    if isinstance(bound, bool) or not isinstance(bound, int):
        return False
    return bound >= num_experts if name == "ge" else bound >= num_experts - 1


# ----------------------------------------------------------------------------------------------
# small structural helpers


def _is_float_tensor(node: Any, ndim: int | None = None) -> bool:
    v = tensor_val(node)
    return v is not None and v.is_floating_point() and (ndim is None or v.dim() == ndim)


def _index_consumers(idx: fx.Node, direct: fx.Node | None = None) -> list[fx.Node]:
    """Row gathers indexed by ``idx``, directly or through ``idx.unsqueeze(-1).expand(-1, H)``."""
    found = []
    firsts = [direct] if direct is not None else list(idx.users)
    for u in firsts:
        for g in [u, *u.users, *(w for v in u.users for w in v.users)]:
            parts = gather_parts(g)
            if parts is not None and parts[1] is idx and g not in found:
                found.append(g)
    return found


# ----------------------------------------------------------------------------------------------
# step 1: sort


def _sort_outputs(sort: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None]:
    """``(ids_flat, perm, ids_sorted)`` of an ascending sort / argsort along the only dim of 1-D int ids."""
    name = op_name(sort)
    ids = sort.args[0]
    dim = arg(sort, 1, "dim", -1)
    if name == "sort":
        # torch.sort(input, dim=-1, descending=False, stable=False) / sort(input, *, stable, dim, descending)
        descending = sort.kwargs.get("descending", sort.args[2] if len(sort.args) > 2 else False)
    else:
        descending = arg(sort, 2, "descending", False)
    if not is_int_tensor(ids, 1):
        raise NoMatch("not_expert_ids", "sorted tensor is not a 1-D integer tensor")
    if dim not in (0, -1):
        raise NoMatch("not_expert_ids", lambda: f"sort along dim={dim}")
    if descending:
        raise NoMatch("descending_sort", "expert ids sorted in descending order")
    if name == "argsort":
        return ids, sort, None
    perm = ids_sorted = None
    for u in sort.users:
        if op_name(u) == "getitem" and u.args[1] == 1:
            perm = u
        elif op_name(u) == "getitem" and u.args[1] == 0:
            ids_sorted = u
        elif u.op == "call_function" and u.target is getattr and u.args[1] == "indices":
            perm = u
        elif u.op == "call_function" and u.target is getattr and u.args[1] == "values":
            ids_sorted = u
    if perm is None:
        raise NoMatch("not_expert_ids", "sort without a permutation output")
    return ids, perm, ids_sorted


def prove_sort(sort: fx.Node) -> SortedIds:
    """Step 1: ``sort`` sorts 1-D integer ids ascending and gives their permutation; in-place writes to the
    ids are clamps only (their bounds are checked against ``E`` by :func:`prove_id_range`)."""
    ids_flat, perm, ids_sorted = _sort_outputs(sort)
    id_clamps: list[fx.Node] = []
    for n in (ids_flat, ids_sorted):
        if n is None:
            continue
        for u in n.users:
            if is_inplace(u) and u.args and u.args[0] is n:
                if _clamp_bounds(u) is None:
                    raise NoMatch("expert_ids_mutated", lambda u=u: f"{u.name} mutates the expert ids in place "
                                  "(expert-parallel sentinel ids are not supported)")
                id_clamps.append(u)
    return SortedIds(
        sort=sort, perm=perm, ids_flat=ids_flat, ids_sorted=ids_sorted, num_rows=tensor_val(perm).shape[0],
        id_clamps=tuple(id_clamps), matched=("argsort" if op_name(sort) == "argsort" else "sort") + "(ids)",
    )


# ----------------------------------------------------------------------------------------------
# step 2: gathers


def _sentinel_source(perm: fx.Node) -> tuple[Any, Any]:
    """``(x, K)`` for ``full(M, T)[dest] = perm // K`` gathered from ``x`` plus a zero sentinel row."""
    for u in perm.users:
        k = index_of_floordiv(u, perm)
        if k is None:
            continue
        for w in u.users:
            if op_name(w) not in ("setitem", "index_put_", "index_copy_") or w.args[0] is u:
                continue
            for g in w.args[0].users:
                parts = gather_parts(g)
                if parts is not None and parts[1] is w.args[0]:
                    base = sentinel_base(parts[0])
                    if base is not None:
                        return base, k
    return None, None


def _is_weighted_rows(node: Any) -> bool:
    """``(x.unsqueeze(1) * w.unsqueeze(-1)).reshape(T*K, H)``-like: a product with routing weights."""
    node = flat_source(node)
    seen = 0
    while isinstance(node, fx.Node) and seen < 8:
        seen += 1
        name = op_name(node)
        if name in ("mul", "mul_", "truediv"):
            return True
        if name in FLAT_VIEWS | CASTS | {"unsqueeze", "expand"}:
            node = node.args[0]
            continue
        return False
    return False


def _source_TK(flat: fx.Node | None, top_k: Any, is_kind: Any) -> fx.Node | None:
    """The 2-D ``[T, K]`` tensor ``flat`` flattens, if ``is_kind(source, 2)`` holds for it."""
    if flat is None:
        return None
    src = flat_source(flat)
    return src if is_kind(src, 2) and same_int(tensor_val(src).shape[1], top_k) else None


def prove_gathers(sorted_ids: SortedIds, order: dict[fx.Node, int]) -> Gathers:
    """Step 2: what ``perm`` gathers. Token rows ``x_TH[perm // K]`` (one source, one ``K``; or the sentinel
    form of :mod:`~moe_compile.passes.fuse_dispatch.device_padding`), weights ``w_S[perm]`` (one source)
    and ids ``ids_S[perm]`` (more sorted ids), with ``S == T * K``."""
    perm, S = sorted_ids.perm, sorted_ids.num_rows
    token_gathers: list[fx.Node] = []
    weight_gathers: list[fx.Node] = []
    more_sorted_ids: list[fx.Node] = []
    x_TH = probs_flat = None
    top_k: Any = None
    suspicious: list[fx.Node] = []
    candidates: list[tuple[fx.Node, Any]] = []  # (gather node, K or None for a plain perm index)
    for u in perm.users:
        k = index_of_floordiv(u, perm)
        if k is not None:
            for g in _index_consumers(u):
                candidates.append((g, k))
            continue
        for g in _index_consumers(perm, direct=u):
            candidates.append((g, None))
    for g, k in sorted(candidates, key=lambda c: order[c[0]]):
        src, _ = gather_parts(g)
        sv = tensor_val(src)
        if sv is None:
            continue
        if k is not None and sv.dim() == 2 and sv.is_floating_point():
            if x_TH is not None and src is not x_TH:
                raise NoMatch("multiple_gather_sources",
                              lambda x_TH=x_TH, src=src: f"token rows gathered from {x_TH.name} and {src.name}")
            if top_k is not None and not same_int(top_k, k):
                raise NoMatch("token_index_mismatch", "token rows gathered with two different top-k")
            x_TH, top_k = src, k
            token_gathers.append(g)
        elif k is None and sv.dim() == 1 and sv.is_floating_point() and same_int(sv.shape[0], S):
            if probs_flat is not None and src is not probs_flat:
                raise NoMatch("multiple_gather_sources", "two different weight vectors gathered by perm")
            probs_flat = src
            weight_gathers.append(g)
        elif k is None and sv.dim() == 1 and not sv.is_floating_point() and (
            src is sorted_ids.ids_flat or flat_source(src) is flat_source(sorted_ids.ids_flat)
        ):
            more_sorted_ids.append(g)  # ids_flat[perm] == sorted ids
        elif k is None and sv.dim() == 2 and sv.is_floating_point():
            suspicious.append(g)
    if x_TH is None and suspicious:
        g = suspicious[0]
        if _is_weighted_rows(gather_parts(g)[0]):
            raise NoMatch("weights_before_gather", lambda: "combine not matched: weights applied before gather "
                          f"({g.name} gathers already-weighted [T*K, H] rows by perm)")
        raise NoMatch("token_gather_not_matched",
                      lambda: f"{g.name} gathers [T*K, H] rows by perm instead of token rows by perm // K")
    if x_TH is None:
        x_TH, top_k = _sentinel_source(perm)
    if x_TH is None:
        raise NoMatch("token_gather_not_matched", "no x[perm // K] / index_select / gather of token rows")
    if token_gathers and not same_int(tensor_val(token_gathers[0]).shape[0], S):
        raise NoMatch("token_gather_not_matched", "token gather does not produce one row per routed pair")
    # K must be the width of the ids: flat index t*K + k
    iv = tensor_val(flat_source(sorted_ids.ids_flat))
    if iv.dim() == 2 and not same_int(iv.shape[1], top_k):
        raise NoMatch("token_index_mismatch",
                      lambda: f"token index is perm // {top_k} but ids have {iv.shape[1]} columns")
    T = tensor_val(x_TH).shape[0]
    if not same_int(S, T * val(top_k)):
        raise NoMatch("token_gather_not_matched", "number of routed rows is not tokens x top-k")
    matched = f"gather(x[perm//K] x{len(token_gathers)})" + ("+weights[perm]" if weight_gathers else "")
    return Gathers(
        x_TH=x_TH, top_k=top_k, num_tokens=T, token_gathers=tuple(token_gathers),
        weight_gathers=tuple(weight_gathers), probs_flat=probs_flat,
        ids_TK=_source_TK(sorted_ids.ids_flat, top_k, is_int_tensor),
        probs_TK=_source_TK(probs_flat, top_k, _is_float_tensor),
        sorted_ids=frozenset(n for n in (sorted_ids.ids_sorted, *more_sorted_ids) if n is not None),
        matched=matched,
    )


# ----------------------------------------------------------------------------------------------
# ids in [0, E)


def prove_id_range(sorted_ids: SortedIds, gathers: Gathers, num_experts: int) -> IdRange:
    """The ids' clamps keep ``[0, E)`` unchanged, and if the graph handles sentinel ids ``>= E`` (clamps or
    ``ids_sorted >= E`` tests) the ids are a router's top-k over ``E`` scores (:func:`ids_below`)."""
    for clamp in sorted_ids.id_clamps:
        low, high = _clamp_bounds(clamp)
        if (low is not None and low > 0) or (high is not None and high < num_experts - 1):
            raise NoMatch("expert_ids_mutated", f"{clamp.name} clamps expert ids to [{low}, {high}], "
                          f"which changes ids in [0, {num_experts})")
    sentinel_tests = tuple(u for n in sorted(gathers.sorted_ids, key=lambda n: n.name) for u in n.users
                           if _is_sentinel_test(u, n, num_experts))
    if (sorted_ids.id_clamps or sentinel_tests) and not ids_below(sorted_ids.ids_flat, num_experts):
        handling = (sorted_ids.id_clamps + sentinel_tests)[0].name
        raise NoMatch("expert_ids_unbounded", lambda: f"{handling} handles ids >= {num_experts} (expert-parallel "
                      f"sentinels) and the ids are not a top-k over {num_experts} router scores, so ids in "
                      f"[0, {num_experts}) is not proven")
    return IdRange(id_clamps=sorted_ids.id_clamps, sentinel_tests=sentinel_tests)


# ----------------------------------------------------------------------------------------------
# step 6: the routing-weight fold into the combine


def _result_used_at(combine: Combine, dtype: torch.dtype) -> bool:
    """The combined value is used only at ``dtype`` (directly, or through casts to it)."""
    result = combine.inplace_buffer if combine.inplace_buffer is not None else combine.result
    if tensor_val(result).dtype == dtype:
        return True
    users = [u for u in result.users if u is not combine.result]
    if not users:
        return False
    for u in users:
        if op_name(u) not in ("to", "bfloat16", "half", "float", "type_as") or tensor_val(u) is None \
                or tensor_val(u).dtype != dtype:
            return False
    return True


def _is_scale_step(node: fx.Node) -> bool:
    """A cast or a column view on the way from ``w[perm]`` to the multiply: ``w[perm][:, None].to(dt)``."""
    return (
        op_name(node) in ("to", "float", "bfloat16", "half", "type_as")
        or (op_name(node) == "unsqueeze" and arg(node, 1, "dim") in (-1, 1))
        or (op_name(node) in ("view", "reshape") and tensor_val(node).dim() == 2 and tensor_val(node).shape[1] == 1)
        or (op_name(node) == "getitem" and node.args[1] in ((slice(None), None), (Ellipsis, None)))
    )


def prove_fold(combine: Combine, gathers: Gathers, region: RowRegion) -> Fold | None:
    """The combined rows are ``rows * w[perm].unsqueeze(-1)`` with nothing else using the product: fold the
    weight into ``unpad_unpermute`` (fp32 accumulate), which saves writing fp32 rows.

    Only when the combine's result is used at the rows' dtype (directly or through casts to it), so the
    result never carries more precision than the unweighted rows, as in eager PyTorch. A weight applied
    after un-permuting (``combine.weight_TK``) is already ``unpad_unpermute``'s; it needs the same.
    """
    weight_gathers = gathers.weight_gathers
    if combine.weight_TK is not None:
        rows_dtype = tensor_val(combine.source).dtype
        if not _result_used_at(combine, rows_dtype):
            raise NoMatch("combine_not_matched", lambda: f"the weighted combine {combine.result.name} is used "
                          f"above the rows' precision ({rows_dtype}); moe.unpad_unpermute rounds to it once")
        return None
    prod = combine.source
    if op_name(prod) != "mul" or len(prod.args) != 2 or len(prod.users) != 1:
        return None
    for rows, scale in (prod.args, prod.args[::-1]):
        chain = []
        node = scale
        while isinstance(node, fx.Node) and node not in weight_gathers and len(node.users) == 1 \
                and _is_scale_step(node):
            chain.append(node)
            node = node.args[0]
        if node not in weight_gathers or len(node.users) != 1 or not chain:
            continue
        rv = tensor_val(rows)
        if not isinstance(rows, fx.Node) or rows not in region.spaces or rv is None or rv.dim() != 2:
            continue
        if not _result_used_at(combine, rv.dtype):
            return None
        return Fold(rows=rows, weight_gather=node, nodes=(prod, *chain))
    return None


# ----------------------------------------------------------------------------------------------
# the whole proof

_MATCHED_ORDER = ("sort", "gather", "counts", "pad", "grouped_mm", "row-wise", "combine")


def _ordered_matched(lines: Iterable[str]) -> tuple[str, ...]:
    """The steps' descriptions in the proof's logical order (the order above), for ``explain``."""
    def key(line: str) -> int:
        return next((i for i, p in enumerate(_MATCHED_ORDER) if p in line), len(_MATCHED_ORDER))

    return tuple(sorted(lines, key=key))


def match_dispatch(sort: fx.Node, order: dict[fx.Node, int]) -> Dispatch:
    """Prove the dispatch region anchored at ``sort`` (analysis only: the graph is not touched).

    Args:
        sort: a ``sort`` / ``argsort`` node from :func:`find_dispatch_anchors`.
        order: node -> topological index of the graph.

    Returns:
        The proven :class:`Dispatch`, assembled from the steps' results.

    Raises:
        NoMatch: the first step that fails, with its reason tag.
    """
    sorted_ids = prove_sort(sort)
    gathers = prove_gathers(sorted_ids, order)
    padding = find_padding(sorted_ids, gathers)
    region = RegionProof(order, sorted_ids, gathers, padding).prove()
    offsets = prove_offsets(sorted_ids, gathers, region, padding)
    id_range = prove_id_range(sorted_ids, gathers, offsets.num_experts)
    if padding is not None:
        check_destination(padding, offsets, sorted_ids.num_rows)
    fold = prove_fold(region.combine, gathers, region)
    matched = [sorted_ids.matched, gathers.matched, *([padding.matched] if padding else []), *region.matched,
               offsets.matched, *(["weight multiply folded into the combine"] if fold else [])]
    return Dispatch(
        layer=layer_name(sort), sort=sort, perm=sorted_ids.perm, ids_flat=sorted_ids.ids_flat, ids_TK=gathers.ids_TK,
        top_k=gathers.top_k, num_experts=offsets.num_experts, x_TH=gathers.x_TH, token_gathers=gathers.token_gathers,
        probs_flat=gathers.probs_flat, probs_TK=gathers.probs_TK, weight_gathers=gathers.weight_gathers,
        grouped_mms=region.grouped_mms, region=region.spaces, combine=region.combine, padding=padding,
        unpads=region.unpads, align=offsets.align, counts_kind=offsets.counts_kind,
        matched=_ordered_matched(matched), fold=fold, id_clamps=id_range.id_clamps,
        sentinel_tests=id_range.sentinel_tests,
    )


def find_dispatch_anchors(graph: fx.Graph) -> list[fx.Node]:
    """Sorts / argsorts of 1-D integer tensors whose permutation is used to index something."""
    anchors = []
    for node in graph.nodes:
        if op_name(node) not in ("sort", "argsort") or node.op not in ("call_function", "call_method"):
            continue
        ids = node.args[0] if node.args else None
        if not is_int_tensor(ids, 1):
            continue
        anchors.append(node)
    return anchors


def looks_like_dispatch(sort: fx.Node) -> bool:
    """The permutation (or ``perm // K``) indexes a floating tensor: worth a skip record if unmatched."""
    perms = [sort] if op_name(sort) == "argsort" else [u for u in sort.users if op_name(u) == "getitem"
                                                      and u.args[1] == 1]
    for perm in perms:
        for u in perm.users:
            targets = [u] + (list(u.users) if index_of_floordiv(u, perm) is not None else [])
            for t in targets:
                parts = gather_parts(t)
                if parts is not None and _is_float_tensor(parts[0]):
                    return True
    return False
