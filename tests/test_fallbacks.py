"""Loud fallbacks (NOTE [loud fallbacks] (moe_compile/fallbacks.py)): an MoE layer that plain
``torch.compile(..., backend="moe_compile")`` leaves to eager, whole (Dynamo skips the frame) or in pieces (graph
breaks at host reads), warns once with the host read, where it is and the fix; ``moe_compile.compile`` on the same
layer and models without experts do not warn."""

from __future__ import annotations

import linecache
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moe_compile
from moe_compile import fallbacks
from moe_compile.fallbacks import FallbackWarning
from tests._subprocess import run_python
from tests.passes._harness import fresh_cache


class LoopLayer(nn.Module):
    """``for e in range(E): idx = torch.nonzero(top_ids == e)``: a graph break inside a loop, which makes Dynamo skip
    the frame without the capture flags."""

    def __init__(self, hidden: int = 16, inter: int = 24, num_experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, inter), nn.GELU(), nn.Linear(inter, hidden)) for _ in range(num_experts)
        )

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        probs_TK, top_ids = torch.topk(F.softmax(self.router(x_TH), dim=-1), self.top_k)
        out = torch.zeros_like(x_TH)
        for e in range(self.num_experts):
            idx = torch.nonzero(top_ids == e)
            tok, k = idx[:, 0], idx[:, 1]
            out.index_add_(0, tok, self.experts[e](x_TH[tok]) * probs_TK[tok, k, None])
        return out


class Block(nn.Module):
    """Projections around a loop layer: Dynamo compiles the block in pieces around the layer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.moe, self.out = nn.Linear(16, 16), LoopLayer(), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.moe(self.inp(x).relu()) + x)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@pytest.fixture(autouse=True)
def fresh():
    torch._dynamo.reset()
    fallbacks.install()  # torch._dynamo.reset() clears Dynamo's compile callbacks; a process gets them at import
    fallbacks.reset()
    with fresh_cache():
        yield
    torch._dynamo.reset()
    fallbacks.reset()


def _calls(compiled, model, tokens: list[int]) -> list[warnings.WarningMessage]:
    """Call ``compiled`` on fresh inputs of each size (a recompile when it changes), check it against ``model``, and
    return the FallbackWarnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in tokens:
            x = torch.randn(t, 16)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    return [w for w in caught if issubclass(w.category, FallbackWarning)]


def _tokens() -> list[int]:
    t = int(torch.randint(4, 12, ()))
    return [t, t, t + 3]


def test_skipped_loop_layer_warns_once_with_the_fix():
    """Plain torch.compile: Dynamo skips the loop layer's frame (graph break at nonzero inside the loop), no graph
    reaches the backend; one warning names the layer, the host read, its line and both fixes."""
    layer = LoopLayer()
    found = _calls(torch.compile(layer, backend="moe_compile"), layer, _tokens())
    assert len(found) == 1, [str(w.message) for w in found]
    message = str(found[0].message)
    assert "LoopLayer" in message and "nonzero" in message and "skipped" in message, message
    assert "idx = torch.nonzero(top_ids == e)" in message and "test_fallbacks.py" in message, message
    assert "moe_compile.compile(model)" in message and "fullgraph=True" in message, message
    _at_the_host_read(found[0])


def _at_the_host_read(found: warnings.WarningMessage) -> None:
    """The warning's location is the user's line with the host read (Python prints that line's code under it), not
    moe_compile's own code."""
    assert found.filename == __file__, found.filename
    assert "torch.nonzero(top_ids == e)" in linecache.getline(found.filename, found.lineno), found.lineno


def test_layer_compiled_in_pieces_warns_once():
    """The loop layer inside a block: Dynamo compiles the block up to the layer and resumes after it (a graph
    break with a host-read reason reaches the backend); one warning for the layer's experts, not one per piece."""
    block = Block()
    found = _calls(torch.compile(block, backend="moe_compile"), block, _tokens())
    assert len(found) == 1, [str(w.message) for w in found]
    assert "moe.experts" in str(found[0].message) and "nonzero" in str(found[0].message)
    _at_the_host_read(found[0])


def test_no_warning_under_moe_compile_compile():
    """``moe_compile.compile`` captures the host reads (and swaps the loop): the same layers reach one graph."""
    for model in (LoopLayer(), Block()):
        torch._dynamo.reset()
        found = _calls(moe_compile.compile(model), model, _tokens()[:1])
        assert found == [], [str(w.message) for w in found]


def test_no_warning_with_fullgraph_or_without_experts():
    layer, mlp = LoopLayer(), MLP()
    assert _calls(torch.compile(layer, backend="moe_compile", fullgraph=True), layer, _tokens()[:1]) == []
    torch._dynamo.reset()
    assert _calls(torch.compile(mlp, backend="moe_compile"), mlp, _tokens()[:1]) == []


def test_fresh_process_warns_without_any_setup():
    """What a user sees: ``import moe_compile``, plain torch.compile of the loop layer, two calls: one warning on
    stderr; the outputs equal eager's."""
    proc = run_python("""
        import torch
        import moe_compile
        from tests.test_fallbacks import LoopLayer

        layer = LoopLayer()
        compiled = torch.compile(layer, backend="moe_compile")
        for _ in range(2):
            x = torch.randn(int(torch.randint(4, 12, ())), 16)
            torch.testing.assert_close(compiled(x), layer(x), rtol=1e-5, atol=1e-5)
    """, env_update={"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("FallbackWarning") == 1, proc.stderr[-3000:]
    assert "Dynamo skipped the frame of LoopLayer" in proc.stderr
    assert "moe_compile/fallbacks.py" not in proc.stderr, proc.stderr  # shown at the user's line, with its code
    assert "test_fallbacks.py" in proc.stderr.split("FallbackWarning")[0], proc.stderr
