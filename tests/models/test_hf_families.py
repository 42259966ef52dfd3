"""Every transformers MoE family (found in the installed package), one compiled training step each.

For each family: Dynamo captures the step whole (``fullgraph=True``), the dispatch passes rewrite its
experts, the audit finds no accumulating scatter or host sync left outside the token embedding, and
loss and every gradient are as close to a float32 eager run as bf16 eager is
(:func:`tests.models.hf_families.check_family` states the bound). The default run checks four families
whose routers and experts hold every form the families use (their backward has the accumulating
scatters the passes must remove); ``-m slow`` runs them all. Families that cannot be built from a
config alone skip with the reason.

The families outside the experts interface (:data:`tests.models.hf_families.OUTSIDE`) get the same step and
judgement through ``moe_compile.compile``, graph breaks allowed where Dynamo cannot capture them whole, and every
experts layer must be rewritten or carry explain's reason tag.
"""

from __future__ import annotations

import pytest
import torch

from tests.models.family_records import add_to_file
from tests.models.hf_families import OUTSIDE, check_family, moe_families, outside_interface_families

pytest.importorskip("transformers")

# DeepSeek-V3: sigmoid scores, selection bias, group-limited top-k, `scores.gather(-1, idx)` (backward:
# scatter_add), shared expert. GPT-OSS: top-k then softmax, per-expert biases gathered by expert id
# (backward: index_put(accumulate=True)), router bias, clamped SwiGLU. ~1 min each on 2 cores.
# one family in the default run (deepseek_v3's training step runs in test_deterministic.py); the rest with -m slow
DEFAULT_FAMILIES = ("gpt_oss",)


def _stepped(family: str, records_path: str | None) -> dict:
    """:func:`check_family`'s row, recorded (``--family-records``); skips a family that cannot be built, fails one
    whose step does not run."""
    row = check_family(family)
    if records_path:
        entry = {"status": row["status"]} if row["status"] != "ok" else {"status": "ok", "records": row["records"]}
        add_to_file(records_path, family, entry)
    if row["status"].startswith("skip"):
        pytest.skip(row["status"])
    assert row["status"] == "ok", row["status"]
    return row


def _check(family: str, records_path: str | None = None) -> None:
    row = _stepped(family, records_path)
    assert row["rewritten"], f"{family}: no experts layer rewritten"
    assert row["left"] == [], "\n".join(row["left"])
    assert row["refused"] == [] and row["unchecked"] == [], "\n".join(row["refused"] + row["unchecked"])
    assert row["numerics"], f"{family}: worst gradient {row['worst']}"
    # cancelling sums may go unjudged (NOTE [cancelling sums] (tests/_tolerance.py)), never the rewritten
    # layers' own gradients
    own = [n for n in row["unjudged"] if any(n.startswith(layer + ".") for layer in row["rewritten"])]
    assert own == [], f"{family}: the rewritten layers' gradients {own} are bf16 noise; they judge nothing"


@pytest.mark.parametrize("family", [f for f in DEFAULT_FAMILIES if f in moe_families()])
def test_family_training_step(family, request):
    _check(family, request.config.getoption("family_records"))


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f in moe_families() if f not in DEFAULT_FAMILIES])
def test_every_family_training_step(family, request):
    _check(family, request.config.getoption("family_records"))


# the families outside the experts interface (tests.models.hf_families.OUTSIDE says why each is); the default run
# checks the cheapest
DEFAULT_OUTSIDE = ("vitpose_backbone",)


def _check_outside(family: str, records_path: str | None = None) -> None:
    """A family outside the experts interface, through ``moe_compile.compile``: the step compiles (whole where
    Dynamo can capture it, else with graph breaks, which the row names), loss and gradients are within the
    bound, and every experts layer is rewritten or carries explain's reason tag; rewritten (by the expert-loop swap)
    where :attr:`tests.models.hf_families.Outside.swapped` says so, and then captured whole."""
    row = _stepped(family, records_path)
    assert row["layers"], f"{family} ({OUTSIDE[family].why}): no experts layer found, so explain accounts for none"
    untagged = [layer for layer, outcome in row["layers"].items() if not outcome]
    assert untagged == [], f"{family}: experts layers neither rewritten nor given a reason: {untagged}"
    spec = OUTSIDE[family]
    if spec.swapped:
        left = {layer: outcome for layer, outcome in row["layers"].items() if outcome != "rewritten"}
        assert left == {}, f"{family}: experts layers the swap should rewrite: {left}"
        if spec.known_break:  # the family's own break, and no break inside a frame Dynamo traces (the swapped layers)
            assert spec.known_break in row["break_context"], (
                f"{family}: not the family's own known break ({spec.known_break!r}) but {row['graph_breaks']!r} "
                f"({row['break_context']!r}); none at all: the family no longer breaks, drop its known_break")
            assert row["breaks_in_frames"] == [], f"{family}: swapped, yet Dynamo breaks: {row['breaks_in_frames']}"
        else:
            assert row["graph_breaks"] == "", f"{family}: swapped, yet Dynamo breaks: {row['graph_breaks']}"
    assert row["refused"] == [] and row["unchecked"] == [], "\n".join(row["refused"] + row["unchecked"])
    assert row["numerics"], f"{family}: worst gradient {row['worst']}"


@pytest.mark.parametrize("family", [f for f in DEFAULT_OUTSIDE if f in outside_interface_families()])
def test_outside_family_training_step(family, request):
    _check_outside(family, request.config.getoption("family_records"))


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f in outside_interface_families() if f not in DEFAULT_OUTSIDE])
def test_every_outside_family_training_step(family, request):
    _check_outside(family, request.config.getoption("family_records"))


def test_switch_graph_break_is_transformers_own():
    """The graph break of the Switch row (``Outside.known_break``) is transformers' code, not the swap's:
    transformers 5.24's ``SwitchTransformersStack`` makes the all-ones attention mask only when not
    ``is_torchdynamo_compiling()``, then its encoder (not a decoder) subscripts the ``None`` mask
    (``attention_mask[:, None, None, :]``). Run eagerly with that flag on (no compile, no swap) it raises the
    ``TypeError`` Dynamo reports; given a mask, it runs. When transformers makes the mask under Dynamo too, this test
    fails: the row is then captured whole and its ``known_break`` can go."""
    from unittest import mock

    import transformers.models.switch_transformers.modeling_switch_transformers as switch

    from tests.models.hf_families import build

    model, inputs = build("switch_transformers")
    assert "'NoneType' object is not subscriptable" in OUTSIDE["switch_transformers"].known_break
    with torch.no_grad(), mock.patch.object(switch, "is_torchdynamo_compiling", lambda: True):
        with pytest.raises(TypeError, match="'NoneType' object is not subscriptable"):
            model(**inputs)
        model(**inputs, attention_mask=torch.ones_like(inputs["input_ids"]))


def test_outside_families_are_found():
    assert {"dbrx", "jetmoe", "llama4", "switch_transformers", "nllb_moe"} <= set(outside_interface_families())
    assert not set(outside_interface_families()) & set(moe_families())


def test_families_are_found():
    families = moe_families()
    assert len(families) >= 40, families
    assert {"mixtral", "qwen2_moe", *DEFAULT_FAMILIES} <= set(families)


def _tiny_phimoe(gen: torch.Generator) -> torch.nn.Module:
    """PhiMoE as a new user builds it: hidden 64, 8 experts, top-2, 1 layer, 4 heads / 2 kv heads, vocab 128,
    every weight ``randn * 0.05``, norms 1, bf16, the token embedding frozen, in training mode (its router samples
    with Gumbel noise)."""
    from transformers import PhimoeConfig, PhimoeForCausalLM

    config = PhimoeConfig(hidden_size=64, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2,
                          num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    model = PhimoeForCausalLM(config).to(torch.bfloat16)
    _fill_phimoe(model, gen)
    model.model.embed_tokens.weight.requires_grad_(False)
    return model.train()


def _fill_phimoe(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Fresh weights in place (a compiled model keeps its graphs): ``randn * 0.05`` drawn in float32, norms 1."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = "norm" in name and p.dim() == 1
            p.copy_(torch.ones_like(p) if norm else torch.randn(p.shape, generator=gen) * 0.05)


def test_phimoe_router_gradient_exactly_zero_in_eager_stays_zero():
    """With these weights PhiMoE's masked gates are often one-hot, and its router backward (``-gate * g``, then
    ``g`` added back at the selected expert) cancels to exactly zero in eager and in plain Inductor. moe_compile
    once turned that add into gather + add + scatter, which Inductor computed without rounding ``-gate * g``
    first: the router gradient came out as rounding residue
    (NOTE [one add into a live tensor] (moe_compile/passes/forms/accumulate.py)).

    Which gates the router masks depends on the bf16 rounding of its scores, and compiled code rounds otherwise
    than eager: the two may select different experts, and then one gradient is zero and the other is not. Plain
    Inductor computes what moe_compile computes apart from the rewrites (the same loss to the last bit), so it is
    the reference: fresh weights are drawn (into one model, compiled once) until eager's and plain Inductor's
    router gradients are both exactly zero, and moe_compile's must then be too."""
    pytest.importorskip("transformers.models.phimoe")
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    model = _tiny_phimoe(gen)
    router = model.model.layers[0].mlp.router.weight

    def step(fn, ids):
        router.grad = None
        torch.manual_seed(0)  # the Gumbel draws: plain Inductor and moe_compile draw alike
        loss = fn(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), router.grad.clone()

    torch._dynamo.reset()
    try:
        inductor = torch.compile(model, backend="inductor", fullgraph=True)
        for _ in range(40):
            _fill_phimoe(model, gen)
            ids = torch.randint(0, 128, (2, 16), generator=gen)
            if torch.all(step(model, ids)[1] == 0):
                loss_inductor, grad_inductor = step(inductor, ids)
                if torch.all(grad_inductor == 0):
                    break
        else:
            pytest.fail("no draw of weights gave an exactly zero router gradient in eager and plain Inductor "
                        "(expected ~40% of draws)")
        loss, grad = step(torch.compile(model, backend="moe_compile", fullgraph=True), ids)
    finally:
        torch._dynamo.reset()
    assert torch.equal(loss, loss_inductor), "moe_compile sampled other experts than plain Inductor"
    assert torch.all(grad == 0), f"exactly zero in eager and plain Inductor; up to {grad.abs().max().item():.3g}"
