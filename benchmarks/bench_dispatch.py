"""Benchmark ``moe::permute_pad`` / ``moe::unpad_unpermute`` (forward and backward) on one GPU.

Compares, per shape (bf16, align 32, uniform top-k routing):

* ``ours_graph``: the Triton ops, ``GRAPH_CALLS`` calls captured in one CUDA graph, replay time per
  call: the GPU time alone, which is what ``torch.compile(mode="reduce-overhead")`` users see;
* ``ours_eager``: the same ops called eagerly through the public wrappers (argument checks,
  allocations and Triton launches included, the custom-op dispatcher skipped as
  NOTE [eager fast path] (moe_compile/ops/_common.py) allows; the backward ops go through it): when that host work takes
  longer than the kernels, this measures the host;
* ``torch_eager``: the usual PyTorch formulation: stable argsort, ``counts.tolist()`` to size the
  padded buffer on the host, ``index_select``/``index_copy`` permute, ``index_add`` combine (backward:
  autograd); it syncs with the host, so it cannot be graph-captured;
* ``inductor``: the same function under ``torch.compile`` (default backend; it graph-breaks at the
  host sync);
* ``floor``: bytes that must move (read + written) / measured device-to-device copy bandwidth.

Backward rows time the ``moe::*_backward`` ops directly. Every time is the median of
``triton.testing.do_bench`` (L2 flushed between repetitions).

Usage, from the repository root: ``python -m benchmarks.bench_dispatch [--save] [--quick] [--ours-only]
[--compare FILE]`` (``--save`` writes ``benchmarks/results/dispatch.json``; ``--ours-only`` times only our ops, no
PyTorch formulation and no compile; ``--compare`` prints our times next to those of another results file, e.g. a run
of another commit's ops on the same machine: the cost of a kernel change, such as issue 35's poisoning of bad input,
NOTE [poisoned tokens] (moe_compile/ops/unpad_unpermute.py), which no flag turns off).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import sys
import time

import torch

from benchmarks._bench_env import add_results_args, copy_bandwidth, device_env, results_path, write_results


@dataclasses.dataclass(frozen=True)
class Config:
    T: int
    H: int
    E: int
    K: int
    align: int = 32
    dtype: torch.dtype = torch.bfloat16

    @property
    def name(self) -> str:
        return f"T{self.T}_H{self.H}_E{self.E}_K{self.K}"


@dataclasses.dataclass(frozen=True)
class Result:
    config: str
    op: str
    direction: str
    impl: str
    time_us: float
    gbps: float  # floor bytes / time
    x_floor: float  # time / floor time


def get_configs(quick: bool) -> list[Config]:
    configs = [Config(8192, 4096, 8, 2), Config(16384, 2048, 64, 8), Config(4096, 7168, 256, 8)]
    return configs[:1] if quick else configs


# ===== the PyTorch formulation (eager and under plain Inductor) =====


def eager_permute_pad(x_TH, ids_TK, probs_TK, num_experts: int, align: int):
    T, K = ids_TK.shape
    flat_N = ids_TK.reshape(-1)
    order_N = torch.argsort(flat_N, stable=True)
    sorted_ids_N = flat_N[order_N]
    counts_E = torch.bincount(flat_N, minlength=num_experts)
    counts = counts_E.tolist()  # host sync: sizes the padded buffer
    padded = [(c + align - 1) // align * align for c in counts]
    seg_start = [0]
    for p in padded[:-1]:
        seg_start.append(seg_start[-1] + p)
    seg_start_E = torch.tensor(seg_start, device=x_TH.device)
    start_E = torch.cumsum(counts_E, 0) - counts_E
    dest_N = seg_start_E[sorted_ids_N] + torch.arange(flat_N.numel(), device=x_TH.device) - start_E[sorted_ids_N]
    tok_N = order_N // K
    rows = x_TH.new_zeros(sum(padded), x_TH.shape[1]).index_copy(0, dest_N, x_TH.index_select(0, tok_N))
    probs_M = probs_TK.new_zeros(sum(padded)).index_copy(0, dest_N, probs_TK.reshape(-1)[order_N])
    offs_E = torch.tensor([s + p for s, p in zip(seg_start, padded)], dtype=torch.int32, device=x_TH.device)
    return rows, probs_M, offs_E, dest_N, tok_N, order_N


def eager_combine(rows_MH, dest_N, tok_N, order_N, probs_TK, T: int):
    z_NH = rows_MH.index_select(0, dest_N) * probs_TK.reshape(-1)[order_N].unsqueeze(1)
    return z_NH.new_zeros(T, rows_MH.shape[1]).index_add(0, tok_N, z_NH)


# ===== measurement =====


GRAPH_CALLS = 10


def run_experiment(cfg: Config, bw: float, rep: int, ours_only: bool = False) -> list[Result]:
    from triton.testing import do_bench

    from moe_compile.ops import permute_pad, static_row_bound, unpad_unpermute

    dev = "cuda"
    T, H, E, K, a, s = cfg.T, cfg.H, cfg.E, cfg.K, cfg.align, cfg.dtype.itemsize
    N, M = T * K, static_row_bound(T * K, E, a)
    torch.manual_seed(0)
    x = torch.randn(T, H, device=dev, dtype=cfg.dtype)
    ids = torch.rand(T, E, device=dev).topk(K, dim=1).indices
    probs = torch.rand(T, K, device=dev, dtype=cfg.dtype)
    out = permute_pad(x, ids, probs, num_experts=E, align=a)
    z = torch.randn_like(out.rows_MH)
    g_rows, g_probs, g_y = torch.randn_like(out.rows_MH), torch.randn_like(out.probs_M), torch.randn_like(x)

    floor_bytes = {  # (read, written) bytes that must move (probs, ids, maps are < 1% and ignored)
        ("permute_pad", "fwd"): (T * H * s, M * H * s),
        ("permute_pad", "bwd"): (N * H * s, T * H * s),
        ("unpad_unpermute", "fwd"): (N * H * s, T * H * s),
        ("unpad_unpermute", "bwd"): ((T + N) * H * s, M * H * s),
    }

    def bench(fn) -> float:
        return do_bench(fn, warmup=max(5, rep // 4), rep=rep, return_mode="median") * 1e3

    def bench_graph(fn) -> float:
        """GPU time of one call: GRAPH_CALLS back-to-back calls captured in one CUDA graph (after a
        warm-up on a side stream), replay time / GRAPH_CALLS: the launch latency of the graph itself
        (~4 us) is spread as it is in a model-sized graph."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(GRAPH_CALLS):
                fn()
        us = bench(graph.replay) / GRAPH_CALLS
        del graph
        return us

    ours = {
        ("permute_pad", "fwd"): lambda: permute_pad(x, ids, probs, num_experts=E, align=a),
        ("unpad_unpermute", "fwd"): lambda: unpad_unpermute(z, out.row_map, probs),
        ("permute_pad", "bwd"): lambda: torch.ops.moe.permute_pad_backward(g_rows, g_probs, out.row_map),
        ("unpad_unpermute", "bwd"): lambda: torch.ops.moe.unpad_unpermute_backward(g_y, out.row_map, probs, z, M),
    }
    timings: dict[tuple[str, str, str], float] = {}
    for (op, direction), fn in ours.items():
        timings[op, direction, "ours_eager"] = bench(fn)
        timings[op, direction, "ours_graph"] = bench_graph(fn)

    for impl in () if ours_only else ("torch_eager", "inductor"):
        torch._dynamo.reset()
        is_eager = impl == "torch_eager"
        permute_fn = eager_permute_pad if is_eager else torch.compile(eager_permute_pad, dynamic=False)
        combine_fn = eager_combine if is_eager else torch.compile(eager_combine, dynamic=False)
        xr, pr = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
        rows, probs_M, _, dest, tok, order = permute_fn(xr, ids, pr, E, a)
        zr = torch.randn_like(rows).requires_grad_(True)
        y = combine_fn(zr, dest, tok, order, pr, T)
        gr, gp, gy = torch.randn_like(rows), torch.randn_like(probs_M), torch.randn_like(y)
        # forward timed on inputs that require grad (training): reuses the graphs compiled above
        timings["permute_pad", "fwd", impl] = bench(lambda: permute_fn(xr, ids, pr, E, a))
        timings["unpad_unpermute", "fwd", impl] = bench(lambda: combine_fn(zr, dest, tok, order, pr, T))
        timings["permute_pad", "bwd", impl] = bench(
            lambda: torch.autograd.grad((rows, probs_M), (xr, pr), (gr, gp), retain_graph=True)
        )
        timings["unpad_unpermute", "bwd", impl] = bench(lambda: torch.autograd.grad(y, (zr, pr), gy, retain_graph=True))
        rows = probs_M = y = zr = None  # frees them; the names stay bound for the lambdas above
    torch._dynamo.reset()

    results = []
    for (op, direction, impl), us in timings.items():
        nbytes = sum(floor_bytes[op, direction])
        results.append(Result(cfg.name, op, direction, impl, us, nbytes / (us * 1e-6) / 1e9, us / (nbytes / bw * 1e6)))
    for (op, direction), (read, written) in floor_bytes.items():
        results.append(Result(cfg.name, op, direction, "floor", (read + written) / bw * 1e6, bw / 1e9, 1.0))
    return results


LEGEND = {
    "floor_us": "bytes that must move (read + written) / measured copy bandwidth (the issue's floor)",
    "graph_us": f"ours, GPU time per call: {GRAPH_CALLS} calls in one CUDA graph, replay / {GRAPH_CALLS} "
    "(what mode='reduce-overhead' sees)",
    "graph_x": "graph_us / floor_us",
    "eager_us": "ours, eager Python call: host overhead included where it exceeds the GPU time",
    "eager_x": "eager_us / floor_us",
    "torch_us": "PyTorch eager formulation (host-sized pad, index_add), eager",
    "inductor_us": "the same PyTorch formulation under torch.compile (default backend)",
    "vs_torch": "torch_us / eager_us (eager against eager)",
    "vs_inductor": "inductor_us / eager_us",
}


def summarize(results: list[Result]) -> list[dict]:
    short = {
        "floor": "floor", "ours_graph": "graph", "ours_eager": "eager", "torch_eager": "torch",
        "inductor": "inductor",
    }  # fmt: skip
    rows: dict[tuple[str, str, str], dict] = {}
    for r in results:
        row = rows.setdefault((r.config, r.op, r.direction), {"config": r.config, "op": r.op, "dir": r.direction})
        row[f"{short[r.impl]}_us"] = round(r.time_us, 1)
    for row in rows.values():
        row["graph_x"] = round(row["graph_us"] / row["floor_us"], 3)
        row["eager_x"] = round(row["eager_us"] / row["floor_us"], 3)
        for key, theirs in (("vs_torch", "torch_us"), ("vs_inductor", "inductor_us")):  # absent with --ours-only
            row[key] = round(row[theirs] / row["eager_us"], 2) if theirs in row else None
    order = ("config", "op", "dir", "floor_us", "graph_us", "graph_x", "eager_us", "eager_x", "torch_us",
             "inductor_us", "vs_torch", "vs_inductor")  # fmt: skip
    return [{k: row.get(k) for k in order} for row in rows.values()]


def compare(results: list[Result], path) -> list[dict]:
    """Our times (graph and eager) next to the same rows of the results file ``path``: ``ratio`` = this run / that
    one (above 1: this run is slower)."""
    from benchmarks._bench_env import read_rows

    env, rows = read_rows(path)
    if not rows:
        raise SystemExit(f"--compare: no results in {path}")
    theirs = {(r["config"], r["op"], r["direction"], r["impl"]): r["time_us"] for r in rows}
    out = []
    for r in results:
        other = theirs.get((r.config, r.op, r.direction, r.impl))
        if r.impl.startswith("ours") and other is not None:
            out.append({"config": r.config, "op": r.op, "dir": r.direction, "impl": r.impl,
                        "this_us": round(r.time_us, 1), "that_us": round(other, 1),
                        "ratio": round(r.time_us / other, 3)})
    print(f"compared with {path} (commit {env.get('commit')}, {env.get('device')}, {env.get('date')}):")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_results_args(parser)
    parser.add_argument("--quick", action="store_true", help="first shape only, fewer repetitions")
    parser.add_argument("--ours-only", action="store_true",
                        help="time only our ops (no PyTorch formulation, no torch.compile)")
    parser.add_argument("--compare", type=pathlib.Path, default=None, metavar="FILE",
                        help="print our times next to those of another dispatch results file (this run / that one)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_dispatch: no CUDA device; nothing to benchmark (this benchmark needs a GPU).")
        return
    rep = 20 if args.quick else 40
    bw = copy_bandwidth()
    results: list[Result] = []
    start = time.perf_counter()
    for cfg in get_configs(args.quick):
        results += run_experiment(cfg, bw, rep, ours_only=args.ours_only)
        torch.cuda.empty_cache()
        print(f"{cfg.name}: done at {time.perf_counter() - start:.0f} s", flush=True)
    summary = summarize(results)
    env = device_env(copy_bandwidth_GBps=round(bw / 1e9, 1))
    if args.save:
        write_results(results_path(args, "dispatch"), [dataclasses.asdict(r) for r in results], env)
    print(
        f"device={env['device']} torch={env['torch']} triton={env['triton']} "
        f"copy={env['copy_bandwidth_GBps']} GB/s"
    )
    for key, text in LEGEND.items():
        print(f"  {key:12s} {text}")
    keys = list(summary[0].keys())
    widths = [max(len(k), *(len(str(r.get(k))) for r in summary)) for k in keys]
    print("  ".join(k.ljust(w) for k, w in zip(keys, widths)))
    for r in summary:
        print("  ".join(str(r.get(k)).ljust(w) for k, w in zip(keys, widths)))
    if args.compare is not None:
        table = compare(results, args.compare)
        keys = list(table[0].keys()) if table else []
        widths = [max(len(k), *(len(str(r[k])) for r in table)) for k in keys]
        print("  ".join(k.ljust(w) for k, w in zip(keys, widths)))
        for r in table:
            print("  ".join(str(r[k]).ljust(w) for k, w in zip(keys, widths)))
    if any(math.isnan(r.time_us) for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
