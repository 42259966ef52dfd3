"""``deterministic_attention`` (``deterministic=True``): attention backward nodes whose kernel has a
deterministic mode point at ``moe.deterministic_<op>``, which calls the same aten op with torch's
deterministic flag on for that call only (and restores it, also when the call raises). Off: untouched.
The CUDA numerics (bitwise repeatable training steps) are ``tests/models/test_deterministic_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from moe_compile.config import make_config
from moe_compile.ops import deterministic_flag
from moe_compile.passes import PassContext, StagePass, deterministic_attention

aten = torch.ops.aten


def _ctx(on: bool) -> PassContext:
    return PassContext(make_config(deterministic=on), "joint", "deterministic_attention", True)


def _run_stage(graph: fx.Graph, on: bool) -> None:
    """The joint stage with only this pass on: without ``deterministic=True`` it does not run (its ``requires``)."""
    others = {"deterministic_accumulate": False, "deterministic_scatter": False, "expert_choice": False,
              "routed_accumulate": False}
    stage = StagePass("joint", make_config(deterministic=on, strict=True, passes=others))
    assert [e.name for e in stage.entries] == (["deterministic_attention"] if on else [])
    stage(graph)


def _graph_with(op) -> tuple[fx.Graph, fx.Node]:
    """A graph calling ``op`` on placeholders (its arguments need not make sense: the pass reads targets)."""
    graph = fx.Graph()
    args = [graph.placeholder(f"a{i}") for i in range(4)]
    node = graph.call_function(op, tuple(args))
    graph.output(node)
    return graph, node


@pytest.mark.parametrize("name", deterministic_flag.FLAG_SELECTED)
@pytest.mark.parametrize("on", [True, False])
def test_attention_backward_is_pointed_at_the_flagged_op(name, on):
    aten_op = getattr(aten, name).default
    graph, node = _graph_with(aten_op)
    _run_stage(graph, on)
    if on:
        assert node.target is deterministic_flag.WRAPPED[aten_op]
        ours, theirs = str(node.target._schema), str(aten_op._schema)
        assert ours[ours.index("("):] == theirs[theirs.index("("):]  # same arguments and returns
    else:
        assert node.target is aten_op


def test_other_ops_are_left_alone():
    graph, node = _graph_with(aten._scaled_dot_product_cudnn_attention_backward.default)
    deterministic_attention.run(graph, _ctx(True))
    assert node.target is aten._scaled_dot_product_cudnn_attention_backward.default


def test_flag_is_on_for_the_call_only_and_restored():
    seen = []
    call = deterministic_flag._with_flag(lambda: seen.append(torch.are_deterministic_algorithms_enabled()))
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    call()
    assert seen == [True]
    flags = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    assert flags == before

    def boom():
        raise RuntimeError("kernel failed")

    with pytest.raises(RuntimeError, match="kernel failed"):
        deterministic_flag._with_flag(boom)()
    assert torch.are_deterministic_algorithms_enabled() == before[0]


def test_flagged_op_keeps_the_shapes_of_the_aten_op():
    """Fake tensors (what Inductor traces with) go through the aten op's meta kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = deterministic_flag.WRAPPED[aten._scaled_dot_product_efficient_attention_backward.default]
    B, Hh, S, D = 2, 3, 16, 8
    with FakeTensorMode():
        q, k, v = (torch.empty(B, Hh, S, D, device="meta") for _ in range(3))
        out = torch.empty(B, Hh, S, D, device="meta")
        lse = torch.empty(B, Hh, S, device="meta")
        seed = torch.empty((), dtype=torch.int64, device="meta")
        args = (out, q, k, v, torch.empty(0, device="meta"), out, lse, seed, seed, 0.0, [True, True, True, False])
        try:
            expected = aten._scaled_dot_product_efficient_attention_backward.default(*args, is_causal=True)
        except Exception as exc:  # noqa: BLE001 - a torch without a meta kernel for it raises whatever it raises
            pytest.skip(f"no meta kernel: {exc}")
        got = op(*args, is_causal=True)
    assert [tuple(t.shape) if t is not None else None for t in got] == \
        [tuple(t.shape) if t is not None else None for t in expected]


@pytest.mark.parametrize("on", [True, False])
def test_backend_traces_sdpa_without_cudnn_when_deterministic(monkeypatch, on):
    """cuDNN attention's backward has no deterministic mode: with the option, SDPA cannot pick it."""
    from moe_compile import backend

    seen = {}

    def fake_compile_fx(gm, example_inputs, config_patches):
        seen["cudnn"] = torch.backends.cuda.cudnn_sdp_enabled()
        seen["flash"] = torch.backends.cuda.flash_sdp_enabled()
        return gm

    monkeypatch.setattr(backend, "compile_fx", fake_compile_fx)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    backend.compile_with_config(fx.GraphModule(torch.nn.Module(), fx.Graph()), [], make_config(deterministic=on))
    assert seen == {"cudnn": before and not on, "flash": torch.backends.cuda.flash_sdp_enabled()}
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
