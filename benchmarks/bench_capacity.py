"""Capacity-factor and expert-choice MoE layers (``tests/models/capacity_layers.py``, ``expert_choice.py``): one
training step (forward + backward) under eager PyTorch, plain Inductor and moe_compile, whose ``capacity_dispatch``
turns the one-hot ``[T, E, C]`` einsums into gathers of the routed rows and ``expert_choice`` the expert-choice
combine into a fixed-order segment sum (capacity factor 2: ``E*C = 2T`` rows, the experts' FLOPs of top-2).

The einsums cost ``2*T*E*C*H`` FLOPs each way (``C = capacity_factor * T * K / E``: quadratic in tokens), the experts
``2 * 2*E*C*H*I`` (linear); the row's ``dispatch_gflop`` and ``experts_gflop`` are the forward's, so the floor
the rewrite aims at is the experts' alone (``experts_floor_ms``: their forward and backward FLOPs at this
device's measured dense matmul rate). ``dropless`` is the same router and experts on the sort path (grouped GEMMs
over the routed rows, nothing dropped): the issue's comparison, on CUDA only (float32 grouped GEMMs do not compile
on CPU). Variants are timed in interleaved rounds (the machine may be shared); on CUDA the GPU kernel time of the
step is read from the profiler too.

    python -m benchmarks.bench_capacity [--quick] [--save]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import moe_compile  # noqa: F401 - registers the backend
from benchmarks._bench_env import add_results_args, device_env, measured_mm_tflops, results_path, sync, write_results
from moe_compile import report
from tests.models.capacity_layers import CapacityMoE, DroplessSortMoE
from tests.models.expert_choice import ExpertChoiceMoE

VARIANTS = ("eager", "inductor", "moe_compile")
# "dropless": the same router and experts on the sort path (grouped GEMMs over the T*K routed rows, nothing dropped),
# the comparison for the rewritten capacity layer
# "expert_choice": each expert takes its top-C tokens (capacity factor 2: E*C = 2T rows, the experts' FLOPs of top-2)
STYLES = ("gshard", "deepspeed", "expert_choice", "dropless")
REWRITES = ("capacity_dispatch", "fuse_dispatch", "expert_choice")


class _TokensFirst(torch.nn.Module):
    """``[T, H]`` tokens into a layer that takes ``[B, S, H]`` (expert choice)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def capacity(self, tokens: int) -> int:
        return self.inner.capacity(tokens)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.unsqueeze(0)).squeeze(0)


def _layer(style: str, T: int, H: int, E: int, inter: int, dtype: torch.dtype) -> torch.nn.Module:
    if style == "expert_choice":
        torch.manual_seed(0)
        return _TokensFirst(ExpertChoiceMoE(hidden=H, ffn=inter, experts=E, capacity_factor=2.0).to(dtype))
    if style == "dropless":
        return DroplessSortMoE(hidden=H, inter=inter, num_experts=E, top_k=2, capacity_factor=1.25, dtype=dtype,
                               seed=0)
    return CapacityMoE(hidden=H, inter=inter, num_experts=E, top_k=2, capacity_factor=1.25, style=style, dtype=dtype,
                       seed=0)


def _step(model: torch.nn.Module, fn, x: torch.Tensor, g: torch.Tensor) -> None:
    for p in model.parameters():
        p.grad = None
    fn(x).backward(g)


def _kernel_ms(model, fn, x, g) -> float | None:
    if x.device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _step(model, fn, x, g)
        sync("cuda")
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="one small shape")
    parser.add_argument("--rounds", type=int, default=5)
    add_results_args(parser)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if device == "cpu":
        torch.set_num_threads(1)
        shapes = [(256, 128, 8, 256)] if args.quick else [(256, 128, 8, 256), (512, 128, 8, 256), (1024, 128, 8, 256)]
    else:  # (T, H, E, I): the targets, H 2048, E 64, fine-grained experts
        shapes = [(2048, 1024, 16, 512)] if args.quick else [(4096, 1024, 16, 512), (4096, 2048, 64, 1024),
                                                              (16384, 2048, 64, 1024)]
    rows = []
    tflops = measured_mm_tflops(device, dtype)
    for T, H, E, inter in shapes:
        for style in STYLES if device == "cuda" else STYLES[:2]:
            model = _layer(style, T, H, E, inter, dtype).to(device)
            C = model.capacity(T)
            x = torch.randn(T, H, device=device, dtype=dtype, requires_grad=True)
            g = torch.randn(T, H, device=device, dtype=dtype)
            fns, rewrites, failed = {}, {}, {}
            for variant in VARIANTS:
                torch._dynamo.reset()
                m = copy.deepcopy(model)
                fn = m if variant == "eager" else torch.compile(m, backend=variant, fullgraph=True)
                # caches off: a cache hit would run the rewritten code without the passes, and record nothing
                try:
                    with report.collecting() as rep, torch._inductor.config.patch(force_disable_caches=True):
                        _step(m, fn, x, g)  # compiles
                except torch.OutOfMemoryError as exc:  # eager's one-hot [T, E, C] tensors at the largest T
                    failed[variant] = f"out of memory: {str(exc).splitlines()[0][:160]}"
                    del m, fn
                    torch.cuda.empty_cache()
                    continue
                rewrites[variant] = sum(r.kind == "rewrite" and r.pass_name in REWRITES for r in rep.records)
                fns[variant] = (m, fn)
            times: dict[str, list[float]] = {v: [] for v in fns}
            for _ in range(args.rounds):
                for variant, (m, fn) in fns.items():
                    _step(m, fn, x, g)
                    sync(device)
                    start = time.perf_counter()
                    for _ in range(3):
                        _step(m, fn, x, g)
                    sync(device)
                    times[variant].append((time.perf_counter() - start) / 3 * 1e3)
            for variant in VARIANTS:
                row = {"style": style, "T": T, "H": H, "E": E, "I": inter, "K": 2, "C": C, "dtype": str(dtype),
                       "variant": variant,
                       "dispatch_gflop": 2 * 2 * T * E * C * H / 1e9 if style in ("gshard", "deepspeed") else 0,
                       "experts_gflop": 2 * 2 * (T * 2 if style == "dropless" else E * C) * H * inter / 1e9}
                # the floor: the experts' forward and backward GEMMs (3x the forward's FLOPs) at the dense rate
                row["experts_floor_ms"] = 3 * row["experts_gflop"] / tflops
                row["matmul_tflops"] = tflops
                if variant in failed:
                    row.update(step_ms=None, kernel_ms=None, rewrites=None, error=failed[variant])
                else:
                    m, fn = fns[variant]
                    row.update(step_ms=statistics.median(times[variant]), kernel_ms=_kernel_ms(m, fn, x, g),
                               rewrites=rewrites[variant])
                rows.append(row)
                print(f"{style} T={T} C={C} {variant}: " + (f"{row['step_ms']:.2f} ms (rewrites {row['rewrites']})"
                      if row["step_ms"] is not None else row["error"]), flush=True)
            del fns
            torch._dynamo.reset()
            if device == "cuda":
                torch.cuda.empty_cache()
    _print_targets(rows)
    env = device_env(threads=torch.get_num_threads() if device == "cpu" else None)
    if args.save:
        write_results(results_path(args, "capacity", "cpu" if device == "cpu" else None), rows, env)


def _print_targets(rows: list[dict]) -> None:
    """The issue's targets per T: moe_compile vs plain Inductor on the capacity layer, and vs the dropless sort path."""
    by = {(r["style"], r["T"], r["variant"]): r["step_ms"] for r in rows}
    for T in sorted({r["T"] for r in rows}):
        sort_ms = by.get(("dropless", T, "moe_compile"))
        for style in ("gshard", "deepspeed", "expert_choice"):
            ours, plain = by.get((style, T, "moe_compile")), by.get((style, T, "inductor"))
            if ours:
                print(f"target {style} T={T}: plain Inductor / moe_compile = "
                      f"{plain / ours if plain else float('nan'):.2f}x; moe_compile / dropless sort path = "
                      f"{ours / sort_ms if sort_ms else float('nan'):.2f}x", flush=True)


if __name__ == "__main__":
    main()
