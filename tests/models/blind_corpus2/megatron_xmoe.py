"""Two routers the first batch did not have, each with a dispatch of its code base:
- NVIDIA/Megatron-LM core/transformer/moe: TopKRouter with a raw [E, H] weight (F.linear gating), score_function
  "sigmoid", an expert_bias buffer used for selection only, group_limited_topk (group score = sum of the top
  (k / group_topk) scores of each group, masked_fill(-inf) outside the chosen groups), probabilities gathered from the
  unbiased sigmoid, renormalised (+1e-20) and scaled by moe_router_topk_scaling_factor, routing_probs / routing_map
  by scatter; the token dispatcher's permute (routing_map.T, arange().expand, masked_select, index_select) with the
  probabilities permuted alongside; the legacy GroupedMLP, whose weight1 [H, E * 2F] / weight2 [E * F, H] are
  viewed per expert and run with gg.ops.gmm (here a loop over torch.split by the host counts), a chunked SwiGLU;
  unpermute multiplies by the permuted probabilities and scatter_add_s back.
- microsoft/unilm xmoe (fairseq moe Top2Gate with use_xmoe): a low-dimensional wg_reduction Linear, cosine
  logits against an [E, 16] wg (both L2-normalised in fp32; the in-place 1.5 rescale of wg is left out: the cosine
  normalises it away), softmax, top-2 with gates renormalised; dispatch by positions from a cumsum over the
  one-hot choices (second choices after all first choices, fairseq's locations2 += sum(mask1)), capacity = T
  (the eval capacity fraction 1.0: dropless), tokens written into an [E, C, H] buffer by index_put, stacked
  einsum experts, read back with the (expert, slot) pairs and combined as g1 * y1 + g2 * y2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._registry import EXPERTS, FFN, HIDDEN, CorpusLayer, materialize, seeded_uniform_


# ----------------------------------------------------------------------------------------- Megatron-LM
def group_limited_topk(scores, topk, num_tokens, num_experts, num_groups, group_topk):
    group_scores = scores.view(num_tokens, num_groups, -1).topk(topk // group_topk, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = (group_mask.unsqueeze(-1).expand(num_tokens, num_groups, num_experts // num_groups)
                  .reshape(num_tokens, -1))
    masked_scores = scores.masked_fill(~score_mask.bool(), float("-inf"))
    probs, top_indices = torch.topk(masked_scores, k=topk, dim=-1)
    return probs, top_indices


class TopKRouter(nn.Module):
    def __init__(self, hidden, num_experts, topk, num_groups, group_topk, scaling_factor):
        super().__init__()
        self.num_experts = num_experts
        self.topk = topk
        self.num_groups = num_groups
        self.group_topk = group_topk
        self.scaling_factor = scaling_factor
        self.weight = nn.Parameter(torch.empty((num_experts, hidden)))
        self.register_buffer("expert_bias", torch.zeros(num_experts))

    def gating(self, inp):
        return F.linear(inp, self.weight)

    def routing(self, logits):
        num_tokens = logits.shape[0]
        scores = torch.sigmoid(logits.float()).type_as(logits)
        scores_for_routing = scores + self.expert_bias
        _, top_indices = group_limited_topk(scores_for_routing, self.topk, num_tokens, self.num_experts,
                                            self.num_groups, self.group_topk)
        scores = torch.gather(scores, dim=1, index=top_indices).type_as(logits)
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if self.topk > 1 else scores
        probs = probs * self.scaling_factor
        routing_probs = torch.zeros_like(logits).scatter(1, top_indices, probs)
        routing_map = torch.zeros_like(logits).int().scatter(1, top_indices, 1).bool()
        return routing_probs, routing_map

    def forward(self, inp):
        logits = self.gating(inp).view(-1, self.num_experts)
        return self.routing(logits)


def permute(tokens, routing_map, probs):
    num_tokens, _ = tokens.shape
    num_experts = routing_map.shape[1]
    routing_map = routing_map.bool().T.contiguous()
    token_indices = torch.arange(num_tokens, device=routing_map.device).unsqueeze(0).expand(num_experts, -1)
    sorted_indices = token_indices.masked_select(routing_map)
    permuted_probs = probs.T.contiguous().masked_select(routing_map)
    permuted_input = tokens.index_select(0, sorted_indices)
    return permuted_input, permuted_probs, sorted_indices


def unpermute(permuted_tokens, sorted_indices, restore_shape, permuted_probs):
    _, hidden = restore_shape
    permuted_tokens = permuted_tokens * permuted_probs.unsqueeze(-1)
    output_tokens = torch.zeros(restore_shape, dtype=permuted_tokens.dtype, device=permuted_tokens.device)
    output_tokens.scatter_add_(0, sorted_indices.unsqueeze(1).expand(-1, hidden), permuted_tokens)
    return output_tokens


class GroupedMLP(nn.Module):
    def __init__(self, hidden, ffn, num_local_experts):
        super().__init__()
        self.hidden = hidden
        self.num_local_experts = num_local_experts
        self.weight1 = nn.Parameter(torch.empty(hidden, ffn * 2 * num_local_experts))
        self.weight2 = nn.Parameter(torch.empty(ffn * num_local_experts, hidden))

    @staticmethod
    def activation_func(x):
        x = torch.chunk(x, 2, dim=-1)
        return F.silu(x[0]) * x[1]

    @staticmethod
    def gmm(a, b, batch_sizes):
        return torch.cat([chunk @ b[i] for i, chunk in enumerate(torch.split(a, batch_sizes.tolist(), dim=0))])

    def forward(self, permuted_local_hidden_states, tokens_per_expert):
        w1 = self.weight1.view(self.num_local_experts, self.hidden, -1)
        w2 = self.weight2.view(self.num_local_experts, -1, self.hidden)
        fc1_output = self.gmm(permuted_local_hidden_states, w1, tokens_per_expert)
        intermediate_parallel = self.activation_func(fc1_output)
        return self.gmm(intermediate_parallel, w2, tokens_per_expert)


class MegatronMoELayer(nn.Module):
    def __init__(self, hidden, ffn, num_experts, topk, num_groups, group_topk, scaling_factor):
        super().__init__()
        self.router = TopKRouter(hidden, num_experts, topk, num_groups, group_topk, scaling_factor)
        self.experts = GroupedMLP(hidden, ffn, num_experts)

    def forward(self, hidden_states):
        probs, routing_map = self.router(hidden_states)
        hidden_shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_shape[-1])
        tokens_per_expert = routing_map.sum(dim=0).long().cpu()
        permuted, permuted_probs, sorted_indices = permute(hidden_states, routing_map, probs)
        expert_output = self.experts(permuted, tokens_per_expert)
        output = unpermute(expert_output, sorted_indices, hidden_states.shape, permuted_probs)
        return output.view(hidden_shape)


# -------------------------------------------------------------------------------------------- unilm xmoe
class XMoETop2Gate(nn.Module):
    def __init__(self, model_dim, num_experts, reduced_dim=16):
        super().__init__()
        self.num_experts = num_experts
        self.wg_reduction = nn.Linear(model_dim, reduced_dim, bias=False)
        self.wg = nn.Parameter(torch.empty(num_experts, reduced_dim))

    @staticmethod
    def _cosine(mat1, mat2, eps=1e-4):
        mat1 = F.normalize(mat1.float(), p=2.0, dim=1, eps=eps)
        mat2 = F.normalize(mat2.float(), p=2.0, dim=1, eps=eps)
        return mat1.matmul(mat2.transpose(0, 1)).type_as(mat1)

    def forward(self, inp):
        reduced = self.wg_reduction(inp)
        logits = self._cosine(reduced, self.wg)
        gates = F.softmax(logits, dim=1)
        num_tokens = gates.shape[0]
        capacity = num_tokens
        indices1_s = torch.argmax(gates, dim=1)
        mask1 = F.one_hot(indices1_s, num_classes=self.num_experts)
        logits_except1 = logits.masked_fill(mask1.bool(), float("-inf"))
        indices2_s = torch.argmax(logits_except1, dim=1)
        mask2 = F.one_hot(indices2_s, num_classes=self.num_experts)
        gates1_s = (gates * mask1).sum(dim=1)
        gates2_s = (gates * mask2).sum(dim=1)
        denom_s = torch.clamp(gates1_s + gates2_s, min=torch.finfo(gates1_s.dtype).eps)
        gates1_s = gates1_s / denom_s
        gates2_s = gates2_s / denom_s
        locations1 = torch.cumsum(mask1, dim=0) - 1
        locations2 = torch.cumsum(mask2, dim=0) - 1
        locations2 = locations2 + torch.sum(mask1, dim=0, keepdim=True)
        locations1_s = torch.sum(locations1 * mask1, dim=1)
        locations2_s = torch.sum(locations2 * mask2, dim=1)
        return (indices1_s, indices2_s), (locations1_s, locations2_s), (gates1_s, gates2_s), capacity


class XMoELayer(nn.Module):
    def __init__(self, model_dim, ffn, num_experts):
        super().__init__()
        self.num_experts = num_experts
        self.gate = XMoETop2Gate(model_dim, num_experts)
        self.fc1 = nn.Parameter(torch.empty(num_experts, model_dim, ffn))
        self.fc1_bias = nn.Parameter(torch.empty(num_experts, 1, ffn))
        self.fc2 = nn.Parameter(torch.empty(num_experts, ffn, model_dim))
        self.fc2_bias = nn.Parameter(torch.empty(num_experts, 1, model_dim))

    def forward(self, inp):
        d_model = inp.shape[-1]
        reshaped_input = inp.reshape(-1, d_model)
        (idx1, idx2), (loc1, loc2), (g1, g2), capacity = self.gate(reshaped_input)
        buf = reshaped_input.new_zeros(self.num_experts, capacity, d_model)
        buf = buf.index_put((idx1, loc1), reshaped_input)
        buf = buf.index_put((idx2, loc2), reshaped_input)
        h = F.relu(torch.einsum("ecm,emf->ecf", buf, self.fc1) + self.fc1_bias)
        expert_output = torch.einsum("ecf,efm->ecm", h, self.fc2) + self.fc2_bias
        y1 = expert_output[idx1, loc1]
        y2 = expert_output[idx2, loc2]
        combined = g1.unsqueeze(-1).to(y1.dtype) * y1 + g2.unsqueeze(-1).to(y2.dtype) * y2
        return combined.reshape(inp.shape)


def make_megatron(dtype: torch.dtype, seed: int) -> nn.Module:
    module = materialize(lambda: MegatronMoELayer(HIDDEN, FFN, EXPERTS, 2, 4, 2, 2.5), dtype, seed)
    seeded_uniform_(module.router.expert_bias, seed + 1, -0.05, 0.05)
    return module


def make_xmoe(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: XMoELayer(HIDDEN, FFN, EXPERTS), dtype, seed)


LAYERS = [
    CorpusLayer(
        name="megatron_sigmoid_group_limited_grouped_mlp",
        origin="Megatron-LM TopKRouter (sigmoid, expert_bias selection, group_limited_topk, scaling) + permute "
               "(masked_select, permuted probs) + legacy GroupedMLP weight1 [H, E*2F] views with gmm by split + "
               "unpermute scatter_add_",
        style="host_loop",
        make=make_megatron,
        input_shape=(2, 16, HIDDEN),
    ),
    CorpusLayer(
        name="xmoe_cosine_top2_index_put",
        origin="microsoft/unilm xmoe Top2Gate (wg_reduction, cosine logits, top-2 renorm, fairseq cumsum "
               "locations, capacity = T) + index_put into [E, C, H], einsum experts with bias, (expert, slot) "
               "gather combine",
        style="device_padded",
        make=make_xmoe,
        input_shape=(2, 16, HIDDEN),
    ),
]
