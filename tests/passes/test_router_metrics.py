"""router_metrics pass: finds every router, inserts ``moe.router_metrics_``, and only with ``metrics=True``.

Detection runs on Dynamo graphs of the router styles in ``tests/models/router_metrics_models.py`` (and
must not fire on a topk that is not a router). Compiled runs (moe_compile's pre-grad passes, then
AOTAutograd) must match eager in outputs and grads and fill the accumulators with the same values as
the eager oracle; one Inductor compile checks the CUDA-graph proxy on the post-grad forward and backward.
"""

from __future__ import annotations

import collections
import warnings
from unittest import mock

import pytest
import torch
import torch.fx as fx
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import moe_compile
from moe_compile import metrics
from moe_compile import passes as passes_mod
from moe_compile.config import MoECompileConfig, make_config
from moe_compile.passes import PassContext, PassEntry, StagePass
from moe_compile.passes import router_metrics as rm_pass
from moe_compile.report import collecting
from tests.models.router_metrics_models import ROUTERS, RoutedStack
from tests.passes._harness import assert_report, fresh_cache

ON = MoECompileConfig(metrics=True)
STATS_KEYS = ("lb_loss", "z_loss", "entropy", "max_over_mean_load", "tokens")


@pytest.fixture(autouse=True)
def _fresh():
    metrics.forget()
    torch._dynamo.reset()
    # torch 2.13 must run pre-grad passes before AOTAutograd lifts buffers: what the backend sets with
    # metrics=True (a no-op here once it does, and on torch 2.11)
    with torch._inductor.config.patch(metrics.inductor_patches(True)):
        yield
    torch._dynamo.reset()
    metrics.forget()


def _dynamo_graph(fn, *args) -> fx.GraphModule:
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    assert len(graphs) == 1
    return graphs[0]


def _x(T=8, H=16, seed=0, requires_grad=False):
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed), requires_grad=requires_grad)


def _oracle(router: str, xs: list[torch.Tensor], layers: int = 2) -> dict[str, float]:
    """The per-layer metrics of running ``xs`` eagerly through a hooked twin of the model."""
    twin = RoutedStack(router=router, layers=layers)
    if router == "matmul":  # no router module to hook: compute from the logits directly
        from moe_compile.ops.router_metrics import router_metrics_

        for x in xs:
            for i, logits in enumerate(twin.router_logits(x)):
                entry = metrics.accumulator(f"oracle.{i}.x", logits.shape[-1], "cpu")
                router_metrics_(entry.acc_S, logits, torch.topk(logits.softmax(-1), 2).indices)
    else:
        metrics.attach(twin)
        for x in xs:
            with torch.no_grad():
                twin(x)
        metrics.detach(twin)
    return metrics.collect(per_layer=True)


# -------------------------------------------------------------------------------------- detection


@pytest.mark.parametrize("router", ROUTERS)
def test_finds_each_router_style(router):
    gm = _dynamo_graph(RoutedStack(router=router), _x())
    routers, skipped = rm_pass.find_routers(gm.graph)
    paths = ["layers.0", "layers.1"] if router == "matmul" else ["layers.0.gate", "layers.1.gate"]
    assert [r.path for r in routers] == paths and not skipped
    assert all(r.num_experts == 4 for r in routers)
    assert all(r.anchored == (router == "permute_pad") for r in routers)
    for r in routers:  # expert_idx is the topk's indices, logits its linear
        assert r.expert_idx.args == (r.topk, 1)
        assert rm_pass._is_linear(r.logits)


def test_anchor_wins_over_expert_limit(monkeypatch):
    """A dispatch op anchors its topk even past MAX_EXPERTS; a bare topk past it is not a router."""
    monkeypatch.setattr(rm_pass, "MAX_EXPERTS", 2)
    anchored, _ = rm_pass.find_routers(_dynamo_graph(RoutedStack(router="permute_pad"), _x()).graph)
    raw, _ = rm_pass.find_routers(_dynamo_graph(RoutedStack(router="softmax"), _x()).graph)
    assert len(anchored) == 2 and raw == []


def test_not_a_router():
    lm_head = torch.nn.Linear(16, 2048, bias=False)
    gate = torch.nn.Linear(16, 4, bias=False)

    def fn(x):
        a = x.topk(2).indices  # hidden states: no router linear
        b = torch.topk(lm_head(x).softmax(-1), 5).indices  # a vocabulary, not experts
        c = torch.topk(gate(x), 2, dim=0).indices  # over tokens
        d = torch.topk(torch.sigmoid(gate(x)), 2).indices  # sigmoid scores: not recognised
        return a, b, c, d

    routers, skipped = rm_pass.find_routers(_dynamo_graph(fn, _x()).graph)
    assert routers == []
    assert [why for _, why, _ in skipped] == ["not_last_dim"]


def test_one_router_per_logits_and_first_topk_wins():
    """transformers' aux loss recomputes softmax + topk from the same logits: counted once."""
    gate = torch.nn.Linear(16, 4, bias=False)

    def fn(x):
        logits = gate(x)
        idx = torch.topk(logits.float().softmax(-1), 2).indices
        aux_idx = torch.topk(torch.nn.functional.softmax(logits.to(torch.float32), dim=-1), 2)[1]
        return idx, aux_idx

    routers, _ = rm_pass.find_routers(_dynamo_graph(fn, _x()).graph)
    assert len(routers) == 1
    order = list(routers[0].topk.graph.nodes)
    topks = [n for n in order if rm_pass._is_topk(n)]
    assert routers[0].topk is topks[0]


# ----------------------------------------------------------------------------- compiled (AOT eager)


def _recording_backend(config: MoECompileConfig):
    stage = StagePass("pre_grad", config)
    graphs: dict[str, list[fx.GraphModule]] = {"fw": [], "bw": []}

    def recorder(kind):
        def compiler(gm, example_inputs):
            graphs[kind].append(gm)
            return make_boxed_func(gm.forward)

        return compiler

    def backend(gm, example_inputs):
        stage(gm.graph)
        gm.recompile()
        return aot_autograd(fw_compiler=recorder("fw"), bw_compiler=recorder("bw"),
                            keep_inference_input_mutations=True)(gm, example_inputs)  # as Inductor does

    return backend, graphs


def _train_steps(model, xs, backend, dynamic=None):
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=dynamic)
    outs, grads = [], []
    for x in xs:
        model.zero_grad()
        y = compiled(x)
        y.square().mean().backward()
        outs.append(y.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
    return outs, grads


@pytest.mark.parametrize("router", ["softmax", "granite", "matmul", "permute_pad"])
def test_compiled_training_matches_eager_and_oracle(router):
    xs = [_x(T, seed=s) for s, T in enumerate((6, 6, 6))]
    ref_outs, ref_grads = _train_steps(RoutedStack(router=router), xs, "eager")
    expected = _oracle(router, xs)
    backend, graphs = _recording_backend(ON)
    with collecting() as rep:
        outs, grads = _train_steps(RoutedStack(router=router), xs, backend)
    assert_report(rep, {"router_metrics": 2}, {"router_metrics": []})
    for a, b in zip(outs, ref_outs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for ga, gb in zip(grads, ref_grads):
        for a, b in zip(ga, gb):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    got = metrics.collect(per_layer=True)
    assert got["moe/steps"] == 3 and got["moe/layers"] == 2
    oracle_layers = sorted({k.split("/")[1] for k in expected if k.startswith("moe/layer_")})
    for layer, oracle_layer in zip(("layer_0", "layer_1"), oracle_layers):
        for key in STATS_KEYS:
            assert got[f"moe/{layer}/{key}"] == pytest.approx(expected[f"moe/{oracle_layer}/{key}"], rel=1e-5)
        for e in range(4):
            key = f"tokens_per_expert/{e}"
            assert got[f"moe/{layer}/{key}"] == expected[f"moe/{oracle_layer}/{key}"]
    # the metrics live in the forward graph only, as an in-place update of a lifted buffer
    (fw,) = graphs["fw"]
    (bw,) = graphs["bw"]
    assert _count(fw)["aten.copy_.default"] == 2
    assert _count(bw)["aten.histc.default"] == 0 and _count(bw)["aten.logsumexp.default"] == 0


def _count(gm: fx.GraphModule) -> collections.Counter:
    return collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def test_metrics_off_adds_no_ops():
    xs = [_x()]
    counts = {}
    for name, config in {
        "off": MoECompileConfig(metrics=False),
        "pass_disabled": MoECompileConfig(metrics=True, passes=(("router_metrics", False),)),
        "on": ON,
    }.items():
        torch._dynamo.reset()
        backend, graphs = _recording_backend(config)
        with collecting() as rep:
            _train_steps(RoutedStack(), xs, backend)
        counts[name] = (_count(graphs["fw"][0]), _count(graphs["bw"][0]), rep.count("router_metrics"))
    assert counts["off"] == counts["pass_disabled"]
    assert counts["off"][2] == 0 and counts["on"][2] == 2
    extra_fw = counts["on"][0] - counts["off"][0]
    assert extra_fw["aten.histc.default"] == 2 and extra_fw["aten.logsumexp.default"] == 2
    assert counts["on"][1] == counts["off"][1]  # backward untouched
    assert metrics.collect()["moe/steps"] == 1


def test_recompiles_and_dynamic_shapes_share_accumulators():
    model = RoutedStack(router="qwen")
    xs = [_x(T, seed=T) for T in (5, 7, 9)]
    expected = _oracle("qwen", xs)
    backend, _ = _recording_backend(ON)
    _train_steps(model, xs[:1], backend)
    accs = [metrics.accumulator(name, 4, "cpu").acc_S.data_ptr() for name in metrics.layers()]
    torch._dynamo.reset()  # new graphs, same layers: same accumulators
    backend, _ = _recording_backend(ON)
    _train_steps(model, xs[1:], backend, dynamic=True)
    assert [metrics.accumulator(n, 4, "cpu").acc_S.data_ptr() for n in metrics.layers()] == accs
    got = metrics.collect(per_layer=True)
    assert got["moe/steps"] == 3
    for key in STATS_KEYS:
        assert got[f"moe/layer_1/{key}"] == pytest.approx(expected[f"moe/layer_1/{key}"], rel=1e-5)


def test_attach_then_compile_counts_once():
    model = RoutedStack(router="softmax")
    metrics.attach(model)
    backend, _ = _recording_backend(ON)
    with collecting() as rep:
        _train_steps(model, [_x(), _x(seed=1)], backend)
    assert_report(rep, {"router_metrics": 0}, {"router_metrics": ["already_instrumented"] * 2})
    got = metrics.collect(per_layer=True)
    assert got["moe/layer_0/steps"] == 2 and got["moe/layer_1/steps"] == 2
    expected = _oracle("softmax", [_x(), _x(seed=1)])
    assert got["moe/z_loss"] == pytest.approx(expected["moe/z_loss"], rel=1e-5)


def test_capacity_factor_reaches_compiled_graph():
    metrics.set_capacity_factor(1.0)
    backend, _ = _recording_backend(ON)
    xs = [_x(seed=7)]
    _train_steps(RoutedStack(router="granite"), xs, backend)
    got = metrics.collect()
    metrics.forget()
    metrics.set_capacity_factor(1.0)
    expected = _oracle("granite", xs)
    assert got["moe/over_capacity"] == pytest.approx(expected["moe/over_capacity"])
    assert got["moe/over_capacity"] > 0


# ------------------------------------------------------------------------------ torch 2.13 timing


def test_late_pre_grad_timing_skips_instead_of_breaking_aot():
    if not hasattr(torch._inductor.config, "pre_grad_pass_timing"):
        pytest.skip("torch 2.11 always runs pre-grad passes before AOTAutograd")
    gm = _dynamo_graph(RoutedStack(), _x())
    before = len(gm.graph.nodes)
    ctx = PassContext(ON, "pre_grad", "router_metrics", False)
    with torch._inductor.config.patch(pre_grad_custom_pass=StagePass("pre_grad", ON), pre_grad_pass_timing="late"):
        with collecting() as rep, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rm_pass.run(gm.graph, ctx)
    assert len(gm.graph.nodes) == before and not list(gm.named_buffers())
    assert [r.what for r in rep.skips] == ["late_pre_grad_timing"] * 2
    assert any("pre_grad_pass_timing" in str(w.message) for w in caught)


def test_backend_sets_early_pre_grad_timing_with_metrics():
    """Integration: moe_compile's backend adds metrics.inductor_patches to its Inductor patches."""
    from moe_compile.backend import inductor_patches

    on = inductor_patches(make_config(metrics=True), None, {})
    off = inductor_patches(make_config(metrics=False), None, {})
    for key, value in metrics.inductor_patches(True).items():
        assert on.get(key) == value
        assert key not in off


# -------------------------------------------------------------------------------- Inductor (slow)


def test_inductor_graphs_are_cudagraph_safe_and_values_match():
    """moe_compile.compile(metrics=True), training on CPU: post-grad forward and backward graphs have no
    cudagraph-incompatible node, no unbacked symbol; the metrics equal the eager oracle."""
    from torch._inductor.utils import get_first_incompatible_cudagraph_node

    recorder = PassEntry("record_post_grad", "post_grad", f"{__name__}:_record_post_grad")
    _RECORDED.clear()
    xs = [_x(seed=s) for s in range(3)]
    expected = _oracle("softmax", xs, layers=1)  # one layer: Inductor's C++ compile dominates the time
    model = RoutedStack(router="softmax", layers=1)
    with mock.patch.object(passes_mod, "PASSES", (*passes_mod.PASSES, recorder)), fresh_cache():
        compiled = moe_compile.compile(model, metrics=True)
        for x in xs:
            compiled(x).square().mean().backward()
    post = list(_RECORDED)
    assert len(post) == 2, f"expected a forward and a backward graph, got {len(post)}"
    for gm in post:
        assert get_first_incompatible_cudagraph_node(gm) is None
        assert not any(n.meta.get("unbacked_bindings") for n in gm.graph.nodes)
        assert not any(isinstance(n.meta.get("val"), torch.SymInt) for n in gm.graph.find_nodes(op="placeholder"))
    assert _count(post[0])["aten.histc.default"] == 1
    got = metrics.collect(per_layer=True)
    assert got["moe/steps"] == 3
    for key in STATS_KEYS:
        assert got[f"moe/{key}"] == pytest.approx(expected[f"moe/{key}"], rel=1e-4)


_RECORDED: list[fx.GraphModule] = []


def _record_post_grad(graph: fx.Graph, ctx: PassContext) -> None:
    _RECORDED.append(graph.owning_module)


def test_checkpointed_routers_are_reported_and_attach_covers_them():
    """Under torch.utils.checkpoint Dynamo puts each block in a higher-order op body: the pass reports
    the routers there; hooks from metrics.attach are traced into the body and count once."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = RoutedStack()

        def forward(self, x):
            for block in self.model.layers:
                x = checkpoint(block, x, use_reentrant=False)
            return x

    model = Checkpointed()
    xs = [_x(seed=8)]
    backend, _ = _recording_backend(ON)
    with collecting() as rep:
        _train_steps(model, xs, backend)
    assert_report(rep, {"router_metrics": 0}, {"router_metrics": ["inside_subgraph"] * 2})
    assert metrics.collect() == {}
    torch._dynamo.reset()
    metrics.attach(model)
    backend, _ = _recording_backend(ON)
    _train_steps(model, xs, backend)
    got = metrics.collect()
    assert got["moe/steps"] == 1 and got["moe/layers"] == 2
    assert got["moe/z_loss"] == pytest.approx(_oracle("softmax", xs)["moe/z_loss"], rel=1e-5)


def test_per_block_compile_pools_layers_unless_attached():
    """Compiling each block on its own gives one graph shared by all blocks, with module paths relative
    to the block: the pass pools every layer under ``gate``. attach keeps layers apart (the hook's
    accumulator is a graph input), without a recompile per layer."""
    from torch._dynamo.utils import counters

    x = _x(seed=9)
    for attach in (False, True):
        torch._dynamo.reset()
        counters.clear()
        model = RoutedStack(layers=4)
        if attach:
            metrics.attach(model)
        backend, _ = _recording_backend(ON)
        for block in model.layers:
            block.compile(backend=backend, fullgraph=True)
        model(x)
        got = metrics.collect(per_layer=True)
        if attach:
            assert [got[f"moe/layer_{i}/steps"] for i in range(4)] == [1.0] * 4
            assert counters["stats"]["unique_graphs"] <= 2
        else:
            assert got["moe/layer_gate/steps"] == 4 and got["moe/layers"] == 1
