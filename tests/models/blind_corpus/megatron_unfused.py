"""Megatron-LM core MoE, unfused paths: transformer/moe/router.py (TopKRouter, sinkhorn), moe_utils.py
(topk_softmax_with_capacity, permute/unpermute in their masked_select, argsort and drop_and_pad forms, sinkhorn),
token_dispatcher.py (AllGather dispatcher) and experts.py (SequentialMLP, GroupedMLP). TP = EP = 1.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ._registry import EXPERTS, FFN, HIDDEN, CorpusLayer, materialize


def get_capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity=None) -> int:
    capacity = math.ceil((num_tokens / num_experts) * capacity_factor)
    if min_capacity is not None and capacity < min_capacity:
        capacity = min_capacity
    return capacity


def topk_softmax_with_capacity(logits, topk, capacity_factor=None, pad_to_capacity=False, drop_policy="probs",
                               use_pre_softmax=False):
    num_tokens, num_experts = logits.shape
    if use_pre_softmax:
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
        probs, top_indices = torch.topk(scores, k=topk, dim=1)
    else:
        scores, top_indices = torch.topk(logits, k=topk, dim=1)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).type_as(logits)
    tokens_per_expert = torch.bincount(top_indices.view(-1), minlength=num_experts)

    if capacity_factor is None:
        routing_probs = torch.zeros_like(logits).scatter(1, top_indices, probs)
        routing_map = torch.zeros_like(logits).int().scatter(1, top_indices, 1).bool()
        return routing_probs, routing_map, tokens_per_expert

    expert_capacity = get_capacity(num_tokens * topk, num_experts, capacity_factor)
    topk_masked_gates = torch.zeros_like(logits).scatter(1, top_indices, probs)
    topk_map = torch.zeros_like(logits).int().scatter(1, top_indices, 1).bool()
    if drop_policy == "probs":
        _, capacity_indices = torch.topk(topk_masked_gates, k=expert_capacity, dim=0, sorted=False)
    else:
        _, capacity_indices = torch.topk(topk_map.int(), k=expert_capacity, dim=0, sorted=False)
    capacity_mask = torch.zeros_like(logits).scatter(0, capacity_indices, 1).bool()
    if pad_to_capacity:
        final_map = capacity_mask
    else:
        final_map = torch.logical_and(topk_map, capacity_mask)
    final_probs = topk_masked_gates * final_map
    return final_probs, final_map, tokens_per_expert


def sinkhorn(cost: torch.Tensor, tol: float = 0.0001) -> torch.Tensor:
    cost = torch.exp(cost)
    d0 = torch.ones(cost.size(0), device=cost.device, dtype=cost.dtype)
    d1 = torch.ones(cost.size(1), device=cost.device, dtype=cost.dtype)
    eps = 0.00000001
    error = 1e9
    d1_old = d1
    while error > tol:
        d0 = (1 / d0.size(0)) * 1 / (torch.sum(d1 * cost, 1) + eps)
        d1 = (1 / d1.size(0)) * 1 / (torch.sum(d0.unsqueeze(1) * cost, 0) + eps)
        error = torch.mean(torch.abs(d1_old - d1))
        d1_old = d1
    return d1 * cost * d0.unsqueeze(1)


# --- moe_utils.permute / unpermute, three generations
def permute_masked_select(tokens, routing_map):
    num_tokens, hidden = tokens.shape
    num_experts = routing_map.shape[1]
    routing_map = routing_map.bool().T.contiguous()
    token_indices = torch.arange(num_tokens, device=routing_map.device).unsqueeze(0).expand(num_experts, -1)
    sorted_indices = token_indices.masked_select(routing_map)
    permuted_input = tokens.index_select(0, sorted_indices)
    return permuted_input, sorted_indices


def unpermute_scatter_add(permuted_tokens, sorted_indices, restore_shape, probs, routing_map):
    _, hidden = restore_shape
    permuted_probs = probs.T.contiguous().masked_select(routing_map.T.contiguous())
    permuted_tokens = permuted_tokens * permuted_probs.unsqueeze(-1)
    output_tokens = torch.zeros(restore_shape, device=permuted_tokens.device, dtype=permuted_tokens.dtype)
    output_tokens.scatter_add_(0, sorted_indices.unsqueeze(1).expand(-1, hidden), permuted_tokens)
    return output_tokens


def permute_argsort(tokens, routing_map, probs, num_out_tokens):
    num_tokens, hidden = tokens.shape
    routing_map = routing_map.bool().T.contiguous()
    flat_sorted = routing_map.reshape(-1).argsort(descending=True, stable=True)
    flat_sorted = flat_sorted[:num_out_tokens]
    sorted_indices = flat_sorted % num_tokens
    permuted_probs = probs.T.contiguous().reshape(-1)[flat_sorted]
    permuted_input = tokens.index_select(0, sorted_indices)
    return permuted_input, permuted_probs, sorted_indices


def permute_drop_and_pad(tokens, routing_map, probs, num_out_tokens):
    num_tokens, hidden = tokens.shape
    num_experts = routing_map.shape[1]
    capacity = num_out_tokens // num_experts
    routing_map = routing_map.to(dtype=torch.int8).T.contiguous()
    sorted_indices = routing_map.argsort(dim=-1, descending=True, stable=True)[:, :capacity].contiguous()
    sorted_indices = sorted_indices.view(-1)
    permuted_input = tokens.index_select(0, sorted_indices)
    return permuted_input, sorted_indices


def unpermute_drop_and_pad(permuted_tokens, sorted_indices, restore_shape, probs, routing_map):
    _, hidden = restore_shape
    num_experts = routing_map.size(1)
    num_permuted_tokens = sorted_indices.size(0)
    capacity = num_permuted_tokens // num_experts
    num_unpermuted_tokens = probs.size(0)
    probs_T_1D = probs.T.contiguous().view(-1)  # noqa: N806
    indices_dim0 = torch.arange(num_experts, device=routing_map.device).unsqueeze(-1)
    indices_dim1 = sorted_indices.view(num_experts, capacity)
    indices_1D = (indices_dim0 * num_unpermuted_tokens + indices_dim1).view(-1)  # noqa: N806
    permuted_probs = probs_T_1D.index_select(0, indices_1D)
    permuted_tokens = permuted_tokens * permuted_probs.unsqueeze(-1)
    output_tokens = torch.zeros(restore_shape, dtype=permuted_tokens.dtype, device=permuted_tokens.device)
    output_tokens.index_add_(0, sorted_indices, permuted_tokens)
    return output_tokens


class TopKRouter(nn.Module):
    # router.py: raw fp32 `weight` [E, H], gating = linear in the router dtype
    def __init__(self, hidden_size, num_experts, topk, capacity_factor=None, pad_to_capacity=False,
                 use_pre_softmax=False, routing_type="aux_loss"):
        super().__init__()
        self.topk = topk
        self.num_experts = num_experts
        self.weight = nn.Parameter(torch.empty((num_experts, hidden_size), dtype=torch.float32))
        self.capacity_factor = capacity_factor
        self.pad_to_capacity = pad_to_capacity
        self.use_pre_softmax = use_pre_softmax
        self.routing_type = routing_type

    def gating(self, input):  # noqa: A002
        return F.linear(input.to(torch.float32), self.weight.to(torch.float32))

    def sinkhorn_load_balancing(self, logits):
        def _sinkhorn_activation(logits):
            if self.topk == 1:
                logits = torch.sigmoid(logits)
            else:
                logits = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
            return logits

        if self.training:
            with torch.no_grad():
                norm_logits = sinkhorn(logits.to(dtype=torch.float32))
                _, indices = torch.topk(norm_logits, k=self.topk, dim=1)
            logits = _sinkhorn_activation(logits)
        else:
            logits = _sinkhorn_activation(logits)
            _, indices = torch.topk(logits, k=self.topk, dim=1)
        scores = torch.gather(logits, 1, indices)
        return scores, indices

    def forward(self, input):  # noqa: A002
        logits = self.gating(input).view(-1, self.num_experts)
        if self.routing_type == "sinkhorn":
            return self.sinkhorn_load_balancing(logits)
        probs, routing_map, _ = topk_softmax_with_capacity(
            logits, self.topk, capacity_factor=self.capacity_factor, pad_to_capacity=self.pad_to_capacity,
            use_pre_softmax=self.use_pre_softmax,
        )
        return probs, routing_map


class MLP(nn.Module):
    # transformer/mlp.py: linear_fc1 (2F when gated) -> glu(silu) -> linear_fc2; returns (output, output_bias)
    def __init__(self, hidden_size, ffn_hidden_size, gated_linear_unit=True):
        super().__init__()
        fc1_out = ffn_hidden_size * 2 if gated_linear_unit else ffn_hidden_size
        self.linear_fc1 = nn.Linear(hidden_size, fc1_out, bias=False)
        self.linear_fc2 = nn.Linear(ffn_hidden_size, hidden_size, bias=False)
        self.gated_linear_unit = gated_linear_unit

    def activation_func(self, x):
        if self.gated_linear_unit:
            x = torch.chunk(x, 2, dim=-1)
            return F.silu(x[0]) * x[1]
        return F.gelu(x)

    def forward(self, hidden_states):
        intermediate_parallel = self.activation_func(self.linear_fc1(hidden_states))
        return self.linear_fc2(intermediate_parallel), None


# Megatron-LM transformer/moe/experts.py :: SequentialMLP (torch.split by tokens_per_expert.tolist())
class SequentialMLP(nn.Module):
    def __init__(self, num_local_experts, hidden_size, ffn_hidden_size, gated_linear_unit=True):
        super().__init__()
        self.num_local_experts = num_local_experts
        self.local_experts = nn.ModuleList(
            [MLP(hidden_size, ffn_hidden_size, gated_linear_unit) for _ in range(num_local_experts)]
        )

    def forward(self, permuted_local_hidden_states, tokens_per_expert):
        tokens_per_expert = tokens_per_expert.tolist()
        tokens_list = torch.split(permuted_local_hidden_states, tokens_per_expert)
        output_local_list = []
        for expert, tokens in zip(self.local_experts, tokens_list):
            output, _ = expert(tokens)
            output_local_list.append(output)
        return torch.cat(output_local_list, dim=0), None


class GroupedMLP(nn.Module):
    # experts.py GroupedMLP: weight1 [H, E * 2F], weight2 [E * F, H] viewed per expert; gmm over host batch sizes
    def __init__(self, num_local_experts, hidden_size, ffn_hidden_size):
        super().__init__()
        self.num_local_experts = num_local_experts
        self.hidden_size = hidden_size
        self.weight1 = nn.Parameter(torch.empty(hidden_size, ffn_hidden_size * num_local_experts * 2))
        self.weight2 = nn.Parameter(torch.empty(ffn_hidden_size * num_local_experts, hidden_size))

    @staticmethod
    def activation_func(x):
        x = torch.chunk(x, 2, dim=-1)
        return F.silu(x[0]) * x[1]

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        w1 = self.weight1.view(self.num_local_experts, self.hidden_size, -1)
        w2 = self.weight2.view(self.num_local_experts, -1, self.hidden_size)
        sizes = tokens_per_expert.tolist()
        fc1_output = torch.cat([t @ w for t, w in zip(permuted_local_hidden_states.split(sizes), w1)], dim=0)
        intermediate_parallel = self.activation_func(fc1_output)
        intermediate_parallel = intermediate_parallel * permuted_probs.unsqueeze(-1).to(intermediate_parallel.dtype)
        fc2_output = torch.cat([t @ w for t, w in zip(intermediate_parallel.split(sizes), w2)], dim=0)
        return fc2_output, None


# MoELayer with the v0.9-era AllToAll dispatcher math (masked_select permute, scatter_add_ unpermute with probs)
class MoELayerMaskedSelect(nn.Module):
    def __init__(self, hidden_size, ffn_hidden_size, num_experts, topk):
        super().__init__()
        self.router = TopKRouter(hidden_size, num_experts, topk)
        self.experts = SequentialMLP(num_experts, hidden_size, ffn_hidden_size)

    def forward(self, hidden_states):
        hidden_shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_shape[-1])
        probs, routing_map = self.router(hidden_states)
        tokens_per_expert = routing_map.sum(dim=0).long().cpu()
        permuted_local_input_tokens, reversed_mapping = permute_masked_select(hidden_states, routing_map)
        expert_output, mlp_bias = self.experts(permuted_local_input_tokens, tokens_per_expert)
        output = unpermute_scatter_add(expert_output, reversed_mapping, hidden_states.shape, probs, routing_map)
        return output.to(hidden_states.dtype).view(hidden_shape), mlp_bias


# MoELayer with the current unfused permute (flat argsort) and GroupedMLP applying probs before linear_fc2
class MoELayerArgsort(nn.Module):
    def __init__(self, hidden_size, ffn_hidden_size, num_experts, topk):
        super().__init__()
        self.topk = topk
        self.router = TopKRouter(hidden_size, num_experts, topk, use_pre_softmax=True)
        self.experts = GroupedMLP(num_experts, hidden_size, ffn_hidden_size)

    def forward(self, hidden_states):
        hidden_shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_shape[-1])
        probs, routing_map = self.router(hidden_states)
        tokens_per_expert = routing_map.sum(dim=0).long()
        num_out_tokens = hidden_states.shape[0] * self.topk
        permuted_input, permuted_probs, sorted_indices = permute_argsort(
            hidden_states, routing_map, probs, num_out_tokens
        )
        expert_output, mlp_bias = self.experts(permuted_input, tokens_per_expert, permuted_probs)
        output = torch.zeros(hidden_states.shape, dtype=expert_output.dtype, device=expert_output.device)
        output.scatter_add_(0, sorted_indices.unsqueeze(1).expand(-1, hidden_states.shape[-1]), expert_output)
        return output.view(hidden_shape), mlp_bias


# MoELayer with moe_expert_capacity_factor + moe_pad_expert_input_to_capacity (drop_and_pad permute)
class MoELayerDropAndPad(nn.Module):
    def __init__(self, hidden_size, ffn_hidden_size, num_experts, topk, capacity_factor):
        super().__init__()
        self.num_experts = num_experts
        self.router = TopKRouter(hidden_size, num_experts, topk, capacity_factor=capacity_factor,
                                 pad_to_capacity=True, use_pre_softmax=True)
        self.weight1 = nn.Parameter(torch.empty(num_experts, hidden_size, 2 * ffn_hidden_size))
        self.weight2 = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size))

    def forward(self, hidden_states):
        hidden_shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_shape[-1])
        probs, routing_map = self.router(hidden_states)
        num_out_tokens = int(routing_map.sum())
        permuted_input, sorted_indices = permute_drop_and_pad(hidden_states, routing_map, probs, num_out_tokens)
        # every expert holds exactly `capacity` rows: the grouped GEMM degenerates to a bmm
        x = permuted_input.view(self.num_experts, -1, hidden_states.shape[-1])
        fc1 = torch.bmm(x, self.weight1)
        gate, up = torch.chunk(fc1, 2, dim=-1)
        expert_output = torch.bmm(F.silu(gate) * up, self.weight2).view(-1, hidden_states.shape[-1])
        output = unpermute_drop_and_pad(
            expert_output, sorted_indices, hidden_states.shape, probs.to(expert_output.dtype), routing_map
        )
        return output.view(hidden_shape), None


# MoELayer with the mcore-0.6 AllGather dispatcher (argsort + histc, gather/scatter with expanded indices),
# sinkhorn top-1 routing in training
class MoELayerAllGatherSinkhorn(nn.Module):
    def __init__(self, hidden_size, ffn_hidden_size, num_experts):
        super().__init__()
        self.num_local_experts = num_experts
        self.local_expert_indices = list(range(num_experts))
        self.router = TopKRouter(hidden_size, num_experts, 1, routing_type="sinkhorn")
        self.experts = SequentialMLP(num_experts, hidden_size, ffn_hidden_size, gated_linear_unit=False)

    def token_permutation(self, hidden_states, max_prob, max_ind):
        self.hidden_shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        self.local_probs = max_prob
        local_indices = max_ind
        with torch.no_grad():
            self.indices = torch.argsort(local_indices.view(-1), dim=0)
            tokens_per_expert = torch.histc(
                local_indices.float(), bins=self.num_local_experts,
                min=self.local_expert_indices[0], max=self.local_expert_indices[-1],
            )
            tokens_per_expert = tokens_per_expert.cpu().to(torch.long)
        self.indices = self.indices.view(-1, 1).expand(-1, hidden_states.shape[-1])
        permuted_local_hidden_states = torch.gather(hidden_states, 0, self.indices)
        return permuted_local_hidden_states, tokens_per_expert

    def token_unpermutation(self, hidden_states):
        scores = self.local_probs.to(dtype=hidden_states.dtype)
        unpermuted_local_hidden = torch.zeros_like(hidden_states)
        unpermuted_local_hidden = unpermuted_local_hidden.scatter(0, self.indices, hidden_states)
        unpermuted_local_hidden = unpermuted_local_hidden * scores.view(-1, 1)
        return unpermuted_local_hidden.view(self.hidden_shape)

    def forward(self, hidden_states):
        scores, indices = self.router(hidden_states)
        dispatched_input, tokens_per_expert = self.token_permutation(hidden_states, scores, indices)
        expert_output, mlp_bias = self.experts(dispatched_input, tokens_per_expert)
        return self.token_unpermutation(expert_output), mlp_bias


def make_mg_masked_select(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: MoELayerMaskedSelect(HIDDEN, FFN, EXPERTS, 2), dtype, seed, keep_fp32=("router",))


def make_mg_argsort(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: MoELayerArgsort(HIDDEN, FFN, EXPERTS, 2), dtype, seed, keep_fp32=("router",))


def make_mg_drop_and_pad(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(
        lambda: MoELayerDropAndPad(HIDDEN, FFN, EXPERTS, 2, capacity_factor=1.0), dtype, seed, keep_fp32=("router",)
    )


def make_mg_sinkhorn(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: MoELayerAllGatherSinkhorn(HIDDEN, FFN, EXPERTS), dtype, seed, keep_fp32=("router",))


LAYERS = [
    CorpusLayer(
        name="megatron_permute_masked_select",
        origin="Megatron-LM moe_utils.py permute (masked_select) / unpermute (scatter_add_) + experts.py SequentialMLP",
        style="host_loop",
        make=make_mg_masked_select,
        input_shape=(16, 2, HIDDEN),
        returns_tuple=True,
    ),
    CorpusLayer(
        name="megatron_permute_argsort_grouped",
        origin="Megatron-LM moe_utils.py permute (flat argsort stable, % num_tokens) + experts.py GroupedMLP views",
        style="host_loop",
        make=make_mg_argsort,
        input_shape=(16, 2, HIDDEN),
        returns_tuple=True,
    ),
    CorpusLayer(
        name="megatron_drop_and_pad_capacity",
        origin="Megatron-LM topk_softmax_with_capacity (pad_to_capacity) + permute/unpermute drop_and_pad (index_add_)",
        style="capacity",
        make=make_mg_drop_and_pad,
        input_shape=(16, 2, HIDDEN),
        returns_tuple=True,
    ),
    CorpusLayer(
        name="megatron_allgather_sinkhorn",
        origin="Megatron-LM (mcore 0.6) MoEAllGatherTokenDispatcher (argsort, histc, gather/scatter) + sinkhorn router",
        style="host_loop",
        make=make_mg_sinkhorn,
        input_shape=(16, 2, HIDDEN),
        returns_tuple=True,
    ),
]
