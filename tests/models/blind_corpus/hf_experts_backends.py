"""transformers' selectable experts backends (src/transformers/integrations/moe.py): `batched_mm_experts_forward`
(per-sample gathered expert matrices + torch.bmm) and `grouped_mm_experts_forward` (stable argsort, histc offsets,
torch._grouped_mm), on a Qwen3-MoE style block (Linear `gate`, softmax, top-k, norm_topk_prob).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._registry import EXPERTS, FFN, HIDDEN, CorpusLayer, materialize


class Qwen3MoeExperts(nn.Module):
    # stacked [E, 2 * I, H] / [E, H, I] weights, not transposed (experts_are_transposed = False)
    def __init__(self, num_experts, hidden_dim, intermediate_dim, implementation):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_dim, hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_dim, intermediate_dim))
        self.act_fn = nn.SiLU()
        self.implementation = implementation

    def forward(self, hidden_states, top_k_index, top_k_weights):
        if self.implementation == "batched_mm":
            return self.batched_mm_forward(hidden_states, top_k_index, top_k_weights)
        return self.grouped_mm_forward(hidden_states, top_k_index, top_k_weights)

    def batched_mm_forward(self, hidden_states, top_k_index, top_k_weights):
        num_top_k = top_k_index.size(-1)
        num_tokens = hidden_states.size(0)
        final_hidden_states = torch.zeros_like(hidden_states)
        expert_ids = top_k_index.reshape(-1)
        token_idx = torch.arange(num_tokens, device=hidden_states.device).unsqueeze(1).expand(-1, num_top_k).reshape(-1)
        sample_weights = top_k_weights.reshape(-1)
        current_hidden_states = hidden_states[token_idx]
        selected_gate_up = self.gate_up_proj[expert_ids]
        selected_down = self.down_proj[expert_ids]
        gate_up_out = torch.bmm(selected_gate_up, current_hidden_states.unsqueeze(-1)).squeeze(-1)
        gate, up = gate_up_out.chunk(2, dim=-1)
        hidden_after_activation = self.act_fn(gate) * up
        out_per_sample = torch.bmm(selected_down, hidden_after_activation.unsqueeze(-1)).squeeze(-1)
        out_per_sample = out_per_sample * sample_weights.unsqueeze(-1)
        final_hidden_states.index_add_(0, token_idx, out_per_sample.to(final_hidden_states.dtype))
        return final_hidden_states

    def grouped_mm_forward(self, hidden_states, top_k_index, top_k_weights):
        num_top_k = top_k_index.size(-1)
        num_tokens = hidden_states.size(0)
        num_experts = self.gate_up_proj.size(0)
        final_hidden_states = torch.zeros_like(hidden_states)
        expert_ids = top_k_index.reshape(-1)
        token_idx = torch.arange(num_tokens, device=hidden_states.device).unsqueeze(1).expand(-1, num_top_k).reshape(-1)
        perm = torch.argsort(expert_ids, stable=True)
        inv_perm = torch.argsort(perm, stable=True)
        sample_weights = top_k_weights.reshape(-1)
        current_hidden_states = hidden_states[token_idx]
        sample_weights_g = sample_weights[perm]
        current_states_g = current_hidden_states[perm]
        expert_ids_g = expert_ids[perm]
        num_tokens_per_expert = torch.histc(expert_ids_g.float(), bins=num_experts, min=0, max=num_experts - 1)
        offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
        # CPU torch._grouped_mm only lowers in bf16 under torch.compile: run the grouped GEMMs in bf16 (as torchtitan
        # does) and return to the activation dtype afterwards
        gate_up_out = torch._grouped_mm(
            current_states_g.bfloat16(), self.gate_up_proj.bfloat16().transpose(-2, -1), offs=offsets
        ).type_as(current_states_g)
        gate, up = gate_up_out.chunk(2, dim=-1)
        hidden_after_activation = self.act_fn(gate) * up
        out_per_sample_g = torch._grouped_mm(
            hidden_after_activation.bfloat16(), self.down_proj.bfloat16().transpose(-2, -1), offs=offsets
        ).type_as(hidden_after_activation)
        out_per_sample_g = out_per_sample_g * sample_weights_g.unsqueeze(-1)
        out_per_sample = out_per_sample_g[inv_perm]
        final_hidden_states.index_add_(0, token_idx, out_per_sample.to(final_hidden_states.dtype))
        return final_hidden_states


# Follows transformers models/qwen3_moe Qwen3MoeSparseMoeBlock (router in the block, experts module pluggable)
class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, hidden_dim, ffn_dim, num_experts, top_k, implementation, norm_topk_prob=True):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(hidden_dim, num_experts, bias=False)
        self.experts = Qwen3MoeExperts(num_experts, hidden_dim, ffn_dim, implementation)

    def forward(self, hidden_states: torch.Tensor):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        if self.norm_topk_prob:
            routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final_hidden_states = self.experts(hidden_states, selected_experts, routing_weights)
        return final_hidden_states.reshape(batch_size, sequence_length, hidden_dim), router_logits


def make_batched(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: Qwen3MoeSparseMoeBlock(HIDDEN, FFN, EXPERTS, 2, "batched_mm"), dtype, seed)


def make_grouped(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: Qwen3MoeSparseMoeBlock(HIDDEN, FFN, 16, 4, "grouped_mm"), dtype, seed)


LAYERS = [
    CorpusLayer(
        name="hf_batched_mm_experts",
        origin="transformers integrations/moe.py batched_mm_experts_forward (gate_up_proj[expert_ids] bmm, index_add_)",
        style="other",
        make=make_batched,
        input_shape=(2, 16, HIDDEN),
        returns_tuple=True,
    ),
    CorpusLayer(
        name="hf_grouped_mm_experts",
        origin="transformers integrations/moe.py grouped_mm_experts_forward (argsort stable, histc, torch._grouped_mm)",
        style="sort",
        make=make_grouped,
        input_shape=(2, 16, HIDDEN),
        returns_tuple=True,
    ),
]
