"""fuse_dispatch with an in-place clamp of the sorted expert ids (transformers 5.17's grouped_mm path)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import moe_compile
from moe_compile.report import collecting


def _hf_like_experts(x_TH, ids_TK, w_TK, gate_up_EIH, down_EHI, clamp_max, sentinel=None):
    """transformers' grouped_mm experts; ``sentinel`` adds 5.17's masks of rows with ids ``>= sentinel``."""
    T, K = ids_TK.shape
    E = gate_up_EIH.shape[0]
    ids_sorted, perm = torch.sort(ids_TK.reshape(-1))
    mask = (ids_sorted >= sentinel).unsqueeze(-1) if sentinel is not None else None
    ids_sorted.clamp_(max=clamp_max)
    x_g = x_TH[perm // K]
    w_g = w_TK.reshape(-1)[perm]
    counts = torch.histc(ids_sorted.float(), bins=E, min=0, max=E - 1)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    if mask is not None:
        x_g.masked_fill_(mask, 0.0)
    gate_up = torch._grouped_mm(x_g, gate_up_EIH.transpose(-2, -1), offs=offs)
    if mask is not None:
        gate_up = gate_up.masked_fill(mask, 0.0)
    gate, up = gate_up.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, down_EHI.transpose(-2, -1), offs=offs)
    if mask is not None:
        y = y.masked_fill(mask, 0.0)
    y = y * w_g.unsqueeze(-1).to(y.dtype)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return y[inv].view(T, K, -1).sum(1)


@pytest.mark.parametrize("clamp_max, rewrites", [(7, 1), (100, 1), (5, 0)])
def test_noop_clamp_of_sorted_ids_is_accepted(clamp_max, rewrites):
    torch.manual_seed(0)
    T, H, I, E, K = 12, 16, 32, 8, 2
    x = torch.randn(T, H, dtype=torch.bfloat16)
    ids = torch.rand(T, E).argsort(1)[:, :K]
    w = torch.rand(T, K).softmax(-1)
    gate_up = (torch.randn(E, 2 * I, H) * 0.1).to(torch.bfloat16)
    down = (torch.randn(E, H, I) * 0.1).to(torch.bfloat16)
    expected = _hf_like_experts(x, ids, w, gate_up, down, clamp_max)
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True), collecting() as report:
        got = torch.compile(_hf_like_experts, backend="moe_compile", fullgraph=True)(x, ids, w, gate_up, down, clamp_max)
    assert report.count("fuse_dispatch") == rewrites, report.table()
    if rewrites == 0:
        assert any(r.what == "expert_ids_mutated" for r in report.skips), report.table()
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)
    assert moe_compile is not None


@pytest.mark.parametrize("sentinel, dropped", [(8, 3), (9, 3), (6, 0)])
def test_sentinel_masks_of_valid_ids_are_dropped(sentinel, dropped):
    """``ids >= E`` is all False for ids in [0, E): the fills and the sort go; ``ids >= 6`` must stay."""
    from tests.passes._harness import passes_then_aot_eager

    torch.manual_seed(0)
    T, H, I, E, K = 12, 16, 32, 8, 2
    x = torch.randn(T, H, dtype=torch.bfloat16, requires_grad=True)
    ids = torch.rand(T, E).argsort(1)[:, :K]
    w = torch.rand(T, K).softmax(-1)
    gate_up = (torch.randn(E, 2 * I, H) * 0.1).to(torch.bfloat16)
    down = (torch.randn(E, H, I) * 0.1).to(torch.bfloat16)
    expected = _hf_like_experts(x, ids, w, gate_up, down, E - 1, sentinel)
    (gx_expected,) = torch.autograd.grad(expected.float().square().sum(), x)
    graphs = []
    backend = passes_then_aot_eager()

    def capture(gm, example_inputs):
        out = backend(gm, example_inputs)
        graphs.append(gm.graph)
        return out

    torch._dynamo.reset()
    with collecting() as report:
        got = torch.compile(_hf_like_experts, backend=capture, fullgraph=True)(x, ids, w, gate_up, down, E - 1, sentinel)
    (gx,) = torch.autograd.grad(got.float().square().sum(), x)
    assert report.count("fuse_dispatch") == 1, report.table()
    assert report.rewrites[0].detail.endswith(f"{dropped} sentinel masked_fill dropped") == bool(dropped)
    names = [str(n.target) for n in graphs[0].nodes]
    assert sum("masked_fill" in t for t in names) == (0 if dropped else 3), names
    assert any("sort" in t for t in names) == (not dropped), "\n".join(names)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gx.float(), gx_expected.float(), rtol=5e-2, atol=5e-2)
