"""MoE blocks written as Python loops over experts (transformers 4.x / research-code style).

``LoopMoE`` routes with ``gate`` (softmax in fp32 -> top-k -> renormalised), then loops over the experts hit
(``nonzero``), selects their tokens with ``torch.where(mask[e])``, runs the expert's MLP, weights it (before or
after the MLP) and ``index_add_``s it into the output. Dynamo cannot capture the loop (data-dependent trip count).

Layouts: ``"module_list"`` (``experts[e]`` is an ``ExpertMLP``) or ``"stacked"`` (``experts.w1 [E, I, H]`` ...).
MLPs: ``"swiglu"`` (``w2(silu(w1 x) * w3 x)``, no bias) or ``"gelu_bias"`` (``fc2(gelu(fc1 x))``, with bias).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MLPS = ("swiglu", "gelu_bias")
LAYOUTS = ("module_list", "stacked")


class ExpertMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, mlp: str):
        super().__init__()
        self.mlp = mlp
        if mlp == "swiglu":
            self.w1 = nn.Linear(hidden, inter, bias=False)
            self.w3 = nn.Linear(hidden, inter, bias=False)
            self.w2 = nn.Linear(inter, hidden, bias=False)
            self.act_fn = nn.SiLU()
        else:
            self.fc1 = nn.Linear(hidden, inter)
            self.fc2 = nn.Linear(inter, hidden)
            self.act_fn = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mlp == "swiglu":
            return self.w2(self.act_fn(self.w1(x)) * self.w3(x))
        return self.fc2(self.act_fn(self.fc1(x)))


class StackedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, inter: int, mlp: str):
        super().__init__()
        self.mlp, self.num_experts = mlp, num_experts
        shapes = {"w1": (inter, hidden), "w3": (inter, hidden), "w2": (hidden, inter)} if mlp == "swiglu" else {
            "fc1": (inter, hidden), "fc2": (hidden, inter)}
        for name, (n, k) in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.randn(num_experts, n, k) / k**0.5))
            if mlp != "swiglu":
                self.register_parameter(name + "_bias", nn.Parameter(torch.randn(num_experts, n) * 0.1))
        self.act_fn = nn.SiLU() if mlp == "swiglu" else nn.GELU()

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        if self.mlp == "swiglu":
            return F.linear(self.act_fn(F.linear(x, self.w1[e])) * F.linear(x, self.w3[e]), self.w2[e])
        h = self.act_fn(F.linear(x, self.fc1[e], self.fc1_bias[e]))
        return F.linear(h, self.fc2[e], self.fc2_bias[e])


class LoopMoE(nn.Module):
    """``block(x_BSH) -> y_BSH``: top-``k`` of ``num_experts`` experts, run in a ``nonzero``-driven loop."""

    def __init__(self, hidden: int = 32, inter: int = 48, num_experts: int = 8, top_k: int = 2,
                 mlp: str = "swiglu", layout: str = "module_list", weights_before: bool = False):
        super().__init__()
        if mlp not in MLPS or layout not in LAYOUTS:
            raise ValueError(f"mlp={mlp!r} must be one of {MLPS}, layout={layout!r} one of {LAYOUTS}")
        self.num_experts, self.top_k, self.weights_before, self.layout = num_experts, top_k, weights_before, layout
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        if layout == "module_list":
            self.experts = nn.ModuleList(ExpertMLP(hidden, inter, mlp) for _ in range(num_experts))
        else:
            self.experts = StackedExperts(num_experts, hidden, inter, mlp)

    def run_expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self.experts[e](x) if self.layout == "module_list" else self.experts.expert(e, x)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x_TH = hidden.reshape(-1, hidden.shape[-1])
        probs_TE = torch.softmax(self.gate(x_TH), dim=-1, dtype=torch.float32)
        weights_TK, ids_TK = torch.topk(probs_TE, self.top_k, dim=-1)
        weights_TK = (weights_TK / weights_TK.sum(dim=-1, keepdim=True)).to(x_TH.dtype)
        out_TH = torch.zeros_like(x_TH)
        mask_EKT = F.one_hot(ids_TK, self.num_experts).permute(2, 1, 0)
        for e in torch.nonzero(mask_EKT.sum(dim=(1, 2)) > 0).flatten().tolist():
            k_pos, tokens = torch.where(mask_EKT[e])
            x = x_TH[tokens]
            w = weights_TK[tokens, k_pos, None]
            if self.weights_before:
                y = self.run_expert(e, x * w)
            else:
                y = self.run_expert(e, x) * w
            out_TH.index_add_(0, tokens, y.to(out_TH.dtype))
        return out_TH.reshape(hidden.shape)


class SigmoidRoutedLoopMoE(LoopMoE):
    """A loop the swap must leave alone: sigmoid routing is none of its router candidates."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x_TH = hidden.reshape(-1, hidden.shape[-1])
        weights_TK, ids_TK = torch.topk(torch.sigmoid(self.gate(x_TH)), self.top_k, dim=-1)
        out_TH = torch.zeros_like(x_TH)
        for e in range(self.num_experts):
            tokens, k_pos = torch.where(ids_TK == e)
            out_TH.index_add_(0, tokens, self.run_expert(e, x_TH[tokens]) * weights_TK[tokens, k_pos, None])
        return out_TH.reshape(hidden.shape)


class LogitsLoopMoE(LoopMoE):
    """transformers 4.x's return convention: ``(y_BSH, router_logits_TE)``."""

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return super().forward(hidden), self.gate(hidden.reshape(-1, hidden.shape[-1]))


def make_loop_moe(seed: int = 0, dtype: torch.dtype = torch.float32, **kwargs) -> LoopMoE:
    """A :class:`LoopMoE` with seeded random parameters in ``dtype``."""
    torch.manual_seed(seed)
    return LoopMoE(**kwargs).to(dtype)
