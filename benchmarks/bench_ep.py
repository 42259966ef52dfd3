"""Expert parallelism over ``W`` GPUs (issue 38): a 2-layer decoder per rank, each layer RMSNorm + causal SDPA attention
+ RMSNorm + an expert-parallel MoE written as torchtitan's ``ExpertParallel``
(:class:`~tests.models.ep_layers.TitanStyleEP`: counts all-to-all, ``.tolist()`` split sizes, rows exchanged at
them, regroup, ``torch._grouped_mm``, and back), one training step (forward, backward, AdamW) per rank.

Variants, each on its own copy of the same weights:

* ``eager``: the host-synced exchange as written (two host reads of the split sizes per layer forward).
* ``inductor``: plain ``torch.compile``: graph breaks at the host reads (and at ``bincount``), the exchange at
  host-read split sizes between compiled graphs.
* ``moe_compile``: ``moe_compile.compile(model)``: the ``expert_parallel`` pass makes each exchange a static padded
  all-to-all (``[W*S, H]`` at equal splits, ``S`` the bound ``T*min(K, L)``: no row dropped), no host read.
* ``moe_compile_cf1.25``: the same with ``ep_capacity_factor=1.25``: ``S = ceil(1.25 * N / W)``, rows past ``S`` per
  destination dropped; ``dropped_fraction`` is counted from the routing at the initial weights and tokens (rows
  each rank sends one rank past ``S``, over all routed rows of all layers and ranks).
* ``moe_compile_graphs`` / ``moe_compile_graphs_cf1.25``: the same two under ``mode="reduce-overhead"`` with strict
  capture (``triton.cudagraph_or_error``, no graph partition: the whole forward and backward each one CUDA graph;
  AdamW runs outside), what the rewrite makes possible: the host-synced exchange cannot be captured. CUDA only.

Every ``moe_compile`` variant but the last is compiled with ``deterministic=True`` (the bitwise promise is one of the
targets); eager and plain Inductor run as users run them (cuDNN's attention backward adds dQ with atomics there).
``moe_compile_graphs_cf1.25_nondeterministic`` is ``moe_compile_graphs_cf1.25`` without the option: what the
exchange's rewrite gains with attention as plain Inductor runs it (the exchange itself is in a fixed order either
way; attention's backward then is not).

AdamW is torch's fused implementation (torchtitan's default) unless ``--optimizer foreach``: the optimizer is the same
in every variant, and the foreach one (31 launches per kernel) is a third of the step on its own.

Per variant: the step's wall time (median over interleaved rounds after warm-up of the slowest rank's time per
round), the GPU kernel time of one profiled step (sum over kernels, rank 0; NCCL kernels count their waiting), split
into NCCL / optimizer / attention / GEMM / the rest (``kernel_ms_<kind>``), and its 15 longest kernels, the exchange
buffer (``moe_compile``: the static ``[W*S, H]`` send / receive buffer from the rewrite's record; eager and Inductor:
the received rows, which vary per step: mean and max over layers and ranks at the initial weights),
whether 10 AdamW steps run twice from the same weights give the same bits (losses and every parameter, every rank),
and the graphs / graph breaks of the compile. The replicated parameters (attention, norms, router) are not
all-reduced across ranks (data parallelism over them is not part of the step timed here).

One entry point launches one process per GPU (``file://`` rendezvous, NCCL; NVLink multicast off) and writes rank 0's
rows: ``python -m benchmarks.bench_ep [--save] [--world W] [--models qwen3_moe,deepseek_v3] [--budget-s S]`` writes
``benchmarks/results/ep_w<W>.json``; with fewer than 2 CUDA devices it prints why and exits 0. ``--device cpu``
runs a small configuration over gloo (a check of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks._bench_env import REPO_ROOT, add_results_args, device_env, results_path, sync, write_results

# compile order: the core comparison first
VARIANTS = ("eager", "moe_compile", "inductor", "moe_compile_cf1.25", "moe_compile_graphs", "moe_compile_graphs_cf1.25",
            "moe_compile_graphs_cf1.25_nondeterministic")
CUDA_ONLY = ("moe_compile_graphs", "moe_compile_graphs_cf1.25", "moe_compile_graphs_cf1.25_nondeterministic")
# strict capture (as tests/models/_ep_gpu_worker.py): a part Inductor cannot capture raises instead of running eagerly
STRICT = {"graph_partition": False, "triton.cudagraph_or_error": True}
CAPACITY_FACTOR = 1.25
LAYERS, BATCH, SEQ = 2, 2, 2048
# MHA, 16 heads of 128 (Qwen3-30B-A3B has GQA 32 / 4 heads, DeepSeek-V3 latent attention; the MoE is the subject)
MODELS = {
    "qwen3_moe": {"hidden": 2048, "experts": 128, "top_k": 8, "inter": 768, "heads": 16},
    "deepseek_v3": {"hidden": 2048, "experts": 64, "top_k": 6, "inter": 1408, "heads": 16},
}
SMALL = {"hidden": 64, "experts": 8, "top_k": 2, "inter": 32, "heads": 2}  # --device cpu / --quick
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class EPDecoderLayer(nn.Module):
    """RMSNorm, causal SDPA attention, RMSNorm, expert-parallel MoE; residuals around both."""

    def __init__(self, hidden: int, heads: int, inter: int, experts: int, top_k: int) -> None:
        from tests.models.ep_layers import TitanStyleEP

        super().__init__()
        self.heads = heads
        self.attn_norm = nn.RMSNorm(hidden, eps=1e-6)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.moe_norm = nn.RMSNorm(hidden, eps=1e-6)
        self.moe = TitanStyleEP(hidden=hidden, inter=inter, experts=experts, top_k=top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, H = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(B, S, 3, self.heads, H // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(B, S, H))
        return x + self.moe(self.moe_norm(x).view(B * S, H)).view(B, S, H)


class EPDecoder(nn.Module):
    def __init__(self, layers: int, **cfg: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EPDecoderLayer(**cfg) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


# ===== one rank =====


class _Rank:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.rank, self.world = args, args.rank, args.world
        self.cuda = args.device == "cuda"
        self.device = torch.device("cuda", self.rank) if self.cuda else torch.device("cpu")
        self.dtype = torch.bfloat16
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def agree(self, ok: bool) -> bool:
        """True on every rank only if ``ok`` on every rank (the ranks must take the same branches: collectives)."""
        flag = torch.tensor([int(ok)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def max_over_ranks(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def sync(self) -> None:
        sync(self.device.type)


def _base_state(cfg: dict, layers: int, rank: int, device: torch.device) -> dict:
    """Initial weights: the replicated ones (attention, norms, router) the same on every rank, each rank's experts
    its own; bf16."""
    with torch.device(device):
        torch.manual_seed(0)
        model = EPDecoder(layers, **cfg)
        torch.manual_seed(100 + rank)
        with torch.no_grad():
            for layer in model.layers:
                for p in (layer.moe.w_gate_up, layer.moe.w_down):
                    p.copy_(torch.randn_like(p) * p.shape[1] ** -0.5)
    return {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}


def _fresh(cfg: dict, layers: int, state: dict, device: torch.device) -> EPDecoder:
    with torch.device("meta"):
        model = EPDecoder(layers, **cfg)
    model = model.to_empty(device=device).to(torch.bfloat16)
    model.load_state_dict(state)
    return model


def _routing(r: _Rank, model: EPDecoder, x: torch.Tensor, S_cf: int) -> dict:
    """Rows each rank receives per layer in the host-synced exchange, and the rows that ``S_cf`` drops, at the
    current weights (one forward of ``model``)."""
    counts: list[torch.Tensor] = []

    def hook(module, inputs):
        h = inputs[0]
        _, ids = module.router(h).softmax(-1).topk(module.top_k, dim=-1)
        counts.append(torch.bincount(ids.flatten(), minlength=module.experts))

    handles = [layer.moe.register_forward_pre_hook(hook) for layer in model.layers]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    mine = torch.stack(counts)  # [layers, E]
    parts = [torch.empty_like(mine) for _ in range(r.world)]
    dist.all_gather(parts, mine.contiguous())
    every = torch.stack(parts)  # [source rank, layer, E]
    W, L = r.world, mine.shape[1] // r.world
    by = every.view(W, mine.shape[0], W, L).sum(-1)  # [source rank, layer, destination rank]
    recv = by.sum(0)  # [layer, destination]
    routed = int(by.sum())
    dropped = int((by - S_cf).clamp(min=0).sum())
    return {"recv_rows_mean": float(recv.double().mean()), "recv_rows_max": int(recv.max()),
            "dropped_fraction_cf": dropped / routed, "routed_rows": routed}


def _adamw(r: _Rank, model: nn.Module) -> torch.optim.AdamW:
    """AdamW as ``--optimizer`` says: ``fused`` (torchtitan's default implementation: one kernel per dtype and device
    group) or ``foreach`` on the GPU; the per-parameter loop on CPU."""
    if not r.cuda:
        return torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    fused = r.args.optimizer == "fused"
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused, foreach=not fused)


def _compile(variant: str, model: nn.Module):
    import moe_compile

    if variant == "eager":
        return model
    if variant == "inductor":
        return torch.compile(model)
    kwargs: dict = {"deterministic": not variant.endswith("_nondeterministic")}
    if "cf1.25" in variant:
        kwargs["ep_capacity_factor"] = CAPACITY_FACTOR
    if "_graphs" in variant:
        kwargs["mode"] = "reduce-overhead"
    return moe_compile.compile(model, **kwargs)


def _run_model(r: _Rank, name: str, cfg: dict, batch: int, seq: int, save) -> tuple[list[dict], dict]:
    """Rows of one model's variants (``save(rows, notes)`` gets them once timed, and again with the extras)."""
    from moe_compile import report

    args, counters = r.args, torch._dynamo.utils.counters
    H, E, K, W = cfg["hidden"], cfg["experts"], cfg["top_k"], r.world
    L, T = E // W, batch * seq
    N = T * K
    bound = T * min(K, L)
    S_cf = max(1, min(bound, math.ceil(CAPACITY_FACTOR * N / W)))
    state = _base_state(cfg, LAYERS, r.rank, r.device)
    gen = torch.Generator().manual_seed(1000 + r.rank)
    x = torch.randn(batch, seq, H, generator=gen).to(device=r.device, dtype=r.dtype)
    cot = torch.randn(batch, seq, H, generator=gen).to(device=r.device, dtype=r.dtype)
    models, fns, opts, info = {}, {}, {}, {}
    notes: dict = {}
    torch._dynamo.reset()

    def forward_backward(variant: str) -> torch.Tensor:
        opts[variant].zero_grad(set_to_none=True)
        if "_graphs" in variant:
            torch.compiler.cudagraph_mark_step_begin()
        loss = (fns[variant](x).float() * cot.float()).sum()
        loss.backward()
        return loss.detach()

    def step(variant: str) -> torch.Tensor:
        loss = forward_backward(variant)
        opts[variant].step()
        return loss

    for variant in VARIANTS:
        if variant not in args.variants.split(",") or variant in CUDA_ONLY and not r.cuda:
            continue
        if not r.agree(r.elapsed() < args.budget_s * 0.7):
            notes.setdefault("skipped", []).append(f"{variant}: time budget")
            continue
        models[variant] = _fresh(cfg, LAYERS, state, r.device)
        opts[variant] = _adamw(r, models[variant])
        fns[variant] = _compile(variant, models[variant])
        breaks = sum(counters["graph_break"].values())
        graphs = counters["stats"]["unique_graphs"]
        skips_before = counters["inductor"]["cudagraph_skips"]
        strict = torch._inductor.config.patch(STRICT) if "_graphs" in variant else contextlib.nullcontext()
        try:
            with report.collecting() as rep, strict:
                t = time.perf_counter()
                step(variant)
                r.sync()
                first_s = time.perf_counter() - t
                for _ in range(args.warmup):  # plain Inductor recompiles once the split sizes change (dynamic)
                    step(variant)
                r.sync()
            error = None
        except Exception as exc:  # noqa: BLE001 - recorded; every rank fails the same way (same program)
            error = f"{type(exc).__name__}: {str(exc)[:400]}"
            first_s = None
        ok = r.agree(error is None)
        if not ok:
            info[variant] = {"error": error or "failed on another rank"}
            for d in (models, fns, opts):
                d.pop(variant, None)
            continue
        ep = [rec for rec in rep.rewrites if rec.pass_name == "expert_parallel"]
        detail = ep[0].detail if ep else ""
        info[variant] = {
            "first_step_s": first_s, "graph_breaks": sum(counters["graph_break"].values()) - breaks,
            "graphs": counters["stats"]["unique_graphs"] - graphs, "ep_rewrites": len(ep),
            "cudagraph_skips": counters["inductor"]["cudagraph_skips"] - skips_before,
            "ep_detail": detail[:400],
            "buffer_bytes": int(detail.split(" bytes per buffer")[0].rsplit(" ", 1)[-1]) if ep else None,
            "S": int(detail.split("(S=")[1].split(",")[0]) if ep else None,
            "host_reads_left": sorted({rec.what for rec in rep.left if "_local_scalar_dense" in rec.what}),
            "ep_skips": sorted({f"{rec.what}: {rec.detail}"[:400] for rec in rep.skips
                                if rec.pass_name == "expert_parallel"}),
            "pass_errors": sorted({f"{rec.pass_name}: {rec.detail}"[:400] for rec in rep.records
                                   if rec.kind == "error"}),
        }
        if r.rank == 0:
            print(f"{name} {variant}: first step {first_s:.1f} s, ep rewrites {len(ep)}, "
                  f"graph breaks {info[variant]['graph_breaks']}, graphs {info[variant]['graphs']}"
                  + "".join(f"\n  expert_parallel skipped: {why}" for why in info[variant]["ep_skips"])
                  + "".join(f"\n  pass error: {why}" for why in info[variant]["pass_errors"]), flush=True)
    live = list(fns)
    routing = _routing(r, models["eager"], x, S_cf) if "eager" in models else {}
    if args.start_timing_after:  # another job shared the GPUs during the compiles: time once it is done
        waited = time.perf_counter()
        while not os.path.exists(args.start_timing_after) and r.elapsed() < args.budget_s * 0.75:
            time.sleep(1.0)
        notes["waited_s"] = time.perf_counter() - waited
        notes["timed_alone"] = r.agree(os.path.exists(args.start_timing_after))
    graphs_before = counters["stats"]["unique_graphs"]
    times: dict[str, list[float]] = {v: [] for v in live}
    for rnd in range(args.rounds):
        order = live[rnd % len(live):] + live[:rnd % len(live)]
        for variant in order:
            graphs = counters["stats"]["unique_graphs"]
            step(variant)
            r.sync()
            dist.barrier()
            r.sync()
            t = time.perf_counter()
            for _ in range(args.steps):
                step(variant)
            r.sync()
            times[variant].append((time.perf_counter() - t) / args.steps * 1e3)
            info[variant]["recompiles_during_timing"] = (info[variant].get("recompiles_during_timing", 0)
                                                         + counters["stats"]["unique_graphs"] - graphs)
    notes["recompiles_during_timing"] = counters["stats"]["unique_graphs"] - graphs_before
    slowest = {v: r.max_over_ranks(times[v]) for v in live}
    extra: dict[str, dict] = {v: {} for v in live}
    notes["bound_rows_S"] = bound

    def build_rows(show: bool) -> list[dict]:
        return [_row(r, variant, name, cfg, batch, seq, info, slowest, times, extra, routing, S_cf, show)
                for variant in VARIANTS]

    save(build_rows(False), notes)  # the times, before the extras (which the deadline may cut)
    for variant in live:
        if r.agree(r.elapsed() < args.budget_s * 0.85):
            extra[variant].update(_kernel_profile(r, lambda v=variant: step(v)))
            extra[variant]["fwd_bwd_extra_gb"] = _step_memory_gb(r, lambda v=variant: forward_backward(v))
    for variant in live:
        if r.agree(r.elapsed() < args.budget_s * 0.9):
            extra[variant]["bitwise_10_steps"] = _reproducible(r, models[variant], state, step, variant, opts)
    rows = build_rows(True)
    for d in (fns, opts, models):
        d.clear()
    torch._dynamo.reset()
    if r.cuda:
        torch.cuda.empty_cache()
    return rows, notes


def _row(r: _Rank, variant: str, name: str, cfg: dict, batch: int, seq: int, info: dict, slowest: dict, times: dict,
         extra: dict, routing: dict, S_cf: int, show: bool) -> dict:
    args, W, H = r.args, r.world, cfg["hidden"]
    L, T = cfg["experts"] // W, batch * seq
    N = T * cfg["top_k"]
    row = {"model": name, "W": W, "tokens_per_rank": T, "batch": batch, "seq": seq, "layers": LAYERS, **cfg,
           "local_experts": L, "routed_rows": N, "dtype": "bf16", "variant": variant,
           "capacity_factor": CAPACITY_FACTOR if "cf1.25" in variant else None,
           "step_ms": None, "step_ms_rank0": None, "rounds": args.rounds, "kernel_ms": None,
           "fwd_bwd_extra_gb": None, "bitwise_10_steps": None, "buffer_rows": None, "buffer_bytes": None,
           "dropped_fraction": None, "error": None}
    row.update({k: v for k, v in info.get(variant, {}).items()})
    if variant in slowest:
        row["step_ms"] = statistics.median(slowest[variant])
        row["step_ms_rank0"] = statistics.median(times[variant])
        row["step_ms_rounds"] = [round(t, 4) for t in slowest[variant]]
    row.update(extra.get(variant, {}))
    if row.get("S") is not None:
        row["buffer_rows"] = W * row["S"]
    elif variant in ("eager", "inductor") and routing:
        row["buffer_rows"] = routing["recv_rows_mean"]
        row["buffer_rows_max"] = routing["recv_rows_max"]
        row["buffer_bytes"] = int(routing["recv_rows_max"] * H * 2)
    if variant in ("moe_compile", "moe_compile_graphs"):
        row["dropped_fraction"] = 0.0
    elif "cf1.25" in variant and routing:
        row["dropped_fraction"] = routing["dropped_fraction_cf"]
        row["S_expected"] = S_cf
    if show and r.rank == 0 and row["step_ms"] is not None:
        print(f"{name} W={W} {variant}: {row['step_ms']:.2f} ms/step (kernels {row['kernel_ms']}), "
              f"buffer {row['buffer_bytes']} B, bitwise 10 steps {row['bitwise_10_steps']}"
              + (f"\n  longest kernels: {row['kernels_top']}" if row.get("kernels_top") else ""), flush=True)
    return row


KERNEL_KINDS = ("nccl", "optimizer", "attention", "gemm", "other")


def _kernel_kind(name: str) -> str:
    """Which part of the step a CUDA kernel belongs to, by its name (NCCL, the AdamW kernels, SDPA's forward and
    backward, cuBLAS / CUTLASS / Triton matmuls, the rest). Torch's foreach kernels count as the optimizer: AdamW's
    are nearly all of them (the CUDA-graph variants' input copies, one ``[B, S, H]`` tensor a step, are the rest)."""
    low = name.lower()
    if low.startswith("nccl"):
        return "nccl"
    if "multi_tensor_apply" in low or "adam" in low:
        return "optimizer"
    if any(k in low for k in ("flash", "sdpa", "fmha", "attention", "attn")):
        return "attention"
    if any(k in low for k in ("gemm", "nvjet", "cutlass", "xmma", "matmul", "_mm_", "sm90_", "grouped_mm")):
        return "gemm"
    return "other"


def _kernel_profile(r: _Rank, run, top: int = 15) -> dict:
    """GPU kernel time of one step (rank 0's profile), split by :func:`_kernel_kind`, and its ``top`` kernels by time
    (``name ms xcalls``, joined by `` | ``: results rows are flat)."""
    if not r.cuda:
        return {}
    from torch.profiler import ProfilerActivity, profile

    r.sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        r.sync()
    kernels = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    by_kind = dict.fromkeys(KERNEL_KINDS, 0.0)
    for e in kernels:
        by_kind[_kernel_kind(e.key)] += e.self_device_time_total / 1e3
    return {"kernel_ms": sum(e.self_device_time_total for e in kernels) / 1e3,
            **{f"kernel_ms_{kind}": round(ms, 4) for kind, ms in by_kind.items()},
            "kernels_top": " | ".join(f"{e.key[:90]} {e.self_device_time_total / 1e3:.3f} x{e.count}"
                                      for e in kernels[:top])}


def _step_memory_gb(r: _Rank, run) -> float | None:
    """Peak memory of a forward and backward past what is resident (every variant's weights and optimizer states;
    the optimizer step is left out: foreach AdamW's temporaries, the size of the parameters, would be the peak)."""
    if not r.cuda:
        return None
    r.sync()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    r.sync()
    return (torch.cuda.max_memory_allocated() - before) / 2**30


def _reproducible(r: _Rank, model: nn.Module, state: dict, step, variant: str, opts: dict) -> bool:
    """10 AdamW steps from ``state`` twice (a new optimizer each time): the same losses and parameters, bitwise,
    on every rank."""
    runs = []
    for _ in range(2):
        model.load_state_dict(state)
        opts[variant] = _adamw(r, model)
        losses = torch.stack([step(variant) for _ in range(10)])
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
    (l0, p0), (l1, p1) = runs
    same = torch.equal(l0, l1) and all(torch.equal(a, b) for a, b in zip(p0, p1))
    return r.agree(same)


def rank_main(args: argparse.Namespace) -> None:
    r = _Rank(args)
    if r.cuda:
        torch.cuda.set_device(r.device)
    kwargs = {"device_id": r.device} if r.cuda else {}
    dist.init_process_group("nccl" if r.cuda else "gloo", init_method=f"file://{args.store}", rank=r.rank,
                            world_size=r.world, timeout=datetime.timedelta(seconds=300), **kwargs)
    torch._dynamo.config.recompile_limit = 32
    rows: list[dict] = []
    notes: dict = {}
    try:
        started = None
        for name in args.models:
            if started is not None:  # the next model only if it fits in what is left (compiles are most of it)
                took = r.elapsed() - started
                if not r.agree(r.elapsed() + 0.8 * took < args.budget_s):
                    notes[name] = f"skipped: time budget ({args.budget_s} s; the previous model took {took:.0f} s)"
                    continue
            started = r.elapsed()
            cfg = SMALL if args.quick else MODELS[name]
            batch, seq = (1, 64) if args.quick else (BATCH, SEQ)
            def save(model_rows: list[dict], model_notes: dict, name: str = name) -> None:
                # rank 0, as soon as a model is timed: a deadline later on leaves these
                if r.rank == 0:
                    done = {"rows": rows + model_rows, "notes": {**notes, name: model_notes}}
                    pathlib.Path(args.rows).write_text(json.dumps(done))

            model_rows, model_notes = _run_model(r, name, cfg, batch, seq, save)
            rows += model_rows
            notes[name] = model_notes
            save([], model_notes)
    finally:
        dist.destroy_process_group()
    if r.rank == 0:
        pathlib.Path(args.rows).write_text(json.dumps({"rows": rows, "notes": notes, "wall_s": r.elapsed()}))


# ===== the entry point: one process per GPU =====


def _print_targets(rows: list[dict]) -> None:
    by = {(r["model"], r["W"], r["variant"]): r["step_ms"] for r in rows}
    for model, W in sorted({(r["model"], r["W"]) for r in rows}):
        eager, plain = by.get((model, W, "eager")), by.get((model, W, "inductor"))
        for variant in VARIANTS[1:]:
            if variant == "inductor":
                continue
            ours = by.get((model, W, variant))
            if not ours:
                print(f"target {model} W={W} {variant}: no time measured")
                continue
            vs_plain = f"{plain / ours:.2f}x" if plain else "n/a"
            vs_eager = f"{eager / ours:.2f}x" if eager else "n/a"
            print(f"target {model} W={W}: {variant} vs plain Inductor host-synced EP: {vs_plain} (target >= 1.2x); "
                  f"{variant} vs eager host-synced EP: {vs_eager} (target > 1x)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=None, help="ranks (default: every CUDA device)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {list(MODELS)}")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {list(VARIANTS)}")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=3, help="steps after the first (compiling) one")
    parser.add_argument("--budget-s", type=float, default=220.0,
                        help="wall time the ranks aim to finish in: later models and extras are skipped past it")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="kill the ranks after this many seconds and write what they finished (default: the "
                             "budget + 150 s)")
    parser.add_argument("--optimizer", default="fused", choices=("fused", "foreach"),
                        help="AdamW's implementation on the GPU (fused: torchtitan's default)")
    parser.add_argument("--quick", action="store_true", help="a small configuration (checks the script)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: gloo, small configuration")
    parser.add_argument("--start-timing-after", default=None, metavar="PATH",
                        help="time the steps only once PATH exists (another job shares the GPUs while this one "
                             "compiles), or once three quarters of the budget are gone; notes record which")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--store", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rows", default=None, help=argparse.SUPPRESS)
    add_results_args(parser)
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    for option, given, known in (("--models", args.models, MODELS), ("--variants", args.variants.split(","), VARIANTS)):
        if unknown := [v for v in given if v not in known]:
            parser.error(f"{option}: unknown {unknown}; choose from {list(known)}")
    if args.device == "cpu":
        args.quick = True
    if args.rank is not None:
        rank_main(args)
        return
    if args.device == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count < 2:
            print(f"bench_ep: skipped: needs at least 2 CUDA devices, this machine has {count}")
            return
        args.world = args.world or count
        if args.world > count:
            print(f"bench_ep: skipped: --world {args.world} > {count} CUDA devices")
            return
    else:
        args.world = args.world or 2
    _launch(args)


def _launch(args: argparse.Namespace) -> None:
    W = args.world
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench_ep_"))
    rows_path = tmp / "rows.json"
    env = {**os.environ, **NO_MULTICAST,
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
           "PYTHONUNBUFFERED": "1"}
    common = ["--world", str(W), "--store", str(tmp / "store"), "--rows", str(rows_path), "--models",
              ",".join(args.models), "--variants", args.variants, "--rounds", str(args.rounds), "--steps",
              str(args.steps), "--warmup", str(args.warmup), "--budget-s", str(args.budget_s), "--device", args.device,
              "--optimizer", args.optimizer,
              *(["--quick"] if args.quick else []),
              *(["--start-timing-after", args.start_timing_after] if args.start_timing_after else [])]
    logs = [open(tmp / f"rank{rank}.log", "w") for rank in range(1, W)]
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.bench_ep", "--rank", str(rank), *common],
                              cwd=REPO_ROOT, env=env, stdout=None if rank == 0 else logs[rank - 1],
                              stderr=subprocess.STDOUT)
             for rank in range(W)]
    deadline = time.monotonic() + (args.deadline_s or args.budget_s + 150)
    failed = []
    for rank, p in enumerate(procs):
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            failed.append(f"rank {rank}: killed at the deadline")
            for q in procs:
                if q.poll() is None:
                    q.kill()
            p.wait()
        if p.returncode:
            failed.append(f"rank {rank}: exit code {p.returncode}")
    for f in logs:
        f.close()
    if failed:
        print("bench_ep: " + "; ".join(failed))
        for rank in range(1, W):
            print(f"--- rank {rank} log tail:\n" + (tmp / f"rank{rank}.log").read_text()[-3000:])
    data = json.loads(rows_path.read_text()) if rows_path.exists() else {"rows": [], "notes": {}}
    rows = data["rows"]
    _print_targets(rows)
    if args.save and rows:
        reduced = {m: "as the issue states" for m in args.models} if not args.quick else "small (--quick)"
        env = device_env("cpu (gloo)" if args.device == "cpu" else None, world=W, gpus=W,
                         models={m: (SMALL if args.quick else MODELS[m]) for m in args.models}, sizes=reduced,
                         tokens_per_rank="1 x 64" if args.quick else f"{BATCH} x {SEQ}", notes=data["notes"],
                         failed=failed, wall_s=data.get("wall_s"), backend="nccl" if args.device == "cuda" else "gloo",
                         attention="MHA, causal SDPA; no shared expert; replicated parameters not all-reduced",
                         optimizer=f"AdamW {args.optimizer if args.device == 'cuda' else 'for-loop'}")
        write_results(results_path(args, "ep", f"w{W}"), rows, env)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
