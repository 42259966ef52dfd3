"""Every transformers MoE family (found in the installed package), one compiled training step each.

For each family: Dynamo captures the step whole (``fullgraph=True``), the dispatch passes rewrite its
experts, the audit finds no accumulating scatter or host sync left outside the token embedding, and
loss and every gradient are as close to a float32 eager run as bf16 eager is
(:func:`tests.models.hf_families.check_family` states the bound). The default run checks four families
whose routers and experts hold every form the families use (their backward has the accumulating
scatters the passes must remove); ``-m slow`` runs them all. Families that cannot be built from a
config alone skip with the reason.
"""

from __future__ import annotations

import pytest

from tests.models.hf_families import check_family, moe_families

pytest.importorskip("transformers")

# DeepSeek-V3: sigmoid scores, selection bias, group-limited top-k, `scores.gather(-1, idx)` (backward:
# scatter_add), shared expert. GPT-OSS: top-k then softmax, per-expert biases gathered by expert id
# (backward: index_put(accumulate=True)), router bias, clamped SwiGLU. ~1 min each on 2 cores.
DEFAULT_FAMILIES = ("deepseek_v3", "gpt_oss")


def _check(family: str) -> None:
    row = check_family(family)
    if row["status"].startswith("skip"):
        pytest.skip(row["status"])
    assert row["status"] == "ok", row["status"]
    assert row["rewritten"], f"{family}: no experts layer rewritten"
    assert row["left"] == [], "\n".join(row["left"])
    assert row["numerics"], f"{family}: worst gradient {row['worst']}"
    # cancelling sums may go unjudged (NOTE [cancelling sums]), never the rewritten layers' own gradients
    own = [n for n in row["unjudged"] if any(n.startswith(layer + ".") for layer in row["rewritten"])]
    assert own == [], f"{family}: the rewritten layers' gradients {own} are bf16 noise; they judge nothing"


@pytest.mark.parametrize("family", [f for f in DEFAULT_FAMILIES if f in moe_families()])
def test_family_training_step(family):
    _check(family)


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f in moe_families() if f not in DEFAULT_FAMILIES])
def test_every_family_training_step(family):
    _check(family)


def test_families_are_found():
    families = moe_families()
    assert len(families) >= 40, families
    assert {"mixtral", "qwen2_moe", *DEFAULT_FAMILIES} <= set(families)
