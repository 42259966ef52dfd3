"""Capacity-limited routers from transformers:
- models/switch_transformers: SwitchTransformersTop1Router (fp32 router, argmax one-hot, cumsum token priority per
  sequence, capacity mask) + SwitchTransformersSparseMLP (ModuleDict `expert_{i}`, boolean-mask writes, dropped
  tokens pass through scaled by their router prob);
- models/nllb_moe: NllbMoeTop2Router (fairseq-style top-2 with capacity, second_expert_policy="all") +
  NllbMoeSparseMLP (einsum "bm,be->ebm" masking, per-expert boolean gather/scatter, sum over experts).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ._registry import EXPERTS, FFN, HIDDEN, CorpusLayer, materialize


# transformers models/switch_transformers :: SwitchTransformersDenseActDense (wi/wo, ReLU)
class SwitchTransformersDenseActDense(nn.Module):
    def __init__(self, d_model, d_ff):
        super().__init__()
        self.wi = nn.Linear(d_model, d_ff, bias=False)
        self.wo = nn.Linear(d_ff, d_model, bias=False)
        self.act = nn.ReLU()

    def forward(self, hidden_states):
        return self.wo(self.act(self.wi(hidden_states)))


# transformers models/switch_transformers :: SwitchTransformersTop1Router (no jitter: eval-style)
class SwitchTransformersTop1Router(nn.Module):
    def __init__(self, hidden_size, num_experts, expert_capacity, router_bias=False):
        super().__init__()
        self.num_experts = num_experts
        self.expert_capacity = expert_capacity
        self.classifier = nn.Linear(hidden_size, self.num_experts, bias=router_bias)
        self.dtype = torch.float32

    def _compute_router_probabilities(self, hidden_states):
        self.input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(self.dtype)
        router_logits = self.classifier(hidden_states)
        router_probabilities = F.softmax(router_logits, dim=-1, dtype=self.dtype).to(self.input_dtype)
        return router_probabilities, router_logits

    def forward(self, hidden_states):
        router_probs, router_logits = self._compute_router_probabilities(hidden_states)
        expert_index = torch.argmax(router_probs, dim=-1)
        expert_index = F.one_hot(expert_index, num_classes=self.num_experts)
        token_priority = torch.cumsum(expert_index, dim=-2)
        expert_capacity_mask = token_priority <= self.expert_capacity
        expert_index = expert_index * expert_capacity_mask
        router_probs = torch.max(router_probs, dim=-1).values.unsqueeze(-1)
        return expert_index, router_probs, router_logits


# transformers models/switch_transformers :: SwitchTransformersSparseMLP
class SwitchTransformersSparseMLP(nn.Module):
    def __init__(self, hidden_size, d_ff, num_experts, expert_capacity):
        super().__init__()
        self.router = SwitchTransformersTop1Router(hidden_size, num_experts, expert_capacity)
        self.experts = nn.ModuleDict()
        for idx in range(num_experts):
            self.experts[f"expert_{idx}"] = SwitchTransformersDenseActDense(hidden_size, d_ff)

    def forward(self, hidden_states):
        router_mask, router_probs, router_logits = self.router(hidden_states)
        expert_index = torch.argmax(router_mask, dim=-1)
        next_states = hidden_states.clone()
        router_mask = router_mask.bool()
        batch_size, seq_len, num_experts = router_mask.shape
        idx_mask = router_mask.reshape(batch_size * seq_len, num_experts).sum(dim=0)
        idx_mask = torch.nonzero(idx_mask, as_tuple=True)[0].tolist()
        for idx in idx_mask:
            next_states[router_mask[:, :, idx]] = getattr(self.experts, f"expert_{idx}")(
                hidden_states[router_mask[:, :, idx]]
            ).to(next_states.dtype)
        hidden_states = router_probs * next_states
        return hidden_states, (router_logits, expert_index)


# transformers models/nllb_moe :: NllbMoeDenseActDense (fc1/fc2 with biases)
class NllbMoeDenseActDense(nn.Module):
    def __init__(self, d_model, ffn_dim):
        super().__init__()
        self.fc1 = nn.Linear(d_model, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, d_model)
        self.act = nn.ReLU()

    def forward(self, hidden_states):
        return self.fc2(self.act(self.fc1(hidden_states)))


# transformers models/nllb_moe :: NllbMoeTop2Router (second_expert_policy='all')
class NllbMoeTop2Router(nn.Module):
    def __init__(self, hidden_size, num_experts, expert_capacity=None, moe_eval_capacity_token_fraction=1.0):
        super().__init__()
        self.num_experts = num_experts
        self.expert_capacity = expert_capacity
        self.classifier = nn.Linear(hidden_size, self.num_experts, bias=False)
        self.dtype = torch.float32
        self.second_expert_policy = "all"
        self.normalize_router_prob_before_dropping = False
        self.moe_eval_capacity_token_fraction = moe_eval_capacity_token_fraction

    def normalize_router_probabilities(self, router_probs, top_1_mask, top_2_mask):
        top_1_max_probs = (router_probs * top_1_mask).sum(dim=1)
        top_2_max_probs = (router_probs * top_2_mask).sum(dim=1)
        denom_s = torch.clamp(top_1_max_probs + top_2_max_probs, min=torch.finfo(router_probs.dtype).eps)
        return top_1_max_probs / denom_s, top_2_max_probs / denom_s

    def route_tokens(self, router_logits, input_dtype=torch.float32):
        nb_tokens = router_logits.shape[0]
        router_probs = F.softmax(router_logits, dim=-1, dtype=self.dtype).to(input_dtype)
        top_1_expert_index = torch.argmax(router_probs, dim=-1)
        top_1_mask = F.one_hot(top_1_expert_index, num_classes=self.num_experts)
        logits_except_top_1 = router_logits.masked_fill(top_1_mask.bool(), float("-inf"))
        top_2_expert_index = torch.argmax(logits_except_top_1, dim=-1)
        top_2_mask = F.one_hot(top_2_expert_index, num_classes=self.num_experts)

        locations1 = torch.cumsum(top_1_mask, dim=0) - 1
        locations2 = torch.cumsum(top_2_mask, dim=0) - 1
        locations2 += torch.sum(top_1_mask, dim=0, keepdim=True)

        if not self.training and self.moe_eval_capacity_token_fraction > 0:
            expert_capacity = math.ceil(self.moe_eval_capacity_token_fraction * nb_tokens)
        else:
            capacity = 2 * math.ceil(nb_tokens / self.num_experts)
            expert_capacity = capacity if self.expert_capacity is None else self.expert_capacity

        top_1_mask = top_1_mask * torch.lt(locations1, expert_capacity)
        top_2_mask = top_2_mask * torch.lt(locations2, expert_capacity)
        top_1_max_probs, top_2_max_probs = self.normalize_router_probabilities(router_probs, top_1_mask, top_2_mask)
        gates1 = top_1_max_probs[:, None] * top_1_mask
        gates2 = top_2_max_probs[:, None] * top_2_mask
        router_probs = gates1 + gates2
        return top_1_mask, router_probs

    def forward(self, hidden_states):
        self.input_dtype = hidden_states.dtype
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.reshape((batch_size * sequence_length), hidden_dim)
        hidden_states = hidden_states.to(self.dtype)
        router_logits = self.classifier(hidden_states)
        return self.route_tokens(router_logits, self.input_dtype)


# transformers models/nllb_moe :: NllbMoeSparseMLP (moe_token_dropout = 0)
class NllbMoeSparseMLP(nn.Module):
    def __init__(self, hidden_size, ffn_dim, num_experts, expert_capacity=None):
        super().__init__()
        self.router = NllbMoeTop2Router(hidden_size, num_experts, expert_capacity)
        self.num_experts = num_experts
        self.experts = nn.ModuleDict()
        for idx in range(self.num_experts):
            self.experts[f"expert_{idx}"] = NllbMoeDenseActDense(hidden_size, ffn_dim)

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        top_1_mask, router_probs = self.router(hidden_states)
        router_mask = router_probs.bool()
        hidden_states = hidden_states.reshape((batch_size * sequence_length), hidden_dim)
        masked_hidden_states = torch.einsum("bm,be->ebm", hidden_states, router_mask.to(hidden_states.dtype))
        for idx, expert in enumerate(self.experts.values()):
            token_indices = router_mask[:, idx]
            combining_weights = router_probs[token_indices, idx]
            expert_output = expert(masked_hidden_states[idx, token_indices])
            masked_hidden_states[idx, token_indices] = torch.einsum("b,be->be", combining_weights, expert_output)
        hidden_states = masked_hidden_states.sum(dim=0).reshape(batch_size, sequence_length, hidden_dim)
        top_1_expert_index = torch.argmax(top_1_mask, dim=-1)
        return hidden_states, (router_probs, top_1_expert_index)


def make_switch(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(
        lambda: SwitchTransformersSparseMLP(HIDDEN, FFN, EXPERTS, expert_capacity=3), dtype, seed,
        keep_fp32=("router.classifier",),
    )


def make_nllb(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(
        lambda: NllbMoeSparseMLP(HIDDEN, FFN, EXPERTS, expert_capacity=6), dtype, seed,
        keep_fp32=("router.classifier",),
    )


LAYERS = [
    CorpusLayer(
        name="switch_transformers_top1_capacity",
        origin="transformers models/switch_transformers Top1Router (cumsum token priority) + SparseMLP ModuleDict",
        style="capacity",
        make=make_switch,
        input_shape=(2, 16, HIDDEN),
        returns_tuple=True,
    ),
    CorpusLayer(
        name="nllb_moe_top2_capacity",
        origin="transformers models/nllb_moe NllbMoeTop2Router (cumsum locations) + NllbMoeSparseMLP (einsum masking)",
        style="capacity",
        make=make_nllb,
        input_shape=(2, 16, HIDDEN),
        returns_tuple=True,
    ),
]
