"""The QuACK expert MLP (``moe_compile/ops/quack_gemm.py``): each GEMM kind against ``torch._grouped_mm``, and the HF
MoE block forward+backward with it against today's paths.

Part ``gemm``: per shape and GEMM kind (NOTE [QuACK expert MLP] (moe_compile/ops/quack_gemm.py)), GPU kernel time
(``torch.profiler``, summed) of QuACK and of the ``torch._grouped_mm`` equivalent (the gather it needs included;
the GLU / dGLU passes it needs not: the CUTLASS side is timed short of the whole job), and whether the two outputs
are bitwise equal.

Part ``block``: transformers' ``Qwen3MoeSparseMoeBlock`` / ``MixtralSparseMoeBlock`` (bf16), forward + backward GPU
kernel time, variants: ``eager`` (transformers' ``grouped_mm`` experts), ``inductor`` (plain ``torch.compile``),
``moe`` (``backend="moe_compile"``: today's path, the FX passes on ``grouped_mm`` experts, ``torch._grouped_mm``),
``iface_cutlass`` (the experts interface ``"moe_compile"``, compiled, ``MOE_COMPILE_GROUPED_GEMM=cutlass``) and
``quack`` (the same with the QuACK MLP). ``err``: max |out - eager| / max |eager| (and the input gradient's);
``det``: two steps bitwise equal (output and every gradient); ``mem_gb``: peak memory of one step above the model.

Usage, from the repository root on a GPU with ``quack-kernels``: ``python -m benchmarks.bench_quack_gemm [--save]
[--parts gemm,block] [--budget-s 400]`` (``--save`` writes ``benchmarks/results/quack_gemm.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import torch

from benchmarks._bench_env import add_results_args, device_env, results_path, sync, write_results


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    T: int
    H: int
    I: int  # noqa: E741 - expert intermediate size
    E: int
    K: int


SHAPES = (
    Shape("qwen3_moe", T=4096, H=2048, I=768, E=128, K=8),
    Shape("qwen3_moe", T=16384, H=2048, I=768, E=128, K=8),
    Shape("mixtral", T=4096, H=4096, I=14336, E=8, K=2),
)
VARIANTS = ("eager", "inductor", "moe", "iface_cutlass", "quack")
BLOCK_ORDER = {("qwen3_moe", 4096): ("eager", "quack", "moe", "inductor", "iface_cutlass"),
               ("qwen3_moe", 16384): ("quack", "moe", "inductor", "eager"),
               ("mixtral", 4096): ("quack", "moe", "inductor", "eager")}


def _kernel_ms(fn, iters: int = 10) -> float:
    from benchmarks.bench_grouped_gemm import kernel_us

    return kernel_us(fn, iters)[0] / 1e3


def gemm_rows(s: Shape) -> list[dict]:
    from moe_compile.ops import quack_gemm as qg
    from moe_compile.ops.expert_gemm import gather_rows, source_rows
    from moe_compile.ops.permute_pad import permute_pad

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(s.T, s.H, generator=gen).to(torch.bfloat16).cuda()
    ids = torch.rand(s.T, s.E, generator=gen).argsort(1)[:, : s.K].cuda()
    w_gu = (torch.randn(s.E, 2 * s.I, s.H, generator=gen) * s.H**-0.5).to(torch.bfloat16).cuda()
    w_dn = (torch.randn(s.E, s.H, s.I, generator=gen) * s.I**-0.5).to(torch.bfloat16).cuda()
    index = permute_pad(x, ids, None, num_experts=s.E)
    offs, M = index.offs_E, index.rows_MH.shape[0]
    src = source_rows(index.row_map, M)
    dy = torch.randn(M, s.H, generator=gen).to(torch.bfloat16).cuda()
    pre, h = qg.gated(x, src, offs, w_gu, True, "quack")
    cat = qg.deinterleave(pre)
    cases = {
        "gated": (lambda: qg.gated(x, src, offs, w_gu, True, "quack")[0],
                  lambda: torch._grouped_mm(gather_rows(x, src), w_gu.mT, offs=offs), qg.deinterleave),
        "down": (lambda: qg.down(h, offs, w_dn, "quack"), lambda: qg.down(h, offs, w_dn, "cutlass"), None),
        "down_dx": (lambda: qg.down_dx(dy, offs, w_dn, pre, "quack")[0],
                    lambda: torch._grouped_mm(dy, w_dn, offs=offs), None),
        "down_wgrad": (lambda: qg.down_wgrad(dy, h, offs, "quack"), lambda: qg.down_wgrad(dy, h, offs, "cutlass"),
                       None),
        "up_dx": (lambda: qg.up_dx(pre, offs, w_gu, "quack"), lambda: torch._grouped_mm(cat, w_gu, offs=offs), None),
        "up_wgrad": (lambda: qg.up_wgrad(pre, x, src, offs, "quack"),
                     lambda: torch._grouped_mm(cat.t(), gather_rows(x, src), offs=offs), None),
    }
    rows = []
    for kind, (quack, cutlass, to_cutlass) in cases.items():
        try:
            got, want = quack(), cutlass()
            got = to_cutlass(got) if to_cutlass is not None else got
            bitwise = kind != "down_dx" and torch.equal(got, want)
            rows.append(dict(part="gemm", model=s.name, T=s.T, kind=kind, quack_ms=round(_kernel_ms(quack), 4),
                             grouped_mm_ms=round(_kernel_ms(cutlass), 4), bitwise=bitwise,
                             attempt=qg._WORKING.get(kind, 0)))
        except Exception as err:  # noqa: BLE001 - a kind QuACK refuses is a result too
            rows.append(dict(part="gemm", model=s.name, T=s.T, kind=kind, quack_ms=None, grouped_mm_ms=None,
                             bitwise=False, note=f"{type(err).__name__}: {str(err)[:200]}"))
        print(rows[-1], flush=True)
    return rows


def _hf_block(s: Shape, device: str):
    from benchmarks.bench_moe_block import Config, build_block

    return build_block(Config(s.name, T=s.T, H=s.H, I=s.I, E=s.E, K=s.K), device)


def _use_experts(block, impl: str) -> None:
    """transformers' experts implementation of every experts module: ``grouped_mm`` (today's path, the FX passes) or
    ``moe_compile`` (the experts interface, where the QuACK MLP sits)."""
    from moe_compile.experts.interface import is_hf_experts, use_fused_hf_experts

    for m in block.modules():
        if is_hf_experts(m):
            m.config._experts_implementation = "eager" if impl == "moe_compile" else impl
    if impl == "moe_compile":
        use_fused_hf_experts(block)


def block_rows(s: Shape, variants: tuple[str, ...], deadline: float, device: str = "cuda",
               timer=None) -> list[dict]:
    """The block rows of one shape; ``device`` / ``timer`` (``step -> ms``) exist so the flow can be dry-run on CPU."""
    import moe_compile  # noqa: F401 - registers the backend

    timer = timer or _kernel_ms
    block = _hf_block(s, device)
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(1, s.T, s.H, generator=gen, device=device).to(torch.bfloat16).requires_grad_(True)
    g = torch.randn(1, s.T, s.H, generator=gen, device=device).to(torch.bfloat16)
    rows = []
    ref = None
    for variant in variants:
        if time.perf_counter() > deadline:
            rows.append(dict(part="block", model=s.name, T=s.T, variant=variant, note="skipped: time budget"))
            continue
        _use_experts(block, "moe_compile" if variant in ("iface_cutlass", "quack") else "grouped_mm")
        os.environ["MOE_COMPILE_GROUPED_GEMM"] = "quack" if variant == "quack" else "cutlass"
        if variant in ("eager", "inductor", "moe"):
            os.environ.pop("MOE_COMPILE_GROUPED_GEMM")
        torch._dynamo.reset()
        fn = block if variant == "eager" else torch.compile(block, **({} if variant == "inductor" else
                                                                      {"backend": "moe_compile"}))

        def step():
            x.grad = None
            for p in block.parameters():
                p.grad = None
            out = fn(x)
            out = out[0] if isinstance(out, tuple) else out
            out.backward(g)
            return [out.detach(), x.grad, *(p.grad for p in block.parameters() if p.grad is not None)]

        start = time.perf_counter()
        try:
            step()
            sync(device)
        except Exception as err:  # noqa: BLE001 - a variant that fails is a result too
            rows.append(dict(part="block", model=s.name, T=s.T, variant=variant,
                             note=f"{type(err).__name__}: {str(err)[:300]}"))
            print(rows[-1], flush=True)
            continue
        compile_s = time.perf_counter() - start
        ms = timer(step)
        cuda = device == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        first = [t.clone() for t in step()]
        mem_gb = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else float("nan")
        det = all(torch.equal(a, b) for a, b in zip(first, step()))
        if ref is None:  # the errors are against the first variant measured (``ref`` in each row)
            ref, ref_variant = first, variant
        err = [float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in zip(first[:2], ref[:2])]
        rows.append(dict(part="block", model=s.name, T=s.T, variant=variant, fwd_bwd_kernel_ms=round(ms, 4),
                         compile_s=round(compile_s, 1), deterministic=det, out_err=err[0], grad_err=err[1],
                         ref=ref_variant, mem_gb=round(mem_gb, 3)))
        print(rows[-1], flush=True)
        fn = None
    os.environ.pop("MOE_COMPILE_GROUPED_GEMM", None)
    torch._dynamo.reset()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_results_args(parser)
    parser.add_argument("--parts", default="gemm,block")
    parser.add_argument("--budget-s", type=float, default=400.0)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args, _ = parser.parse_known_args()
    if not torch.cuda.is_available():
        print("bench_quack_gemm: no CUDA device, nothing to measure (this benchmark needs a GPU)")
        return
    from moe_compile.ops.quack_gemm import quack_importable

    if not quack_importable() or torch.cuda.get_device_capability()[0] not in (9, 10):
        print("bench_quack_gemm: needs quack-kernels (pip install moe_compile[quack]) on sm90/sm100; nothing measured")
        return
    import quack

    start = time.perf_counter()
    deadline = start + args.budget_s
    rows: list[dict] = []
    parts = args.parts.split(",")
    for s in SHAPES:
        if "gemm" in parts and time.perf_counter() < deadline:
            rows.extend(gemm_rows(s))
    for s in SHAPES:
        if "block" in parts:
            # most wanted first (the budget skips the rest): QuACK and today's path, then the others at Qwen3 T4096
            variants = [v for v in BLOCK_ORDER[(s.name, s.T)] if v in args.variants.split(",")]
            rows.extend(block_rows(s, tuple(variants), deadline))
    env = device_env(quack=getattr(quack, "__version__", None), wall_s=round(time.perf_counter() - start, 1))
    if args.save:
        write_results(results_path(args, "quack_gemm"), rows, env)
    print(f"device={env['device']} torch={env['torch']} triton={env['triton']} quack={env['quack']}")
    for r in rows:
        if r["part"] == "gemm":
            print(f"{r['model']:10} T{r['T']:<6} {r['kind']:11} quack {r['quack_ms']} ms  "
                  f"grouped_mm {r['grouped_mm_ms']} ms  bitwise {r['bitwise']} {r.get('note', '')}")
    for r in rows:
        if r["part"] == "block":
            print(f"{r['model']:10} T{r['T']:<6} {r['variant']:14} fwd+bwd kernel {r.get('fwd_bwd_kernel_ms', 'nan')} "
                  f"ms det {r.get('deterministic')} err {r.get('out_err')}/{r.get('grad_err')} "
                  f"mem {r.get('mem_gb')} GB {r.get('note', '')}")


if __name__ == "__main__":
    main()
