"""MoE layers composed from tables of dispatch forms: every way of permuting, counting, padding and
combining that the dispatch recogniser knows, in any combination (what the cross-product test compiles).

A :class:`Forms` picks one row of each table; :func:`ComposedMoE` builds the layer

    route -> permute (PERMUTES) -> counts (COUNTS, on the device or read to the host)
          -> padding (PADDINGS) -> SwiGLU experts by grouped GEMMs -> unpad
          -> combine (COMBINES) with the routing weight applied where WEIGHTS says.

The spellings live in the fuzzer's grammar (``tests/fuzz/grammar.py``, written out by ``tests/fuzz/emit.py``), which
has more of them than the passes know; the tables here are the subset that every dispatch pass must rewrite, and a
:class:`Forms` is one point of that grammar (:func:`spec_of`). Add a spelling to the grammar and the fuzzer
draws it; add its name here too and the cross-product test requires it to be rewritten against every other form.

Shapes: ``T`` tokens, ``H`` hidden, ``E`` experts, ``K`` top-k, ``S = T*K`` routed rows, ``M`` padded rows.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

import torch

from tests.fuzz import grammar
from tests.fuzz.emit import DTYPES, build
from tests.fuzz.grammar import Spec

PERMUTES = ("sort", "sort_stable", "argsort_stable", "masked_select")
COUNTS = ("histc", "histc_sorted", "one_hot_sum", "eq_arange_sum")
COUNT_PLACES = grammar.COUNT_PLACES  # host: counts.long().tolist(), sizes as Python ints
PADDINGS = grammar.PADDINGS
COMBINES = ("index_add", "scatter_add", "index_put_acc", "inverse_gather_sum", "scatter_unpermute_sum",
            "argsort_gather_sum", "index_copy_sum")
SUM_COMBINES = ("inverse_gather_sum", "scatter_unpermute_sum", "argsort_gather_sum", "index_copy_sum")
# where the routing weight multiplies: the sorted expert outputs in fp32 / in the activation dtype, the
# sorted rows before the experts, or (sum combines only) the un-permuted [T, K, H] view
WEIGHTS = ("rows_fp32", "rows_act", "before_experts", "after_unpermute")
assert set(PERMUTES) <= set(grammar.PERMUTES) and set(COUNTS) <= set(grammar.COUNTS)
assert set(COMBINES) <= set(grammar.COMBINES) and set(WEIGHTS) <= set(grammar.WEIGHTS)


@dataclasses.dataclass(frozen=True)
class Forms:
    permute: str
    counts: str
    count_place: str
    padding: str
    combine: str
    weight: str

    def __str__(self) -> str:
        return "-".join(dataclasses.astuple(self))

    @property
    def host(self) -> bool:
        return self.count_place == "host"


def valid(f: Forms) -> bool:
    """Combinations that are one coherent layer: host padding needs host sizes, device padding device
    counts; the post-unpermute weight exists only for the sum combines."""
    if f.padding.startswith("host") and not f.host:
        return False
    if f.padding == "device_static" and f.host:
        return False
    if f.weight == "after_unpermute" and f.combine not in SUM_COMBINES:
        return False
    if f.permute == "masked_select":
        return f.host and f.combine not in SUM_COMBINES and f.counts != "histc_sorted"
    return True


def all_forms() -> Iterator[Forms]:
    for combo in itertools.product(PERMUTES, COUNTS, COUNT_PLACES, PADDINGS, COMBINES, WEIGHTS):
        f = Forms(*combo)
        if valid(f):
            yield f


def spec_of(forms: Forms, hidden: int = 16, inter: int = 32, num_experts: int = 4, top_k: int = 2, align: int = 8,
            dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Spec:
    """The grammar's spec of ``forms``: softmax top-k router (fp32, renormalised), stacked SwiGLU experts by
    ``torch._grouped_mm``, dispatched in the given forms."""
    name = next(k for k, v in DTYPES.items() if v == dtype)
    return Spec(seed=seed, hidden=hidden, inter=inter, experts=num_experts, top_k=top_k, align=align, dtype=name,
                dispatch="masked" if forms.permute == "masked_select" else "sorted", permute=forms.permute,
                counts=forms.counts, count_place=forms.count_place, padding=forms.padding, combine=forms.combine,
                weight=forms.weight)


def ComposedMoE(forms: Forms, hidden: int = 16, inter: int = 32, num_experts: int = 4, top_k: int = 2,  # noqa: N802
                align: int = 8, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.nn.Module:
    """The layer of ``forms`` (:func:`spec_of`) with seeded weights: ``router [E, H]``, ``w13_EIH [E, 2I, H]``,
    ``w2_EHI [E, H, I]``; ``forward(x_TH) -> [T, H]``."""
    return build(spec_of(forms, hidden, inter, num_experts, top_k, align, dtype, seed))
