"""GPU: ``moe.masked_attention``'s Triton kernels at real sizes against torch's SDPA, eager and compiled.

Qwen3-MoE's attention (32 query heads over 4 key/value heads, head dim 128) and MLA head dims (192 / 128), bf16,
1024 tokens: a causal mask with left padding, and a ``finfo.min`` additive mask. Output and gradients within eager's
own distance from fp32 SDPA as transformers calls it (memory-efficient attention;
NOTE [derived tolerances] (tests/_tolerance.py)), the mask's zeros exactly zero; the backward bitwise equal run to
run, eager and compiled.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_compile.ops import masked_attention as ma
from tests import _tolerance as tol

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SHAPES = {"gqa": (2, 32, 4, 1024, 128, 128), "mla": (1, 8, 8, 1024, 192, 128)}


def _inputs(shape, mask_kind, seed):
    B, H, Hkv, S, Dk, Dv = SHAPES[shape]
    gen = torch.Generator("cuda").manual_seed(seed)
    q = torch.randn(B, S, H, Dk, device="cuda", generator=gen).bfloat16().transpose(1, 2)
    k = torch.randn(B, S, Hkv, Dk, device="cuda", generator=gen).bfloat16().transpose(1, 2)
    v = torch.randn(B, S, Hkv, Dv, device="cuda", generator=gen).bfloat16().transpose(1, 2)
    keep = torch.ones(B, S, dtype=torch.bool, device="cuda")
    keep[-1, : S // 10] = False
    allowed = torch.ones(S, S, dtype=torch.bool, device="cuda").tril()[None, None] & keep[:, None, None, :]
    if mask_kind == "bool":
        mask = allowed
    else:  # transformers' older additive form: rows of padding queries hold only finfo.min
        mask = torch.zeros(allowed.shape, dtype=torch.bfloat16, device="cuda").masked_fill(
            ~allowed, torch.finfo(torch.bfloat16).min)
    grad = torch.randn(B, H, S, Dv, device="cuda", generator=gen).bfloat16()
    return q, k, v, mask, grad


def _step(fn, q, k, v, mask, grad, dtype=None):
    q, k, v = (t.detach().to(dtype or t.dtype).requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, mask if mask.dtype == torch.bool or dtype is None else mask.to(dtype))
    out.backward(grad.to(out.dtype))
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _sdpa(q, k, v, mask):
    """SDPA as transformers calls it with a mask: key/value heads repeated (no ``enable_gqa``, which would send a
    masked call to the math backend), so the memory-efficient kernel runs."""
    groups = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                          attn_mask=mask)


def _structural_zeros(mask, kv_heads):
    """What the mask alone makes zero: the output and ``dq`` of query rows that allow nothing, ``dk`` and ``dv`` of keys
    that no query of the group allows."""
    allowed = mask if mask.dtype == torch.bool else ma.allowed_by(mask)
    rows = ~allowed.any(-1)  # [B, 1, M]
    cols = ~allowed.any(-2)  # [B, 1, N]
    return rows[..., None], cols[..., None].expand(-1, kv_heads, -1, 1)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("mask_kind", ["bool", "finfo_min"])
def test_matches_sdpa_and_is_reproducible(shape, mask_kind):
    q, k, v, mask, grad = _inputs(shape, mask_kind, seed=len(shape) + len(mask_kind))
    got = _step(ma.masked_attention, q, k, v, mask, grad)
    eager = _step(_sdpa, q, k, v, mask, grad)
    ref = _step(_sdpa, q, k, v, mask, grad, torch.float32)
    # judged by the bound of eager's own error; exact zeros are the mask's (a query row that attends to one key has a
    # dq of zero only by cancellation, exactly so in some kernels and not in others)
    rows = tol.eager_bound_errors(got, {n: t.clone() for n, t in eager.items()}, ref)
    assert all(r.compiled <= r.bound for r in rows), [(r.name, r.compiled, r.eager, r.bound) for r in rows]
    empty_rows, unread_keys = _structural_zeros(mask, k.shape[1])
    assert not got["out"].masked_select(empty_rows).any() and not got["dq"].masked_select(empty_rows).any()
    assert not got["dk"].masked_select(unread_keys).any() and not got["dv"].masked_select(unread_keys).any()
    again = _step(ma.masked_attention, q, k, v, mask, grad)
    assert all(torch.equal(got[n], again[n]) for n in got)


def test_compiled_launch_is_reproducible_and_within_the_bound():
    """Inductor compiles the kernels with its own options (fp contraction), so its bits may differ from the eager
    launch's; each is reproducible, and both within the bound."""
    q, k, v, mask, grad = _inputs("gqa", "bool", seed=3)
    compiled = torch.compile(lambda a, b, c, m: ma.masked_attention(a, b, c, m), fullgraph=True)
    got, again = _step(compiled, q, k, v, mask, grad), _step(compiled, q, k, v, mask, grad)
    assert all(torch.equal(got[n], again[n]) for n in got)
    eager, ref = _step(_sdpa, q, k, v, mask, grad), _step(_sdpa, q, k, v, mask, grad, torch.float32)
    rows = tol.eager_bound_errors(got, eager, ref)
    assert all(r.compiled <= r.bound for r in rows), [(r.name, r.compiled, r.eager, r.bound) for r in rows]
