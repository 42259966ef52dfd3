"""OLMoE, Qwen2-MoE and JetMoE blocks from transformers:
- models/olmoe OlmoeSparseMoeBlock (64 experts / top-8 upstream; here 16 / top-4, no top-k renormalisation),
- models/qwen2_moe Qwen2MoeSparseMoeBlock (expert_hit loop + sigmoid-gated shared expert),
- models/jetmoe JetMoeMoE (JetMoeTopKGating: top-k on logits then softmax, sort of the flattened choices,
  expert_size.tolist(); JetMoeParallelExperts split by expert sizes; index_add combine; output bias).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._registry import EXPERTS, FFN, HIDDEN, CorpusLayer, materialize


# transformers models/olmoe :: OlmoeMLP
class OlmoeMLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


# transformers models/olmoe :: OlmoeSparseMoeBlock
class OlmoeSparseMoeBlock(nn.Module):
    def __init__(self, hidden_size, intermediate_size, num_experts, top_k, norm_topk_prob=False):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(hidden_size, self.num_experts, bias=False)
        self.experts = nn.ModuleList([OlmoeMLP(hidden_size, intermediate_size) for _ in range(self.num_experts)])

    def forward(self, hidden_states: torch.Tensor):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        if self.norm_topk_prob:
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


# transformers models/qwen2_moe :: Qwen2MoeMLP (same projections as OlmoeMLP)
class Qwen2MoeMLP(OlmoeMLP):
    pass


# transformers models/qwen2_moe :: Qwen2MoeSparseMoeBlock
class Qwen2MoeSparseMoeBlock(nn.Module):
    def __init__(self, hidden_size, moe_intermediate_size, shared_expert_intermediate_size, num_experts, top_k,
                 norm_topk_prob=False):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleList([Qwen2MoeMLP(hidden_size, moe_intermediate_size) for _ in range(num_experts)])
        self.shared_expert = Qwen2MoeMLP(hidden_size, shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, hidden_states: torch.Tensor):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        if self.norm_topk_prob:
            routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final_hidden_states = torch.zeros(
            (batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype, device=hidden_states.device
        )
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx].squeeze(0))
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current_hidden_states = expert_layer(current_state) * routing_weights[top_x, idx, None]
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
        shared_expert_output = self.shared_expert(hidden_states)
        shared_expert_output = F.sigmoid(self.shared_expert_gate(hidden_states)) * shared_expert_output
        final_hidden_states = final_hidden_states + shared_expert_output
        final_hidden_states = final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)
        return final_hidden_states, router_logits


# transformers models/jetmoe :: JetMoeParallelExperts
class JetMoeParallelExperts(nn.Module):
    def __init__(self, num_experts, input_size, output_size):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, output_size, input_size))
        self.num_experts = num_experts
        self.input_size = input_size
        self.output_size = output_size

    def forward(self, inputs, expert_size):
        input_list = inputs.split(expert_size, dim=0)
        output_list = []
        for i in range(self.num_experts):
            output_list.append(F.linear(input_list[i], self.weight[i]))
        return torch.cat(output_list, dim=0)


# transformers models/jetmoe :: JetMoeTopKGating
class JetMoeTopKGating(nn.Module):
    def __init__(self, input_size, num_experts, top_k):
        super().__init__()
        self.num_experts = num_experts
        self.input_size = input_size
        self.top_k = top_k
        self.layer = nn.Linear(input_size, num_experts, bias=False)

    def forward(self, hidden_states):
        logits = self.layer(hidden_states).float()
        top_k_logits, top_k_indices = logits.topk(self.top_k, dim=1)
        top_k_gates = torch.softmax(top_k_logits, dim=1).type_as(hidden_states)
        zeros = torch.zeros(
            [top_k_gates.size(0), self.num_experts], dtype=top_k_gates.dtype, device=top_k_gates.device
        )
        gates = zeros.scatter(1, top_k_indices, 1)
        expert_size = gates.long().sum(0)
        expert_size = expert_size.tolist()
        top_k_experts = top_k_indices.flatten()
        _, index_sorted_experts = top_k_experts.sort(0)
        batch_index = index_sorted_experts.div(self.top_k, rounding_mode="trunc")
        top_k_gates = top_k_gates.flatten()
        batch_gates = top_k_gates[index_sorted_experts]
        return index_sorted_experts, batch_index, batch_gates, expert_size, logits


# transformers models/jetmoe :: JetMoeMoE (the MLP mixture; the attention mixture is not included)
class JetMoeMoE(nn.Module):
    def __init__(self, hidden_size, intermediate_size, num_experts, top_k):
        super().__init__()
        self.input_size = hidden_size
        self.hidden_size = intermediate_size
        self.activation = nn.SiLU()
        self.bias = nn.Parameter(torch.empty(hidden_size))
        self.input_linear = JetMoeParallelExperts(num_experts, hidden_size, intermediate_size * 2)
        self.output_linear = JetMoeParallelExperts(num_experts, intermediate_size, hidden_size)
        self.router = JetMoeTopKGating(hidden_size, num_experts, top_k)

    def forward(self, layer_input):
        bsz, length, emb_size = layer_input.size()
        layer_input = layer_input.reshape(-1, emb_size)
        _, batch_index, batch_gates, expert_size, router_logits = self.router(layer_input)
        expert_inputs = layer_input[batch_index]
        hidden_states = self.input_linear(expert_inputs, expert_size)
        chunked_hidden_states = hidden_states.chunk(2, dim=-1)
        hidden_states = self.activation(chunked_hidden_states[0]) * chunked_hidden_states[1]
        expert_outputs = self.output_linear(hidden_states, expert_size)
        expert_outputs = expert_outputs * batch_gates[:, None]
        zeros = torch.zeros((bsz * length, self.input_size), dtype=expert_outputs.dtype, device=expert_outputs.device)
        layer_output = zeros.index_add(0, batch_index, expert_outputs)
        layer_output = layer_output.view(bsz, length, self.input_size)
        layer_output = layer_output + self.bias
        return layer_output, router_logits


def make_olmoe(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: OlmoeSparseMoeBlock(HIDDEN, FFN, 16, 4), dtype, seed)


def make_qwen2(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: Qwen2MoeSparseMoeBlock(HIDDEN, FFN, 64, 16, 4), dtype, seed)


def make_jetmoe(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: JetMoeMoE(HIDDEN, FFN, EXPERTS, 2), dtype, seed)


LAYERS = [
    CorpusLayer(
        name="olmoe_sparse_moe_block",
        origin="transformers models/olmoe OlmoeSparseMoeBlock (E=16, top-4, no renorm, one_hot/where/index_add_)",
        style="modulelist_loop",
        make=make_olmoe,
        input_shape=(2, 16, HIDDEN),
        returns_tuple=True,
    ),
    CorpusLayer(
        name="qwen2_moe_shared_expert_gate",
        origin="transformers models/qwen2_moe Qwen2MoeSparseMoeBlock (expert_hit.nonzero loop, sigmoid shared gate)",
        style="modulelist_loop",
        make=make_qwen2,
        input_shape=(2, 16, HIDDEN),
        returns_tuple=True,
    ),
    CorpusLayer(
        name="jetmoe_parallel_experts",
        origin="transformers models/jetmoe JetMoeTopKGating (sort, expert_size.tolist()) + JetMoeParallelExperts split",
        style="host_loop",
        make=make_jetmoe,
        input_shape=(2, 16, HIDDEN),
        returns_tuple=True,
    ),
]
