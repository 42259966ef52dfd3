"""The differential fuzzer: generated MoE layers compiled by moe_compile are no further from a wider reference than
eager is, forward and backward, and keep eager's exact zeros (or moe_compile leaves them alone, which the same check
covers). Hypothesis draws layers from ``tests/fuzz/grammar.py``; a failure prints its summary and a standalone
script that reproduces it (``tests/fuzz/harness.py`` says how each layer is run and judged).

Default run: ``MOE_FUZZ_EXAMPLES`` (12) layers through moe_compile's passes with eager kernels, and
``MOE_FUZZ_INDUCTOR_EXAMPLES`` (2) through the real backend against plain Inductor. ``-m slow``:
``MOE_FUZZ_SLOW_EXAMPLES`` (2000) and ``MOE_FUZZ_SLOW_INDUCTOR_EXAMPLES`` (100). ``python -m tests.fuzz.run`` runs
the same check without stopping at a failure, writing every finding to JSON.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests._subprocess import REPO_ROOT, run_python
from tests.fuzz.emit import DTYPES, build, load, script, source
from tests.fuzz.grammar import DISPATCHES, Spec, corpus, draw, random_choose
from tests.fuzz.harness import check, check_module


def _examples(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _spec(data: st.DataObject) -> Spec:
    return draw(lambda name, options: data.draw(st.sampled_from(list(options)), label=name))


def _fuzz(data: st.DataObject, backend: str) -> None:
    spec = _spec(data)
    result = check(spec, backend)
    assert result.kind != "generator_error", result.failure_message()
    assert result.passed, result.failure_message()


_SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large]}


@settings(max_examples=_examples("MOE_FUZZ_EXAMPLES", 12), **_SETTINGS)
@given(data=st.data())
def test_fuzz_passes(data):
    _fuzz(data, "passes")


@settings(max_examples=_examples("MOE_FUZZ_INDUCTOR_EXAMPLES", 2), **_SETTINGS)
@given(data=st.data())
def test_fuzz_inductor(data):
    _fuzz(data, "inductor")


@pytest.mark.slow
@settings(max_examples=_examples("MOE_FUZZ_SLOW_EXAMPLES", 2000), **_SETTINGS)
@given(data=st.data())
def test_fuzz_passes_slow(data):
    _fuzz(data, "passes")


@pytest.mark.slow
@settings(max_examples=_examples("MOE_FUZZ_SLOW_INDUCTOR_EXAMPLES", 100), **_SETTINGS)
@given(data=st.data())
def test_fuzz_inductor_slow(data):
    _fuzz(data, "inductor")


# ---- the generator itself ----------------------------------------------------------------------------------


def test_generated_layers_run_eagerly_in_every_dtype():
    """Every drawn layer runs forward and backward in its dtype and in the reference dtype (a generator bug shows
    here, not as a moe_compile finding); the draws cover every dispatch."""
    rng = random.Random(random.SystemRandom().randrange(2**32))
    specs = [draw(random_choose(rng)) for _ in range(60)]
    for spec in specs:
        dtype = DTYPES[spec.dtype]
        for d in (dtype, torch.float64 if dtype == torch.float32 else torch.float32):
            layer = build(spec, d)
            x = torch.randn(spec.tokens, spec.hidden, dtype=d, requires_grad=True)
            out = layer(x)
            (out[0] if isinstance(out, tuple) else out).float().sum().backward()
            assert x.grad is not None and torch.isfinite(x.grad).all(), spec
    assert {s.dispatch for s in corpus(200)} == set(DISPATCHES)


def test_printed_script_reproduces_the_check():
    """A failure's script is the layer's source plus a call of the same check: exec'd, it gives the same verdict
    on the same tensors as :func:`check` (here on a layer the passes rewrite)."""
    spec = Spec(seed=random.SystemRandom().randrange(2**16))
    text = script(spec)
    assert text.startswith(source(spec)) and "check_module" in text
    direct = check(spec)
    again = check_module(load(text, "fuzz_script"), spec)
    assert direct.kind == again.kind == "ok" and "fuse_dispatch" in direct.rewrites
    assert [(r.name, r.compiled) for r in direct.rows] == [(r.name, r.compiled) for r in again.rows]


def test_never_worse_table_on_corpus_layers(capsys):
    """The never-worse script's rows: every tensor's error next to eager's and the compile without our passes, the
    worst one named, the ratio the bound's (here two corpus layers with moe_compile's eager-kernel pipeline)."""
    from tests.fuzz import never_worse

    rows = never_worse.main(["--no-families", "--corpus", "2", "--backend", "passes"])
    printed = capsys.readouterr().out
    assert len(rows) == 2 and all(r["layer"] in printed for r in rows)
    for row in rows:
        if row["status"] != "ok":
            continue
        worst = max(row["tensors"], key=lambda t: t["moe_ratio"])
        assert row["worst"] == worst["name"] and row["moe_err"] == worst["moe_err"]
        assert row["verdict"] == ("ok" if row["judged_worst"][1] <= 1 else "WORSE")


_FINDINGS = sorted((Path(__file__).parent / "findings").rglob("*.py"))
# the finding scripts that run in about 10 s on 2 cores: in the default suite (the others with -m slow)
FAST_FINDINGS = frozenset({"fuse_dispatch_validation_refused_bf16_eval_grad",
                           "grouped_mm_fallback_fp16_nonfinite_pattern", "inductor_zero_residue"})


def _finding_param(p: Path) -> object:
    marks = [] if p.stem in FAST_FINDINGS else [pytest.mark.slow]
    if p.parent.name == "open":
        marks.append(pytest.mark.xfail(strict=True, reason="an open finding (FINDINGS.md)"))
    return pytest.param(p, marks=marks, id=p.stem)


@pytest.mark.parametrize("script_path", [_finding_param(p) for p in _FINDINGS])
def test_finding_scripts(script_path: Path):
    """Every finding's standalone script (FINDINGS.md) still passes, or fails only with a class of ``known.py``
    (the script prints ``(known: <tag>)``): a fixed finding that comes back fails here. Scripts under ``open/`` are
    findings not fixed yet: they must fail (strict xfail), so a fix shows as a pass to move out of ``open/``."""
    done = run_python(f"import runpy; runpy.run_path({str(script_path)!r}, run_name='__main__')", timeout=600)
    known = "(known: " in done.stdout
    assert done.returncode == 0 or (done.returncode == 1 and known), done.stdout[-3000:] + done.stderr[-3000:]


def test_long_run_records_an_abort_and_goes_on(tmp_path):
    """``python -m tests.fuzz.run`` checks its layers in a child process: a layer that kills it (here the test hook
    ``MOE_FUZZ_ABORT_AT`` aborts at layer 0; FINDINGS B4 did so in generated code) is recorded as an ``abort``, with
    its script and JSON line, and the next layer still runs."""
    env = dict(os.environ, MOE_FUZZ_ABORT_AT="0", PYTHONPATH=str(REPO_ROOT))
    done = subprocess.run([sys.executable, "-m", "tests.fuzz.run", "-n", "2", "--seed", "3", "--json",
                           str(tmp_path / "fuzz.json"), "--scripts", str(tmp_path / "scripts")],
                          env=env, capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "fuzz.json").read_text().splitlines()]
    assert [(r["index"], r["kind"]) for r in rows] == [(0, "abort"), (1, rows[1]["kind"])], rows
    assert rows[1]["kind"] != "abort" and "SIGABRT" in rows[0]["detail"], rows
    assert [p.name for p in (tmp_path / "scripts").iterdir()] == ["passes-3-0-abort.py"]
    lines = done.stdout.splitlines()
    summary = json.loads("\n".join(lines[max(i for i, line in enumerate(lines) if line == "{"):]))
    assert summary["examples"] == 2 and summary["verdicts"]["abort"] == 1, summary


def test_both_fail_only_when_the_failures_agree():
    """A compile that fails with and without moe_compile is ``both_fail`` only when it fails the same way (the
    backend's name, addresses and numbers aside); a different failure with moe_compile is ours (``crash``)."""
    from tests.fuzz.harness import same_failure

    size = random.randint(2, 10**6)
    moe = f"BackendCompilerFailed: backend='moe_compile' raised: RuntimeError: shape [{size}] at 0x7f{size:x}"
    plain = f"BackendCompilerFailed: backend='inductor' raised: RuntimeError: shape [{size + 1}] at 0x7e{size:x}"
    assert same_failure(moe, plain)
    assert not same_failure(moe, "BackendCompilerFailed: backend='inductor' raised: TypeError: an int is required")
    assert not same_failure("AssertionError: moe_compile pass 'fuse_dispatch' failed", plain)
