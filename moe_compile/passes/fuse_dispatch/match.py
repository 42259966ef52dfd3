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
   ``index_add_`` / ``scatter_add_`` / ``index_put_(accumulate=True)`` at ``perm // K``.

Ids in ``[0, E)`` (``permute_pad``'s contract) are assumed, except where the graph handles sentinel ids
``>= E`` (an in-place clamp of the ids, or a ``ids_sorted >= E`` mask, as transformers does for expert
parallelism): then the ids must be a router's top-k over ``E`` scores.

Anything unproven raises :class:`NoMatch` with a reason tag (see ``fuse_dispatch``'s docstring). Step 4 is
:mod:`moe_compile.passes.fuse_dispatch.device_padding`; steps 5 and 6 (and the row gathers every step reads) are
:mod:`moe_compile.passes.fuse_dispatch.region`.
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
    layer_name,
    op_name,
    same_int,
    tensor_val,
    val,
)
from moe_compile.passes.forms import index_algebra as ia
from moe_compile.passes.forms.counts import expert_counts, ids_base
from moe_compile.passes.forms.ops import CASTS, FLAT_VIEWS
from moe_compile.passes.fuse_dispatch.device_padding import (
    DevicePaddingProof,
    sentinel_base,
)
from moe_compile.passes.fuse_dispatch.region import (
    Combine,
    Padding,
    RegionProof,
    gather_parts,
    index_of_floordiv,
    is_int_tensor,
)


@dataclasses.dataclass
class Fold:
    """``combine(rows * w[perm][:, None])`` -> ``unpad_unpermute(rows, row_map, w_TK)`` (fp32 accumulate)."""

    rows: fx.Node  # the unweighted expert output rows
    weight_gather: fx.Node
    nodes: list[fx.Node]  # the multiply and the scale chain (erased)


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


# casts that keep every expert id (a router has far fewer than 2**15 experts)
_ID_DTYPES = (torch.int16, torch.int32, torch.int64)


def ids_below(ids_flat: fx.Node, num_experts: int) -> bool:
    """Whether ``ids_flat`` is provably in ``[0, E)``: through flatten views and integer casts, the indices
    of a ``topk`` along the last dim of a tensor whose last dim is ``E`` (every router's top-k)."""
    node = _flat_source(ids_flat)
    while isinstance(node, fx.Node) and op_name(node) in ("to", "long", "int", "type"):
        v = tensor_val(node)
        if v is None or v.dtype not in _ID_DTYPES:
            return False
        node = node.args[0]
    if not isinstance(node, fx.Node):
        return False
    is_indices = (op_name(node) == "getitem" and node.args[1] == 1) or (
        node.op == "call_function" and node.target is getattr and node.args[1] == "indices")
    topk = node.args[0] if is_indices else None
    if not isinstance(topk, fx.Node) or op_name(topk) != "topk":
        return False
    scores = tensor_val(topk.args[0])
    if scores is None or scores.dim() == 0 or known_int(scores.shape[-1]) != num_experts:
        return False
    dim = known_int(arg(topk, 2, "dim", -1))
    return dim is not None and dim % scores.dim() == scores.dim() - 1


@dataclasses.dataclass
class Dispatch:
    layer: str
    sort: fx.Node
    perm: fx.Node
    ids_flat: fx.Node
    ids_TK: fx.Node | None  # 2-D [T, K] source of ids_flat, if any
    top_k: Any  # K (int or SymInt node)
    num_experts: int
    x_TH: fx.Node
    token_gathers: list[fx.Node]
    probs_flat: fx.Node | None
    probs_TK: fx.Node | None
    weight_gathers: list[fx.Node]
    grouped_mms: list[fx.Node]
    region: dict[fx.Node, str]  # node -> row space ("S" sorted rows, "M" padded rows)
    combine: Combine
    padding: Padding | None
    counts_kind: str
    matched: list[str]
    # routing-weight multiply folded into unpad_unpermute: (unweighted rows, weight gather, scale nodes)
    fold: Fold | None = None
    # in-place clamps of the ids that leave every id in [0, E) unchanged (transformers clamps sorted
    # ids to E-1 for expert-parallel sentinels); erased with the sort
    id_clamps: list[fx.Node] = dataclasses.field(default_factory=list)
    # ``ids_sorted >= E`` tests of the sorted ids (transformers' sentinel masks), all False once the ids are
    # proven in [0, E); the rewrite drops the masked fills they feed
    sentinel_tests: list[fx.Node] = dataclasses.field(default_factory=list)

    @property
    def align(self) -> int:
        return self.padding.align if self.padding else 1


# ----------------------------------------------------------------------------------------------
# small structural helpers


def _is_float_tensor(node: Any, ndim: int | None = None) -> bool:
    v = tensor_val(node)
    return v is not None and v.is_floating_point() and (ndim is None or v.dim() == ndim)


def _flat_source(node: fx.Node) -> fx.Node:
    """Walk back through flatten-like views (``reshape(-1)``, ``view(-1)``, ``flatten()``)."""
    while isinstance(node, fx.Node) and op_name(node) in FLAT_VIEWS:
        src = node.args[0]
        sv = tensor_val(src)
        if sv is None or sv.numel() != tensor_val(node).numel():
            break
        node = src
    return node


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
# the matcher


class Matcher(DevicePaddingProof, RegionProof):
    """Analyses one sort/argsort anchor. :meth:`match` returns a :class:`Dispatch` or raises."""

    def __init__(self, graph: fx.Graph, sort: fx.Node, order: dict[fx.Node, int]) -> None:
        self.graph = graph
        self.sort = sort
        self.order = order
        self.layer = layer_name(sort)
        self.matched: list[str] = []

    # -- 1. sort -------------------------------------------------------------------------------
    def _sort_parts(self) -> tuple[fx.Node, fx.Node, fx.Node | None]:
        node = self.sort
        name = op_name(node)
        ids = node.args[0]
        dim = arg(node, 1, "dim", -1)
        if name == "sort":
            # torch.sort(input, dim=-1, descending=False, stable=False) / sort(input, *, stable, dim, descending)
            descending = node.kwargs.get("descending", node.args[2] if len(node.args) > 2 else False)
        else:
            descending = arg(node, 2, "descending", False)
        if not is_int_tensor(ids, 1):
            raise NoMatch("not_expert_ids", "sorted tensor is not a 1-D integer tensor")
        if dim not in (0, -1):
            raise NoMatch("not_expert_ids", f"sort along dim={dim}")
        if descending:
            raise NoMatch("descending_sort", "expert ids sorted in descending order")
        if name == "argsort":
            perm, ids_sorted = node, None
        else:
            perm = ids_sorted = None
            for u in node.users:
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

    def match(self) -> Dispatch:
        ids_flat, perm, ids_sorted = self._sort_parts()
        self.ids_flat, self.perm = ids_flat, perm
        self.S = tensor_val(perm).shape[0]
        self.sorted_ids = {n for n in (ids_sorted,) if n is not None}
        self.id_clamps: list[fx.Node] = []
        for n in (ids_flat, *self.sorted_ids):
            for u in n.users:
                if is_inplace(u) and u.args and u.args[0] is n:
                    if _clamp_bounds(u) is None:
                        raise NoMatch("expert_ids_mutated", f"{u.name} mutates the expert ids in place "
                                      "(expert-parallel sentinel ids are not supported)")
                    self.id_clamps.append(u)  # checked against E below
        self.matched.append(("argsort" if op_name(self.sort) == "argsort" else "sort") + "(ids)")

        # -- 2. gathers --------------------------------------------------------------------------
        token_gathers, x_TH, top_k, weight_gathers, probs_flat = self._gathers()
        self.x_TH, self.top_k = x_TH, top_k
        ids_src = _flat_source(ids_flat)
        ids_TK = ids_src if is_int_tensor(ids_src, 2) and same_int(tensor_val(ids_src).shape[1], top_k) else None
        probs_TK = None
        if probs_flat is not None:
            src = _flat_source(probs_flat)
            if _is_float_tensor(src, 2) and same_int(tensor_val(src).shape[1], top_k):
                probs_TK = src
        T = tensor_val(x_TH).shape[0]
        if not same_int(self.S, T * val(top_k)):
            raise NoMatch("token_gather_not_matched", "number of routed rows is not tokens x top-k")
        self.T = T

        # -- 3. padding (optional), region and combine -----------------------------------------------
        padding = self._padding(token_gathers, weight_gathers)
        region, grouped_mms, combine = self._region(token_gathers, weight_gathers, padding)
        # -- 4. offsets of every grouped GEMM ------------------------------------------------------
        num_experts, counts_kind = self._check_offsets(grouped_mms, padding)
        for clamp in self.id_clamps:
            low, high = _clamp_bounds(clamp)
            if (low is not None and low > 0) or (high is not None and high < num_experts - 1):
                raise NoMatch("expert_ids_mutated", f"{clamp.name} clamps expert ids to [{low}, {high}], "
                              f"which changes ids in [0, {num_experts})")
        sentinel_tests = [u for n in sorted(self.sorted_ids, key=lambda n: n.name) for u in n.users
                          if _is_sentinel_test(u, n, num_experts)]
        if (self.id_clamps or sentinel_tests) and not ids_below(ids_flat, num_experts):
            handling = (self.id_clamps + sentinel_tests)[0].name
            raise NoMatch("expert_ids_unbounded", f"{handling} handles ids >= {num_experts} (expert-parallel "
                          f"sentinels) and the ids are not a top-k over {num_experts} router scores, so ids in "
                          f"[0, {num_experts}) is not proven")
        if padding is not None:
            self._check_destination(padding, num_experts)
        fold = self._fold(combine, weight_gathers, region)
        if fold is not None:
            self.matched.append("weight multiply folded into the combine")
        return Dispatch(
            layer=self.layer, sort=self.sort, perm=perm, ids_flat=ids_flat, ids_TK=ids_TK, top_k=top_k,
            num_experts=num_experts, x_TH=x_TH, token_gathers=token_gathers, probs_flat=probs_flat,
            probs_TK=probs_TK, weight_gathers=weight_gathers, grouped_mms=grouped_mms, region=region,
            combine=combine, padding=padding, counts_kind=counts_kind, matched=self._ordered_matched(), fold=fold,
            id_clamps=self.id_clamps, sentinel_tests=sentinel_tests,
        )

    def _ordered_matched(self) -> list[str]:
        order = ("sort", "gather", "counts", "pad", "grouped_mm", "row-wise", "combine")
        key = lambda m: next((i for i, p in enumerate(order) if p in m), len(order))  # noqa: E731
        return sorted(self.matched, key=key)

    def _fold(self, combine: Combine, weight_gathers: list[fx.Node], region: dict[fx.Node, str]) -> Fold | None:
        """The combined rows are ``rows * w[perm].unsqueeze(-1)`` with nothing else using the product:
        fold the weight into ``unpad_unpermute`` (fp32 accumulate), which saves writing fp32 rows.

        Only when the combine's result is used at the rows' dtype (directly or through casts to it), so
        the result never carries more precision than the unweighted rows, as in eager PyTorch.
        """
        if combine.weight_TK is not None:
            rows_dtype = tensor_val(combine.source).dtype
            if not self._result_used_at(combine, rows_dtype):
                raise NoMatch("combine_not_matched", f"the weighted combine {combine.result.name} is used above "
                              f"the rows' precision ({rows_dtype}); moe.unpad_unpermute rounds to it once")
            return None
        prod = combine.source
        if op_name(prod) != "mul" or len(prod.args) != 2 or len(prod.users) != 1:
            return None
        for rows, scale in (prod.args, prod.args[::-1]):
            chain = []
            node = scale
            while isinstance(node, fx.Node) and node not in weight_gathers and len(node.users) == 1 and (
                op_name(node) in ("to", "float", "bfloat16", "half", "type_as")
                or (op_name(node) == "unsqueeze" and arg(node, 1, "dim") in (-1, 1))
                or (op_name(node) in ("view", "reshape") and tensor_val(node).dim() == 2
                    and tensor_val(node).shape[1] == 1)
                or (op_name(node) == "getitem" and node.args[1] in ((slice(None), None), (Ellipsis, None)))
            ):
                chain.append(node)
                node = node.args[0]
            if node not in weight_gathers or len(node.users) != 1 or not chain:
                continue
            rv = tensor_val(rows)
            if not isinstance(rows, fx.Node) or rows not in region or rv is None or rv.dim() != 2:
                continue
            if not self._result_used_at(combine, rv.dtype):
                return None
            return Fold(rows=rows, weight_gather=node, nodes=[prod, *chain])
        return None

    def _result_used_at(self, combine: Combine, dtype: torch.dtype) -> bool:
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

    # -- 2. gathers ------------------------------------------------------------------------------
    def _gathers(self):
        perm = self.perm
        token_gathers: list[fx.Node] = []
        weight_gathers: list[fx.Node] = []
        x_TH = probs_flat = None
        top_k: Any = None
        suspicious: list[str] = []
        candidates: list[tuple[fx.Node, Any]] = []  # (gather node, K or None for a plain perm index)
        for u in perm.users:
            k = index_of_floordiv(u, perm)
            if k is not None:
                for g in _index_consumers(u):
                    candidates.append((g, k))
                continue
            for g in _index_consumers(perm, direct=u):
                candidates.append((g, None))
        for g, k in sorted(candidates, key=lambda c: self.order[c[0]]):
            src, _ = gather_parts(g)
            sv = tensor_val(src)
            if sv is None:
                continue
            if k is not None and sv.dim() == 2 and sv.is_floating_point():
                if x_TH is not None and src is not x_TH:
                    raise NoMatch("multiple_gather_sources", f"token rows gathered from {x_TH.name} and {src.name}")
                if top_k is not None and not same_int(top_k, k):
                    raise NoMatch("token_index_mismatch", "token rows gathered with two different top-k")
                x_TH, top_k = src, k
                token_gathers.append(g)
            elif k is None and sv.dim() == 1 and sv.is_floating_point() and same_int(sv.shape[0], self.S):
                if probs_flat is not None and src is not probs_flat:
                    raise NoMatch("multiple_gather_sources", "two different weight vectors gathered by perm")
                probs_flat = src
                weight_gathers.append(g)
            elif k is None and sv.dim() == 1 and not sv.is_floating_point() and (
                src is self.ids_flat or _flat_source(src) is _flat_source(self.ids_flat)
            ):
                self.sorted_ids.add(g)  # ids_flat[perm] == sorted ids
            elif k is None and sv.dim() == 2 and sv.is_floating_point():
                suspicious.append(g)
        if x_TH is None and suspicious:
            g = suspicious[0]
            src = gather_parts(g)[0]
            if self._is_weighted_rows(src):
                raise NoMatch("weights_before_gather", "combine not matched: weights applied before gather "
                              f"({g.name} gathers already-weighted [T*K, H] rows by perm)")
            raise NoMatch("token_gather_not_matched",
                          f"{g.name} gathers [T*K, H] rows by perm instead of token rows by perm // K")
        if x_TH is None:
            x_TH, top_k = self._sentinel_source()
        if x_TH is None:
            raise NoMatch("token_gather_not_matched", "no x[perm // K] / index_select / gather of token rows")
        if token_gathers and not same_int(tensor_val(token_gathers[0]).shape[0], self.S):
            raise NoMatch("token_gather_not_matched", "token gather does not produce one row per routed pair")
        # K must be the width of the ids: flat index t*K + k
        ids_src = _flat_source(self.ids_flat)
        iv = tensor_val(ids_src)
        if iv.dim() == 2 and not same_int(iv.shape[1], top_k):
            raise NoMatch("token_index_mismatch", f"token index is perm // {top_k} but ids have {iv.shape[1]} columns")
        desc = f"gather(x[perm//K] x{len(token_gathers)})"
        if weight_gathers:
            desc += "+weights[perm]"
        self.matched.append(desc)
        return token_gathers, x_TH, top_k, weight_gathers, probs_flat

    def _sentinel_source(self) -> tuple[Any, Any]:
        """``(x, K)`` for ``full(M, T)[dest] = perm // K`` gathered from ``x`` plus a zero sentinel row."""
        for u in self.perm.users:
            k = index_of_floordiv(u, self.perm)
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

    def _is_weighted_rows(self, node: Any) -> bool:
        """``(x.unsqueeze(1) * w.unsqueeze(-1)).reshape(T*K, H)``-like: a product with routing weights."""
        node = _flat_source(node)
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

    def _num_tokens(self) -> Any:
        return tensor_val(self.x_TH).shape[0]

    # -- 3. counts and offsets -------------------------------------------------------------------
    def _counts_of(self, node: fx.Node) -> tuple[int, str] | None:
        """``(E, kind)`` if ``node`` counts the routed expert ids per expert (forms in ``_count_forms``)."""
        return expert_counts(node, self._is_ids)

    def _is_ids(self, node: Any) -> bool:
        """The routed expert ids in any order or flattening (what counts may be computed from)."""
        node = ia.strip_casts(node)
        if not isinstance(node, fx.Node):
            return False
        if node in self.sorted_ids:
            return True
        return ids_base(node) is ids_base(self.ids_flat)

    def _check_offsets(self, grouped_mms: list[fx.Node], padding: Padding | None) -> tuple[int, str]:
        found: dict[str, Any] = {}

        def is_counts(node: fx.Node) -> bool:
            c = self._counts_of(node)
            if c is None:
                return False
            if "E" in found and found["E"] != c[0]:
                raise NoMatch("offsets_not_matched", f"counts over {found['E']} and {c[0]} experts")
            found["E"], found["kind"] = c
            return True

        forms = ia.LinearForms(is_counts, lambda n: n in self.sorted_ids, lambda r: same_int(r, self.S))
        align = None
        for mm in grouped_mms:
            offs = arg(mm, 2, "offs")
            if not isinstance(offs, fx.Node):
                raise NoMatch("offsets_not_matched", f"{mm.name} has no device offsets")
            ov = tensor_val(offs)
            if ov is None or ov.dtype != torch.int32 or ov.dim() != 1:
                raise NoMatch("offsets_not_matched", f"{mm.name} offsets are not a 1-D int32 tensor")
            try:
                form = forms(offs)
            except ia.NotLinear as exc:
                raise NoMatch("offsets_not_matched", f"{mm.name} offsets are not cumsum(counts of ids): {exc}") from None
            a = _alignment_of_offsets(form)
            if a is None:
                raise NoMatch("offsets_not_matched", f"{mm.name} offsets are not cumsum of (padded) expert counts")
            if align is not None and a != align:
                raise NoMatch("offsets_not_matched", "grouped GEMMs use different offsets")
            align = a
            w = tensor_val(mm.args[1])
            if w is None or w.dim() != 3 or known_int(w.shape[0]) != found.get("E"):
                raise NoMatch("offsets_not_matched", f"{mm.name} weight does not have one matrix per expert")
        E = found["E"]
        if padding is None and align != 1:
            raise NoMatch("padding_not_proven", f"offsets are padded to {align} but no padded buffer was found")
        if padding is not None:
            if align == 1:
                raise NoMatch("padding_not_proven", "padded buffer used with unpadded offsets")
            from moe_compile.ops._common import SUPPORTED_ALIGNMENTS

            if align not in SUPPORTED_ALIGNMENTS:
                raise NoMatch("unsupported_alignment", f"padding to {align} rows (supported: {SUPPORTED_ALIGNMENTS})")
            padding.align = align
            self._forms = forms
        self.matched.append(f"counts({found['kind']})->cumsum offsets" + (f" padded to {align}" if align != 1 else ""))
        return E, found["kind"]

def _alignment_of_offsets(form: ia.Form) -> int | None:
    """``a`` if ``form`` is ``cumsum(ceil(counts / a) * a)`` (``cumsum(counts)`` for ``a == 1``)."""
    if form == ia.expected_offsets(1):
        return 1
    if form.const or len(form.terms) != 1:
        return None
    (atom, coef), = form.terms
    if atom[0] == "cumsum" and atom[1][0] == "ceil" and atom[1][2] == coef and form == ia.expected_offsets(coef):
        return coef
    return None


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
