"""``drop_and_pad``: Megatron's drop-and-pad dispatch (gathers and a ``scatter_add_`` combine at argsort slots)
becomes fixed-order gathers and sums."""

from __future__ import annotations

import copy

import pytest
import torch

from moe_compile import report
from tests import _tolerance as tol
from tests.models.capacity_layers import MegatronDropAndPadMoE
from tests.passes._harness import metrics_over_calls


def _step(seed: int, capacity_factor: float):
    gen = torch.Generator().manual_seed(seed)
    model = MegatronDropAndPadMoE(capacity_factor=capacity_factor, seed=int(torch.randint(0, 2**16, (), generator=gen)))
    x = torch.randn(2, 24, 16, generator=gen).to(torch.bfloat16)
    cot = torch.randn(2, 24, 16, generator=gen)
    return model, x, cot


def test_drop_and_pad_layer_rewritten_within_eager_bound():
    """A bf16 training step with tokens dropped at capacity (and experts padded with unrouted tokens): both gathers
    and the combine are rewritten, no accumulating scatter is left forward or backward, every tensor is as close to a
    float32 eager run as bf16 eager is, and a second compiled step on the same inputs is bitwise equal."""
    model, x, cot = _step(torch.seed() % 2**31, capacity_factor=0.75)
    ref_model = copy.deepcopy(model).float()
    eager = tol.layer_step(model, model, x, cot)
    ref = tol.layer_step(ref_model, ref_model, x, cot, torch.float32)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="moe_compile", fullgraph=True)
    with report.collecting() as rep, torch._inductor.config.patch(force_disable_caches=True):
        got = tol.layer_step(compiled, model, x, cot)
    again = tol.layer_step(compiled, model, x, cot)
    torch._dynamo.reset()
    done = [r.what for r in rep.records if r.pass_name == "drop_and_pad" and r.kind == "rewrite"]
    assert len(done) == 1 and done[0].count("gather index_select") == 2 and "combine scatter_add_" in done[0], \
        rep.table()
    assert not [r for r in rep.records if r.what == "validation_failed"], rep.table()
    assert rep.clean and rep.deterministic, rep.table()
    ok, worst, unjudged = tol.within_eager_bound(got, eager, ref, always_judged=("out",))
    assert ok and not unjudged, (worst, unjudged)
    assert all(torch.equal(got[k], again[k]) for k in got), "not bitwise reproducible"


def test_combine_buffer_read_before_the_combine_is_left_alone():
    """A zero buffer that something reads before the ``scatter_add_`` is not a fresh combine buffer: skipped with
    its tag, and the result is eager's."""

    class ReadsBuffer(MegatronDropAndPadMoE):
        def forward(self, x):
            T, H = x.shape
            slots = torch.ones(self.num_experts, T, dtype=torch.int8).argsort(dim=-1, descending=True,
                                                                               stable=True)[:, :2].reshape(-1)
            out = torch.zeros(T, H, dtype=x.dtype)
            peek = out.sum()
            out.scatter_add_(0, slots.unsqueeze(1).expand(-1, H), x.index_select(0, slots) * 2)
            return out + peek

    model = ReadsBuffer(hidden=8, inter=8, num_experts=2, top_k=1)
    x = torch.randn(6, 8, dtype=torch.bfloat16)
    torch._dynamo.reset()
    with report.collecting() as rep, torch._inductor.config.patch(force_disable_caches=True):  # the passes must run
        got = torch.compile(model, backend="moe_compile", fullgraph=True)(x)
    torch._dynamo.reset()
    assert any(r.pass_name == "drop_and_pad" and r.kind == "skip" and r.what == "combine_buffer_reused"
               for r in rep.records), rep.table()
    assert torch.equal(got, model(x))


def test_dropped_fraction_reported_by_the_metrics():
    """With ``metrics=True`` the rewritten layer reports ``moe/dropped_fraction``: the routed choices past each
    expert's capacity (eager's routing map keeps ``C`` of them), averaged over the steps."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    model = MegatronDropAndPadMoE(capacity_factor=0.75, dtype=torch.float32,
                                  seed=int(torch.randint(0, 2**16, (), generator=gen)))
    xs = [torch.randn(48, 16, generator=gen) for _ in range(3)]
    got, rep = metrics_over_calls(model, xs, per_layer=True)
    assert rep.count("drop_and_pad") == 1, rep.table()
    dropped = []
    for x in xs:
        ids = torch.nn.functional.linear(x, model.router).float().softmax(-1).topk(model.top_k, dim=-1).indices
        counts = torch.bincount(ids.flatten(), minlength=model.num_experts)
        dropped.append(float((counts - model.capacity(48)).clamp(min=0).sum()) / ids.numel())
    assert max(dropped) > 0, "nothing dropped: the metric is not exercised"
    assert got["moe/dropped_fraction"] == pytest.approx(sum(dropped) / len(dropped), abs=1e-6)


def test_dynamic_shapes_left_alone_with_a_tag():
    """A dynamic-shape compile (symbolic tokens and slots: the fuzzer's finding) is skipped as ``symbolic_shape``,
    not a pass error, and the result is eager's within its bound."""
    model, x, cot = _step(torch.seed() % 2**31, capacity_factor=1.0)
    ref_model = copy.deepcopy(model).float()
    eager = tol.layer_step(model, model, x, cot)
    ref = tol.layer_step(ref_model, ref_model, x, cot, torch.float32)
    torch._dynamo.reset()
    with report.collecting() as rep:
        got = tol.layer_step(torch.compile(model, backend="moe_compile", dynamic=True), model, x, cot)
    torch._dynamo.reset()
    assert not [r for r in rep.records if r.kind == "error"], rep.table()
    assert any(r.pass_name == "drop_and_pad" and r.kind == "skip" and r.what == "symbolic_shape"
               for r in rep.records), rep.table()
    ok, worst, unjudged = tol.within_eager_bound(got, eager, ref, always_judged=("out",))
    assert ok and not unjudged, (worst, unjudged)
