"""vLLM fused-MoE paths for a Mixtral-style block (w13_weight [E, 2I, H], w2_weight [E, H, I], fused_topk):
- fused_moe/fused_moe.py: moe_align_block_size + fused_experts (two invoke_fused_moe_kernel calls, silu_and_mul,
  moe_sum). The CUDA/Triton kernels are re-expressed: a counting-sort alignment into BLOCK_SIZE_M blocks with a
  per-block expert id, then a per-block bmm against that block's expert weights; padded rows are masked.
- fused_moe/moe_torch_iterative.py: the CPU/TPU fallback that runs every expert on every token.
- fused_moe/moe_pallas.py: repeat_interleave + argsort + one-hot histogram, grouped GEMM (torch._grouped_mm standing
  in for torch.ops.xla.gmm), then the revert argsort.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._registry import EXPERTS, FFN, HIDDEN, CorpusLayer, materialize

BLOCK_SIZE_M = 8


def fused_topk(hidden_states, gating_output, topk, renormalize):
    topk_weights = torch.softmax(gating_output.float(), dim=-1)
    topk_weights, topk_ids = torch.topk(topk_weights, topk, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def moe_align_block_size(topk_ids, block_size, num_experts):
    numel = topk_ids.numel()
    max_num_tokens_padded = numel + num_experts * (block_size - 1)
    max_num_m_blocks = -(max_num_tokens_padded // -block_size)
    max_num_tokens_padded = max_num_m_blocks * block_size  # round up so sorted_ids splits into whole blocks
    flat_ids = topk_ids.flatten()
    one_hot = F.one_hot(flat_ids, num_experts)
    tokens_cnts = one_hot.sum(dim=0)
    padded_cnts = (tokens_cnts + block_size - 1) // block_size * block_size
    cumsum = torch.cumsum(padded_cnts, dim=0)
    expert_starts = cumsum - padded_cnts
    rank_in_expert = (torch.cumsum(one_hot, dim=0) - 1).gather(1, flat_ids.unsqueeze(1)).squeeze(1)
    sorted_ids = torch.full((max_num_tokens_padded,), numel, dtype=torch.int32, device=topk_ids.device)
    sorted_ids = sorted_ids.scatter(
        0, expert_starts[flat_ids] + rank_in_expert, torch.arange(numel, dtype=torch.int32, device=topk_ids.device)
    )
    block_starts = torch.arange(max_num_m_blocks, device=topk_ids.device) * block_size
    expert_ids = torch.searchsorted(cumsum, block_starts, right=True).clamp(max=num_experts - 1).to(torch.int32)
    num_tokens_post_pad = cumsum[-1:].to(torch.int32)
    return sorted_ids, expert_ids, num_tokens_post_pad


def invoke_fused_moe_kernel(A, B, topk_weights, sorted_token_ids, expert_ids, mul_routed_weight, top_k,  # noqa: N803
                            num_valid_tokens, block_size):
    # one "program" per BLOCK_SIZE_M rows of sorted_token_ids: C[tok] = A[tok // top_k] @ B[expert].T (* weight)
    offs_token = sorted_token_ids.view(-1, block_size).long()
    token_mask = offs_token < num_valid_tokens
    a = A[torch.where(token_mask, offs_token // top_k, 0)] * token_mask.unsqueeze(-1).to(A.dtype)
    b = B[expert_ids.long()]
    accumulator = torch.bmm(a, b.transpose(1, 2))
    if mul_routed_weight:
        moe_weight = topk_weights.flatten()[offs_token.clamp(max=num_valid_tokens - 1)]
        accumulator = accumulator * moe_weight.unsqueeze(-1).to(accumulator.dtype)
    c = A.new_zeros(num_valid_tokens + 1, B.size(1))
    dest = torch.where(token_mask, offs_token, num_valid_tokens).flatten()
    return c.index_add(0, dest, accumulator.flatten(0, 1))[:-1]


def fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, block_size=BLOCK_SIZE_M):
    num_tokens, _ = hidden_states.shape
    E, N, _ = w1.shape  # noqa: N806
    top_k_num = topk_ids.shape[1]
    sorted_token_ids, expert_ids, num_tokens_post_padded = moe_align_block_size(topk_ids, block_size, E)
    num_valid_tokens = topk_ids.numel()
    intermediate_cache1 = invoke_fused_moe_kernel(
        hidden_states, w1, topk_weights, sorted_token_ids, expert_ids, False, top_k_num, num_valid_tokens, block_size
    )
    d = N // 2
    intermediate_cache2 = F.silu(intermediate_cache1[:, :d]) * intermediate_cache1[:, d:]  # silu_and_mul
    intermediate_cache3 = invoke_fused_moe_kernel(
        intermediate_cache2, w2, topk_weights, sorted_token_ids, expert_ids, True, 1, num_valid_tokens, block_size
    )
    return intermediate_cache3.view(num_tokens, top_k_num, -1).sum(dim=1)  # moe_sum


def torch_iterative_fused_moe(hidden_states, w1, w2, gating_output, topk, global_num_experts, renormalize=False):
    orig_shape = hidden_states.shape
    hidden_size = hidden_states.shape[-1]
    num_tokens = hidden_states.shape[:-1].numel()
    dtype = hidden_states.dtype
    intermediate_size = w2.shape[-1]
    hidden_states = hidden_states.view(num_tokens, hidden_size)
    gating_output = gating_output.view(num_tokens, global_num_experts)
    topk_weights = gating_output.softmax(dim=-1, dtype=torch.float)
    topk_weights, selected_experts = topk_weights.topk(topk, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    topk_weights = topk_weights.to(dtype)
    final_hidden_states = None
    for expert_idx in range(global_num_experts):
        expert_w1 = w1[expert_idx]
        expert_w2 = w2[expert_idx]
        expert_mask = selected_experts == expert_idx
        expert_weights = (topk_weights * expert_mask).sum(dim=-1, keepdim=True)
        x = F.linear(hidden_states, expert_w1)
        gate = F.silu(x[:, :intermediate_size])
        x = x[:, intermediate_size:] * gate
        x = F.linear(x, expert_w2)
        current_hidden_states = x * expert_weights
        if final_hidden_states is None:
            final_hidden_states = current_hidden_states
        else:
            final_hidden_states = final_hidden_states + current_hidden_states
    return final_hidden_states.view(orig_shape)


def _histogram(input: torch.Tensor, min: int, max: int) -> torch.Tensor:  # noqa: A002
    assert input.dtype == torch.int32
    bin_indices = torch.arange(min, max + 1, device=input.device, dtype=input.dtype)
    return (input.unsqueeze(-1) == bin_indices).sum(dim=0, dtype=torch.int32)


def pallas_fused_moe(hidden_states, w1, w2, gating_output, topk, renormalize):
    orig_shape = hidden_states.shape
    hidden_size = hidden_states.shape[-1]
    num_tokens = hidden_states.shape[:-1].numel()
    num_experts = w1.shape[0]
    intermediate_size = w2.shape[-1]
    device = hidden_states.device
    dtype = hidden_states.dtype
    hidden_states = hidden_states.view(num_tokens, hidden_size)
    gating_output = gating_output.view(num_tokens, num_experts)
    topk_weights = gating_output.softmax(dim=-1)
    topk_weights, topk_indices = topk_weights.topk(topk, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    topk_weights = topk_weights.to(dtype)
    topk_indices = topk_indices.flatten()
    topk_argsort_indices = topk_indices.argsort()
    topk_argsort_revert_indices = topk_argsort_indices.argsort()
    token_indices = torch.arange(num_tokens, device=device).repeat_interleave(topk)
    token_indices = token_indices[topk_argsort_indices]
    group_sizes = _histogram(topk_indices.to(torch.int32), 0, num_experts - 1)
    offs = torch.cumsum(group_sizes, dim=0, dtype=torch.int32)
    x = hidden_states[token_indices]
    # torch.ops.xla.gmm(x, w, group_sizes, transpose_rhs=True); bf16 so that CPU _grouped_mm also compiles
    x = torch._grouped_mm(x.bfloat16(), w1.bfloat16().transpose(1, 2), offs=offs).to(dtype)
    x = F.silu(x[..., :intermediate_size]) * x[..., intermediate_size:]
    x = torch._grouped_mm(x.bfloat16(), w2.bfloat16().transpose(1, 2), offs=offs).to(dtype)
    x = x[topk_argsort_revert_indices].reshape(-1, topk, hidden_size)
    x = x * topk_weights.unsqueeze(dim=-1)
    x = x.sum(dim=-2)
    return x.reshape(orig_shape)


class FusedMoE(nn.Module):
    # vllm model_executor/layers/fused_moe/layer.py FusedMoE parameters: w13_weight / w2_weight
    def __init__(self, num_experts, top_k, hidden_size, intermediate_size, backend, renormalize=True):
        super().__init__()
        self.global_num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.backend = backend
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, hidden_states, router_logits):
        if self.backend == "triton":
            topk_weights, topk_ids = fused_topk(hidden_states, router_logits, self.top_k, self.renormalize)
            return fused_experts(hidden_states, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        if self.backend == "torch_iterative":
            return torch_iterative_fused_moe(hidden_states, self.w13_weight, self.w2_weight, router_logits,
                                             self.top_k, self.global_num_experts, self.renormalize)
        return pallas_fused_moe(hidden_states, self.w13_weight, self.w2_weight, router_logits, self.top_k,
                                self.renormalize)


# Follows vllm model_executor/models/mixtral.py :: MixtralMoE (gate = ReplicatedLinear, experts = FusedMoE)
class MixtralMoE(nn.Module):
    def __init__(self, num_experts, top_k, hidden_size, intermediate_size, backend, renormalize=True):
        super().__init__()
        self.hidden_size = hidden_size
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, backend, renormalize)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        orig_shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, self.hidden_size)
        router_logits = self.gate(hidden_states)
        final_hidden_states = self.experts(hidden_states, router_logits)
        return final_hidden_states.view(orig_shape)


def make_vllm_triton(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: MixtralMoE(EXPERTS, 2, HIDDEN, FFN, "triton"), dtype, seed)


def make_vllm_iterative(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: MixtralMoE(4, 1, HIDDEN, FFN, "torch_iterative", renormalize=False), dtype, seed)


def make_vllm_pallas(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: MixtralMoE(EXPERTS, 2, HIDDEN, FFN, "pallas"), dtype, seed)


LAYERS = [
    CorpusLayer(
        name="vllm_moe_align_block_size",
        origin="vLLM fused_moe.py moe_align_block_size + fused_experts (block expert_ids, silu_and_mul, moe_sum)",
        style="device_padded",
        make=make_vllm_triton,
        input_shape=(32, HIDDEN),
    ),
    CorpusLayer(
        name="vllm_torch_iterative_dense",
        origin="vLLM fused_moe/moe_torch_iterative.py fused_moe (every expert on every token, masked weights), top-1",
        style="onehot_dense",
        make=make_vllm_iterative,
        input_shape=(2, 16, HIDDEN),
    ),
    CorpusLayer(
        name="vllm_pallas_gmm",
        origin="vLLM fused_moe/moe_pallas.py fused_moe (repeat_interleave, argsort twice, one-hot histogram, gmm)",
        style="sort",
        make=make_vllm_pallas,
        input_shape=(32, HIDDEN),
    ),
]
