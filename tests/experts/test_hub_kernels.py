"""``experts/hub_kernels.py``: the ``kernels`` package's per-instance forward wrapper (transformers 5.25 wraps
attention with it) graph-breaks under activation checkpointing; ``moe_compile.compile`` gives idle instances their
original forward, so the checkpointed layer is compiled, with results equal to eager."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import moe_compile
from moe_compile.experts.hub_kernels import unwrap_idle_kernel_wrappers

kernels = pytest.importorskip("kernels")


@kernels.use_kernel_forward_from_hub("MoeCompileTestScaledTanh")
def scaled_tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * 1.5


@kernels.use_kernelized_func(scaled_tanh)
class Wrapped(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scaled_tanh(self.proj(x))


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Wrapped()
        self.out = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)
        return self.out(h)


def _step(model: nn.Module, fn, x: torch.Tensor) -> list[torch.Tensor]:
    for p in model.parameters():
        p.grad = None
    fn(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_idle_wrapper_is_unwrapped_and_computes_the_same():
    torch.manual_seed(torch.seed() % 2**31)
    a, b = Wrapped(), Wrapped()
    x = torch.randn(5, 16)
    want = a(x)
    assert type(a).forward.__wrapped__ is not type(a).forward
    assert unwrap_idle_kernel_wrappers(nn.ModuleDict({"a": a})) == ["a"]
    assert a.forward.__func__ is type(a).forward.__wrapped__ and "forward" not in b.__dict__
    assert torch.equal(a(x), want)
    assert unwrap_idle_kernel_wrappers(a) == []  # idempotent


def test_kernelized_instance_keeps_the_wrapper():
    """An instance whose hub function runs another forward (what ``kernels.kernelize`` sets) needs the wrapper to
    route to it: left as it is."""
    layer = Wrapped()
    (func,) = layer._kernel_funcs.values()
    func.forward = types.MethodType(lambda self, x: x * 3.0, func)
    assert unwrap_idle_kernel_wrappers(layer) == [] and "forward" not in layer.__dict__


def test_checkpointed_layer_is_compiled_whole():
    """The control: plain ``torch.compile`` graph-breaks at the wrapper's context-variable write inside the
    checkpoint; through ``moe_compile.compile`` nothing breaks, and the loss gradients equal eager's within the
    float32 rounding of GEMMs over K = 16 summed in another order (rtol 1e-5, about 10 K u with u = 2^-24)."""
    torch.manual_seed(torch.seed() % 2**31)
    model = Checkpointed()
    x = torch.randn(6, 16)
    want = _step(model, model, x)

    torch._dynamo.reset()
    counters.clear()
    _step(model, torch.compile(model, backend="eager"), x)
    assert sum(counters["graph_break"].values()) > 0, "the wrapper no longer breaks the graph: retire the workaround"

    torch._dynamo.reset()
    counters.clear()
    got = _step(model, moe_compile.compile(model, fullgraph=True), x)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
