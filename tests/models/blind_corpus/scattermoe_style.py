"""ScatterMoE-style MoE (shawntan/scattermoe): flatten_sort_count / padded_block_indices, ParallelExperts with
`scatter2scatter` (grouped_in / grouped_out) and the final `gates @ output_expanded` combine.

scatter2scatter is a Triton kernel; `_scatter2scatter_blocked` re-expresses its block program in torch (each
BLOCK_M block of sorted rows belongs to one expert, rows of the next expert are masked off), and
`_scatter2scatter_offsets` runs the same contraction per expert over host-side offsets.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._registry import EXPERTS, FFN, HIDDEN, CorpusLayer, materialize

BLOCK_M = 8


def flatten_sort_count(expert_idxs: torch.Tensor, num_experts: int):
    with torch.no_grad():
        flattened_expert_idxs = expert_idxs.flatten()
        sorted_expert_idxs, sorted_scattered_idxs = torch.sort(flattened_expert_idxs)
        expert_counts = torch.bincount(flattened_expert_idxs, minlength=num_experts)
        expert_offsets = expert_counts.cumsum(-1)
        return sorted_expert_idxs, sorted_scattered_idxs, expert_offsets


def padded_block_indices(sorted_experts_idxs: torch.Tensor, k: int, N_BLOCK_SIZE: int = BLOCK_M):  # noqa: N803
    expert_counts = torch.bincount(sorted_experts_idxs, minlength=k)
    padded_block_counts = ((expert_counts - 1) // N_BLOCK_SIZE) + 1
    padded_expert_block_end = padded_block_counts.cumsum(-1)
    expert_boundaries_end = expert_counts.cumsum(-1)
    expert_boundaries_start = expert_boundaries_end - expert_counts
    padded_expert_block_start = padded_expert_block_end - padded_block_counts
    block_idxs = torch.arange(
        padded_expert_block_end[-1], dtype=sorted_experts_idxs.dtype, device=sorted_experts_idxs.device
    )
    block_mask = (block_idxs[:, None] < padded_expert_block_start) | (block_idxs[:, None] >= padded_expert_block_end)
    expanded_block_idxs = N_BLOCK_SIZE * (block_idxs[:, None] - padded_expert_block_start) + expert_boundaries_start
    expanded_block_idxs = expanded_block_idxs.masked_fill(block_mask, 0).sum(-1)
    return expanded_block_idxs, expert_boundaries_end


def _scatter2scatter_blocked(X, W, sorted_expert_idxs, sorted_scattered_idxs, k, padded_block_idxs,  # noqa: N803
                             x_grouped=False, y_grouped=False):
    num_experts = W.size(0)
    L_scattered = sorted_expert_idxs.size(0)  # noqa: N806
    M_block = padded_block_idxs[:, None] + torch.arange(BLOCK_M, device=X.device)  # noqa: N806
    in_range = M_block < L_scattered
    M_safe = M_block.clamp(max=L_scattered - 1)  # noqa: N806
    E_idxs = torch.where(in_range, sorted_expert_idxs[M_safe], num_experts)  # noqa: N806
    E_idx = E_idxs.min(dim=1).values  # noqa: N806
    E_mask = E_idxs == E_idx[:, None]  # noqa: N806
    M_idx = torch.where(E_mask, sorted_scattered_idxs[M_safe], 0)  # noqa: N806
    M_in_idx = M_safe if x_grouped else M_idx // k  # noqa: N806
    M_out_idx = torch.where(E_mask, M_safe if y_grouped else M_idx, L_scattered)  # noqa: N806
    x = X[M_in_idx] * E_mask.unsqueeze(-1).to(X.dtype)
    acc = torch.bmm(x, W[E_idx])
    out = X.new_zeros(L_scattered + 1, W.size(-1))
    out = out.index_add(0, M_out_idx.flatten(), acc.flatten(0, 1))
    return out[:-1]


def _scatter2scatter_offsets(X, W, b, sorted_expert_idxs, sorted_scattered_idxs, expert_offsets, k,  # noqa: N803
                             x_grouped=False, y_grouped=False):
    # the `group` kernel (rows in expert order, fan-out k), one matmul per expert span, then ungroup
    grouped_x = X if x_grouped else X[sorted_scattered_idxs // k]
    ends = expert_offsets.tolist()
    starts = [0] + ends[:-1]
    grouped_y = torch.cat([grouped_x[s:e] @ W[i] + b[i] for i, (s, e) in enumerate(zip(starts, ends))], dim=0)
    if y_grouped:
        return grouped_y
    y = torch.empty_like(grouped_y)
    y[sorted_scattered_idxs] = grouped_y
    return y


# scattermoe parallel_experts.py :: ParallelExperts (weight [E, out, in], passed permuted)
class ParallelExperts(nn.Module):
    def __init__(self, num_experts, input_size, output_size, bias=False, blocked=True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, output_size, input_size))
        self.bias = nn.Parameter(torch.empty(num_experts, output_size)) if bias else None
        self.num_experts = num_experts
        self.input_size = input_size
        self.output_size = output_size
        self.blocked = blocked

    def forward(self, inputs, k, sorted_expert_idxs, sorted_scattered_idxs, padded_block_idxs, expert_offsets,
                gates=None, grouped_in=False, grouped_out=False):
        if self.blocked:
            output = _scatter2scatter_blocked(
                inputs, self.weight.permute(0, 2, 1), sorted_expert_idxs, sorted_scattered_idxs, k,
                padded_block_idxs, x_grouped=grouped_in, y_grouped=grouped_out,
            )
        else:
            output = _scatter2scatter_offsets(
                inputs, self.weight.permute(0, 2, 1), self.bias, sorted_expert_idxs, sorted_scattered_idxs,
                expert_offsets, k, x_grouped=grouped_in, y_grouped=grouped_out,
            )
        if gates is not None:
            output_expanded = output.view(gates.size(0), gates.size(1), output.size(-1))
            output = (gates.unsqueeze(1) @ output_expanded).squeeze(1)
        return output


# Follows scattermoe/mlp.py :: GLUMLP (Triton block path, padded_block_indices)
class GLUMLP(nn.Module):
    def __init__(self, input_size, hidden_size, num_experts, top_k, activation=None):
        super().__init__()
        self.num_experts = num_experts
        self.experts = ParallelExperts(num_experts, input_size, 2 * hidden_size)
        self.output_experts = ParallelExperts(num_experts, hidden_size, input_size)
        self.top_k = min(top_k, self.num_experts)
        self.activation = activation if activation is not None else nn.SiLU()

    def forward(self, x, expert_p, expert_idxs):
        x_shape = x.size()
        x = x.view(-1, x_shape[-1])
        with torch.no_grad():
            sorted_expert_idxs, sorted_scattered_idxs = torch.sort(expert_idxs.flatten())
            padded_block_idxs, expert_offsets = padded_block_indices(sorted_expert_idxs, self.num_experts)
        h, gates = self.experts(
            x, self.top_k, sorted_expert_idxs, sorted_scattered_idxs, padded_block_idxs, expert_offsets,
            grouped_out=True,
        ).chunk(2, dim=-1)
        h = self.activation(gates) * h
        y = self.output_experts(
            h, 1, sorted_expert_idxs, sorted_scattered_idxs, padded_block_idxs, expert_offsets,
            grouped_in=True, gates=expert_p,
        )
        return y.view(*x_shape[:-1], y.size(-1))


# Follows scattermoe/mlp.py :: MLP with ParallelExperts(bias=True) and flatten_sort_count offsets
class MLP(nn.Module):
    def __init__(self, input_size, hidden_size, num_experts, top_k, activation=None):
        super().__init__()
        self.num_experts = num_experts
        self.experts = ParallelExperts(num_experts, input_size, hidden_size, bias=True, blocked=False)
        self.output_experts = ParallelExperts(num_experts, hidden_size, input_size, bias=True, blocked=False)
        self.top_k = min(top_k, self.num_experts)
        self.activation = activation if activation is not None else nn.GELU()

    def forward(self, x, expert_p, expert_idxs):
        x_shape = x.size()
        x = x.view(-1, x_shape[-1])
        sorted_expert_idxs, sorted_scattered_idxs, expert_offsets = flatten_sort_count(expert_idxs, self.num_experts)
        h = self.experts(x, self.top_k, sorted_expert_idxs, sorted_scattered_idxs, None, expert_offsets,
                         grouped_out=True)
        h = self.activation(h)
        y = self.output_experts(h, 1, sorted_expert_idxs, sorted_scattered_idxs, None, expert_offsets,
                                grouped_in=True, gates=expert_p)
        return y.view(*x_shape[:-1], y.size(-1))


# Follows scattermoe examples/mixtral/modeling_mixtral.py :: MixtralSparseMoeBlock (gate Linear + moe_mlp)
class ScatterMoEBlock(nn.Module):
    def __init__(self, hidden_dim, ffn_dim, num_experts, top_k, glu=True):
        super().__init__()
        self.hidden_dim = hidden_dim
        self.num_experts = num_experts
        self.top_k = top_k
        self.gate = nn.Linear(hidden_dim, num_experts, bias=False)
        self.moe_mlp = (GLUMLP if glu else MLP)(hidden_dim, ffn_dim, num_experts, top_k)

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final_hidden_states = self.moe_mlp(hidden_states, routing_weights, selected_experts)
        final_hidden_states = final_hidden_states.view(batch_size, sequence_length, hidden_dim)
        return final_hidden_states, router_logits


def make_scatter_glu(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: ScatterMoEBlock(HIDDEN, FFN, EXPERTS, 2, glu=True), dtype, seed)


def make_scatter_mlp(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: ScatterMoEBlock(HIDDEN, FFN, EXPERTS, 2, glu=False), dtype, seed)


LAYERS = [
    CorpusLayer(
        name="scattermoe_glumlp_blocked",
        origin="scattermoe mlp.py GLUMLP + kernels/ops.py padded_block_indices/scatter2scatter (block-masked bmm)",
        style="device_padded",
        make=make_scatter_glu,
        input_shape=(2, 16, HIDDEN),
        returns_tuple=True,
    ),
    CorpusLayer(
        name="scattermoe_mlp_sorted_offsets",
        origin="scattermoe parallel_experts.py flatten_sort_count (sort, bincount, cumsum offsets) + MLP with biases",
        style="host_loop",
        make=make_scatter_mlp,
        input_shape=(2, 16, HIDDEN),
        returns_tuple=True,
    ),
]
