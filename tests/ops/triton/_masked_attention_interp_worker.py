"""Runs the ``moe.masked_attention`` Triton kernels through their launchers on CPU tensors under ``TRITON_INTERPRET=1``.

Started in a fresh interpreter by ``test_masked_attention_kernels.py``. Prints one JSON line: ``{case name: "ok" |
traceback}``. ``CASES`` is plain data so the parent can import it cheaply.

Each case: the output and the three gradients against an fp64 run of the reference, within the suite's bound of
eager's own distance (torch's SDPA in the case's dtype, NOTE [derived tolerances] (tests/_tolerance.py)); ``stats``
against the reference's; two more runs bitwise equal.
"""

from __future__ import annotations

# name: (B, H, Hkv, M, N, Dk, Dv, dtype name, mask kind)
CASES = {
    "fp32_bool_gqa": (2, 4, 2, 37, 45, 24, 16, "float32", "bool"),
    "bf16_causal_2d_mask": (2, 2, 2, 33, 33, 16, 16, "bfloat16", "causal_2d"),
    "bf16_float_mask_mqa": (1, 4, 1, 20, 36, 32, 32, "bfloat16", "float"),
    "fp16_mla_head_dims": (1, 2, 2, 24, 24, 48, 32, "float16", "bool"),
    "fp32_mask_per_head": (2, 2, 1, 16, 20, 16, 16, "float32", "per_head"),
    # finfo.min instead of -inf, and rows of nothing else:
    # NOTE [large finite mask values] (moe_compile/ops/triton/masked_attention.py)
    "fp32_finfo_min_rows": (1, 2, 2, 18, 18, 16, 16, "float32", "finfo_min"),
    "bf16_finfo_min_rows": (1, 2, 1, 18, 18, 16, 16, "bfloat16", "finfo_min"),
}
EXTRA_CASES = ("rows_with_nothing_allowed",)
BLOCKS = (16, 16, 4)


def _inputs(B, H, Hkv, M, N, Dk, Dv, dtype, kind, seed):
    import torch

    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, M, H, Dk, generator=gen).to(dtype).transpose(1, 2)  # SDPA's strided layout
    k = torch.randn(B, Hkv, N, Dk, generator=gen).to(dtype)
    v = torch.randn(B, Hkv, N, Dv, generator=gen).to(dtype)
    if kind == "causal_2d":
        mask = torch.ones(M, N, dtype=torch.bool).tril()
    elif kind == "float":
        mask = torch.randn(B, 1, M, N, generator=gen).to(dtype)
        mask[torch.rand(B, 1, M, N, generator=gen) > 0.6] = float("-inf")
        mask[..., 0] = 0.0  # every row allows a key
    elif kind == "finfo_min":
        mask = torch.zeros(B, 1, M, N, dtype=dtype).masked_fill(torch.rand(B, 1, M, N, generator=gen) > 0.5,
                                                                torch.finfo(dtype).min)
        mask[:, :, 2] = torch.finfo(dtype).min
    elif kind == "per_head":
        mask = torch.rand(B, H, M, N, generator=gen) > 0.4
        mask[..., -1] = True
    else:
        mask = torch.rand(B, 1, M, N, generator=gen) > 0.5
        mask[..., 1] = True
    grad = torch.randn(B, H, M, Dv, generator=gen).to(dtype)
    return q, k, v, mask, grad


def _sdpa_step(q, k, v, mask, grad, dtype):
    """Torch's SDPA in ``dtype`` (eager), or fp64 for the reference: ``{out, dq, dk, dv}``. A float mask's values that
    overflow in the log2 domain are ``-inf`` first, the rule of the CUDA kernel the op replaces (CPU SDPA's flash kernel
    has another one): NOTE [large finite mask values] (moe_compile/ops/triton/masked_attention.py)."""
    import torch
    import torch.nn.functional as F

    from moe_compile.ops.masked_attention import allowed_by

    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    m = mask if mask.dtype == torch.bool else mask.masked_fill(~allowed_by(mask), float("-inf")).to(dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.3, enable_gqa=True)
    out.backward(grad.to(dtype))
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _kernel_step(ma, q, k, v, mask, grad):
    out, stats = ma.launch_forward(q, k, v, mask, 0.3, blocks=BLOCKS)
    dq, dk, dv = ma.launch_backward(grad, q, k, v, mask, out, stats, 0.3, blocks_dq=BLOCKS, blocks_dkdv=BLOCKS)
    return {"out": out, "dq": dq, "dk": dk, "dv": dv}, stats


def _run_case(B, H, Hkv, M, N, Dk, Dv, dtype_name, kind, seed):
    import importlib

    import torch

    from tests import _tolerance as tol

    ma = importlib.import_module("moe_compile.ops.masked_attention")
    dtype = getattr(torch, dtype_name)
    q, k, v, mask, grad = _inputs(B, H, Hkv, M, N, Dk, Dv, dtype, kind, seed)
    got, stats = _kernel_step(ma, q, k, v, mask, grad)
    ref = _sdpa_step(q, k, v, mask, grad, torch.float64)
    eager = _sdpa_step(q, k, v, mask, grad, dtype)
    assert got["out"].stride() == eager["out"].stride() or got["out"].transpose(1, 2).is_contiguous()
    ok, worst, unjudged = tol.within_eager_bound(got, eager, ref, dtype=dtype, always_judged=tuple(ref))
    assert ok and not unjudged, (worst, [(r.name, r.compiled, r.bound) for r in tol.eager_bound_errors(
        got, eager, ref, dtype=dtype)])
    m = mask if mask.dtype == torch.bool else mask.double()
    _, want_stats = ma.masked_attention_reference(q.double(), k.double(), v.double(), m, 0.3)
    # the log-sum-exp m + log2(l) (log2 domain; +inf in rows that allow nothing, on both sides): each score's fp32
    # dot of Dk terms, against |q| @ |k|^T, then a few fp32 roundings
    lse, want_lse = stats[0].double() + stats[1].double(), want_stats[0].double() + want_stats[1].double()
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    lse, want_lse = lse.nan_to_num(posinf=0.0), want_lse.nan_to_num(posinf=0.0)
    mag = 0.3 * ma.LOG2E * tol.abs_matmul(q, ma._grouped(k, H).transpose(-1, -2)).amax(-1)
    bound = 2 * tol.gamma(Dk) * mag + 8 * tol.unit_roundoff(torch.float32) * want_lse.abs()
    tol.assert_within(lse, want_lse, bound, "m + log2(l)")
    for _ in range(2):  # run to run: bitwise
        again, again_stats = _kernel_step(ma, q, k, v, mask, grad)
        assert all(torch.equal(again[name], got[name]) for name in got) and torch.equal(again_stats, stats)


def _run_rows_with_nothing_allowed():
    """A query row whose mask is all False: output 0 and no gradient from it, exactly (SDPA's rule)."""
    import importlib

    import torch

    ma = importlib.import_module("moe_compile.ops.masked_attention")
    q, k, v, mask, grad = _inputs(1, 2, 2, 20, 20, 16, 16, torch.float32, "bool", seed=7)
    mask[0, 0, 3] = False
    mask[0, 0, 17] = False
    got, stats = _kernel_step(ma, q, k, v, mask, grad)
    assert torch.equal(got["out"][:, :, [3, 17]], torch.zeros_like(got["out"][:, :, [3, 17]]))
    assert torch.equal(got["dq"][:, :, [3, 17]], torch.zeros_like(got["dq"][:, :, [3, 17]]))
    assert bool(torch.isinf(stats[1][:, :, [3, 17]]).all()) and bool(torch.isfinite(stats[1][:, :, :3]).all())
    # the other rows as the reference, and the keys get nothing from the empty rows
    grad_only_empty = torch.zeros_like(grad)
    grad_only_empty[:, :, [3, 17]] = grad[:, :, [3, 17]]
    empty, _ = _kernel_step(ma, q, k, v, mask, grad_only_empty)
    assert not empty["dk"].any() and not empty["dv"].any() and not empty["dq"].any()


def main() -> None:
    import json
    import os

    from tests.ops.triton._interp import run_cases

    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    torch.set_num_threads(1)
    from moe_compile.ops.triton import masked_attention

    results = {"_interpreted": isinstance(masked_attention._masked_attention_fwd_kernel, InterpretedFunction)}
    jobs = [(n, lambda c=c, n=n: _run_case(*c, seed=sum(map(ord, n)))) for n, c in CASES.items()]
    jobs += [("rows_with_nothing_allowed", _run_rows_with_nothing_allowed)]
    print(json.dumps(run_cases(jobs, results)))


if __name__ == "__main__":
    main()
