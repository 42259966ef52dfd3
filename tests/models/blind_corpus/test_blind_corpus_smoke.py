"""Smoke test for the blind MoE corpus: every layer builds, runs forward + backward on CPU in fp32 and bf16,
keeps the input's shape and stays finite."""

from __future__ import annotations

import pytest
import torch

from tests.models.blind_corpus import LAYERS, STYLES

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    # the tensors are tiny: intra-op threads only add OpenMP spin-wait overhead (it dominates on a busy 2-core box)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def test_registry_is_well_formed():
    assert len(LAYERS) >= 32
    assert len({layer.name for layer in LAYERS}) == len(LAYERS)
    for layer in LAYERS:
        assert layer.style in STYLES
        assert layer.origin and layer.name == layer.name.lower()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("layer", LAYERS, ids=[layer.name for layer in LAYERS])
def test_forward_backward(layer, dtype):
    torch.manual_seed(0)
    module = layer.make(dtype, 0)
    params = [p for p in module.parameters() if p.requires_grad]
    assert params, "layer has no trainable parameters"
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(layer.input_shape, generator=gen).to(dtype).requires_grad_(True)

    out = module(x)
    if layer.returns_tuple:
        assert isinstance(out, tuple)
        out = out[0]
    assert isinstance(out, torch.Tensor)
    assert out.shape == x.shape
    assert out.dtype == dtype
    assert torch.isfinite(out.float()).all()

    probe = torch.randn(out.shape, generator=gen)
    (out.float() * probe).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad.float()).all()
    grads = [p.grad for p in params if p.grad is not None]
    assert grads, "no parameter received a gradient"
    assert all(torch.isfinite(g.float()).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)
