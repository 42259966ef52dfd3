"""transformers MoE CausalLM training steps: step time, atomics, and what differs from run to run.

Models (2 layers, bf16, batch 2 x 2048 tokens, loss = LM cross-entropy, ``_experts_implementation="grouped_mm"``
where the family has it), at the widths of issue 37:

* ``qwen3_moe``: H 2048, moe_intermediate 768, E 128, top-8, 16 heads / 4 kv, SDPA;
* ``mixtral``: H 4096, intermediate 14336, E 8, top-2, 32 heads / 8 kv, SDPA;
* ``deepseek_v3``: H 2048, MLA (q_lora 1536, kv_lora 512, q/k head dim 128 + 64, v head dim 128, 16 heads),
  moe_intermediate 1408, E 64, top-6, 2 shared experts, both layers MoE, SDPA;
* ``gpt_oss``: H 2880, intermediate 2880, E 32, top-4, 64 heads / 8 kv, head dim 64, sinks, a sliding and a full
  attention layer (eager attention: the family has no SDPA path).

Variants, side by side in one run: ``eager`` (the model as written), ``inductor`` (``torch.compile(model)``),
``inductor_det`` (the same under ``torch.use_deterministic_algorithms(True)``), ``moe`` (``backend="moe_compile"``),
``moe_deterministic`` (``moe_compile.compile(model, deterministic=True)``); ``moe_det_algos`` (moe_compile under the
global flag) on request.

Columns: ``step_ms`` (median forward + backward over ``--steps`` timed steps), ``atomic_kernels`` (generated Triton
kernels with ``tl.atomic_add``), ``grads_differ`` (parameters whose gradient is not bitwise equal over
``--repeats`` steps at the same inputs), ``loss_differs``, ``adamw_params_differ`` (parameters not bitwise equal
after ``--adamw-steps`` AdamW steps run twice from the same start on the same batches), ``compile_s``.

Under ``torchrun --nproc-per-node N`` the model is sharded with FSDP2 (``fully_shard`` per decoder layer, then the
root; NCCL), each rank on its own batches; times are the slowest rank's, differences are counted over every
rank's shards, and the rewrites moe_compile recorded are counted on rank 0 (``rewrites``).

Usage, from the repository root: ``python -m benchmarks.bench_train_determinism --models deepseek_v3 --save``
(writes ``benchmarks/results/train_determinism_<model>.json``; ``_fsdp2`` is appended under torchrun).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import time
from collections.abc import Callable

import torch

from benchmarks._bench_env import add_results_args, device_env, results_path, write_results

VARIANTS = ("eager", "inductor", "inductor_det", "moe", "moe_deterministic")
VOCAB = 32000


@dataclasses.dataclass
class Result:
    model: str
    variant: str
    step_ms: float
    atomic_kernels: int
    grads_differ: int
    params: int
    loss_differs: bool
    adamw_params_differ: int
    differing: list[str]
    compile_s: float
    rewrites: int
    world_size: int
    attention: list[str]


def _qwen3_moe(layers: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=4096, use_cache=False, tie_word_embeddings=False,
        output_router_logits=False)
    return Qwen3MoeForCausalLM, cfg, "sdpa"


def _mixtral(layers: int):
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=VOCAB, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=4096, use_cache=False, tie_word_embeddings=False, output_router_logits=False)
    return MixtralForCausalLM, cfg, "sdpa"


def _deepseek_v3(layers: int):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64,
        num_experts_per_tok=6, n_shared_experts=2, n_group=1, topk_group=1, first_k_dense_replace=0,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        max_position_embeddings=4096, use_cache=False, tie_word_embeddings=False, rope_scaling=None)
    return DeepseekV3ForCausalLM, cfg, "sdpa"


def _gpt_oss(layers: int):
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(
        vocab_size=VOCAB, hidden_size=2880, intermediate_size=2880, num_hidden_layers=layers,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
        sliding_window=128, layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(layers)],
        max_position_embeddings=4096, use_cache=False, tie_word_embeddings=False, output_router_logits=False)
    return GptOssForCausalLM, cfg, "eager"


MODELS: dict[str, Callable] = {"qwen3_moe": _qwen3_moe, "mixtral": _mixtral, "deepseek_v3": _deepseek_v3,
                               "gpt_oss": _gpt_oss}


def build_model(layers: int, seed: int = 0, attn: str | None = None, model: str = "qwen3_moe",
                device: str = "cuda") -> torch.nn.Module:
    """``model``'s CausalLM (see the module docstring), bf16, in training mode, initialised from ``seed``."""
    cls, cfg, default_attn = MODELS[model](layers)
    cfg._experts_implementation = "grouped_mm"
    cfg._attn_implementation = attn or default_attn
    torch.manual_seed(seed)
    with torch.device(device):
        built = cls(cfg).to(torch.bfloat16)
    return built.train()


def _compiled(model: torch.nn.Module, variant: str):
    import moe_compile

    if variant == "eager":
        return model
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


def _attention_kernels(code: list[str]) -> list[str]:
    """The attention ops the generated code calls (flash, memory-efficient, cuDNN; forward and backward)."""
    return sorted(set(re.findall(
        r"(?:aten|moe)\.((?:deterministic_)?_(?:scaled_dot_product|efficient_attention|flash_attention)\w*)",
        "\n".join(code))))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def _adamw_runs(fn, model, batches: list[torch.Tensor]) -> list[str]:
    """Names of the parameters not bitwise equal after ``len(batches)`` AdamW steps, run twice from the same
    start on the same batches."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    start = [_local(p).detach().clone() for _, p in named]
    finals = []
    for _ in range(2):
        with torch.no_grad():
            for (_, p), s in zip(named, start):
                _local(p).copy_(s)
        opt = torch.optim.AdamW([p for _, p in named], lr=1e-4)
        for ids in batches:
            _step(fn, model, ids)
            opt.step()
        model.zero_grad(set_to_none=True)
        finals.append([_local(p).detach().clone() for _, p in named])
        del opt
    with torch.no_grad():
        for (_, p), s in zip(named, start):
            _local(p).copy_(s)
    return [n for i, (n, _) in enumerate(named) if not torch.equal(finals[0][i], finals[1][i])]


def _shard(model: torch.nn.Module) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)


def _all_max(value: float) -> float:
    if not torch.distributed.is_initialized():
        return value
    t = torch.tensor([value], device="cuda", dtype=torch.float64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t.item())


def run_variant(model_name: str, variant: str, args) -> Result:
    from torch._inductor.utils import run_and_get_code

    from moe_compile import report

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    det = variant in ("inductor_det", "moe_det_algos")
    model = build_model(args.layers, attn=args.attn, model=model_name)
    if world > 1:
        _shard(model)
    gen = torch.Generator(device="cuda").manual_seed(1 + rank)
    ids = torch.randint(0, VOCAB, (args.batch, args.seq), device="cuda", generator=gen)
    batches = [torch.randint(0, VOCAB, (args.batch, args.seq), device="cuda", generator=gen)
               for _ in range(args.adamw_steps)]
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
        with report.collecting() as rep:
            _, code = run_and_get_code(lambda: _step(fn, model, ids))
        torch.cuda.synchronize()
        compile_s = _all_max(time.perf_counter() - t0)
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        losses, grads = [], []
        for _ in range(args.repeats):
            losses.append(_step(fn, model, ids))
            grads.append([_local(model.get_parameter(n).grad).clone() for n in names])
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
        adamw_differ = _adamw_runs(fn, model, batches) if args.adamw_steps else []
    times.sort()
    counts = torch.tensor([len(differing), len(adamw_differ),
                           any(not torch.equal(loss, losses[0]) for loss in losses[1:])], device="cuda")
    if world > 1:
        # a parameter differs if any rank's shard does: count on each rank, keep the largest
        torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.MAX)
    rewrites = sum(1 for r in rep.records if r.kind == "rewrite")
    return Result(model_name, variant, _all_max(times[len(times) // 2]), _atomic_kernels(code), int(counts[0]),
                  len(names), bool(counts[2]), int(counts[1]), differing + [f"adamw:{n}" for n in adamw_differ],
                  compile_s, rewrites, world, _attention_kernels(code))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_results_args(parser)
    parser.add_argument("--models", default="qwen3_moe", help=f"comma-separated, of {sorted(MODELS)}")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--adamw-steps", type=int, default=10, help="0: no AdamW runs")
    parser.add_argument("--attn", default=None, help="transformers attention implementation (default: the model's)")
    parser.add_argument("--sdpa-backend", default="", help="force one SDPA backend (math, flash_attention, ...)")
    parser.add_argument("--bisect", action="store_true", help="print the names of the differing parameters")
    parser.add_argument("--budget-s", type=float, default=540)
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.distributed.init_process_group("nccl")
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    start = time.perf_counter()
    for model_name in args.models.split(","):
        results = []
        for variant in args.variants.split(","):
            if _all_max(time.perf_counter() - start) > args.budget_s:
                if rank0:
                    print(f"{model_name} {variant}: skipped (budget)")
                continue
            r = run_variant(model_name, variant, args)
            results.append(r)
            torch.cuda.empty_cache()
            if rank0:
                print(f"{r.model:12s} {r.variant:18s} step {r.step_ms:7.2f} ms  atomics {r.atomic_kernels}  grads "
                      f"differ {r.grads_differ}/{r.params}  loss differs {r.loss_differs}  AdamW params differ "
                      f"{r.adamw_params_differ}  rewrites {r.rewrites}  compile {r.compile_s:.0f}s  "
                      f"{','.join(r.attention)}", flush=True)
                if args.bisect and r.differing:
                    print("   differ:", ", ".join(r.differing))
        if args.save and rank0 and results:
            config = model_name + ("_fsdp2" if world > 1 else "")
            write_results(results_path(args, "train_determinism", config), [dataclasses.asdict(r) for r in results],
                          device_env(layers=args.layers, batch=args.batch, seq=args.seq, world_size=world))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
