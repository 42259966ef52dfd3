"""HF sparse MoE blocks, bf16, forward and forward+backward: moe_compile vs eager vs plain Inductor.

Blocks are transformers' own ``MixtralSparseMoeBlock`` (T 4096, H 4096, I 3584, E 8, K 2),
``Qwen3MoeSparseMoeBlock`` (T 4096, H 2048, I 768, E 128, K 8), ``DeepseekV3MoE`` (H 2048, I 1408, E 64,
K 6; sigmoid router with selection bias and group-limited top-k, weights gathered from the scores, a
shared expert) and ``GptOssMLP`` (H 2880, I 2880, E 32, K 4; per-expert biases), built from a config with
``_experts_implementation="grouped_mm"`` and every parameter initialised. Variants:

* ``eager``: the block as is;
* ``inductor``: ``torch.compile(block)`` (default backend);
* ``moe``: ``torch.compile(block, backend="moe_compile")`` (``fuse_dispatch`` rewrites the dispatch,
  ``fuse_expert_mlp`` the gate_up GEMM + GLU into ``moe.expert_gemm``);
* ``moe_unfused``: the same without ``fuse_expert_mlp`` (the grouped GEMMs as transformers calls them);
* ``moe_ro`` / ``inductor_ro``: the same with ``mode="reduce-overhead"`` (CUDA graphs: no CPU launch
  overhead, which the custom ops' Python dispatch adds in default mode).

``fwd`` runs under ``no_grad``; ``fwd+bwd`` runs forward and ``backward(grad_out)`` w.r.t. the input and
every parameter; ``fwd+bwd kernel``: its GPU kernel time (``torch.profiler``, summed), for ``moe``,
``moe_unfused`` and ``inductor``: what issue 16's targets are stated in. ``floor``: FLOPs of the expert GEMMs
(``6*T*K*H*I`` forward, 3x that forward+backward) at the throughput a large bf16 ``mm`` reaches on this device.
``deterministic``: outputs and every gradient bitwise equal over 20 runs (forward and backward). ``err``:
max |out - eager| / max |eager| and the same for the input gradient.

Usage, from the repository root: ``python -m benchmarks.bench_moe_block [--save] [--quick]
[--models qwen3_moe,mixtral]`` (``--save`` writes ``benchmarks/results/moe_block.json``; ``--tag NAME`` writes
``moe_block_NAME.json`` instead, for a run that is not the default one).
A time budget (``--budget-s``, default 110) skips whatever is left once exceeded.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time

import torch

from benchmarks._bench_env import add_results_args, device_env, measured_mm_tflops, results_path, write_results

VARIANTS = ("eager", "moe", "moe_unfused", "inductor", "moe_ro", "inductor_ro")
KERNEL_TIMED = ("moe", "moe_unfused", "inductor")
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
    Config("mixtral", T=4096, H=4096, I=3584, E=8, K=2),
    Config("qwen3_moe", T=4096, H=2048, I=768, E=128, K=8),
    # sigmoid scores + selection bias, group-limited top-k (8 groups, 4 kept), weights gathered from the
    # scores (backward: a scatter-add at the top-k indices), one shared expert
    Config("deepseek_v3", T=4096, H=2048, I=1408, E=64, K=6),
    # per-expert biases on both projections (gathered by sorted expert ids), clamped GLU
    Config("gpt_oss", T=4096, H=2880, I=2880, E=32, K=4),
)


@dataclasses.dataclass
class Result:
    model: str
    variant: str
    fwd_ms: float
    fwd_bwd_ms: float
    fwd_floor_ms: float
    fwd_bwd_floor_ms: float
    compile_s: float
    deterministic_fwd: bool
    deterministic_bwd: bool
    out_err: float
    grad_err: float
    rewrites: int
    note: str = ""
    fwd_bwd_kernel_ms: float = float("nan")


def build_block(cfg: Config, device: str = "cuda") -> torch.nn.Module:
    import transformers

    if cfg.name == "mixtral":
        config = transformers.MixtralConfig(hidden_size=cfg.H, intermediate_size=cfg.I, num_local_experts=cfg.E,
                                            num_experts_per_tok=cfg.K, router_jitter_noise=0.0)
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block
    elif cfg.name == "deepseek_v3":
        config = transformers.DeepseekV3Config(hidden_size=cfg.H, moe_intermediate_size=cfg.I, n_routed_experts=cfg.E,
                                               num_experts_per_tok=cfg.K, n_group=8, topk_group=4, n_shared_experts=1,
                                               norm_topk_prob=True)
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as Block
    elif cfg.name == "gpt_oss":
        config = transformers.GptOssConfig(hidden_size=cfg.H, intermediate_size=cfg.I, num_local_experts=cfg.E,
                                           num_experts_per_tok=cfg.K)
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP as Block
    else:
        config = transformers.Qwen3MoeConfig(hidden_size=cfg.H, moe_intermediate_size=cfg.I, num_experts=cfg.E,
                                             num_experts_per_tok=cfg.K, norm_topk_prob=True)
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
    config._experts_implementation = "grouped_mm"
    with torch.device(device):
        block = Block(config)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in block.named_parameters():
            router = ("gate" in name or "router" in name) and p.dim() == 2
            std = 0.5 / cfg.H**0.5 if router else 0.1 if p.dim() <= 2 and "bias" in name else 1.0 / p.shape[-1] ** 0.5
            p.copy_(torch.randn(p.shape, generator=gen, device=device) * std)
        for _name, b in block.named_buffers():  # DeepSeek-V3's selection bias
            if b.is_floating_point():
                b.copy_(torch.randn(b.shape, generator=gen, device=device) * 0.01)
    return block.to(torch.bfloat16)


def _output(out):
    return out[0] if isinstance(out, tuple) else out


def _grads(block, x):
    return [x.grad] + [p.grad for p in block.parameters()]


def _fwd_bwd(fn, block, x, grad_out):
    def step():
        torch.compiler.cudagraph_mark_step_begin()
        x.grad = None
        for p in block.parameters():
            p.grad = None
        out = _output(fn(x))
        out.backward(grad_out)
        return out

    return step


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


def _bitwise_repeat(run, n: int) -> bool:
    first = [t.clone() for t in run()]
    return all(all(torch.equal(a, b) for a, b in zip(first, run())) for _ in range(n - 1))


def run_config(cfg: Config, tflops: float, deadline: float, quick: bool, device: str = "cuda",
               bench=None) -> list[Result]:
    """All variants of one block. ``device``/``bench`` exist so the flow can be dry-run on CPU."""
    import moe_compile  # noqa: F401 - registers the backend
    from moe_compile import report

    if bench is None:
        import triton.testing

        bench = triton.testing.do_bench
    block = build_block(cfg, device)
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(1, cfg.T, cfg.H, generator=gen, device=device).to(torch.bfloat16)
    grad_out = torch.randn(1, cfg.T, cfg.H, generator=gen, device=device).to(torch.bfloat16)
    flops_fwd = 6 * cfg.T * cfg.K * cfg.H * cfg.I
    floor_fwd = flops_fwd / (tflops * 1e12) * 1e3
    results: list[Result] = []
    ref = None
    rep_ms = 30 if quick else 100
    for variant in VARIANTS:
        if time.perf_counter() > deadline:
            results.append(Result(cfg.name, variant, float("nan"), float("nan"), floor_fwd, 3 * floor_fwd, 0.0,
                                  False, False, float("nan"), float("nan"), 0, "skipped: time budget"))
            continue
        torch._dynamo.reset()
        fn = {"eager": lambda: block,
              "inductor": lambda: torch.compile(block),
              "moe": lambda: torch.compile(block, backend="moe_compile"),
              "moe_unfused": lambda: torch.compile(block, backend="moe_compile",
                                                   options={"moe.passes": {"fuse_expert_mlp": False}}),
              "moe_ro": lambda: torch.compile(block, backend="moe_compile", mode="reduce-overhead"),
              "inductor_ro": lambda: torch.compile(block, mode="reduce-overhead")}[variant]()
        # a fresh cache, kept until the variant is done: the passes run (and are counted) even when an
        # earlier run cached this graph
        fresh = getattr(torch._inductor.utils, "fresh_cache", None) or torch._inductor.utils.fresh_inductor_cache
        cache = contextlib.ExitStack()
        cache.enter_context(fresh())
        start = time.perf_counter()
        with report.collecting() as rep:
            with torch.no_grad():
                torch.compiler.cudagraph_mark_step_begin()
                _output(fn(x))
            xg = x.detach().requires_grad_(True)
            step = _fwd_bwd(fn, block, xg, grad_out)
            step()
            if device == "cuda":
                torch.cuda.synchronize()
        compile_s = time.perf_counter() - start
        def forward():
            torch.compiler.cudagraph_mark_step_begin()
            return fn(x)

        with torch.no_grad():
            fwd_ms = bench(forward, warmup=10, rep=rep_ms)
        fwd_bwd_ms = bench(step, warmup=5, rep=rep_ms)
        kernel_ms = float("nan")
        if device == "cuda" and variant in KERNEL_TIMED:
            from benchmarks.bench_grouped_gemm import kernel_us

            kernel_ms = kernel_us(step)[0] / 1e3

        def forward_only():
            with torch.no_grad():
                return [_output(forward())]

        def forward_backward():
            out = step()
            return [out.detach(), *(g for g in _grads(block, xg) if g is not None)]

        det_fwd = _bitwise_repeat(forward_only, DETERMINISM_RUNS)
        det_bwd = _bitwise_repeat(forward_backward, DETERMINISM_RUNS)
        outs = forward_backward()
        if ref is None:
            ref = outs
        out_err, grad_err = _max_rel(outs[0], ref[0]), _max_rel(outs[1], ref[1])
        results.append(Result(cfg.name, variant, fwd_ms, fwd_bwd_ms, floor_fwd, 3 * floor_fwd, compile_s, det_fwd,
                              det_bwd, out_err, grad_err, rep.count("fuse_dispatch"), fwd_bwd_kernel_ms=kernel_ms))
        fn = None  # frees the compiled block; the name stays bound for forward() above
        cache.close()
    torch._dynamo.reset()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_results_args(parser)
    parser.add_argument("--quick", action="store_true", help="shorter timing loops")
    parser.add_argument("--budget-s", type=float, default=110.0)
    parser.add_argument("--models", default=None, help="comma-separated config names (default: all)")
    args, _ = parser.parse_known_args()
    if not torch.cuda.is_available():
        print("bench_moe_block: no CUDA device, nothing to measure (this benchmark needs a GPU)")
        return
    start = time.perf_counter()
    deadline = start + args.budget_s
    tflops = measured_mm_tflops()
    results: list[Result] = []
    chosen = [c for c in CONFIGS if args.models is None or c.name in args.models.split(",")]
    for cfg in chosen:
        results.extend(run_config(cfg, tflops, deadline, args.quick))
    env = device_env(mm_tflops=round(tflops, 1), wall_s=round(time.perf_counter() - start, 1))
    if args.save:
        write_results(results_path(args, "moe_block"), [dataclasses.asdict(r) for r in results], env)
    print(f"device={env['device']} torch={env['torch']} triton={env['triton']} mm={env['mm_tflops']} TFLOP/s "
          f"wall={env['wall_s']} s")
    header = ("model", "variant", "fwd ms", "fwd+bwd ms", "fb kernel ms", "floor f/fb", "det f/b", "out err",
              "grad err", "rewrites", "compile s")
    rows = [(r.model, r.variant, f"{r.fwd_ms:.3f}", f"{r.fwd_bwd_ms:.3f}", f"{r.fwd_bwd_kernel_ms:.3f}",
             f"{r.fwd_floor_ms:.3f}/{r.fwd_bwd_floor_ms:.3f}", f"{r.deterministic_fwd}/{r.deterministic_bwd}",
             f"{r.out_err:.2e}", f"{r.grad_err:.2e}", str(r.rewrites), f"{r.compile_s:.1f}" + (f" {r.note}" if r.note
                                                                                            else ""))
            for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    for line in speedups(results):
        print(line)


def speedups(results: list[Result]) -> list[str]:
    """``moe`` vs the best of eager and inductor (default mode), ``moe_ro`` vs eager and inductor_ro."""
    lines = []
    by = {(r.model, r.variant): r for r in results}
    for model in dict.fromkeys(r.model for r in results):
        for ours, others in (("moe", ("eager", "inductor")), ("moe", ("moe_unfused",)),
                             ("moe_ro", ("eager", "inductor_ro"))):
            if (model, ours) not in by:
                continue
            for field in ("fwd_ms", "fwd_bwd_ms"):
                best = min(getattr(by[(model, o)], field) for o in others if (model, o) in by)
                mine = getattr(by[(model, ours)], field)
                lines.append(f"{model} {ours} {field}: {mine:.3f} vs best of {'/'.join(others)} {best:.3f} "
                             f"-> {best / mine:.2f}x")
    return lines


if __name__ == "__main__":
    main()
