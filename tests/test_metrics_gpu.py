"""Router metrics on CUDA: no host sync in eager hooks, and CUDA-graph capture with ``metrics=True``.

Strict capture (``graph_partition=False``, ``triton.cudagraph_or_error=True``): any cudagraph skip raises.
Each call of a cudagraph-tree function accumulates exactly once (warm-up runs eagerly; recording
captures then replays once; later calls replay), and ``collect`` zeroes the accumulators in place so
that replays after a reset keep writing to the captured addresses.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import moe_compile
from moe_compile import metrics
from tests.models.router_metrics_models import RoutedStack

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

KEYS = ("lb_loss", "z_loss", "entropy", "max_over_mean_load", "tokens")
STRICT = {"graph_partition": False, "triton.cudagraph_or_error": True}


@pytest.fixture(autouse=True)
def _fresh():
    metrics.forget()
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    metrics.forget()


def _inputs(n: int, T: int = 64, H: int = 16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(T, H, generator=g).cuda() for _ in range(n)]


def _oracle(xs: list[torch.Tensor], layers: int = 2) -> dict[str, float]:
    """Eager CUDA run of an identical model with hooks (same seed, same weights)."""
    twin = RoutedStack(layers=layers).cuda()
    metrics.attach(twin)
    with torch.no_grad():
        for x in xs:
            twin(x)
    metrics.detach(twin)
    return metrics.collect(per_layer=True)


def _assert_close(got: dict[str, float], want: dict[str, float], layers: int = 2) -> None:
    for i in range(layers):
        for key in KEYS:
            assert got[f"moe/layer_{i}/{key}"] == pytest.approx(want[f"moe/layer_{i}/{key}"], rel=2e-3), (i, key)
        total = sum(got[f"moe/layer_{i}/tokens_per_expert/{e}"] for e in range(4))
        assert total == pytest.approx(got[f"moe/layer_{i}/tokens"] * 2)  # every token routed to K=2 experts
        for e in range(4):  # a near-tie may flip one choice between compiled and eager logits
            key = f"moe/layer_{i}/tokens_per_expert/{e}"
            assert got[key] == pytest.approx(want[key], abs=1.0)


def test_eager_hooks_do_not_sync():
    model = RoutedStack().cuda()
    metrics.attach(model)
    xs = _inputs(3)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x in xs:
            model(x).square().mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    got = metrics.collect(per_layer=True)
    metrics.detach(model)
    assert got["moe/steps"] == 3
    _assert_close(got, _oracle(xs))


@pytest.mark.parametrize("train", [False, True])
def test_reduce_overhead_captures_with_metrics(train):
    xs = _inputs(6)
    want_first, want_last = _oracle(xs[:4]), _oracle(xs[4:])
    model = RoutedStack().cuda()
    with torch._inductor.config.patch(STRICT):
        compiled = moe_compile.compile(model, metrics=True, mode="reduce-overhead", fullgraph=True)
        for i, x in enumerate(xs):
            torch.compiler.cudagraph_mark_step_begin()
            if train:
                # as an optimizer's zero_grad would: .grad from the last replay lives in the graph pool
                model.zero_grad(set_to_none=True)
                compiled(x).square().mean().backward()
            else:
                with torch.no_grad():
                    compiled(x)
            if i == 3:  # after warm-up, record and one replay: one accumulation per call
                first = metrics.collect(per_layer=True)
        last = metrics.collect(per_layer=True)  # two replays after an in-place reset
    assert counters["inductor"]["cudagraph_skips"] == 0
    manager = torch._inductor.cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    assert manager is not None and manager.new_graph_id().id >= 1
    assert first["moe/steps"] == 4 and last["moe/steps"] == 2
    _assert_close(first, want_first)
    _assert_close(last, want_last)


def test_attach_and_compile_under_cuda_graphs_counts_once():
    xs = _inputs(4)
    want = _oracle(xs)
    model = RoutedStack().cuda()
    metrics.attach(model)  # the hooks are traced into the graph; the pass adds nothing
    with torch._inductor.config.patch(STRICT), torch.no_grad():
        compiled = moe_compile.compile(model, metrics=True, mode="reduce-overhead", fullgraph=True)
        for x in xs:
            torch.compiler.cudagraph_mark_step_begin()
            compiled(x)
    got = metrics.collect(per_layer=True)
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert got["moe/steps"] == 4
    _assert_close(got, want)
