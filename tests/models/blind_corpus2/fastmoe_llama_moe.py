"""Host-count dispatchers from two research MoE libraries:
- laekov/fastmoe (fmoe/gates/naive_gate.py NaiveGate, fmoe/functions.py count_by_gate / MOEScatter / MOEGather,
  fmoe/layers.py FMoE, fmoe/linear.py FMoELinear, fmoe/transformer.py FMoETransformerMLP): top-k on the raw gate
  logits, softmax over the k kept values, a sort of the flat choices and torch.unique counts put into a per-expert
  count, index_select scatter, per-expert slices of a stacked [E, out, in] weight with bias (the CUDA grouped GEMM
  re-expressed as a loop over host counts), index_copy_ gather, and a torch.bmm of the [T, 1, k] scores with the
  [T, k, H] outputs as the combine.
- pjlab-sys4nlp/llama-moe (smoe/modules/moe/moe_gates.py TopKBalancedNoisyGate, moe_calculators.py
  UniversalCalculator, moe_experts.py LinearGLUExperts): a Linear-Tanh-Linear gate network, noise off (eval of the
  noisy gate), softmax over the top-k logits, sort of the flat expert ids, bincount().tolist() split, experts held as
  nn.ParameterList slices, index_add combine.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._registry import EXPERTS, FFN, HIDDEN, CorpusLayer, materialize


# ------------------------------------------------------------------------------------------- laekov/fastmoe
class NaiveGate(nn.Module):
    def __init__(self, d_model, num_expert, top_k=2):
        super().__init__()
        self.gate = nn.Linear(d_model, num_expert)
        self.top_k = top_k

    def forward(self, inp):
        gate = self.gate(inp)
        gate_top_k_val, gate_top_k_idx = torch.topk(gate, k=self.top_k, dim=-1, largest=True, sorted=False)
        gate_top_k_val = gate_top_k_val.view(-1, self.top_k)
        gate_score = F.softmax(gate_top_k_val, dim=-1)
        return gate_top_k_idx, gate_score


def count_by_gate(gate, num_expert):
    with torch.no_grad():
        flat = gate.view(-1)
        _, pos = torch.sort(flat)
        gate_idx, gate_count = torch.unique(flat, return_counts=True)
        local_expert_count = torch.zeros(num_expert, device=gate.device, dtype=torch.long)
        local_expert_count.index_put_((gate_idx.long(),), gate_count)
    return pos, local_expert_count


class FMoELinear(nn.Module):
    def __init__(self, num_expert, in_feat, out_feat):
        super().__init__()
        self.num_expert = num_expert
        self.weight = nn.Parameter(torch.empty(num_expert, out_feat, in_feat))
        self.bias = nn.Parameter(torch.zeros(num_expert, out_feat))

    def forward(self, inp, fwd_expert_count):
        # MOELinear: rows of inp are grouped by expert, fwd_expert_count lives on the host
        outs = []
        base = 0
        for i, count in enumerate(fwd_expert_count.tolist()):
            chunk = inp[base:base + count]
            outs.append(torch.addmm(self.bias[i], chunk, self.weight[i].t()))
            base += count
        return torch.cat(outs, dim=0)


class FMoETransformerMLP(nn.Module):
    def __init__(self, num_expert, d_model, d_hidden, top_k):
        super().__init__()
        self.num_expert = num_expert
        self.d_model = d_model
        self.top_k = top_k
        self.gate = NaiveGate(d_model, num_expert, top_k)
        self.htoh4 = FMoELinear(num_expert, d_model, d_hidden)
        self.h4toh = FMoELinear(num_expert, d_hidden, d_model)
        self.activation = nn.GELU()

    def expert_fn(self, inp, fwd_expert_count):
        x = self.htoh4(inp, fwd_expert_count)
        x = self.activation(x)
        return self.h4toh(x, fwd_expert_count)

    def forward(self, inp):
        original_shape = inp.shape
        moe_inp = inp.reshape(-1, self.d_model)
        gate_top_k_idx, gate_score = self.gate(moe_inp)
        pos, local_expert_count = count_by_gate(gate_top_k_idx, self.num_expert)
        fwd_expert_count = local_expert_count.cpu()
        # MOEScatter: _local_scatter(inp, pos // topk)
        x = torch.index_select(moe_inp, 0, pos // self.top_k)
        x = self.expert_fn(x, fwd_expert_count)
        # MOEGather: _local_gather into a buffer of T * top_k rows
        out_buf = torch.zeros(moe_inp.shape[0] * self.top_k, self.d_model, dtype=x.dtype, device=x.device)
        moe_outp = out_buf.index_copy(0, pos, x)
        moe_outp = moe_outp.view(-1, self.top_k, self.d_model)
        gate_score = gate_score.view(-1, 1, self.top_k)
        moe_outp = torch.bmm(gate_score, moe_outp).reshape(-1, self.d_model)
        return moe_outp.reshape(original_shape)


# --------------------------------------------------------------------------------------- pjlab llama-moe
class TopKBalancedNoisyGate(nn.Module):
    def __init__(self, input_size, num_experts, num_selects):
        super().__init__()
        self.num_experts = num_experts
        self.num_selects = num_selects
        self.gate_network = nn.Sequential(
            nn.Linear(input_size, num_experts, bias=False),
            nn.Tanh(),
            nn.Linear(num_experts, num_experts, bias=False),
        )
        self.weight_noise = nn.Linear(input_size, num_experts, bias=False)
        self.softmax = nn.Softmax(1)
        self.add_noise = False  # the noisy branch is a training-time option; eval-equivalent here

    def forward(self, x):
        logits_gate = self.gate_network(x)
        if self.training and self.add_noise:
            noise_control = F.softplus(self.weight_noise(x)) + 0.01
            logits = logits_gate + torch.randn_like(logits_gate) * noise_control
        else:
            logits = logits_gate
        top_logits, top_indices = logits.topk(min(self.num_selects + 1, self.num_experts), dim=1)
        top_k_logits = top_logits[:, :self.num_selects]
        top_k_indices = top_indices[:, :self.num_selects]
        top_k_scores = self.softmax(top_k_logits.to(torch.float32))
        return {"topK_indices": top_k_indices, "topK_scores": top_k_scores}


class LinearGLUExperts(nn.Module):
    def __init__(self, in_features, hidden_features, out_features, num_experts):
        super().__init__()
        self.num_experts = num_experts
        self.act_fn = nn.SiLU()
        self.weight_gate = nn.ParameterList(
            [nn.Parameter(torch.empty(hidden_features, in_features)) for _ in range(num_experts)])
        self.weight_up = nn.ParameterList(
            [nn.Parameter(torch.empty(hidden_features, in_features)) for _ in range(num_experts)])
        self.weight_down = nn.ParameterList(
            [nn.Parameter(torch.empty(out_features, hidden_features)) for _ in range(num_experts)])

    def forward(self, inp, i):
        gate = self.act_fn(F.linear(inp, self.weight_gate[i]))
        up = F.linear(inp, self.weight_up[i])
        return F.linear(gate * up, self.weight_down[i])


class UniversalCalculator(nn.Module):
    def __init__(self, experts, multiply_gate_scores=True, score_scale_factor=1.0):
        super().__init__()
        self.experts = experts
        self.num_experts = experts.num_experts
        self.multiply_gate_scores = multiply_gate_scores
        self.score_scale_factor = score_scale_factor

    def forward(self, x, topK_indices, topK_scores):
        batch_size = topK_indices.size(0)
        num_selects = topK_indices.size(1)
        topK_indices = topK_indices.flatten()
        topK_scores = topK_scores.flatten()
        batch_indices = torch.arange(batch_size, device=x.device).repeat_interleave(num_selects)
        _, index_sorted_topK_indices = topK_indices.sort(0)
        sorted_topK_scores = topK_scores.index_select(0, index_sorted_topK_indices)
        sorted_batch_indices = batch_indices.index_select(0, index_sorted_topK_indices)
        expert_batch_size = topK_indices.bincount(minlength=self.num_experts).tolist()
        sorted_x = x.index_select(0, sorted_batch_indices)
        split_x = torch.split(sorted_x, expert_batch_size, dim=0)
        expert_outputs = [self.experts(split_x[i], i) for i in range(self.num_experts) if split_x[i].shape[0] > 0]
        cat_expert_outputs = torch.cat(expert_outputs, 0)
        output_dim = cat_expert_outputs.size(1)
        if self.multiply_gate_scores:
            cat_expert_outputs = torch.mul(
                cat_expert_outputs, sorted_topK_scores.reshape(-1, 1) * self.score_scale_factor)
        zeros = torch.zeros((batch_size, output_dim), device=cat_expert_outputs.device,
                            dtype=cat_expert_outputs.dtype)
        return zeros.index_add(0, sorted_batch_indices, cat_expert_outputs)


class LinearGLUMoELayer(nn.Module):
    def __init__(self, input_size, hidden_size, output_size, num_experts, num_selects):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.gate = TopKBalancedNoisyGate(input_size, num_experts, num_selects)
        self.calculator = UniversalCalculator(LinearGLUExperts(input_size, hidden_size, output_size, num_experts))

    def forward(self, x):
        original_shape = x.shape[:-1]
        x = x.reshape(-1, self.input_size)
        gate_outputs = self.gate(x)
        y = self.calculator(x, gate_outputs["topK_indices"], gate_outputs["topK_scores"].to(x.dtype))
        return y.reshape(original_shape + (self.output_size,))


def make_fastmoe(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: FMoETransformerMLP(EXPERTS, HIDDEN, FFN, 2), dtype, seed)


def make_llama_moe(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: LinearGLUMoELayer(HIDDEN, FFN, HIDDEN, EXPERTS, 2), dtype, seed)


LAYERS = [
    CorpusLayer(
        name="fastmoe_naive_gate_bmm_combine",
        origin="laekov/fastmoe NaiveGate (top-k logits, softmax over k) + count_by_gate (sort, unique counts) + "
               "FMoELinear [E, out, in] host-count slices + index_copy gather + bmm(score, out) combine",
        style="host_loop",
        make=make_fastmoe,
        input_shape=(2, 16, HIDDEN),
    ),
    CorpusLayer(
        name="llama_moe_universal_calculator",
        origin="pjlab-sys4nlp/llama-moe TopKBalancedNoisyGate (Linear-Tanh-Linear, noise off) + UniversalCalculator "
               "(sort, bincount().tolist() split, index_add) + LinearGLUExperts (ParameterList)",
        style="host_loop",
        make=make_llama_moe,
        input_shape=(2, 16, HIDDEN),
    ),
]
