"""Capacity-factor MoE layers (``tests/models/capacity_layers.py``): one training step (forward + backward) under eager
PyTorch, plain Inductor and moe_compile, whose ``capacity_dispatch`` turns the one-hot ``[T, E, C]`` einsums into
gathers of the routed rows.

The einsums cost ``2*T*E*C*H`` FLOPs each way (``C = capacity_factor * T * K / E``: quadratic in tokens), the experts
``2 * 2*E*C*H*I`` (linear); the row's ``dispatch_gflop`` and ``experts_gflop`` are the forward's, so the floor
the rewrite aims at is the experts' alone. Variants are timed in interleaved rounds (the machine may be shared); on
CUDA the GPU kernel time of the step is read from the profiler too.

    python -m benchmarks.bench_capacity [--quick] [--save]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import moe_compile  # noqa: F401 - registers the backend
from benchmarks._bench_env import add_results_args, device_env, results_path, sync, write_results
from moe_compile import report
from tests.models.capacity_layers import CapacityMoE

VARIANTS = ("eager", "inductor", "moe_compile")


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
        shapes = [(256, 128, 8)] if args.quick else [(256, 128, 8), (512, 128, 8), (1024, 128, 8)]
    else:
        shapes = [(2048, 1024, 16)] if args.quick else [(2048, 1024, 16), (4096, 1024, 16), (8192, 1024, 16)]
    rows = []
    for T, H, E in shapes:
        for style in ("gshard", "deepspeed"):
            model = CapacityMoE(hidden=H, inter=2 * H, num_experts=E, top_k=2, capacity_factor=1.25, style=style,
                                dtype=dtype, seed=0).to(device)
            C = model.capacity(T)
            x = torch.randn(T, H, device=device, dtype=dtype, requires_grad=True)
            g = torch.randn(T, H, device=device, dtype=dtype)
            fns, rewrites = {}, {}
            for variant in VARIANTS:
                torch._dynamo.reset()
                m = copy.deepcopy(model)
                fn = m if variant == "eager" else torch.compile(m, backend=variant, fullgraph=True)
                # caches off: a cache hit would run the rewritten code without the passes, and record nothing
                with report.collecting() as rep, torch._inductor.config.patch(force_disable_caches=True):
                    _step(m, fn, x, g)  # compiles
                rewrites[variant] = sum(r.kind == "rewrite" and r.pass_name == "capacity_dispatch"
                                        for r in rep.records)
                fns[variant] = (m, fn)
            times: dict[str, list[float]] = {v: [] for v in VARIANTS}
            for _ in range(args.rounds):
                for variant, (m, fn) in fns.items():
                    _step(m, fn, x, g)
                    sync(device)
                    start = time.perf_counter()
                    for _ in range(3):
                        _step(m, fn, x, g)
                    sync(device)
                    times[variant].append((time.perf_counter() - start) / 3 * 1e3)
            for variant, (m, fn) in fns.items():
                rows.append({"style": style, "T": T, "H": H, "E": E, "K": 2, "C": C, "dtype": str(dtype),
                             "variant": variant, "step_ms": statistics.median(times[variant]),
                             "kernel_ms": _kernel_ms(m, fn, x, g), "rewrites": rewrites[variant],
                             "dispatch_gflop": 2 * 2 * T * E * C * H / 1e9,
                             "experts_gflop": 2 * 2 * E * C * H * 2 * H / 1e9})
                print(f"{style} T={T} C={C} {variant}: {rows[-1]['step_ms']:.2f} ms "
                      f"(rewrites {rewrites[variant]})", flush=True)
            torch._dynamo.reset()
    env = device_env(threads=torch.get_num_threads() if device == "cpu" else None)
    if args.save:
        write_results(results_path(args, "capacity", "cpu" if device == "cpu" else None), rows, env)


if __name__ == "__main__":
    main()
