"""Blind corpus of MoE layers re-expressed from public MoE code (see each module's header for its source).

``LAYERS`` lists every layer as a :class:`CorpusLayer`: name, public origin, dispatch style, a ``make(dtype, seed)``
factory, the input shape and whether ``forward`` returns ``(out, aux)``.
"""

from __future__ import annotations

from . import (
    deepseek_inference,
    deepspeed_style,
    fairseq_gshard,
    grok_dbrx_style,
    hf_capacity_style,
    hf_experts_backends,
    llama4_gptoss_style,
    megablocks_style,
    megatron_unfused,
    mixtral_reference,
    olmoe_jetmoe_style,
    research_misc,
    scattermoe_style,
    torchtitan_style,
    tutel_style,
    vllm_style,
)
from ._registry import STYLES, CorpusLayer

LAYERS: list[CorpusLayer] = [
    *fairseq_gshard.LAYERS,
    *tutel_style.LAYERS,
    *deepspeed_style.LAYERS,
    *megablocks_style.LAYERS,
    *scattermoe_style.LAYERS,
    *mixtral_reference.LAYERS,
    *hf_experts_backends.LAYERS,
    *deepseek_inference.LAYERS,
    *megatron_unfused.LAYERS,
    *torchtitan_style.LAYERS,
    *grok_dbrx_style.LAYERS,
    *olmoe_jetmoe_style.LAYERS,
    *hf_capacity_style.LAYERS,
    *vllm_style.LAYERS,
    *llama4_gptoss_style.LAYERS,
    *research_misc.LAYERS,
]

_names = [layer.name for layer in LAYERS]
if len(set(_names)) != len(_names):
    raise RuntimeError("duplicate blind-corpus layer names")

__all__ = ["LAYERS", "STYLES", "CorpusLayer"]
