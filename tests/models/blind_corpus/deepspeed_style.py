"""DeepSpeed MoE: deepspeed/moe/sharded_moe.py (TopKGate, top1gating, top2gating, MOELayer), moe/experts.py and
moe/layer.py (MoE wrapper, PR-MoE residual). Expert parallel size 1; the _AllToAll is the identity.
Also DeepSpeed-FastGen's inference/v2 ragged MoE (modules/implementations/moe/cutlass_multi_gemm.py): top-k gating
kernel (expert counts + per-token slot offsets), moe_scatter into expert-contiguous slots, CUTLASS multi-GEMM over
expert_cumsum (torch._grouped_mm here), moe_gather back with score weighting. The kernels are re-expressed in torch.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from ._registry import EXPERTS, FFN, HIDDEN, CorpusLayer, materialize


def einsum(rule, a, b):
    # sharded_moe.einsum with USE_EINSUM = True
    return torch.einsum(rule, a, b)


def _capacity(gates: torch.Tensor, capacity_factor: torch.Tensor, min_capacity: torch.Tensor) -> torch.Tensor:
    num_tokens = gates.shape[0]
    num_experts = gates.shape[1]
    capacity = torch.ceil((num_tokens / num_experts) * capacity_factor).to(torch.int64)
    if capacity < min_capacity:
        capacity = min_capacity.to(torch.int64)
    return capacity


def _top_idx(source: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(source, k=k, dim=0)[1]


def _one_hot_to_float(x: torch.Tensor, num_classes: int) -> torch.Tensor:
    return F.one_hot(x, num_classes=num_classes).float()


# Follows sharded_moe.top1gating (noisy_gate_policy=None, drop_tokens=True, use_rts=False)
def top1gating(logits, capacity_factor, min_capacity):
    gates = F.softmax(logits, dim=1)
    capacity = int(_capacity(gates, torch.tensor(capacity_factor), torch.tensor(min_capacity)))
    indices1_s = torch.argmax(gates, dim=1)
    num_experts = int(gates.shape[1])
    mask1 = F.one_hot(indices1_s, num_classes=num_experts)
    exp_counts = torch.sum(mask1, dim=0).detach().to("cpu")

    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask1.float(), dim=0)
    l_aux = torch.sum(me * ce) * num_experts

    mask1_rand = mask1
    top_idx = _top_idx(mask1_rand, capacity)
    new_mask1 = mask1 * torch.zeros_like(mask1).scatter_(0, top_idx, 1)
    mask1 = new_mask1

    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations1_s = torch.sum(locations1 * mask1, dim=1)
    mask1_float = mask1.float()
    gates = gates * mask1_float
    locations1_sc = _one_hot_to_float(locations1_s, capacity)
    combine_weights = einsum("se,sc->sec", gates, locations1_sc)
    dispatch_mask = combine_weights.bool()
    return l_aux, combine_weights, dispatch_mask, exp_counts


# Follows sharded_moe.top2gating (top2_2nd_expert_sampling=False, drop_tokens=True)
def top2gating(logits, capacity_factor, min_capacity):
    gates = F.softmax(logits, dim=1)
    indices1_s = torch.argmax(gates, dim=1)
    num_experts = int(gates.shape[1])
    mask1 = F.one_hot(indices1_s, num_classes=num_experts)
    logits_except1 = logits.masked_fill(mask1.bool(), float("-inf"))
    indices2_s = torch.argmax(logits_except1, dim=1)
    mask2 = F.one_hot(indices2_s, num_classes=num_experts)

    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1
    locations2 += torch.sum(mask1, dim=0, keepdim=True)

    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask1.float(), dim=0)
    l_aux = torch.mean(me * ce) * num_experts * num_experts
    exp_counts = torch.sum(mask1 + mask2, dim=0).detach()

    capacity = _capacity(gates, torch.tensor(capacity_factor * 2), torch.tensor(min_capacity))
    mask1 = mask1 * torch.lt(locations1, capacity)
    mask2 = mask2 * torch.lt(locations2, capacity)

    locations1_s = torch.sum(locations1 * mask1, dim=1)
    locations2_s = torch.sum(locations2 * mask2, dim=1)
    mask1_float = mask1.float()
    mask2_float = mask2.float()
    gates1_s = einsum("se,se->s", gates, mask1_float)
    gates2_s = einsum("se,se->s", gates, mask2_float)
    denom_s = torch.clamp(gates1_s + gates2_s, min=torch.finfo(gates1_s.dtype).eps)
    gates1_s = gates1_s / denom_s
    gates2_s = gates2_s / denom_s

    gates1 = einsum("s,se->se", gates1_s, mask1_float)
    gates2 = einsum("s,se->se", gates2_s, mask2_float)
    capacity = int(capacity)
    locations1_sc = _one_hot_to_float(locations1_s, capacity)
    locations2_sc = _one_hot_to_float(locations2_s, capacity)
    combine1_sec = einsum("se,sc->sec", gates1, locations1_sc)
    combine2_sec = einsum("se,sc->sec", gates2, locations2_sc)
    combine_weights = combine1_sec + combine2_sec
    dispatch_mask = combine_weights.bool()
    return l_aux, combine_weights, dispatch_mask, exp_counts


class TopKGate(nn.Module):
    # `wg` is an fp32 Linear (DeepSpeed calls .float() on it); the input is upcast before the gate
    def __init__(self, model_dim, num_experts, k=1, capacity_factor=1.0, eval_capacity_factor=1.0, min_capacity=4):
        super().__init__()
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity

    def forward(self, input, used_token=None):  # noqa: A002
        input_fp32 = input.float()
        logits = self.wg(input_fp32)
        cf = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return top1gating(logits, cf, self.min_capacity)
        return top2gating(logits, cf, self.min_capacity)


class Experts(nn.Module):
    # deepspeed/moe/experts.py: deep copies of one expert, inputs chunked along the local-expert dim
    def __init__(self, expert, num_local_experts=1):
        super().__init__()
        self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts

    def forward(self, inputs):
        chunks = inputs.chunk(self.num_local_experts, dim=1)
        expert_outputs = []
        for chunk, expert in zip(chunks, self.deepspeed_experts):
            out = expert(chunk)
            if isinstance(out, tuple):
                out = out[0]
            expert_outputs += [out]
        return torch.cat(expert_outputs, dim=1)


# DeepSpeed moe/sharded_moe.py :: MOELayer.forward (einsum dispatch/combine, ep_size == 1)
class MOELayer(nn.Module):
    def __init__(self, gate, experts, num_local_experts, ep_size=1):
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_size = ep_size
        self.num_local_experts = num_local_experts

    def forward(self, *input: torch.Tensor):  # noqa: A002
        d_model = input[0].shape[-1]
        reshaped_input = input[0].reshape(-1, d_model)
        self.l_aux, combine_weights, dispatch_mask, self.exp_counts = self.gate(reshaped_input, None)
        dispatched_input = einsum("sec,sm->ecm", dispatch_mask.type_as(input[0]), reshaped_input)
        dispatched_input = dispatched_input.reshape(self.ep_size, self.num_local_experts, -1, d_model)
        expert_output = self.experts(dispatched_input)
        expert_output = expert_output.reshape(self.ep_size * self.num_local_experts, -1, d_model)
        combined_output = einsum("sec,ecm->sm", combine_weights.type_as(input[0]), expert_output)
        return combined_output.reshape(input[0].shape)


class MLP(nn.Module):
    # a Megatron-DeepSpeed style expert: dense_h_to_4h / dense_4h_to_h with GeLU
    def __init__(self, hidden, ffn):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(hidden, ffn)
        self.dense_4h_to_h = nn.Linear(ffn, hidden)

    def forward(self, x):
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)))


# Follows deepspeed/moe/layer.py :: MoE (returns output, l_aux, exp_counts; optional PR-MoE residual)
class MoE(nn.Module):
    def __init__(self, hidden_size, expert, num_experts=1, k=1, capacity_factor=1.0, min_capacity=4,
                 use_residual=False):
        super().__init__()
        self.use_residual = use_residual
        self.num_experts = num_experts
        experts = Experts(expert, num_experts)
        self.deepspeed_moe = MOELayer(
            TopKGate(hidden_size, num_experts, k, capacity_factor, capacity_factor, min_capacity), experts, num_experts
        )
        if self.use_residual:
            self.mlp = copy.deepcopy(expert)
            self.coefficient = nn.Linear(hidden_size, 2)

    def forward(self, hidden_states, used_token=None):
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            output_mlp = self.mlp(hidden_states)
            if isinstance(output_mlp, tuple):
                output_mlp = output_mlp[0]
            coef = self.coefficient(hidden_states)
            coef = F.softmax(coef, dim=-1)
            output = output * coef[..., 0:1] + output_mlp * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts


# ---------------------------------------------------------------- DeepSpeed-FastGen (inference/v2) ragged MoE
class DSMultiGemmMoE(nn.Module):
    def __init__(self, model_dim, intermediate_dim, n_experts, n_top_k, normalize_scores=True):
        super().__init__()
        self.n_experts = n_experts
        self.n_top_k = n_top_k
        self.normalize_scores = normalize_scores
        # parameters as the model holds them after transform_*_param: gate [E, H], mlp weights [E, in, out]
        self.gate_w = nn.Parameter(torch.empty(n_experts, model_dim))
        self.mlp_1_w = nn.Parameter(torch.empty(n_experts, model_dim, 2 * intermediate_dim))
        self.mlp_2_w = nn.Parameter(torch.empty(n_experts, intermediate_dim, model_dim))

    def _top_k_gate(self, logits):
        # ragged top_k_gating kernel: softmax scores, expert assignments, per-expert counts and arrival offsets
        probs = torch.softmax(logits.float(), dim=-1)
        scores, assignments = torch.topk(probs, self.n_top_k, dim=-1)
        flat_assignments = assignments.flatten()
        expert_counts = torch.zeros(self.n_experts, dtype=torch.int64, device=logits.device).scatter_reduce(
            0, flat_assignments, torch.ones_like(flat_assignments), reduce="sum"
        )
        order = torch.argsort(flat_assignments, stable=True)
        rank = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        offsets = (rank - (torch.cumsum(expert_counts, 0) - expert_counts)[flat_assignments]).view_as(assignments)
        return expert_counts, scores, assignments, offsets

    def _moe_scatter(self, hidden_states, expert_counts, assignments, offsets):
        expert_cumsum = torch.cumsum(expert_counts, dim=0)
        mapped_slots = (expert_cumsum - expert_counts)[assignments] + offsets
        moe_input = hidden_states.new_empty(hidden_states.shape[0] * self.n_top_k, hidden_states.shape[-1])
        moe_input = moe_input.index_copy(0, mapped_slots.flatten(), hidden_states.repeat_interleave(self.n_top_k, 0))
        return moe_input, expert_cumsum, mapped_slots

    def _moe_gather(self, output_unordered, scores, mapped_slots):
        if self.normalize_scores:
            scores = scores / scores.sum(dim=-1, keepdim=True)
        gathered = output_unordered[mapped_slots]  # [T, k, H]
        return (gathered * scores.unsqueeze(-1).to(gathered.dtype)).sum(dim=1)

    def forward(self, hidden_states):
        shape = hidden_states.shape
        hidden_states = hidden_states.reshape(-1, shape[-1])
        logits = F.linear(hidden_states, self.gate_w)
        expert_counts, scores, assignments, offsets = self._top_k_gate(logits)
        moe_input, expert_cumsum, mapped_slots = self._moe_scatter(hidden_states, expert_counts, assignments, offsets)
        offs = expert_cumsum.to(torch.int32)
        # the multi-GEMM kernels run in the (bf16) inference dtype; CPU _grouped_mm also only compiles in bf16
        gated_intermediate = torch._grouped_mm(moe_input.bfloat16(), self.mlp_1_w.bfloat16(), offs=offs)
        gate, up = gated_intermediate.chunk(2, dim=-1)
        intermediate = F.silu(gate) * up
        output_unordered = torch._grouped_mm(intermediate, self.mlp_2_w.bfloat16(), offs=offs).to(hidden_states.dtype)
        return self._moe_gather(output_unordered, scores, mapped_slots).view(shape)


_GATE_FP32 = ("deepspeed_moe.gate.wg",)


def make_ds_top1(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(
        lambda: MoE(HIDDEN, MLP(HIDDEN, FFN), EXPERTS, k=1, capacity_factor=1.5), dtype, seed, keep_fp32=_GATE_FP32
    )


def make_ds_top2(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(
        lambda: MoE(HIDDEN, MLP(HIDDEN, FFN), EXPERTS, k=2, capacity_factor=1.0), dtype, seed, keep_fp32=_GATE_FP32
    )


def make_ds_residual(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(
        lambda: MoE(HIDDEN, MLP(HIDDEN, FFN), 4, k=1, capacity_factor=1.0, use_residual=True),
        dtype,
        seed,
        keep_fp32=_GATE_FP32,
    )


def make_ds_fastgen(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: DSMultiGemmMoE(HIDDEN, FFN, EXPERTS, 2), dtype, seed)


LAYERS = [
    CorpusLayer(
        name="deepspeed_top1gating",
        origin="DeepSpeed moe/sharded_moe.py top1gating (topk-over-tokens capacity drop) + MOELayer einsum sec,sm->ecm",
        style="capacity",
        make=make_ds_top1,
        input_shape=(2, 16, HIDDEN),
        returns_tuple=True,
    ),
    CorpusLayer(
        name="deepspeed_top2gating",
        origin="DeepSpeed moe/sharded_moe.py top2gating (cumsum locations, se,sc->sec combine) + moe/experts.py",
        style="capacity",
        make=make_ds_top2,
        input_shape=(32, HIDDEN),
        returns_tuple=True,
    ),
    CorpusLayer(
        name="deepspeed_pr_moe_residual",
        origin="DeepSpeed moe/layer.py MoE(use_residual=True): top-1 experts + dense MLP mixed by softmax coefficient",
        style="capacity",
        make=make_ds_residual,
        input_shape=(2, 16, HIDDEN),
        returns_tuple=True,
    ),
    CorpusLayer(
        name="deepspeed_fastgen_ragged_multigemm",
        origin="DeepSpeed inference/v2 cutlass_multi_gemm.py (top_k_gating counts/offsets, moe_scatter, multi-GEMM, "
        "moe_gather)",
        style="sort",
        make=make_ds_fastgen,
        input_shape=(32, HIDDEN),
    ),
]
