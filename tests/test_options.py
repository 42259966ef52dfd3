"""Options are checked where they are given, before anything compiles, and the error names the argument and the
closest known name (moe_compile/options.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import moe_compile
from moe_compile import backend, config
from moe_compile.options import OptionError, OptionTypeError, inductor_config_names

# moe_compile options that are no Inductor config: options={name: ...} without "moe." is a mistake
NOT_INDUCTOR = [name for name in config.OPTIONS if name not in inductor_config_names()]
VALUES = {"passes": {}, "ep_capacity_factor": 1.5}


def _scale(x: torch.Tensor) -> torch.Tensor:
    return x.sin() * 2


@pytest.fixture
def no_compile(monkeypatch):
    """Fail the test if the backend starts compiling (the check must come first)."""
    calls = []
    monkeypatch.setattr(backend, "compile_with_config", lambda *a, **k: calls.append(a) or (lambda *x: x))
    torch._dynamo.reset()
    yield calls
    torch._dynamo.reset()


def _one_edit(name: str, data) -> str:
    """``name`` with one character dropped, doubled or replaced (after the first two)."""
    i = data.draw(st.integers(2, len(name) - 1))
    edit = data.draw(st.sampled_from(["drop", "double", "replace"]))
    if edit == "drop":
        return name[:i] + name[i + 1:]
    if edit == "double":
        return name[:i] + name[i] + name[i:]
    c = data.draw(st.sampled_from([ch for ch in "xqzj" if ch != name[i]]))
    return name[:i] + c + name[i + 1:]


@pytest.mark.parametrize("name", NOT_INDUCTOR)
def test_backend_option_without_prefix_raises_at_first_call_before_compiling(name, no_compile):
    """``options={"metrics": True}``: a moe_compile option name that is no Inductor config raises at the first call
    (torch keeps ``options`` for the backend until then), before the backend compiles anything, as itself (not
    wrapped in BackendCompilerFailed), naming the key and the spelling that works."""
    compiled = torch.compile(_scale, backend="moe_compile", options={name: VALUES.get(name, True)})
    with pytest.raises(OptionError) as caught:
        compiled(torch.randn(5))
    assert isinstance(caught.value, ValueError)
    assert not isinstance(caught.value, torch._dynamo.exc.BackendCompilerFailed)
    message = str(caught.value)
    assert f"{name!r}" in message and f"did you mean 'moe.{name}'" in message, message
    assert "TORCHDYNAMO_VERBOSE" not in message and "reporting a bug" not in message, message  # no torch footer
    assert no_compile == []


@given(data=st.data())
def test_backend_misspelled_moe_option_suggests_the_name(data):
    """A ``"moe."`` key one edit away from an option: "did you mean" names it; nothing compiled."""
    name = data.draw(st.sampled_from(config.OPTIONS))
    typo = _one_edit(f"moe.{name}", data)
    if typo[len("moe."):] in config.OPTIONS:
        return
    calls = []
    original = backend.compile_with_config
    backend.compile_with_config = lambda *a, **k: calls.append(a)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(_scale, backend="moe_compile", options={typo: True})
        with pytest.raises(OptionError, match=f"did you mean[^?]*'moe.{name}'"):
            compiled(torch.randn(int(data.draw(st.integers(1, 9)))))
    finally:
        backend.compile_with_config = original
        torch._dynamo.reset()
    assert calls == []


def test_backend_checks_inductor_keys_values_and_pass_names(no_compile):
    cases = [  # (options, error, message)
        ({"max_autotun": True}, OptionError, "did you mean 'max_autotune'"),
        ({"moe.passes": {"fuse_dispach": False}}, OptionError, "'fuse_dispach' in passes=; did you mean 'fuse_disp"),
        ({"moe.metrics": "yes"}, OptionTypeError, "metrics must be a bool"),
    ]
    for options, error, pattern in cases:
        torch._dynamo.reset()
        with pytest.raises(error, match=pattern) as caught:
            torch.compile(_scale, backend="moe_compile", options=options)(torch.randn(3))
        assert "TORCHDYNAMO_VERBOSE" not in str(caught.value), str(caught.value)
    with pytest.raises(OptionError, match="did you mean 'max-autotune'"):
        torch.compile(_scale, backend="moe_compile", mode="max_autotune")(torch.randn(3))
    assert no_compile == []


def test_valid_options_still_compile():
    """Inductor keys (``debug`` is Inductor's), ``"moe."`` keys and a mode pass the check and compile."""
    torch._dynamo.reset()
    x = torch.randn(7)
    options = {"debug": False, "moe.validate": False, "moe.passes": {"fuse_dispatch": True}}
    torch.testing.assert_close(torch.compile(_scale, backend="moe_compile", options=options)(x), _scale(x))
    torch._dynamo.reset()


@given(data=st.data())
def test_compile_keyword_typo_names_it_and_suggests(data):
    """``moe_compile.compile(model, metric=True)``: a TypeError that names the keyword, suggests the option and lists
    the keywords; raised before the model is touched (no swap, no compile)."""
    name = data.draw(st.sampled_from(config.OPTIONS + ("capture_host_syncs", "swap_expert_loops", "fullgraph")))
    typo = _one_edit(name, data)
    if typo in config.OPTIONS or typo in ("mode", "name", "options", "dynamic", "disable"):
        return
    model = torch.nn.Linear(4, 4)
    with pytest.raises(TypeError) as caught:
        moe_compile.compile(model, **{typo: True})
    message = str(caught.value)
    assert f"unknown keyword {typo!r}" in message and f"'{name}'" in message.split("?")[0], message
    assert all(o in message for o in config.OPTIONS), message
    assert not hasattr(model, "_moe_compile_views")


def test_compile_refuses_bad_options_eagerly():
    with pytest.raises(OptionError, match=r"'moe.metrics'.*keywords of moe_compile.compile \(metrics=...\)"):
        moe_compile.compile(_scale, options={"moe.metrics": True})
    with pytest.raises(OptionError, match=r"'moe.metric' is no moe_compile option; did you mean 'metrics'\?"):
        moe_compile.compile(_scale, options={"moe.metric": True})  # not "pass them as keywords (metric=...)"
    with pytest.raises(OptionError, match=r"did you mean moe_compile.compile\(model, metrics=...\)"):
        moe_compile.compile(_scale, options={"metrics": True})
    with pytest.raises(OptionError, match="'fuse_dispach' in passes=; did you mean 'fuse_dispatch'"):
        moe_compile.compile(_scale, passes={"fuse_dispach": False})


def test_explain_names_compile_options():
    with pytest.raises(TypeError, match=r"explain\(\): 'deterministic' is a compile option.*compile_options="):
        moe_compile.explain(_scale, torch.randn(3), deterministic=True)  # not an input of _scale
    with pytest.raises(TypeError, match=r"explain\(\): 'mode' is a compile option"):
        moe_compile.explain(torch.nn.Linear(3, 3), torch.randn(3), mode="reduce-overhead")
    with pytest.raises(TypeError, match=r"explain\(compile_options=...\): unknown keyword 'metric'.*'metrics'"):
        moe_compile.explain(_scale, torch.randn(3), compile_options={"metric": True})
    with pytest.raises(TypeError, match=r"explain\(compile_options=...\): metrics must be a bool"):
        moe_compile.explain(_scale, torch.randn(3), compile_options={"metrics": "yes"})
    with pytest.raises(OptionError, match=r"explain\(compile_options=...\).*did you mean 'max_autotune'"):
        moe_compile.explain(_scale, torch.randn(3), compile_options={"options": {"max_autotun": True}})
