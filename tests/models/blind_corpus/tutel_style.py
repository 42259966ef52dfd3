"""Tutel-style MoE: tutel/impls/moe_layer.py + tutel/impls/fast_dispatch.py (extract_critical, fast_encode/decode).

Tutel's fast dispatcher is a CUDA/CPU kernel; here its semantics (row ``index * capacity + location`` of the
[E*C, M] buffer, slots past capacity dropped) are written with index_add_ / gather on a buffer with one spare row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._registry import EXPERTS, FFN, HIDDEN, CorpusLayer, materialize


def one_hot_with_dtype(data: torch.Tensor, num_classes: int, dtype: torch.dtype) -> torch.Tensor:
    result = torch.zeros([data.size(0), num_classes], device=data.device, dtype=dtype)
    return result.scatter_(1, data.unsqueeze(-1), 1)


def fast_cumsum_sub_one(mask: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(mask, dim=0) - 1


def compute_sorted_location(x: torch.Tensor, importance_scores: torch.Tensor) -> torch.Tensor:
    # batch-prioritized routing: locations are assigned in order of decreasing router confidence
    sorted_x = x[importance_scores.argsort(dim=0)]
    sorted_cumsum = fast_cumsum_sub_one(sorted_x) * sorted_x
    return sorted_cumsum[importance_scores.argsort(dim=0).argsort(dim=0)]


def load_balance(gates: torch.Tensor, mask1: torch.Tensor, num_global_experts: int) -> torch.Tensor:
    me = torch.sum(gates.float(), dim=0)
    ce = torch.sum(mask1.to(me.dtype), dim=0)
    return torch.sum(me * ce) * (num_global_experts / (gates.size(0) * gates.size(0)))


# Follows tutel fast_dispatch.extract_critical
def extract_critical(gates, top_k, capacity_factor=1.0, batch_prioritized_routing=False):
    topk_indices = torch.topk(gates, top_k, dim=1).indices
    num_global_experts = gates.size(1)
    indices_s = [x.view(-1) for x in topk_indices.chunk(top_k, dim=1)]
    masks_se = [one_hot_with_dtype(x, num_classes=num_global_experts, dtype=x.dtype) for x in indices_s]
    gates_s = [(gates * x).sum(dim=1) for x in masks_se]
    l_loss = load_balance(gates, masks_se[0], num_global_experts)

    if batch_prioritized_routing:
        importance_scores = -1 * gates.max(dim=1)[0]

        def compute_location(x):
            return compute_sorted_location(x, importance_scores)
    else:
        compute_location = fast_cumsum_sub_one

    locations1 = compute_location(masks_se[0])
    locations_s = [torch.sum(locations1 * masks_se[0], dim=1).to(torch.int32)]
    if top_k > 1:
        acc_base = None
        for k in range(1, top_k):
            step = torch.sum(masks_se[k - 1], dim=0, keepdim=True)
            acc_base = step if acc_base is None else acc_base + step
            locations2 = compute_location(masks_se[k]) + acc_base
            locations_s.append(torch.sum(locations2 * masks_se[k], dim=1).to(torch.int32))
        denom_s = torch.clamp(sum(gates_s), min=torch.finfo(gates_s[0].dtype).eps)
        gates_s = [x / denom_s for x in gates_s]

    indices_s = [x.to(torch.int32) for x in indices_s]
    capacity = top_k * int(capacity_factor * ((int(gates.size(0)) + num_global_experts - 1) // num_global_experts))
    return (num_global_experts, indices_s, locations_s, gates_s, capacity), l_loss


def _slot_rows(indices1_s, locations1_s, capacity, num_global_experts):
    # flat slot index in the [E * C] buffer; tokens beyond capacity go to the spare row E * C
    rows = indices1_s.long() * capacity + locations1_s.long()
    return torch.where(locations1_s < capacity, rows, num_global_experts * capacity)


def fast_encode(data, critial_data, is_postscore=True):
    num_global_experts, indices_s, locations_s, gates_s, capacity = critial_data
    dispatched_input = data.new_zeros(num_global_experts * capacity + 1, data.size(-1))
    for gates1_s, indices1_s, locations1_s in zip(gates_s, indices_s, locations_s):
        rows = _slot_rows(indices1_s, locations1_s, capacity, num_global_experts)
        src = data if is_postscore else data * gates1_s.unsqueeze(-1).to(data.dtype)
        dispatched_input = dispatched_input.index_add(0, rows, src)
    return dispatched_input[:-1].view(num_global_experts, -1, data.size(-1))


def fast_decode(data, critial_data, is_postscore=True):
    num_global_experts, indices_s, locations_s, gates_s, capacity = critial_data
    flat = data.reshape(-1, data.size(-1))
    flat = torch.cat([flat, flat.new_zeros(1, flat.size(-1))], dim=0)
    combined_output = None
    for gates1_s, indices1_s, locations1_s in zip(gates_s, indices_s, locations_s):
        rows = _slot_rows(indices1_s, locations1_s, capacity, num_global_experts)
        single_output = flat[rows]
        if is_postscore:
            single_output = single_output * gates1_s.unsqueeze(-1).to(flat.dtype)
        combined_output = single_output if combined_output is None else combined_output + single_output
    return combined_output


class LinearTopKGate(nn.Module):
    # tutel/gates/top.py: `wg` Linear, optionally evaluated in fp32
    def __init__(self, model_dim, num_global_experts, k=1, fp32_gate=True, capacity_factor=1.0):
        super().__init__()
        self.wg = nn.Linear(model_dim, num_global_experts, bias=False)
        self.top_k = min(num_global_experts, int(k))
        self.fp32_gate = fp32_gate
        self.capacity_factor = float(capacity_factor)

    def forward(self, x):
        if self.fp32_gate:
            return F.linear(x.float(), self.wg.weight.float())
        return self.wg(x)


class FusedExpertsNetwork(nn.Module):
    # tutel builtin 'ffn' experts: fc1_weight [E, M, V] + fc1_bias [E, 1, V], fc2_weight [E, V, M] + fc2_bias
    def __init__(self, model_dim, hidden_size, local_experts, activation_fn=F.relu):
        super().__init__()
        self.model_dim, self.hidden_size, self.local_experts = model_dim, hidden_size, local_experts
        self.register_parameter("fc1_weight", nn.Parameter(torch.empty(local_experts, model_dim, hidden_size)))
        self.register_parameter("fc2_weight", nn.Parameter(torch.empty(local_experts, hidden_size, model_dim)))
        self.register_parameter("fc1_bias", nn.Parameter(torch.empty(local_experts, 1, hidden_size)))
        self.register_parameter("fc2_bias", nn.Parameter(torch.empty(local_experts, 1, model_dim)))
        self.activation_fn = activation_fn

    def forward(self, x):
        # x: [W, E, C, M] -> [E, W*C, M]
        x = x.permute(1, 0, 2, 3)
        original_shape, x = x.shape, x.reshape(self.local_experts, -1, self.model_dim)
        x = torch.matmul(x, self.fc1_weight) + self.fc1_bias
        x = self.activation_fn(x)
        x = torch.matmul(x, self.fc2_weight) + self.fc2_bias
        x = x.reshape(self.local_experts, original_shape[1], original_shape[2], self.model_dim)
        return x.permute(1, 0, 2, 3)


# Follows tutel/impls/moe_layer.py :: MOELayer.forward (single node: W == 1, no a2a)
class TutelMOELayer(nn.Module):
    def __init__(self, model_dim, hidden_size, num_experts, k, capacity_factor, batch_prioritized_routing,
                 is_postscore=True):
        super().__init__()
        self.model_dim = model_dim
        self.num_global_experts = num_experts
        self.gate = LinearTopKGate(model_dim, num_experts, k=k, capacity_factor=capacity_factor)
        self.experts = nn.ModuleList([FusedExpertsNetwork(model_dim, hidden_size, num_experts)])
        self.batch_prioritized_routing = batch_prioritized_routing
        self.is_postscore = is_postscore

    def expert_fn(self, dispatched_input):
        return self.experts[0](dispatched_input)

    def forward(self, input: torch.Tensor):  # noqa: A002
        original_shape, original_dtype = input.shape, input.dtype
        x = input.reshape(-1, input.shape[-1])
        logits = self.gate(x)
        scores = F.softmax(logits, dim=1)
        crit, l_aux = extract_critical(
            scores, top_k=self.gate.top_k, capacity_factor=self.gate.capacity_factor,
            batch_prioritized_routing=self.batch_prioritized_routing,
        )
        y = fast_encode(x.to(scores.dtype), crit, self.is_postscore).to(x.dtype)
        y = y.view(1, self.num_global_experts, -1, self.model_dim)
        y = self.expert_fn(y)
        y = y.view(self.num_global_experts, -1, self.model_dim)
        y = fast_decode(y.to(scores.dtype), crit, self.is_postscore)
        result_output = y.view(original_shape).to(original_dtype)
        self.l_aux = l_aux
        return result_output


def make_tutel_top2(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: TutelMOELayer(HIDDEN, FFN, EXPERTS, 2, 1.0, False), dtype, seed)


def make_tutel_bpr_top1(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: TutelMOELayer(HIDDEN, FFN, 4, 1, 1.25, True, is_postscore=False), dtype, seed)


LAYERS = [
    CorpusLayer(
        name="tutel_fast_dispatch_top2",
        origin="tutel impls/moe_layer.py MOELayer + fast_dispatch.py extract_critical/fast_encode/fast_decode",
        style="capacity",
        make=make_tutel_top2,
        input_shape=(32, HIDDEN),
    ),
    CorpusLayer(
        name="tutel_batch_prioritized_top1",
        origin="tutel fast_dispatch.py compute_sorted_location (batch_prioritized_routing), pre-score encode, E=4",
        style="capacity",
        make=make_tutel_bpr_top1,
        input_shape=(2, 16, HIDDEN),
    ),
]
