"""Package surface: backend registration, options, the pass registry and its fallback, docs/options.md against the
settings table, README/CI agreement."""

from __future__ import annotations

import ast
import dataclasses
import os
import pathlib
import re
import subprocess
import sys
import warnings

import pytest
import torch
import torch.fx as fx

import moe_compile
from moe_compile import config as config_mod
from moe_compile import passes as passes_mod
from moe_compile.backend import ConfiguredBackend
from moe_compile.config import MoECompileConfig, make_config, split_options
from tests._subprocess import WITHOUT_TORCHAO

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
    for kwargs in (
        {},
        {"mode": "max-autotune-no-cudagraphs"},
        {"options": {"moe.strict": True, "max_autotune": False}},
    ):
        torch._dynamo.reset()
        got = torch.compile(model, backend="moe_compile", **kwargs)(x)
        torch.testing.assert_close(got, expected)


def test_unknown_option_names_the_key():
    with pytest.raises(ValueError, match="bogus"):
        split_options({"moe.bogus": 1})
    with pytest.raises(TypeError, match="metrics"):
        make_config(metrics="yes")
    config, inductor = split_options({"moe.debug": True, "max_autotune": True})
    assert config.debug and inductor == {"max_autotune": True}


def test_passes_values_must_be_bools():
    """A string is not a switch: ``"false"`` used to leave the pass on."""
    with pytest.raises(TypeError, match=r"passes=.*'fuse_dispatch': 'false'"):
        make_config(passes={"fuse_dispatch": "false"})
    with pytest.raises(TypeError, match="passes must be a mapping"):
        make_config(passes=["fuse_dispatch"])
    with pytest.raises(TypeError, match="passes"):
        split_options({"moe.passes": {"fuse_dispatch": 0}})
    assert make_config(passes=None) == make_config() == MoECompileConfig()
    assert make_config(passes={"fuse_dispatch": False}).passes == (("fuse_dispatch", False),)


def test_unknown_pass_names_raise_where_a_config_is_used():
    """``passes`` checks its names: at ``moe_compile.compile``, at the backend's first compile for ``options=``, and
    when a config is bound to a backend; config.py itself knows no passes."""
    with pytest.raises(ValueError, match=r"no_such_pass.*passes="):
        passes_mod.check_pass_names(["fuse_dispatch", "no_such_pass"])
    passes_mod.check_pass_names([e.name for e in passes_mod.PASSES])
    with pytest.raises(ValueError, match=r"no_such_pass.*passes="):
        moe_compile.compile(torch.nn.Linear(2, 2), passes={"no_such_pass": True})
    with pytest.raises(ValueError, match=r"no_such_pass.*passes="):
        ConfiguredBackend(make_config(passes={"no_such_pass": True}))
    torch._dynamo.reset()
    options = {"moe.passes": {"no_such_pass": True}}
    compiled = torch.compile(lambda x: x.sin() * 2, backend="moe_compile", options=options)
    with pytest.raises(Exception, match=r"no_such_pass.*passes="):
        compiled(torch.randn(3))
    torch._dynamo.reset()


def test_settings_table_matches_the_config():
    """MoECompileConfig's fields are the table's compile options, with its defaults; ``requires`` names bool options."""
    fields = {f.name: f.default for f in dataclasses.fields(MoECompileConfig)}
    assert tuple(fields) == config_mod.OPTIONS
    for name in config_mod.OPTIONS:
        setting = config_mod.SETTINGS[name]
        assert setting.kind == "option" and setting.env is None and setting.read == "per compile"
        assert fields[name] == (tuple(setting.default.items()) if setting.type is dict else setting.default), name
    for name in config_mod.ENV_SETTINGS:
        setting = config_mod.SETTINGS[name]
        assert setting.env == f"MOE_COMPILE_{name.upper()}" and setting.type in (bool, str)
    for entry in passes_mod.PASSES:
        for option in entry.requires:
            assert config_mod.SETTINGS[option].kind == "option" and config_mod.SETTINGS[option].type is bool
    for setting in config_mod.SETTINGS.values():
        assert "\n" not in setting.doc and setting.doc, setting.name
        assert setting.env or f"``moe.{setting.name}``" in config_mod.__doc__
        assert not setting.env or f"``{setting.env}``" in config_mod.__doc__


def test_env_setting(monkeypatch):
    """Booleans: ``1`` on, ``0`` off, anything else the default; strings: the value, unset or empty the default."""
    for value, tma, hw_fp4 in (("1", True, True), ("0", False, False), ("yes", True, False), ("", True, False)):
        monkeypatch.setenv("MOE_COMPILE_TMA", value)
        monkeypatch.setenv("MOE_COMPILE_HW_FP4", value)
        assert (config_mod.env_setting("tma"), config_mod.env_setting("hw_fp4")) == (tma, hw_fp4), value
    monkeypatch.delenv("MOE_COMPILE_TMA")
    assert config_mod.env_setting("tma") is True
    monkeypatch.setenv("MOE_COMPILE_GROUPED_GEMM", "triton")
    assert config_mod.env_setting("grouped_gemm") == "triton"
    monkeypatch.setenv("MOE_COMPILE_GROUPED_GEMM", "")
    assert config_mod.env_setting("grouped_gemm") is None
    with pytest.raises(KeyError, match="compile option"):
        config_mod.env_setting("metrics")


def test_environment_is_read_only_through_the_settings_table():
    """No module but config.py reads a ``MOE_COMPILE_*`` variable, and config.py imports nothing of moe_compile."""
    package = ROOT / "moe_compile"
    for path in package.rglob("*.py"):
        if path.name == "config.py" and path.parent == package:
            continue
        text = path.read_text()
        assert not re.search(r"(environ|getenv)\b[^\n]*MOE_COMPILE_", text), path
        assert not re.search(r"[\"']MOE_COMPILE_\w+[\"']", text), path
    tree = ast.parse((package / "config.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in imported if m and m.startswith("moe_compile")}, imported


def test_api_and_backend_import_at_the_top():
    """No function-level imports left in api.py and backend.py (none of them would make a cycle)."""
    for name in ("api.py", "backend.py"):
        tree = ast.parse((ROOT / "moe_compile" / name).read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = [n for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))]
                assert not inner, f"{name}:{fn.name} imports at line {inner[0].lineno}"


def test_every_setting_is_in_the_options_doc():
    """docs/options.md's two tables (compile options, environment variables) have a row per setting: its default, when
    an environment variable is read, and a meaning that begins with the table's doc (``tests/test_docs.py`` checks
    that the tables are exactly what ``tests/docs_tables.py`` generates)."""
    doc = (ROOT / "docs" / "options.md").read_text()
    rows = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) >= 3:
            rows[cells[0].strip("`")] = cells[1:]
    for setting in config_mod.SETTINGS.values():
        key = setting.env or setting.name
        assert key in rows, f"docs/options.md lacks {key}"
        default, *rest = rows[key]
        shown = setting.default_text()
        assert default == (shown if shown == "unset" else f"`{shown}`"), key
        if setting.env:
            assert rest[0] == setting.read, key
        assert rest[-1].replace("`", "").startswith(setting.doc), key


def test_passes_that_need_an_option_are_off_without_it():
    """``requires``: not listed, not run, even when ``passes=`` turns them on; on with the option."""
    needing = {e.name: e.requires for e in passes_mod.PASSES if e.requires}
    assert needing == {"router_metrics": ("metrics",), "causal_mask": ("deterministic",),
                       "pad_attention_value": ("deterministic",), "masked_attention": ("deterministic",),
                       "deterministic_scatter": ("deterministic",),
                       "deterministic_attention": ("deterministic",)}
    off = make_config(passes=dict.fromkeys(needing, True))
    assert not set(needing) & set(passes_mod.enabled_passes(off))
    assert not {e.name for stage in passes_mod.stage_passes(off).values() for e in stage.entries} & set(needing)
    on = make_config(metrics=True, deterministic=True)
    assert set(needing) <= set(passes_mod.enabled_passes(on))
    turned_off = make_config(metrics=True, passes={"router_metrics": False})
    assert "router_metrics" not in passes_mod.enabled_passes(turned_off)


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
    """The README's test command (its Tests section; docs/testing.md repeats it) is the one ``.ci/run`` runs."""
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    marker = "python3 -m pip install -e \".[test,hf]\" -c constraints.txt && python3 -m pytest -q -ra -n 2 tests"
    assert marker in readme
    ci_line = next(line for line in ci.splitlines() if "pytest" in line and not line.startswith("#"))
    assert ci_line.replace("--quiet ", "") in readme
    assert marker in (ROOT / "docs" / "testing.md").read_text()


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)\s*$", line)
        if m:
            pins[m.group(1).lower()] = m.group(2)
    return pins


def test_constraints_pin_the_test_environment():
    """The README's test command installs from ``constraints.txt``: exact versions of the test tools and of
    transformers and torchao, torch as ``.ci/run`` pins it, and a transformers inside the ``hf`` extra's range."""
    from packaging.requirements import Requirement

    pins = _pins()
    for name in ("torch", "transformers", "torchao", "pytest", "pytest-xdist", "hypothesis", "expecttest"):
        assert name in pins, f"constraints.txt does not pin {name}"
    assert f"torch=={pins['torch']}" in (ROOT / ".ci" / "run").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    hf = Requirement(re.search(r'^hf = \["([^"]+)"\]', pyproject, re.M).group(1))
    assert hf.name == "transformers" and pins["transformers"] in hf.specifier, hf


@pytest.mark.skipif(not os.environ.get("CI"), reason="CI installs constraints.txt; a developer's environment may not")
def test_ci_environment_is_the_pinned_one():
    import importlib.metadata as md

    moved = {name: (pin, md.version(name)) for name, pin in _pins().items()
             if not md.version(name).startswith(pin)}  # torch reports 2.13.0+cpu for the pin 2.13.0
    assert not moved, moved


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


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_torchao_is_only_the_quant_extra():
    """torchao is no core dependency: transformers imports it whenever it is installed (its quantizer), and on a CPU
    machine that logs "Failed to load ... _C_mxfp8" and torch's pytree deprecation warnings in every script that
    builds a model. The ``quant`` extra has it, and the ``test`` extra pulls that in (the suite tests quantised
    weights). The README's extras row names every extra."""
    from packaging.requirements import Requirement

    project = _pyproject()["project"]
    assert all(Requirement(r).name != "torchao" for r in project["dependencies"]), project["dependencies"]
    extras = project["optional-dependencies"]
    assert [Requirement(r).name for r in extras["quant"]] == ["torchao"], extras["quant"]
    assert "moe_compile[quant]" in extras["test"], extras["test"]
    row = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| extras"))
    assert all(f"`{name}`" in row for name in extras), (sorted(extras), row)


def test_hf_model_and_moe_compile_are_quiet_without_torchao():
    """What the README's install gives (transformers, no torchao): building a transformers MoE model and importing
    moe_compile print nothing, and ``quantize_experts(model, "bf16")`` works without torchao."""
    pytest.importorskip("transformers")
    code = WITHOUT_TORCHAO + (
        "from transformers import AutoConfig, AutoModelForCausalLM\n"
        "import moe_compile\n"
        "config = AutoConfig.for_model('mixtral', hidden_size=16, intermediate_size=32, num_hidden_layers=1,\n"
        "                              num_attention_heads=2, num_key_value_heads=1, vocab_size=32,\n"
        "                              num_local_experts=4, num_experts_per_tok=2)\n"
        "model = AutoModelForCausalLM.from_config(config)\n"
        "moe_compile.quantize_experts(model, 'bf16')\n"
        "assert sys.modules['torchao'] is None\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == "" and proc.stderr == "", proc.stdout + proc.stderr


def test_examples_do_not_hide_logs_or_warnings():
    """The examples show what a user's script would print: no logger levels raised, no warnings filtered."""
    hiding = re.compile(r"\.setLevel\(|filterwarnings|catch_warnings|simplefilter|logging\.disable")
    found = [f"{p.name}: {m.group(0)}" for p in sorted((ROOT / "examples").glob("*.py"))
             for m in hiding.finditer(p.read_text())]
    assert not found, found
