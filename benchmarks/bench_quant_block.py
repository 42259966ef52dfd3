"""Quantised experts in the product: transformers' Qwen3-MoE block (H 2048, I 768, E 128, K 8) in inference.

The block of ``bench_moe_block.py`` with its experts replaced by ``moe_compile.quantize_experts`` (MXFP8 or NVFP4
``GroupedQuantWeight``), compiled with ``backend="moe_compile"``, forward under ``no_grad``, T in {1, 64, 4096}:

* ``bf16``: the unquantised block (``moe``: the GLU fused into ``moe.expert_gemm``, CUTLASS or the Triton family per
  the measured table);
* ``<fmt>_unfused``: ``fuse_expert_mlp`` off: both grouped GEMMs run the weight-only kernels of
  ``moe::grouped_mm_<fmt>``, the GLU is an Inductor kernel;
* ``<fmt>``: as shipped: the gate_up GEMM + GLU fused into the subclass's ``moe::expert_gemm_<fmt>``, which runs the
  expert-GEMM family (tiles decoded in registers) or the weight-only kernel plus the epilogue per the measured
  table (``QUANT_FAMILY_ROWS_FROM``); the down GEMM on the weight-only kernel;
* ``<fmt>_family``: the same with the family forced (``MOE_COMPILE_GROUPED_GEMM=triton``): the data behind the
  table.

Decode (T 1, 64) runs with ``mode="reduce-overhead"`` (CUDA graphs, as decode serving runs), prefill (T 1024, 4096)
in default mode. ``wall``: ``triton.testing.do_bench`` of one forward; ``kernel``: its GPU kernel time
(``torch.profiler``, summed). ``err``: max |out - bf16 out| / max |bf16 out| (quantisation error included).

Usage, from the repository root: ``python -m benchmarks.bench_quant_block [--save] [--quick]`` (``--save`` writes
``benchmarks/results/quant_block.json``).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch

from benchmarks._bench_env import add_results_args, device_env, results_path, write_results

TOKENS = (1, 64, 1024, 4096)
MODE = {1: "reduce-overhead", 64: "reduce-overhead", 1024: "default", 4096: "default"}
RECIPES = ("mxfp8", "nvfp4")
ENV_CHOICE = "MOE_COMPILE_GROUPED_GEMM"


def _kernel_us(fn, iters: int = 10) -> float:
    from benchmarks.bench_grouped_gemm import kernel_us

    return kernel_us(fn, iters)[0]


def run(T: int, blocks: dict, quick: bool) -> list[dict]:
    import triton.testing

    from moe_compile import report

    x = torch.randn(1, T, 2048, generator=torch.Generator(device="cuda").manual_seed(T), device="cuda").to(
        torch.bfloat16
    )
    rows, ref = [], None
    mode = MODE[T]
    for name, (block, fused) in blocks.items():
        torch._dynamo.reset()
        forced = os.environ.pop(ENV_CHOICE, None)
        if name.endswith("_family"):
            os.environ[ENV_CHOICE] = "triton"
        # torch.compile takes mode= or options=, not both: reduce-overhead is its triton.cudagraphs option
        options = {"triton.cudagraphs": mode == "reduce-overhead"}
        if not fused:
            options["moe.passes"] = {"fuse_expert_mlp": False}
        fn = torch.compile(block, backend="moe_compile", options=options)

        def forward(fn=fn):
            torch.compiler.cudagraph_mark_step_begin()
            out = fn(x)
            return out[0] if isinstance(out, tuple) else out

        # a fresh compile cache per variant: the choice table is read while compiling, and a cached graph of
        # another variant (same graph, same options) would be reused
        fresh = getattr(torch._inductor.utils, "fresh_cache", None) or torch._inductor.utils.fresh_inductor_cache
        with torch.no_grad(), fresh():
            with report.collecting() as rep:
                out = forward().clone()
            forward()
            wall = triton.testing.do_bench(forward, warmup=10, rep=30 if quick else 100) * 1e3
            kernel = _kernel_us(forward)
        os.environ.pop(ENV_CHOICE, None)
        if forced is not None:
            os.environ[ENV_CHOICE] = forced
        ref = out.float() if ref is None else ref
        err = float((out.float() - ref).abs().max() / ref.abs().max())
        rows.append(dict(T=T, impl=name, mode=mode, wall_us=round(wall, 1), kernel_us=round(kernel, 1),
                         err=f"{err:.3g}", fused_glu=rep.count("fuse_expert_mlp")))
        print(rows[-1], flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_results_args(parser)
    parser.add_argument("--quick", action="store_true", help="shorter timing loops")
    args, _ = parser.parse_known_args()
    if not torch.cuda.is_available():
        print("bench_quant_block: no CUDA device, nothing to measure (this benchmark needs a GPU)")
        return 0
    import moe_compile  # noqa: F401 - registers the backend
    from benchmarks.bench_moe_block import CONFIGS, build_block
    from moe_compile.experts.quantize import quantize_experts

    start = time.perf_counter()
    base = build_block(next(c for c in CONFIGS if c.name == "qwen3_moe"))
    blocks = {"bf16": (base, True)}
    for recipe in RECIPES:
        q = quantize_experts(copy.deepcopy(base), recipe)
        blocks[f"{recipe}_unfused"] = (q, False)
        blocks[recipe] = (q, True)
        blocks[f"{recipe}_family"] = (q, True)
    rows = []
    for T in TOKENS:
        rows += run(T, blocks, args.quick)
    env = device_env(wall_s=round(time.perf_counter() - start, 1))
    if args.save:
        write_results(results_path(args, "quant_block"), rows, env)
    print(f"device={env['device']} torch={env['torch']} triton={env['triton']}")
    print("T      mode             impl           wall us   kernel us  fused GLU  err")
    for r in rows:
        print(
            f"{r['T']:<6} {r['mode']:<16} {r['impl']:<14} {r['wall_us']:>8}  {r['kernel_us']:>9}  {r['fused_glu']:>9}  "
            f"{r['err']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
