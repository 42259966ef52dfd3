"""Tiny MoE models whose routers the ``router_metrics`` pass and ``moe_compile.metrics.attach`` must find.

``RoutedStack(router=...)`` is ``layers`` residual MoE blocks (``layers.{i}.gate`` an ``nn.Linear`` router,
stacked expert matrices ``experts[E, H, H]``); experts are computed densely and gathered by the chosen
ids, so there is no host sync and no dispatch op. Router styles (``T`` tokens, ``E`` experts, ``K`` top-k):

=================  =======================================================================
``router``         how the top-k is taken
=================  =======================================================================
``"softmax"``      ``topk(softmax(logits.float(), -1), K)``, renormalised (Mixtral)
``"qwen"``         ``topk(softmax(logits, dim=-1, dtype=float), K)`` (Qwen-MoE, OLMoE)
``"granite"``      ``topk(logits.float(), K)``, softmax over the K values (Granite-MoE)
``"matmul"``       as ``"softmax"`` with logits ``x @ w_router.T`` from a bare parameter
``"permute_pad"``  as ``"softmax"``, dispatch by ``moe_compile.ops.permute_pad`` /
                   ``unpad_unpermute`` (the form ``fuse_dispatch`` produces)
=================  =======================================================================
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ROUTERS = ("softmax", "qwen", "granite", "matmul", "permute_pad")


class RoutedBlock(nn.Module):
    def __init__(self, hidden: int, experts: int, top_k: int, router: str, gen: torch.Generator) -> None:
        super().__init__()
        if router not in ROUTERS:
            raise ValueError(f"router={router!r} is not one of {ROUTERS}")
        self.router_kind, self.num_experts, self.top_k = router, experts, top_k
        if router == "matmul":
            self.w_router = nn.Parameter(0.5 * torch.randn(experts, hidden, generator=gen))
        else:
            self.gate = nn.Linear(hidden, experts, bias=False)
            with torch.no_grad():
                self.gate.weight.copy_(0.5 * torch.randn(experts, hidden, generator=gen))
        self.experts = nn.Parameter(torch.randn(experts, hidden, hidden, generator=gen) * hidden**-0.5)

    def route(self, x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kind, K = self.router_kind, self.top_k
        if kind == "granite":
            top_TK, idx_TK = self.gate(x_TH).float().topk(K, dim=-1)
            return torch.softmax(top_TK, dim=-1), idx_TK
        if kind == "qwen":
            probs_TE = F.softmax(self.gate(x_TH), dim=-1, dtype=torch.float)
        else:
            logits_TE = x_TH @ self.w_router.t() if kind == "matmul" else self.gate(x_TH)
            probs_TE = torch.softmax(logits_TE.float(), dim=-1)
        w_TK, idx_TK = torch.topk(probs_TE, K, dim=-1)
        return w_TK / w_TK.sum(dim=-1, keepdim=True), idx_TK

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        w_TK, idx_TK = self.route(x_TH)
        if self.router_kind == "permute_pad":
            from moe_compile.ops import permute_pad, unpad_unpermute

            out = permute_pad(x_TH, idx_TK, num_experts=self.num_experts, align=1)
            expert_of_row = torch.searchsorted(
                out.offs_E, torch.arange(out.rows_MH.shape[0], device=x_TH.device), right=True
            )
            expert_of_row = expert_of_row.clamp_max(self.num_experts - 1)
            y_MH = torch.bmm(out.rows_MH.unsqueeze(1), self.experts[expert_of_row]).squeeze(1)
            return x_TH + unpad_unpermute(y_MH, out.row_map, w_TK.to(x_TH.dtype))
        y_TEH = torch.einsum("th,ehd->ted", x_TH, self.experts)
        y_TKH = y_TEH.gather(1, idx_TK.unsqueeze(-1).expand(-1, -1, x_TH.shape[-1]))
        return x_TH + (y_TKH * w_TK.unsqueeze(-1).to(x_TH.dtype)).sum(dim=1)


class RoutedStack(nn.Module):
    """``layers`` routed blocks; ``forward(x_TH) -> [T, H]``."""

    def __init__(self, hidden: int = 16, experts: int = 4, top_k: int = 2, layers: int = 2,
                 router: str = "softmax", seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.layers = nn.ModuleList(RoutedBlock(hidden, experts, top_k, router, gen) for _ in range(layers))

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x_TH = block(x_TH)
        return x_TH

    def router_logits(self, x_TH: torch.Tensor) -> list[torch.Tensor]:
        """Each layer's router logits for input ``x_TH`` (eager, detached): the test oracle's input."""
        logits = []
        with torch.no_grad():
            for block in self.layers:
                gate = block.w_router.t() if block.router_kind == "matmul" else block.gate.weight.t()
                logits.append(x_TH @ gate)
                x_TH = block(x_TH)
        return logits
