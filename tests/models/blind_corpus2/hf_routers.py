"""Routers the first batch did not have, from transformers / model-hub code:
- Phi-3.5-MoE (microsoft/Phi-3.5-MoE-instruct modeling_phimoe.py, later transformers models/phimoe): sparsemixer
  routing, eval branch (argmax pick, a relative-threshold -inf mask, softmax of the masked logits gathered at the
  pick; then the pick is scattered to -inf and the second expert chosen the same way), Mixtral-style
  PhiMoEBlockSparseTop2MLP ModuleList with a one_hot/where/index_add_ loop that skips empty experts.
- ERNIE 4.5 MoE (transformers models/ernie4_5_moe, v4.5x): fp32 gate Linear, softmax, selection on probabilities
  plus a frozen correction bias held by a Ernie4_5_MoeStatics module, gather of the unbiased probabilities,
  renormalisation divided by clamp(sum, min=norm_min), expert_hit loop, shared experts added.
- LongCat-Flash (transformers models/longcat_flash): softmax router over routed + zero-computation experts with an
  e_score_correction_bias for selection only and a routed scaling factor; stacked gate_up_proj / down_proj experts
  looped over expert_hit with .item(), experts past the routed count are identities.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._registry import EXPERTS, FFN, HIDDEN, CorpusLayer, materialize, seeded_uniform_


# ------------------------------------------------------------------------------------------------ PhiMoE
def sparsemixer_eval(scores, jitter_eps):
    with torch.no_grad():
        threshold, max_ind = scores.max(dim=-1, keepdim=True)
        factor = scores.abs().clamp(min=threshold)
        drop = ((threshold - scores) / factor) > (2 * jitter_eps)
    masked_gates = torch.softmax(scores.masked_fill(drop, float("-inf")), dim=-1)
    first = max_ind
    multiplier = masked_gates.gather(dim=-1, index=first)

    masked_scores = torch.scatter(scores, -1, first, float("-inf"))
    with torch.no_grad():
        threshold, max_ind = masked_scores.max(dim=-1, keepdim=True)
        factor = scores.abs().clamp(min=threshold)
        drop = ((threshold - scores) / factor) > (2 * jitter_eps)
    masked_gates_top2 = torch.softmax(masked_scores.masked_fill(drop, float("-inf")), dim=-1)
    second = max_ind
    multiplier_top2 = masked_gates_top2.gather(dim=-1, index=second)
    return torch.concat((multiplier, multiplier_top2), dim=-1), torch.concat((first, second), dim=-1)


class PhiMoEBlockSparseTop2MLP(nn.Module):
    def __init__(self, hidden_dim, ffn_dim):
        super().__init__()
        self.w1 = nn.Linear(hidden_dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(hidden_dim, ffn_dim, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states):
        current_hidden_states = self.act_fn(self.w1(hidden_states)) * self.w3(hidden_states)
        return self.w2(current_hidden_states)


class PhiMoESparseMoeBlock(nn.Module):
    def __init__(self, hidden_dim, ffn_dim, num_experts, router_jitter_noise=0.01):
        super().__init__()
        self.hidden_dim = hidden_dim
        self.num_experts = num_experts
        self.top_k = 2
        self.router_jitter_noise = router_jitter_noise
        self.gate = nn.Linear(hidden_dim, num_experts, bias=False)
        self.experts = nn.ModuleList([PhiMoEBlockSparseTop2MLP(hidden_dim, ffn_dim) for _ in range(num_experts)])

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights, selected_experts = sparsemixer_eval(router_logits, self.router_jitter_noise)
        final_hidden_states = torch.zeros(
            (batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype, device=hidden_states.device)
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in range(self.num_experts):
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx])
            if top_x.shape[0] == 0:
                continue
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current_hidden_states = expert_layer(current_state) * routing_weights[top_x, idx, None]
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
        return final_hidden_states.reshape(batch_size, sequence_length, hidden_dim), router_logits


# --------------------------------------------------------------------------------------------- ERNIE 4.5
class Ernie4_5_MoeMLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Ernie4_5_MoeStatics(nn.Module):
    def __init__(self, num_experts):
        super().__init__()
        self.e_score_correction_bias = nn.Parameter(torch.zeros(1, num_experts, dtype=torch.float32),
                                                    requires_grad=False)

    def forward(self, hidden_states):
        return hidden_states + self.e_score_correction_bias.squeeze()


class Ernie4_5_MoeSparseMoeBlock(nn.Module):
    def __init__(self, hidden_size, moe_intermediate_size, num_experts, top_k, n_shared, norm_min=1e-12):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_min = norm_min
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.moe_statics = Ernie4_5_MoeStatics(num_experts)
        self.experts = nn.ModuleList(
            [Ernie4_5_MoeMLP(hidden_size, moe_intermediate_size) for _ in range(num_experts)])
        self.shared_experts = Ernie4_5_MoeMLP(hidden_size, moe_intermediate_size * n_shared)

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        shared_output = self.shared_experts(hidden_states)
        router_logits = self.gate(hidden_states.float())
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        _, selected_experts = torch.topk(self.moe_statics(routing_weights), self.top_k, dim=-1)
        routing_weights = torch.gather(routing_weights, dim=-1, index=selected_experts)
        routing_weights = routing_weights / torch.clamp(routing_weights.sum(dim=-1, keepdim=True), min=self.norm_min)
        routing_weights = routing_weights.to(hidden_states.dtype)

        final_hidden_states = torch.zeros(
            (batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype, device=hidden_states.device)
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx].squeeze(0))
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current_hidden_states = expert_layer(current_state) * routing_weights[top_x, idx, None]
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
        final_hidden_states = final_hidden_states + shared_output
        return final_hidden_states.reshape(batch_size, sequence_length, hidden_dim), router_logits


# ------------------------------------------------------------------------------------------ LongCat-Flash
class LongcatTopkRouter(nn.Module):
    def __init__(self, hidden_size, n_routed_experts, zero_expert_num, top_k, routed_scaling_factor):
        super().__init__()
        self.top_k = top_k
        self.hidden_dim = hidden_size
        self.n_routed_experts = n_routed_experts + zero_expert_num
        self.routed_scaling_factor = routed_scaling_factor
        self.register_buffer("e_score_correction_bias", torch.zeros(self.n_routed_experts))
        self.classifier = nn.Linear(hidden_size, self.n_routed_experts, bias=False)

    def forward(self, hidden_states):
        hidden_states = hidden_states.view(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states.type(torch.float32), self.classifier.weight.type(torch.float32))
        scores = router_logits.softmax(dim=-1)
        with torch.no_grad():
            scores_for_choice = scores.view(-1, self.n_routed_experts) + self.e_score_correction_bias.unsqueeze(0)
            topk_indices = torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)[1]
        topk_weights = scores.gather(1, topk_indices) * self.routed_scaling_factor
        return topk_weights.to(router_logits.dtype), topk_indices


class LongcatExperts(nn.Module):
    def __init__(self, hidden_size, intermediate_size, n_routed_experts, zero_expert_num):
        super().__init__()
        self.num_routed_experts = n_routed_experts
        self.total_experts = n_routed_experts + zero_expert_num
        self.act_fn = nn.SiLU()
        self.identity_expert = nn.Identity()
        self.gate_up_proj = nn.Parameter(torch.empty(n_routed_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(n_routed_experts, hidden_size, intermediate_size))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        final_hidden_states = torch.zeros_like(hidden_states)
        expert_mask = F.one_hot(top_k_index, num_classes=self.total_experts).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero(as_tuple=False)
        for expert_idx_tensor in expert_hit:
            expert_idx = int(expert_idx_tensor.item())
            selection_idx, token_idx = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[token_idx]
            if expert_idx >= self.num_routed_experts:
                current_hidden_states = self.identity_expert(current_state)
            else:
                gate, up = F.linear(current_state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
                current_hidden_states = F.linear(self.act_fn(gate) * up, self.down_proj[expert_idx])
            current_hidden_states = current_hidden_states * top_k_weights[token_idx, selection_idx, None]
            final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(hidden_states.dtype))
        return final_hidden_states


class LongcatFlashMoE(nn.Module):
    def __init__(self, hidden_size, intermediate_size, n_routed_experts, zero_expert_num, top_k, scaling):
        super().__init__()
        self.experts = LongcatExperts(hidden_size, intermediate_size, n_routed_experts, zero_expert_num)
        self.router = LongcatTopkRouter(hidden_size, n_routed_experts, zero_expert_num, top_k, scaling)

    def forward(self, hidden_states):
        orig_shape = hidden_states.shape
        topk_weights, topk_indices = self.router(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        return self.experts(hidden_states, topk_indices, topk_weights).view(*orig_shape)


def make_phimoe(dtype: torch.dtype, seed: int) -> nn.Module:
    # eval: the training branch of sparsemixer draws Gumbel samples
    return materialize(lambda: PhiMoESparseMoeBlock(HIDDEN, FFN, EXPERTS), dtype, seed, train=False)


def make_ernie(dtype: torch.dtype, seed: int) -> nn.Module:
    module = materialize(lambda: Ernie4_5_MoeSparseMoeBlock(HIDDEN, FFN, EXPERTS, 2, 1), dtype, seed,
                         keep_fp32=("gate", "moe_statics"))
    seeded_uniform_(module.moe_statics.e_score_correction_bias, seed + 1, -0.05, 0.05)
    return module


def make_longcat(dtype: torch.dtype, seed: int) -> nn.Module:
    module = materialize(lambda: LongcatFlashMoE(HIDDEN, FFN, EXPERTS, 4, 2, 2.0), dtype, seed)
    seeded_uniform_(module.router.e_score_correction_bias, seed + 1, -0.03, 0.03)
    return module


LAYERS = [
    CorpusLayer(
        name="phimoe_sparsemixer_eval",
        origin="microsoft Phi-3.5-MoE modeling_phimoe.py sparsemixer (eval) + PhiMoEBlockSparseTop2MLP ModuleList "
               "one_hot/where/index_add_ loop",
        style="modulelist_loop",
        make=make_phimoe,
        input_shape=(2, 16, HIDDEN),
        returns_tuple=True,
    ),
    CorpusLayer(
        name="ernie45_moe_statics_bias",
        origin="transformers models/ernie4_5_moe (fp32 gate, softmax, Ernie4_5_MoeStatics bias for selection, "
               "gather, clamp(min=norm_min) renorm, expert_hit loop, shared experts)",
        style="modulelist_loop",
        make=make_ernie,
        input_shape=(2, 16, HIDDEN),
        returns_tuple=True,
    ),
    CorpusLayer(
        name="longcat_flash_zero_experts",
        origin="transformers models/longcat_flash (softmax router with selection bias and scaling, 4 "
               "zero-computation identity experts next to 8 stacked SwiGLU experts, expert_hit .item() loop)",
        style="other",
        make=make_longcat,
        input_shape=(2, 16, HIDDEN),
    ),
]
