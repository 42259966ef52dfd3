"""Grok-1 and DBRX MoE layers.

Grok-1 (xai-org/grok-1 model.py, MoELayer._inference_call): a JAX/Haiku layer; each (token, choice) row is pushed
through *every* expert with einsum("mk,bkn->bmn") and the chosen output is picked with a one-hot einsum
("moe_slow_matmul"). Re-expressed in torch with the stacked [E, ...] weights Haiku's vmapped init produces.

DBRX (transformers models/dbrx/modeling_dbrx.py): DbrxRouter with p-norm weight normalisation and DbrxExperts whose
w1/v1/w2 are 2-D [E * ffn, hidden] parameters viewed per expert inside a loop over experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._registry import EXPERTS, FFN, HIDDEN, CorpusLayer, materialize


class Router(nn.Module):
    # grok-1 Router: raw `w` [emb, E], routing computed in fp32, softmax, no renormalisation after top-k
    def __init__(self, emb_size, num_experts, num_selected_experts):
        super().__init__()
        self.w = nn.Parameter(torch.empty(emb_size, num_experts))
        self.num_experts = num_experts
        self.num_selected_experts = num_selected_experts

    def compute_routing_prob(self, inputs):
        inputs = inputs.float()
        routing_logits = inputs @ self.w.float()
        routing_probs = torch.softmax(routing_logits, dim=-1)
        return routing_probs, routing_logits


# xai-org/grok-1 model.py :: MoELayer._inference_call (moe_slow_matmul1/2)
class Grok1MoELayer(nn.Module):
    def __init__(self, emb_size, ffn_size, num_experts, num_selected_experts):
        super().__init__()
        self.router = Router(emb_size, num_experts, num_selected_experts)
        self.num_experts = num_experts
        # DenseBlock params lifted through vmap: linear_v / linear / linear_1, each with a leading expert dim
        self.linear_v = nn.Parameter(torch.empty(num_experts, emb_size, ffn_size))
        self.linear = nn.Parameter(torch.empty(num_experts, emb_size, ffn_size))
        self.linear_1 = nn.Parameter(torch.empty(num_experts, ffn_size, emb_size))

    def moe_slow_matmul(self, input, weight, index):  # noqa: A002
        one_hot_indices = F.one_hot(index.reshape(-1), self.num_experts).transpose(0, 1).to(input.dtype)
        all_expert_output = torch.einsum("mk,bkn->bmn", input, weight)
        return torch.einsum("bm,bmn->mn", one_hot_indices, all_expert_output)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        routing_probs, _ = self.router.compute_routing_prob(inputs)
        expert_gate, expert_index = torch.topk(routing_probs, k=self.router.num_selected_experts)
        tmp = inputs.reshape(inputs.shape[0] * inputs.shape[1], inputs.shape[2])
        broad_inputs = tmp[:, None, :].repeat(1, self.router.num_selected_experts, 1)
        broad_inputs = broad_inputs.reshape(broad_inputs.shape[0] * broad_inputs.shape[1], broad_inputs.shape[2])
        x = self.moe_slow_matmul(broad_inputs, self.linear_v, expert_index)
        y = self.moe_slow_matmul(broad_inputs, self.linear, expert_index)
        y = F.gelu(y, approximate="tanh")
        out = self.moe_slow_matmul(x * y, self.linear_1, expert_index)
        out = out.reshape(inputs.shape[0], inputs.shape[1], self.router.num_selected_experts, out.shape[-1])
        out = expert_gate[:, :, :, None].to(inputs.dtype) * out
        return out.sum(dim=2)


# transformers models/dbrx :: DbrxRouter
class DbrxRouter(nn.Module):
    def __init__(self, hidden_size, moe_num_experts, moe_top_k, moe_normalize_expert_weights=1.0):
        super().__init__()
        self.hidden_size = hidden_size
        self.moe_num_experts = moe_num_experts
        self.moe_top_k = moe_top_k
        self.moe_normalize_expert_weights = moe_normalize_expert_weights
        self.layer = nn.Linear(self.hidden_size, self.moe_num_experts, bias=False)

    def forward(self, hidden_states: torch.Tensor):
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        weights = self.layer(hidden_states).softmax(dim=-1, dtype=torch.float32)
        top_weights, top_experts = torch.topk(weights, self.moe_top_k, dim=-1)
        top_weights_scale = (
            torch.norm(top_weights, p=self.moe_normalize_expert_weights, dim=-1, keepdim=True)
            if self.moe_normalize_expert_weights is not None
            else torch.ones_like(top_weights)
        )
        top_weights = top_weights / top_weights_scale
        weights = weights.to(hidden_states.dtype)
        top_weights = top_weights.to(hidden_states.dtype)
        return weights, top_weights, top_experts


# transformers models/dbrx :: DbrxExpertGLU (2-D w1/v1/w2, sliced per expert by the caller)
class DbrxExpertGLU(nn.Module):
    def __init__(self, hidden_size, ffn_hidden_size, moe_num_experts):
        super().__init__()
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.moe_num_experts = moe_num_experts
        self.w1 = nn.Parameter(torch.empty(moe_num_experts * ffn_hidden_size, hidden_size))
        self.v1 = nn.Parameter(torch.empty(moe_num_experts * ffn_hidden_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(moe_num_experts * ffn_hidden_size, hidden_size))
        self.activation_fn = nn.SiLU()

    def forward(self, x, expert_w1, expert_v1, expert_w2):
        gate_proj = x.matmul(expert_w1.t())
        up_proj = x.matmul(expert_v1.t())
        gate_proj = self.activation_fn(gate_proj)
        intermediate_states = gate_proj * up_proj
        return intermediate_states.matmul(expert_w2)


# transformers models/dbrx :: DbrxExperts.forward
class DbrxExperts(nn.Module):
    def __init__(self, hidden_size, ffn_hidden_size, moe_num_experts):
        super().__init__()
        self.moe_num_experts = moe_num_experts
        self.mlp = DbrxExpertGLU(hidden_size, ffn_hidden_size, moe_num_experts)

    def forward(self, x, weights, top_weights, top_experts):
        bsz, q_len, hidden_size = x.shape
        x = x.view(-1, hidden_size)
        out = torch.zeros_like(x)
        expert_mask = F.one_hot(top_experts, num_classes=self.moe_num_experts).permute(2, 1, 0)
        split_expert_shape = (-1, self.mlp.ffn_hidden_size, self.mlp.hidden_size)
        for expert_idx in range(0, self.moe_num_experts):
            topk_idx, token_idx = torch.where(expert_mask[expert_idx])
            if token_idx.shape[0] == 0:
                continue
            token_list = token_idx
            topk_list = topk_idx
            expert_tokens = x[None, token_list].reshape(-1, hidden_size)
            expert_out = (
                self.mlp(
                    expert_tokens,
                    self.mlp.w1.view(split_expert_shape)[expert_idx],
                    self.mlp.v1.view(split_expert_shape)[expert_idx],
                    self.mlp.w2.view(split_expert_shape)[expert_idx],
                )
                * top_weights[token_list, topk_list, None]
            )
            out.index_add_(0, token_idx, expert_out)
        return out.reshape(bsz, q_len, hidden_size)


# transformers models/dbrx :: DbrxFFN (router + experts, returns (out, weights))
class DbrxFFN(nn.Module):
    def __init__(self, hidden_size, ffn_hidden_size, moe_num_experts, moe_top_k):
        super().__init__()
        self.router = DbrxRouter(hidden_size, moe_num_experts, moe_top_k)
        self.experts = DbrxExperts(hidden_size, ffn_hidden_size, moe_num_experts)

    def forward(self, x: torch.Tensor):
        weights, top_weights, top_experts = self.router(x)
        out = self.experts(x, weights, top_weights, top_experts)
        return out, weights


def make_grok(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: Grok1MoELayer(HIDDEN, FFN, EXPERTS, 2), dtype, seed)


def make_dbrx(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: DbrxFFN(HIDDEN, FFN, 16, 4), dtype, seed)


LAYERS = [
    CorpusLayer(
        name="grok1_moe_slow_matmul",
        origin="xai-org/grok-1 model.py MoELayer._inference_call (tile per choice, einsum mk,bkn->bmn + one-hot pick)",
        style="onehot_dense",
        make=make_grok,
        input_shape=(2, 16, HIDDEN),
    ),
    CorpusLayer(
        name="dbrx_experts_glu_views",
        origin="transformers models/dbrx DbrxRouter (p-norm) + DbrxExperts (w1/v1/w2 .view per expert, index_add_)",
        style="host_loop",
        make=make_dbrx,
        input_shape=(2, 16, HIDDEN),
        returns_tuple=True,
    ),
]
