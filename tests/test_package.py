"""Package surface: backend registration, options, the pass registry and its fallback, README/CI agreement."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import warnings

import pytest
import torch
import torch.fx as fx

import moe_compile
from moe_compile import passes as passes_mod
from moe_compile.config import make_config, split_options

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_backend_is_registered_by_entry_point_without_import():
    code = (
        "import torch\n"
        "from torch._dynamo.backends.registry import list_backends\n"
        "assert 'moe_compile' in list_backends(), list_backends()\n"
        "f = torch.compile(lambda x: x.cos() * 2, backend='moe_compile')\n"
        "x = torch.randn(5)\n"
        "torch.testing.assert_close(f(x), x.cos() * 2)\n"
        "import sys; assert 'moe_compile' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


def test_backend_after_import_honours_mode_and_options():
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    x = torch.randn(3, 8)
    expected = model(x)
    for kwargs in ({}, {"mode": "max-autotune-no-cudagraphs"}, {"options": {"moe.strict": True, "max_autotune": False}}):
        torch._dynamo.reset()
        got = torch.compile(model, backend="moe_compile", **kwargs)(x)
        torch.testing.assert_close(got, expected)


def test_unknown_option_names_the_key():
    with pytest.raises(ValueError, match="bogus"):
        split_options({"moe.bogus": 1})
    with pytest.raises(ValueError, match="no_such_pass"):
        make_config(passes={"no_such_pass": True})
    with pytest.raises(TypeError, match="metrics"):
        make_config(metrics="yes")
    config, inductor = split_options({"moe.debug": True, "max_autotune": True})
    assert config.debug and inductor == {"max_autotune": True}


def test_pass_that_raises_falls_back_with_warning(monkeypatch):
    calls = []

    def exploding_pass(graph: fx.Graph, ctx: passes_mod.PassContext) -> None:
        calls.append(ctx.stage)
        # mutate first, then fail: the stage must restore the graph it was given
        for node in list(graph.nodes):
            if node.target is torch.sin:
                node.target = torch.cos
        raise RuntimeError("boom")

    import moe_compile.passes

    module = type(sys)("moe_compile_test_exploding")
    module.run = exploding_pass
    monkeypatch.setitem(sys.modules, module.__name__, module)
    entry = passes_mod.PassEntry("exploding", "pre_grad", f"{module.__name__}:run")
    monkeypatch.setattr(moe_compile.passes, "PASSES", (*passes_mod.PASSES, entry))

    def f(x):
        return torch.sin(x) * 3 + x.exp()

    x = torch.randn(16)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch._inductor.config.patch(force_disable_caches=True), moe_compile.report.collecting() as report:
            got = torch.compile(f, backend="moe_compile")(x)
    assert calls == ["pre_grad"]
    torch.testing.assert_close(got, f(x))
    assert any("exploding" in str(w.message) and "boom" in str(w.message) for w in caught)
    assert [r.kind for r in report.records if r.pass_name == "exploding"] == ["error"]

    torch._dynamo.reset()
    with pytest.raises(Exception, match="boom"):
        with torch._inductor.config.patch(force_disable_caches=True):
            torch.compile(f, backend="moe_compile", options={"moe.strict": True})(x)


def test_stage_uuid_depends_on_config():
    a = passes_mod.StagePass("joint", make_config())
    b = passes_mod.StagePass("joint", make_config(debug=True))
    assert a.uuid() != b.uuid()
    assert a.uuid() == passes_mod.StagePass("joint", make_config()).uuid()


def test_registry_entries_are_importable_and_documented():
    names = [e.name for e in passes_mod.PASSES]
    assert len(names) == len(set(names))
    for entry in passes_mod.PASSES:
        fn = entry.load()
        assert callable(fn)
        module_name = entry.target.split(":")[0]  # a pass package's docstring is its __init__'s
        doc = sys.modules[module_name].__doc__ or ""
        for heading in ("Matches", "Rewrites to", "Stage"):
            assert re.search(rf"^{heading}\b.*:", doc, re.M), f"{module_name} docstring lacks a {heading!r} heading"


def test_public_api():
    for name in moe_compile.__all__:
        assert getattr(moe_compile, name) is not None


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    marker = "python3 -m pip install -e \".[test,hf]\" && python3 -m pytest -q -ra tests"
    assert marker in readme
    ci_line = next(line for line in ci.splitlines() if "pytest" in line and not line.startswith("#"))
    assert ci_line.replace("--quiet ", "") in readme


def test_import_and_compile_without_torchao():
    """torchao is imported only where quantised weights are used (``quantize_experts``): importing the package
    prints nothing, and neither it nor compiling an MoE layer with the backend imports torchao (whose import
    logs CUDA-extension and pytree warnings on CPU machines)."""
    proc = subprocess.run([sys.executable, "-c", "import sys, moe_compile; assert 'torchao' not in sys.modules"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == "", proc.stdout + proc.stderr
    code = (
        "import sys, torch, moe_compile\n"
        "from tests.models.handwritten import SortIndexSelectScatterAdd\n"
        "layer = SortIndexSelectScatterAdd(hidden=16, inter=8, experts=4)\n"
        "rep = moe_compile.explain(layer, torch.randn(6, 16, dtype=torch.bfloat16))\n"
        "assert rep.count('fuse_dispatch') >= 1, rep.table()\n"
        "assert 'torchao' not in sys.modules, 'torchao imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "torchao" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
