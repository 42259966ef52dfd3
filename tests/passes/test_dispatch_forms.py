"""The cross product of dispatch forms: every combination of permutation, counts (device or host),
padding, combine and weight placement from ``tests/models/composed.py`` is rewritten by exactly one pass,
leaves no accumulating scatter and no host read in the graph, and matches eager (forward and grads).

Default run: a fixed stratified subset (every value of every axis at least once, at two token counts, in training
and in eval) and a Hypothesis sample of the combinations (the failing combination and Hypothesis' seed are
printed on failure; ``@reproduce_failure`` blobs are printed too). ``-m slow``: all of them
(1581 combinations, ~30 min on 2 cores).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_compile import report
from moe_compile.config import MoECompileConfig
from moe_compile.passes import StagePass
from moe_compile.passes._graph import arg, op_name
from tests.models.composed import ComposedMoE, Forms, all_forms
from tests.passes._harness import assert_matches_eager, fresh_cache, run_once

FORMS = list(all_forms())
DISPATCH_PASSES = ("fuse_dispatch", "strip_host_padding")
_ACCUMULATING = {"index_add_", "index_add", "scatter_add_", "scatter_add"}
_HOST_READS = {"item", "tolist", "_local_scalar_dense"}


def _left_behind(gm: torch.fx.GraphModule) -> list[str]:
    """Accumulating scatters and host reads in a Dynamo graph after our pre-grad passes."""
    found = []
    for n in gm.graph.nodes:
        name = op_name(n)
        if name in _ACCUMULATING or name in _HOST_READS:
            found.append(f"{n.name} ({name})")
        elif name in ("index_put_", "index_put") and arg(n, 3, "accumulate", False):
            found.append(f"{n.name} (index_put accumulate)")
    return found


def _compile_forms(model: torch.nn.Module, x: torch.Tensor, train: bool = True
                   ) -> tuple[Any, list[str], report.Report, list[str]]:
    """Compile with moe_compile's pre-grad passes then AOTAutograd (eager kernels), ``fullgraph=True``;
    returns (out, grads), what is left in the graph, the report and the ops in the rewritten graph."""
    from torch._dynamo.backends.debugging import aot_eager

    left: list[str] = []
    ops: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        StagePass("pre_grad", MoECompileConfig())(gm.graph)
        gm.recompile()
        left.extend(_left_behind(gm))
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    with fresh_cache(), report.collecting() as rep:
        result = run_once(torch.compile(model, backend=backend, fullgraph=True), (x,), train=train)
    torch._dynamo.reset()
    return result, left, rep, ops


def check_forms(forms: Forms, seed: int = 0, tokens: int = 10, train: bool = True) -> None:
    torch.manual_seed(seed)
    model = ComposedMoE(forms, seed=seed)
    x = torch.randn(tokens, 16, dtype=torch.bfloat16, requires_grad=train)
    eager = run_once(model, (x,), train=train)
    (out, grads), left, rep, ops = _compile_forms(model, x, train)
    rewrites = collections.Counter(r.pass_name for r in rep.rewrites if r.pass_name in DISPATCH_PASSES)
    skips = [(r.pass_name, r.what, r.detail) for r in rep.skips if r.pass_name in DISPATCH_PASSES
             and r.what != "already_aligned"]
    expected_pass = "strip_host_padding" if forms.host else "fuse_dispatch"
    assert not rep.errors, f"{forms}: pass errors {rep.errors}"
    assert dict(rewrites) == {expected_pass: 1}, f"{forms}: rewrites {dict(rewrites)}, skips {skips}\n{rep.table()}"
    assert left == [], f"{forms}: left in the graph: {left}"
    assert sum("moe.permute_pad" in o for o in ops) == 1 and sum("moe.unpad_unpermute" in o for o in ops) == 1
    from tests.passes._harness import Run

    assert_matches_eager(Run(out, grads, rep, []), model, (x,), train=train, eager=eager, tol_dtype=torch.bfloat16)


def stratified_forms() -> list[Forms]:
    """A fixed subset of :data:`FORMS` in which every value of every axis occurs at least once: greedily, the
    combination that covers the most values not covered yet (ties: the first in :data:`FORMS`' order)."""
    missing = {(axis, getattr(f, axis)) for f in FORMS for axis in Forms.__dataclass_fields__}
    chosen: list[Forms] = []
    while missing:
        best = max(FORMS, key=lambda f: len({(a, getattr(f, a)) for a in Forms.__dataclass_fields__} & missing))
        chosen.append(best)
        missing -= {(a, getattr(best, a)) for a in Forms.__dataclass_fields__}
    return chosen


# every form of the subset at two shapes (tokens 10 and 37: one not a multiple of the alignment), once in training
# and once in eval, alternating so that each (shape, mode) pair occurs
STRATIFIED = [pytest.param(f, tokens, train, id=f"{f}-T{tokens}-{'train' if train else 'eval'}")
              for i, f in enumerate(stratified_forms())
              for tokens, train in (((10, True), (37, False)) if i % 2 == 0 else ((10, False), (37, True)))]


def test_stratified_subset_covers_every_axis_value():
    covered = {(a, getattr(p.values[0], a)) for p in STRATIFIED for a in Forms.__dataclass_fields__}
    assert covered == {(a, getattr(f, a)) for f in FORMS for a in Forms.__dataclass_fields__}
    assert {(p.values[1], p.values[2]) for p in STRATIFIED} == {(10, True), (10, False), (37, True), (37, False)}


@pytest.mark.parametrize("forms,tokens,train", STRATIFIED)
def test_stratified_dispatch_forms_rewrite(forms, tokens, train):
    check_forms(forms, seed=sum(map(ord, str(forms))) + tokens, tokens=tokens, train=train)


@settings(max_examples=24, deadline=None, derandomize=False, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(forms=st.sampled_from(FORMS), seed=st.integers(0, 2**16))
def test_sampled_dispatch_forms_rewrite(forms, seed):
    check_forms(forms, seed)


@pytest.mark.slow
@pytest.mark.parametrize("forms", FORMS, ids=str)
def test_every_dispatch_form_rewrites(forms):
    check_forms(forms)


@pytest.mark.parametrize("forms", [Forms("sort", "histc", "device", "none", "index_copy_sum", "rows_fp32"),
                                   Forms("argsort_stable", "eq_arange_sum", "host", "host_pad", "index_copy_sum",
                                         "after_unpermute")], ids=str)
def test_index_copy_unpermute_rewrites(forms):
    """Megatron's un-permute ``zeros_like(ys).index_copy_(0, perm, ys)`` summed over the top-k slots (issue 36: the
    layer was left alone, its backward's accumulating ``index_put`` kept, capture refused on the GPU)."""
    check_forms(forms, seed=int(torch.randint(0, 2**16, ())))
