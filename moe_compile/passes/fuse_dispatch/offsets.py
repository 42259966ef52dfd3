"""Step 3 of the dispatch proof (:mod:`moe_compile.passes.fuse_dispatch.match`): counts and offsets.

Every grouped GEMM of the region must take, as its ``offs``, a 1-D int32 tensor that reads as the linear form
(:mod:`~moe_compile.passes.forms.index_algebra`)

    cumsum(counts_E)                          unpadded (a == 1)
    cumsum(ceil(counts_E / a) * a)            padded to a multiple of a rows per expert

where ``counts_E`` counts the routed ids per expert in any spelling of
:func:`~moe_compile.passes.forms.counts.expert_counts` (``histc``, ``bincount``, ``one_hot(...).sum``,
``(ids == arange(E)).sum``) of the ids in any order or flattening.

    prove_offsets(SortedIds, Gathers, RowRegion, Padding | None) -> Offsets
        before: offs of each of RowRegion.grouped_mms, the padded buffers found (or None)
        after:  Offsets(num_experts E, counts_kind, align a, forms), forms reused for the padded destination

A padded layout needs ``a > 1`` and an alignment ``permute_pad`` supports; no padding needs ``a == 1``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from moe_compile.ops._common import SUPPORTED_ALIGNMENTS
from moe_compile.passes import NoMatch
from moe_compile.passes._graph import arg, known_int, same_int, tensor_val
from moe_compile.passes.forms import index_algebra as ia
from moe_compile.passes.forms.counts import expert_counts, ids_base
from moe_compile.passes.forms.ops import strip_casts
from moe_compile.passes.fuse_dispatch.steps import (
    Gathers,
    Offsets,
    Padding,
    RowRegion,
    SortedIds,
)


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


def _is_ids(node: Any, sorted_ids: SortedIds, gathers: Gathers) -> bool:
    """The routed expert ids in any order or flattening (what counts may be computed from)."""
    node = strip_casts(node)
    if not isinstance(node, fx.Node):
        return False
    if node in gathers.sorted_ids:
        return True
    return ids_base(node) is ids_base(sorted_ids.ids_flat)


def prove_offsets(sorted_ids: SortedIds, gathers: Gathers, region: RowRegion, padding: Padding | None) -> Offsets:
    """Step 3: the offsets of every grouped GEMM in ``region`` are the (padded) cumulative counts of the ids.

    Raises:
        NoMatch: ``offsets_not_matched``, ``padding_not_proven`` (padding and alignment disagree) or
            ``unsupported_alignment``.
    """
    found: dict[str, Any] = {}

    def is_counts(node: fx.Node) -> bool:
        c = expert_counts(node, lambda n: _is_ids(n, sorted_ids, gathers))
        if c is None:
            return False
        if "E" in found and found["E"] != c[0]:
            raise NoMatch("offsets_not_matched", f"counts over {found['E']} and {c[0]} experts")
        found["E"], found["kind"] = c
        return True

    forms = ia.LinearForms(is_counts, lambda n: n in gathers.sorted_ids,
                           lambda r: same_int(r, sorted_ids.num_rows))
    align = None
    for mm in region.grouped_mms:
        offs = arg(mm, 2, "offs")
        if not isinstance(offs, fx.Node):
            raise NoMatch("offsets_not_matched", f"{mm.name} has no device offsets")
        ov = tensor_val(offs)
        if ov is None or ov.dtype != torch.int32 or ov.dim() != 1:
            raise NoMatch("offsets_not_matched", f"{mm.name} offsets are not a 1-D int32 tensor")
        try:
            form = forms(offs)
        except ia.NotLinear as exc:
            # the reason a form is not linear can be long: formatted only if the skip is recorded
            raise NoMatch("offsets_not_matched",
                          lambda mm=mm, exc=exc: f"{mm.name} offsets are not cumsum(counts of ids): {exc}") from None
        a = _alignment_of_offsets(form)
        if a is None:
            raise NoMatch("offsets_not_matched", f"{mm.name} offsets are not cumsum of (padded) expert counts")
        if align is not None and a != align:
            raise NoMatch("offsets_not_matched", "grouped GEMMs use different offsets")
        align = a
        w = tensor_val(mm.args[1])
        if w is None or w.dim() != 3 or known_int(w.shape[0]) != found.get("E"):
            raise NoMatch("offsets_not_matched", f"{mm.name} weight does not have one matrix per expert")
    if padding is None and align != 1:
        raise NoMatch("padding_not_proven", f"offsets are padded to {align} but no padded buffer was found")
    if padding is not None:
        if align == 1:
            raise NoMatch("padding_not_proven", "padded buffer used with unpadded offsets")
        if align not in SUPPORTED_ALIGNMENTS:
            raise NoMatch("unsupported_alignment", f"padding to {align} rows (supported: {SUPPORTED_ALIGNMENTS})")
    matched = f"counts({found['kind']})->cumsum offsets" + (f" padded to {align}" if align != 1 else "")
    return Offsets(num_experts=found["E"], counts_kind=found["kind"], align=align, forms=forms, matched=matched)
