"""The blind corpus (``tests/models/blind_corpus``) through ``moe_compile.compile``, per layer (slow: a compile and
three training steps each, about 10-30 s on 2 CPU cores; ``python -m tests.models.blind_corpus_check`` prints the
same as a table and the rate; ``tests/models/BLIND_CORPUS.md`` keeps the runs).

Every layer, rewritten or not: no error (moe_compile.compile falls back where it cannot capture, as plain
torch.compile runs), and every tensor of its training step within eager's distance from a wider run (no silent wrong
answer). The layers :data:`REWRITTEN` lists must stay rewritten, one graph, no graph break, clean: a regression in
recognition fails here."""

from __future__ import annotations

import pytest

from tests.models.blind_corpus import LAYERS
from tests.models.blind_corpus_check import check

# rewritten and clean at the last run recorded in BLIND_CORPUS.md
REWRITTEN = frozenset({
    "mistral_reference_where_loop", "hf_mixtral_sparse_moe_block", "hf_mixtral_v5_experts_hit",
    "gptfast_conditional_feedforward", "hf_batched_mm_experts", "deepseek_v3_inference_bincount",
    "hf_deepseek_v3_noaux_tc", "dbrx_experts_glu_views", "olmoe_sparse_moe_block", "qwen2_moe_shared_expert_gate",
    "hf_grouped_mm_experts", "vllm_pallas_gmm", "megatron_permute_masked_select",
    "deepseek_v2_train_repeat_interleave", "deepseek_v2_moe_infer_argsort", "torchtitan_for_loop_experts",
})


@pytest.mark.slow
@pytest.mark.parametrize("entry", LAYERS, ids=[e.name for e in LAYERS])
def test_corpus_layer(entry):
    outcome = check(entry)
    assert not outcome.error, outcome.error
    assert outcome.within_bound, outcome.worst
    if entry.name in REWRITTEN:
        assert outcome.ok, outcome
