"""Research-code MoE layers:
- Shazeer et al. sparsely-gated MoE as in davidmrau/mixture-of-experts moe.py (noisy_top_k_gating with raw w_gate /
  w_noise, SparseDispatcher: nonzero().sort(0), split by part sizes, index_add combine). The noise is only drawn in
  training, so the corpus builds it in eval mode; the experts' trailing softmax (a classification toy) is omitted.
- Expert-choice routing, Zhou et al. 2022 (arXiv 2202.09368) pseudo-code: softmax over experts, top-k over tokens per
  expert, one-hot permutation einsums.
- Soft MoE, Puigcerver et al., as in lucidrains/soft-moe-pytorch (slot embeddings, dispatch softmax over tokens,
  combine softmax over slots).
- GShard top-2 gating with per-group capacity and its 2-level hierarchical variant, as in
  lucidrains/mixture-of-experts (transcribed from tensor2tensor moe.py; cumsum_exclusive, safe_one_hot, einsum
  dispatch/combine tensors).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._registry import EXPERTS, FFN, HIDDEN, CorpusLayer, materialize


# ---------------------------------------------------------------- davidmrau/mixture-of-experts
class SparseDispatcher:
    def __init__(self, num_experts, gates):
        self._gates = gates
        self._num_experts = num_experts
        sorted_experts, index_sorted_experts = torch.nonzero(gates).sort(0)
        _, self._expert_index = sorted_experts.split(1, dim=1)
        self._batch_index = torch.nonzero(gates)[index_sorted_experts[:, 1], 0]
        self._part_sizes = (gates > 0).sum(0).tolist()
        gates_exp = gates[self._batch_index.flatten()]
        self._nonzero_gates = torch.gather(gates_exp, 1, self._expert_index)

    def dispatch(self, inp):
        inp_exp = inp[self._batch_index].squeeze(1)
        return torch.split(inp_exp, self._part_sizes, dim=0)

    def combine(self, expert_out, multiply_by_gates=True):
        stitched = torch.cat(expert_out, 0)
        if multiply_by_gates:
            stitched = stitched.mul(self._nonzero_gates)
        zeros = torch.zeros(self._gates.size(0), expert_out[-1].size(1), requires_grad=True, device=stitched.device)
        return zeros.index_add(0, self._batch_index, stitched.float())


# davidmrau/mixture-of-experts moe.py :: MLP (without the trailing softmax)
class MLP(nn.Module):
    def __init__(self, input_size, output_size, hidden_size):
        super().__init__()
        self.fc1 = nn.Linear(input_size, hidden_size)
        self.fc2 = nn.Linear(hidden_size, output_size)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.fc2(self.relu(self.fc1(x)))


# davidmrau/mixture-of-experts moe.py :: MoE (noisy_top_k_gating, SparseDispatcher)
class ShazeerMoE(nn.Module):
    def __init__(self, input_size, output_size, num_experts, hidden_size, noisy_gating=True, k=2):
        super().__init__()
        self.noisy_gating = noisy_gating
        self.num_experts = num_experts
        self.output_size = output_size
        self.input_size = input_size
        self.k = k
        self.experts = nn.ModuleList([MLP(input_size, output_size, hidden_size) for _ in range(num_experts)])
        self.w_gate = nn.Parameter(torch.zeros(input_size, num_experts), requires_grad=True)
        self.w_noise = nn.Parameter(torch.zeros(input_size, num_experts), requires_grad=True)
        self.softplus = nn.Softplus()
        self.softmax = nn.Softmax(1)

    def cv_squared(self, x):
        eps = 1e-10
        if x.shape[0] == 1:
            return torch.tensor([0], device=x.device, dtype=x.dtype)
        return x.float().var() / (x.float().mean() ** 2 + eps)

    def _gates_to_load(self, gates):
        return (gates > 0).sum(0)

    def noisy_top_k_gating(self, x, train, noise_epsilon=1e-2):
        clean_logits = x @ self.w_gate
        if self.noisy_gating and train:
            raw_noise_stddev = x @ self.w_noise
            noise_stddev = self.softplus(raw_noise_stddev) + noise_epsilon
            logits = clean_logits + (torch.randn_like(clean_logits) * noise_stddev)
        else:
            logits = clean_logits
        logits = self.softmax(logits)
        top_logits, top_indices = logits.topk(min(self.k + 1, self.num_experts), dim=1)
        top_k_logits = top_logits[:, : self.k]
        top_k_indices = top_indices[:, : self.k]
        top_k_gates = top_k_logits / (top_k_logits.sum(1, keepdim=True) + 1e-6)
        zeros = torch.zeros_like(logits, requires_grad=True)
        gates = zeros.scatter(1, top_k_indices, top_k_gates)
        load = self._gates_to_load(gates)
        return gates, load

    def forward(self, x, loss_coef=1e-2):
        gates, load = self.noisy_top_k_gating(x, self.training)
        importance = gates.sum(0)
        loss = (self.cv_squared(importance) + self.cv_squared(load)) * loss_coef
        dispatcher = SparseDispatcher(self.num_experts, gates)
        expert_inputs = dispatcher.dispatch(x)
        expert_outputs = [self.experts[i](expert_inputs[i]) for i in range(self.num_experts)]
        y = dispatcher.combine(expert_outputs)
        return y.to(x.dtype), loss  # combine() accumulates in fp32; cast back to the input dtype


# ---------------------------------------------------------------- expert choice (paper pseudo-code)
class ExpertChoiceMoE(nn.Module):
    def __init__(self, model_dim, hidden_dim, num_experts, capacity_factor=2):
        super().__init__()
        self.num_experts = num_experts
        self.capacity_factor = capacity_factor
        self.W_g = nn.Parameter(torch.empty(model_dim, num_experts))  # noqa: N815
        self.W_1 = nn.Parameter(torch.empty(num_experts, model_dim, hidden_dim))  # noqa: N815
        self.W_2 = nn.Parameter(torch.empty(num_experts, hidden_dim, model_dim))  # noqa: N815

    def forward(self, X):  # noqa: N803 - X: [G, S, M], one routing group per sequence
        n = X.shape[1]
        k = n * self.capacity_factor // self.num_experts
        S = torch.einsum("gsm,me->gse", X, self.W_g).float().softmax(dim=-1)  # noqa: N806
        G, I = torch.topk(S.transpose(1, 2), k, dim=-1)  # noqa: N806,E741 - [G, E, k]
        P = F.one_hot(I, n).to(X.dtype)  # noqa: N806 - [G, E, k, S]
        X_in = torch.einsum("gsm,geks->gekm", X, P)  # noqa: N806
        H = F.gelu(torch.einsum("gekm,emh->gekh", X_in, self.W_1))  # noqa: N806
        X_e = torch.einsum("gekh,ehm->gekm", H, self.W_2)  # noqa: N806
        return torch.einsum("geks,gek,gekm->gsm", P, G.to(X.dtype), X_e)


# ---------------------------------------------------------------- lucidrains/soft-moe-pytorch
class FeedForward(nn.Module):
    def __init__(self, dim, mult=4):
        super().__init__()
        dim_hidden = int(dim * mult)
        self.net = nn.Sequential(nn.Linear(dim, dim_hidden), nn.GELU(), nn.Linear(dim_hidden, dim))

    def forward(self, x):
        return self.net(x)


# lucidrains/soft-moe-pytorch :: Experts (single-process path, loop over experts)
class Experts(nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.experts = nn.ModuleList(experts)
        self.num_experts = len(experts)

    def forward(self, x):
        x = x.permute(1, 0, 2, 3)  # b e n d -> e b n d
        outs = []
        for expert, expert_input in zip(self.experts, x):
            outs.append(expert(expert_input))
        outs = torch.stack(outs)
        return outs.permute(1, 0, 2, 3)  # e b n d -> b e n d


# lucidrains/soft-moe-pytorch :: SoftMoE (use_layernorm=True)
class SoftMoE(nn.Module):
    def __init__(self, dim, num_experts=4, num_slots=2, expert_mult=0.5):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.slot_norm = nn.LayerNorm(dim)
        self.slot_embeds = nn.Parameter(torch.randn(num_experts, num_slots, dim))
        self.experts = Experts([FeedForward(dim, mult=expert_mult) for _ in range(num_experts)])

    def forward(self, x):
        x = self.norm(x)
        slot_embeds = self.slot_norm(self.slot_embeds)
        logits = torch.einsum("bnd,esd->bnes", x, slot_embeds)
        dispatch_weights = logits.softmax(dim=1)
        combine_weights = logits.flatten(2).softmax(dim=-1)
        slots = torch.einsum("bnd,bnes->besd", x, dispatch_weights)
        out = self.experts(slots)
        out = out.flatten(1, 2)
        return torch.einsum("bsd,bns->bnd", out, combine_weights)


# ---------------------------------------------------------------- lucidrains/mixture-of-experts
MIN_EXPERT_CAPACITY = 4


def top1(t):
    values, index = t.topk(k=1, dim=-1)
    return values.squeeze(dim=-1), index.squeeze(dim=-1)


def cumsum_exclusive(t, dim=-1):
    num_pad_dims = -dim - 1
    pre_padding = (0, 0) * num_pad_dims
    pre_slice = (slice(None),) * num_pad_dims
    padded_t = F.pad(t, (*pre_padding, 1, 0)).cumsum(dim=dim)
    return padded_t[(..., slice(None, -1), *pre_slice)]


def safe_one_hot(indexes, max_length):
    max_index = indexes.max() + 1
    return F.one_hot(indexes, max(int(max_index) + 1, max_length))[..., :max_length]


# lucidrains/mixture-of-experts :: Experts (w1/w2 with leading expert dims, '...' einsums)
class LucidrainsExperts(nn.Module):
    def __init__(self, dim, num_experts, hidden_dim):
        super().__init__()
        num_experts = num_experts if isinstance(num_experts, tuple) else (num_experts,)
        self.w1 = nn.Parameter(torch.zeros(*num_experts, dim, hidden_dim))
        self.w2 = nn.Parameter(torch.zeros(*num_experts, hidden_dim, dim))
        self.act = nn.ReLU()

    def forward(self, x):
        hidden = torch.einsum("...nd,...dh->...nh", x, self.w1)
        hidden = self.act(hidden)
        return torch.einsum("...nh,...hd->...nd", hidden, self.w2)


# lucidrains/mixture-of-experts :: Top2Gating (policy 'all')
class Top2Gating(nn.Module):
    def __init__(self, dim, num_gates, eps=1e-9, outer_expert_dims=tuple(), second_policy="all",
                 capacity_factor_train=1.25, capacity_factor_eval=2.0):
        super().__init__()
        self.eps = eps
        self.num_gates = num_gates
        self.w_gating = nn.Parameter(torch.randn(*outer_expert_dims, dim, num_gates))
        self.second_policy = second_policy
        self.capacity_factor_train = capacity_factor_train
        self.capacity_factor_eval = capacity_factor_eval

    def forward(self, x, importance=None):
        *_, b, group_size, dim = x.shape
        num_gates = self.num_gates
        capacity_factor = self.capacity_factor_train if self.training else self.capacity_factor_eval

        raw_gates = torch.einsum("...bnd,...de->...bne", x, self.w_gating)
        raw_gates = raw_gates.softmax(dim=-1)

        gate_1, index_1 = top1(raw_gates)
        mask_1 = F.one_hot(index_1, num_gates).float()
        density_1_proxy = raw_gates
        if importance is not None:
            equals_one_mask = (importance == 1.0).float()
            mask_1 = mask_1 * equals_one_mask[..., None]
            gate_1 = gate_1 * equals_one_mask
            density_1_proxy = density_1_proxy * equals_one_mask[..., None]

        gates_without_top_1 = raw_gates * (1.0 - mask_1)
        gate_2, index_2 = top1(gates_without_top_1)
        mask_2 = F.one_hot(index_2, num_gates).float()
        if importance is not None:
            greater_zero_mask = (importance > 0.0).float()
            mask_2 = mask_2 * greater_zero_mask[..., None]

        denom = gate_1 + gate_2 + self.eps
        gate_1 = gate_1 / denom
        gate_2 = gate_2 / denom

        density_1 = mask_1.mean(dim=-2)
        density_1_proxy = density_1_proxy.mean(dim=-2)
        loss = (density_1_proxy * density_1).mean() * float(num_gates**2)

        if self.second_policy == "none":
            mask_2 = torch.zeros_like(mask_2)

        expert_capacity = min(group_size, int((group_size * capacity_factor) / num_gates))
        expert_capacity = max(expert_capacity, MIN_EXPERT_CAPACITY)
        expert_capacity_f = float(expert_capacity)

        position_in_expert_1 = cumsum_exclusive(mask_1, dim=-2) * mask_1
        mask_1 = mask_1 * (position_in_expert_1 < expert_capacity_f).float()
        mask_1_count = mask_1.sum(dim=-2, keepdim=True)
        mask_1_flat = mask_1.sum(dim=-1)
        position_in_expert_1 = position_in_expert_1.sum(dim=-1)
        gate_1 = gate_1 * mask_1_flat

        position_in_expert_2 = cumsum_exclusive(mask_2, dim=-2) + mask_1_count
        position_in_expert_2 = position_in_expert_2 * mask_2
        mask_2 = mask_2 * (position_in_expert_2 < expert_capacity_f).float()
        mask_2_flat = mask_2.sum(dim=-1)
        position_in_expert_2 = position_in_expert_2.sum(dim=-1)
        gate_2 = gate_2 * mask_2_flat

        combine_tensor = (
            gate_1[..., None, None]
            * mask_1_flat[..., None, None]
            * F.one_hot(index_1, num_gates)[..., None]
            * safe_one_hot(position_in_expert_1.long(), expert_capacity)[..., None, :]
            + gate_2[..., None, None]
            * mask_2_flat[..., None, None]
            * F.one_hot(index_2, num_gates)[..., None]
            * safe_one_hot(position_in_expert_2.long(), expert_capacity)[..., None, :]
        )
        combine_tensor = combine_tensor.to(x.dtype)  # the masks above are fp32; match the activations' dtype
        dispatch_tensor = combine_tensor.bool().to(combine_tensor)
        return dispatch_tensor, combine_tensor, loss


# lucidrains/mixture-of-experts :: MoE
class LucidrainsMoE(nn.Module):
    def __init__(self, dim, num_experts=16, hidden_dim=None, loss_coef=1e-2):
        super().__init__()
        self.num_experts = num_experts
        self.gate = Top2Gating(dim, num_gates=num_experts)
        self.experts = LucidrainsExperts(dim, num_experts, hidden_dim)
        self.loss_coef = loss_coef

    def forward(self, inputs, **kwargs):
        _b, _n, d, e = *inputs.shape, self.num_experts
        dispatch_tensor, combine_tensor, loss = self.gate(inputs)
        expert_inputs = torch.einsum("bnd,bnec->ebcd", inputs, dispatch_tensor)
        orig_shape = expert_inputs.shape
        expert_inputs = expert_inputs.reshape(e, -1, d)
        expert_outputs = self.experts(expert_inputs)
        expert_outputs = expert_outputs.reshape(*orig_shape)
        output = torch.einsum("ebcd,bnec->bnd", expert_outputs, combine_tensor)
        return output, loss * self.loss_coef


# lucidrains/mixture-of-experts :: HeirarchicalMoE (spelling as upstream)
class HeirarchicalMoE(nn.Module):
    def __init__(self, dim, num_experts=(2, 4), hidden_dim=None, loss_coef=1e-2):
        super().__init__()
        num_experts_outer, num_experts_inner = num_experts
        self.num_experts_outer = num_experts_outer
        self.num_experts_inner = num_experts_inner
        self.gate_outer = Top2Gating(dim, num_gates=num_experts_outer)
        self.gate_inner = Top2Gating(dim, num_gates=num_experts_inner, outer_expert_dims=(num_experts_outer,))
        self.experts = LucidrainsExperts(dim, num_experts, hidden_dim)
        self.loss_coef = loss_coef

    def forward(self, inputs, **kwargs):
        _b, _n, d, eo, ei = *inputs.shape, self.num_experts_outer, self.num_experts_inner
        dispatch_tensor_outer, combine_tensor_outer, loss_outer = self.gate_outer(inputs)
        expert_inputs_outer = torch.einsum("bnd,bnec->ebcd", inputs, dispatch_tensor_outer)
        importance = combine_tensor_outer.permute(2, 0, 3, 1).sum(dim=-1)
        importance = 0.5 * ((importance > 0.5).float() + (importance > 0.0).float())
        dispatch_tensor_inner, combine_tensor_inner, loss_inner = self.gate_inner(
            expert_inputs_outer, importance=importance
        )
        expert_inputs = torch.einsum("ebnd,ebnfc->efbcd", expert_inputs_outer, dispatch_tensor_inner)
        orig_shape = expert_inputs.shape
        expert_inputs = expert_inputs.reshape(eo, ei, -1, d)
        expert_outputs = self.experts(expert_inputs)
        expert_outputs = expert_outputs.reshape(*orig_shape)
        expert_outputs_outer = torch.einsum("efbcd,ebnfc->ebnd", expert_outputs, combine_tensor_inner)
        output = torch.einsum("ebcd,bnec->bnd", expert_outputs_outer, combine_tensor_outer)
        return output, (loss_outer + loss_inner) * self.loss_coef


def make_shazeer(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: ShazeerMoE(HIDDEN, HIDDEN, EXPERTS, FFN, noisy_gating=True, k=2), dtype, seed,
                       train=False)


def make_expert_choice(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: ExpertChoiceMoE(HIDDEN, FFN, EXPERTS, capacity_factor=2), dtype, seed)


def make_soft_moe(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: SoftMoE(HIDDEN, num_experts=4, num_slots=2), dtype, seed)


def make_lucidrains(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: LucidrainsMoE(HIDDEN, num_experts=EXPERTS, hidden_dim=FFN), dtype, seed)


def make_hierarchical(dtype: torch.dtype, seed: int) -> nn.Module:
    return materialize(lambda: HeirarchicalMoE(HIDDEN, num_experts=(2, 4), hidden_dim=FFN), dtype, seed)


LAYERS = [
    CorpusLayer(
        name="shazeer_sparse_dispatcher",
        origin="davidmrau/mixture-of-experts moe.py noisy_top_k_gating + SparseDispatcher (eval mode: no noise)",
        style="host_loop",
        make=make_shazeer,
        input_shape=(32, HIDDEN),
        returns_tuple=True,
    ),
    CorpusLayer(
        name="expert_choice_paper_onehot",
        origin="Zhou et al. 2022 expert-choice routing pseudo-code (topk over tokens, one_hot P, einsum gecs)",
        style="expert_choice",
        make=make_expert_choice,
        input_shape=(2, 16, HIDDEN),
    ),
    CorpusLayer(
        name="soft_moe_slots",
        origin="lucidrains/soft-moe-pytorch SoftMoE (slot_embeds, dispatch softmax over n, combine softmax over slots)",
        style="other",
        make=make_soft_moe,
        input_shape=(2, 16, HIDDEN),
    ),
    CorpusLayer(
        name="lucidrains_gshard_top2",
        origin="lucidrains/mixture-of-experts Top2Gating + MoE (cumsum_exclusive, safe_one_hot, einsum bnd,bnec->ebcd)",
        style="capacity",
        make=make_lucidrains,
        input_shape=(2, 16, HIDDEN),
        returns_tuple=True,
    ),
    CorpusLayer(
        name="lucidrains_hierarchical_moe",
        origin="lucidrains/mixture-of-experts HeirarchicalMoE (2x4 experts, outer + inner Top2Gating, importance)",
        style="capacity",
        make=make_hierarchical,
        input_shape=(2, 16, HIDDEN),
        returns_tuple=True,
    ),
]
