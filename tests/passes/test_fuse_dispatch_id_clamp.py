"""fuse_dispatch and sentinel-id handling: transformers 5.17 clamps the sorted ids and masks rows of ids >= E.

Under expert parallelism those ids exist (sentinels for experts on other ranks); otherwise the router's top-k
over E scores keeps every id in [0, E) and the clamp and the masks change nothing. The rewrite accepts them
only in the second case, which it proves from the graph.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_compile.report import collecting
from tests import _tolerance as tol
from tests.passes._harness import passes_then_aot_eager

T, H, I, E, K = 12, 16, 32, 8, 2  # noqa: E741


def _hf_like_experts(x_TH, scores_TE, gate_up_EIH, down_EHI, clamp_max, sentinel=None, ids_TK=None):
    """A top-K router and transformers' grouped_mm experts; ``sentinel`` adds 5.17's masks of rows with ids
    ``>= sentinel``; ``ids_TK`` replaces the router's ids (then nothing bounds them)."""
    w_TK, routed_TK = torch.topk(scores_TE.softmax(-1), K, dim=-1)
    ids_TK = routed_TK if ids_TK is None else ids_TK
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


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).requires_grad_(True)
    scores = torch.randn(T, E, generator=g)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * 0.1).to(torch.bfloat16)
    down = (torch.randn(E, H, I, generator=g) * 0.1).to(torch.bfloat16)
    return x, scores, gate_up, down


def _compile_and_run(*args, **kwargs):
    """Passes + AOTAutograd (eager kernels): returns (out, grad of x, report, the rewritten Dynamo graph)."""
    graphs = []
    backend = passes_then_aot_eager()

    def capture(gm, example_inputs):
        compiled = backend(gm, example_inputs)
        graphs.append(gm.graph)
        return compiled

    torch._dynamo.reset()
    with collecting() as report:
        out = torch.compile(_hf_like_experts, backend=capture, fullgraph=True)(*args, **kwargs)
    (grad,) = torch.autograd.grad(out.float().square().sum(), args[0])
    return out, grad, report, graphs[0]


def _assert_matches_eager(out, grad, *args, **kwargs):
    expected = _hf_like_experts(*args, **kwargs)
    (grad_expected,) = torch.autograd.grad(expected.float().square().sum(), args[0])
    k_dims = tol.gemm_k_dims([a for a in args[2:4]])  # gate_up [E, I, H], down [E, H, I]
    tol.assert_layer_close(out, expected, k_dims, what="output")
    tol.assert_layer_close(grad, grad_expected, k_dims, backward=True, rows=args[0].shape[0], what="dX")


@pytest.mark.parametrize("clamp_max, rewrites", [(7, 1), (100, 1), (5, 0)])
def test_noop_clamp_of_sorted_ids_is_accepted(clamp_max, rewrites):
    args = (*_inputs(), clamp_max)
    out, grad, report, _ = _compile_and_run(*args)
    assert report.count("fuse_dispatch") == rewrites, report.table()
    if rewrites == 0:
        assert any(r.what == "expert_ids_mutated" for r in report.skips), report.table()
    _assert_matches_eager(out, grad, *args)


@pytest.mark.parametrize("sentinel, dropped", [(8, 3), (9, 3), (6, 0)])
def test_sentinel_masks_of_valid_ids_are_dropped(sentinel, dropped):
    """``ids >= E`` is all False for ids in [0, E): the fills and the sort go; ``ids >= 6`` must stay."""
    args = (*_inputs(1), E - 1, sentinel)
    out, grad, report, graph = _compile_and_run(*args)
    assert report.count("fuse_dispatch") == 1, report.table()
    assert report.rewrites[0].detail.endswith(f"{dropped} sentinel masked_fill dropped") == bool(dropped)
    names = [str(n.target) for n in graph.nodes]
    assert sum("masked_fill" in t for t in names) == (0 if dropped else 3), names
    assert any("sort" in t for t in names) == (not dropped), "\n".join(names)
    _assert_matches_eager(out, grad, *args)


@pytest.mark.parametrize("sentinel", [None, 8])
def test_sentinel_handling_of_unbounded_ids_is_left_alone(sentinel):
    """Ids that do not come from a top-k over E scores may hold sentinels (>= E): no rewrite, same values."""
    x, scores, gate_up, down = _inputs(2)
    g = torch.Generator().manual_seed(3)
    ids = torch.rand(T, E, generator=g).argsort(1)[:, :K]
    ids[::3, 0] = E  # sentinels, as an expert-parallel router leaves them
    args = (x, scores, gate_up, down, E - 1, sentinel)
    out, grad, report, graph = _compile_and_run(*args, ids_TK=ids)
    assert report.count("fuse_dispatch") == 0, report.table()
    assert [r.what for r in report.skips] == ["expert_ids_unbounded"], report.table()
    assert not any("permute_pad" in str(n.target) for n in graph.nodes)
    _assert_matches_eager(out, grad, *args, ids_TK=ids)
