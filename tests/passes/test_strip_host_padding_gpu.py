"""GPU: host-padded MoE layers compiled with ``mode="reduce-overhead"`` are captured in CUDA graphs.

Strict settings (compiler-mechanics note, 7.2): ``graph_partition=False`` (whole-graph checks) and
``triton.cudagraph_or_error=True`` (any cudagraph skip raises instead of silently running eagerly).
Every step uses new activations, so the routing, the per-expert counts and the padding change on
replay; outputs (and grads) are compared with eager after each step.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

import moe_compile
from tests.models.host_padded import make_layer
from tests.passes._host_padding_checks import fresh_caches

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

T, H, I, E, K, ALIGN = 24, 64, 128, 8, 2, 16  # noqa: E741 - I: expert intermediate size
TOLS = dict(atol=3e-2, rtol=3e-2)
STRICT = {"graph_partition": False, "triton.cudagraph_or_error": True}


def _layer(kind: str) -> torch.nn.Module:
    return make_layer(kind, hidden=H, inter=I, num_experts=E, top_k=K, align=ALIGN, device="cuda")


def _recorded_graphs() -> int:
    from torch._inductor.cudagraph_trees import get_manager

    manager = get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    return 0 if manager is None else manager.new_graph_id().id


def _compile(model: torch.nn.Module, path: str):
    if path == "api":
        return moe_compile.compile(model, mode="reduce-overhead")
    return torch.compile(model, backend="moe_compile", mode="reduce-overhead", fullgraph=True)


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize(
    "kind,path", [("split_pad", "api"), ("split_pad", "backend"), ("masked_select", "api"), ("loop", "api"),
                  ("sort_histc_pad", "backend")]
)
def test_forward_is_captured_and_replayed(kind, path):
    model = _layer(kind)
    with torch._inductor.config.patch(STRICT), fresh_caches(), torch.no_grad():
        compiled = _compile(model, path)
        for step in range(4):  # warm-up, record, replays with new routing
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            torch.compiler.cudagraph_mark_step_begin()
            out = compiled(x).clone()
            torch.testing.assert_close(out.float(), model(x).float(), **TOLS, msg=f"step {step}")
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert _recorded_graphs() >= 1


@pytest.mark.parametrize("kind", ["split_pad", "masked_select", "loop", "sort_histc_pad"])
def test_training_step_is_captured_and_replayed(kind):
    model = _layer(kind)
    eager = copy.deepcopy(model)
    with torch._inductor.config.patch(STRICT), fresh_caches():
        compiled = _compile(model, "api")
        for step in range(4):
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            cot = torch.randn(T, H, device="cuda", dtype=torch.float32)
            model.zero_grad(set_to_none=True)
            eager.zero_grad(set_to_none=True)
            torch.compiler.cudagraph_mark_step_begin()
            x_c = x.clone().requires_grad_(True)
            out = compiled(x_c)
            (out.float() * cot).sum().backward()
            x_e = x.clone().requires_grad_(True)
            want = eager(x_e)
            (want.float() * cot).sum().backward()
            torch.testing.assert_close(out.detach().float(), want.detach().float(), **TOLS, msg=f"step {step}")
            grads = [("x", x_c.grad, x_e.grad)] + [
                (name, p.grad, q.grad)
                for (name, p), q in zip(model.named_parameters(), eager.parameters())
                if q.grad is not None
            ]
            for name, got, ref in grads:
                scale = ref.float().abs().max().clamp_min(1e-3)
                torch.testing.assert_close(got.float() / scale, ref.float() / scale, **TOLS, msg=f"{name} step {step}")
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert _recorded_graphs() >= 2  # forward and backward


def test_strict_capture_fails_without_the_pass():
    """The strict settings do reject a host-padded graph: the checks above can fail."""
    model = _layer("split_pad")
    with torch._inductor.config.patch(STRICT), fresh_caches(), torch.no_grad():
        compiled = moe_compile.compile(model, mode="reduce-overhead", passes={"strip_host_padding": False})
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        with pytest.raises(Exception, match="cudagraph"):
            for _ in range(3):
                torch.compiler.cudagraph_mark_step_begin()
                compiled(x)
