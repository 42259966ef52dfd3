"""moe_compile under torch's logging (moe_compile/logs.py): ``TORCH_LOGS="moe_compile"`` / ``"+moe_compile"``, the
``moe_graphs`` artifact and tlparse's trace, the one-line summary per compiled graph, one user-visible message per
failing pass, and an ``import moe_compile`` that prints nothing."""

from __future__ import annotations

import logging
import re
import warnings

import pytest
import torch
from torch import nn

import moe_compile
from moe_compile import backend
from tests._subprocess import run_python
from tests.models import handwritten as hw
from tests.passes._harness import fresh_cache

# compiles a sort-based layer (fuse_dispatch rewrites it) on a fresh token count, prints how many layers it rewrote
SCRIPT = """
    import torch, moe_compile
    from tests.models.handwritten import SortIndexSelectScatterAdd

    layer = SortIndexSelectScatterAdd(hidden=16, inter=8, experts=4)
    x = torch.randn(int(torch.randint(4, 12, ())), 16, dtype=torch.bfloat16)
    with moe_compile.report.collecting() as rep, torch.no_grad():
        torch.compile(layer, backend="moe_compile")(x)
    print("REWRITES", rep.count("fuse_dispatch"))
"""
# every pass runs (no cache hit); validation is not what these tests look at
NO_CACHE = {"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1", "MOE_COMPILE_VALIDATE_ALL": "0"}
SUMMARY = re.compile(r"compiled a graph of (\d+) nodes: (.*); ([0-9.]+) s in the passes")


def _dump(stderr: str, name: str) -> str:
    """The code lines of the ``moe_graphs`` dump ``name`` (each log line carries the artifact's tag; the source
    comments are left out)."""
    lines = stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.endswith(f"{name}:"))
    out = []
    for line in lines[start + 1:]:
        if "[__moe_graphs]" not in line or line.endswith(":") and "moe_compile_" in line:
            break
        if "# File:" not in line:
            out.append(line)
    return "\n".join(out)


def test_torch_logs_moe_compile_gives_the_summary_not_the_graphs():
    proc = run_python(SCRIPT, {"TORCH_LOGS": "moe_compile", **NO_CACHE})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "REWRITES 1" in proc.stdout
    summaries = SUMMARY.findall(proc.stderr)
    assert len(summaries) == 1, proc.stderr[-3000:]
    nodes, what, seconds = summaries[0]
    assert what.startswith("fuse_dispatch 1 layer") and int(nodes) > 10 and float(seconds) > 0, summaries
    assert "[fuse_dispatch]" in proc.stderr  # the rewrite's own INFO line
    assert "moe_compile_pre_grad_before" not in proc.stderr  # graphs are DEBUG / the artifact


def test_moe_graphs_artifact_and_trace_show_the_graph_before_and_after(tmp_path):
    """``TORCH_LOGS="moe_compile,moe_graphs"`` dumps each stage's graph before and after the passes: the pre-grad
    graph has the sort before and the fused dispatch op after; ``TORCH_TRACE`` gets the same artifacts for tlparse."""
    proc = run_python(SCRIPT, {"TORCH_LOGS": "moe_compile,moe_graphs", "TORCH_TRACE": str(tmp_path), **NO_CACHE})
    assert proc.returncode == 0, proc.stderr[-3000:]
    before, after = _dump(proc.stderr, "moe_compile_pre_grad_before"), _dump(proc.stderr, "moe_compile_pre_grad_after")
    assert "torch.sort" in before and "moe.permute_pad" not in before, before
    assert "moe.permute_pad" in after and "torch.sort" not in after, after
    trace = "".join(p.read_text() for p in tmp_path.iterdir())
    for stage in ("pre_grad", "joint", "post_grad"):
        for when in ("before", "after"):
            assert f'"name": "moe_compile_{stage}_{when}"' in trace, (stage, when)


def test_plus_moe_compile_is_debug_with_graphs():
    proc = run_python(SCRIPT, {"TORCH_LOGS": "+moe_compile", **NO_CACHE})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "compiling a graph of" in proc.stderr and "moe_compile_joint_after" in proc.stderr
    assert len(SUMMARY.findall(proc.stderr)) == 1


def test_compile_without_torch_logs_is_silent(tmp_path):
    proc = run_python(SCRIPT, {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "MOE_COMPILE_VALIDATE_ALL": "0"})
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]


def test_summary_counts_the_layers_each_pass_rewrote(caplog):
    """A stack of ``n`` sort-based layers (fresh ``n``): the graph's INFO line says fuse_dispatch rewrote ``n`` layers,
    as the report's records do."""
    n = int(torch.randint(1, 4, ()))
    model = nn.Sequential(*(hw.SortIndexSelectScatterAdd(hidden=16, inter=8, experts=4, seed=i) for i in range(n)))
    x = torch.randn(int(torch.randint(4, 12, ())), 16, dtype=torch.bfloat16)
    torch._dynamo.reset()
    with caplog.at_level(logging.INFO, logger="moe_compile"), fresh_cache(), torch.no_grad(), \
            moe_compile.report.collecting() as rep:
        torch.compile(model, backend="moe_compile")(x)
    torch._dynamo.reset()
    lines = [r.getMessage() for r in caplog.records if r.name == "moe_compile.backend" and "compiled a graph" in
             r.getMessage()]
    assert len(lines) == 1, lines
    assert len({r.layer for r in rep.rewrites if r.pass_name == "fuse_dispatch"}) == n, rep.table()
    assert f"fuse_dispatch {n} layer{'s' if n > 1 else ''}" in lines[0], lines


def test_failed_compile_after_a_rewrite_warns_once_and_logs_at_debug(caplog):
    """NOTE [fallback after a failed compile] (moe_compile/backend.py): one warning per pass turned off; the log
    has it at DEBUG only (Python's last-resort handler would print a WARNING record a second time)."""
    with caplog.at_level(logging.DEBUG, logger="moe_compile"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend._record_fallback(["fuse_dispatch"], {"fuse_dispatch": ["layers.0.mlp"]}, RuntimeError("no lowering"))
    assert [str(w.message) for w in caught if "fuse_dispatch" in str(w.message)] != []
    assert len(caught) == 1, [str(w.message) for w in caught]
    loud = [r for r in caplog.records if r.name.startswith("moe_compile") and r.levelno >= logging.WARNING]
    assert loud == [] and any("fuse_dispatch" in r.getMessage() for r in caplog.records)


def test_failing_pass_prints_one_message():
    """A pass that raises, in a fresh process with Python's default warning and logging setup: its failure shows on
    stderr once, and the output is still eager's (to bf16 rounding: the compile is plain Inductor's)."""
    proc = run_python("""
        import torch, moe_compile
        from moe_compile.passes import fuse_dispatch
        from tests.models.handwritten import SortIndexSelectScatterAdd

        def broken(graph, ctx):
            raise RuntimeError("planted failure")

        fuse_dispatch.run = broken
        layer = SortIndexSelectScatterAdd(hidden=16, inter=8, experts=4)
        x = torch.randn(int(torch.randint(4, 12, ())), 16, dtype=torch.bfloat16)
        with torch.no_grad():
            got = torch.compile(layer, backend="moe_compile")(x)  # plain Inductor for the layer: bf16 roundings apart
            torch.testing.assert_close(got, layer(x), rtol=2**-5, atol=2**-5)
    """, NO_CACHE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("planted failure") == 1, proc.stderr[-3000:]


@pytest.mark.parametrize("first", ["", "import transformers; "], ids=["alone", "after_transformers"])
def test_import_prints_nothing_and_skips_torchao(first):
    """``import moe_compile`` (after transformers too, which registers our expert-parallel implementation) prints
    nothing and imports no torchao (whose import prints CUDA-extension and pytree warnings on CPU machines)."""
    pytest.importorskip("transformers") if first else None
    proc = run_python(f"""
        import sys
        {first}import moe_compile
        assert "torchao" not in sys.modules, "torchao imported"
    """)
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == "", proc.stdout + proc.stderr


def test_torch_logs_naming_moe_compile_imports_it_quietly():
    """torch imports the package named in ``TORCH_LOGS`` while it reads the variable (that registers moe_graphs):
    nothing printed, no torchao, and the artifact is known."""
    proc = run_python("""
        import sys, torch
        from torch._logging import _internal
        assert "moe_compile" in sys.modules and "torchao" not in sys.modules
        assert _internal.log_registry.is_artifact("moe_graphs")
    """, {"TORCH_LOGS": "+moe_compile,moe_graphs"})
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == "", proc.stdout + proc.stderr


def test_swap_logs_what_it_swapped_and_what_it_declined(caplog):
    """``moe_compile.compile``'s module-level swap logs each block at INFO, as the graph passes log theirs: a swapped
    loop, and a declined one with the swap's reason tag and what it found (a sigmoid router its probe does not
    reproduce)."""
    from tests.models.loop_models import SigmoidRoutedLoopMoE, make_loop_moe

    model = nn.ModuleDict({"good": make_loop_moe(hidden=32), "odd": SigmoidRoutedLoopMoE(hidden=32)})
    with caplog.at_level(logging.INFO, logger="moe_compile"):
        records = moe_compile.api.prepare_expert_loops(model)
    declined = next(r for r in records if r.kind == "skip")
    lines = [r.getMessage() for r in caplog.records if r.name == "moe_compile.api"]
    assert any(line.startswith("[swap_expert_loops] good: swapped (expert_loop_swapped)") for line in lines), lines
    assert f"[swap_expert_loops] odd: declined ({declined.what}) {declined.detail}" in lines, lines
    assert declined.what == "probe_mismatch" and declined.detail, declined
