"""MaxText's routed MoE (AI-Hypercomputer/maxtext MaxText/layers/moe.py RoutedMoE), translated from JAX to torch:
- sparse_matmul path: top-k on the gate logits then softmax over the k (Mixtral setting), permute = argsort of the
  flat expert ids, take(inputs, sorted // k), bincount(length=E) group sizes, ragged gmm (jax.lax.ragged_dot /
  megablox gmm; here torch._grouped_mm with int32 cumulative offsets) against [E, H, F] / [E, F, H] kernels,
  unpermute = take(out, argsort(sorted)) and einsum("BKE,BK -> BE") over the k.
- dense_matmul path with a capacity factor: one_hot of the top-k ids, cumsum over the flattened (S * K) axis per
  batch row as the position, tokens past the per-batch capacity dropped, dispatch / combine masks [B, S, E, C],
  einsum("BSM,BSEC -> EBCM") dispatch, einsum expert kernels over [E, B, C, *], einsum("EBCM,BSEC -> BSM") combine.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ._registry import EXPERTS, FFN, HIDDEN, CorpusLayer, materialize


class MaxTextGate(nn.Module):
    """DenseGeneral(embed -> num_experts), kernel kept as [H, E] the way Flax stores it."""

    def __init__(self, hidden, num_experts):
        super().__init__()
        self.kernel = nn.Parameter(torch.empty(hidden, num_experts))

    def forward(self, inputs):
        return torch.matmul(inputs, self.kernel)


class MaxTextSparseMoE(nn.Module):
    def __init__(self, hidden, mlp_dim, num_experts, num_experts_per_tok):
        super().__init__()
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.gate = MaxTextGate(hidden, num_experts)
        self.wi_0 = nn.Parameter(torch.empty(num_experts, hidden, mlp_dim))
        self.wi_1 = nn.Parameter(torch.empty(num_experts, hidden, mlp_dim))
        self.wo = nn.Parameter(torch.empty(num_experts, mlp_dim, hidden))

    def get_topk(self, gate_logits):
        top_k_weights, top_k_indices = torch.topk(gate_logits, self.num_experts_per_tok, dim=-1)
        top_k_weights = F.softmax(top_k_weights.float(), dim=-1).to(gate_logits.dtype)
        return top_k_weights, top_k_indices

    def permute(self, inputs, gate_logits):
        b, s, h = inputs.shape
        inputs_2d = inputs.reshape(b * s, h)
        weights, selected_experts = self.get_topk(gate_logits)
        flatten_selected_experts = selected_experts.reshape(-1)
        sorted_selected_experts = torch.argsort(flatten_selected_experts)
        sorted_indices = sorted_selected_experts // self.num_experts_per_tok
        sorted_inputs = torch.take_along_dim(inputs_2d, sorted_indices[:, None], dim=0)
        group_size = torch.bincount(flatten_selected_experts, minlength=self.num_experts)
        return sorted_inputs, sorted_selected_experts, weights, group_size

    def unpermute(self, intermediate, sorted_selected_experts, weights, b, s):
        unsort_intermediate = intermediate[torch.argsort(sorted_selected_experts)]
        reshaped_weights = weights.reshape(-1, self.num_experts_per_tok)
        reshaped_intermediate = unsort_intermediate.reshape(b * s, self.num_experts_per_tok, -1)
        output = torch.einsum("BKE,BK -> BE", reshaped_intermediate, reshaped_weights)
        return output.reshape(b, s, -1)

    @staticmethod
    def gmm(x, kernel, group_sizes):
        offs = torch.cumsum(group_sizes, dim=0).to(torch.int32)
        return torch._grouped_mm(x, kernel, offs=offs)

    def forward(self, inputs):
        b, s, _ = inputs.shape
        gate_logits = self.gate(inputs)
        x, sorted_selected_experts, weights, group_sizes = self.permute(inputs, gate_logits)
        layer_w0 = self.gmm(x, self.wi_0, group_sizes)
        layer_w1 = self.gmm(x, self.wi_1, group_sizes)
        intermediate_layer = F.silu(layer_w0) * layer_w1
        intermediate_output = self.gmm(intermediate_layer, self.wo, group_sizes)
        return self.unpermute(intermediate_output, sorted_selected_experts, weights, b, s)


class MaxTextDenseCapacityMoE(nn.Module):
    def __init__(self, hidden, mlp_dim, num_experts, num_experts_per_tok, capacity_factor):
        super().__init__()
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.capacity_factor = capacity_factor
        self.gate = MaxTextGate(hidden, num_experts)
        self.wi_0 = nn.Parameter(torch.empty(num_experts, hidden, mlp_dim))
        self.wi_1 = nn.Parameter(torch.empty(num_experts, hidden, mlp_dim))
        self.wo = nn.Parameter(torch.empty(num_experts, mlp_dim, hidden))

    def get_expert_capacity_per_batch(self, tokens_per_batch):
        return max(int(math.ceil(tokens_per_batch * self.num_experts_per_tok / self.num_experts
                                 * self.capacity_factor)), 1)

    def reshape_and_update_weights(self, weights, indices):
        # dense [B, S, E] weights with the top-k values at their expert ids
        update = torch.zeros(*weights.shape[:-1], self.num_experts, dtype=weights.dtype, device=weights.device)
        return update.scatter(-1, indices, weights)

    def generate_masks(self, top_k_indices, softmax_probs, capacity):
        b, s, k = top_k_indices.shape
        expert_mask = F.one_hot(top_k_indices, num_classes=self.num_experts).to(torch.int32)  # [B, S, K, E]
        expert_mask_fused = expert_mask.reshape(b, s * k, self.num_experts)
        expert_token_count_fused = torch.cumsum(expert_mask_fused, dim=1)
        expert_token_count = expert_token_count_fused.reshape(b, s, k, self.num_experts)
        trunc_expert_mask = expert_mask * (expert_token_count <= capacity).to(torch.int32)
        combined_expert_mask = trunc_expert_mask.sum(dim=2)  # [B, S, E]
        softmax_probs = softmax_probs * combined_expert_mask
        expert_token_position_in_capacity = (expert_token_count * trunc_expert_mask).sum(dim=2)  # 1-based, 0 = none
        expert_capacity_mask = F.one_hot(expert_token_position_in_capacity.long(), num_classes=capacity + 1)
        expert_capacity_mask = expert_capacity_mask[..., 1:].to(softmax_probs.dtype)  # [B, S, E, C]
        combine_mask = softmax_probs[..., None] * expert_capacity_mask
        dispatch_mask = combine_mask.bool().to(softmax_probs.dtype)
        return dispatch_mask, combine_mask

    def forward(self, inputs):
        b, s, _ = inputs.shape
        gate_logits = self.gate(inputs)
        top_k_weights, top_k_indices = torch.topk(gate_logits, self.num_experts_per_tok, dim=-1)
        top_k_weights = F.softmax(top_k_weights.float(), dim=-1).to(inputs.dtype)
        weights = self.reshape_and_update_weights(top_k_weights, top_k_indices)
        capacity = self.get_expert_capacity_per_batch(s)
        dispatch_mask, combine_mask = self.generate_masks(top_k_indices, weights, capacity)
        dispatch = torch.einsum("BSM,BSEC -> EBCM", inputs, dispatch_mask)
        layer_w0 = torch.einsum("EBCM,EMH -> EBCH", dispatch, self.wi_0)
        layer_w1 = torch.einsum("EBCM,EMH -> EBCH", dispatch, self.wi_1)
        layer_multiply = F.silu(layer_w0) * layer_w1
        intermediate_layer = torch.einsum("EBCH,EHM -> EBCM", layer_multiply, self.wo)
        return torch.einsum("EBCM,BSEC -> BSM", intermediate_layer, combine_mask)


def make_sparse(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: MaxTextSparseMoE(HIDDEN, FFN, EXPERTS, 2), dtype, seed)


def make_dense_capacity(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: MaxTextDenseCapacityMoE(HIDDEN, FFN, EXPERTS, 2, 1.25), dtype, seed)


LAYERS = [
    CorpusLayer(
        name="maxtext_sparse_argsort_gmm",
        origin="maxtext MaxText/layers/moe.py RoutedMoE.sparse_matmul (top-k logits + softmax, argsort permute, "
               "bincount group sizes, ragged gmm as torch._grouped_mm, argsort unpermute, einsum BKE,BK->BE)",
        style="sort",
        make=make_sparse,
        input_shape=(2, 16, HIDDEN),
    ),
    CorpusLayer(
        name="maxtext_dense_capacity_einsum",
        origin="maxtext MaxText/layers/moe.py RoutedMoE.dense_matmul with capacity_factor (cumsum over S*K, "
               "[B, S, E, C] masks, einsum BSM,BSEC->EBCM dispatch and EBCM,BSEC->BSM combine)",
        style="capacity",
        make=make_dense_capacity,
        input_shape=(2, 16, HIDDEN),
    ),
]
