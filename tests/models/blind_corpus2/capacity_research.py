"""Capacity-factor layers from research code the first batch did not cover:
- lucidrains/st-moe-pytorch TopNGating + MoE + Experts: softmax, top-n, per-rank one-hot masks [N, B, S, E],
  gates renormalised over the n, a second-expert threshold (the stochastic policy "route with probability
  min(1, gate / threshold)" is replaced by its deterministic form "route if gate >= threshold", so the layer is
  reproducible), exclusive cumsum along the sequence for positions, per-rank capacity with prev_expert_count,
  safe one-hot over capacity, combine [B, S, E, C] and dispatch = combine.bool(), einsum dispatch
  "b n d, b n e c -> b e c d", a ModuleList of GEGLU experts run over the [E, B, C, D] slabs, einsum combine.
- google/flaxformer routing.py TokensChooseScatterRouter + moe_layers.py _scatter_to_experts (JAX, translated):
  softmax, top-k, normalised gates, token priority from a cumsum over the k-major flattened one-hot, capacity
  mask, dispatch indices (expert, slot) and combine weights; tokens repeated k times and scattered into a
  [G, E, C, H] buffer (scatter_nd adds, as index_put_ with accumulate; dropped tokens are zeroed first), vmapped
  [E, H, F] GLU kernels as einsum, gathered back by (expert, slot) and combined with einsum("gtkh,gtk->gth").
- wolfecameron/nanoMoE model.py Router + MOELayer + MLPExperts: top-k on logits scattered into a -inf tensor then
  softmax, capacity from floor(k * cf * T / E) rounded up to even, k-major cumsum ranks, [T, E, C] combine weights
  and sec mask, dispatch as a matmul exp_mask.permute(1, 2, 0) @ x, bmm experts with in-place bias adds, combine as
  a matmul of the [T, E * C] weights with the [E * C, H] outputs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ._registry import EXPERTS, FFN, HIDDEN, CorpusLayer, materialize

MIN_EXPERT_CAPACITY = 4


# --------------------------------------------------------------------------------- lucidrains/st-moe-pytorch
def cumsum_exclusive(t):
    """Exclusive cumsum along the sequence axis (dim -2) of a [..., n, e] mask."""
    return F.pad(t, (0, 0, 1, -1)).cumsum(dim=-2)


def safe_one_hot(indexes, max_length):
    max_index = int(indexes.max()) + 1 if indexes.numel() else 1
    one_hot_classes = max(max_index + 1, max_length)
    return F.one_hot(indexes, one_hot_classes)[..., :max_length]


class GEGLU(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.mult_bias = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x, gate = x.chunk(2, dim=-1)
        return F.gelu(gate) * x * self.mult_bias


class STExpert(nn.Module):
    def __init__(self, dim, hidden_mult_dim):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden_mult_dim * 2), GEGLU(hidden_mult_dim),
                                 nn.Linear(hidden_mult_dim, dim))

    def forward(self, x):
        return self.net(x)


class TopNGating(nn.Module):
    def __init__(self, dim, num_gates, eps=1e-9, top_n=2, threshold=0.2, capacity_factor_train=1.25,
                 capacity_factor_eval=2.0):
        super().__init__()
        self.eps = eps
        self.num_gates = num_gates
        self.top_n = top_n
        self.to_gates = nn.Linear(dim, num_gates, bias=False)
        self.register_buffer("threshold", torch.tensor([eps] + [threshold] * (top_n - 1)), persistent=False)
        self.capacity_factor_train = capacity_factor_train
        self.capacity_factor_eval = capacity_factor_eval

    def forward(self, x):
        b, group_size, _ = x.shape
        num_gates = self.num_gates
        capacity_factor = self.capacity_factor_train if self.training else self.capacity_factor_eval
        expert_capacity = min(group_size, int((group_size * capacity_factor) / num_gates))
        expert_capacity = max(expert_capacity, MIN_EXPERT_CAPACITY)
        expert_capacity_f = float(expert_capacity)

        gate_logits = self.to_gates(x)
        raw_gates = gate_logits.softmax(dim=-1)
        topk_return = torch.topk(raw_gates, k=self.top_n, dim=-1)
        gates = topk_return.values.permute(2, 0, 1)  # k b n
        gate_indices = topk_return.indices.permute(2, 0, 1)
        one_hot_gate_indices = F.one_hot(gate_indices, num_gates)
        mask = one_hot_gate_indices.float()

        denom = gates.sum(dim=0, keepdim=True).clamp(min=self.eps)
        gates = gates / denom

        should_route = gates >= self.threshold.view(-1, 1, 1)
        should_route[0, ...] = True
        mask = mask * should_route.float().unsqueeze(-1)

        mask_cumsum = cumsum_exclusive(mask)
        positions = []
        masks = []
        prev_expert_count = 0.0
        for n in range(self.top_n):
            position_in_expert = (mask_cumsum[n] + prev_expert_count) * mask[n]
            mask_n = mask[n] * (position_in_expert < expert_capacity_f).float()
            prev_expert_count = mask_n.sum(dim=-2, keepdim=True) + prev_expert_count
            positions.append(position_in_expert.sum(dim=-1))
            masks.append(mask_n)
        positions = torch.stack(positions)
        mask = torch.stack(masks)
        mask_flat = mask.sum(dim=-1)
        gates = gates * mask_flat

        combine_tensor = (gates[..., None, None] * mask_flat[..., None, None]
                          * one_hot_gate_indices[..., None].float()
                          * safe_one_hot(positions.long(), expert_capacity)[..., None, :].float())
        combine_tensor = combine_tensor.sum(dim=0).to(x.dtype)  # b n e c
        dispatch_tensor = combine_tensor.bool().to(x.dtype)
        return dispatch_tensor, combine_tensor


class STMoE(nn.Module):
    def __init__(self, dim, ffn, num_experts):
        super().__init__()
        self.gate = TopNGating(dim, num_experts)
        self.experts = nn.ModuleList([STExpert(dim, ffn) for _ in range(num_experts)])

    def forward(self, x):
        dispatch_tensor, combine_tensor = self.gate(x)
        expert_inputs = torch.einsum("b n d, b n e c -> b e c d", x, dispatch_tensor)
        expert_inputs = expert_inputs.permute(1, 0, 2, 3)  # e b c d
        outs = []
        for expert, expert_input in zip(self.experts, expert_inputs):
            outs.append(expert(expert_input))
        expert_outputs = torch.stack(outs).permute(1, 0, 2, 3)  # b e c d
        return torch.einsum("b e c d, b n e c -> b n d", expert_outputs, combine_tensor)


# ------------------------------------------------------------------------------------ google/flaxformer
class TokensChooseScatterRouter(nn.Module):
    def __init__(self, dim, num_experts, num_selected_experts, normalize=True):
        super().__init__()
        self.router_weights = nn.Linear(dim, num_experts, bias=False)
        self.num_experts = num_experts
        self.num_selected_experts = num_selected_experts
        self.normalize = normalize

    def forward(self, token_inputs, expert_capacity):
        router_logits = self.router_weights(token_inputs)
        router_probs = F.softmax(router_logits, dim=-1)
        g, t, _ = router_probs.shape
        k = self.num_selected_experts
        expert_gate, expert_index = torch.topk(router_probs, k=k, dim=-1)  # [G, T, K]
        if self.normalize:
            expert_gate = expert_gate / expert_gate.sum(dim=-1, keepdim=True)
        flat_index = expert_index.transpose(1, 2).reshape(g, k * t)  # k-major: top-1 choices get priority
        expert_mask = F.one_hot(flat_index, self.num_experts)
        token_priority = torch.cumsum(expert_mask, dim=1) * expert_mask - 1
        token_priority = token_priority.reshape(g, k, t, self.num_experts).transpose(1, 2)
        token_priority = token_priority.max(dim=-1).values  # [G, T, K]
        valid_mask = token_priority < expert_capacity
        token_priority = torch.where(valid_mask, token_priority, torch.zeros_like(token_priority))
        dispatch_indices = torch.stack([expert_index, token_priority], dim=-1)  # [G, T, K, 2]
        combine_weights = expert_gate * valid_mask.to(expert_gate.dtype)
        return dispatch_indices, combine_weights, valid_mask


class FlaxformerScatterMoeLayer(nn.Module):
    def __init__(self, dim, ffn, num_experts, num_selected_experts, capacity_factor):
        super().__init__()
        self.num_experts = num_experts
        self.capacity_factor = capacity_factor
        self.router = TokensChooseScatterRouter(dim, num_experts, num_selected_experts)
        # MlpBlock vmapped over experts: gated-gelu wi_0 / wi_1 and wo kernels
        self.wi_0 = nn.Parameter(torch.empty(num_experts, dim, ffn))
        self.wi_1 = nn.Parameter(torch.empty(num_experts, dim, ffn))
        self.wo = nn.Parameter(torch.empty(num_experts, ffn, dim))

    def forward(self, inputs):
        g, t, h = inputs.shape  # batch rows are the routing groups
        k = self.router.num_selected_experts
        expert_capacity = int(math.ceil(self.capacity_factor * t * k / self.num_experts))
        dispatch_indices, combine_weights, valid_mask = self.router(inputs, expert_capacity)
        # _scatter_to_experts
        token_inputs = inputs.repeat_interleave(k, dim=1)  # [G, T*K, H]
        token_inputs = token_inputs * valid_mask.reshape(g, t * k, 1).to(inputs.dtype)
        flat_indices = dispatch_indices.reshape(g, t * k, 2)
        group_ids = torch.arange(g, device=inputs.device).unsqueeze(1).expand(g, t * k)
        expert_inputs = inputs.new_zeros(g, self.num_experts, expert_capacity, h)
        expert_inputs = expert_inputs.index_put(
            (group_ids, flat_indices[..., 0], flat_indices[..., 1]), token_inputs, accumulate=True)
        # experts
        h0 = torch.einsum("gech,ehf->gecf", expert_inputs, self.wi_0)
        h1 = torch.einsum("gech,ehf->gecf", expert_inputs, self.wi_1)
        expert_outputs = torch.einsum("gecf,efh->gech", F.gelu(h0) * h1, self.wo)
        # gather back and combine
        combined_outputs = expert_outputs[group_ids, flat_indices[..., 0], flat_indices[..., 1]]
        combined_outputs = combined_outputs.reshape(g, t, k, h)
        return torch.einsum("gtkh,gtk->gth", combined_outputs, combine_weights.to(combined_outputs.dtype))


# ----------------------------------------------------------------------------------------- nanoMoE
class NanoRouter(nn.Module):
    def __init__(self, n_embd, n_exp, top_k, capacity_factor, min_capacity=4):
        super().__init__()
        self.n_exp = n_exp
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.min_capacity = min_capacity
        self.w_g = nn.Linear(n_embd, n_exp, bias=False)

    def get_capacity(self, tokens_per_batch):
        capacity = math.floor(self.top_k * self.capacity_factor * tokens_per_batch / self.n_exp)
        capacity += capacity % 2
        capacity = max(capacity, self.min_capacity)
        return int(capacity)

    def forward(self, x):
        B, T, _ = x.size()
        num_tokens = B * T
        logits = self.w_g(x)
        top_k_logits, top_k_indices = logits.topk(self.top_k, dim=-1)
        router_probs = torch.full_like(logits, float("-inf"))
        router_probs.scatter_(-1, top_k_indices, top_k_logits)
        router_probs = F.softmax(router_probs, dim=-1)

        exp_capacity = self.get_capacity(num_tokens)
        exp_mask = F.one_hot(top_k_indices, num_classes=self.n_exp)
        exp_mask = exp_mask.view(num_tokens, self.top_k, self.n_exp)
        exp_mask = exp_mask.permute(1, 0, 2)
        exp_rank = exp_mask.reshape(self.top_k * num_tokens, self.n_exp)
        exp_rank = torch.cumsum(exp_rank, dim=0) - 1
        exp_rank = exp_rank.reshape(self.top_k, num_tokens, self.n_exp)
        exp_mask = exp_mask * torch.lt(exp_rank, exp_capacity)
        used_capacity = torch.sum(exp_mask, dim=(0, 1))
        exp_rank = torch.sum(exp_mask * exp_rank, dim=-1)
        router_probs = router_probs.view(num_tokens, self.n_exp)[None, :]
        exp_weights = exp_mask * router_probs
        exp_rank_sc = F.one_hot(exp_rank, num_classes=exp_capacity)
        cb_weight = torch.sum(exp_weights.unsqueeze(3) * exp_rank_sc.unsqueeze(2), dim=0)
        sec_mask = cb_weight.bool()
        return used_capacity, cb_weight, sec_mask


class MLPExperts(nn.Module):
    def __init__(self, n_embd, ffn, n_exp):
        super().__init__()
        self.c_fc = nn.Parameter(torch.empty(n_exp, n_embd, ffn))
        self.c_proj = nn.Parameter(torch.empty(n_exp, ffn, n_embd))
        self.fc_bias = nn.Parameter(torch.empty(n_exp, 1, ffn))
        self.proj_bias = nn.Parameter(torch.empty(n_exp, 1, n_embd))
        self.gelu = nn.GELU()

    def forward(self, x):
        x = torch.bmm(x, self.c_fc)
        x += self.fc_bias
        x = self.gelu(x)
        x = torch.bmm(x, self.c_proj)
        x += self.proj_bias
        return x


class NanoMOELayer(nn.Module):
    def __init__(self, n_embd, ffn, n_exp, top_k, capacity_factor):
        super().__init__()
        self.router = NanoRouter(n_embd, n_exp, top_k, capacity_factor)
        self.experts = MLPExperts(n_embd, ffn, n_exp)

    def forward(self, x):
        B, T, n_embd = x.size()
        num_tokens = B * T
        used_capacity, exp_weight, exp_mask = self.router(x)
        x = x.view(num_tokens, n_embd)
        exp_batches = exp_mask.permute(1, 2, 0).type_as(x) @ x
        exp_out = self.experts(exp_batches)
        exp_weight = exp_weight.view(num_tokens, -1)
        exp_out = exp_out.view(-1, n_embd)
        output = exp_weight @ exp_out
        return output.view(B, T, n_embd)


def make_st_moe(dtype: torch.dtype, seed: int) -> nn.Module:
    module = materialize(lambda: STMoE(HIDDEN, FFN, EXPERTS), dtype, seed)
    with torch.no_grad():
        for expert in module.experts:
            expert.net[1].mult_bias.add_(1.0)  # GEGLU's mult_bias starts at ones upstream
    return module


def make_flaxformer(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: FlaxformerScatterMoeLayer(HIDDEN, FFN, EXPERTS, 2, 1.0), dtype, seed)


def make_nanomoe(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: NanoMOELayer(HIDDEN, FFN, EXPERTS, 2, 1.25), dtype, seed)


LAYERS = [
    CorpusLayer(
        name="st_moe_top_n_threshold_capacity",
        origin="lucidrains/st-moe-pytorch TopNGating (softmax, top-2 renormalised, threshold for the 2nd expert, "
               "exclusive cumsum positions, per-rank capacity) + einsum dispatch/combine + GEGLU Experts ModuleList",
        style="capacity",
        make=make_st_moe,
        input_shape=(2, 16, HIDDEN),
    ),
    CorpusLayer(
        name="flaxformer_scatter_router",
        origin="google/flaxformer TokensChooseScatterRouter + _scatter_to_experts (token priority cumsum, "
               "index_put accumulate into [G, E, C, H], einsum GLU experts, gather by (expert, slot), einsum combine)",
        style="capacity",
        make=make_flaxformer,
        input_shape=(2, 16, HIDDEN),
    ),
    CorpusLayer(
        name="nanomoe_matmul_capacity",
        origin="wolfecameron/nanoMoE Router (-inf scatter + softmax, k-major cumsum ranks, [T, E, C] cb_weight) + "
               "MOELayer (mask @ x dispatch, weight @ out combine) + MLPExperts bmm with in-place bias",
        style="capacity",
        make=make_nanomoe,
        input_shape=(2, 16, HIDDEN),
    ),
]
