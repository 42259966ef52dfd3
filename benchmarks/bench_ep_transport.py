"""The expert-parallel exchange alone, over ``W`` GPUs (issue 38: which transport to use where it is available).

One exchange of ``N`` bf16 rows of ``H`` per rank, each row to a uniformly random rank (the routed rows of
``bench_ep``'s models: ``N = T*K`` with ``T = 4096`` tokens per rank), timed per call with CUDA events (median of
rounds after warm-up, the slowest rank's), as each way of moving them does it:

* ``nccl_exact``: ``dist.all_to_all_single`` at the real split sizes, what a host-synced layer runs once the host has
  read them (the read itself not timed);
* ``nccl_padded_bound``: the padded ``[W*S, H]`` buffer at equal splits with ``S`` the bound ``N`` (``T*min(K, L)``
  with ``L >= K``: no row dropped), what ``expert_parallel`` inserts by default;
* ``nccl_padded_cf1.25``: the same at ``S = ceil(1.25 * N / W)`` (``ep_capacity_factor=1.25``);
* ``symm_mem_vdev``: PyTorch's symmetric-memory ``all_to_all_vdev`` (NVSHMEM): split sizes stay on the device, only
  the real rows move, into a receive buffer of static size; checked against ``nccl_exact`` (the same rows, bitwise)
  and under CUDA-graph capture (a replay after new splits and data were written in place).

``copy_floor_ms``: a local device copy of the bytes a rank receives from other ranks (real rows; read and write at the
measured copy bandwidth): a loose floor, NVLink being slower than the GPU's own memory.

``python -m benchmarks.bench_ep_transport [--save] [--world W]`` (one process per GPU, NVLink multicast off) writes
``benchmarks/results/ep_transport_w<W>.json``; with fewer than 2 CUDA devices it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist

from benchmarks._bench_env import REPO_ROOT, add_results_args, device_env, results_path, write_results

HIDDEN, TOKENS = 2048, 4096
TOP_K = {"qwen3_moe": 8, "deepseek_v3": 6}
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
ROUNDS, CALLS = 7, 10


def _time_ms(fn) -> list[float]:
    """Per-call ms of ``fn`` in each round (the ranks start each round together)."""
    for _ in range(3):
        fn()
    out = []
    for _ in range(ROUNDS):
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(CALLS):
            fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end) / CALLS)
    return out


def _slowest(times: list[float], device: torch.device) -> float:
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return statistics.median(t.tolist())


def _exchange_rows(rank: int, world: int, model: str, K: int, device: torch.device) -> list[dict]:
    import torch.distributed._symmetric_memory as symm_mem

    N = TOKENS * K
    gen = torch.Generator().manual_seed(rank)
    splits = torch.bincount(torch.randint(0, world, (N,), generator=gen), minlength=world)
    data = torch.randn(N, HIDDEN, generator=gen).to(torch.bfloat16).to(device)
    recv = torch.empty(world, dtype=torch.int64, device=device)
    dist.all_to_all_single(recv, splits.to(device))
    send_sizes, recv_sizes = splits.tolist(), recv.tolist()
    exact = torch.empty(sum(recv_sizes), HIDDEN, dtype=torch.bfloat16, device=device)
    row_bytes = HIDDEN * 2
    remote_rows = sum(recv_sizes) - recv_sizes[rank]
    base = {"model": model, "W": world, "rows_per_rank": N, "hidden": HIDDEN, "dtype": "bf16", "top_k": K,
            "recv_rows": sum(recv_sizes)}
    rows = []

    def add(transport: str, fn, buffer_rows: int, **extra) -> None:
        ms = _slowest(_time_ms(fn), device)
        rows.append({**base, "transport": transport, "ms": ms, "buffer_rows": buffer_rows,
                     "buffer_bytes": buffer_rows * row_bytes, **extra})

    add("nccl_exact", lambda: dist.all_to_all_single(exact, data, recv_sizes, send_sizes), sum(recv_sizes))
    for name, S in (("nccl_padded_bound", N), ("nccl_padded_cf1.25", math.ceil(1.25 * N / world))):
        send = torch.empty(world * S, HIDDEN, dtype=torch.bfloat16, device=device)
        got = torch.empty_like(send)
        add(name, lambda send=send, got=got: dist.all_to_all_single(got, send), world * S, S=S)
        del send, got
    # symmetric memory: the receive buffer holds the worst case (every rank sends this one all its rows)
    extra: dict = {}
    try:
        symm_mem.set_backend("NVSHMEM")
        group = dist.group.WORLD.group_name
        inp = symm_mem.empty((N, HIDDEN), dtype=torch.bfloat16, device=device)
        out = symm_mem.empty((world * N, HIDDEN), dtype=torch.bfloat16, device=device)
        in_splits = symm_mem.empty(world, dtype=torch.int64, device=device)
        out_splits_offsets = symm_mem.empty((2, world), dtype=torch.int64, device=device)
        for t in (inp, out, in_splits, out_splits_offsets):
            symm_mem.rendezvous(t, group=group)
        inp.copy_(data)
        in_splits.copy_(splits)

        def vdev() -> None:
            torch.ops.symm_mem.all_to_all_vdev(inp, out, in_splits, out_splits_offsets, group)

        def packed() -> torch.Tensor:
            sizes, offsets = out_splits_offsets.tolist()
            return torch.cat([out[o:o + s] for s, o in zip(sizes, offsets)])

        dist.barrier()
        vdev()
        torch.cuda.synchronize()
        dist.all_to_all_single(exact, data, recv_sizes, send_sizes)
        extra["same_rows_as_nccl"] = bool(torch.equal(packed(), exact))
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            vdev()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        dist.barrier()
        with torch.cuda.graph(graph):
            vdev()
        splits2 = torch.bincount(torch.randint(0, world, (N,), generator=gen), minlength=world)
        data2 = torch.randn(N, HIDDEN, generator=gen).to(torch.bfloat16).to(device)
        in_splits.copy_(splits2)
        inp.copy_(data2)
        torch.cuda.synchronize()
        dist.barrier()
        graph.replay()
        torch.cuda.synchronize()
        dist.all_to_all_single(recv, splits2.to(device))
        ref = torch.empty(int(recv.sum()), HIDDEN, dtype=torch.bfloat16, device=device)
        dist.all_to_all_single(ref, data2, recv.tolist(), splits2.tolist())
        extra["captured_replay_correct"] = bool(torch.equal(packed(), ref))
        in_splits.copy_(splits)
        inp.copy_(data)
        add("symm_mem_vdev", vdev, world * N, **extra)
        add("symm_mem_vdev_graph", graph.replay, world * N, **extra)
    except Exception as exc:  # noqa: BLE001 - recorded: where NVSHMEM is missing, the portable transport stays
        rows.append({**base, "transport": "symm_mem_vdev", "ms": None,
                     "error": f"{type(exc).__name__}: {str(exc)[:300]}", **extra})
        if rank == 0:
            traceback.print_exc()
    for row in rows:
        row["remote_bytes"] = remote_rows * row_bytes
    return rows


def rank_main(args: argparse.Namespace) -> None:
    rank, world = args.rank, args.world
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{args.store}", rank=rank, world_size=world,
                            device_id=device)
    try:
        rows = []
        for model, K in TOP_K.items():
            rows += _exchange_rows(rank, world, model, K, device)
        if rank == 0:
            from benchmarks._bench_env import copy_bandwidth

            bw = copy_bandwidth()
            for row in rows:
                row["copy_floor_ms"] = 2 * row["remote_bytes"] / bw * 1e3
            pathlib.Path(args.rows).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=None, help="ranks (default: every CUDA device)")
    parser.add_argument("--budget-s", type=float, default=150.0, help="the ranks are killed past it")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--store", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rows", default=None, help=argparse.SUPPRESS)
    add_results_args(parser)
    args = parser.parse_args(argv)
    if args.rank is not None:
        rank_main(args)
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    world = args.world or count
    if count < 2 or world > count:
        print(f"bench_ep_transport: skipped: needs {max(world, 2)} CUDA devices, this machine has {count}")
        return
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench_ep_transport_"))
    env = {**os.environ, **NO_MULTICAST,
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    common = ["--world", str(world), "--store", str(tmp / "store"), "--rows", str(tmp / "rows.json")]
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.bench_ep_transport", "--rank", str(r), *common],
                              cwd=REPO_ROOT, env=env) for r in range(world)]
    failed = []
    for r, p in enumerate(procs):
        try:
            p.wait(timeout=args.budget_s)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            p.wait()
        if p.returncode:
            failed.append(f"rank {r}: exit code {p.returncode}")
    rows = json.loads((tmp / "rows.json").read_text()) if (tmp / "rows.json").exists() else []
    for row in rows:
        ms = row["ms"]
        print(f"{row['model']} W={row['W']} {row['transport']}: "
              + (f"{ms:.3f} ms (floor {row['copy_floor_ms']:.3f})" if ms is not None else row.get("error", "")))
    if args.save and rows:
        write_results(results_path(args, "ep_transport", f"w{world}"), rows,
                      device_env(None, world=world, backend="nccl", failed=failed, rounds=ROUNDS, calls=CALLS))
    if failed:
        print("bench_ep_transport: " + "; ".join(failed))
        sys.exit(1)


if __name__ == "__main__":
    main()
