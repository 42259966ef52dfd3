"""Host cost of MoE layers, default mode: eager vs plain Inductor vs moe_compile (issue 14).

Per layer, token count and direction (``fwd`` under ``no_grad``, ``fwd+bwd`` with ``backward(grad_out)``
w.r.t. the input and every parameter), bf16:

* ``wall_us``: 200 calls back to back, one synchronisation at the end, per call: what a decode loop sees;
  when the step is launch bound this is the host time. The variants of a row are timed interleaved (9 rounds,
  each runs every variant once, in rotating order) and the median round is reported, so that the drift of a
  shared machine moves all of them alike; ``wall_min_us`` is the least disturbed round;
* ``issue_us``: the same loop timed before that synchronisation (the host's time to issue a call;
  equal to ``wall_us`` when the host is the bottleneck, below it when the GPU is);
* ``kernel_us``: GPU kernel time per call (``torch.profiler``, CUDA kernels summed);
* ``prof_cpu_us``: CPU time per call of the profiled ops (``torch.profiler`` self CPU time summed;
  Python between ops not included);
* ``host_cpu_us``: the process's CPU time per call while issuing the timed calls (``time.process_time``, every
  thread; Python included): the host cost itself, which, unlike wall time, does not grow when the shared machine
  takes the core away. The target "host time within 10 us of Inductor's" is read on this column.

Layers (``torch.compile(layer, backend=..., fullgraph=True)``, as the issue measured them):

* ``padded``: ``tests/models/handwritten.py::PaddedSentinelRow`` (torchtitan-style device padding: sort,
  padded indices on the device, zero sentinel row, ``torch._grouped_mm``, ``index_add_`` combine),
  H 1024, I 1536, E 16, K 4, align 32, T in {1, 64, 4096};
* ``sort_scatter``: ``SortIndexSelectScatterAdd`` (sort + ``scatter_add_`` combine), same sizes, T in {1, 64, 4096};
* ``host_padded``: ``tests/models/host_padded.py::SplitPadGroupedMoE`` (``counts.tolist()``, split + ``F.pad`` +
  cat, offsets from host sizes, ``index_add_``), same sizes, T in {1, 64, 4096} forward, 4096 forward+backward;
  ``moe`` compiles it through ``moe_compile.compile`` (the entry point for host-sized padding), ``inductor``
  with ``torch.compile(fullgraph=True)`` (which captures the ``.tolist()``);
* ``qwen3``: transformers' ``Qwen3MoeSparseMoeBlock`` (H 2048, I 768, E 128, K 8), T in {1, 64, 4096} forward;
* ``mixtral``: transformers' ``MixtralSparseMoeBlock`` (H 4096, I 3584, E 8, K 2), T in {1, 64, 4096} forward;
* ``permute_pad``: ``moe_compile.ops.permute_pad`` alone (eager public wrapper; the same with Triton's own
  launch path instead of the cached launch, NOTE [cached eager launch] (moe_compile/ops/_eager_launch.py); and compiled
  with plain Inductor, whose generated code launches the kernels) against its bandwidth floor (bytes read and
  written / measured copy bandwidth), T8192 H4096 E8 K2 and T16384 H2048 E64 K8 (align 32).

Variants: ``eager``; ``inductor`` (default backend); ``moe`` (``backend="moe_compile"``). Targets
(issue 14): ``moe`` wall time <= ``inductor``'s on every row (within 10% at T <= 64), and
``permute_pad`` eager within 1.3x of its floor at T8192 E8 K2.

Usage, from the repository root: ``python -m benchmarks.bench_host_cost [--save] [--quick] [--budget-s 200]``
(``--save`` writes ``benchmarks/results/host_cost.json``); ``--cpu-smoke`` runs every variant at tiny shapes on CPU
(checks the flow; the times mean nothing there).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks._bench_env import add_results_args, device_env, results_path, sync, timed_calls, write_results

VARIANTS = ("eager", "inductor", "moe")
CALLS = 200  # timed calls per measurement (one synchronisation at the end)
# interleaved rounds (every variant once per round); the median is reported (9 left T1 rows within noise on the H100)
REPEATS = 15
PROFILED_CALLS = 20
SMOKE_CALLS = 3  # --cpu-smoke: the flow only


@dataclasses.dataclass(frozen=True)
class Config:
    layer: str  # padded | sort_scatter | host_padded | qwen3 | mixtral | permute_pad
    T: int
    direction: str  # fwd | fwd+bwd
    H: int
    I: int  # noqa: E741 - expert intermediate size
    E: int
    K: int
    align: int = 32

    @property
    def name(self) -> str:
        return f"{self.layer} T{self.T} {self.direction}"


@dataclasses.dataclass(frozen=True)
class Result:
    config: str
    layer: str
    T: int
    direction: str
    variant: str
    wall_us: float
    issue_us: float
    kernel_us: float
    prof_cpu_us: float
    floor_us: float  # permute_pad rows only
    compile_s: float
    note: str = ""
    wall_min_us: float = math.nan  # the least disturbed of the interleaved rounds
    host_cpu_us: float = math.nan  # process CPU time while issuing, per call (see _bench_env.timed_calls)
    wall_rounds_us: tuple[float, ...] = ()  # wall per call in each interleaved round, in order


def get_configs(quick: bool, cpu_smoke: bool) -> list[Config]:
    if cpu_smoke:  # tiny shapes, every layer and direction once
        return [
            Config("padded", 1, "fwd", 32, 16, 4, 2, 8),
            Config("padded", 16, "fwd+bwd", 32, 16, 4, 2, 8),
            Config("sort_scatter", 16, "fwd", 32, 16, 4, 2, 8),
            Config("host_padded", 16, "fwd+bwd", 32, 16, 4, 2, 8),
            Config("qwen3", 1, "fwd", 32, 16, 8, 2),
            Config("mixtral", 16, "fwd", 32, 16, 4, 2),
            Config("permute_pad", 64, "fwd", 32, 0, 4, 2, 8),
        ]
    decode = [1, 64]
    configs = [Config("padded", T, "fwd", 1024, 1536, 16, 4) for T in decode]
    configs += [Config("qwen3", T, "fwd", 2048, 768, 128, 8) for T in decode]
    configs += [Config("mixtral", T, "fwd", 4096, 3584, 8, 2) for T in decode]
    configs += [Config("permute_pad", 8192, "fwd", 4096, 0, 8, 2), Config("permute_pad", 16384, "fwd", 2048, 0, 64, 8)]
    configs += [Config("padded", 4096, d, 1024, 1536, 16, 4) for d in ("fwd", "fwd+bwd")]
    configs += [Config("padded", T, "fwd+bwd", 1024, 1536, 16, 4) for T in decode]
    configs += [Config("sort_scatter", T, "fwd", 1024, 1536, 16, 4) for T in (*decode, 4096)]
    configs += [Config("host_padded", T, "fwd", 1024, 1536, 16, 4) for T in (*decode, 4096)]
    configs += [Config("host_padded", 4096, "fwd+bwd", 1024, 1536, 16, 4)]
    configs += [Config("qwen3", 4096, "fwd", 2048, 768, 128, 8), Config("mixtral", 4096, "fwd", 4096, 3584, 8, 2)]
    if quick:
        configs = [c for c in configs if c.T <= 64 or c.layer == "permute_pad"][:6]
    return configs


# ===== layers =====


def build_layer(cfg: Config, device: str) -> torch.nn.Module:
    from tests.models import handwritten as hw

    if cfg.layer in ("padded", "sort_scatter"):
        cls = hw.PaddedSentinelRow if cfg.layer == "padded" else hw.SortIndexSelectScatterAdd
        kwargs = dict(align=cfg.align) if cfg.layer == "padded" else {}
        return cls(hidden=cfg.H, inter=cfg.I, experts=cfg.E, top_k=cfg.K, **kwargs).to(device)
    if cfg.layer == "host_padded":
        from tests.models.host_padded import SplitPadGroupedMoE

        return SplitPadGroupedMoE(cfg.H, cfg.I, cfg.E, cfg.K, cfg.align, torch.bfloat16).to(device)
    if cfg.layer in ("qwen3", "mixtral"):  # transformers' own block, as bench_moe_block.py builds it
        from benchmarks import bench_moe_block

        family = "qwen3_moe" if cfg.layer == "qwen3" else "mixtral"
        return bench_moe_block.build_block(bench_moe_block.Config(family, cfg.T, cfg.H, cfg.I, cfg.E, cfg.K), device)
    raise ValueError(cfg.layer)


def layer_input(cfg: Config, device: str) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(cfg.T)
    shape = (1, cfg.T, cfg.H) if cfg.layer in ("qwen3", "mixtral") else (cfg.T, cfg.H)
    return torch.randn(shape, generator=gen, device=device).to(torch.bfloat16)


def _output(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _compile(variant: str, fn, fullgraph: bool = True, layer_kind: str = ""):
    import moe_compile

    if variant == "eager":
        return fn
    if variant == "moe" and layer_kind == "host_padded":  # padding sized on the host: moe_compile's entry point
        return moe_compile.compile(fn, fullgraph=fullgraph, dynamic=False)
    backend = "moe_compile" if variant == "moe" else "inductor"
    return torch.compile(fn, backend=backend, fullgraph=fullgraph, dynamic=False)


# ===== timing =====


def time_interleaved(steps: dict[str, Callable[[], object]], device: str) -> dict[str, tuple]:
    """``{variant: (median wall, median issue, min wall, median host CPU, wall of each round)}`` microseconds
    per call, the variants interleaved.

    Host-bound times drift by tens of percent over a run on a shared machine (clocks, other tenants), so the
    variants are not timed one after the other: each of ``REPEATS`` rounds runs ``CALLS`` calls of every
    variant, in an order that rotates from round to round, and each variant's median over the rounds is
    reported (drift moves every variant alike); the minimum is the least disturbed round.
    """
    calls, repeats = (CALLS, REPEATS) if device == "cuda" else (SMOKE_CALLS, 1)
    names = list(steps)
    for name in names:
        for _ in range(5 if device == "cuda" else 1):
            steps[name]()
    walls: dict[str, list[float]] = {n: [] for n in names}
    issues: dict[str, list[float]] = {n: [] for n in names}
    cpus: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            wall, issue, cpu = timed_calls(steps[name], device, calls)
            walls[name].append(wall)
            issues[name].append(issue)
            cpus[name].append(cpu)
    med = statistics.median
    return {n: (med(walls[n]), med(issues[n]), min(walls[n]), med(cpus[n]), tuple(round(w, 1) for w in walls[n]))
            for n in names}


def profile_calls(step: Callable[[], object], device: str) -> tuple[float, float]:
    """(GPU kernel, profiled-op CPU) microseconds per call."""
    calls = PROFILED_CALLS if device == "cuda" else SMOKE_CALLS
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sync(device)
    with profile(activities=activities) as prof:
        for _ in range(calls):
            step()
        sync(device)
    events = prof.events()
    kernel = sum(e.device_time_total for e in events if e.device_type == DeviceType.CUDA) if device == "cuda" else 0.0
    cpu = sum(e.self_cpu_time_total for e in events if e.device_type == DeviceType.CPU)
    return kernel / calls, cpu / calls


# ===== experiments =====


def _make_step(cfg: Config, fn, layer: torch.nn.Module, x: torch.Tensor, grad_out: torch.Tensor):
    if cfg.direction == "fwd":

        def step():
            with torch.no_grad():
                return _output(fn(x))

        return step
    xg = x.detach().requires_grad_(True)

    def step():
        xg.grad = None
        for p in layer.parameters():
            p.grad = None
        out = _output(fn(xg))
        out.backward(grad_out)
        return out

    return step


def run_layer(cfg: Config, device: str, deadline: float) -> list[Result]:
    """Every variant of one layer: compiled first, then timed interleaved (:func:`time_interleaved`), then profiled."""
    layer = build_layer(cfg, device)
    x = layer_input(cfg, device)
    grad_out = torch.randn_like(x)
    torch._dynamo.reset()
    steps: dict[str, Callable[[], object]] = {}
    info: dict[str, tuple[float, str]] = {}  # variant -> (compile seconds, note)
    for variant in VARIANTS:
        if time.perf_counter() > deadline:
            info[variant] = (math.nan, "skipped: time budget")
            continue
        note = ""
        try:
            start = time.perf_counter()
            try:
                step = _make_step(cfg, _compile(variant, layer, layer_kind=cfg.layer), layer, x, grad_out)
                step()
            except Exception as exc:  # noqa: BLE001 - a graph break: measure what a user gets without fullgraph
                if variant == "eager":
                    raise
                note = f"fullgraph=False ({type(exc).__name__})"
                fn = _compile(variant, layer, fullgraph=False, layer_kind=cfg.layer)
                step = _make_step(cfg, fn, layer, x, grad_out)
                step()
            sync(device)
            steps[variant] = step
            info[variant] = (time.perf_counter() - start if variant != "eager" else 0.0, note)
        except Exception as exc:  # noqa: BLE001 - report the failure in the table, keep going
            info[variant] = (math.nan, f"{note} failed: {type(exc).__name__}: {exc}"[:200].strip())
    timed = time_interleaved(steps, device) if steps else {}
    results = []
    for variant in VARIANTS:
        compile_s, note = info[variant]
        wall, issue, wall_min, host_cpu, rounds = timed.get(variant, (math.nan,) * 4 + ((),))
        kernel, cpu = profile_calls(steps[variant], device) if variant in steps else (math.nan, math.nan)
        results.append(Result(cfg.name, cfg.layer, cfg.T, cfg.direction, variant, wall, issue, kernel, cpu,
                              math.nan, compile_s, note, wall_min, host_cpu, rounds))
        print(f"  {cfg.name} {variant}: wall {wall:.1f} us (min {wall_min:.1f}), issue {issue:.1f} us, "
              f"kernels {kernel:.1f} us (compile {compile_s:.1f} s) {note}; rounds {[round(w) for w in rounds]}",
              flush=True)
    torch._dynamo.reset()
    return results


def _permute_pad_floor_us(cfg: Config, bw: float) -> float:
    from moe_compile.ops import static_row_bound

    N = cfg.T * cfg.K
    M = static_row_bound(N, cfg.E, cfg.align)
    bytes_moved = (cfg.T * cfg.H * 2 + N * 8 + N * 2  # read x, ids (int64), probs
                   + M * cfg.H * 2 + M * 2 + cfg.T * 2 * cfg.K * 4 + 2 * cfg.E * 4)  # write rows, probs, map, offs
    return bytes_moved / bw * 1e6


def run_permute_pad(cfg: Config, device: str, bw: float) -> list[Result]:
    from moe_compile.ops import permute_pad

    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(cfg.T, cfg.H, generator=gen, device=device).to(torch.bfloat16)
    ids = torch.rand(cfg.T, cfg.E, generator=gen, device=device).argsort(1)[:, : cfg.K].contiguous()
    probs = torch.rand(cfg.T, cfg.K, generator=gen, device=device).to(torch.bfloat16)
    floor = _permute_pad_floor_us(cfg, bw) if device == "cuda" else math.nan

    def op(x, ids, probs):
        return permute_pad(x, ids, probs, num_experts=cfg.E, align=cfg.align)

    from moe_compile.ops import _eager_launch

    def uncached(x, ids, probs):  # the eager wrapper with Triton's own launch path (JITFunction.run per launch)
        _eager_launch.ENABLED = False
        try:
            return op(x, ids, probs)
        finally:
            _eager_launch.ENABLED = True

    torch._dynamo.reset()
    names = {"eager": "eager (public wrapper)", "eager_uncached": "eager, Triton's launch path",
             "inductor": "compiled (Inductor launches)"}
    steps, compile_s = {}, {}
    for variant in names:  # "inductor": the op's kernels launched from generated code
        fn = uncached if variant == "eager_uncached" else _compile(variant, op)
        start = time.perf_counter()
        fn(x, ids, probs)
        sync(device)
        compile_s[variant] = time.perf_counter() - start if variant == "inductor" else 0.0
        steps[variant] = lambda fn=fn: fn(x, ids, probs)
    timed = time_interleaved(steps, device)
    results = []
    for variant, name in names.items():
        wall, issue, wall_min, host_cpu, rounds = timed[variant]
        kernel, cpu = profile_calls(steps[variant], device)
        results.append(Result(cfg.name, cfg.layer, cfg.T, cfg.direction, name, wall, issue, kernel, cpu, floor,
                              compile_s[variant], "", wall_min, host_cpu, rounds))
        print(f"  {cfg.name} {name}: wall {wall:.1f} us, kernels {kernel:.1f} us, floor {floor:.1f} us", flush=True)
    torch._dynamo.reset()
    return results


SUMMARY_VARIANTS = {"eager": "eager", "inductor": "inductor", "moe": "moe",
                    "eager (public wrapper)": "eager", "eager, Triton's launch path": "eager_uncached",
                    "compiled (Inductor launches)": "inductor"}


def summarize(results: list[Result]) -> list[dict]:
    """One row per config, the same keys on every row (wall, issue and kernel microseconds per call)."""
    rows = []

    def us(r: Result | None, field: str) -> float | None:
        v = getattr(r, field) if r is not None else math.nan
        return None if math.isnan(v) else round(v, 1)

    for key in dict.fromkeys(r.config for r in results):
        cell = {SUMMARY_VARIANTS[r.variant]: r for r in results if r.config == key}
        row: dict = {"config": key}
        for v in VARIANTS:
            row[f"{v}_wall_us"] = us(cell.get(v), "wall_us")
        for v in ("inductor", "moe"):
            row[f"{v}_issue_us"] = us(cell.get(v), "issue_us")
            row[f"{v}_kernel_us"] = us(cell.get(v), "kernel_us")
        moe, ind = row["moe_wall_us"], row["inductor_wall_us"]
        row["moe/inductor"] = round(moe / ind, 2) if moe and ind else None
        moe_min, ind_min = us(cell.get("moe"), "wall_min_us"), us(cell.get("inductor"), "wall_min_us")
        row["moe/inductor_min"] = round(moe_min / ind_min, 2) if moe_min and ind_min else None
        for v in ("inductor", "moe"):
            row[f"{v}_host_cpu_us"] = us(cell.get(v), "host_cpu_us")
        cpu_moe, cpu_ind = row["moe_host_cpu_us"], row["inductor_host_cpu_us"]
        row["moe-inductor_host_cpu_us"] = round(cpu_moe - cpu_ind, 1) if cpu_moe and cpu_ind else None
        floor = us(cell.get("eager"), "floor_us")
        row["floor_us"] = floor
        row["eager/floor"] = round(row["eager_wall_us"] / floor, 2) if floor and row["eager_wall_us"] else None
        # permute_pad rows: the same eager call through Triton's own launch path
        row["eager_uncached_wall_us"] = us(cell.get("eager_uncached"), "wall_us")
        uncached = row["eager_uncached_wall_us"]
        row["eager_uncached/floor"] = round(uncached / floor, 2) if floor and uncached else None
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_results_args(parser)
    parser.add_argument("--quick", action="store_true", help="decode rows and permute_pad only")
    parser.add_argument("--budget-s", type=float, default=200.0, help="skip what is left after this many seconds")
    parser.add_argument("--layers", nargs="+", default=None,
                        help="subset of: padded sort_scatter host_padded qwen3 mixtral permute_pad")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU: checks the flow runs")
    args = parser.parse_args()
    device = "cpu" if args.cpu_smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("bench_host_cost: no CUDA device, nothing to measure "
              "(this benchmark needs a GPU; --cpu-smoke runs the flow)")
        return
    for name, value in (("cache_size_limit", 64), ("recompile_limit", 64), ("accumulated_cache_size_limit", 256)):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, value)
    start = time.perf_counter()
    deadline = start + args.budget_s
    if device == "cuda":
        from benchmarks._bench_env import copy_bandwidth

        bw = copy_bandwidth()
        env = device_env(copy_bandwidth_GBps=round(bw / 1e9, 1))
    else:
        bw = math.nan
        env = device_env(device="cpu (smoke)")
    configs = [c for c in get_configs(args.quick, args.cpu_smoke) if args.layers is None or c.layer in args.layers]
    results: list[Result] = []
    for cfg in configs:
        if cfg.layer == "permute_pad":
            results += run_permute_pad(cfg, device, bw)
        else:
            results += run_layer(cfg, device, deadline)
    env["wall_s"] = round(time.perf_counter() - start, 1)
    summary = summarize(results)
    if args.save:
        write_results(results_path(args, "host_cost", "cpu_smoke" if args.cpu_smoke else None),
                      [dataclasses.asdict(r) for r in results], env)
    print(f"device={env['device']} torch={env['torch']} triton={env['triton']} wall={env['wall_s']} s")
    keys = list(summary[0])
    widths = [max(len(k), *(len(str(r.get(k))) for r in summary)) for k in keys]
    print("  ".join(k.ljust(w) for k, w in zip(keys, widths)))
    for r in summary:
        print("  ".join(str(r.get(k)).ljust(w) for k, w in zip(keys, widths)))


if __name__ == "__main__":
    main()
