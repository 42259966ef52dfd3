"""``moe.masked_attention`` on CPU: opcheck, the reference against torch's SDPA in fp64, rows the mask allows nothing
in, the output layout, compiled, and argument errors that name the argument. The Triton kernels are in
``triton/test_masked_attention_kernels.py``; on the GPU in ``test_masked_attention_gpu.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

from moe_compile.ops import masked_attention as ma
from tests import _tolerance as tol

OP = torch.ops.moe.masked_attention.default


def _inputs(B=2, H=4, Hkv=2, M=9, N=11, Dk=8, Dv=6, dtype=torch.float64, kind="bool", seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, M, H, Dk, generator=gen).to(dtype).transpose(1, 2)
    k = torch.randn(B, Hkv, N, Dk, generator=gen).to(dtype)
    v = torch.randn(B, Hkv, N, Dv, generator=gen).to(dtype)
    if kind == "bool":
        mask = torch.rand(B, 1, M, N, generator=gen) > 0.4
        mask[..., 0] = True
    else:
        mask = torch.randn(M, N, generator=gen).to(dtype)
        mask[torch.rand(M, N, generator=gen) > 0.7] = float("-inf")
        mask[:, 0] = 0.0
    return q, k, v, mask


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_reference_is_sdpa_in_fp64(kind):
    q, k, v, mask = _inputs(kind=kind, seed=1)
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    want = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=0.4, enable_gqa=True)
    grad = torch.randn_like(want)
    want.backward(grad)
    qa, ka, va = (t.detach().clone().requires_grad_() for t in (q, k, v))
    got = ma.masked_attention(qa, ka, va, mask, 0.4)
    got.backward(grad)
    # fp64 on both sides, two different summation orders: gamma of the longest sum (the key axis or the head dim)
    # times the magnitude of each result
    rel = 8 * tol.gamma(max(q.shape[-1], k.shape[2], q.shape[1]) * 4, torch.float64)
    for name, a, b in (("out", got, want), ("dq", qa.grad, qs.grad), ("dk", ka.grad, ks.grad),
                       ("dv", va.grad, vs.grad)):
        tol.assert_within(a, b, rel * (1 + b.abs().max().item()), name)


def test_opcheck_forward_and_backward():
    q, k, v, mask = _inputs(dtype=torch.float32, seed=2)
    for t in (q, k, v):
        t.requires_grad_()
    opcheck(OP, (q, k, v, mask, 0.35))
    out, lse = (t.detach() for t in OP(q, k, v, mask, 0.35))
    opcheck(torch.ops.moe.masked_attention_backward.default,
            (torch.randn(2, 4, 9, 6), q.detach(), k.detach(), v.detach(), mask, out, lse, 0.35), {})


def test_gradcheck_fp64():
    q, k, v, mask = _inputs(B=1, H=2, Hkv=1, M=4, N=5, Dk=3, Dv=2, seed=3)
    inputs = tuple(t.detach().clone().requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(lambda a, b, c: ma.masked_attention(a, b, c, mask, 0.5), inputs)


def test_rows_with_nothing_allowed_are_exactly_zero():
    q, k, v, mask = _inputs(dtype=torch.float32, seed=4)
    mask[1, 0, 2] = False
    qa, ka, va = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = ma.masked_attention(qa, ka, va, mask)
    grad = torch.zeros_like(out)
    grad[1, :, 2] = 1.0
    out.backward(grad)
    assert not out[1, :, 2].any() and bool(out[0].abs().sum() > 0)
    assert not qa.grad.any() and not ka.grad.any() and not va.grad.any()


def test_output_has_sdpa_layout():
    q, k, v, mask = _inputs(dtype=torch.bfloat16, seed=5)
    out = ma.masked_attention(q, k, v, mask)
    assert out.shape == (2, 4, 9, 6) and out.dtype == torch.bfloat16 and out.transpose(1, 2).is_contiguous()


def test_compiled_matches_eager_bitwise_on_cpu():
    """The CPU kernel is the reference traced into the graph:
    NOTE [device-decomposed triton ops] (moe_compile/ops/_common.py)."""
    q, k, v, mask = _inputs(dtype=torch.float32, seed=6)
    fn = torch.compile(lambda a, b, c, m: ma.masked_attention(a, b, c, m) * 2, backend="aot_eager", fullgraph=True)
    assert torch.equal(fn(q, k, v, mask), ma.masked_attention(q, k, v, mask) * 2)


@pytest.mark.parametrize("change,message", [
    (lambda q, k, v, m, s: (q[0], k, v, m, s), "query must be 4-D"),
    (lambda q, k, v, m, s: (q, k.half(), v, m, s), "one dtype"),
    (lambda q, k, v, m, s: (q, k[:, :, :, :4], v, m, s), "key must have query's head dim"),
    (lambda q, k, v, m, s: (q, torch.cat([k, k, k], 1), torch.cat([v, v, v], 1), m, s), "dividing query's 4"),
    (lambda q, k, v, m, s: (q, k, v[:, :, :3], m, s), "the same length"),
    (lambda q, k, v, m, s: (q, k, v, m[..., :3], s), "does not broadcast"),
    (lambda q, k, v, m, s: (q, k, v, m.int(), s), "mask must be bool or floating point"),
    (lambda q, k, v, m, s: (q, k, v, m, -1.0), "scale must be a finite float > 0"),
    (lambda q, k, v, m, s: (q, k, v, m, float("nan")), "scale must be a finite float > 0"),
])
def test_bad_arguments_name_the_argument(change, message):
    q, k, v, mask = _inputs(dtype=torch.float32, seed=7)
    with pytest.raises(ValueError, match=message):
        ma.masked_attention(*change(q, k, v, mask, 0.3))


def test_mask_requiring_grad_is_refused():
    q, k, v, _ = _inputs(dtype=torch.float32, seed=8)
    with pytest.raises(ValueError, match="mask must not require grad"):
        ma.masked_attention(q, k, v, torch.zeros(9, 11, requires_grad=True))
