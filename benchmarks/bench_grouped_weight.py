"""Benchmark weight-only MXFP8 / NVFP4 grouped GEMMs against bf16 ``torch._grouped_mm`` on one GPU.

Qwen3-MoE-like experts: E=128, H=2048, I=768, top-8, uniform routing; T tokens give M = 8T rows.
Per T, both expert GEMMs are timed and summed: gate_up ``[M, 2048] x [128, 1536, 2048]^T`` and
down ``[M, 768] x [128, 2048, 768]^T``. Implementations:

* ``bf16``: ``torch._grouped_mm`` on bf16 weights (CUTLASS on sm90; plain Inductor emits the same
  extern call for this op, so it is also the "Inductor" baseline);
* ``<fmt>_dequant``: dequantise the whole weight, then ``torch._grouped_mm`` (what an emulated
  quantised path does; ``--inductor`` also times it under ``torch.compile``);
* ``mxfp8`` / ``nvfp4``: our Triton weight-only kernels (``moe::grouped_mm_mxfp8/_nvfp4``);
* ``<fmt>_family``: the persistent expert-GEMM family with the same weights (``moe::expert_gemm_mxfp8/_nvfp4``,
  no epilogue);
* ``<fmt>_shipped``: ``torch._grouped_mm`` on a ``GroupedQuantWeight``: what moe_compile runs (the subclass picks
  one of the two per shape);
* ``floor``: (weight bytes of the experts that received rows + activation bytes) / measured copy
  bandwidth, per format.

Timing: every implementation is captured in a CUDA graph (``do_bench_cudagraph``), so the times are
GPU time, not Python launch overhead (an eager ``wrap_triton`` launch costs far more than a decode
GEMM). Each timed call runs the GEMMs for ``ROUTINGS`` different random routings in a row, so at
small T consecutive calls read different experts' weights (as consecutive layers would) instead of
re-reading the same few experts from L2; the time is per routing.

Columns: time, speedup vs bf16, weight memory (both GEMMs), relative error of the output vs the bf16
weights (quantisation error) and vs dequantise-then-bf16 (kernel error: for NVFP4 the reference's bf16 rounding
of each weight, which the kernel does not do; NOTE [NVFP4 decode] (moe_compile/ops/triton/grouped_mm.py)), time / floor.
Targets at T <= 64: mxfp8 >= 1.8x and nvfp4 >= 3x faster than bf16.

Usage, from the repository root: ``python -m benchmarks.bench_grouped_weight [--save] [--quick] [--sweep]
[--inductor]`` (``--save`` writes ``benchmarks/results/grouped_weight.json``). ``--sweep`` also times a grid of tile
configs per shape and prints the best (slow: one Triton compile per config).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys

import torch

from benchmarks._bench_env import add_results_args, copy_bandwidth, device_env, results_path, write_results

E, H, I, TOPK = 128, 2048, 768, 8  # noqa: E741 - I: expert intermediate size
TOKENS = (1, 16, 64, 256, 1024, 4096)
TARGETS = {"mxfp8": 1.8, "nvfp4": 3.0}
ROUTINGS = 8


@dataclasses.dataclass(frozen=True)
class Result:
    T: int
    impl: str
    time_us: float
    speedup_vs_bf16: float
    weight_MB: float
    rel_err_vs_bf16: float
    rel_err_vs_dequant: float
    floor_us: float
    x_floor: float
    config: str = ""


def routing(T: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """Uniform top-8 of 128 per token -> (int32 cumulative offsets, experts that got rows)."""
    ids = torch.rand(T, E, generator=gen).argsort(1)[:, :TOPK]
    counts = torch.bincount(ids.flatten(), minlength=E)
    return torch.cumsum(counts, 0).to(torch.int32).cuda(), int((counts > 0).sum())


def rel_err(y: torch.Tensor, ref: torch.Tensor, rows: int) -> float:
    y, ref = y[:rows].float(), ref[:rows].float()
    return float((y - ref).norm() / ref.norm().clamp_min(1e-30))


def make_weights(gen: torch.Generator):
    from moe_compile.experts.grouped_weight import quantize_stored

    weights = {}
    for name, (n, k) in {"gate_up": (2 * I, H), "down": (H, I)}.items():
        w = (torch.randn(E, n, k, generator=gen) * k**-0.5).to(torch.bfloat16).cuda()
        weights[name] = {"bf16": (w,), "mxfp8": quantize_stored(w, "mxfp8")[:2], "nvfp4": quantize_stored(w, "nvfp4")}
    return weights


def weight_bytes(tensors: tuple[torch.Tensor, ...]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def sweep_configs(M: int) -> list[dict]:
    """Decode-kernel tiles (few rows per expert) or tiled-kernel tiles (prefill)."""
    rows = M / E
    configs = []
    if rows <= 16:
        for bm in (16, 32) if rows > 4 else (16,):
            for bn, bk in ((32, 128), (32, 256), (64, 64), (64, 128), (128, 64)):
                for swap in (True, False):
                    for split in (1, 2, 4) if rows <= 1 else (1,):
                        configs.append(dict(KERNEL="decode", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split,
                                            SWAP_AB=swap, num_warps=4, num_stages=3))  # fmt: skip
        return configs
    for bm, bn, bk, warps, stages in (
        (128, 128, 64, 8, 3),
        (128, 128, 64, 4, 4),
        (64, 128, 64, 4, 4),
        (128, 64, 64, 4, 4),
    ):
        configs.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages))
    return configs


def run_experiment(T: int, weights: dict, bw: float, args, gen: torch.Generator) -> list[Result]:
    from triton.testing import do_bench_cudagraph

    from moe_compile.experts.grouped_weight import GroupedQuantWeight
    from moe_compile.ops import grouped_mm as gmm

    routings = [routing(T, gen) for _ in range(ROUTINGS)]
    offs_list = [o for o, _ in routings]
    offs, active = offs_list[0], sum(a for _, a in routings) / ROUTINGS
    M = T * TOPK
    xs = {"gate_up": torch.randn(M, H, generator=gen).to(torch.bfloat16).cuda(),
          "down": torch.randn(M, I, generator=gen).to(torch.bfloat16).cuda()}  # fmt: skip
    dequant = {"mxfp8": lambda q, s: gmm.dequantize_mxfp8(q, s, torch.bfloat16),
               "nvfp4": lambda q, s, g: gmm.dequantize_nvfp4(q, s, g, torch.bfloat16)}  # fmt: skip
    fns: dict[str, dict] = {"bf16": {}, "mxfp8": {}, "nvfp4": {}, "mxfp8_dequant": {}, "nvfp4_dequant": {}}
    def dequant_then_mm(x, o, *w, f):
        return torch._grouped_mm(x, dequant[f](*w).transpose(-2, -1), offs=o)

    compiled_dequant = {f: torch.compile(functools.partial(dequant_then_mm, f=f)) for f in ("mxfp8", "nvfp4")}
    for g, x in xs.items():
        w = weights[g]
        fns["bf16"][g] = lambda o, x=x, w=w: torch._grouped_mm(x, w["bf16"][0].transpose(-2, -1), offs=o)
        fns["mxfp8"][g] = lambda o, x=x, w=w: torch.ops.moe.grouped_mm_mxfp8(x, *w["mxfp8"], o)
        fns["nvfp4"][g] = lambda o, x=x, w=w: torch.ops.moe.grouped_mm_nvfp4(x, *w["nvfp4"], o)
        fns.setdefault("mxfp8_family", {})[g] = lambda o, x=x, w=w: torch.ops.moe.expert_gemm_mxfp8(
            x, *w["mxfp8"], o, None, None, "none", x.shape[0], False)[0]
        fns.setdefault("nvfp4_family", {})[g] = lambda o, x=x, w=w: torch.ops.moe.expert_gemm_nvfp4(
            x, *w["nvfp4"], o, None, None, "none", x.shape[0], False)[0]
        for f in ("mxfp8", "nvfp4"):
            sub = GroupedQuantWeight.from_qdata_and_scale(*w[f][:2], f, expert_scale=w[f][2] if f == "nvfp4" else None)
            fns.setdefault(f"{f}_shipped", {})[g] = lambda o, x=x, sub=sub: torch._grouped_mm(
                x, sub.transpose(-2, -1), offs=o
            )
            fns[f"{f}_dequant"][g] = lambda o, x=x, w=w, f=f: dequant_then_mm(x, o, *w[f], f=f)
            if args.inductor:
                fns.setdefault(f"{f}_dequant_inductor", {})[g] = lambda o, x=x, w=w, f=f: compiled_dequant[f](
                    x, o, *w[f]
                )

    rows = int(offs[-1])
    ref = {g: fns["bf16"][g](offs) for g in xs}
    results = []
    bf16_time = None

    def all_routings(fn):
        return lambda: [fn(o) for o in offs_list]

    for impl, per_gemm in fns.items():
        fmt = impl.split("_")[0]
        rep = 20 if args.quick else 50
        time_us = sum(do_bench_cudagraph(all_routings(fn), rep=rep) for fn in per_gemm.values()) * 1e3 / ROUTINGS
        bf16_time = time_us if impl == "bf16" else bf16_time
        outs = {g: fn(offs) for g, fn in per_gemm.items()}
        deq_ref = {g: fns[f"{fmt}_dequant"][g](offs) for g in xs} if fmt != "bf16" else ref
        err_bf16 = max(rel_err(outs[g], ref[g], rows) for g in xs)
        err_deq = max(rel_err(outs[g], deq_ref[g], rows) for g in xs)
        wbytes = sum(weight_bytes(weights[g][fmt]) for g in xs)
        moved = wbytes * active / E + sum(x.numel() * x.element_size() for x in xs.values()) + M * (2 * I + H) * 2
        floor_us = moved / bw * 1e6
        speedup = bf16_time / time_us
        results.append(Result(T, impl, time_us, speedup, wbytes / 1e6, err_bf16, err_deq, floor_us, time_us / floor_us))
    if args.sweep:
        for fmt in ("mxfp8", "nvfp4"):
            best = sweep(T, fmt, xs, weights, offs, bf16_time, results, bw)
            results.extend([best] if best is not None else [])
    return results


def sweep(T, fmt, xs, weights, offs, bf16_time, results, bw) -> Result | None:
    """Best tile config per GEMM, timed on one routing (the same experts each replay: L2-warm at small T)."""
    from triton.testing import do_bench_cudagraph

    from moe_compile.ops import grouped_mm as gmm

    total, chosen = 0.0, []
    for g, x in xs.items():
        w = weights[g][fmt]
        scale, gscale = w[1], (w[2] if fmt == "nvfp4" else None)
        out = x.new_empty(x.shape[0], w[0].shape[1])
        best = (float("inf"), None)
        for cfg in sweep_configs(x.shape[0]):
            try:
                launch = functools.partial(gmm.launch_grouped_mm, x, w[0], scale, gscale, offs, out, fmt, config=cfg)
                t = do_bench_cudagraph(launch, rep=10)
            except Exception:  # noqa: BLE001 - e.g. out of shared memory for this tile
                continue
            best = min(best, (t, cfg), key=lambda b: b[0])
        if best[1] is None:
            return None
        total += best[0] * 1e3
        chosen.append(f"{g}:{best[1]}")
    base = next(r for r in results if r.impl == fmt)
    return dataclasses.replace(base, impl=f"{fmt}_best", time_us=total, speedup_vs_bf16=bf16_time / total,
                               x_floor=total / base.floor_us, config=" ".join(chosen))  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_results_args(parser)
    parser.add_argument("--quick", action="store_true", help="T in {1, 64, 4096}, fewer repetitions")
    parser.add_argument("--sweep", action="store_true", help="also time a grid of tile configs (slow)")
    parser.add_argument("--inductor", action="store_true", help="also time torch.compile(dequant + grouped mm)")
    args, _ = parser.parse_known_args()
    if not torch.cuda.is_available():
        print("bench_grouped_weight: no CUDA device, nothing to run")
        return 0
    import moe_compile.ops.grouped_mm  # noqa: F401  (registers the ops)

    gen = torch.Generator().manual_seed(0)
    bw = copy_bandwidth()
    weights = make_weights(gen)
    results = []
    for T in (1, 64, 4096) if args.quick else TOKENS:
        results.extend(run_experiment(T, weights, bw, args, gen))
    summary = [
        {"T": r.T, "impl": r.impl, "us": round(r.time_us, 1), "x_vs_bf16": round(r.speedup_vs_bf16, 2),
         "weight_MB": round(r.weight_MB, 1), "err_vs_bf16": f"{r.rel_err_vs_bf16:.3g}",
         "err_vs_deq": f"{r.rel_err_vs_dequant:.2g}", "x_floor": round(r.x_floor, 2)}
        for r in results
    ]  # fmt: skip
    targets = {
        f"{fmt}_T{T}": next(r.speedup_vs_bf16 for r in results if r.T == T and r.impl == fmt) >= goal
        for fmt, goal in TARGETS.items()
        for T in sorted({r.T for r in results if r.T <= 64})
    }
    env = device_env(copy_bandwidth_GBps=round(bw / 1e9, 1), shape=dict(E=E, H=H, I=I, top_k=TOPK),
                     targets_met=targets)
    if args.save:
        write_results(results_path(args, "grouped_weight"), [dataclasses.asdict(r) for r in results], env)
    for r in results:
        if r.config:
            print(f"T={r.T} {r.impl}: {r.config}")
    print(f"device={env['device']} torch={env['torch']} triton={env['triton']} copy={env['copy_bandwidth_GBps']} GB/s")
    print(f"targets (T<=64: mxfp8 >= 1.8x, nvfp4 >= 3x vs bf16): {targets}")
    keys = list(summary[0].keys())
    widths = [max(len(k), *(len(str(r[k])) for r in summary)) for k in keys]
    print("  ".join(k.ljust(w) for k, w in zip(keys, widths)))
    for row in summary:
        print("  ".join(str(row[k]).ljust(w) for k, w in zip(keys, widths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
