"""MegaBlocks-style MoE: megablocks/layers/moe.py (ParallelMLP, binned gather/scatter with capacity),
layers/dmoe.py (dropless: padded gather to a block multiple, block-sparse expert MLP) and the grouped-GEMM path.

MegaBlocks' ops (sort, histogram, binned_gather, padded_gather, ...) are CUDA kernels; each is re-expressed here
in plain torch following the semantics of its reference test (megablocks/ops/*_test.py).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from ._registry import EXPERTS, FFN, HIDDEN, CorpusLayer, materialize

DEFAULT_ACTIVATION_FN = functools.partial(F.gelu, approximate="tanh")


# torch re-expressions of megablocks.ops (CUDA kernels), semantics from megablocks/ops/*_test.py
class ops:  # noqa: N801 - mirrors `import megablocks.ops as ops`
    @staticmethod
    def sort(x: torch.Tensor, end_bit: int | None = None):
        # radix sort on the expert ids: stable, returns (sorted values, permutation)
        return torch.sort(x, stable=True)

    @staticmethod
    def histogram(x: torch.Tensor, max_val: int) -> torch.Tensor:
        ones = torch.ones_like(x, dtype=torch.int32)
        return torch.zeros(max_val, dtype=torch.int32, device=x.device).scatter_add_(0, x.long(), ones)

    @staticmethod
    def inclusive_cumsum(x: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.cumsum(x, dim, dtype=torch.int32)

    @staticmethod
    def round_up(x: torch.Tensor, value: int) -> torch.Tensor:
        return torch.div(x + (value - 1), value, rounding_mode="floor") * value

    @staticmethod
    def binned_gather(x, indices, bins, bin_size, top_k):
        # out[e, j] = x[indices[start_e + j] // top_k] for j < min(bin_size, count_e); zeros elsewhere
        num_experts = bins.numel()
        positions = torch.arange(indices.numel(), device=x.device, dtype=bins.dtype)
        bin_ids = torch.searchsorted(bins, positions, right=True)
        bin_starts = F.pad(bins[:-1], (1, 0))
        offset = positions - bin_starts[bin_ids]
        dest = torch.where(offset < bin_size, bin_ids * bin_size + offset, num_experts * bin_size)
        out = x.new_zeros(num_experts * bin_size + 1, x.shape[-1])
        out = out.index_add(0, dest, x[indices // top_k])
        return out[:-1].view(num_experts, bin_size, x.shape[-1])

    @staticmethod
    def binned_scatter(x, indices, weights, bins, top_k):
        # inverse of binned_gather, scaled by the routing weight; dropped slots contribute zeros
        num_experts, bin_size, hidden = x.shape
        positions = torch.arange(indices.numel(), device=x.device, dtype=bins.dtype)
        bin_ids = torch.searchsorted(bins, positions, right=True)
        bin_starts = F.pad(bins[:-1], (1, 0))
        offset = positions - bin_starts[bin_ids]
        src_rows = torch.where(offset < bin_size, bin_ids * bin_size + offset, num_experts * bin_size)
        flat = torch.cat([x.reshape(-1, hidden), x.new_zeros(1, hidden)], dim=0)
        src = flat[src_rows] * weights[indices].unsqueeze(-1).to(x.dtype)
        out = x.new_zeros(indices.numel(), hidden)
        out = out.scatter(0, indices.long().unsqueeze(-1).expand(-1, hidden), src)
        return out.view(-1, top_k, hidden).sum(dim=1)

    @staticmethod
    def padded_gather(x, indices, bin_ids, bins, padded_bins, top_k):
        # rows of expert e land at padded_bins[e-1] + j; the padding rows stay zero
        positions = torch.arange(indices.numel(), device=x.device, dtype=bins.dtype)
        bin_starts = F.pad(bins[:-1], (1, 0))
        padded_starts = F.pad(padded_bins[:-1], (1, 0))
        dest = padded_starts[bin_ids] + (positions - bin_starts[bin_ids])
        out = x.new_zeros(int(padded_bins[-1]), x.shape[-1])
        return out.index_copy(0, dest.long(), x[indices // top_k])

    @staticmethod
    def padded_scatter(x, indices, bin_ids, weights, bins, padded_bins, top_k):
        positions = torch.arange(indices.numel(), device=x.device, dtype=bins.dtype)
        bin_starts = F.pad(bins[:-1], (1, 0))
        padded_starts = F.pad(padded_bins[:-1], (1, 0))
        src = x[padded_starts[bin_ids] + (positions - bin_starts[bin_ids])]
        src = src * weights[indices].unsqueeze(-1).to(x.dtype)
        out = x.new_zeros(indices.numel() // top_k, x.shape[-1])
        return out.index_add(0, indices // top_k, src)

    @staticmethod
    def gather(x, indices, bin_ids, bins, top_k):
        return x[indices // top_k]

    @staticmethod
    def scatter(x, indices, bin_ids, weights, bins, top_k):
        out = x.new_zeros(indices.numel() // top_k, x.shape[-1])
        src = x * weights[indices].unsqueeze(-1).to(x.dtype)
        return out.index_put_((indices // top_k,), src, accumulate=True)


class LearnedRouter(nn.Module):
    # megablocks/layers/router.py
    def __init__(self, hidden_size, moe_num_experts, moe_top_k, moe_normalize_expert_weights=None):
        super().__init__()
        self.layer = nn.Linear(hidden_size, moe_num_experts, bias=False)
        self.moe_top_k = moe_top_k
        self.moe_normalize_expert_weights = moe_normalize_expert_weights

    def _top_k(self, scores):
        if self.moe_top_k == 1:
            return scores.max(dim=-1, keepdim=True)
        return torch.topk(scores, self.moe_top_k, dim=-1)

    def forward(self, x):
        scores = self.layer(x.view(-1, x.shape[-1])).softmax(dim=-1)
        expert_weights, expert_indices = self._top_k(scores)
        if self.moe_normalize_expert_weights:
            expert_weights = expert_weights / torch.norm(
                expert_weights, p=self.moe_normalize_expert_weights, dim=-1, keepdim=True
            )
        return scores, expert_weights, expert_indices


class MLP(nn.Module):
    # megablocks/layers/mlp.py MLP: w1 [E, hidden, ffn], w2 [E, ffn, hidden], bmm over the expert dim
    def __init__(self, hidden_size, ffn_hidden_size, num_experts):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size))

    def forward(self, x):
        return torch.bmm(DEFAULT_ACTIVATION_FN(torch.bmm(x, self.w1)), self.w2)


# Follows megablocks/layers/moe.py :: ParallelMLP / MoE (no expert model parallelism)
class MoE(nn.Module):
    def __init__(self, hidden_size, ffn_hidden_size, num_experts, top_k, capacity_factor=1.0):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.moe_capacity_factor = capacity_factor
        self.sort_end_bit = max(int(math.ceil(math.log2(num_experts))), 1)
        self.router = LearnedRouter(hidden_size, num_experts, top_k)
        self.mlp = MLP(hidden_size, ffn_hidden_size, num_experts)
        self.bias = nn.Parameter(torch.empty(1, 1, hidden_size))

    def expert_capacity(self, tokens):
        tokens_per_expert = self.top_k * tokens / self.num_experts
        return int(self.moe_capacity_factor * tokens_per_expert)

    def indices_and_bins(self, top_expert):
        top_expert = top_expert.int()
        bin_ids, indices = ops.sort(top_expert, self.sort_end_bit)
        tokens_per_expert = ops.histogram(top_expert, self.num_experts)
        bins = ops.inclusive_cumsum(tokens_per_expert, 0)
        bins = bins.view(1) if not len(bins.size()) else bins
        return indices, bin_ids, bins, tokens_per_expert

    def permute_and_compute(self, x, tokens_per_expert, indices, bin_ids, expert_weights, bins, expert_capacity,
                            top_k):
        x = x.view(-1, x.shape[-1])
        x = ops.binned_gather(x, indices, bins, expert_capacity, top_k)
        x = self.mlp(x)
        return ops.binned_scatter(x, indices, expert_weights, bins, top_k)

    def forward_once(self, x, expert_weights, top_experts):
        expert_weights = expert_weights.flatten()
        top_experts = top_experts.flatten()
        with torch.no_grad():
            indices, bin_ids, bins, tokens_per_expert = self.indices_and_bins(top_experts)
            sl, bs, _ = x.size()
            expert_capacity = self.expert_capacity(sl * bs)
            if expert_capacity == 0:
                expert_capacity = torch.max(tokens_per_expert).item()
        x = self.permute_and_compute(
            x, tokens_per_expert, indices, bin_ids, expert_weights, bins, expert_capacity, self.top_k
        )
        return x, tokens_per_expert

    def forward(self, x):
        sl, bs, hs = x.size()
        scores, expert_weights, top_experts = self.router(x)
        x, tokens_per_expert = self.forward_once(x, expert_weights, top_experts)
        return x.view(sl, bs, hs), self.bias


class SparseGLU(nn.Module):
    # megablocks/layers/glu.py SparseGLU: w1, v1, w2 stored 2-D as [E * ffn, hidden]
    def __init__(self, hidden_size, ffn_hidden_size, num_experts):
        super().__init__()
        self.num_experts = num_experts
        self.ffn_hidden_size = ffn_hidden_size
        self.w1 = nn.Parameter(torch.empty(num_experts * ffn_hidden_size, hidden_size))
        self.v1 = nn.Parameter(torch.empty(num_experts * ffn_hidden_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts * ffn_hidden_size, hidden_size))

    def forward(self, x, topo):
        # block-sparse sdd/dsd with a block-diagonal topology == per-block matmul with that block's expert weights
        block_experts, blocking = topo
        hidden = x.shape[-1]
        xb = x.view(-1, blocking, hidden)
        w1 = self.w1.view(self.num_experts, self.ffn_hidden_size, hidden)[block_experts]
        v1 = self.v1.view(self.num_experts, self.ffn_hidden_size, hidden)[block_experts]
        w2 = self.w2.view(self.num_experts, self.ffn_hidden_size, hidden)[block_experts]
        x1 = torch.bmm(xb, w1.transpose(1, 2))
        x2 = torch.bmm(xb, v1.transpose(1, 2))
        x1 = DEFAULT_ACTIVATION_FN(x1) * x2
        return torch.bmm(x1, w2).view(-1, hidden)


# Follows megablocks/layers/dmoe.py :: ParallelDroplessMLP.sparse_forward_once (dropless, padded to `blocking`)
class dMoE(nn.Module):  # noqa: N801
    def __init__(self, hidden_size, ffn_hidden_size, num_experts, top_k, blocking=8):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.blocking = blocking
        self.router = LearnedRouter(hidden_size, num_experts, top_k)
        self.mlp = SparseGLU(hidden_size, ffn_hidden_size, num_experts)

    def indices_and_padded_bins(self, top_experts):
        top_experts = top_experts.int()
        bin_ids, indices = ops.sort(top_experts)
        tokens_per_expert = ops.histogram(top_experts, self.num_experts)
        padded_tokens_per_expert = ops.round_up(tokens_per_expert, self.blocking)
        padded_bins = ops.inclusive_cumsum(padded_tokens_per_expert, 0)
        bins = ops.inclusive_cumsum(tokens_per_expert, 0)
        return indices, bin_ids, bins, padded_bins, tokens_per_expert

    def topology(self, x, padded_bins):
        # which expert owns each row block of the padded activations
        block_starts = torch.arange(0, x.shape[0], self.blocking, device=x.device, dtype=padded_bins.dtype)
        return torch.searchsorted(padded_bins, block_starts, right=True), self.blocking

    def sparse_forward_once(self, x, expert_weights, top_experts):
        expert_weights = expert_weights.flatten()
        top_experts = top_experts.flatten()
        with torch.no_grad():
            indices, bin_ids, bins, padded_bins, tokens_per_expert = self.indices_and_padded_bins(top_experts)
        x = x.view(-1, x.shape[-1])
        x = ops.padded_gather(x, indices, bin_ids, bins, padded_bins, self.top_k)
        with torch.no_grad():
            topo = self.topology(x, padded_bins)
        x = self.mlp(x, topo)
        x = ops.padded_scatter(x, indices, bin_ids, expert_weights, bins, padded_bins, self.top_k)
        return x, tokens_per_expert

    def forward(self, x):
        in_shape = x.size()
        scores, expert_weights, top_experts = self.router(x)
        x, tokens_per_expert = self.sparse_forward_once(x, expert_weights, top_experts)
        return x.view(in_shape), None


class GroupedMLP(nn.Module):
    # megablocks/layers/mlp.py GroupedMLP: 2-D w1/w2 [E * ffn, hidden]; gg.ops.gmm(x, w, batch_sizes) on host sizes
    def __init__(self, hidden_size, ffn_hidden_size, num_experts):
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.w1 = nn.Parameter(torch.empty(num_experts * ffn_hidden_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts * ffn_hidden_size, hidden_size))

    @staticmethod
    def gmm(x, w, batch_sizes, trans_b=False):
        outs = [a @ (b.t() if trans_b else b) for a, b in zip(x.split(batch_sizes.tolist()), w)]
        return torch.cat(outs, dim=0)

    def forward(self, x, tokens_per_expert):
        batch_sizes = tokens_per_expert.cpu().to(torch.long)
        w1 = self.w1.view(self.num_experts, -1, self.hidden_size)
        w2 = self.w2.view(self.num_experts, -1, self.hidden_size)
        x = self.gmm(x, w1, batch_sizes, trans_b=True)
        x = DEFAULT_ACTIVATION_FN(x)
        return self.gmm(x, w2, batch_sizes)


# Follows megablocks/layers/dmoe.py :: ParallelDroplessMLP.grouped_forward_once (mlp_impl="grouped")
class GroupedDMoE(nn.Module):
    def __init__(self, hidden_size, ffn_hidden_size, num_experts, top_k):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.router = LearnedRouter(hidden_size, num_experts, top_k, moe_normalize_expert_weights=1.0)
        self.mlp = GroupedMLP(hidden_size, ffn_hidden_size, num_experts)

    def forward(self, x):
        in_shape = x.size()
        scores, expert_weights, top_experts = self.router(x)
        expert_weights = expert_weights.flatten()
        top_experts = top_experts.flatten()
        with torch.no_grad():
            top_experts = top_experts.int()
            bin_ids, indices = ops.sort(top_experts)
            tokens_per_expert = ops.histogram(top_experts, self.num_experts)
            bins = ops.inclusive_cumsum(tokens_per_expert, 0)
        x = x.view(-1, x.shape[-1])
        x = ops.gather(x, indices, bin_ids, bins, self.top_k)
        x = self.mlp(x, tokens_per_expert)
        x = ops.scatter(x, indices, bin_ids, expert_weights, bins, self.top_k)
        return x.view(in_shape), None


def make_mb_moe(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: MoE(HIDDEN, FFN, EXPERTS, 2, capacity_factor=1.0), dtype, seed)


def make_mb_dmoe(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: dMoE(HIDDEN, FFN, EXPERTS, 2, blocking=8), dtype, seed)


def make_mb_grouped(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: GroupedDMoE(HIDDEN, FFN, EXPERTS, 2), dtype, seed)


LAYERS = [
    CorpusLayer(
        name="megablocks_moe_binned_capacity",
        origin="MegaBlocks layers/moe.py ParallelMLP (ops.sort, histogram, binned_gather/binned_scatter, capacity)",
        style="capacity",
        make=make_mb_moe,
        input_shape=(16, 2, HIDDEN),
        returns_tuple=True,
    ),
    CorpusLayer(
        name="megablocks_dmoe_padded_glu",
        origin="MegaBlocks layers/dmoe.py sparse_forward_once (round_up, padded_gather/scatter) + glu.py SparseGLU",
        style="device_padded",
        make=make_mb_dmoe,
        input_shape=(16, 2, HIDDEN),
        returns_tuple=True,
    ),
    CorpusLayer(
        name="megablocks_dmoe_grouped_gmm",
        origin="MegaBlocks layers/dmoe.py grouped_forward_once (ops.gather/scatter) + mlp.py GroupedMLP gmm by counts",
        style="host_loop",
        make=make_mb_grouped,
        input_shape=(16, 2, HIDDEN),
        returns_tuple=True,
    ),
]
