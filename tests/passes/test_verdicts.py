"""Validation verdicts kept per graph (moe_compile/passes/_verdicts.py): a recompile of the same graph, in this
process or from a warm cache directory, runs no validation and reaches the same decision; a different graph or
pass version is validated again."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from moe_compile import passes as passes_mod
from moe_compile.config import make_config
from moe_compile.passes import _validate, _verdicts
from tests.passes._harness import assert_matches_eager, compile_and_run
from tests.passes.test_validate import _inject, _sort_dispatch, scale_forward


@pytest.fixture
def verdict_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> dict[str, int]:
    """The verdict cache on, in a fresh directory, with a count of the validations that ran."""
    monkeypatch.setenv("MOE_COMPILE_VERDICT_CACHE", "1")
    monkeypatch.setattr(_verdicts, "_directory", lambda: tmp_path / "verdicts")
    monkeypatch.setattr(_verdicts, "_MEMORY", {})
    counts = {"checks": 0}
    original = _validate.StageValidator.check

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        counts["checks"] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(_validate.StageValidator, "check", counting)
    return counts


def test_a_recompile_of_the_same_graph_is_not_validated_again(verdict_cache):
    torch.manual_seed(11)
    fn, args, kwargs = _sort_dispatch()
    first = compile_and_run(fn, args, kwargs, train=True, config=make_config())
    checks = verdict_cache["checks"]
    assert checks >= 1 and first.report.count("fuse_dispatch") == 1, first.report.table()
    _verdicts.clear_memory()  # a new process: the verdicts on disk only
    again = compile_and_run(fn, args, kwargs, train=True, config=make_config())
    assert verdict_cache["checks"] == checks
    assert again.report.count("fuse_dispatch") == 1 and not again.report.unchecked, again.report.table()
    for run in (first, again):  # explain says what was checked: a kept verdict counts as validated
        assert [r.pass_name for r in run.report.validated] == ["fuse_dispatch"], run.report.table()
        assert "validation: 1 rewrite(s) validated, 0 refused, 0 unchecked" in " ".join(run.report.table().split())
    assert_matches_eager(again, fn, args, kwargs, train=True)


def test_a_refused_rewrite_stays_refused_from_the_cache(verdict_cache, monkeypatch):
    torch.manual_seed(12)
    fn, args, kwargs = _sort_dispatch()
    _inject(monkeypatch, "fuse_dispatch", scale_forward)
    for run_index in range(2):
        monkeypatch.setattr(passes_mod, "_WARNED_VALIDATION", set())
        run = compile_and_run(fn, args, kwargs, train=True, config=make_config())
        refused = [r for r in run.report.skips if r.what == "validation_failed"]
        assert refused and run.report.count("fuse_dispatch") == 0, run.report.table()
        assert run.report.refused == refused and not run.report.validated
        assert_matches_eager(run, fn, args, kwargs, train=True)
        if run_index == 0:
            checks = verdict_cache["checks"]
    assert verdict_cache["checks"] == checks >= 1


def test_the_key_changes_with_the_graph_and_the_pass_version():
    gm = torch.fx.symbolic_trace(lambda x: x * 2)
    other = torch.fx.symbolic_trace(lambda x: x * 3)
    text, other_text = _verdicts.graph_text(gm.graph), _verdicts.graph_text(other.graph)
    base = dict(stage="pre_grad", training=True, pass_name="fuse_dispatch", exact=False, version="v1",
                baseline=text, rewritten=text)
    k = _verdicts.key(**base)
    assert k == _verdicts.key(**base)
    for change in ({"rewritten": other_text}, {"baseline": other_text}, {"version": "v2"}, {"training": False},
                   {"pass_name": "normalize"}, {"stage": "joint"}, {"exact": True}):
        assert _verdicts.key(**{**base, **change}) != k, change


def test_caches_off_means_no_verdict_kept(verdict_cache):
    torch.manual_seed(13)
    fn, args, kwargs = _sort_dispatch()
    with torch._inductor.config.patch(force_disable_caches=True):
        compile_and_run(fn, args, kwargs, train=True, config=make_config())
        checks = verdict_cache["checks"]
        compile_and_run(fn, args, kwargs, train=True, config=make_config())
    assert verdict_cache["checks"] == 2 * checks >= 2
