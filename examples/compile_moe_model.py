"""Compile an unchanged Hugging Face MoE model with moe_compile, print what the passes did, check it against eager.

Runs on CPU by default and on CUDA where present (bf16 there, fp32 on CPU unless --dtype says so):

    python examples/compile_moe_model.py [--family mixtral|qwen2_moe|qwen3_moe|olmoe|granitemoe]
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import moe_compile

TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
)
FAMILY_ARGS = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, router_jitter_noise=0.0),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                      shared_expert_intermediate_size=128),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2),
    "granitemoe": dict(num_local_experts=8, num_experts_per_tok=2),
}


def build(family: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    config = AutoConfig.for_model(family, **TINY, **FAMILY_ARGS[family], output_router_logits=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype)
    for p in model.parameters():  # stacked expert weights may be left uninitialised
        if not torch.isfinite(p).all():
            torch.nn.init.normal_(p, std=0.02)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="mixtral", choices=sorted(FAMILY_ARGS))
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype or ("bfloat16" if device == "cuda" else "float32"))

    model = build(args.family, dtype, device)
    ids = torch.randint(0, TINY["vocab_size"], (2, 16), device=device)
    labels = torch.randint(0, TINY["vocab_size"], (2, 16), device=device)

    expected = model(input_ids=ids, labels=labels)
    compiled = moe_compile.compile(model)
    got = compiled(input_ids=ids, labels=labels)
    got.loss.backward()
    # what the passes did in the graphs just compiled (forward and backward): no second compile, unlike explain()
    print(moe_compile.last_report().table())
    diff = (got.logits.float() - expected.logits.float()).abs().max().item()
    print(f"\n{args.family} on {device} in {dtype}: loss eager {expected.loss.item():.5f} "
          f"compiled {got.loss.item():.5f}, max |logits diff| {diff:.2e}")
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    if diff > tol:
        raise SystemExit(f"mismatch: {diff} > {tol}")


if __name__ == "__main__":
    main()
