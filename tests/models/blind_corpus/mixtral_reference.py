"""Mixtral-family MoE blocks: Mistral's reference (mistral-src moe.py MoeLayer), transformers' MixtralSparseMoeBlock
(v4 one_hot/where/index_add_ loop over a ModuleList, and v5 MixtralExperts with stacked gate_up_proj/down_proj and an
`expert_hit` loop) and gpt-fast's mixtral-moe ConditionalFeedForward (per-token gathered expert weights).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._registry import EXPERTS, FFN, HIDDEN, CorpusLayer, materialize


# ---------------------------------------------------------------- mistral-src (mistral/moe.py, mistral/model.py)
class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


# mistral-src moe.py :: MoeLayer
class MoeLayer(nn.Module):
    def __init__(self, experts, gate, num_experts_per_tok):
        super().__init__()
        self.experts = nn.ModuleList(experts)
        self.gate = gate
        self.num_experts_per_tok = num_experts_per_tok

    def forward(self, inputs: torch.Tensor):
        gate_logits = self.gate(inputs)
        weights, selected_experts = torch.topk(gate_logits, self.num_experts_per_tok)
        weights = F.softmax(weights, dim=1, dtype=torch.float).to(inputs.dtype)
        results = torch.zeros_like(inputs)
        for i, expert in enumerate(self.experts):
            batch_idx, nth_expert = torch.where(selected_experts == i)
            results[batch_idx] += weights[batch_idx, nth_expert, None] * expert(inputs[batch_idx])
        return results


# ---------------------------------------------------------------- transformers v4 modeling_mixtral.py
class MixtralBlockSparseTop2MLP(nn.Module):
    def __init__(self, hidden_dim, ffn_dim):
        super().__init__()
        self.w1 = nn.Linear(hidden_dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(hidden_dim, ffn_dim, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states):
        current_hidden_states = self.act_fn(self.w1(hidden_states)) * self.w3(hidden_states)
        return self.w2(current_hidden_states)


# transformers v4 models/mixtral :: MixtralSparseMoeBlock
class MixtralSparseMoeBlock(nn.Module):
    def __init__(self, hidden_dim, ffn_dim, num_experts, top_k, jitter_noise=0.0):
        super().__init__()
        self.hidden_dim = hidden_dim
        self.ffn_dim = ffn_dim
        self.num_experts = num_experts
        self.top_k = top_k
        self.gate = nn.Linear(self.hidden_dim, self.num_experts, bias=False)
        self.experts = nn.ModuleList([MixtralBlockSparseTop2MLP(hidden_dim, ffn_dim) for _ in range(num_experts)])
        self.jitter_noise = jitter_noise

    def forward(self, hidden_states: torch.Tensor):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        if self.training and self.jitter_noise > 0:
            hidden_states *= torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)

        final_hidden_states = torch.zeros(
            (batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype, device=hidden_states.device
        )
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in range(self.num_experts):
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current_hidden_states = expert_layer(current_state) * routing_weights[top_x, idx, None]
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
        final_hidden_states = final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)
        return final_hidden_states, router_logits


# ---------------------------------------------------------------- transformers v5 modeling_mixtral.py
class MixtralTopKRouter(nn.Module):
    def __init__(self, hidden_dim, num_experts, top_k):
        super().__init__()
        self.top_k = top_k
        self.num_experts = num_experts
        self.hidden_dim = hidden_dim
        self.weight = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim))

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states, self.weight)
        router_probs = F.softmax(router_logits.float(), dim=-1)
        router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
        router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
        router_scores = router_top_value.to(router_logits.dtype)
        return router_logits, router_scores, router_indices


# transformers v5 models/mixtral :: MixtralExperts (stacked weights, expert_hit loop)
class MixtralExperts(nn.Module):
    def __init__(self, hidden_dim, intermediate_dim, num_experts):
        super().__init__()
        self.num_experts = num_experts
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_dim, self.hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim, self.intermediate_dim))
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        final_hidden_states = torch.zeros_like(hidden_states)
        with torch.no_grad():
            expert_mask = F.one_hot(top_k_index, num_classes=self.num_experts)
            expert_mask = expert_mask.permute(2, 1, 0)
            expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            expert_idx = expert_idx[0]
            if expert_idx == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[token_idx]
            gate, up = F.linear(current_state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
            current_hidden_states = self.act_fn(gate) * up
            current_hidden_states = F.linear(current_hidden_states, self.down_proj[expert_idx])
            current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
            final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
        return final_hidden_states


# transformers v5 models/mixtral :: MixtralSparseMoeBlock (router + experts modules)
class MixtralSparseMoeBlockV5(nn.Module):
    def __init__(self, hidden_dim, ffn_dim, num_experts, top_k):
        super().__init__()
        self.gate = MixtralTopKRouter(hidden_dim, num_experts, top_k)
        self.experts = MixtralExperts(hidden_dim, ffn_dim, num_experts)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        _, top_k_weights, top_k_index = self.gate(hidden_states)
        hidden_states = self.experts(hidden_states, top_k_index, top_k_weights)
        return hidden_states.reshape(batch_size, sequence_length, hidden_dim)


# ---------------------------------------------------------------- gpt-fast mixtral-moe/model.py
class ConditionalFeedForward(nn.Module):
    def __init__(self, num_experts, dim, intermediate_size):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, intermediate_size, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, intermediate_size))
        self.w3 = nn.Parameter(torch.empty(num_experts, intermediate_size, dim))

    def forward(self, x: torch.Tensor, expert_indices: torch.Tensor) -> torch.Tensor:
        w1_weights = self.w1[expert_indices]  # [T, A, D, D]
        w3_weights = self.w3[expert_indices]
        w2_weights = self.w2[expert_indices]
        x1 = F.silu(torch.einsum("ti,taoi -> tao", x, w1_weights))
        x3 = torch.einsum("ti, taoi -> tao", x, w3_weights)
        return torch.einsum("tao, taio -> tai", (x1 * x3), w2_weights)


# gpt-fast mixtral-moe/model.py :: MOEFeedForward
class MOEFeedForward(nn.Module):
    def __init__(self, dim, intermediate_size, num_experts, num_activated_experts):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.cond_ffn = ConditionalFeedForward(num_experts, dim, intermediate_size)
        self.dim = dim
        self.num_activated_experts = num_activated_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(-1, self.dim)
        scores = self.gate(x)  # [T, E]
        expert_weights = F.softmax(scores, dim=-1)
        expert_weights, expert_indices = torch.topk(expert_weights, self.num_activated_experts, dim=-1)
        expert_weights /= expert_weights.sum(dim=-1, keepdim=True)
        expert_outs = self.cond_ffn(x, expert_indices)
        return torch.einsum("tai,ta -> ti", expert_outs, expert_weights)


def make_mistral(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(
        lambda: MoeLayer(
            [FeedForward(HIDDEN, FFN) for _ in range(EXPERTS)], nn.Linear(HIDDEN, EXPERTS, bias=False), 2
        ),
        dtype,
        seed,
    )


def make_hf_mixtral(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: MixtralSparseMoeBlock(HIDDEN, FFN, EXPERTS, 2), dtype, seed)


def make_hf_mixtral_v5(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: MixtralSparseMoeBlockV5(HIDDEN, FFN, EXPERTS, 2), dtype, seed)


def make_gptfast(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: MOEFeedForward(HIDDEN, FFN, EXPERTS, 2), dtype, seed)


LAYERS = [
    CorpusLayer(
        name="mistral_reference_where_loop",
        origin="mistral-src moe.py MoeLayer (topk on logits, softmax after, torch.where(selected_experts == i))",
        style="modulelist_loop",
        make=make_mistral,
        input_shape=(32, HIDDEN),
    ),
    CorpusLayer(
        name="hf_mixtral_sparse_moe_block",
        origin="transformers v4 models/mixtral MixtralSparseMoeBlock (one_hot permute, where, index_add_)",
        style="modulelist_loop",
        make=make_hf_mixtral,
        input_shape=(2, 16, HIDDEN),
        returns_tuple=True,
    ),
    CorpusLayer(
        name="hf_mixtral_v5_experts_hit",
        origin="transformers v5 models/mixtral MixtralTopKRouter + MixtralExperts (gate_up_proj, expert_hit.nonzero)",
        style="host_loop",
        make=make_hf_mixtral_v5,
        input_shape=(2, 16, HIDDEN),
    ),
    CorpusLayer(
        name="gptfast_conditional_feedforward",
        origin="gpt-fast mixtral-moe/model.py MOEFeedForward + ConditionalFeedForward (w1[expert_indices] einsum)",
        style="other",
        make=make_gptfast,
        input_shape=(32, HIDDEN),
    ),
]
