"""Tiny-config Hugging Face MoE CausalLM models with random, fully initialised weights.

Every builder returns ``(model, inputs)`` where ``inputs`` are keyword arguments for ``model(**inputs)``:
``input_ids`` and (``with_labels=True``) ``labels``; every config has ``output_router_logits=True`` so the
aux loss is in the graph. Shapes: hidden 64, 2 layers, E=8 experts, K=2, vocab 128, batch 2 x seq 8.

The models go through transformers' default experts implementation (``grouped_mm``): in bf16 it calls
``torch._grouped_mm``, in fp32 (under ``torch.compile``) ``torch.ops.transformers.grouped_mm_fallback``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe")

HIDDEN = 64
LAYERS = 2
EXPERTS = 8
TOP_K = 2
VOCAB = 128


def _common(**overrides: Any) -> dict[str, Any]:
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_experts_per_tok=TOP_K,
        output_router_logits=True,
        router_aux_loss_coef=0.02,
        use_cache=False,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    kwargs.update(overrides)
    return kwargs


def mixtral_config(**overrides: Any):
    from transformers import MixtralConfig

    return MixtralConfig(**_common(intermediate_size=128, num_local_experts=EXPERTS, router_jitter_noise=0.0,
                                   **overrides))


def qwen2_moe_config(**overrides: Any):
    from transformers import Qwen2MoeConfig

    overrides.setdefault("norm_topk_prob", False)
    return Qwen2MoeConfig(**_common(intermediate_size=128, moe_intermediate_size=64,
                                    shared_expert_intermediate_size=96, num_experts=EXPERTS,
                                    decoder_sparse_step=1, **overrides))


def qwen3_moe_config(**overrides: Any):
    from transformers import Qwen3MoeConfig

    overrides.setdefault("norm_topk_prob", True)
    return Qwen3MoeConfig(**_common(intermediate_size=128, moe_intermediate_size=64, num_experts=EXPERTS,
                                    head_dim=16, decoder_sparse_step=1, **overrides))


def olmoe_config(**overrides: Any):
    from transformers import OlmoeConfig

    return OlmoeConfig(**_common(intermediate_size=64, num_experts=EXPERTS, **overrides))


def granitemoe_config(**overrides: Any):
    from transformers import GraniteMoeConfig

    return GraniteMoeConfig(**_common(intermediate_size=64, num_local_experts=EXPERTS, **overrides))


CONFIGS: dict[str, Callable[..., Any]] = {
    "mixtral": mixtral_config,
    "qwen2_moe": qwen2_moe_config,
    "qwen3_moe": qwen3_moe_config,
    "olmoe": olmoe_config,
    "granitemoe": granitemoe_config,
}


def _causal_lm_class(family: str):
    import transformers

    return {
        "mixtral": transformers.MixtralForCausalLM,
        "qwen2_moe": transformers.Qwen2MoeForCausalLM,
        "qwen3_moe": transformers.Qwen3MoeForCausalLM,
        "olmoe": transformers.OlmoeForCausalLM,
        "granitemoe": transformers.GraniteMoeForCausalLM,
    }[family]


def init_params_(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Deterministically re-initialise every parameter and floating buffer (no ``torch.empty`` garbage).

    Norm weights get ``1 + N(0, 0.1)``, everything else ``N(0, 0.08)`` (large enough for varied routing).
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name or "layernorm" in name:
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.08 * noise)
    return module


def build_causal_lm(
    family: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    batch: int = 2,
    seq: int = 8,
    seed: int = 0,
    with_labels: bool = True,
    **config_overrides: Any,
) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A tiny ``<Family>ForCausalLM`` (experts implementation ``grouped_mm``) and its inputs."""
    if family not in CONFIGS:
        raise ValueError(f"family={family!r} is not one of {FAMILIES}")
    config = CONFIGS[family](**config_overrides)
    torch.manual_seed(seed)
    model = _causal_lm_class(family)(config)
    init_params_(model, seed)
    model = model.to(device=device, dtype=dtype)
    impl = getattr(model.config, "_experts_implementation", None)
    if impl != "grouped_mm":
        raise RuntimeError(f"{family}: expected the grouped_mm experts implementation, got {impl!r}")
    gen = torch.Generator().manual_seed(seed + 1)
    input_ids = torch.randint(1, VOCAB, (batch, seq), generator=gen).to(device)
    inputs = {"input_ids": input_ids}
    if with_labels:
        inputs["labels"] = torch.randint(1, VOCAB, (batch, seq), generator=gen).to(device)
    return model, inputs


def build_sparse_moe_block(
    family: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    **config_overrides: Any,
) -> torch.nn.Module:
    """The family's sparse MoE block with ``_experts_implementation="grouped_mm"`` and initialised params.

    Called as ``block(hidden_BSH)``; some families return ``(hidden, router_logits)``.
    """
    config = CONFIGS[family](**config_overrides)
    config._experts_implementation = "grouped_mm"
    block_cls = _block_class(family)
    torch.manual_seed(seed)
    block = block_cls(config)
    init_params_(block, seed)
    return block.to(device=device, dtype=dtype)


def _block_class(family: str):
    import importlib

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    name = {
        "mixtral": "MixtralSparseMoeBlock",
        "qwen2_moe": "Qwen2MoeSparseMoeBlock",
        "qwen3_moe": "Qwen3MoeSparseMoeBlock",
        "olmoe": "OlmoeSparseMoeBlock",
        "granitemoe": "GraniteMoeMoE",
    }[family]
    return getattr(module, name)


def block_output(out: Any) -> torch.Tensor:
    """The hidden-states tensor of a block's output (some blocks return a tuple)."""
    return out[0] if isinstance(out, tuple) else out


def build_jetmoe(dtype: torch.dtype = torch.float32, seed: int = 0, batch: int = 2, seq: int = 8
                 ) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A tiny ``JetMoeForCausalLM`` (1 layer, hidden 32, 4 experts, top-2) and its inputs (labels included).

    Its layer has four host-sized expert loops (``expert_size.tolist()`` + ``split`` through ``weight[e]``): two in
    the attention experts (``map`` and ``reduce``) and two in the MLP experts, read from two routers.
    """
    from transformers import JetMoeConfig, JetMoeForCausalLM

    config = JetMoeConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_key_value_heads=2,
                          kv_channels=8, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                          max_position_embeddings=64, use_cache=False, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = JetMoeForCausalLM(config)
    init_params_(model, seed)
    model = model.to(dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    input_ids = torch.randint(1, VOCAB, (batch, seq), generator=gen)
    return model, {"input_ids": input_ids, "labels": torch.randint(1, VOCAB, (batch, seq), generator=gen)}
