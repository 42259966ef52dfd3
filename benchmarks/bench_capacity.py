"""Capacity-factor and expert-choice MoE layers (``tests/models/capacity_layers.py``, ``expert_choice.py``): one
training step (forward + backward) under eager PyTorch, plain Inductor and moe_compile, whose ``capacity_dispatch``
turns the one-hot ``[T, E, C]`` einsums into gathers of the routed rows and ``expert_choice`` the expert-choice
combine into a fixed-order segment sum (capacity factor 2: ``E*C = 2T`` rows, the experts' FLOPs of top-2).

The einsums cost ``2*T*E*C*H`` FLOPs each way (``C = capacity_factor * T * K / E``: quadratic in tokens), the experts
``2 * 2*E*C*H*I`` (linear); the row's ``dispatch_gflop`` and ``experts_gflop`` are the forward's, so the floor
the rewrite aims at is the experts' alone (``experts_floor_ms``: their forward and backward FLOPs at this
device's measured dense matmul rate). ``dropless`` is the same router and experts on the sort path (grouped GEMMs
over the routed rows, nothing dropped): the issue's comparison, on CUDA only (float32 grouped GEMMs do not compile
on CPU). ``skip_loop`` is the host loop with data-dependent skips (``tests/models/skip_loops.py``: counts read with
``.tolist()``, experts with no tokens skipped, ``y[tok] += ...``; stacked SwiGLU experts), compiled by
``moe_compile.compile`` (its swap) and by plain ``torch.compile`` (graph breaks at the host read); ``sort_swiglu`` is
the same gate and experts on the sort path, its comparison. Variants are timed in interleaved rounds (the machine may
be shared); on CUDA the GPU kernel time of the step and its number of kernels are read from the profiler, and
``host_ms`` is the time to issue one step (the host's share: where it is near ``step_ms`` the step is host-bound).

    python -m benchmarks.bench_capacity [--quick] [--save]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import moe_compile
from benchmarks._bench_env import (
    add_results_args,
    device_env,
    measured_mm_tflops,
    results_path,
    sync,
    timed_calls,
    write_results,
)
from moe_compile import report
from tests.models.capacity_layers import CapacityMoE, DroplessSortMoE
from tests.models.expert_choice import ExpertChoiceMoE
from tests.models.skip_loops import SkipLoopMoE, SortedSkipLoopMoE

VARIANTS = ("eager", "inductor", "moe_compile")
# the layers compared with the sort path are timed captured too (mode="reduce-overhead": no host launch cost)
GRAPHS = "moe_compile_graphs"
GRAPH_STYLES = ("expert_choice", "dropless", "skip_loop", "sort_swiglu")
# "dropless": the same router and experts on the sort path (grouped GEMMs over the T*K routed rows, nothing dropped),
# the comparison for the rewritten capacity layer
# "expert_choice": each expert takes its top-C tokens (capacity factor 2: E*C = 2T rows, the experts' FLOPs of top-2)
# "skip_loop" / "sort_swiglu": the host loop with data-dependent skips and the same experts on the sort path
STYLES = ("gshard", "deepspeed", "expert_choice", "dropless", "skip_loop", "sort_swiglu")
REWRITES = ("capacity_dispatch", "fuse_dispatch", "expert_choice", "swap_expert_loops")
# style -> the sort-path style it is compared with (the targets)
SORT_PATH = {"gshard": "dropless", "deepspeed": "dropless", "expert_choice": "dropless", "skip_loop": "sort_swiglu"}


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
    if style in ("skip_loop", "sort_swiglu"):
        cls = SkipLoopMoE if style == "skip_loop" else SortedSkipLoopMoE
        return cls(hidden=H, inter=inter, num_experts=E, top_k=2, experts="stacked", shared=False, dtype=dtype, seed=0)
    if style == "dropless":
        return DroplessSortMoE(hidden=H, inter=inter, num_experts=E, top_k=2, capacity_factor=1.25, dtype=dtype,
                               seed=0)
    return CapacityMoE(hidden=H, inter=inter, num_experts=E, top_k=2, capacity_factor=1.25, style=style, dtype=dtype,
                       seed=0)


def _step(model: torch.nn.Module, fn, x: torch.Tensor, g: torch.Tensor) -> None:
    for p in model.parameters():
        p.grad = None
    torch.compiler.cudagraph_mark_step_begin()  # a new CUDA-graph step (GRAPHS); nothing for the other variants
    fn(x).backward(g)


def _variants(style: str, device: str) -> tuple[str, ...]:
    return VARIANTS + ((GRAPHS,) if style in GRAPH_STYLES and device == "cuda" else ())


def _compiled(style: str, variant: str, m: torch.nn.Module):
    """The step's callable: the host loop goes through ``moe_compile.compile`` (its swap; Dynamo captures the host
    read) and plain ``torch.compile`` without ``fullgraph`` (it graph-breaks there, as a user would see it)."""
    if variant == "eager":
        return m
    if variant == GRAPHS:
        return moe_compile.compile(m, mode="reduce-overhead") if style == "skip_loop" else \
            torch.compile(m, backend="moe_compile", mode="reduce-overhead", fullgraph=True)
    if style == "skip_loop":
        return moe_compile.compile(m) if variant == "moe_compile" else torch.compile(m)
    return torch.compile(m, backend=variant, fullgraph=True)


def _kernels(model, fn, x, g) -> tuple[float | None, int | None]:
    """(GPU kernel ms, kernels launched) of one step, from the profiler (CUDA only)."""
    if x.device.type != "cuda":
        return None, None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _step(model, fn, x, g)
        sync("cuda")
    events = prof.key_averages()
    return sum(e.self_device_time_total for e in events) / 1e3, sum(e.count for e in events if e.device_time_total)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="one small shape")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--styles", default=",".join(STYLES),
                        help="comma-separated layer styles to run (default: all; a subset saves to "
                             "capacity_<styles>.json)")
    parser.add_argument("--shape", action="append", default=None, metavar="TxHxExI",
                        help="a (tokens, hidden, experts, expert inter) shape instead of the defaults (repeat it for "
                             "several; saved to capacity_[<styles>_]<shapes>.json)")
    add_results_args(parser)
    args = parser.parse_args(argv)
    unknown = set(args.styles.split(",")) - set(STYLES)
    if unknown:
        parser.error(f"--styles: unknown {sorted(unknown)}; known: {', '.join(STYLES)}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if device == "cpu":
        torch.set_num_threads(1)
        shapes = [(256, 128, 8, 256)] if args.quick else [(256, 128, 8, 256), (512, 128, 8, 256), (1024, 128, 8, 256)]
    else:  # (T, H, E, I): the targets, H 2048, E 64, fine-grained experts
        shapes = [(2048, 1024, 16, 512)] if args.quick else [(4096, 1024, 16, 512), (4096, 2048, 64, 1024),
                                                              (16384, 2048, 64, 1024)]
    if args.shape:
        try:
            shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shape]
        except ValueError:
            shapes = []
        if not shapes or any(len(shape) != 4 for shape in shapes):
            parser.error(f"--shape: expected TxHxExI (four integers), got {args.shape}")
    rows = []
    tflops = measured_mm_tflops(device, dtype)
    for T, H, E, inter in shapes:
        for style in [s for s in args.styles.split(",") if device == "cuda" or s in STYLES[:2]]:
            model = _layer(style, T, H, E, inter, dtype).to(device)
            C = model.capacity(T) if hasattr(model, "capacity") else None  # the loop layers drop nothing
            x = torch.randn(T, H, device=device, dtype=dtype, requires_grad=True)
            g = torch.randn(T, H, device=device, dtype=dtype)
            fns, rewrites, failed = {}, {}, {}
            for variant in _variants(style, device):
                torch._dynamo.reset()
                m = copy.deepcopy(model)
                fn = _compiled(style, variant, m)
                # caches off: a cache hit would run the rewritten code without the passes, and record nothing
                try:
                    with report.collecting() as rep, torch._inductor.config.patch(force_disable_caches=True):
                        _step(m, fn, x, g)  # compiles
                except torch.OutOfMemoryError as exc:  # eager's one-hot [T, E, C] tensors at the largest T
                    failed[variant] = f"out of memory: {str(exc).splitlines()[0][:160]}"
                    del m, fn
                    torch.cuda.empty_cache()
                    continue
                rep.records[:0] = report.module_records(m)  # moe_compile.compile's loop swap lives on the module
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
            for variant in _variants(style, device):
                row = {"style": style, "T": T, "H": H, "E": E, "I": inter, "K": 2, "C": C, "dtype": str(dtype),
                       "variant": variant,
                       "dispatch_gflop": 2 * 2 * T * E * C * H / 1e9 if style in ("gshard", "deepspeed") else 0,
                       "experts_gflop": (3 if style in ("skip_loop", "sort_swiglu") else 2) * 2
                       * (T * 2 if style in ("dropless", "skip_loop", "sort_swiglu") else E * C) * H * inter / 1e9}
                # the floor: the experts' forward and backward GEMMs (3x the forward's FLOPs) at the dense rate
                row["experts_floor_ms"] = 3 * row["experts_gflop"] / tflops
                row["matmul_tflops"] = tflops
                if variant in failed:
                    row.update(step_ms=None, kernel_ms=None, kernels=None, host_ms=None, rewrites=None,
                               error=failed[variant])
                else:
                    m, fn = fns[variant]
                    kernel_ms, kernels = _kernels(m, fn, x, g)
                    host_ms = timed_calls(lambda m=m, fn=fn: _step(m, fn, x, g), device, 5)[1] / 1e3
                    row.update(step_ms=statistics.median(times[variant]), kernel_ms=kernel_ms, kernels=kernels,
                               host_ms=host_ms, rewrites=rewrites[variant])
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
        styles = args.styles.split(",")
        # a subset of the styles is its own configuration (the full table's file keeps one run)
        subset = None if set(styles) == set(STYLES) else "_".join(sorted(styles))
        shape_tag = "_".join("x".join(map(str, shape)) for shape in shapes) if args.shape else None
        config = "_".join(c for c in ("cpu" if device == "cpu" else None, subset, shape_tag) if c) or None
        write_results(results_path(args, "capacity", config), rows, env)


def _print_targets(rows: list[dict]) -> None:
    """The issue's targets per T: moe_compile vs plain Inductor on the capacity layer, and vs the dropless sort path."""
    by = {(r["style"], r["T"], r["variant"]): r for r in rows}
    for T in sorted({r["T"] for r in rows}):
        for style, sort_style in SORT_PATH.items():
            ours, plain = by.get((style, T, "moe_compile")), by.get((style, T, "inductor"))
            sort = by.get((sort_style, T, "moe_compile"))
            if not ours or ours["step_ms"] is None:
                continue

            def ratio(a, b, key):
                return a[key] / b[key] if a and b and a.get(key) and b.get(key) else float("nan")

            print(f"target {style} T={T}: plain Inductor / moe_compile = {ratio(plain, ours, 'step_ms'):.2f}x; "
                  f"moe_compile / {sort_style} sort path = {ratio(ours, sort, 'step_ms'):.2f}x wall, "
                  f"{ratio(ours, sort, 'kernel_ms'):.2f}x GPU kernel time", flush=True)
            graphs, sort_graphs = by.get((style, T, GRAPHS)), by.get((sort_style, T, GRAPHS))
            if graphs and sort_graphs:
                print(f"target {style} T={T}, CUDA graphs: moe_compile / {sort_style} sort path = "
                      f"{ratio(graphs, sort_graphs, 'step_ms'):.2f}x wall", flush=True)


if __name__ == "__main__":
    main()
