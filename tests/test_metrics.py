"""``moe_compile.metrics`` in eager mode: the op's statistics, ``attach``, ``collect`` and ``reset``.

Oracles: transformers' ``load_balancing_loss_func`` on one layer's router logits (Mixtral tiny config)
and hand computations (z-loss, entropy, counts, max/mean load, over-capacity fraction).
"""

from __future__ import annotations

import math

import pytest
import torch

from moe_compile import metrics
from moe_compile.ops.router_metrics import NUM_STATS, STATS, new_accumulator, router_metrics_, router_stats
from tests.models.router_metrics_models import RoutedStack


@pytest.fixture(autouse=True)
def _fresh_registry():
    metrics.forget()
    yield
    metrics.forget()


def _hand_stats(logits_TE: torch.Tensor, idx_TK: torch.Tensor, capacity_factor: float = 0.0) -> dict[str, float]:
    """Loop-and-float64 reference of one call's statistics."""
    logits = logits_TE.double()
    T, E = logits.shape
    K = idx_TK.shape[1]
    counts = [0.0] * E
    for e in idx_TK.reshape(-1).tolist():
        if 0 <= e < E:
            counts[e] += 1
    probs = torch.softmax(logits, -1)
    lse = torch.logsumexp(logits, -1)
    entropy = -(probs * probs.log()).sum(-1).mean().item()
    prob_E = probs.mean(0).tolist()
    out = {
        "steps": 1.0,
        "tokens": float(T),
        "lb_loss": E * sum(c / T * p for c, p in zip(counts, prob_E)),
        "z_loss": lse.square().mean().item(),
        "entropy": entropy,
        "max_over_mean_load": max(counts) / (sum(counts) / E),
        "over_capacity": 0.0,
        "invalid_ids": float(T * K - sum(counts)),
    }
    if capacity_factor > 0:
        cap = math.ceil(capacity_factor * T * K / E)
        out["over_capacity"] = sum(max(c - cap, 0) for c in counts) / (T * K)
    return out | {f"count_{e}": c for e, c in enumerate(counts)}


def _as_dict(row: torch.Tensor) -> dict[str, float]:
    values = row.tolist()
    return dict(zip(STATS, values[:NUM_STATS])) | {f"count_{e}": c for e, c in enumerate(values[NUM_STATS:])}


@pytest.mark.parametrize("capacity_factor", [0.0, 1.0])
def test_op_matches_hand_computation(capacity_factor):
    g = torch.Generator().manual_seed(1)
    T, E, K = 13, 6, 2
    logits = 2 * torch.randn(T, E, generator=g)
    logits[0] += 8.0  # one confident token: entropy near 0, large logsumexp
    idx = torch.topk(logits, K, dim=-1).indices
    idx[:4, 0] = 5  # skew: expert 5 over capacity
    got = _as_dict(router_stats(logits.to(torch.bfloat16).float(), idx, capacity_factor))
    want = _hand_stats(logits.to(torch.bfloat16).float(), idx, capacity_factor)
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    if capacity_factor:
        assert got["over_capacity"] > 0


def test_op_accumulates_in_place_ignores_foreign_ids_and_keeps_grads():
    g = torch.Generator().manual_seed(2)
    E = 4
    acc = new_accumulator(E, "cpu")
    ptr = acc.data_ptr()
    logits = torch.randn(2, 5, E, generator=g, requires_grad=True)  # [B, S, E] is flattened
    idx = torch.randint(0, E + 2, (2, 5, 2), generator=g)  # ids >= E: not local, not counted
    router_metrics_(acc, logits, idx)
    router_metrics_(acc, logits, idx)
    assert acc.data_ptr() == ptr and not acc.requires_grad and logits.grad is None
    once = router_stats(logits, idx).double()
    torch.testing.assert_close(acc, 2 * once)
    valid = idx[(idx >= 0) & (idx < E)]
    assert acc[NUM_STATS:].sum().item() == 2 * valid.numel()
    assert acc[STATS.index("tokens")].item() == 20


@pytest.mark.parametrize("bad", [6, -1, 2**40], ids=["E", "minus_1", "2_pow_40"])
def test_op_counts_invalid_ids_per_layer(bad):
    """Issue 35: expert ids outside [0, E), which moe.permute_pad drops and poisons on CUDA, are counted on the
    device (``invalid_ids``) and reported per layer by collect()."""
    g = torch.Generator().manual_seed(int(torch.seed() % 2**31))
    T, E, K = 7, 6, 2
    logits = torch.randn(T, E, generator=g)
    idx = torch.topk(logits, K, dim=-1).indices
    idx[2, 1] = idx[5, 0] = idx[5, 1] = bad
    assert router_stats(logits, idx)[STATS.index("invalid_ids")].item() == 3
    entry = metrics.accumulator("model.layers.4.mlp.gate", E, "cpu")
    router_metrics_(entry.acc_S, logits, idx)
    router_metrics_(entry.acc_S, logits, idx.clamp(0, E - 1))  # a clean step: 3 per 2 steps
    got = metrics.collect(per_layer=True)
    assert got["moe/layer_4/invalid_ids"] == 1.5 and got["moe/invalid_ids"] == 1.5


def test_op_rejects_bad_arguments():
    with pytest.raises(ValueError, match="acc_S"):
        router_metrics_(new_accumulator(3, "cpu"), torch.randn(4, 4), torch.zeros(4, 1, dtype=torch.long))
    with pytest.raises(TypeError, match="expert_idx"):
        router_metrics_(new_accumulator(4, "cpu"), torch.randn(4, 4), torch.zeros(4, 1))
    with pytest.raises(ValueError, match="num_experts"):
        new_accumulator(0, "cpu")


def test_lb_loss_equals_transformers_load_balancing_loss_mixtral():
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    from tests.models.hf_models import build_causal_lm

    model, inputs = build_causal_lm("mixtral", seq=12)
    cfg = model.config
    names = metrics.attach(model)
    assert names == [f"model.layers.{i}.mlp.gate" for i in range(cfg.num_hidden_layers)]
    with torch.no_grad():
        out = model(**inputs)
    got = metrics.collect(per_layer=True)
    E, K = cfg.num_local_experts, cfg.num_experts_per_tok
    for i, logits in enumerate(out.router_logits):
        want = mixtral.load_balancing_loss_func((logits,), E, K).item()
        assert got[f"moe/layer_{i}/lb_loss"] == pytest.approx(want, rel=1e-5)
        z = torch.logsumexp(logits.double(), -1).square().mean().item()
        assert got[f"moe/layer_{i}/z_loss"] == pytest.approx(z, rel=1e-5)
        counts = torch.bincount(torch.topk(logits.softmax(-1), K).indices.reshape(-1), minlength=E)
        assert [got[f"moe/layer_{i}/tokens_per_expert/{e}"] for e in range(E)] == counts.tolist()
    mean_lb = sum(got[f"moe/layer_{i}/lb_loss"] for i in range(cfg.num_hidden_layers)) / cfg.num_hidden_layers
    assert got["moe/lb_loss"] == pytest.approx(mean_lb)
    metrics.detach(model)


def test_attach_accumulates_over_steps_and_reset():
    model, oracle = RoutedStack(layers=2, router="softmax"), RoutedStack(layers=2, router="softmax")
    assert metrics.attach(model) == ["layers.0.gate", "layers.1.gate"]
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(n, 16, generator=g) for n in (5, 7, 9)]
    per_step = []
    for x in xs:
        model(x)
        per_step.append([_hand_stats(lg, torch.topk(lg.softmax(-1), 2).indices) for lg in oracle.router_logits(x)])
    got = metrics.collect(reset=False, per_layer=True)
    for layer in range(2):
        for key in ("lb_loss", "z_loss", "entropy", "max_over_mean_load", "tokens"):
            want = sum(s[layer][key] for s in per_step) / 3
            assert got[f"moe/layer_{layer}/{key}"] == pytest.approx(want, rel=1e-5), (layer, key)
        for e in range(4):
            want = sum(s[layer][f"count_{e}"] for s in per_step) / 3
            assert got[f"moe/layer_{layer}/tokens_per_expert/{e}"] == pytest.approx(want)
        assert got[f"moe/layer_{layer}/steps"] == 3
    assert got["moe/tokens"] == pytest.approx(7.0) and got["moe/layers"] == 2
    assert got["moe/z_loss"] == pytest.approx((got["moe/layer_0/z_loss"] + got["moe/layer_1/z_loss"]) / 2)
    assert "moe/over_capacity" not in got  # no capacity anywhere
    assert all(isinstance(v, float) for v in got.values())
    # reset=False kept the sums; reset=True (default) returns them once more, then nothing
    assert metrics.collect(per_layer=True) == got
    assert metrics.collect() == {}
    model(xs[0])
    again = metrics.collect(per_layer=True)
    assert again["moe/steps"] == 1
    assert again["moe/layer_0/z_loss"] == pytest.approx(per_step[0][0]["z_loss"], rel=1e-5)


def test_aggregate_keys_without_per_layer_and_capacity():
    model, oracle = RoutedStack(layers=2, router="granite"), RoutedStack(layers=2, router="granite")
    metrics.attach(model, capacity_factor=1.0)
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(4))
    model(x)
    got = metrics.collect()
    assert not any(k.startswith("moe/layer_") for k in got)
    assert set(got) == {
        "moe/lb_loss", "moe/z_loss", "moe/entropy", "moe/max_over_mean_load", "moe/over_capacity", "moe/tokens",
        "moe/invalid_ids", "moe/tokens_per_expert_min", "moe/tokens_per_expert_max", "moe/steps", "moe/layers",
    }
    assert got["moe/invalid_ids"] == 0
    # granite's router picks the top-k of the logits: the same experts as top-k of the softmax
    hand = [_hand_stats(lg, torch.topk(lg, 2).indices, 1.0) for lg in oracle.router_logits(x)]
    assert got["moe/over_capacity"] == pytest.approx(sum(h["over_capacity"] for h in hand) / 2)
    assert got["moe/lb_loss"] == pytest.approx(sum(h["lb_loss"] for h in hand) / 2, rel=1e-5)


def test_attach_leaves_outputs_and_grads_unchanged():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, 16, generator=g, requires_grad=True)
    ref_model, model = RoutedStack(router="qwen"), RoutedStack(router="qwen")
    metrics.attach(model)
    ref, out = ref_model(x), model(x)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    (gx_ref,) = torch.autograd.grad(ref.square().sum(), [x])
    gw_ref = torch.autograd.grad(ref_model(x).square().sum(), list(ref_model.parameters()))
    (gx,) = torch.autograd.grad(out.square().sum(), [x])
    gw = torch.autograd.grad(model(x).square().sum(), list(model.parameters()))
    torch.testing.assert_close(gx, gx_ref, rtol=0, atol=0)
    for a, b in zip(gw, gw_ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert metrics.collect()["moe/steps"] == 2  # two forwards through the hooked model


def test_linear_router_needs_top_k_and_detach_stops_counting():
    class Bare(torch.nn.Module):  # a gate next to experts, but no top_k attribute anywhere
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(8, 4, bias=False)
            self.experts = torch.nn.Parameter(torch.zeros(4, 8, 8))

        def forward(self, x):
            return self.gate(x)

    model = Bare()
    metrics.attach(model)
    with pytest.raises(ValueError, match="top_k"):
        model(torch.randn(3, 8))
    metrics.attach(model, top_k=1)  # idempotent: replaces the hook
    model(torch.randn(3, 8))
    metrics.detach(model)
    model(torch.randn(3, 8))
    got = metrics.collect(per_layer=True)
    assert got["moe/steps"] == 1 and got["moe/tokens"] == 3
    assert "moe/layer_gate/lb_loss" in got  # no integer in the path: the path names the layer


def test_layer_ids_follow_module_paths():
    ids = metrics._layer_ids(["model.layers.3.mlp.gate", "model.layers.11.mlp.gate", "gate",
                              "enc.blocks.2.router", "dec.blocks.2.router"])
    assert ids["model.layers.3.mlp.gate"] == "3" and ids["model.layers.11.mlp.gate"] == "11"
    assert ids["gate"] == "gate"
    assert ids["enc.blocks.2.router"] == "enc_blocks_2_router"  # two paths share 2: keep the paths
    assert ids["dec.blocks.2.router"] == "dec_blocks_2_router"


def test_capacity_factor_validation_and_registry_conflicts():
    with pytest.raises(ValueError, match="capacity_factor"):
        metrics.set_capacity_factor(0.0)
    metrics.accumulator("layers.0.gate", 4, "cpu")
    with pytest.raises(ValueError, match="4 experts, now 8"):
        metrics.accumulator("layers.0.gate", 8, "cpu")
    assert metrics.layers() == ["layers.0.gate"]


def test_activation_checkpointing_recompute_is_not_counted():
    from torch.utils.checkpoint import checkpoint

    model = RoutedStack(router="softmax")
    metrics.attach(model)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(6), requires_grad=True)
    for use_reentrant in (False, True):
        y = x
        for block in model.layers:
            y = checkpoint(block, y, use_reentrant=use_reentrant)
        y.square().mean().backward()  # re-runs each block's forward, hooks included
    got = metrics.collect(per_layer=True)
    assert got["moe/layer_0/steps"] == 2 and got["moe/layer_1/steps"] == 2


def test_op_names_every_bad_argument():
    acc, logits, idx = new_accumulator(4, "cpu"), torch.randn(6, 4), torch.zeros(6, 2, dtype=torch.long)
    cases = [
        (lambda: router_metrics_(acc, logits, idx[:5]), "expert_idx must be .* one row per token of logits"),
        (lambda: router_metrics_(acc, logits.long(), idx), "logits must be a float tensor"),
        (lambda: router_metrics_(acc.long(), logits, idx), "acc_S must have a float dtype"),
        (lambda: router_metrics_(acc, logits, idx, capacity_factor="1.0"), "capacity_factor must be a number"),
        (lambda: router_metrics_(acc, logits, idx, capacity_factor=float("nan")), "capacity_factor must be a number"),
        (lambda: router_metrics_(acc, logits, idx.bool()), "expert_idx must be an integer tensor"),
        (lambda: router_metrics_(acc, logits.to("meta"), idx), "one device"),
        (lambda: router_metrics_(acc, [1.0], idx), "logits must be a torch.Tensor"),
    ]
    for call, match in cases:
        with pytest.raises((ValueError, TypeError), match=match):
            call()
