"""Per-expert gradients as views of one grouped gradient (``moe_compile/experts/_grad_views.py``), fresh or recycled."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moe_compile.experts import _storage_swap
from moe_compile.experts._grad_views import GradViews, _grad_python_refs, per_expert_views

E, N, K = 4, 3, 5
LAYOUTS = pytest.mark.parametrize("halves", [False, True], ids=["stacked", "gate_up_halves"])
MODES = pytest.mark.parametrize("recycle", [False, True], ids=["fresh", "recycled"])
needs_swap = pytest.mark.skipif(_grad_python_refs() is None, reason="this torch cannot swap storage data pointers")


@pytest.fixture(params=["torch", "shim"])
def swapper(request, monkeypatch):
    """Recycling through torch's ``_swap_data_ptr_`` and through
    NOTE [storage swap shim] (moe_compile/experts/_storage_swap.py) (what torch 2.11 uses)."""
    chosen = _storage_swap.torch_swapper() if request.param == "torch" else _storage_swap.shim_swapper()
    if chosen is None:
        pytest.skip(f"no {request.param} storage swap here")
    monkeypatch.setattr(_storage_swap, "storage_swapper", lambda: chosen)
    return request.param


DEVICES = pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])


def _grouped_params(halves: bool, recycle: bool, device: str = "cpu") -> tuple[list[nn.Parameter], torch.Tensor,
                                                                             GradViews]:
    """Per-expert parameters made views of one grouped leaf with :class:`GradViews` hooks, as
    ``experts/swap.py`` does."""
    params = [nn.Parameter(torch.randn(N, K, device=device)) for _ in range(2 * E if halves else E)]
    stacked = torch.stack([p.detach() for p in params])
    grouped = (torch.cat([stacked[:E], stacked[E:]], dim=1) if halves else stacked).requires_grad_(True)
    for p, view in zip(params, per_expert_views(grouped.detach(), halves)):
        assert torch.equal(view, p.detach())
        p.data = view
    return params, grouped, GradViews(grouped, params, halves, recycle)


def _backward(grouped: torch.Tensor, halves: bool) -> list[torch.Tensor]:
    """A backward with fresh random weights; returns each parameter's expected gradient."""
    c = torch.randn(grouped.shape, device=grouped.device)
    (grouped * c).sum().backward()
    return per_expert_views(c, halves)


def _reset(params: list[nn.Parameter], views: GradViews) -> None:
    """``zero_grad(set_to_none=True)``, then what ``moe_compile.compile`` runs before the next call."""
    for p in params:
        p.grad = None
    views.release()


@LAYOUTS
@MODES
def test_accumulate_reset_and_mixed(halves, recycle):
    """Per-expert grads stay views of one buffer: accumulation without zeroing sums, ``zero_grad`` in either mode
    restarts, and grads the user replaced or reset one by one are respected. ``halves``: the grouped leaf holds two
    parameters per expert (gate and up halves of ``[E, 2N, K]``)."""
    params, grouped, views = _grouped_params(halves, recycle)
    c1 = _backward(grouped, halves)
    for p, want in zip(params, c1):
        assert torch.equal(p.grad, want)
        assert p.grad._base is params[0].grad._base
    c2 = _backward(grouped, halves)  # accumulation: in place into the same buffer
    buffer = params[0].grad._base
    assert all(p.grad._base is buffer for p in params)
    assert all(torch.equal(p.grad, a + b) for p, a, b in zip(params, c1, c2))
    for p in params:  # zero_grad(set_to_none=False)
        p.grad.zero_()
    c3 = _backward(grouped, halves)
    assert all(torch.equal(p.grad, w) for p, w in zip(params, c3))
    _reset(params, views)
    c4 = _backward(grouped, halves)
    assert all(torch.equal(p.grad, w) for p, w in zip(params, c4))
    params[1].grad = None
    params[2].grad = torch.full(params[2].shape, 2.0)
    views.release()  # not every p.grad is None: nothing is freed
    c5 = _backward(grouped, halves)
    want = [a + b for a, b in zip(c4, c5)]
    want[1], want[2] = c5[1], 2.0 + c5[2]
    assert all(torch.equal(p.grad, w) for p, w in zip(params, want))
    assert grouped.grad is None


@needs_swap
@DEVICES
@LAYOUTS
def test_recycled_views_are_kept_and_their_memory_released(halves, device, swapper):
    """With recycling the same view objects come back every step with the new values; the memory under them is
    freed once every ``p.grad`` was reset, and is not while one is still set."""
    params, grouped, views = _grouped_params(halves, recycle=True, device=device)
    _backward(grouped, halves)
    kept = views.views  # the tuple: holding it holds no view a second time
    assert all(p.grad is v for p, v in zip(params, kept))
    for step in range(3):
        _reset(params, views)
        assert views.carrier.untyped_storage().nbytes() == 0, step
        want = _backward(grouped, halves)
        assert views.views is kept and all(p.grad is v for p, v in zip(params, kept)), step
        assert all(torch.equal(p.grad, w) for p, w in zip(params, want)), step
    params[0].grad = None
    views.release()
    assert views.carrier.untyped_storage().nbytes() == views.carrier.numel() * views.carrier.element_size()
    assert all(torch.equal(p.grad, w) for p, w in zip(params[1:], want[1:]))


@needs_swap
@DEVICES
@LAYOUTS
@pytest.mark.parametrize("hold", ["grad", "view_of_grad", "item_of_grad"])
@pytest.mark.parametrize("released", [True, False], ids=["released", "not_released"])
def test_recycling_leaves_held_gradients_alone(halves, hold, released, device, swapper):
    """A gradient the user still holds after ``zero_grad`` (the tensor, or one made from it) keeps its values
    through the next backward, as a fresh gradient would; the parameters get the new gradient."""
    params, grouped, views = _grouped_params(halves, recycle=True, device=device)
    _backward(grouped, halves)
    _reset(params, views)
    _backward(grouped, halves)  # now the recycled views
    held = {"grad": lambda g: g, "view_of_grad": lambda g: g.view(-1), "item_of_grad": lambda g: g[1]}[hold](
        params[E - 1].grad)
    kept = held.clone()
    for p in params:
        p.grad = None
    if released:
        views.release()
    want = _backward(grouped, halves)
    assert torch.equal(held, kept)
    assert all(torch.equal(p.grad, w) for p, w in zip(params, want))
    _reset(params, views)
    want = _backward(grouped, halves)
    assert torch.equal(held, kept)
    assert all(torch.equal(p.grad, w) for p, w in zip(params, want))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_cuda_training_hands_out_gradient_views():
    """A swapped bf16 loop block on CUDA under ``moe_compile.compile``: AdamW steps match the loop's; where torch
    can recycle gradient views, the same views come back every step and the first call after ``zero_grad`` gives
    their memory back."""
    import copy

    import moe_compile
    from tests.models.loop_models import make_loop_moe

    torch._dynamo.reset()
    hidden = 64
    block = make_loop_moe(seed=7, hidden=hidden, dtype=torch.bfloat16).cuda()
    eager = copy.deepcopy(block)
    compiled = moe_compile.compile(block)
    grad_views = block._moe_compile_views.grad_views
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (block, eager)]
    kept = None
    for step in range(3):
        x = torch.randn(8, 16, hidden, device="cuda", dtype=torch.bfloat16)
        for fn, opt in zip((compiled, eager), opts):
            opt.zero_grad()
            fn(x).float().square().mean().backward()
            if fn is compiled:
                grads = [p.grad.float() for p in block.parameters()]
            else:
                want = [p.grad.float() for p in eager.parameters()]
            opt.step()
        for g, w in zip(grads, want):  # bf16 sums over H and I terms in another order: a few roundings
            tol = 16 * torch.finfo(torch.bfloat16).eps * w.abs().max().clamp_min(1e-6)
            assert (g - w).abs().max() <= tol, step
        del grads, want
        if kept is not None and _grad_python_refs() is not None:
            assert all(v.views is k for v, k in zip(grad_views, kept)), step
        kept = [v.views for v in grad_views]
    if _grad_python_refs() is None:
        assert not any(v.recycle for v in grad_views)
        return
    held = sum(v.carrier.untyped_storage().nbytes() for v in grad_views)
    assert held > 0
    before = torch.cuda.memory_allocated()
    opts[0].zero_grad()
    with torch.no_grad():
        compiled(torch.randn(8, 16, hidden, device="cuda", dtype=torch.bfloat16))
    torch.cuda.synchronize()
    assert all(v.carrier.untyped_storage().nbytes() == 0 for v in grad_views)
    assert torch.cuda.memory_allocated() <= before - held
