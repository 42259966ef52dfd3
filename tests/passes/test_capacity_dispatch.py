"""``capacity_dispatch``: einsums over one-hot ``[T, E, C]`` dispatch and combine tensors become gathers."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from moe_compile import report
from moe_compile.passes.capacity_dispatch import capacity_combine, capacity_dispatch
from tests import _tolerance as tol
from tests.models.capacity_layers import STYLES, CapacityMoE
from tests.passes._harness import metrics_over_calls


@pytest.mark.parametrize("style", STYLES)
def test_capacity_layer_rewritten_within_eager_bound(style):
    """A bf16 training step with tokens dropped at capacity: both einsums are rewritten (DeepSpeed's dispatch mask is
    a ``bool()`` of the combine tensor), no accumulating scatter is left forward or backward, and output, input
    gradient, router and expert gradients are as close to a float32 eager run as bf16 eager is."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    model = CapacityMoE(capacity_factor=0.75, style=style, seed=int(torch.randint(0, 2**16, (), generator=gen)))
    x = torch.randn(2, 24, 16, generator=gen).to(torch.bfloat16)
    cot = torch.randn(2, 24, 16, generator=gen)
    with torch.no_grad():
        logits = F.linear(x.reshape(-1, 16), model.router).float()
        route = model._gshard if style == "gshard" else model._deepspeed
        kept = int(route(logits, model.capacity(48))[0].sum())
    assert kept < 48 * model.top_k, "no choice dropped: the capacity path is not exercised"
    ref_model = copy.deepcopy(model).float()
    eager = tol.layer_step(model, model, x, cot)
    ref = tol.layer_step(ref_model, ref_model, x, cot, torch.float32)
    torch._dynamo.reset()
    with report.collecting() as rep, torch._inductor.config.patch(force_disable_caches=True):
        got = tol.layer_step(torch.compile(model, backend="moe_compile", fullgraph=True), model, x, cot)
    torch._dynamo.reset()
    done = sorted(r.what.split(" over")[0] for r in rep.records if r.pass_name == "capacity_dispatch"
                  and r.kind == "rewrite")
    skipped = [r.what for r in rep.records if r.pass_name == "capacity_dispatch" and r.kind == "skip"]
    assert done == ["einsum('tec,ech->th')", "einsum('tec,th->ech')"] and not skipped, rep.table()
    assert not [r for r in rep.records if r.what == "validation_failed"], rep.table()
    assert rep.clean and rep.deterministic, rep.table()  # no accumulating scatter forward or backward
    ok, worst, unjudged = tol.within_eager_bound(got, eager, ref, always_judged=("out",))
    assert ok and not unjudged, (worst, unjudged)


def _random_terms(gen, T, E, C, K):
    """One-hot terms with shared slots and positions outside ``[0, C)``, small-integer weights (exact sums)."""
    ids = torch.randint(0, E, (K, T), generator=gen)
    pos = torch.randint(-1, C + 1, (K, T, E), generator=gen)
    w = torch.randint(-3, 4, (K, T, 1), generator=gen).float()
    keep = torch.randint(0, 2, (K, T, E), generator=gen).bool()
    d = sum(F.one_hot(pos[k].clamp(0, C - 1), C) * ((pos[k] >= 0) & (pos[k] < C)).unsqueeze(-1)
            * (F.one_hot(ids[k], E) * keep[k] * w[k]).unsqueeze(-1) for k in range(K))
    terms = [(ids, pos, [(keep, False), (w, False)], (K, T), 1, None, False)]
    return d.float(), terms


def test_functions_equal_the_einsums_exactly():
    """On small integers every sum is exact, so the gathers must give the einsums' values bitwise, slots shared by
    several entries and positions outside ``[0, C)`` (which weigh nothing, as ``one_hot`` by comparison) included."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    T, E, C, K, H = 64, 4, 5, 2, 8  # ~90% of draws put two entries of a token into one slot
    d, terms = _random_terms(gen, T, E, C, K)
    x = torch.randint(-4, 5, (T, H), generator=gen).float()
    y = torch.randint(-4, 5, (E, C, H), generator=gen).float()
    assert torch.equal(capacity_dispatch(x, terms, E, C), torch.einsum("tec,th->ech", d, x))
    assert torch.equal(capacity_combine(y, terms, E, C, T), torch.einsum("tec,ech->th", d, y))
    # bool() of the whole sum: a slot counts once when its entries' weights sum to non-zero (the -3..3 weights of
    # shared slots cancel in some draws)
    bool_terms = [t[:-1] + (True,) for t in terms]
    assert torch.equal(capacity_dispatch(x, bool_terms, E, C), torch.einsum("tec,th->ech", d.bool().float(), x))
    assert torch.equal(capacity_combine(y, bool_terms, E, C, T), torch.einsum("tec,ech->th", d.bool().float(), y))


def test_dense_operand_left_alone():
    """An einsum of the dispatch shape over a dense tensor is no dispatch: left alone with ``not_one_hot``."""

    def layer(d, x):
        return torch.einsum("tec,th->ech", d.softmax(-1), x)

    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    d, x = torch.randn(6, 3, 4, generator=gen), torch.randn(6, 8, generator=gen)
    torch._dynamo.reset()
    with report.collecting() as rep, torch._inductor.config.patch(force_disable_caches=True):  # the passes must run
        got = torch.compile(layer, backend="moe_compile", fullgraph=True)(d, x)
    torch._dynamo.reset()
    assert [(r.kind, r.what) for r in rep.records if r.pass_name == "capacity_dispatch"] == [("skip", "not_one_hot")]
    assert torch.allclose(got, layer(d, x), rtol=0, atol=8 * torch.finfo(torch.float32).eps * 6 * x.abs().max())


def test_dynamic_capacity_left_alone_without_error():
    """A dynamic-shape compile makes the token count a symbol: the pass skips with ``symbolic_shape``, raises
    nothing, and the results are within eager's bound. (The fuzz layers 1328 and 1366 of 2026-11-27, where
    ``one_hot``'s class count was a graph node and the pass raised a TypeError, are replayed by
    ``tests/fuzz/findings/generated/capacity_symbolic_classes.py`` in the slow findings test.)"""
    class IntegerCapacity(CapacityMoE):
        def capacity(self, tokens):  # ceil(1.25 * T * K / E) in integers, as the fuzzer writes it: a symbol
            return (5 * tokens * self.top_k + 4 * self.num_experts - 1) // (4 * self.num_experts)

    model = IntegerCapacity(style="gshard", seed=int(torch.randint(0, 2**16, ())))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="moe_compile", dynamic=True)
    ref_model = copy.deepcopy(model).float()
    with report.collecting() as rep, torch._inductor.config.patch(force_disable_caches=True), torch.no_grad():
        for tokens in (24, 27):  # the second compiles with a symbolic token count
            x = torch.randn(tokens, 16).to(torch.bfloat16)
            got, eager, ref = compiled(x), model(x), ref_model(x.float())
            ok, worst, _ = tol.within_eager_bound({"out": got}, {"out": eager}, {"out": ref}, always_judged=("out",))
            assert ok, (tokens, worst)
    torch._dynamo.reset()
    assert not rep.errors, rep.table()
    skips = [r.what for r in rep.records if r.pass_name == "capacity_dispatch" and r.kind == "skip"]
    assert "symbolic_shape" in skips, rep.table()


@pytest.mark.parametrize("style", STYLES)
def test_dropped_fraction_reported_by_the_metrics(style):
    """With ``metrics=True`` (and validation on) the rewritten layer reports ``moe/dropped_fraction``: the fraction
    of its routed choices past the capacity, as eager's dispatch tensor drops them, averaged over the steps (GShard's
    top-k router, and DeepSpeed's top-2 by two ``argmax``)."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    # float32: in bf16 a token within rounding of a top-k tie is routed either way by any compile
    model = CapacityMoE(capacity_factor=0.75, style=style, dtype=torch.float32,
                        seed=int(torch.randint(0, 2**16, (), generator=gen)))
    xs = [torch.randn(48, 16, generator=gen) for _ in range(3)]
    got, rep = metrics_over_calls(model, xs, per_layer=True, validate=True)
    assert rep.count("capacity_dispatch") == 2, rep.table()
    # router_metrics is validated bitwise against the graph capacity_dispatch left, not the stage's first graph
    assert not [r for r in rep.records if r.what == "validation_failed"], rep.table()
    dropped = []
    for x in xs:
        logits = F.linear(x, model.router).float()
        route = model._gshard if style == "gshard" else model._deepspeed
        kept = float(route(logits, model.capacity(48))[0].sum())
        dropped.append(1 - kept / (48 * model.top_k))
    assert max(dropped) > 0, "nothing dropped: the metric is not exercised"
    assert got["moe/dropped_fraction"] == pytest.approx(sum(dropped) / len(dropped), abs=1e-6)
