"""Translation validation (NOTE [translation validation] (moe_compile/passes/_validate.py)).

Every pass gets a wrong rewrite injected (its own rewrite, then a wrong value in the forward, a wrong gradient, or
a change of one bit where the pass claims bitwise equality): the stage must refuse it with ``validation_failed``,
keep the original graph (results as eager's) and warn. The judge itself is checked on fresh random tensors, and
validation must leave user state (buffers, metrics accumulators, ``.grad``) as it found it.
"""

from __future__ import annotations

import copy
import importlib
import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx as fx
from torch import nn

from moe_compile import passes as passes_mod
from moe_compile import report
from moe_compile.api import CAPTURE_FLAGS
from moe_compile.backend import ConfiguredBackend
from moe_compile.config import make_config
from moe_compile.passes import PASSES, PassContext, StagePass
from moe_compile.passes._graph import tensor_val
from moe_compile.passes._judge import judge
from moe_compile.passes._validate import mutated_sources
from tests import _tolerance as tol
from tests.passes._harness import assert_matches_eager, compile_and_run, layer_k_dims

# ------------------------------------------------------------------------------------------ the judge


def _outputs(*tensors: torch.Tensor) -> dict[str, torch.Tensor]:
    return {f"output {i}": t for i, t in enumerate(tensors)}


def test_judge_bounds_floats_by_the_baseline_error_from_the_reference():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(64, 32, generator=g, dtype=torch.float64)
    base = ref.to(torch.bfloat16)  # the baseline: one rounding from the reference
    eager_err = float((base.double() - ref).abs().max())
    bound = 4 * eager_err + 2**-8 * float(ref.abs().max())
    # half the bound either side at a few elements (bf16 rounds the result by at most u|x| more, well inside the
    # other half; on every element it would be a systematic error, which the rms bound refuses: the test below)
    within = ref.clone()
    picked = torch.randperm(ref.numel(), generator=g)[:4]
    within.view(-1)[picked] += 0.5 * bound * torch.sign(torch.randn(4, generator=g, dtype=torch.float64))
    beyond = ref.clone()
    beyond[3, 5] += 1.5 * bound
    reference = lambda: type("Out", (), {"tensors": _outputs(ref.float())})()  # noqa: E731
    ok = judge(_outputs(within.to(torch.bfloat16)), _outputs(base), reference)
    bad = judge(_outputs(beyond.to(torch.bfloat16)), _outputs(base), reference)
    assert ok.ok and ok.worst.ratio <= 1, ok
    assert not bad.ok and bad.worst.ratio > 1, bad


def test_judge_gives_a_small_tensor_the_graphs_noise():
    """A loss (fp32 scalar) next to bf16 logits: the loss's baseline sits on the reference (one sample, near zero
    by chance), so its bound is 4x the graph's noise (the logits' relative error) plus one bf16 rounding, of its
    magnitude; without the bf16 logits in the graph it is fp32's rounding alone."""
    g = torch.Generator().manual_seed(1)
    loss_ref = 1 + torch.rand((), generator=g, dtype=torch.float64)
    logits = torch.randn(128, 16, generator=g, dtype=torch.float64)
    noise = float((logits.to(torch.bfloat16).double() - logits).abs().max() / logits.abs().max())
    bound = (4 * noise + 2.0**-8) * float(loss_ref)
    base = {"loss": loss_ref.float(), "logits": logits.to(torch.bfloat16)}
    reference = lambda: type("Out", (), {"tensors": {"loss": loss_ref.float(), "logits": logits.float()}})()  # noqa: E731

    def with_loss(err: float) -> dict[str, torch.Tensor]:
        return {"loss": (loss_ref + err).float(), "logits": logits.to(torch.bfloat16)}

    assert judge(with_loss(0.9 * bound), base, reference).ok
    refused = judge(with_loss(1.1 * bound), base, reference)
    assert not refused.ok and refused.worst.name == "loss"
    only_loss = {"loss": base["loss"]}
    assert not judge({"loss": with_loss(0.9 * bound)["loss"]}, only_loss, reference).ok


def test_judge_integers_zeros_and_non_finites_exactly():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 8, (16, 2), generator=g)
    changed = ids.clone()
    changed[0, 0] = (changed[0, 0] + 1) % 8
    assert judge(_outputs(ids.clone()), _outputs(ids), None).ok
    assert not judge(_outputs(changed), _outputs(ids), None).ok
    zero = torch.zeros(8, 4)
    assert not judge(_outputs(torch.full((8, 4), 1e-30)), _outputs(zero), None).ok, "exact zero must stay zero"
    x = torch.randn(8, 4, generator=g)
    x[2, 1] = math.nan
    y = x.clone()
    y[2, 1] = 0.0
    assert judge(_outputs(x.clone()), _outputs(x), None).ok
    assert not judge(_outputs(y), _outputs(x), None).ok, "a NaN must stay where it was"
    tiny = x + 1e-7 * torch.randn(8, 4, generator=g)
    assert judge(_outputs(tiny), _outputs(x), None).ok
    assert not judge(_outputs(tiny), _outputs(x), None, exact=True).ok, "exact: bitwise"


def test_judge_sees_a_systematic_error_under_the_max_bound_by_its_rms():
    """bf16 outputs of a top-2 combine: another summation order (fp32 products, one rounding) passes; the second
    choice's weight 4% too large is refused, furthest past the rms bound (the max bound is set by the largest
    rounding and misses such an error where weights are small: the injections on real layers)."""
    g = torch.Generator().manual_seed(5)
    y = torch.randn(2, 256, 64, generator=g, dtype=torch.float64)
    w = torch.softmax(torch.randn(256, 2, generator=g, dtype=torch.float64), -1)
    ref = (w.T[..., None] * y).sum(0)
    y16, w16 = y.to(torch.bfloat16), w.to(torch.bfloat16)
    base = (w16.T[..., None] * y16).sum(0)  # eager: bf16 products, a bf16 sum
    reordered = (w16.T[..., None].float() * y16.float()).sum(0).to(torch.bfloat16)
    off = (w16.T[..., None].float() * y16.float() * torch.tensor([1.0, 1.04]).view(2, 1, 1)).sum(0).to(torch.bfloat16)
    reference = lambda: type("Out", (), {"tensors": _outputs(ref.float())})()  # noqa: E731
    assert judge(_outputs(reordered), _outputs(base), reference).ok
    refused = judge(_outputs(off), _outputs(base), reference)
    assert not refused.ok and refused.worst.how.startswith("rms"), refused  # the rms bound sees it best


def test_mutated_sources_follow_views():
    def fn(buf, x):
        buf.view(-1)[:3].add_(1)
        return x * 2

    gm = fx.symbolic_trace(fn)
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    assert mutated_sources(gm.graph) == {placeholders[0]}


def test_without_real_inputs_rewrites_are_kept_unchecked():
    """A stage run outside a compile (no real inputs) cannot validate: the rewrite stays, marked unchecked."""
    from tests.models.handwritten import SortIndexSelectScatterAdd

    torch.manual_seed(0)
    layer = SortIndexSelectScatterAdd()
    gms = []
    torch._dynamo.reset()
    x = torch.randn(6, layer.router.shape[1], dtype=torch.bfloat16)
    torch.compile(layer, backend=lambda gm, ex: gms.append(gm) or gm)(x)
    with report.collecting() as rep:
        StagePass("pre_grad", make_config())(gms[0].graph)
    assert rep.count("fuse_dispatch") == 1
    assert [r.what for r in rep.unchecked] == ["validation_unavailable"], rep.table()


# ------------------------------------------------------------------------------------------ injected wrong rewrites


def _changed_nodes(graph: fx.Graph, before: dict[fx.Node, tuple[Any, str]]) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function"
            and before.get(n) != (n.target, repr((n.args, n.kwargs)))]


def _float_nodes(nodes: list[fx.Node]) -> list[fx.Node]:
    out = [n for n in nodes if (v := tensor_val(n)) is not None and v.is_floating_point() and n.users]
    if not out:  # a node rewritten in place that returns a tuple: its float getitem users
        out = [u for n in nodes for u in n.users if (v := tensor_val(u)) is not None and v.is_floating_point()]
    assert out, "the pass changed no float node to corrupt"
    return out


def _insert_after(graph: fx.Graph, node: fx.Node, build: Callable[[fx.Node], fx.Node]) -> None:
    with graph.inserting_before(node.next):  # in order: each node before the anchor, after the one before
        new = build(node)
    node.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new and user not in new.all_input_nodes
                               and not _feeds(user, new))


def _feeds(node: fx.Node, target: fx.Node) -> bool:
    """Whether ``node`` is among ``target``'s inputs, transitively (the corruption's own nodes)."""
    todo, seen = list(target.all_input_nodes), set()
    while todo:
        n = todo.pop()
        if n is node:
            return True
        if n not in seen:
            seen.add(n)
            todo += [i for i in n.all_input_nodes if i.meta.get("corruption")]
    return False


def _call(graph: fx.Graph, stage: str, torch_fn: Any, aten_fn: Any, *args: Any, like: fx.Node) -> fx.Node:
    node = graph.call_function(torch_fn if stage == "pre_grad" else aten_fn, args)
    key = "example_value" if "example_value" in like.meta else "val"
    node.meta[key] = like.meta[key]
    node.meta["corruption"] = True
    return node


def scale_forward(graph: fx.Graph, changed: list[fx.Node], stage: str) -> None:
    """A wrong value: the last float result of the rewrite doubled (a term counted twice)."""
    aten = torch.ops.aten
    _insert_after(graph, _float_nodes(changed)[-1],
                  lambda n: _call(graph, stage, torch.mul, aten.mul.Tensor, n, 2.0, like=n))


def break_backward(graph: fx.Graph, changed: list[fx.Node], stage: str) -> None:
    """A wrong gradient with a bitwise equal forward: ``y = x + (x - x.detach())`` doubles dx."""
    assert stage == "pre_grad"
    node = next(n for n in _float_nodes(changed) if tensor_val(n).requires_grad)

    def build(n: fx.Node) -> fx.Node:
        detached = _call(graph, stage, torch.Tensor.detach, None, n, like=n)
        diff = _call(graph, stage, torch.sub, None, n, detached, like=n)
        return _call(graph, stage, torch.add, None, n, diff, like=n)

    _insert_after(graph, node, build)


def nudge_input(graph: fx.Graph, changed: list[fx.Node], stage: str) -> None:
    """For a pass that claims bitwise equality: one input of its op off by a relative 2^-20 (far inside any
    float bound, but not bitwise)."""
    inputs = [a for n in changed for a in n.all_input_nodes if a not in changed and a.op == "call_function"
              and (v := tensor_val(a)) is not None and v.is_floating_point()]
    _insert_after(graph, inputs[0],
                  lambda n: _call(graph, stage, torch.mul, torch.ops.aten.mul.Tensor, n, 1 + 2**-20, like=n))


def _routing_weights(changed: list[fx.Node], *, needs_grad: bool) -> tuple[fx.Node, fx.Node]:
    """The rewrite's op that takes the routing weights, and that input: a float input from outside the rewrite,
    one weight per row or choice (1-D, or a last dim of at most 8: ``[T, K]``, ``[N, 1, 1]``)."""
    for node in changed:
        for arg in node.all_input_nodes:
            v = tensor_val(arg)
            if (arg not in changed and v is not None and v.is_floating_point() and (v.dim() == 1 or v.shape[-1] <= 8)
                    and v.numel() > 1 and (v.requires_grad or not needs_grad)):
                return node, arg
    raise AssertionError(f"no routing weights among the inputs of {[n.target for n in changed]}")


def _scale_weights(graph: fx.Graph, changed: list[fx.Node], stage: str, factor: float, *, forward: bool) -> None:
    """Every other routing weight (the second choice of a top-2 ``[T, 2]``) times ``factor`` in the forward, or
    its gradient alone (``w + (factor - 1) * (w - w.detach())``: a bitwise equal forward)."""
    op, weights = _routing_weights(changed, needs_grad=not forward)
    v = tensor_val(weights)
    with graph.inserting_before(op):
        if forward:
            scale = torch.ones(v.numel(), dtype=v.dtype)
            scale[1::2] = factor
            const = graph.call_function(torch.tensor, (scale.reshape(v.shape).tolist(),), {"dtype": v.dtype})
            const.meta["example_value"] = scale.reshape(v.shape)
            new = _call(graph, stage, torch.mul, None, weights, const, like=weights)
        else:
            detached = _call(graph, stage, torch.Tensor.detach, None, weights, like=weights)
            diff = _call(graph, stage, torch.sub, None, weights, detached, like=weights)
            scaled = _call(graph, stage, torch.mul, None, diff, factor - 1.0, like=weights)
            new = _call(graph, stage, torch.add, None, weights, scaled, like=weights)
    op.replace_input_with(weights, new)


def combine_weight_off_4pct(graph: fx.Graph, changed: list[fx.Node], stage: str) -> None:
    """A combine whose second choice's weight is 4% too large (every other routing weight times 1.04)."""
    _scale_weights(graph, changed, stage, 1.04, forward=True)


def router_gradient_off_15pct(graph: fx.Graph, changed: list[fx.Node], stage: str) -> None:
    """The gradient into the routing weights (and so the router's) times 0.85, the forward bitwise equal."""
    _scale_weights(graph, changed, stage, 0.85, forward=False)


def _inject(monkeypatch: pytest.MonkeyPatch, pass_name: str,
            corrupt: Callable[[fx.Graph, list[fx.Node], str], None]) -> None:
    entry = next(e for e in PASSES if e.name == pass_name)
    module_name, fn_name = entry.target.split(":")
    module = importlib.import_module(module_name)
    original = getattr(module, fn_name)

    def corrupted(graph: fx.Graph, ctx: PassContext) -> None:
        before = {n: (n.target, repr((n.args, n.kwargs))) for n in graph.nodes}
        original(graph, ctx)
        if ctx.rewritten_layers:
            corrupt(graph, _changed_nodes(graph, before), ctx.stage)

    monkeypatch.setattr(module, fn_name, corrupted)


def _sort_dispatch():
    from tests.models.handwritten import SortIndexSelectScatterAdd

    layer = SortIndexSelectScatterAdd()  # bf16: CPU grouped GEMMs take no other dtype
    return layer, (torch.randn(12, layer.router.shape[1], dtype=torch.bfloat16),), {}


def _host_padded():
    from tests.models.host_padded import make_layer
    from tests.passes._host_padding_checks import layer_input

    return make_layer("split_pad"), (layer_input(int(torch.randint(0, 1000, ()))),), {}


def _expert_loop():
    from tests.models.host_padded import make_layer
    from tests.passes._host_padding_checks import layer_input

    return make_layer("loop"), (layer_input(int(torch.randint(0, 1000, ()))),), {}


def _grouped_mm_fallback():
    pytest.importorskip("transformers.integrations.moe")
    from tests.passes.test_replace_grouped_mm_fallback import _inputs, experts

    return experts, _inputs(seed=int(torch.randint(0, 1000, ()))), {}


def _glu_inference():
    pytest.importorskip("transformers.integrations.moe")
    from tests.passes.test_fuse_expert_mlp import GLU_FORMS, _inputs, _moe

    return _moe(GLU_FORMS["silu_chunk"][0], "fallback"), _inputs(torch.float32), {}


def _capacity_layer():
    from tests.models.capacity_layers import CapacityMoE

    return CapacityMoE(capacity_factor=0.75, dtype=torch.float32), (torch.randn(24, 16),), {}


def _drop_and_pad_layer():
    from tests.models.capacity_layers import MegatronDropAndPadMoE

    return MegatronDropAndPadMoE(capacity_factor=0.75, dtype=torch.float32), (torch.randn(24, 16),), {}


def _expert_choice():
    from tests.models.expert_choice import ExpertChoiceMoE

    return ExpertChoiceMoE(hidden=16, ffn=32, experts=4), (torch.randn(2, 8, 16),), {}


def _routers():
    from tests.models.router_metrics_models import RoutedStack

    return RoutedStack(router="softmax"), (torch.randn(8, 16),), {}


def _causal_attention():
    from tests.passes.test_causal_mask import Attention

    return Attention("bool"), (torch.randn(2, 12, 32),), {}


def _mla_attention():
    from tests.passes.test_pad_attention_value import MLAttention

    return MLAttention(), (torch.randn(2, 12, 32),), {}


def _padded_attention():
    from tests.passes.test_causal_mask import Attention

    keep = torch.ones(2, 12, dtype=torch.bool)
    keep[1, :3] = False
    return Attention("bool"), (torch.randn(2, 12, 32), keep), {}


def _group_limited_router():
    from tests.passes.test_deterministic_accumulate import GroupLimitedRouter

    return GroupLimitedRouter(), (torch.randn(16, 16, requires_grad=True),), {}


def _embedding():
    from tests.passes.test_deterministic_scatter import Embed

    ids = torch.randint(0, 40, (3, 7))
    ids[0, :4] = 3
    return Embed(), (ids,), {}


def _matmul_capacity_layer():
    from tests.passes.test_sparse_contraction import MatmulCapacityMoE

    return MatmulCapacityMoE(capacity_factor=0.75), (torch.randn(24, 16),), {}


def _slot_buffer_layer():
    from tests.passes.test_deterministic_scatter import SlotBufferMoE

    return SlotBufferMoE(), (torch.randn(12, 8, requires_grad=True),), {}


def _hand_written_grouped_mm():
    from tests.passes.test_normalize import H, HandWrittenGroupedMM, T

    return HandWrittenGroupedMM(seed=0).to(torch.bfloat16), (torch.randn(T, H, dtype=torch.bfloat16),), {}


# pass -> (model, options, stage backend, corruptions); "passes+aot_eager" runs the pre-grad stage only
CASES: dict[str, tuple[Callable[[], Any], dict[str, Any], str, tuple[Callable[..., None], ...]]] = {
    "normalize": (_hand_written_grouped_mm, {}, "passes+aot_eager", (scale_forward, break_backward)),
    "fuse_expert_loop": (_expert_loop, {}, "passes+aot_eager", (scale_forward, break_backward)),
    "strip_host_padding": (_host_padded, {}, "passes+aot_eager", (scale_forward, break_backward)),
    "fuse_dispatch": (_sort_dispatch, {}, "passes+aot_eager", (scale_forward, break_backward)),
    "capacity_dispatch": (_capacity_layer, {}, "passes+aot_eager", (scale_forward, break_backward)),
    "sparse_contraction": (_matmul_capacity_layer, {}, "passes+aot_eager", (scale_forward, break_backward)),
    "drop_and_pad": (_drop_and_pad_layer, {}, "passes+aot_eager", (scale_forward, break_backward)),
    "replace_grouped_mm_fallback": (_grouped_mm_fallback, {}, "passes+aot_eager", (scale_forward, break_backward)),
    "fuse_expert_mlp": (_glu_inference, {}, "passes+aot_eager", (scale_forward,)),
    "router_metrics": (_routers, {"metrics": True}, "passes+aot_eager", (nudge_input,)),
    "causal_mask": (_causal_attention, {"deterministic": True}, "passes+aot_eager", (scale_forward, break_backward)),
    "pad_attention_value": (_mla_attention, {"deterministic": True}, "passes+aot_eager",
                            (scale_forward, break_backward)),
    "masked_attention": (_padded_attention, {"deterministic": True}, "passes+aot_eager",
                         (scale_forward, break_backward)),
    "expert_choice": (_expert_choice, {}, "moe_compile", (scale_forward,)),
    "deterministic_accumulate": (_group_limited_router, {}, "moe_compile", (scale_forward,)),
    "routed_accumulate": (_slot_buffer_layer, {}, "moe_compile", (scale_forward,)),
    "deterministic_scatter": (_embedding, {"deterministic": True}, "moe_compile", (scale_forward,)),
}


def _case_ids() -> list[Any]:
    return [pytest.param(name, corrupt, id=f"{name}-{corrupt.__name__}")
            for name, (_, _, _, corruptions) in CASES.items() for corrupt in corruptions]


def test_every_rewriting_pass_has_an_injection_case():
    """Every pass that rewrites is covered (the audit only reads; deterministic_attention's rewrite exists on
    CUDA only: tests/passes/test_validate_gpu.py; expert_parallel's graphs hold collectives, which validation does not
    run: tests/models/test_ep.py compares it with eager on 2 gloo ranks)."""
    assert set(CASES) | {"audit", "deterministic_attention", "expert_parallel"} == {e.name for e in PASSES}


@pytest.mark.parametrize("pass_name,corrupt", _case_ids())
def test_wrong_rewrite_is_refused(monkeypatch, pass_name, corrupt):
    torch.manual_seed(sum(map(ord, pass_name)))
    build, options, backend, _ = CASES[pass_name]
    fn, args, kwargs = build()
    train = pass_name != "fuse_expert_mlp"  # fused in inference only
    config = make_config(**options)
    _inject(monkeypatch, pass_name, corrupt)
    monkeypatch.setattr(passes_mod, "_WARNED_VALIDATION", set())  # each case sees its own warning
    # host-sized layers are captured as moe_compile.compile captures them
    with warnings.catch_warnings(record=True) as caught, torch._dynamo.config.patch(CAPTURE_FLAGS):
        warnings.simplefilter("always")
        run = compile_and_run(fn, args, kwargs, train=train, config=config,
                              backend=backend if backend == "passes+aot_eager" else ConfiguredBackend(config))
    refused = [r for r in run.report.skips if r.pass_name == pass_name and r.what == "validation_failed"]
    assert refused, run.report.table()
    assert run.report.count(pass_name) == 0, run.report.table()
    assert any(pass_name in str(w.message) and "changed the results" in str(w.message) for w in caught)
    assert_matches_eager(run, fn, args, kwargs, train=train)


# The passes whose rewrite takes the routing weights as they are (fuse_dispatch, capacity_dispatch, drop_and_pad)
SMALL_ERRORS = [pytest.param(name, corrupt, id=f"{name}-{corrupt.__name__}")
                for name in ("fuse_dispatch", "capacity_dispatch", "drop_and_pad")
                for corrupt in (combine_weight_off_4pct, router_gradient_off_15pct)]


@pytest.mark.parametrize("pass_name,corrupt", SMALL_ERRORS)
def test_small_wrong_rewrite_is_refused_under_the_default_options(monkeypatch, pass_name, corrupt):
    """A combine weight 4% off or a router gradient 15% off, under ``make_config()`` as a user gets it (no
    MOE_COMPILE_VALIDATE_ALL): validation refuses it and the results are eager's."""
    monkeypatch.delenv("MOE_COMPILE_VALIDATE_ALL", raising=False)
    torch.manual_seed(sum(map(ord, pass_name)) + 1)
    build, options, backend, _ = CASES[pass_name]
    fn, args, kwargs = build()
    _inject(monkeypatch, pass_name, corrupt)
    monkeypatch.setattr(passes_mod, "_WARNED_VALIDATION", set())
    with warnings.catch_warnings(record=True), torch._dynamo.config.patch(CAPTURE_FLAGS):
        warnings.simplefilter("always")
        run = compile_and_run(fn, args, kwargs, train=True, config=make_config(**options))
    assert [r for r in run.report.skips if r.pass_name == pass_name and r.what == "validation_failed"], \
        run.report.table()
    assert_matches_eager(run, fn, args, kwargs, train=True)


# Known gap: the bf16 sort-dispatch layer's 4% combine error stays within 3x eager's rms distance in the pass tests'
# oracle (validation, on other random activations, refuses it); 2x caught it but refused a correct sampled form.
_ORACLE_CASES = [pytest.param(*case.values, id=case.id, marks=pytest.mark.xfail(strict=True, reason="known gap"))
                 if case.id == "fuse_dispatch-combine_weight_off_4pct" else case for case in SMALL_ERRORS]


@pytest.mark.parametrize("pass_name,corrupt", _ORACLE_CASES)
def test_small_wrong_rewrite_fails_the_pass_tests_oracle_without_validation(monkeypatch, pass_name, corrupt):
    """The same errors with validation off: the rewrite is kept, and the oracle of the pass tests
    (``assert_matches_eager``: tensor by tensor against eager's distance from a float32 run) fails."""
    monkeypatch.delenv("MOE_COMPILE_VALIDATE_ALL", raising=False)
    torch.manual_seed(sum(map(ord, pass_name)) + 2)
    build, options, backend, _ = CASES[pass_name]
    fn, args, kwargs = build()
    _inject(monkeypatch, pass_name, corrupt)
    with torch._dynamo.config.patch(CAPTURE_FLAGS):
        run = compile_and_run(fn, args, kwargs, train=True, config=make_config(**options, validate=False))
    assert run.report.count(pass_name) >= 1, run.report.table()
    with pytest.raises(AssertionError):
        assert_matches_eager(run, fn, args, kwargs, train=True)


# ------------------------------------------------------------------------------------------ no user state changed


class CountingMoE(nn.Module):
    """A sort-dispatch MoE layer that counts its calls in a buffer (state the graph mutates)."""

    def __init__(self) -> None:
        super().__init__()
        from tests.models.handwritten import SortIndexSelectScatterAdd

        self.moe = SortIndexSelectScatterAdd()
        self.hidden = self.moe.router.shape[1]
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("seen", torch.zeros(self.hidden, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        self.seen.add_(x.detach().sum(0))
        return self.moe(x)


def test_validation_leaves_user_state_alone():
    """Buffers the graph mutates see two calls' updates after two calls, and ``.grad`` two backwards' sums:
    the validation runs (forward, reference, gradients) touched neither."""
    torch.manual_seed(3)
    model = CountingMoE()
    eager = copy.deepcopy(model)
    xs = [torch.randn(9, model.hidden, dtype=torch.bfloat16) for _ in range(2)]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=ConfiguredBackend(make_config(validate=True)))
    with report.collecting() as rep, torch._inductor.config.patch(force_disable_caches=True):  # the passes must run
        for x in xs:
            compiled(x).pow(2).sum().backward()
            eager(x).pow(2).sum().backward()
    assert rep.count("fuse_dispatch") >= 1 and not rep.unchecked, rep.table()
    assert int(model.calls) == 2
    assert torch.equal(model.seen, eager.seen)
    k_dims = layer_k_dims(model.moe, xs)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        tol.assert_layer_close(p.grad, q.grad, k_dims, p.dtype, backward=True, rows=2 * len(xs[0]), what=name)


def test_validate_off_runs_no_validation(monkeypatch):
    """Off (``validate=False``; on is the default) and without MOE_COMPILE_VALIDATE_ALL, nothing is validated."""
    from moe_compile.passes import _validate

    monkeypatch.delenv("MOE_COMPILE_VALIDATE_ALL", raising=False)
    assert make_config().validate is True

    def fail(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("validation ran with validate=False")

    monkeypatch.setattr(_validate.StageValidator, "check", fail)
    fn, args, kwargs = _sort_dispatch()
    run = compile_and_run(fn, args, kwargs, train=True, config=make_config(validate=False))
    assert run.report.count("fuse_dispatch") == 1 and not run.report.unchecked


def test_wrong_rewrite_inside_a_checkpointed_region_is_refused(monkeypatch):
    """Inductor's pre-grad passes visit the body of an activation-checkpointed region as a graph of its own, whose
    inputs are not the compile's: validation runs it on random inputs from its example values and still refuses a
    wrong rewrite there."""
    from torch.utils.checkpoint import checkpoint

    from tests.passes.test_causal_mask import Attention

    class Checkpointed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Attention("bool")

        def forward(self, x, keep):
            return checkpoint(self.inner, x, keep, use_reentrant=False)

    torch.manual_seed(0)
    model, args = Checkpointed(), _padded_attention()[1]
    _inject(monkeypatch, "masked_attention", scale_forward)
    monkeypatch.setattr(passes_mod, "_WARNED_VALIDATION", set())
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        run = compile_and_run(model, args, train=True, backend=ConfiguredBackend(make_config(deterministic=True)))
    refused = [r for r in run.report.skips if r.pass_name == "masked_attention" and r.what == "validation_failed"]
    assert refused and not run.report.unchecked, run.report.table()
    assert_matches_eager(run, model, args, train=True)



def test_dynamic_shape_compile_is_validated_on_its_real_parameters(monkeypatch):
    """A dynamic-shape compile's example inputs hold its size symbols: validation still takes the real parameters
    (and random activations like the real ones), not random tensors from the placeholders' metadata, which made
    a layer's gradients 1e6 and refused a right rewrite (fuzz finding A11)."""
    from moe_compile.passes import _validate

    prepared: list[tuple[str, list[Any], list[Any]]] = []
    original = _validate.StageValidator._prepare

    def spy(self: Any, graph: fx.Graph) -> None:
        original(self, graph)
        current = _validate._CURRENT.get()
        prepared.append((self.stage, list(current.example_inputs), list(self._inputs or [])))

    monkeypatch.setattr(_validate.StageValidator, "_prepare", spy)
    torch.manual_seed(4)
    model = CountingMoE()
    torch._dynamo.reset()
    compiled = torch.compile(model, dynamic=True, backend=ConfiguredBackend(make_config(validate=True)))
    with torch._inductor.config.patch(force_disable_caches=True), report.collecting() as rep:
        compiled(torch.randn(9, model.hidden, dtype=torch.bfloat16)).float().pow(2).sum().backward()
    refused = [r for r in rep.skips if r.what == "validation_failed"]
    assert rep.count("fuse_dispatch") >= 1 and not rep.unchecked and not refused, rep.table()
    pre_grad = [(real, used) for stage, real, used in prepared if stage == "pre_grad"]
    assert pre_grad and any(isinstance(r, torch.SymInt) for real, _ in pre_grad for r in real)
    for real, used in pre_grad:
        params = [(r, u) for r, u in zip(real, used) if isinstance(r, nn.Parameter)]
        assert params and all(u is r for r, u in params)


def test_judge_gives_float32_tensors_the_graphs_noise():
    """In a float32 graph a tensor whose baseline happens to sit within a rounding of the reference (a weight
    gradient summed over a few tokens) may be off by the graph's noise (its largest relative error), not only 4x its
    own lucky error (fuzz finding A14); a relative error of 1e-4, far below any wrong expert or dropped term, is
    still refused, and bf16 graphs keep the per-tensor bound."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    ref_w = torch.randn(256, generator=g, dtype=torch.float64)
    ref_y = torch.randn(256, generator=g, dtype=torch.float64)
    noisy_y = ref_y * (1 + 2e-7 * torch.randn(256, generator=g, dtype=torch.float64))
    noise = float((noisy_y.float().double() - ref_y).abs().max() / ref_y.abs().max())
    scale = float(ref_w.abs().max())
    base = {"w": ref_w.float(), "y": noisy_y.float()}  # w: exact to one rounding (lucky)
    reference = lambda: type("Out", (), {"tensors": {"w": ref_w, "y": ref_y}})()  # noqa: E731

    def with_w(rel: float) -> dict[str, torch.Tensor]:
        w = ref_w.clone()
        w[int(ref_w.abs().argmax())] += rel * scale
        return {"w": w.float(), "y": base["y"]}

    assert judge(with_w(2 * noise), base, reference).ok
    refused = judge(with_w(1e-4), base, reference)
    assert not refused.ok and refused.worst.name == "w"
    base16 = {k: v.to(torch.bfloat16) for k, v in base.items()}
    ref16 = lambda: type("Out", (), {"tensors": {"w": ref_w, "y": noisy_y}})()  # noqa: E731
    assert not judge({k: v.to(torch.bfloat16) for k, v in with_w(0.05).items()}, base16, ref16).ok


def test_validation_leaves_metrics_accumulators_alone():
    """``router_metrics`` adds an in-place accumulate into the process-wide metrics buffer: validating that rewrite
    runs it on validation's inputs, which must not count as a step of the user's (two calls: two steps, and the
    statistics of those two calls alone)."""
    from moe_compile import metrics
    from tests.models.router_metrics_models import RoutedStack

    metrics.forget()
    torch._dynamo.reset()
    model = RoutedStack(router="softmax", layers=1)
    xs = [torch.randn(8, 16) for _ in range(2)]
    patches = {**metrics.inductor_patches(True), "force_disable_caches": True}
    with torch._inductor.config.patch(patches), report.collecting() as rep:
        compiled = torch.compile(model, backend=ConfiguredBackend(make_config(metrics=True, validate=True)))
        for x in xs:
            compiled(x)
    got = metrics.collect()
    metrics.forget()
    assert rep.count("router_metrics") >= 1 and not rep.unchecked, rep.table()
    assert got["moe/steps"] == 2.0
    metrics.attach(model)
    with torch.no_grad():
        for x in xs:
            model(x)
    metrics.detach(model)
    want = metrics.collect()
    metrics.forget()
    torch._dynamo.reset()
    assert got["moe/tokens"] == want["moe/tokens"]
    assert got["moe/lb_loss"] == pytest.approx(want["moe/lb_loss"], rel=1e-5)
