"""A transformers Qwen3-MoE CausalLM training step: step time, atomics, and run-to-run gradient differences.

Model: ``Qwen3MoeForCausalLM`` (2 layers, H 2048, moe_intermediate 768, E 128, top-8, vocab 32000, 16 heads,
bf16, ``_experts_implementation="grouped_mm"``), batch 2 x 2048 tokens, loss = LM cross-entropy. One step is
forward + backward (no optimizer: the gradients are what is compared). Variants, side by side in one run:

* ``inductor``: ``torch.compile(model)``; ``inductor_det``: the same under
  ``torch.use_deterministic_algorithms(True)``;
* ``moe``: ``torch.compile(model, backend="moe_compile")``; ``moe_det_algos``: under
  ``use_deterministic_algorithms(True)``;
* ``moe_deterministic``: ``moe_compile.compile(model, deterministic=True)`` (where the option exists).

Columns: ``step_ms`` (median over ``--steps`` timed steps), ``atomic_kernels`` (Triton kernels with
``tl.atomic_add`` in the generated forward and backward code), ``grads_differ`` (parameters whose gradient
is not bitwise equal over ``--repeats`` steps at the same inputs), ``loss_differs``, and with ``--bisect``
the names of those parameters (the first to differ, in backward order, is nearest the source).

Usage, from the repository root: ``python -m benchmarks.bench_train_determinism [--save]`` (``--save`` writes
``benchmarks/results/train_determinism.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import re
import time

import torch

from benchmarks._bench_env import add_results_args, device_env, results_path, write_results

VARIANTS = ("inductor", "inductor_det", "moe", "moe_det_algos", "moe_deterministic")


@dataclasses.dataclass
class Result:
    variant: str
    step_ms: float
    atomic_kernels: int
    grads_differ: int
    params: int
    loss_differs: bool
    differing: list[str]
    compile_s: float


def build_model(layers: int, seed: int = 0, attn: str = "sdpa") -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=4096, use_cache=False, tie_word_embeddings=False,
        output_router_logits=False,
    )
    cfg._experts_implementation = "grouped_mm"
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    return model.train()


def _compiled(model: torch.nn.Module, variant: str):
    import moe_compile

    if variant.startswith("inductor"):
        return torch.compile(model)
    if variant == "moe_deterministic":
        return moe_compile.compile(model, deterministic=True)
    return torch.compile(model, backend="moe_compile")


def _step(fn, model, ids):
    model.zero_grad(set_to_none=True)
    out = fn(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach().clone()


def _atomic_kernels(code: list[str]) -> int:
    joined = "\n".join(code)
    kernels = re.split(r"\n@triton\.jit|\ntriton_helpers\.set_driver_to_gpu\(\)", joined)
    return sum("tl.atomic_add" in k for k in kernels)


def run_variant(variant: str, args) -> Result:
    from torch._inductor.utils import run_and_get_code

    det = variant in ("inductor_det", "moe_det_algos")
    model = build_model(args.layers, attn=args.attn)
    torch.manual_seed(1)
    ids = torch.randint(0, 32000, (args.batch, args.seq), device="cuda")
    torch._dynamo.reset()
    ctx = contextlib.ExitStack()
    if args.sdpa_backend:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        ctx.enter_context(sdpa_kernel(getattr(SDPBackend, args.sdpa_backend.upper())))
    if det:
        torch.use_deterministic_algorithms(True)
        ctx.callback(torch.use_deterministic_algorithms, False)
    with ctx:
        fn = _compiled(model, variant)
        t0 = time.perf_counter()
        _, code = run_and_get_code(lambda: _step(fn, model, ids))
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        losses, grads = [], []
        for _ in range(args.repeats):
            losses.append(_step(fn, model, ids))
            grads.append([model.get_parameter(n).grad.clone() for n in names])
        differing = [n for i, n in enumerate(names)
                     if any(not torch.equal(g[i], grads[0][i]) for g in grads[1:])]
        del grads
        times = []
        for _ in range(args.steps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            _step(fn, model, ids)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    return Result(variant, times[len(times) // 2], _atomic_kernels(code), len(differing), len(names),
                  any(not torch.equal(loss, losses[0]) for loss in losses[1:]), differing, compile_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_results_args(parser)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--attn", default="sdpa", help="transformers attention implementation")
    parser.add_argument("--sdpa-backend", default="", help="force one SDPA backend (math, flash_attention, ...)")
    parser.add_argument("--bisect", action="store_true", help="print the names of the differing parameters")
    parser.add_argument("--budget-s", type=float, default=300)
    args = parser.parse_args()
    from moe_compile.config import MoECompileConfig

    has_option = "deterministic" in {f.name for f in dataclasses.fields(MoECompileConfig)}
    start = time.perf_counter()
    results = []
    for variant in args.variants.split(","):
        if variant == "moe_deterministic" and not has_option:
            print(f"{variant}: skipped (no deterministic option in this moe_compile)")
            continue
        if time.perf_counter() - start > args.budget_s:
            print(f"{variant}: skipped (budget)")
            continue
        r = run_variant(variant, args)
        results.append(r)
        print(f"{r.variant:18s} step {r.step_ms:7.2f} ms  atomics {r.atomic_kernels}  grads differ "
              f"{r.grads_differ}/{r.params}  loss differs {r.loss_differs}  compile {r.compile_s:.0f}s", flush=True)
        if args.bisect and r.differing:
            print("   differ:", ", ".join(r.differing))
    if args.save:
        write_results(results_path(args, "train_determinism"), [dataclasses.asdict(r) for r in results],
                      device_env(layers=args.layers, batch=args.batch, seq=args.seq))


if __name__ == "__main__":
    main()
