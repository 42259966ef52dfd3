"""Second blind batch of MoE layers re-expressed from public MoE code not in ``tests/models/blind_corpus`` (see each
module's header for its source). A measurement only: ``tests/models/BLIND_CORPUS2.md`` keeps the run.

``LAYERS`` lists every layer as a :class:`CorpusLayer` (the first batch's type): name, public origin, dispatch style,
a ``make(dtype, seed)`` factory, the input shape and whether ``forward`` returns ``(out, aux)``.
"""

from __future__ import annotations

from . import aria_vllm_reference, capacity_research, fastmoe_llama_moe, hf_routers, maxtext_style, megatron_xmoe
from ._registry import STYLES, CorpusLayer

LAYERS: list[CorpusLayer] = [
    *fastmoe_llama_moe.LAYERS,
    *hf_routers.LAYERS,
    *maxtext_style.LAYERS,
    *aria_vllm_reference.LAYERS,
    *capacity_research.LAYERS,
    *megatron_xmoe.LAYERS,
]

_names = [layer.name for layer in LAYERS]
if len(set(_names)) != len(_names):
    raise RuntimeError("duplicate blind-corpus layer names")

__all__ = ["LAYERS", "STYLES", "CorpusLayer"]
