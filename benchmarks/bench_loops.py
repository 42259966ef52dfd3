"""MoE blocks written as Python loops over experts, bf16: eager vs plain Inductor vs moe_compile.

Blocks are ``tests/models/loop_models.py::LoopMoE`` (``nn.ModuleList`` of SwiGLU experts, softmax router,
top-k renormalised, a ``nonzero`` / ``torch.where`` / ``index_add_`` loop, as transformers 4.x wrote Mixtral):
Mixtral-like (T 4096, H 4096, I 3584, E 8, K 2) and Qwen3-MoE-like (T 4096, H 2048, I 768, E 128, K 8).
Variants:

* ``eager``: the loop as written;
* ``inductor``: ``torch.compile(block)`` (graph-breaks around the loop; the loop runs eagerly);
* ``moe``: ``moe_compile.compile(block)``: the block is swapped onto permute_pad -> grouped GEMMs ->
  unpad_unpermute over grouped views of the expert weights (``moe_compile/experts/swap.py``);
* ``moe_ro``: the same with ``mode="reduce-overhead"``;
* ``grouped_mm_moe``: the target: the same weights in transformers' block with
  ``_experts_implementation="grouped_mm"`` under ``moe_compile.compile`` (``fuse_dispatch`` path).

``fwd`` runs under ``no_grad``; ``fwd+bwd`` resets every parameter's gradient to ``None`` from a list made once
(as ``optimizer.zero_grad()`` does; walking ``block.parameters()`` through 128 expert modules costs more host time
than the layer itself), then runs forward and ``backward(grad_out)``. ``deterministic``:
output and every gradient bitwise equal over 20 runs. ``cuda_graph``: the ``moe`` forward captured with
``torch.cuda.graph(capture_error_mode="global")`` (any host sync or sync-requiring op fails the capture) and
replayed bitwise equal to the uncaptured call. ``vs_grouped_mm``: ``moe`` time / ``grouped_mm_moe`` time
(target <= 1.10), read on ``paired``: the two timed again interleaved, median of 7 rounds, with the host time per
call next to the wall time (:func:`time_paired`; at E=128 the loop's fwd+bwd does more host work per step, one
gradient view per expert parameter, and the variants' own rows are timed minutes apart).

Usage, from the repository root: ``python -m benchmarks.bench_loops [--save] [--quick]`` (``--save`` writes
``benchmarks/results/loops.json``; the rows of ``PAIRED`` carry the interleaved timings as ``paired_*``);
``--cpu-smoke`` runs the whole flow on CPU at tiny shapes (no timing worth reading, no CUDA graphs).
A time budget (``--budget-s``, default 150, shared equally by the configs; ``run_gpu.sh`` kills a benchmark at
240 s) skips the variants left once exceeded, least important last; run it alone with ``--budget-s 600`` for
the full table.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import statistics
import time

import torch

from benchmarks._bench_env import add_results_args, device_env, results_path, timed_calls, write_results

# most important first: a variant started after the time budget is skipped
VARIANTS = ("eager", "moe", "grouped_mm_moe", "inductor", "moe_ro")
DETERMINISM_RUNS = 20


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    T: int
    H: int
    I: int  # noqa: E741 - expert intermediate size
    E: int
    K: int


CONFIGS = (
    Config("mixtral_loop", T=4096, H=4096, I=3584, E=8, K=2),
    Config("qwen3_moe_loop", T=4096, H=2048, I=768, E=128, K=8),
)
SMOKE_CONFIGS = (
    Config("mixtral_loop", T=16, H=32, I=48, E=8, K=2),
    Config("qwen3_moe_loop", T=16, H=32, I=16, E=16, K=4),
)


@dataclasses.dataclass
class Result:
    model: str
    variant: str
    fwd_ms: float
    fwd_bwd_ms: float
    compile_s: float
    deterministic_fwd: bool
    deterministic_bwd: bool
    out_err: float
    grad_err: float
    swapped: int
    cuda_graph: str = ""
    # NOTE [recycled gradient views] (moe_compile/experts/_grad_views.py) active (no CUDA graphs)
    recycled_grads: bool = False
    note: str = ""


def build_loop_block(cfg: Config, device: str) -> torch.nn.Module:
    """A ``LoopMoE`` with router std ``0.5/sqrt(H)`` and expert weights ``1/sqrt(fan_in)``, bf16."""
    from tests.models.loop_models import LoopMoE

    with torch.device(device):
        block = LoopMoE(hidden=cfg.H, inter=cfg.I, num_experts=cfg.E, top_k=cfg.K, mlp="swiglu")
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in block.named_parameters():
            std = 0.5 / cfg.H**0.5 if name.startswith("gate") else 1.0 / p.shape[-1] ** 0.5
            p.copy_(torch.randn(p.shape, generator=gen, device=device) * std)
    return block.to(torch.bfloat16)


def build_grouped_mm_block(cfg: Config, loop: torch.nn.Module, device: str) -> torch.nn.Module:
    """transformers' Mixtral / Qwen3-MoE block (``grouped_mm`` experts) holding ``loop``'s weights."""
    import transformers

    if cfg.name.startswith("mixtral"):
        config = transformers.MixtralConfig(hidden_size=cfg.H, intermediate_size=cfg.I, num_local_experts=cfg.E,
                                            num_experts_per_tok=cfg.K, router_jitter_noise=0.0)
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block
    else:
        config = transformers.Qwen3MoeConfig(hidden_size=cfg.H, moe_intermediate_size=cfg.I, num_experts=cfg.E,
                                             num_experts_per_tok=cfg.K, norm_topk_prob=True)
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
    config._experts_implementation = "grouped_mm"
    with torch.device(device):
        block = Block(config).to(torch.bfloat16)
    with torch.no_grad():
        block.gate.weight.copy_(loop.gate.weight)
        block.experts.gate_up_proj.copy_(torch.stack([torch.cat([e.w1.weight, e.w3.weight]) for e in loop.experts]))
        block.experts.down_proj.copy_(torch.stack([e.w2.weight for e in loop.experts]))
    return block


def _output(out):
    return out[0] if isinstance(out, tuple) else out


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


def _bitwise_repeat(run, n: int) -> bool:
    first = [t.clone() for t in run()]
    return all(all(torch.equal(a, b) for a, b in zip(first, run())) for _ in range(n - 1))


def _cpu_bench(fn, warmup: int = 1, rep: int = 3) -> float:
    for _ in range(warmup):
        fn()
    start = time.perf_counter()
    for _ in range(rep):
        fn()
    return (time.perf_counter() - start) / rep * 1e3


def _strict_capture(fn, x: torch.Tensor) -> str:
    """Capture ``fn(x)`` (no_grad) in a CUDA graph with global capture errors; replay must equal a plain call."""
    try:
        with torch.no_grad():
            want = _output(fn(x)).clone()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="global"):
                out = _output(fn(x))
            graph.replay()
            torch.cuda.synchronize()
        return "ok" if torch.equal(out, want) else "replay_differs"
    except Exception as err:  # noqa: BLE001 - reported, not raised
        return f"failed: {type(err).__name__}: {str(err)[:120]}"


def _steps(fn, x: torch.Tensor, grad_out: torch.Tensor, params: list[torch.Tensor]):
    """``(forward, step, xg)`` of one compiled variant (bound here, not to the caller's loop variables)."""
    xg = x.detach().requires_grad_(True)

    def step():
        torch.compiler.cudagraph_mark_step_begin()
        xg.grad = None
        for p in params:
            p.grad = None
        out = _output(fn(xg))
        out.backward(grad_out)
        return out

    def forward():
        torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():
            return _output(fn(x))

    return forward, step, xg


PAIRED = ("moe", "grouped_mm_moe")  # timed again interleaved: the ratio the target is read on
PAIRED_ROUNDS = 7
HOST_STEPS = 5  # calls issued back to back for the host time: few enough not to fill the launch queue


def time_paired(steps: dict[str, tuple], bench, device: str) -> dict[str, dict[str, float]]:
    """``{variant: {"fwd_ms", "fwd_bwd_ms", "host_fwd_ms", "host_fwd_bwd_ms"}}``: the median over
    ``PAIRED_ROUNDS`` rounds, each timing every variant once in alternating order (wall time, then host time per
    call: the issue time of ``HOST_STEPS`` calls after a sync, ``_bench_env.timed_calls``; where it is below the
    wall time the step is GPU-bound, and the difference is the host's margin). The loop's fwd+bwd hands out one
    gradient view per expert parameter (384 at E=128): on a slow host that is host-bound, so the two are timed
    interleaved (drift moves both alike) and the host time says how far from host-bound each is."""
    names = list(steps)
    fields = ("fwd_ms", "fwd_bwd_ms", "host_fwd_ms", "host_fwd_bwd_ms")
    times: dict[str, dict[str, list[float]]] = {n: {f: [] for f in fields} for n in names}
    for r in range(PAIRED_ROUNDS):
        for name in names if r % 2 == 0 else names[::-1]:
            forward, step = steps[name]
            times[name]["fwd_ms"].append(bench(forward, warmup=3, rep=25))
            times[name]["fwd_bwd_ms"].append(bench(step, warmup=3, rep=25))
            times[name]["host_fwd_ms"].append(timed_calls(forward, device, HOST_STEPS)[1] / 1e3)
            times[name]["host_fwd_bwd_ms"].append(timed_calls(step, device, HOST_STEPS)[1] / 1e3)
    return {n: {k: statistics.median(v) for k, v in fields.items()} for n, fields in times.items()}


def run_config(cfg: Config, deadline: float, quick: bool, device: str = "cuda") -> tuple[list[Result], dict]:
    """All variants of one block (``device="cpu"``: the smoke flow, no reduce-overhead / CUDA graphs), and the
    interleaved timing of ``PAIRED`` (:func:`time_paired`; empty when one of them did not run)."""
    import moe_compile
    from moe_compile import report

    if device == "cuda":
        import triton.testing

        bench = triton.testing.do_bench
    else:
        def bench(fn, warmup=1, rep=3):
            return _cpu_bench(fn)
    loop = build_loop_block(cfg, device)
    pristine = copy.deepcopy(loop)  # moe_compile.compile swaps ``loop`` in place; eager/inductor use this one
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(1, cfg.T, cfg.H, generator=gen, device=device).to(torch.bfloat16)
    grad_out = torch.randn(1, cfg.T, cfg.H, generator=gen, device=device).to(torch.bfloat16)
    results: list[Result] = []
    ref = None
    rep_ms = 30 if quick else 100
    kept: dict[str, tuple] = {}  # PAIRED variants stay compiled (and their caches open) for time_paired
    caches = contextlib.ExitStack()
    for variant in VARIANTS:
        if device != "cuda" and variant == "moe_ro":
            continue
        if time.perf_counter() > deadline:
            results.append(Result(cfg.name, variant, float("nan"), float("nan"), 0.0, False, False, float("nan"),
                                  float("nan"), 0, note="skipped: time budget"))
            continue
        if not (variant in PAIRED and kept):  # a reset would recompile the kept variant on its next call
            torch._dynamo.reset()
        # moe_ro gets its own copy: a block compiled with CUDA graphs no longer recycles its gradient views
        block = {"eager": pristine, "inductor": pristine, "moe": loop}.get(variant)
        if variant == "moe_ro":
            block = copy.deepcopy(pristine)
        if variant == "grouped_mm_moe":
            block = build_grouped_mm_block(cfg, pristine, device)
        fn = {"eager": lambda: block,
              "inductor": lambda: torch.compile(block),
              "moe": lambda: moe_compile.compile(block),
              "moe_ro": lambda: moe_compile.compile(block, mode="reduce-overhead"),
              "grouped_mm_moe": lambda: moe_compile.compile(block)}[variant]()
        fresh = getattr(torch._inductor.utils, "fresh_cache", None) or torch._inductor.utils.fresh_inductor_cache
        cache = contextlib.ExitStack()
        cache.enter_context(fresh())
        params = list(block.parameters())  # as an optimizer holds them: zero_grad walks a list, not the modules
        forward, step, xg = _steps(fn, x, grad_out, params)

        start = time.perf_counter()
        forward()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        compile_s = time.perf_counter() - start
        fwd_ms = bench(forward, warmup=10, rep=rep_ms)
        fwd_bwd_ms = bench(step, warmup=5, rep=rep_ms)

        def forward_backward(step=step, xg=xg, params=params):
            out = step()
            return [out.detach(), xg.grad, *(p.grad for p in params if p.grad is not None)]

        runs = DETERMINISM_RUNS if device == "cuda" else 2
        det_fwd = _bitwise_repeat(lambda: [forward()], runs)
        det_bwd = _bitwise_repeat(forward_backward, runs)
        outs = forward_backward()
        if ref is None:
            ref = outs
        out_err, grad_err = _max_rel(outs[0], ref[0]), _max_rel(outs[1], ref[1])
        swapped = sum(1 for r in report.module_records(block) if r.kind == "rewrite")
        graph = _strict_capture(fn, x) if device == "cuda" and variant == "moe" else ""
        grad_views = getattr(getattr(block, "_moe_compile_views", None), "grad_views", [])
        results.append(Result(cfg.name, variant, fwd_ms, fwd_bwd_ms, compile_s, det_fwd, det_bwd, out_err,
                              grad_err, swapped, graph, any(v.recycle for v in grad_views)))
        if variant in PAIRED:
            kept[variant] = (forward, step)
            caches.enter_context(cache)
        else:
            del fn, forward, step
            cache.close()
    paired = time_paired(kept, bench, device) if len(kept) == len(PAIRED) else {}
    kept.clear()
    caches.close()
    torch._dynamo.reset()
    return results, paired


def vs_grouped_mm(results: list[Result], paired: dict[str, dict]) -> list[str]:
    """``moe`` (and ``moe_ro``, eager, inductor) over ``grouped_mm_moe``, forward and forward+backward, from the
    per-variant timings; then ``moe`` over ``grouped_mm_moe`` timed interleaved (``paired[model]``), the ratio
    the target (<= 1.10) is read on."""
    by = {(r.model, r.variant): r for r in results}
    lines = []
    for model in dict.fromkeys(r.model for r in results):
        target = by.get((model, "grouped_mm_moe"))
        for ours in ("moe", "moe_ro", "eager", "inductor"):
            mine = by.get((model, ours))
            if target is None or mine is None:
                continue
            for field in ("fwd_ms", "fwd_bwd_ms"):
                ratio = getattr(mine, field) / getattr(target, field)
                lines.append(f"{model} {ours} {field}: {getattr(mine, field):.3f} vs grouped_mm_moe "
                             f"{getattr(target, field):.3f} -> {ratio:.2f}x")
        pair = paired.get(model)
        if pair:
            for field in ("fwd_ms", "fwd_bwd_ms"):
                mine, theirs = pair["moe"][field], pair["grouped_mm_moe"][field]
                host = f"host_{field}"
                lines.append(f"{model} moe {field}, interleaved (median of {PAIRED_ROUNDS} rounds): {mine:.3f} vs "
                             f"grouped_mm_moe {theirs:.3f} -> {mine / theirs:.2f}x (target <= 1.10); host time "
                             f"{pair['moe'][host]:.3f} vs {pair['grouped_mm_moe'][host]:.3f}")
    return lines


def rows_with_paired(results: list[Result], paired: dict[str, dict]) -> list[dict]:
    """One row per (model, variant); the rows of ``PAIRED`` carry their interleaved timings as ``paired_<field>``
    (:func:`time_paired`), the other rows ``None`` there."""
    fields = ("fwd_ms", "fwd_bwd_ms", "host_fwd_ms", "host_fwd_bwd_ms")
    rows = []
    for r in results:
        pair = paired.get(r.model, {}).get(r.variant, {})
        rows.append({**dataclasses.asdict(r), **{f"paired_{f}": pair.get(f) for f in fields}})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_results_args(parser)
    parser.add_argument("--quick", action="store_true", help="shorter timing loops")
    # run_gpu.sh kills a benchmark at 240 s: each config gets its share of the budget
    parser.add_argument("--budget-s", type=float, default=150.0)
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU: checks the flow runs")
    args, _ = parser.parse_known_args()
    device = "cpu" if args.cpu_smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("bench_loops: no CUDA device, nothing to measure (this benchmark needs a GPU; --cpu-smoke runs the flow)")
        return
    start = time.perf_counter()
    configs = SMOKE_CONFIGS if args.cpu_smoke else CONFIGS
    if args.cpu_smoke:
        args.budget_s = float("inf")  # the smoke run checks every variant's flow, however slow CPU compiles are
    results: list[Result] = []
    paired: dict[str, dict] = {}
    for i, cfg in enumerate(configs):
        deadline = start + args.budget_s * (i + 1) / len(configs)
        config_results, paired[cfg.name] = run_config(cfg, deadline, args.quick, device)
        results.extend(config_results)
    env = device_env(device=None if device == "cuda" else "cpu (smoke)", wall_s=round(time.perf_counter() - start, 1))
    ratios = vs_grouped_mm(results, paired)
    if args.save:
        write_results(
            results_path(args, "loops", "cpu_smoke" if args.cpu_smoke else None), rows_with_paired(results, paired), env
        )
    print(f"device={env['device']} torch={env['torch']} triton={env['triton']}")
    header = ("model", "variant", "fwd ms", "fwd+bwd ms", "det f/b", "out err", "grad err", "swapped", "cuda graph",
              "compile s")
    rows = [(r.model, r.variant, f"{r.fwd_ms:.3f}", f"{r.fwd_bwd_ms:.3f}",
             f"{r.deterministic_fwd}/{r.deterministic_bwd}", f"{r.out_err:.2e}", f"{r.grad_err:.2e}", str(r.swapped),
             r.cuda_graph or "-", f"{r.compile_s:.1f}" + (f" {r.note}" if r.note else "")) for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    for line in ratios:
        print(line)


if __name__ == "__main__":
    main()
