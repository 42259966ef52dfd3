"""Stacked-weight loops from two inference code bases:
- Aria (transformers models/aria AriaTextMoELayer, AriaGroupedExpertsGemm / sequential_experts_gemm): top-k on the
  router logits then softmax over the k, torch.histc counts (ids cast to float), argsort of the flat ids,
  index_select(sorted // k), a loop over experts slicing [start:end] from a cumsum of the host counts and matmul
  against an [E, in, out] weight, index_copy_ unpermute into [T * k, H], weighted sum over k, shared experts.
- vLLM's torch reference for fused_moe (tests/kernels/moe torch_moe): tokens repeated k times with
  .repeat(1, topk, 1), softmax then top-k (no renormalisation), a loop over experts with a boolean mask
  `topk_ids == i`, `if mask.sum():` and masked assignment out[mask] = SiluAndMul(a[mask] @ w1[i].T) @ w2[i].T
  on stacked w1 [E, 2F, H] / w2 [E, H, F], then (out.view(T, k, H) * w.view(T, k, 1)).sum(dim=1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._registry import EXPERTS, FFN, HIDDEN, CorpusLayer, materialize


# -------------------------------------------------------------------------------------------------- Aria
def sequential_experts_gemm(token_states, expert_weights, tokens_per_expert):
    num_tokens = token_states.shape[0]
    out_features = expert_weights.shape[-1]
    output = torch.zeros(num_tokens, out_features, dtype=token_states.dtype, device=token_states.device)
    cumsum_num_tokens = torch.cumsum(tokens_per_expert, dim=0)
    zero_tensor = torch.zeros(1, dtype=torch.long, device=cumsum_num_tokens.device)
    cumsum_num_tokens = torch.cat((zero_tensor, cumsum_num_tokens))
    for expert_num in range(expert_weights.shape[0]):
        start = cumsum_num_tokens[expert_num]
        end = cumsum_num_tokens[expert_num + 1]
        tokens = token_states[start:end]
        out = torch.matmul(tokens, expert_weights[expert_num])
        output[start:end] = out
    return output


class AriaGroupedExpertsGemm(nn.Module):
    def __init__(self, in_features, out_features, groups):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(groups, in_features, out_features))

    def forward(self, inp, tokens_per_expert):
        return sequential_experts_gemm(inp, self.weight, tokens_per_expert.cpu())


class AriaGroupedExpertsMLP(nn.Module):
    def __init__(self, hidden, ffn, num_experts):
        super().__init__()
        self.fc1 = AriaGroupedExpertsGemm(hidden, ffn * 2, num_experts)
        self.fc2 = AriaGroupedExpertsGemm(ffn, hidden, num_experts)

    def forward(self, permuted_tokens, tokens_per_expert):
        fc1_output = self.fc1(permuted_tokens, tokens_per_expert)
        projection, gate = torch.chunk(fc1_output, 2, dim=-1)
        fc1_output = F.silu(projection) * gate
        return self.fc2(fc1_output, tokens_per_expert)


class AriaSharedExpertsMLP(nn.Module):
    def __init__(self, hidden, ffn):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class AriaTextMoELayer(nn.Module):
    def __init__(self, hidden, ffn, num_experts, moe_topk, num_shared):
        super().__init__()
        self.num_experts = num_experts
        self.moe_topk = moe_topk
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = AriaGroupedExpertsMLP(hidden, ffn, num_experts)
        self.shared_experts = AriaSharedExpertsMLP(hidden, ffn * num_shared)

    def forward(self, hidden_states):
        original_shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_states.size(-1))
        logits = self.router(hidden_states)
        top_logits, top_indices = torch.topk(logits, k=self.moe_topk, dim=1)
        scores = F.softmax(top_logits, dim=-1)
        original_dtype = top_indices.dtype
        tokens_per_expert = torch.histc(top_indices.flatten().to(torch.float32), bins=self.num_experts, min=0,
                                        max=self.num_experts - 1).to(original_dtype)
        flatten_indices = top_indices.view(-1)
        sorted_indices = torch.argsort(flatten_indices)
        permuted_tokens = hidden_states.index_select(0, sorted_indices // self.moe_topk)
        expert_output = self.experts(permuted_tokens, tokens_per_expert)
        unpermuted_tokens = torch.zeros((scores.shape[0] * self.moe_topk, expert_output.size(1)),
                                        dtype=expert_output.dtype, device=expert_output.device)
        unpermuted_tokens.index_copy_(0, sorted_indices, expert_output)
        unpermuted_tokens = unpermuted_tokens.view(-1, self.moe_topk, expert_output.size(1))
        output = (unpermuted_tokens * scores.unsqueeze(-1)).sum(dim=1).view(original_shape)
        return output + self.shared_experts(hidden_states.view(original_shape))


# ------------------------------------------------------------------------------------- vLLM torch_moe
class SiluAndMul(nn.Module):
    def forward(self, x):
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


class VllmTorchMoE(nn.Module):
    def __init__(self, hidden, ffn, num_experts, topk):
        super().__init__()
        self.topk = topk
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(num_experts, 2 * ffn, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, ffn))
        self.act = SiluAndMul()

    def forward(self, hidden_states):
        orig_shape = hidden_states.shape
        a = hidden_states.reshape(-1, orig_shape[-1])
        score = self.gate(a)
        B, D = a.shape
        a = a.view(B, -1, D).repeat(1, self.topk, 1).reshape(-1, D)
        out = torch.zeros(B * self.topk, self.w2.shape[1], dtype=a.dtype, device=a.device)
        score = torch.softmax(score, dim=-1, dtype=torch.float32)
        topk_weight, topk_ids = torch.topk(score, self.topk)
        topk_weight = topk_weight.view(-1)
        topk_ids = topk_ids.view(-1)
        for i in range(self.w1.shape[0]):
            mask = topk_ids == i
            if mask.sum():
                out[mask] = self.act(a[mask] @ self.w1[i].transpose(0, 1)) @ self.w2[i].transpose(0, 1)
        out = (out.view(B, -1, self.w2.shape[1]) * topk_weight.view(B, -1, 1).to(out.dtype)).sum(dim=1)
        return out.reshape(orig_shape)


def make_aria(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: AriaTextMoELayer(HIDDEN, FFN, EXPERTS, 2, 1), dtype, seed)


def make_vllm_torch_moe(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: VllmTorchMoE(HIDDEN, FFN, EXPERTS, 2), dtype, seed)


LAYERS = [
    CorpusLayer(
        name="aria_histc_sequential_gemm",
        origin="transformers models/aria AriaTextMoELayer (top-k logits + softmax, histc counts, argsort, "
               "sequential_experts_gemm [start:end] slices of [E, in, out], index_copy_ unpermute, sum over k)",
        style="host_loop",
        make=make_aria,
        input_shape=(2, 16, HIDDEN),
    ),
    CorpusLayer(
        name="vllm_torch_moe_reference_masks",
        origin="vllm tests/kernels/moe torch_moe (repeat(1, topk, 1), softmax-then-topk, boolean-mask assignment "
               "per expert on stacked w1/w2, view(T, k, H) weighted sum)",
        style="host_loop",
        make=make_vllm_torch_moe,
        input_shape=(2, 16, HIDDEN),
    ),
]
