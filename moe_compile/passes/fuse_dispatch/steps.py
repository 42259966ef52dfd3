"""The results of the dispatch proof's steps (:mod:`moe_compile.passes.fuse_dispatch.match`), one frozen
dataclass per step. Each step is a function of earlier results and returns the next one; none of them
touches the graph, so a failed proof (:class:`~moe_compile.passes.NoMatch`) leaves nothing behind.

Shapes: ``T`` tokens, ``H`` hidden, ``E`` experts, ``K`` top-k, ``S = T * K`` routed (sorted) rows,
``M`` rows of a padded buffer.

=========================  ============================================  ===================
step (in the order run)    function                                      returns
=========================  ============================================  ===================
1. sort                    ``match.prove_sort(sort)``                    :class:`SortedIds`
2. gathers                 ``match.prove_gathers(sorted_ids, order)``    :class:`Gathers`
4. padding (found)         ``device_padding.find_padding(...)``          :class:`Padding` or None
5. region + 6. combine     ``region.RegionProof(...).prove()``           :class:`RowRegion` (with its :class:`Combine`)
3. counts and offsets      ``offsets.prove_offsets(...)``                :class:`Offsets`
   ids in ``[0, E)``       ``match.prove_id_range(...)``                 :class:`IdRange`
4. padding (proven)        ``device_padding.check_destination(...)``     None (raises if unproven)
6. weight fold             ``match.prove_fold(...)``                     :class:`Fold` or None
=========================  ============================================  ===================

:class:`Dispatch`, assembled from all of them by ``match.match_dispatch``, is what
:func:`moe_compile.passes.fuse_dispatch.rewrite.rewrite` consumes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.fx as fx

from moe_compile.passes.forms import index_algebra as ia


@dataclasses.dataclass(frozen=True)
class SortedIds:
    """Step 1: ``ids_sorted, perm = sort(ids_S)`` (or ``perm = argsort(ids_S)``)."""

    sort: fx.Node  # the sort / argsort node
    perm: fx.Node  # the permutation [S]
    ids_flat: fx.Node  # the sorted ids_S
    ids_sorted: fx.Node | None  # the sort's values output, if used
    num_rows: Any  # S (int or SymInt)
    # in-place clamps of ids_flat / ids_sorted; their bounds are checked against E once E is known
    id_clamps: tuple[fx.Node, ...]
    matched: str


@dataclasses.dataclass(frozen=True)
class Gathers:
    """Step 2: token rows ``x_TH[perm // K]``, weights ``w_S[perm]`` and ids ``ids_S[perm]``."""

    x_TH: fx.Node
    top_k: Any  # K (int or SymInt node)
    num_tokens: Any  # T (int or SymInt)
    token_gathers: tuple[fx.Node, ...]  # empty for the sentinel form (rows gathered through a full(M, T) index)
    weight_gathers: tuple[fx.Node, ...]
    probs_flat: fx.Node | None
    ids_TK: fx.Node | None  # 2-D [T, K] source of ids_flat, if any
    probs_TK: fx.Node | None  # 2-D [T, K] source of probs_flat, if any
    # every node equal to the sorted ids: the sort's values output and the gathers ids_S[perm]
    sorted_ids: frozenset[fx.Node]
    matched: str


@dataclasses.dataclass(frozen=True)
class Padding:
    """Step 4: the sorted rows written to a padded ``[M, H]`` buffer at ``dest_S`` (proven against the
    offsets' alignment later, by ``device_padding.check_destination``)."""

    num_rows: Any  # M of the user's buffer (int or SymInt)
    dest: fx.Node  # padded destination rows of the sorted rows [S]
    seeds: tuple[fx.Node, ...]  # padded [M, H] row buffers (replaced by rows_MH)
    prob_seeds: tuple[fx.Node, ...]  # padded [M] probs buffers (replaced by probs_M)
    writes: tuple[fx.Node, ...]  # in-place writes that build the padded buffers (erased)
    # seeds written with the token rows weighted before the experts (x[perm // K] * w[perm][:, None]):
    # replaced by rows_MH * probs_M[:, None] in the rows' dtype
    weighted_seeds: tuple[fx.Node, ...]
    matched: str


@dataclasses.dataclass(frozen=True)
class Combine:
    """Step 6: how the expert rows come back to tokens."""

    kind: str  # "inverse_perm_sum" | "index_add" | "scatter_add" | "index_put"
    source: fx.Node  # the region node combined ([S, H] sorted rows)
    result: fx.Node  # the node whose value is the combined [T, H]
    inplace_buffer: fx.Node | None  # the zeros buffer an in-place accumulate mutated
    nodes: tuple[fx.Node, ...]  # combine nodes to erase after rewiring
    # routing weight applied after un-permuting, in [T, K] order ((y.view(T, K, H) * w[..., None]).sum(1))
    weight_TK: fx.Node | None = None


@dataclasses.dataclass(frozen=True)
class RowRegion:
    """Steps 5 and 6: the row-wise region between the gathers and the combine, and the combine."""

    spaces: dict[fx.Node, str]  # node -> row space ("S" sorted rows, "M" padded rows)
    grouped_mms: tuple[fx.Node, ...]
    unpads: tuple[fx.Node, ...]  # Y[dest] gathers back from padded to sorted rows (replaced by Y)
    combine: Combine
    matched: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Offsets:
    """Step 3: every grouped GEMM's ``offs`` is ``cumsum(ceil(counts / a) * a)`` of the ids' counts."""

    num_experts: int  # E
    counts_kind: str  # how the counts are spelled (histc, bincount, ...)
    align: int  # a (1: unpadded)
    forms: ia.LinearForms  # the linear-form reader that proved them (reused for the padded destination)
    matched: str


@dataclasses.dataclass(frozen=True)
class IdRange:
    """Ids in ``[0, E)``: the graph's handling of sentinel ids ``>= E`` that the rewrite drops."""

    # in-place clamps that leave every id in [0, E) unchanged (transformers clamps sorted ids to E-1 for
    # expert-parallel sentinels); erased with the sort
    id_clamps: tuple[fx.Node, ...]
    # ``ids_sorted >= E`` tests of the sorted ids (transformers' sentinel masks), all False once the ids are
    # proven in [0, E); the rewrite drops the masked fills they feed
    sentinel_tests: tuple[fx.Node, ...]


@dataclasses.dataclass(frozen=True)
class Fold:
    """``combine(rows * w[perm][:, None])`` -> ``unpad_unpermute(rows, row_map, w_TK)`` (fp32 accumulate)."""

    rows: fx.Node  # the unweighted expert output rows
    weight_gather: fx.Node
    nodes: tuple[fx.Node, ...]  # the multiply and the scale chain (erased)


@dataclasses.dataclass(frozen=True)
class Dispatch:
    """One proven dispatch region, assembled from the step results above."""

    layer: str
    sort: fx.Node
    perm: fx.Node
    ids_flat: fx.Node
    ids_TK: fx.Node | None  # 2-D [T, K] source of ids_flat, if any
    top_k: Any  # K (int or SymInt node)
    num_experts: int
    x_TH: fx.Node
    token_gathers: tuple[fx.Node, ...]
    probs_flat: fx.Node | None
    probs_TK: fx.Node | None
    weight_gathers: tuple[fx.Node, ...]
    grouped_mms: tuple[fx.Node, ...]
    region: dict[fx.Node, str]  # node -> row space ("S" sorted rows, "M" padded rows)
    combine: Combine
    padding: Padding | None
    unpads: tuple[fx.Node, ...]  # Y[dest] gathers of the padded rows (empty without padding)
    align: int  # rows per expert are padded to a multiple of this (1: no padding)
    counts_kind: str
    matched: tuple[str, ...]
    # routing-weight multiply folded into unpad_unpermute
    fold: Fold | None
    id_clamps: tuple[fx.Node, ...]  # see IdRange
    sentinel_tests: tuple[fx.Node, ...]  # see IdRange
