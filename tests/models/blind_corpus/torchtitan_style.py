"""torchtitan MoE: torchtitan/models/moe/moe.py (TokenChoiceTopKRouter with histc counts, TokenReorderer with a
stable argsort, GroupedExperts w1/w2/w3 run with torch._grouped_mm behind indices_padding_wrapper /
generate_permute_indices, or the `_run_experts_for_loop` fallback) and the expert-choice MoE of the llama4
experiments (ExpertChoiceTopKRouter, bmm experts, scatter_add combine).

generate_permute_indices is a Triton kernel in torchtitan (with a CPU reference loop); here it is vectorised.
torch.histc has no integer CPU kernel, so the expert ids are cast to float before it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._registry import EXPERTS, FFN, HIDDEN, CorpusLayer, materialize

TOKEN_GROUP_ALIGN_SIZE_M = 8


def _round_up(x: int, y: int) -> int:
    return ((x + y - 1) // y) * y


def generate_permute_indices(tokens_per_expert_group, experts_per_rank, num_ranks, max_len, alignment):
    start_index_values = torch.cumsum(tokens_per_expert_group, 0) - tokens_per_expert_group
    total_tokens_per_expert = tokens_per_expert_group.view(num_ranks, -1).sum(0)
    total_tokens_per_expert = torch.clamp_min(total_tokens_per_expert, alignment)
    m_sizes = ((total_tokens_per_expert + alignment - 1) // alignment * alignment).to(torch.int32)
    m_offsets = torch.cumsum(m_sizes, 0)
    write_offsets = m_offsets - m_sizes
    # fill_indices (num_ranks == 1): slot j of expert e reads token start_e + j while j < count_e, else -1
    slots = torch.arange(max_len, device=tokens_per_expert_group.device, dtype=m_offsets.dtype)
    slot_expert = torch.searchsorted(m_offsets, slots, right=True)
    e = slot_expert.clamp(max=experts_per_rank - 1)
    rel = slots - write_offsets[e]
    valid = (slot_expert < experts_per_rank) & (rel < tokens_per_expert_group[e])
    permuted_indices = torch.where(valid, start_index_values[e] + rel, -1).to(torch.int32)
    return permuted_indices, m_sizes, m_offsets.to(torch.int32)


def _permute(x, num_tokens_per_expert, ep_degree, num_local_experts):
    x_padded_per_expert = x.shape[0] + num_local_experts * TOKEN_GROUP_ALIGN_SIZE_M
    padded_max_len = _round_up(x_padded_per_expert, TOKEN_GROUP_ALIGN_SIZE_M)
    with torch.no_grad():
        permuted_indices, num_tokens_per_expert, _offsets = generate_permute_indices(
            num_tokens_per_expert, num_local_experts, ep_degree, padded_max_len, TOKEN_GROUP_ALIGN_SIZE_M
        )
    x = torch.vstack((x, x.new_zeros((x.shape[-1]))))
    input_shape = x.shape
    x = x[permuted_indices, :]
    return input_shape, x, permuted_indices, num_tokens_per_expert


def _unpermute(out, input_shape, permuted_indices):
    out_unpermuted = out.new_empty(input_shape)
    out_unpermuted[permuted_indices, :] = out
    return out_unpermuted[:-1]


def indices_padding_wrapper(func):
    def wrapper(w1, w2, w3, x, num_tokens_per_expert):
        num_local_experts = w1.shape[0]
        ep_degree = num_tokens_per_expert.shape[0] // num_local_experts
        input_shape, x, permuted_indices, num_tokens_per_expert = _permute(
            x, num_tokens_per_expert, ep_degree, num_local_experts
        )
        out = func(w1, w2, w3, x, num_tokens_per_expert)
        return _unpermute(out, input_shape, permuted_indices)

    return wrapper


def _run_experts_for_loop(w1, w2, w3, x, num_tokens_per_expert):
    num_tokens_per_expert = num_tokens_per_expert.tolist()
    num_padding = x.shape[0] - sum(num_tokens_per_expert)
    x = torch.split(x[: sum(num_tokens_per_expert)], split_size_or_sections=num_tokens_per_expert, dim=0)
    out_experts_splits = []
    for expert_idx, x_expert in enumerate(x):
        h = F.silu(torch.matmul(x_expert, w1[expert_idx].transpose(-2, -1)))
        h = h * torch.matmul(x_expert, w3[expert_idx].transpose(-2, -1))
        h = torch.matmul(h, w2[expert_idx].transpose(-2, -1))
        out_experts_splits.append(h)
    out = torch.cat(out_experts_splits, dim=0)
    return torch.vstack((out, out.new_zeros((num_padding, out.shape[-1]))))


def _run_experts_grouped_mm(w1, w2, w3, x, num_tokens_per_expert):
    offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
    h = F.silu(torch._grouped_mm(x.bfloat16(), w1.bfloat16().transpose(-2, -1), offs=offsets))
    h = h * torch._grouped_mm(x.bfloat16(), w3.bfloat16().transpose(-2, -1), offs=offsets)
    return torch._grouped_mm(h, w2.bfloat16().transpose(-2, -1), offs=offsets).type_as(x)


# torchtitan models/moe/moe.py :: FeedForward (shared experts)
class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


# torchtitan models/moe/moe.py :: GroupedExperts (w1/w2/w3 [E, ., .])
class GroupedExperts(nn.Module):
    def __init__(self, dim, hidden_dim, num_experts, use_grouped_mm):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.use_grouped_mm = use_grouped_mm

    def forward(self, x, num_tokens_per_expert):
        if self.use_grouped_mm:
            run_experts_fn = indices_padding_wrapper(_run_experts_grouped_mm)
            return run_experts_fn(self.w1, self.w2, self.w3, x, num_tokens_per_expert)
        return _run_experts_for_loop(self.w1, self.w2, self.w3, x, num_tokens_per_expert)


# torchtitan models/moe/moe.py :: TokenChoiceTopKRouter (gather spelled take_along_dim)
class TokenChoiceTopKRouter(nn.Module):
    def __init__(self, dim, num_experts, top_k, score_func, route_norm, route_scale):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.num_experts = num_experts
        self.top_k = top_k
        self.score_func = score_func
        self.route_norm = route_norm
        self.route_scale = route_scale

    def forward(self, x, expert_bias=None):
        scores = self.gate(x)
        if self.score_func == "sigmoid":
            scores = torch.sigmoid(scores.to(torch.float32))
        else:
            scores = F.softmax(scores.to(torch.float32), dim=1)
        if expert_bias is not None:
            _, selected_experts_indices = torch.topk(scores + expert_bias, k=self.top_k, dim=1)
            top_scores = torch.take_along_dim(scores, selected_experts_indices, dim=1)
        else:
            top_scores, selected_experts_indices = torch.topk(scores, k=self.top_k, dim=1)
        if self.route_norm:
            denominator = top_scores.sum(dim=-1, keepdim=True) + 1e-20
            top_scores = top_scores / denominator
        top_scores = top_scores * self.route_scale
        num_tokens_per_expert = torch.histc(
            selected_experts_indices.view(-1).to(torch.float32), bins=self.num_experts, min=0, max=self.num_experts
        )
        return top_scores, selected_experts_indices, num_tokens_per_expert


# torchtitan models/moe/moe.py :: TokenReorderer
class TokenReorderer(nn.Module):
    def __init__(self, num_experts, top_k):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k

    def forward(self, top_scores, selected_experts_indices):
        num_tokens_per_expert = torch.histc(
            selected_experts_indices.view(-1).to(torch.float32), bins=self.num_experts, min=0, max=self.num_experts
        ).to(torch.int64)
        token_indices_experts_sorted = torch.argsort(selected_experts_indices.view(-1), stable=True)
        top_scores_experts_sorted = top_scores.view(-1)[token_indices_experts_sorted]
        token_indices_experts_sorted = token_indices_experts_sorted // self.top_k
        return top_scores_experts_sorted, token_indices_experts_sorted, num_tokens_per_expert


# torchtitan models/moe/moe.py :: MoE.forward (expert_bias / tokens_per_expert buffers)
class MoE(nn.Module):
    def __init__(self, dim, hidden_dim, num_experts, top_k, score_func, route_norm, route_scale, num_shared_experts,
                 use_grouped_mm, score_before_experts, load_balance_coeff=1e-3):
        super().__init__()
        self.experts = GroupedExperts(dim, hidden_dim, num_experts, use_grouped_mm)
        self.router = TokenChoiceTopKRouter(dim, num_experts, top_k, score_func, route_norm, route_scale)
        self.reorderer = TokenReorderer(num_experts, top_k)
        self.shared_experts = FeedForward(dim, hidden_dim * num_shared_experts) if num_shared_experts > 0 else None
        self.score_before_experts = score_before_experts
        self.load_balance_coeff = load_balance_coeff
        if load_balance_coeff is not None:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32), persistent=True)
        else:
            self.expert_bias = None
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.float32), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        top_scores, selected_experts_indices, num_tokens_per_expert = self.router(x, self.expert_bias)
        with torch.no_grad():
            self.tokens_per_expert.add_(num_tokens_per_expert)
        top_scores_experts_sorted, token_indices_experts_sorted, num_tokens_per_expert = self.reorderer(
            top_scores, selected_experts_indices
        )
        token_indices_experts_sorted = token_indices_experts_sorted.reshape(-1, 1).expand(-1, dim)
        routed_input = torch.gather(x, dim=0, index=token_indices_experts_sorted)
        if self.score_before_experts:
            routed_input = (routed_input.to(torch.float32) * top_scores_experts_sorted.reshape(-1, 1)).to(x.dtype)
        routed_output = self.experts(routed_input, num_tokens_per_expert)
        if self.shared_experts is not None:
            out = self.shared_experts(x)
        else:
            out = torch.zeros_like(x)
        if not self.score_before_experts:
            routed_output = (routed_output.to(torch.float32) * top_scores_experts_sorted.reshape(-1, 1)).to(x.dtype)
        out = out.scatter_add(dim=0, index=token_indices_experts_sorted, src=routed_output)
        return out.reshape(bs, slen, dim)


# ---------------------------------------------------------------- expert choice (llama4 experiments)
class ExpertChoiceGroupedExperts(nn.Module):
    def __init__(self, dim_in, dim_out, num_experts):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(num_experts, dim_in, dim_out))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim_out, dim_in))
        self.up_proj = nn.Parameter(torch.empty(num_experts, dim_in, dim_out))
        self.act_fn = F.silu

    def forward(self, x):
        h = self.act_fn(torch.bmm(x, self.gate_proj))
        h = h * torch.bmm(x, self.up_proj)
        return torch.bmm(h, self.down_proj)


# torchtitan llama4 experiments :: ExpertChoiceTopKRouter
class ExpertChoiceTopKRouter(nn.Module):
    def __init__(self, gate, dim, num_experts, capacity_factor, use_sigmoid=True):
        super().__init__()
        self.gate = gate
        self.dim = dim
        self.num_experts = num_experts
        self.capacity_factor = capacity_factor
        self.use_sigmoid = use_sigmoid

    def forward(self, x):
        scores = self.gate(x).transpose(0, 1)
        if self.use_sigmoid:
            scores = torch.sigmoid(scores.to(torch.float32)).to(x.dtype)
        else:
            scores = F.softmax(scores.to(torch.float32), dim=0).to(x.dtype)
        tokens_per_expert = int(x.shape[0] * self.capacity_factor / self.num_experts)
        tokens_per_expert += -tokens_per_expert % 8
        tokens_per_expert = min(tokens_per_expert, x.shape[0])
        top_scores, selected_token_indices = torch.topk(scores, k=tokens_per_expert, dim=1)
        return top_scores, selected_token_indices


# torchtitan llama4 experiments :: MoE.forward for expert choice (shared expert + scatter_add)
class ExpertChoiceMoE(nn.Module):
    def __init__(self, dim, hidden_dim, num_experts, capacity_factor):
        super().__init__()
        self.experts = ExpertChoiceGroupedExperts(dim, hidden_dim, num_experts)
        self.router = ExpertChoiceTopKRouter(nn.Linear(dim, num_experts, bias=False), dim, num_experts,
                                             capacity_factor)
        self.shared_expert = FeedForward(dim, hidden_dim)

    def forward(self, x):
        bz, slen, dim = x.shape
        x = x.reshape(bz * slen, dim)
        top_scores, selected_token_indices = self.router(x)
        num_experts, _ = top_scores.shape
        token_indices = selected_token_indices.reshape(-1, 1).expand(-1, dim)
        routed_input = torch.gather(x, dim=0, index=token_indices)
        routed_input = routed_input * top_scores.reshape(-1, 1)
        routed_input = routed_input.reshape(num_experts, -1, dim)
        routed_output = self.experts(routed_input)
        routed_output = routed_output.reshape(-1, dim)
        out = self.shared_expert(x.reshape(1, bz * slen, dim)).reshape(bz * slen, dim)
        out = out.scatter_add(dim=0, index=token_indices, src=routed_output)
        return out.reshape(bz, slen, dim)


def _with_expert_bias(module: nn.Module, seed: int) -> nn.Module:
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        module.expert_bias.copy_((torch.rand(module.expert_bias.shape, generator=gen) - 0.5) * 0.1)
    return module


def make_tt_grouped(dtype: torch.dtype, seed: int) -> nn.Module:
    module = materialize(
        lambda: MoE(HIDDEN, FFN, EXPERTS, 2, "sigmoid", True, 1.0, 1, use_grouped_mm=True,
                    score_before_experts=False),
        dtype,
        seed,
    )
    return _with_expert_bias(module, seed)


def make_tt_loop(dtype: torch.dtype, seed: int) -> nn.Module:
    module = materialize(
        lambda: MoE(HIDDEN, FFN, EXPERTS, 1, "softmax", False, 1.0, 0, use_grouped_mm=False,
                    score_before_experts=True),
        dtype,
        seed,
    )
    return _with_expert_bias(module, seed)


def make_tt_expert_choice(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: ExpertChoiceMoE(HIDDEN, FFN, EXPERTS, capacity_factor=1.0), dtype, seed)


LAYERS = [
    CorpusLayer(
        name="torchtitan_grouped_mm_padded",
        origin="torchtitan models/moe/moe.py MoE (histc, argsort stable, gather) + indices_padding_wrapper/_grouped_mm",
        style="device_padded",
        make=make_tt_grouped,
        input_shape=(2, 16, HIDDEN),
    ),
    CorpusLayer(
        name="torchtitan_for_loop_experts",
        origin="torchtitan models/moe/moe.py _run_experts_for_loop (tolist, split), top-1, scores before experts",
        style="host_loop",
        make=make_tt_loop,
        input_shape=(2, 16, HIDDEN),
    ),
    CorpusLayer(
        name="torchtitan_expert_choice",
        origin="torchtitan llama4 experiments ExpertChoiceTopKRouter (topk over tokens) + bmm experts + scatter_add",
        style="expert_choice",
        make=make_tt_expert_choice,
        input_shape=(2, 16, HIDDEN),
    ),
]
