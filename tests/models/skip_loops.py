"""MoE layers written as the reference inference code of open MoE releases writes them (DeepSeek-V3's
``inference/model.py`` style): the tokens per expert are counted and read to the host, and the loop skips the experts
that got none::

    weights_TK, ids_TK = self.gate(x_TH)                                  (a Gate module returning both)
    y_TH = torch.zeros_like(x_TH)
    counts = torch.bincount(ids_TK.flatten(), minlength=E).tolist()
    for i in range(E):
        if counts[i] == 0:
            continue
        tok, top = torch.where(ids_TK == i)
        y_TH[tok] += expert_i(x_TH[tok]) * weights_TK[tok, top, None]
    return (y_TH + self.shared_experts(x_TH)).view(shape)

``SkipLoopMoE(experts=...)``: ``"modules"`` (an ``nn.ModuleList`` of SwiGLU MLPs ``w1/w2/w3``) or ``"stacked"``
(``[E, I, H]`` / ``[E, H, I]`` parameters on an experts module, sliced per expert). ``gate``: ``"softmax"``
(softmax, top-k, weights not renormalised) or ``"sigmoid"`` (sigmoid scores, a selection bias that selects but does
not weight, renormalised, scaled: DeepSeek-V3's gate). ``shared``: whether shared experts are added.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

EXPERTS = ("modules", "stacked")
GATES = ("softmax", "sigmoid")


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class StackedExperts(nn.Module):
    """``E`` SwiGLU experts as stacked parameters; ``forward(x, i)`` runs expert ``i``."""

    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(num_experts, inter, hidden) * hidden ** -0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, hidden, inter) * inter ** -0.5)
        self.w3 = nn.Parameter(torch.randn(num_experts, inter, hidden) * hidden ** -0.5)

    def forward(self, x: torch.Tensor, i: int) -> torch.Tensor:
        return F.linear(F.silu(F.linear(x, self.w1[i])) * F.linear(x, self.w3[i]), self.w2[i])


class Gate(nn.Module):
    """Scores, top-k, weights: returns ``(weights_TK, ids_TK)``."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, kind: str, route_scale: float = 2.5) -> None:
        super().__init__()
        self.kind, self.top_k, self.route_scale = kind, top_k, route_scale
        self.weight = nn.Parameter(torch.randn(num_experts, hidden) * hidden ** -0.5)
        self.bias = nn.Parameter(0.1 * torch.randn(num_experts)) if kind == "sigmoid" else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x, self.weight)
        if self.kind == "softmax":
            scores = scores.softmax(dim=-1, dtype=torch.float32)
            weights, ids = torch.topk(scores, self.top_k, dim=-1)
            return weights.type_as(x), ids
        scores = scores.sigmoid()
        original = scores
        ids = torch.topk(scores + self.bias, self.top_k, dim=-1)[1]
        weights = original.gather(1, ids)
        weights = weights / weights.sum(dim=-1, keepdim=True) * self.route_scale
        return weights.type_as(x), ids


class SkipLoopMoE(nn.Module):
    def __init__(self, hidden: int = 16, inter: int = 32, num_experts: int = 8, top_k: int = 2,
                 experts: str = "modules", gate: str = "softmax", shared: bool = True,
                 dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> None:
        super().__init__()
        for name, value, allowed in (("experts", experts, EXPERTS), ("gate", gate, GATES)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        torch.manual_seed(seed)
        self.num_experts, self.kind = num_experts, experts
        self.gate = Gate(hidden, num_experts, top_k, gate)
        if experts == "modules":
            self.experts = nn.ModuleList(MLP(hidden, inter) for _ in range(num_experts))
        else:
            self.experts = StackedExperts(num_experts, hidden, inter)
        self.shared_experts = MLP(hidden, inter) if shared else None
        self.to(dtype)

    def gate_outputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate(x)

    def expert(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return self.experts[i](x) if self.kind == "modules" else self.experts(x, i)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.size()
        x = x.view(-1, shape[-1])
        weights, indices = self.gate_outputs(x)
        y = torch.zeros_like(x)
        counts = torch.bincount(indices.flatten(), minlength=self.num_experts).tolist()
        for i in range(self.num_experts):
            if counts[i] == 0:
                continue
            idx, top = torch.where(indices == i)
            y[idx] += self.expert(i, x[idx]) * weights[idx, top, None]
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y.view(shape)


class SortedSkipLoopMoE(SkipLoopMoE):
    """The same gate and stacked SwiGLU experts as :class:`SkipLoopMoE` (``experts="stacked"``), dispatched on the
    sort path without a host read: choices sorted by expert, ``index_select`` of the rows, grouped GEMMs
    (``torch._grouped_mm``) over the sorted rows, ``scatter_add_`` back. The benchmark's comparison for the
    host-loop layer: what the loop computes, written as the dropless sort-based layer."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**{**kwargs, "experts": "stacked"})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.size()
        x = x.view(-1, shape[-1])
        weights, indices = self.gate_outputs(x)
        top_k = indices.shape[-1]
        ids = indices.reshape(-1)
        _, perm = torch.sort(ids, stable=True)
        token = perm // top_k
        rows = x.index_select(0, token)
        offs = torch.cumsum(torch.bincount(ids, minlength=self.num_experts), 0).to(torch.int32)
        w = self.experts
        h = F.silu(torch._grouped_mm(rows, w.w1.transpose(1, 2), offs=offs)) \
            * torch._grouped_mm(rows, w.w3.transpose(1, 2), offs=offs)
        y = torch._grouped_mm(h, w.w2.transpose(1, 2), offs=offs) * weights.reshape(-1)[perm].unsqueeze(-1)
        out = torch.zeros_like(x).scatter_add_(0, token.unsqueeze(-1).expand(-1, shape[-1]), y)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape)
