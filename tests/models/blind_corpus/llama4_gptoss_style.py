"""Dense-dispatch MoE blocks from transformers:
- models/llama4 Llama4TextMoe: top-k on router logits, scores scattered into a -inf tensor and passed through a
  sigmoid, every token replicated to every expert (gather with expanded indices), scores applied *before* the
  experts, Llama4TextExperts bmm over [E, T, H], shared expert + scatter_add_ combine.
- models/gpt_oss GptOssMLP: GptOssTopKRouter (Linear with bias, top-k on logits then softmax, scores scattered into
  [T, E]) and GptOssExperts (interleaved gate/up columns, clamped SwiGLU with alpha, biases), either the training
  loop over hit experts or the inference path that runs all experts with bmm and weights them by the dense scores.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._registry import EXPERTS, FFN, HIDDEN, CorpusLayer, materialize


# transformers models/llama4 :: Llama4TextExperts (gate_up_proj [E, H, 2I], bmm)
class Llama4TextExperts(nn.Module):
    def __init__(self, num_experts, hidden_size, expert_dim):
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.expert_dim = expert_dim
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_size, 2 * self.expert_dim))
        self.down_proj = nn.Parameter(torch.empty((self.num_experts, self.expert_dim, self.hidden_size)))
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states.view(self.num_experts, -1, self.hidden_size)
        gate_up = torch.bmm(hidden_states, self.gate_up_proj)
        gate, up = gate_up.chunk(2, dim=-1)
        next_states = torch.bmm((up * self.act_fn(gate)), self.down_proj)
        return next_states.view(-1, self.hidden_size)


# transformers models/llama4 :: Llama4TextMLP (the shared expert)
class Llama4TextMLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.activation_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.activation_fn(self.gate_proj(x)) * self.up_proj(x))


# transformers models/llama4 :: Llama4TextMoe.forward
class Llama4TextMoe(nn.Module):
    def __init__(self, hidden_size, intermediate_size, num_experts, top_k):
        super().__init__()
        self.top_k = top_k
        self.hidden_dim = hidden_size
        self.num_experts = num_experts
        self.experts = Llama4TextExperts(num_experts, hidden_size, intermediate_size)
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        self.shared_expert = Llama4TextMLP(hidden_size, intermediate_size)

    def forward(self, hidden_states):
        batch, seq_len, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, self.hidden_dim)
        router_logits = self.router(hidden_states).transpose(0, 1)
        tokens_per_expert = batch * seq_len
        router_top_value, router_indices = torch.topk(router_logits.transpose(0, 1), self.top_k, dim=1)
        router_scores = (
            torch.full_like(router_logits.transpose(0, 1), float("-inf"))
            .scatter_(1, router_indices, router_top_value)
            .transpose(0, 1)
        )
        router_indices = (
            torch.arange(tokens_per_expert, device=hidden_states.device).view(1, -1).expand(router_scores.size(0), -1)
        )
        router_scores = torch.sigmoid(router_scores.float()).to(hidden_states.dtype)
        router_indices = router_indices.reshape(-1, 1).expand(-1, hidden_dim)
        routed_in = torch.gather(input=hidden_states, dim=0, index=router_indices).to(hidden_states.device)
        routed_in = routed_in * router_scores.reshape(-1, 1)
        routed_out = self.experts(routed_in)
        out = self.shared_expert(hidden_states)
        out.scatter_add_(dim=0, index=router_indices, src=routed_out.view(-1, hidden_dim))
        return out.view(batch, seq_len, hidden_dim), router_scores


# transformers models/gpt_oss :: GptOssTopKRouter
class GptOssTopKRouter(nn.Module):
    def __init__(self, hidden_size, num_experts, top_k):
        super().__init__()
        self.top_k = top_k
        self.num_experts = num_experts
        self.hidden_dim = hidden_size
        self.weight = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim))
        self.bias = nn.Parameter(torch.empty(self.num_experts))

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states, self.weight, self.bias)
        router_top_value, router_indices = torch.topk(router_logits, self.top_k, dim=-1)
        router_top_value = F.softmax(router_top_value, dim=1, dtype=router_top_value.dtype)
        router_scores = torch.zeros_like(router_logits).scatter_(1, router_indices, router_top_value)
        return router_scores, router_indices


# transformers models/gpt_oss :: GptOssExperts (training loop or inference bmm path)
class GptOssExperts(nn.Module):
    def __init__(self, num_experts, hidden_size, expert_dim, dense_path):
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.expert_dim = expert_dim
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_size, 2 * self.expert_dim))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(self.num_experts, 2 * self.expert_dim))
        self.down_proj = nn.Parameter(torch.empty((self.num_experts, self.expert_dim, self.hidden_size)))
        self.down_proj_bias = nn.Parameter(torch.empty(self.num_experts, self.hidden_size))
        self.alpha = 1.702
        self.limit = 7.0
        self.dense_path = dense_path

    def forward(self, hidden_states, router_indices=None, routing_weights=None):
        batch_size = hidden_states.shape[0]
        hidden_states = hidden_states.reshape(-1, self.hidden_size)
        num_experts = routing_weights.shape[1]
        if not self.dense_path:
            next_states = torch.zeros_like(hidden_states, dtype=hidden_states.dtype, device=hidden_states.device)
            with torch.no_grad():
                expert_mask = F.one_hot(router_indices, num_classes=num_experts)
                expert_mask = expert_mask.permute(2, 1, 0)
                expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
            for expert_idx in expert_hit[:]:
                expert_idx = expert_idx[0]
                with torch.no_grad():
                    _, token_idx = torch.where(expert_mask[expert_idx])
                current_state = hidden_states[token_idx]
                gate_up = current_state @ self.gate_up_proj[expert_idx] + self.gate_up_proj_bias[expert_idx]
                gate, up = gate_up[..., ::2], gate_up[..., 1::2]
                gate = gate.clamp(min=None, max=self.limit)
                up = up.clamp(min=-self.limit, max=self.limit)
                glu = gate * torch.sigmoid(gate * self.alpha)
                gated_output = (up + 1) * glu
                out = gated_output @ self.down_proj[expert_idx] + self.down_proj_bias[expert_idx]
                weighted_output = out * routing_weights[token_idx, expert_idx, None]
                next_states.index_add_(0, token_idx, weighted_output.to(hidden_states.dtype))
            return next_states.view(batch_size, -1, self.hidden_size)
        hidden_states = hidden_states.repeat(num_experts, 1)
        hidden_states = hidden_states.view(num_experts, -1, self.hidden_size)
        gate_up = torch.bmm(hidden_states, self.gate_up_proj) + self.gate_up_proj_bias[..., None, :]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        next_states = torch.bmm(((up + 1) * glu), self.down_proj)
        next_states = next_states + self.down_proj_bias[..., None, :]
        next_states = next_states.view(num_experts, batch_size, -1, self.hidden_size)
        next_states = next_states * routing_weights.transpose(0, 1).view(num_experts, batch_size, -1)[..., None]
        return next_states.sum(dim=0)


# transformers models/gpt_oss :: GptOssMLP
class GptOssMLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size, num_experts, top_k, dense_path):
        super().__init__()
        self.router = GptOssTopKRouter(hidden_size, num_experts, top_k)
        self.experts = GptOssExperts(num_experts, hidden_size, intermediate_size, dense_path)

    def forward(self, hidden_states):
        router_scores, router_indices = self.router(hidden_states)
        routed_out = self.experts(hidden_states, router_indices=router_indices, routing_weights=router_scores)
        return routed_out, router_scores


def make_llama4(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: Llama4TextMoe(HIDDEN, FFN, EXPERTS, 1), dtype, seed)


def make_gptoss_loop(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: GptOssMLP(HIDDEN, FFN, EXPERTS, 2, dense_path=False), dtype, seed)


def make_gptoss_dense(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: GptOssMLP(HIDDEN, FFN, 4, 2, dense_path=True), dtype, seed)


LAYERS = [
    CorpusLayer(
        name="llama4_text_moe_dense_sigmoid",
        origin="transformers models/llama4 Llama4TextMoe (-inf scatter + sigmoid, all-expert bmm, scatter_add_ shared)",
        style="onehot_dense",
        make=make_llama4,
        input_shape=(2, 16, HIDDEN),
        returns_tuple=True,
    ),
    CorpusLayer(
        name="gpt_oss_experts_train_loop",
        origin="transformers models/gpt_oss GptOssTopKRouter + GptOssExperts training loop (expert_hit, ::2 / 1::2)",
        style="host_loop",
        make=make_gptoss_loop,
        input_shape=(2, 16, HIDDEN),
        returns_tuple=True,
    ),
    CorpusLayer(
        name="gpt_oss_experts_dense_bmm",
        origin="transformers models/gpt_oss GptOssExperts inference path (repeat to all experts, bmm, dense scores)",
        style="onehot_dense",
        make=make_gptoss_dense,
        input_shape=(2, 16, HIDDEN),
        returns_tuple=True,
    ),
]
