"""DeepSeek MoE layers: DeepSeek-V3 inference/model.py (Gate + MoE with bincount().tolist()), the DeepSeek-V2
HF remote code (modeling_deepseek.py: MoEGate, DeepseekV2MoE training path and moe_infer) and the transformers
DeepseekV3MoE (noaux_tc group routing with e_score_correction_bias). Single rank: world_size == 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._registry import FFN, HIDDEN, CorpusLayer, materialize, seeded_uniform_


# ---------------------------------------------------------------- DeepSeek-V3 inference/model.py
class Gate(nn.Module):
    def __init__(self, dim, n_routed_experts, topk, n_groups, topk_groups, score_func="sigmoid", route_scale=1.0):
        super().__init__()
        self.dim = dim
        self.topk = topk
        self.n_groups = n_groups
        self.topk_groups = topk_groups
        self.score_func = score_func
        self.route_scale = route_scale
        self.weight = nn.Parameter(torch.empty(n_routed_experts, dim))
        self.bias = nn.Parameter(torch.empty(n_routed_experts))

    def forward(self, x: torch.Tensor):
        scores = F.linear(x, self.weight)
        if self.score_func == "softmax":
            scores = scores.softmax(dim=-1, dtype=torch.float32)
        else:
            scores = scores.sigmoid()
        original_scores = scores
        if self.bias is not None:
            scores = scores + self.bias
        if self.n_groups > 1:
            scores = scores.view(x.size(0), self.n_groups, -1)
            if self.bias is None:
                group_scores = scores.amax(dim=-1)
            else:
                group_scores = scores.topk(2, dim=-1)[0].sum(dim=-1)
            indices = group_scores.topk(self.topk_groups, dim=-1)[1]
            mask = scores.new_ones(x.size(0), self.n_groups, dtype=torch.bool).scatter_(1, indices, False)
            scores = scores.masked_fill(mask.unsqueeze(-1), float("-inf")).flatten(1)
        indices = torch.topk(scores, self.topk, dim=-1)[1]
        weights = original_scores.gather(1, indices)
        if self.score_func == "sigmoid":
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights * self.route_scale
        return weights.type_as(x), indices


# DeepSeek-V3 inference/model.py :: Expert (w1/w2/w3 SwiGLU; MLP is the same shape)
class Expert(nn.Module):
    def __init__(self, dim, inter_dim):
        super().__init__()
        self.w1 = nn.Linear(dim, inter_dim, bias=False)
        self.w2 = nn.Linear(inter_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, inter_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


MLP = Expert  # the shared experts use the same w1/w2/w3 SwiGLU


# DeepSeek-V3 inference/model.py :: MoE (world_size == 1)
class DeepseekV3InferenceMoE(nn.Module):
    def __init__(self, dim, moe_inter_dim, n_routed_experts, n_activated_experts, n_groups, topk_groups,
                 n_shared_experts=1, route_scale=2.5):
        super().__init__()
        self.dim = dim
        self.n_routed_experts = n_routed_experts
        self.n_local_experts = n_routed_experts
        self.n_activated_experts = n_activated_experts
        self.experts_start_idx = 0
        self.experts_end_idx = self.experts_start_idx + self.n_local_experts
        self.gate = Gate(dim, n_routed_experts, n_activated_experts, n_groups, topk_groups, route_scale=route_scale)
        self.experts = nn.ModuleList([Expert(dim, moe_inter_dim) for _ in range(n_routed_experts)])
        self.shared_experts = MLP(dim, n_shared_experts * moe_inter_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.size()
        x = x.view(-1, self.dim)
        weights, indices = self.gate(x)
        y = torch.zeros_like(x)
        counts = torch.bincount(indices.flatten(), minlength=self.n_routed_experts).tolist()
        for i in range(self.experts_start_idx, self.experts_end_idx):
            if counts[i] == 0:
                continue
            expert = self.experts[i]
            idx, top = torch.where(indices == i)
            y[idx] += expert(x[idx]) * weights[idx, top, None]
        z = self.shared_experts(x)
        return (y + z).view(shape)


# ---------------------------------------------------------------- DeepSeek-V2 modeling_deepseek.py
class MoEGate(nn.Module):
    def __init__(self, hidden_size, n_routed_experts, top_k, n_group, topk_group, norm_topk_prob=False,
                 routed_scaling_factor=1.0, topk_method="group_limited_greedy"):
        super().__init__()
        self.top_k = top_k
        self.n_routed_experts = n_routed_experts
        self.routed_scaling_factor = routed_scaling_factor
        self.topk_method = topk_method
        self.n_group = n_group
        self.topk_group = topk_group
        self.norm_topk_prob = norm_topk_prob
        self.gating_dim = hidden_size
        self.weight = nn.Parameter(torch.empty((self.n_routed_experts, self.gating_dim)))

    def forward(self, hidden_states):
        bsz, seq_len, h = hidden_states.shape
        hidden_states = hidden_states.view(-1, h)
        logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32), None)
        scores = logits.softmax(dim=-1, dtype=torch.float32)
        if self.topk_method == "greedy":
            topk_weight, topk_idx = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        else:
            group_scores = scores.view(bsz * seq_len, self.n_group, -1).max(dim=-1).values
            group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores)
            group_mask.scatter_(1, group_idx, 1)
            score_mask = (
                group_mask.unsqueeze(-1)
                .expand(bsz * seq_len, self.n_group, self.n_routed_experts // self.n_group)
                .reshape(bsz * seq_len, -1)
            )
            tmp_scores = scores.masked_fill(~score_mask.bool(), 0.0)
            topk_weight, topk_idx = torch.topk(tmp_scores, k=self.top_k, dim=-1, sorted=False)
        if self.top_k > 1 and self.norm_topk_prob:
            denominator = topk_weight.sum(dim=-1, keepdim=True) + 1e-20
            topk_weight = topk_weight / denominator
        else:
            topk_weight = topk_weight * self.routed_scaling_factor
        return topk_idx, topk_weight, None


# DeepSeek-V2 modeling_deepseek.py :: DeepseekV2MLP (gate_proj/up_proj/down_proj)
class DeepseekV2MLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


# DeepSeek-V2 modeling_deepseek.py :: DeepseekV2MoE.__init__ (ep_size == 1)
class _DeepseekV2MoEBase(nn.Module):
    def __init__(self, hidden_size, moe_intermediate_size, n_routed_experts, num_experts_per_tok, n_group,
                 topk_group, n_shared_experts, routed_scaling_factor):
        super().__init__()
        self.num_experts_per_tok = num_experts_per_tok
        self.ep_size = 1
        self.experts_per_rank = n_routed_experts
        self.ep_rank = 0
        self.experts = nn.ModuleList(
            [DeepseekV2MLP(hidden_size, moe_intermediate_size) for _ in range(n_routed_experts)]
        )
        self.gate = MoEGate(hidden_size, n_routed_experts, num_experts_per_tok, n_group, topk_group,
                            routed_scaling_factor=routed_scaling_factor)
        self.shared_experts = DeepseekV2MLP(hidden_size, moe_intermediate_size * n_shared_experts)


# Follows DeepseekV2MoE.forward, the `self.training` branch (repeat_interleave + boolean-mask loop)
class DeepseekV2MoETrain(_DeepseekV2MoEBase):
    def forward(self, hidden_states):
        identity = hidden_states
        orig_shape = hidden_states.shape
        topk_idx, topk_weight, aux_loss = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        flat_topk_idx = topk_idx.view(-1)
        hidden_states = hidden_states.repeat_interleave(self.num_experts_per_tok, dim=0)
        y = torch.empty_like(hidden_states)
        for i, expert in enumerate(self.experts):
            y[flat_topk_idx == i] = expert(hidden_states[flat_topk_idx == i])
        y = (y.view(*topk_weight.shape, -1) * topk_weight.unsqueeze(-1)).sum(dim=1)
        y = y.to(hidden_states.dtype).view(*orig_shape)
        return y + self.shared_experts(identity)


# Follows DeepseekV2MoE.moe_infer (argsort, counts on the host, cat of per-expert outputs, new_x[idxs] = outs)
class DeepseekV2MoEInfer(_DeepseekV2MoEBase):
    def forward(self, hidden_states):
        identity = hidden_states
        orig_shape = hidden_states.shape
        topk_idx, topk_weight, aux_loss = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        y = self.moe_infer(hidden_states, topk_idx, topk_weight).view(*orig_shape)
        return y + self.shared_experts(identity)

    def moe_infer(self, x, topk_ids, topk_weight):
        cnts = topk_ids.new_zeros((topk_ids.shape[0], len(self.experts)))
        cnts.scatter_(1, topk_ids, 1)
        tokens_per_expert = cnts.sum(dim=0)
        idxs = topk_ids.view(-1).argsort()
        sorted_tokens = x[idxs // topk_ids.shape[1]]
        tokens_per_expert = tokens_per_expert.cpu().tolist()
        outputs = []
        start_idx = 0
        for i, num_tokens in enumerate(tokens_per_expert):
            end_idx = start_idx + num_tokens
            if num_tokens == 0:
                continue
            expert = self.experts[i + self.ep_rank * self.experts_per_rank]
            tokens_for_this_expert = sorted_tokens[start_idx:end_idx]
            outputs.append(expert(tokens_for_this_expert))
            start_idx = end_idx
        outs = torch.cat(outputs, dim=0) if len(outputs) else sorted_tokens.new_empty(0)
        new_x = torch.empty_like(outs)
        new_x[idxs] = outs
        final_out = (
            new_x.view(*topk_ids.shape, -1)
            .type(topk_weight.dtype)
            .mul_(topk_weight.unsqueeze(dim=-1))
            .sum(dim=1)
            .type(new_x.dtype)
        )
        return final_out


# ---------------------------------------------------------------- transformers DeepseekV3MoE
class DeepseekV3TopkRouter(nn.Module):
    def __init__(self, hidden_size, n_routed_experts, top_k, n_group, topk_group, routed_scaling_factor,
                 norm_topk_prob=True):
        super().__init__()
        self.top_k = top_k
        self.n_routed_experts = n_routed_experts
        self.routed_scaling_factor = routed_scaling_factor
        self.n_group = n_group
        self.topk_group = topk_group
        self.norm_topk_prob = norm_topk_prob
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(torch.empty((self.n_routed_experts, hidden_size)))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.n_routed_experts))

    @torch.no_grad()
    def get_topk_indices(self, scores):
        scores_for_choice = scores.view(-1, self.n_routed_experts) + self.e_score_correction_bias.unsqueeze(0)
        group_scores = (
            scores_for_choice.view(-1, self.n_group, self.n_routed_experts // self.n_group)
            .topk(2, dim=-1)[0]
            .sum(dim=-1)
        )
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = (
            group_mask.unsqueeze(-1)
            .expand(-1, self.n_group, self.n_routed_experts // self.n_group)
            .reshape(-1, self.n_routed_experts)
        )
        scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), 0.0)
        return torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)[1]

    def forward(self, hidden_states):
        hidden_states = hidden_states.view(-1, self.hidden_size)
        router_logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
        scores = router_logits.sigmoid()
        topk_indices = self.get_topk_indices(scores)
        topk_weights = scores.gather(1, topk_indices)
        if self.norm_topk_prob:
            denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
            topk_weights = topk_weights / denominator
        topk_weights = topk_weights * self.routed_scaling_factor
        return topk_indices, topk_weights


# transformers models/deepseek_v3 :: DeepseekV3MoE (moe() loop over a ModuleList + shared experts)
class DeepseekV3MoE(nn.Module):
    def __init__(self, hidden_size, moe_intermediate_size, n_routed_experts, top_k, n_group, topk_group,
                 n_shared_experts=1, routed_scaling_factor=2.5):
        super().__init__()
        self.experts = nn.ModuleList(
            [DeepseekV2MLP(hidden_size, moe_intermediate_size) for _ in range(n_routed_experts)]
        )
        self.gate = DeepseekV3TopkRouter(hidden_size, n_routed_experts, top_k, n_group, topk_group,
                                         routed_scaling_factor)
        self.shared_experts = DeepseekV2MLP(hidden_size, moe_intermediate_size * n_shared_experts)

    def moe(self, hidden_states, topk_indices, topk_weights):
        final_hidden_states = torch.zeros_like(hidden_states, dtype=topk_weights.dtype)
        expert_mask = F.one_hot(topk_indices, num_classes=len(self.experts))
        expert_mask = expert_mask.permute(2, 0, 1)
        for expert_idx in range(len(self.experts)):
            expert = self.experts[expert_idx]
            mask = expert_mask[expert_idx]
            token_indices, weight_indices = torch.where(mask)
            if token_indices.numel() > 0:
                expert_weights = topk_weights[token_indices, weight_indices]
                expert_input = hidden_states[token_indices]
                expert_output = expert(expert_input)
                weighted_output = expert_output * expert_weights.unsqueeze(-1)
                final_hidden_states.index_add_(0, token_indices, weighted_output)
        return final_hidden_states.type(hidden_states.dtype)

    def forward(self, hidden_states):
        residuals = hidden_states
        orig_shape = hidden_states.shape
        topk_indices, topk_weights = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        hidden_states = self.moe(hidden_states, topk_indices, topk_weights).view(*orig_shape)
        return hidden_states + self.shared_experts(residuals)


def make_ds_v3_inference(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: DeepseekV3InferenceMoE(HIDDEN, FFN, 16, 4, n_groups=4, topk_groups=2), dtype, seed)


def make_ds_v2_train(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: DeepseekV2MoETrain(HIDDEN, FFN, 16, 4, 4, 2, 2, 1.0), dtype, seed)


def make_ds_v2_infer(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: DeepseekV2MoEInfer(HIDDEN, FFN, 8, 2, 4, 2, 1, 1.0), dtype, seed)


def make_hf_ds_v3(dtype: torch.dtype, seed: int) -> nn.Module:
    module = materialize(lambda: DeepseekV3MoE(HIDDEN, FFN, 16, 4, n_group=4, topk_group=2), dtype, seed)
    seeded_uniform_(module.gate.e_score_correction_bias, seed + 1, -0.05, 0.05)
    return module


LAYERS = [
    CorpusLayer(
        name="deepseek_v3_inference_bincount",
        origin="DeepSeek-V3 inference/model.py Gate (sigmoid, group top-k) + MoE (bincount().tolist(), y[idx] +=)",
        style="modulelist_loop",
        make=make_ds_v3_inference,
        input_shape=(2, 16, HIDDEN),
    ),
    CorpusLayer(
        name="deepseek_v2_train_repeat_interleave",
        origin="DeepSeek-V2 modeling_deepseek.py DeepseekV2MoE training path (repeat_interleave, y[mask] = expert(..))",
        style="modulelist_loop",
        make=make_ds_v2_train,
        input_shape=(2, 16, HIDDEN),
    ),
    CorpusLayer(
        name="deepseek_v2_moe_infer_argsort",
        origin="DeepSeek-V2 modeling_deepseek.py DeepseekV2MoE.moe_infer (scatter_ counts, argsort, host counts, cat)",
        style="host_loop",
        make=make_ds_v2_infer,
        input_shape=(2, 16, HIDDEN),
    ),
    CorpusLayer(
        name="hf_deepseek_v3_noaux_tc",
        origin="transformers models/deepseek_v3 DeepseekV3TopkRouter (noaux_tc) + DeepseekV3MoE.moe (one_hot, where)",
        style="modulelist_loop",
        make=make_hf_ds_v3,
        input_shape=(2, 16, HIDDEN),
    ),
]
