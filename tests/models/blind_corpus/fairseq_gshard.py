"""fairseq MoE layers: GShard top-2 / top-1 gating with capacity (fairseq/modules/moe/) and the BASE layer.

Re-expressed for one process: the all-to-all is the identity and every expert lives in this module.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ._registry import EXPERTS, FFN, HIDDEN, CorpusLayer, materialize


def _one_hot_scatter(idx: torch.Tensor, n: int, add_last_dim: bool = False) -> torch.Tensor:
    # fairseq's own one_hot: zeros of the index dtype, scatter_ ones along the last dim
    if add_last_dim:
        idx = idx.unsqueeze(-1)
    out = idx.new_zeros(idx.shape[:-1] + (n,))
    return out.scatter_(out.dim() - 1, idx, 1)


def _cumsum_sub_one(mask: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(mask, dim=0) - 1


# Follows fairseq/modules/moe/top2gate.py :: top2gating (second_expert_policy="all", use_fp32=True)
def top2gating(logits: torch.Tensor, eval_mode: bool, eval_capacity_token_fraction: float = 0.25):
    orig_dtype = logits.dtype
    logits = logits.float()
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    if eval_mode and eval_capacity_token_fraction > 0.0:
        capacity = math.ceil(eval_capacity_token_fraction * num_tokens)
    else:
        capacity = 2 * math.ceil(num_tokens / num_experts)

    indices1_s = torch.argmax(gates, dim=1, keepdim=True)
    mask1 = _one_hot_scatter(indices1_s, num_experts)
    logits_except1 = logits.masked_fill(mask1.bool(), float("-inf"))
    indices2_s = torch.argmax(logits_except1, dim=1, keepdim=True)
    mask2 = _one_hot_scatter(indices2_s, num_experts)

    locations1 = _cumsum_sub_one(mask1)
    locations2 = _cumsum_sub_one(mask2)
    locations2 = locations2 + torch.sum(mask1, dim=0, keepdim=True)

    me = gates.mean(dim=0)
    ce = mask1.to(gates.dtype).mean(dim=0)
    l_aux = torch.mean(me * ce) * num_experts * num_experts

    mask1 = mask1 * torch.lt(locations1, capacity)
    mask2 = mask2 * torch.lt(locations2, capacity)

    gates1_s = (gates * mask1).sum(dim=1)
    gates2_s = (gates * mask2).sum(dim=1)
    denom_s = torch.clamp(gates1_s + gates2_s, min=torch.finfo(gates1_s.dtype).eps)
    gates1_s = gates1_s / denom_s
    gates2_s = gates2_s / denom_s

    locations1_s = torch.sum(locations1 * mask1, dim=1)
    locations2_s = torch.sum(locations2 * mask2, dim=1)
    gates1 = gates1_s.unsqueeze(-1) * mask1.to(gates1_s.dtype)
    gates2 = gates2_s.unsqueeze(-1) * mask2.to(gates2_s.dtype)
    locations1_sc = _one_hot_scatter(locations1_s, capacity, add_last_dim=True)
    locations2_sc = _one_hot_scatter(locations2_s, capacity, add_last_dim=True)
    # "se,sc->sec" written as a batched outer product
    combine1_sec = torch.bmm(gates1.unsqueeze(-1), locations1_sc.to(gates1.dtype).unsqueeze(1))
    combine2_sec = torch.bmm(gates2.unsqueeze(-1), locations2_sc.to(gates2.dtype).unsqueeze(1))
    combine_weights = combine1_sec + combine2_sec
    dispatch_mask = combine_weights.bool()
    return l_aux, combine_weights.to(orig_dtype), dispatch_mask


# Follows fairseq/modules/moe/top1gate.py :: top1gating (use_fp32=True)
def top1gating(logits: torch.Tensor, capacity_factor: float, eval_mode: bool, eval_capacity_token_fraction: float):
    orig_dtype = logits.dtype
    logits = logits.float()
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    if eval_mode and eval_capacity_token_fraction > 0.0:
        capacity = math.ceil(eval_capacity_token_fraction * num_tokens)
    else:
        capacity = int(capacity_factor * math.ceil(num_tokens / num_experts))

    indices1_s = torch.argmax(gates, dim=1)
    mask1 = _one_hot_scatter(indices1_s, num_experts, add_last_dim=True)
    gates1_s = (gates * mask1).sum(dim=1)
    locations1 = _cumsum_sub_one(mask1)

    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask1.to(gates.dtype), dim=0)
    l_aux = torch.mean(me * ce) * num_experts * num_experts

    mask1 = mask1 * torch.lt(locations1, capacity)
    locations1_s = torch.sum(locations1 * mask1, dim=1)
    gates1 = gates1_s.unsqueeze(-1) * mask1.to(gates1_s.dtype)
    locations1_sc = _one_hot_scatter(locations1_s, capacity, add_last_dim=True)
    combine1_sec = torch.bmm(gates1.unsqueeze(-1), locations1_sc.to(gates1.dtype).unsqueeze(1))
    return l_aux, combine1_sec.to(orig_dtype), combine1_sec.bool()


class Top2Gate(nn.Module):
    # fairseq Top2Gate: a bias-free Linear called `wg`
    def __init__(self, model_dim: int, num_experts: int) -> None:
        super().__init__()
        self.wg = nn.Linear(model_dim, num_experts, bias=False)

    def forward(self, input: torch.Tensor):  # noqa: A002
        return top2gating(self.wg(input), eval_mode=not self.training)


# fairseq modules/moe/top1gate.py :: Top1Gate
class Top1Gate(nn.Module):
    def __init__(self, model_dim: int, num_experts: int, capacity_factor: float = 1.0) -> None:
        super().__init__()
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.capacity_factor = capacity_factor

    def forward(self, input: torch.Tensor):  # noqa: A002
        return top1gating(self.wg(input), self.capacity_factor, not self.training, 0.25)


class FeedForwardNetwork(nn.Module):
    # fairseq transformer_layer.FeedForwardNetwork: fc1 -> activation -> fc2 (biases on)
    def __init__(self, embed_dim: int, ffn_dim: int, activation: str = "relu") -> None:
        super().__init__()
        self.fc1 = nn.Linear(embed_dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, embed_dim)
        self.activation_fn = F.relu if activation == "relu" else F.gelu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation_fn(self.fc1(x)))


# Follows fairseq/modules/moe/moe_layer.py :: MOELayer.forward (non-Tutel path, all2all_size == 1)
class MOELayer(nn.Module):
    def __init__(self, gate: nn.Module, experts: nn.ModuleList) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.num_local_experts = len(experts)
        self.all2all_size = 1

    def forward(self, *input: torch.Tensor):  # noqa: A002
        input = input[0]  # noqa: A001
        assert input.dim() == 3, "input Tensor must have dimensions: (s)equence, (t)oken, (m)odel"
        d_model = input.shape[2]
        reshaped_input = input.reshape(-1, d_model)
        l_aux, combine_weights, dispatch_mask = self.gate(reshaped_input)

        dispatch_mask = dispatch_mask.to(input.dtype).permute(1, 2, 0)  # S,E,C -> E,C,S
        E, C, S = dispatch_mask.size()
        M = reshaped_input.size(1)
        # einsum("sec,sm->ecm") as a single mm
        dispatched_input = torch.mm(dispatch_mask.view(E * C, S), reshaped_input)

        dispatched_input = dispatched_input.reshape(self.all2all_size, self.num_local_experts, -1, d_model)
        chunks = dispatched_input.chunk(self.num_local_experts, dim=1)
        expert_outputs = []
        for chunk, expert in zip(chunks, self.experts):
            expert_outputs += [expert(chunk)]
        expert_output = torch.cat(expert_outputs, dim=1)
        expert_output = expert_output.reshape(self.all2all_size * self.num_local_experts, -1, d_model)

        # einsum("sec,ecm->sm")
        combined_output = combine_weights.view(S, E * C).mm(expert_output.view(E * C, M))
        combined_output = combined_output.reshape(input.shape)
        return combined_output, {"moe_gate_loss": l_aux}


class BaseSublayer(nn.Module):
    # fairseq/modules/base_layer.py :: BaseSublayer (pre-norm residual FFN)
    def __init__(self, dim: int, ffn: int) -> None:
        super().__init__()
        self.activation_fn = F.gelu
        self.norm = nn.LayerNorm(dim)
        self.ff1 = nn.Linear(dim, ffn)
        self.ff2 = nn.Linear(ffn, dim)

    def forward(self, xs: torch.Tensor) -> torch.Tensor:
        return xs + self.ff2(self.activation_fn(self.ff1(self.norm(xs))))


# Follows fairseq/modules/base_layer.py :: BaseLayer (greedy_assignment, the eval-time router), one "worker" per expert
class BaseLayer(nn.Module):
    def __init__(self, dim: int, ffn: int, num_workers: int) -> None:
        super().__init__()
        self.num_workers = num_workers
        self.expert_centroids = nn.Parameter(torch.empty(num_workers, dim))
        self.expert_networks = nn.ModuleList([nn.Sequential(BaseSublayer(dim, ffn)) for _ in range(num_workers)])

    def forward(self, input_features: torch.Tensor, *args, **kwargs):
        features = input_features.reshape(-1, input_features.size(-1))
        with torch.no_grad():
            token_expert_affinities = features.matmul(self.expert_centroids.transpose(0, 1))
        sort_by_expert, output_splits = self.greedy_assignment(token_expert_affinities)
        routed_features = features[sort_by_expert]
        routed_chunks = []
        for expert_id, chunk in enumerate(routed_features.split(output_splits)):
            if chunk.size(0) > 0:
                alpha = torch.sigmoid(chunk.mv(self.expert_centroids[expert_id])).unsqueeze(1)
                chunk = alpha * self.expert_networks[expert_id](chunk) + (1 - alpha) * chunk
            routed_chunks.append(chunk)
        result = torch.cat(routed_chunks)
        result = result[self.inverse_sort(sort_by_expert)]
        return result.view(input_features.size()), None, None

    def inverse_sort(self, order: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(order).scatter_(0, order, torch.arange(0, order.size(0), device=order.device))

    def greedy_assignment(self, scores: torch.Tensor, k: int = 1):
        token_to_workers = torch.topk(scores, dim=1, k=k, largest=True).indices.view(-1)
        token_to_workers, sort_ordering = torch.sort(token_to_workers)
        worker2token = sort_ordering // k
        output_splits = torch.zeros((self.num_workers,), dtype=torch.long, device=scores.device)
        workers, counts = torch.unique_consecutive(token_to_workers, return_counts=True)
        output_splits[workers] = counts
        return worker2token, output_splits.tolist()


def make_fairseq_top2(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(
        lambda: MOELayer(
            Top2Gate(HIDDEN, EXPERTS), nn.ModuleList([FeedForwardNetwork(HIDDEN, FFN) for _ in range(EXPERTS)])
        ),
        dtype,
        seed,
    )


def make_fairseq_top1(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(
        lambda: MOELayer(
            Top1Gate(HIDDEN, 16, capacity_factor=2.0),
            nn.ModuleList([FeedForwardNetwork(HIDDEN, FFN, activation="gelu") for _ in range(16)]),
        ),
        dtype,
        seed,
    )


def make_base_layer(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: BaseLayer(HIDDEN, FFN, EXPERTS), dtype, seed)


LAYERS = [
    CorpusLayer(
        name="fairseq_top2gate_moe_layer",
        origin="fairseq modules/moe/top2gate.py top2gating + moe_layer.py MOELayer (GShard, mm dispatch/combine)",
        style="capacity",
        make=make_fairseq_top2,
        input_shape=(2, 16, HIDDEN),
        returns_tuple=True,
    ),
    CorpusLayer(
        name="fairseq_top1gate_moe_layer",
        origin="fairseq modules/moe/top1gate.py top1gating + moe_layer.py MOELayer (E=16, capacity factor 2)",
        style="capacity",
        make=make_fairseq_top1,
        input_shape=(2, 16, HIDDEN),
        returns_tuple=True,
    ),
    CorpusLayer(
        name="fairseq_base_layer_greedy",
        origin="fairseq modules/base_layer.py BaseLayer (greedy_assignment, unique_consecutive splits, inverse_sort)",
        style="host_loop",
        make=make_base_layer,
        input_shape=(2, 16, HIDDEN),
        returns_tuple=True,
    ),
]
