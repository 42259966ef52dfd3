"""``quantize_experts``: detection, the parity matrix, checkpoints both ways, training, compile."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moe_compile  # noqa: F401  (registers the "moe_compile" backend)
from moe_compile.experts.discovery import find_expert_weights
from moe_compile.experts.quantize import GroupedExpertList, GroupedLinear, quantize_experts
from tests import _tolerance as tol

H, I, E, TOPK, T = 64, 32, 4, 2, 6  # noqa: E741 - I: expert intermediate size
RECIPES = ("bf16", "mxfp8", "nvfp4")


# ===== tiny models: one stacked (HF style), one discrete (ModuleList of MLPs) =====


class StackedExperts(nn.Module):
    """HF ``*Experts`` layout: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``, grouped_mm forward."""

    def __init__(self):
        super().__init__()
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(0.1 * torch.randn(E, 2 * I, H))
        self.down_proj = nn.Parameter(0.1 * torch.randn(E, H, I))

    def forward(self, x_TH, idx_TK, w_TK):
        perm = torch.argsort(idx_TK.reshape(-1), stable=True)
        rows = x_TH[perm // TOPK]
        offs = torch.cumsum(F.one_hot(idx_TK.reshape(-1), E).sum(0), 0).to(torch.int32)
        gate, up = torch._grouped_mm(rows, self.gate_up_proj.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, self.down_proj.transpose(-2, -1), offs=offs)
        y = y * w_TK.reshape(-1)[perm, None]
        return torch.zeros_like(x_TH).index_add(0, perm // TOPK, y)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(H, I, bias=False), nn.Linear(H, I, bias=False), nn.Linear(I, H)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DiscreteExperts(nn.Module):
    """``experts[e].w1/w3/w2`` as ``nn.Linear``; dense combine (compile-friendly, no data-dependent shapes)."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList([MLP() for _ in range(E)])

    def forward(self, x_TH, idx_TK, w_TK):
        gates_TE = torch.zeros(x_TH.shape[0], E, dtype=x_TH.dtype).scatter_add(1, idx_TK, w_TK)
        out = torch.zeros_like(x_TH)
        for e, expert in enumerate(self.experts):
            out = out + expert(x_TH) * gates_TE[:, e : e + 1]
        return out


class Block(nn.Module):
    def __init__(self, experts: nn.Module):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = experts

    def forward(self, x_TH):
        w_TK, idx_TK = torch.topk(self.router(x_TH).softmax(-1), TOPK, dim=-1)
        return self.experts(x_TH, idx_TK, w_TK)


def make_block(kind: str, seed: int = 0) -> Block:
    torch.manual_seed(seed)
    return Block(StackedExperts() if kind == "stacked" else DiscreteExperts()).to(torch.bfloat16)


def inputs(seed: int = 1) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _expert_list(block: Block) -> GroupedExpertList | None:
    experts = getattr(block.experts, "experts", None)
    return experts if isinstance(experts, GroupedExpertList) else None


def grouped_weights(block: Block) -> dict[str, torch.Tensor]:
    """Dequantised ``[E, N, K]`` expert weights and stacked biases of a converted block."""
    if _expert_list(block) is not None:
        params = dict(_expert_list(block).named_parameters(recurse=False))
    else:
        params = {"gate_up_proj": block.experts.gate_up_proj, "down_proj": block.experts.down_proj}
    return {n: (p.dequantize() if hasattr(p, "dequantize") else p).detach() for n, p in params.items()}


def dequantized_reference(original: Block, converted: Block) -> Block:
    """The original (unconverted) model with every expert weight replaced by its dequantised value."""
    ref = copy.deepcopy(original)
    weights = grouped_weights(converted)
    with torch.no_grad():
        if _expert_list(converted) is not None:
            for e, expert in enumerate(ref.experts.experts):
                for path in ("w1", "w2", "w3"):
                    getattr(expert, path).weight.copy_(weights[f"{path}_weight"][e])
                expert.w2.bias.copy_(weights["w2_bias"][e])
        else:
            ref.experts.gate_up_proj.copy_(weights["gate_up_proj"])
            ref.experts.down_proj.copy_(weights["down_proj"])
    return ref


def reference_grads(ref: Block) -> dict[str, torch.Tensor]:
    if isinstance(ref.experts, StackedExperts):
        return {"gate_up_proj": ref.experts.gate_up_proj.grad, "down_proj": ref.experts.down_proj.grad}
    grads = {}
    for path in ("w1", "w2", "w3"):
        grads[f"{path}_weight"] = torch.stack([getattr(m, path).weight.grad for m in ref.experts.experts])
    grads["w2_bias"] = torch.stack([m.w2.bias.grad for m in ref.experts.experts])
    return grads


def converted_grads(block: Block) -> dict[str, torch.Tensor]:
    if _expert_list(block) is not None:
        return {n: p.grad for n, p in _expert_list(block).named_parameters(recurse=False)}
    return {"gate_up_proj": block.experts.gate_up_proj.grad, "down_proj": block.experts.down_proj.grad}


# ===== detection =====


def test_detects_stacked_and_module_list():
    stacked = find_expert_weights(make_block("stacked"))
    assert [(g.name, g.kind) for g in stacked] == [("experts", "stacked")]
    assert [(s.path, s.out_features, s.in_features) for s in stacked[0].linears] == [
        ("gate_up_proj", 2 * I, H),
        ("down_proj", H, I),
    ]
    discrete = find_expert_weights(make_block("discrete"))
    assert [(g.name, g.kind) for g in discrete] == [("experts.experts", "module_list")]
    assert [(s.path, s.has_bias) for s in discrete[0].linears] == [("w1", False), ("w3", False), ("w2", True)]


def test_detects_torchtitan_layout_and_linear_lists():
    class GroupedExpertsTT(nn.Module):  # torchtitan: w1/w3 [E, hidden, dim], w2 [E, dim, hidden]
        def __init__(self):
            super().__init__()
            self.num_experts = E
            self.w1, self.w2, self.w3 = (nn.Parameter(torch.randn(E, *s)) for s in ((I, H), (H, I), (I, H)))

    model = nn.Sequential(GroupedExpertsTT())
    model.add_module("experts", nn.ModuleList([nn.Linear(H, I) for _ in range(E)]))
    groups = find_expert_weights(model)
    assert [(g.name, g.kind, [s.path for s in g.linears]) for g in groups] == [
        ("0", "stacked", ["w1", "w2", "w3"]),
        ("experts", "module_list", [""]),
    ]
    assert find_expert_weights(model, filter_fn=lambda name, m: name != "0")[0].name == "experts"


def test_ignores_non_expert_structures():
    layers = nn.ModuleList([nn.Sequential(nn.Linear(H, H), nn.Linear(H, H)) for _ in range(3)])
    mixed = nn.ModuleList([nn.Linear(H, I), nn.Linear(H, I + 1)])
    model = nn.Module()
    model.layers, model.experts, model.conv = layers, mixed, nn.Conv1d(4, 4, 3)
    assert find_expert_weights(model) == []


# ===== parity matrix: {bf16, mxfp8, nvfp4} x {stacked, discrete} x {quantised primary, bf16 master} =====


@pytest.mark.parametrize("master", [False, True], ids=["primary", "master"])
@pytest.mark.parametrize("kind", ["stacked", "discrete"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_parity_with_dequantized_bf16_model(recipe, kind, master):
    original = make_block(kind)
    block = quantize_experts(copy.deepcopy(original), recipe, master_weights=master)
    ref = dequantized_reference(original, block)
    weights = grouped_weights(block)
    if recipe != "bf16":
        raw = grouped_weights(quantize_experts(copy.deepcopy(original), "bf16"))
        assert all(not torch.equal(weights[n], raw[n]) for n in weights if "bias" not in n)  # really quantised
    x = inputs().requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    out, out_ref = block(x), ref(x_ref)
    assert torch.equal(out, out_ref)
    dy = inputs(seed=2)
    out.backward(dy)
    out_ref.backward(dy)
    assert torch.equal(x.grad, x_ref.grad)
    got, want = converted_grads(block), reference_grads(ref)
    assert got.keys() == want.keys()
    for name in got:
        assert type(got[name]) is torch.Tensor and torch.equal(got[name], want[name]), name
    assert torch.equal(block.router.weight.grad, ref.router.weight.grad)


def test_discrete_structure_after_conversion():
    block = quantize_experts(make_block("discrete"), "mxfp8")
    assert isinstance(block.experts.experts, GroupedExpertList) and len(block.experts.experts) == E
    assert isinstance(block.experts.experts[2].w1, GroupedLinear)
    assert block.experts.experts.grouped_weight("w1").shape == (E, I, H)
    assert {n for n, _ in block.named_parameters()} == {
        "router.weight",
        "experts.experts.w1_weight",
        "experts.experts.w3_weight",
        "experts.experts.w2_weight",
        "experts.experts.w2_bias",
    }


def test_requantize_converted_model():
    """A converted model is found again (a GroupedExpertList holds stacked weights) and re-quantised
    from its best copy (the bf16 master here)."""
    original = make_block("discrete")
    block = quantize_experts(quantize_experts(copy.deepcopy(original), "mxfp8", master_weights=True), "nvfp4")
    expected = quantize_experts(copy.deepcopy(original), "nvfp4")
    assert torch.equal(block(inputs()), expected(inputs()))


def test_hf_qwen3_moe_block():
    from tests.models.hf_models import block_output, build_sparse_moe_block

    original = build_sparse_moe_block("qwen3_moe", dtype=torch.bfloat16)
    for recipe in ("mxfp8", "nvfp4"):
        block = quantize_experts(copy.deepcopy(original), recipe)
        assert type(block.experts.gate_up_proj).__name__ == "GroupedQuantWeight"
        ref = copy.deepcopy(original)
        with torch.no_grad():
            ref.experts.gate_up_proj.copy_(block.experts.gate_up_proj.dequantize())
            ref.experts.down_proj.copy_(block.experts.down_proj.dequantize())
        x = torch.randn(2, 8, 64, dtype=torch.bfloat16)
        assert torch.equal(block_output(block(x)), block_output(ref(x)))


# ===== checkpoints =====


@pytest.mark.parametrize("master", [False, True], ids=["primary", "master"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_checkpoint_discrete_to_grouped_and_back(recipe, master):
    original = make_block("discrete")
    # per-expert (original layout) -> grouped model built from other weights
    grouped = quantize_experts(make_block("discrete", seed=5), recipe, master_weights=master)
    grouped.load_state_dict(original.state_dict())
    expected = quantize_experts(copy.deepcopy(original), recipe, master_weights=master)
    for name, w in grouped_weights(grouped).items():
        assert torch.equal(w, grouped_weights(expected)[name]), name
    # grouped -> a plain per-expert model: same outputs as the dequantised reference
    plain = make_block("discrete", seed=6)
    plain.load_state_dict(grouped.state_dict())
    expected_model = original if master else dequantized_reference(original, grouped)  # masters load exactly
    assert torch.equal(plain(inputs()), expected_model(inputs()))


@pytest.mark.parametrize("kind", ["stacked", "discrete"])
@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_checkpoint_quantized_round_trip_does_not_requantize(recipe, kind, monkeypatch):
    source = quantize_experts(make_block(kind), recipe)
    buf = io.BytesIO()
    torch.save(source.state_dict(), buf)
    target = quantize_experts(make_block(kind, seed=7), recipe)
    from moe_compile.experts import grouped_weight

    def no_requant(*args, **kwargs):
        raise AssertionError("loading quantised weights must not re-quantise")

    monkeypatch.setattr(grouped_weight, "quantize_stored", no_requant)
    buf.seek(0)
    target.load_state_dict(torch.load(buf, weights_only=True))
    for name, w in grouped_weights(target).items():
        assert torch.equal(w, grouped_weights(source)[name]), name
    assert torch.equal(target(inputs()), source(inputs()))


def test_checkpoint_stacked_into_plain_model():
    original = make_block("stacked")
    quantized = quantize_experts(copy.deepcopy(original), "nvfp4")
    assert set(quantized.state_dict()) == set(original.state_dict())
    plain = make_block("stacked", seed=8)
    plain.load_state_dict(quantized.state_dict())
    assert torch.equal(plain(inputs()), quantized(inputs()))


# ===== training =====


def _train(block: Block, steps: int, eval_after: tuple[int, ...] = ()) -> list[torch.Tensor]:
    opt = torch.optim.AdamW(block.parameters(), lr=3e-2, weight_decay=0.1)
    losses = []
    for step in range(steps):
        block.train()
        loss = block(inputs(seed=10 + step)).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        if step in eval_after:
            block.eval()
            with torch.no_grad():
                block(inputs(seed=99))
    return losses


@pytest.mark.parametrize("master", [False, True], ids=["primary", "master"])
@pytest.mark.parametrize("kind,recipe", [("stacked", "mxfp8"), ("discrete", "nvfp4"), ("stacked", "nvfp4")])
def test_train_eval_train_equals_train(kind, recipe, master):
    a = quantize_experts(make_block(kind), recipe, master_weights=master)
    b = copy.deepcopy(a)
    before = grouped_weights(a)
    losses_a = _train(a, 3)
    losses_b = _train(b, 3, eval_after=(0, 1))
    assert all(torch.equal(x, y) for x, y in zip(losses_a, losses_b))
    for name, w in grouped_weights(a).items():
        assert torch.equal(w, grouped_weights(b)[name]), name
    changed = [not torch.equal(w, before[n]) for n, w in grouped_weights(a).items() if "bias" not in n]
    assert all(changed), "the optimizer must update the quantised weights"
    params = dict(a.named_parameters())
    for _name, p in params.items():
        if type(p).__name__ == "GroupedQuantWeight":
            assert (p.master is not None) == master
            if master:  # the compute copy is the quantised master, never stale
                assert torch.equal(p.dequantize(), type(p).from_hp(p.master, recipe).dequantize())


# ===== compile =====


@pytest.mark.parametrize(
    "kind,recipe,backend", [("stacked", "nvfp4", "moe_compile"), ("discrete", "mxfp8", "aot_eager")]
)
def test_compile_converted_block(kind, recipe, backend):
    """Training-mode compile with bf16 masters. Plain Inductor is covered in test_grouped_weight; the
    discrete block (E unrolled expert calls) uses aot_eager to keep CI time down."""
    torch._dynamo.reset()
    block = quantize_experts(make_block(kind), recipe, master_weights=True)
    x = inputs().requires_grad_()
    eager = block(x)
    eager.float().pow(2).sum().backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    x_grad = x.grad.clone()
    block.zero_grad(set_to_none=True)
    x.grad = None
    compiled = torch.compile(block, backend=backend, fullgraph=True)
    out = compiled(x)
    out.float().pow(2).sum().backward()
    # both sides read the same quantised weights: the layer bound of its GEMMs (router and gate/up over H,
    # down over I), bf16 roundings, weight grads summed over the T tokens
    k_dims = [H, H, I]
    tol.assert_layer_close(out, eager, k_dims, what="output")
    tol.assert_layer_close(x.grad, x_grad, k_dims, backward=True, rows=T, what="dX")
    for name, p in block.named_parameters():
        tol.assert_layer_close(p.grad, grads[name], k_dims, backward=True, rows=T, what=name)


# ===== errors =====


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="recipe='int4'"):
        quantize_experts(make_block("stacked"), "int4")
    with pytest.raises(ValueError, match="no expert weights found in Sequential"):
        quantize_experts(nn.Sequential(nn.Linear(4, 4)), "mxfp8")
    block = make_block("stacked")
    block.experts.down_proj = nn.Parameter(torch.randn(E, H, 48, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"experts\.down_proj: w: K=48 .* block size 32"):
        quantize_experts(block, "mxfp8")
