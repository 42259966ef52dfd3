"""Attention under a mask tensor, forward + backward: ``moe.masked_attention`` against torch's SDPA, on the GPU.

What ``deterministic=True`` runs where a mask reaches SDPA (a padding mask, a window, every layer under FSDP2):
before ``moe.masked_attention``, SDPA's memory-efficient attention with torch's deterministic flag on. Side by side in
one run, per mask: SDPA with the mask (memory-efficient, its default atomic dQ), the same with the deterministic flag,
``moe.masked_attention`` (eager launch, and compiled by Inductor), and SDPA flash with ``is_causal=True`` (no mask
tensor: the fast floor for a causal mask). The FLOP floor is the causal FLOPs (forward 2 GEMMs, backward 5 over
the allowed half) at the card's bf16 dense peak.

Columns: fwd+bwd median ms (CUDA events around the pair, after warmup), the error against fp32 SDPA next to the bf16
SDPA's own (max abs over out / dq / dk / dv), and whether two backward runs are bitwise equal.

    python -m benchmarks.bench_attention --save
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn.functional as F

from benchmarks import _bench_env
from moe_compile.ops import masked_attention as ma

# Qwen3-MoE's attention (H 2048: 32 query heads, 4 key/value heads, head dim 128) and DeepSeek-V3's MLA (16 heads in
# the 2-layer model, q/k 192, v 128), batch 2 x 2048 tokens
SHAPES = {
    "qwen3_moe": dict(B=2, H=32, Hkv=4, S=2048, Dk=128, Dv=128),
    "mla": dict(B=2, H=16, Hkv=16, S=2048, Dk=192, Dv=128),
}
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0}


def _inputs(B, H, Hkv, S, Dk, Dv, mask_kind, gen):
    q = torch.randn(B, S, H, Dk, device="cuda", generator=gen, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(B, S, Hkv, Dk, device="cuda", generator=gen, dtype=torch.bfloat16).transpose(1, 2)
    v = torch.randn(B, S, Hkv, Dv, device="cuda", generator=gen, dtype=torch.bfloat16).transpose(1, 2)
    causal = torch.ones(S, S, dtype=torch.bool, device="cuda").tril()
    if mask_kind == "causal_padded":  # left padding of 100 tokens in the second sequence
        keep = torch.ones(B, S, dtype=torch.bool, device="cuda")
        keep[1, :100] = False
        mask = causal[None, None] & keep[:, None, None, :]
    else:
        mask = causal[None, None].expand(B, 1, S, S).contiguous()
    mask[:, :, torch.arange(S, device="cuda"), torch.arange(S, device="cuda")] = True  # every row allows a key
    return q, k, v, mask, torch.randn(B, H, S, Dv, device="cuda", generator=gen, dtype=torch.bfloat16)


def _sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def _variants(mask):
    compiled = torch.compile(lambda q, k, v, m: ma.masked_attention(q, k, v, m), fullgraph=True)

    @contextlib.contextmanager
    def deterministic():  # as moe_compile's deterministic_attention calls the backward: the flag on, not warn_only
        before = torch.are_deterministic_algorithms_enabled()
        warn = torch.is_deterministic_algorithms_warn_only_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(before, warn_only=warn)

    return {
        "sdpa_masked": (lambda q, k, v: _sdpa(q, k, v, mask), contextlib.nullcontext),
        "sdpa_masked_deterministic": (lambda q, k, v: _sdpa(q, k, v, mask), deterministic),
        "moe_masked_attention": (lambda q, k, v: ma.masked_attention(q, k, v, mask), contextlib.nullcontext),
        "moe_masked_attention_compiled": (lambda q, k, v: compiled(q, k, v, mask), contextlib.nullcontext),
        "sdpa_flash_is_causal": (lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1]), contextlib.nullcontext),
    }


def _step(fn, q, k, v, grad, backward_ctx=contextlib.nullcontext):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    with backward_ctx():
        out.backward(grad)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _time_ms(fn, q, k, v, grad, backward_ctx=contextlib.nullcontext, reps: int = 20) -> float:
    for _ in range(3):
        _step(fn, q, k, v, grad, backward_ctx)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _step(fn, q, k, v, grad, backward_ctx)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def run(shape: str, mask_kind: str) -> list[dict]:
    dims = SHAPES[shape]
    gen = torch.Generator("cuda").manual_seed(0)
    q, k, v, mask, grad = _inputs(**dims, mask_kind=mask_kind, gen=gen)
    ref = _step(lambda a, b, c: _sdpa(a.float(), b.float(), c.float(), mask), q, k, v, grad.float())
    B, H, S, Dk, Dv = dims["B"], dims["H"], dims["S"], dims["Dk"], dims["Dv"]
    # the allowed half of the scores: forward q k^T and p v, backward q k^T again, dp, dv, dq, dk
    flops = B * H * (S * S / 2) * 2 * (4 * Dk + 3 * Dv)
    peak = next((p for name, p in PEAK_BF16_TFLOPS.items() if name in torch.cuda.get_device_name()), None)
    rows, eager_err = [], None
    for variant, (fn, ctx) in _variants(mask).items():
        if variant == "sdpa_flash_is_causal" and (mask_kind != "causal" or Dk != Dv):
            continue
        ms = _time_ms(fn, q, k, v, grad, ctx)
        a, b = _step(fn, q, k, v, grad, ctx), _step(fn, q, k, v, grad, ctx)
        err = max((a[n].float() - ref[n]).abs().max().item() for n in ref)
        if variant == "sdpa_masked":
            eager_err = err
        rows.append({
            "shape": shape, "mask": mask_kind, "variant": variant, "ms": ms,
            "tflops": flops / (ms * 1e-3) / 1e12, "floor_ms": flops / (peak * 1e12) * 1e3 if peak else None,
            "max_err_vs_fp32": err, "sdpa_bf16_err_vs_fp32": eager_err,
            "bitwise_reproducible": all(torch.equal(a[n], b[n]) for n in a),
        })  # fmt: skip
        print(f"{shape:10s} {mask_kind:14s} {variant:32s} {ms:7.3f} ms  err {err:.3g}  "
              f"reproducible {rows[-1]['bitwise_reproducible']}")
    return rows


# launch plans tried by --sweep: (BLOCK_M, BLOCK_N, num_warps) per kernel
SWEEP = {
    "fwd": [(128, 64, 8), (128, 128, 8), (64, 64, 4), (128, 32, 4), (64, 128, 8)],
    "dq": [(64, 64, 8), (128, 32, 8), (128, 64, 8), (64, 32, 4), (128, 32, 4)],
    "dkdv": [(64, 64, 8), (32, 128, 8), (64, 128, 8), (32, 64, 4), (64, 32, 4), (128, 64, 8), (64, 64, 4)],
}


def sweep(shape: str) -> list[dict]:
    """Each kernel alone under each launch plan of :data:`SWEEP` (causal mask), median ms."""
    from triton.testing import do_bench

    dims = SHAPES[shape]
    q, k, v, mask, grad = _inputs(**dims, mask_kind="causal", gen=torch.Generator("cuda").manual_seed(0))
    scale = dims["Dk"] ** -0.5
    out, stats = ma.launch_forward(q, k, v, mask, scale)
    rows = []
    for kernel, plans in SWEEP.items():
        for plan in plans:
            if kernel == "fwd":
                call = lambda p=plan: ma.launch_forward(q, k, v, mask, scale, blocks=p)  # noqa: E731
            elif kernel == "dq":
                call = lambda p=plan: ma.launch_backward(grad, q, k, v, mask, out, stats, scale, blocks_dq=p)  # noqa: E731
            else:
                call = lambda p=plan: ma.launch_backward(grad, q, k, v, mask, out, stats, scale, blocks_dkdv=p)  # noqa: E731
            try:
                ms = do_bench(call, warmup=5, rep=30, return_mode="median")
            except Exception as exc:  # noqa: BLE001 - a plan that does not fit (shared memory) is reported, not fatal
                print(f"sweep {kernel} {plan}: {type(exc).__name__}")
                continue
            rows.append({"shape": shape, "mask": "causal", "variant": f"sweep_{kernel}", "plan": list(plan),
                         "ms": ms})
            print(f"sweep {shape} {kernel:5s} {plan}: {ms:.3f} ms")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--sweep", action="store_true", help="time each kernel under several launch plans first")
    _bench_env.add_results_args(parser)
    args = parser.parse_args()
    rows = []
    if args.sweep:
        rows += sweep("qwen3_moe")
    for shape in args.shapes.split(","):
        for mask_kind in ("causal", "causal_padded"):
            rows += run(shape, mask_kind)
    if args.save:
        _bench_env.write_results(_bench_env.results_path(args, "attention"), rows, _bench_env.device_env())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
