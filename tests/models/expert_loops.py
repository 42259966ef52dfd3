"""MoE layers written as a Python loop over experts that selects each expert's tokens with ``torch.where``
(what transformers 4.x Mixtral / Qwen2-MoE / DBRX, transformers 5.x's eager experts and most research
code do). Dynamo unrolls the loop under ``fullgraph=True`` (one ``nonzero`` per expert).

``SelectionLoopMoE(experts=..., select=..., weight=...)``:

* ``experts="stacked"``: SwiGLU on slices ``w13_EIH[e]``, ``w2_EHI[e]`` of stacked parameters;
  ``"swiglu_list"``: an ``nn.ModuleList`` of bias-free SwiGLU MLPs; ``"gelu_bias_list"``: an
  ``nn.ModuleList`` of GELU MLPs with biases.
* ``select="one_hot"``: ``kpos, tok = torch.where(one_hot(idx, E).permute(2, 1, 0)[e])`` (transformers);
  ``"eq"``: ``tok, kpos = torch.where(idx == e)``.
* ``weight="after"``: ``MLP(x[tok]) * w[tok, kpos, None]``; ``"before"``: ``MLP(x[tok] * w[tok, kpos, None])``.

``forward(x_TH) -> [T, H]`` accumulates with ``index_add_`` into ``zeros_like(x)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, inter, bias=False)
        self.up = nn.Linear(hidden, inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class GeluMLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, inter)
        self.fc2 = nn.Linear(inter, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


EXPERTS = ("stacked", "swiglu_list", "gelu_bias_list")
SELECTS = ("one_hot", "eq")
WEIGHTS = ("after", "before")


class SelectionLoopMoE(nn.Module):
    def __init__(self, hidden: int = 16, inter: int = 32, num_experts: int = 4, top_k: int = 2,
                 experts: str = "stacked", select: str = "one_hot", weight: str = "after",
                 dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> None:
        super().__init__()
        for name, value, allowed in (("experts", experts, EXPERTS), ("select", select, SELECTS),
                                     ("weight", weight, WEIGHTS)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        torch.manual_seed(seed)
        self.num_experts, self.top_k, self.select, self.weight, self.kind = num_experts, top_k, select, weight, experts
        self.router = nn.Linear(hidden, num_experts, bias=False)
        if experts == "stacked":
            self.w13_EIH = nn.Parameter(torch.randn(num_experts, 2 * inter, hidden) * hidden**-0.5)
            self.w2_EHI = nn.Parameter(torch.randn(num_experts, hidden, inter) * inter**-0.5)
        else:
            cls = SwiGLU if experts == "swiglu_list" else GeluMLP
            self.experts = nn.ModuleList(cls(hidden, inter) for _ in range(num_experts))
        self.to(dtype)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        if self.kind != "stacked":
            return self.experts[e](x)
        gate, up = F.linear(x, self.w13_EIH[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.w2_EHI[e])

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        probs_TK, idx_TK = torch.topk(self.router(x_TH).float().softmax(-1), self.top_k, dim=-1)
        probs_TK = probs_TK.to(x_TH.dtype)  # not renormalised: with K=1 the router would get no gradient
        out_TH = torch.zeros_like(x_TH)
        mask_EKT = F.one_hot(idx_TK, self.num_experts).permute(2, 1, 0)
        for e in range(self.num_experts):
            if self.select == "one_hot":
                kpos, tok = torch.where(mask_EKT[e])
            else:
                tok, kpos = torch.where(idx_TK == e)
            rows = x_TH[tok]
            if self.weight == "before":
                y = self._expert(e, rows * probs_TK[tok, kpos, None])
            else:
                y = self._expert(e, rows) * probs_TK[tok, kpos, None]
            out_TH.index_add_(0, tok, y.to(out_TH.dtype))
        return out_TH
