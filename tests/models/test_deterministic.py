"""``moe_compile.compile(model, deterministic=True)`` on tiny transformers MoE causal LMs: one training step.

With the option, the generated code (forward and backward) holds no atomic add anywhere, the token
embedding's backward included (``moe.segment_sum`` instead), the audit finds no non-deterministic source
(``Report.deterministic``; on CPU no library kernel of the table runs), a second step is bitwise equal,
and loss and every gradient equal eager's step within the derived layer bound (``tests/_tolerance.py::layer_rel``).
The negative control (without the option the embedding's backward is an atomic add, so the code check can fail, and
the audit names it) is ``tests/passes/test_deterministic_scatter.py::test_option_off_keeps_atomics_and_reports_them``,
on an embedding alone: compiling the model a second time without the option cost as much as the step itself.
"""

from __future__ import annotations

import pytest
import torch

from moe_compile import report
from moe_compile.backend import ConfiguredBackend
from moe_compile.config import make_config
from tests import _tolerance as tol
from tests.models.hf_families import Unbuildable, _loss_and_grads, build, moe_families
from tests.passes._harness import ATOMIC_ADD

pytest.importorskip("transformers")

# DeepSeek-V3: group-limited biased router (scatter_add backward, made plain by deterministic_accumulate), MLA;
# Qwen3-MoE: softmax top-k router; both with a token embedding. ~1 min each on 2 cores: Qwen3-MoE's only with
# -m slow (its router holds no form DeepSeek-V3's does not; the activation-checkpointing test below runs it).
FAMILIES = ("deepseek_v3", "qwen3_moe")
SLOW = ("qwen3_moe",)


def _step(model, inputs):
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=ConfiguredBackend(make_config(deterministic=True)),
                             fullgraph=True)
    try:
        with report.collecting() as rep, torch._inductor.config.patch(force_disable_caches=True):
            first, code = run_and_get_code(lambda: _loss_and_grads(model, inputs, compiled))
            second = _loss_and_grads(model, inputs, compiled)
    finally:
        torch._dynamo.reset()
    return first, second, rep, code


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow if f in SLOW else ())
                                    for f in FAMILIES if f in moe_families()])
def test_deterministic_training_step(family):
    try:
        model, inputs = build(family)
    except Unbuildable as exc:
        pytest.skip(str(exc))
    model.train()
    (loss, grads), again, rep, code = _step(model, inputs)
    assert code and not any(ATOMIC_ADD.search(c) for c in code), "atomic add left in the generated code"
    # moe.segment_sum inlined (its CPU body: a stable sort and segment_reduce), not called back into Python
    assert any("segment_reduce" in c for c in code) and not any("ops.moe.segment_sum" in c for c in code)
    assert rep.deterministic and rep.clean, rep.table()
    assert any(r.pass_name == "deterministic_scatter" and "embed" in r.layer for r in rep.rewrites), rep.table()
    assert torch.equal(again[0], loss) and all(torch.equal(again[1][n], g) for n, g in grads.items())

    loss_eager, grads_eager = _loss_and_grads(model, inputs)
    k_dims = tol.gemm_k_dims(list(model.parameters()))
    rows = inputs["input_ids"].numel()
    tol.assert_layer_close(loss, loss_eager, k_dims, torch.bfloat16, what="loss")
    assert grads.keys() == grads_eager.keys()
    for name, g in grads.items():
        tol.assert_layer_close(g, grads_eager[name], k_dims, torch.bfloat16, backward=True, rows=rows, what=name)


@pytest.mark.slow  # ~75 s on 2 cores: the default suite's time budget
def test_activation_checkpointing_keeps_every_rewrite():
    """Under activation checkpointing Dynamo breaks the graph per layer and the layers get the causal mask as an input
    (as under FSDP2): the MoE layer is still rewritten, attention runs ``moe.masked_attention`` instead of flash,
    every rewrite passes translation validation (on in the suite), and nothing non-deterministic is left."""
    import moe_compile

    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, use_cache=False,
                                      tie_word_embeddings=False)
    cfg._experts_implementation, cfg._attn_implementation = "grouped_mm", "sdpa"
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 128, (2, 16))
    rep = moe_compile.explain(model, input_ids=ids, labels=ids, compile_options={"deterministic": True})
    assert rep.deterministic and not rep.errors and not rep.unchecked, rep.table()
    assert {r.layer for r in rep.moe_rewrites if r.pass_name == "fuse_dispatch"} == {"model.layers.0.mlp.experts"}, \
        rep.table()
    assert rep.count("masked_attention") == 1 and not [s for s in rep.skips if s.what == "validation_failed"], \
        rep.table()
