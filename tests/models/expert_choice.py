"""Expert-choice routing as public code writes it (Zhou et al. 2022): every expert takes its top-``C`` tokens by
router score, ``x[tok]`` gathers them to ``[E, C, H]``, a batched MLP runs, and ``index_add_`` adds the weighted
results back into the tokens' rows (a token is taken by 0..E experts)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ExpertChoiceMoE(nn.Module):
    def __init__(self, hidden: int, ffn: int, experts: int, capacity_factor: float = 2.0) -> None:
        super().__init__()
        self.experts, self.capacity_factor = experts, capacity_factor
        self.router = nn.Linear(hidden, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, hidden, ffn) / hidden**0.5)
        self.w2 = nn.Parameter(torch.randn(experts, ffn, hidden) / ffn**0.5)

    def capacity(self, tokens: int) -> int:
        return int(tokens * self.capacity_factor / self.experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, H = x.shape
        x = x.reshape(-1, H)
        scores = F.softmax(self.router(x), dim=-1)                            # [T, E]
        gates, tok = torch.topk(scores.t(), self.capacity(x.shape[0]), dim=-1)  # [E, C]: each expert's tokens
        xe = x[tok]                                                           # [E, C, H]
        ye = torch.bmm(F.gelu(torch.bmm(xe, self.w1)), self.w2) * gates.unsqueeze(-1)
        out = torch.zeros_like(x).index_add_(0, tok.reshape(-1), ye.reshape(-1, H))
        return out.reshape(B, S, H)


class SmallBatchExpertChoiceMoE(ExpertChoiceMoE):
    """The same layer with a capacity of at least one token per expert, in integer arithmetic (``max(1, T * f //
    E)``), as code that also runs small batches writes it. With dynamic shapes a call where it is 1 compiles a graph
    for every ``T`` that keeps it 1 (NOTE in ``moe_compile/inductor_workarounds/expand_size_one.py``)."""

    def capacity(self, tokens: int) -> int:
        return max(1, tokens * int(self.capacity_factor) // self.experts)
