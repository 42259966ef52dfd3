"""On-device router metrics: train a 2-layer MoE for 3 steps and print what ``moe_compile.metrics`` saw.

    python examples/router_metrics.py            # moe_compile.compile(model, metrics=True)
    python examples/router_metrics.py --eager    # no compile: moe_compile.metrics.attach(model)

Runs on CPU (or CUDA where present). The metrics are accumulated on the device during the forward
passes; ``collect()`` is the only host read, once, at the end.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch import nn

import moe_compile
from moe_compile import metrics


class MoEBlock(nn.Module):
    """Mixtral-style router (softmax in fp32, top-k, renormalised) and SwiGLU experts (dense, tiny)."""

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.w_gate_up_EIH = nn.Parameter(torch.randn(num_experts, 2 * inter, hidden) * hidden**-0.5)
        self.w_down_EHI = nn.Parameter(torch.randn(num_experts, hidden, inter) * inter**-0.5)

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        probs_TE = torch.softmax(self.gate(x_TH).float(), dim=-1)
        w_TK, idx_TK = torch.topk(probs_TE, self.top_k, dim=-1)
        w_TK = (w_TK / w_TK.sum(dim=-1, keepdim=True)).to(x_TH.dtype)
        gate_TEI, up_TEI = torch.einsum("th,eih->tei", x_TH, self.w_gate_up_EIH).chunk(2, dim=-1)
        y_TEH = torch.einsum("tei,ehi->teh", F.silu(gate_TEI) * up_TEI, self.w_down_EHI)
        y_TKH = y_TEH.gather(1, idx_TK.unsqueeze(-1).expand(-1, -1, x_TH.shape[-1]))
        return (y_TKH * w_TK.unsqueeze(-1)).sum(dim=1)


class TinyMoEModel(nn.Module):
    def __init__(self, vocab: int = 64, hidden: int = 32, layers: int = 2, num_experts: int = 8, top_k: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(nn.ModuleDict({"norm": nn.RMSNorm(hidden),
                                                   "mlp": MoEBlock(hidden, 2 * hidden, num_experts, top_k)})
                                    for _ in range(layers))
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids_BS: torch.Tensor) -> torch.Tensor:
        x_TH = self.embed(ids_BS).flatten(0, 1)
        for layer in self.layers:
            x_TH = x_TH + layer["mlp"](layer["norm"](x_TH))
        return self.head(x_TH)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eager", action="store_true", help="no compile: attach forward hooks instead")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = TinyMoEModel().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if args.eager:
        print("instrumented routers:", metrics.attach(model))
        step_fn = model
    else:
        step_fn = moe_compile.compile(model, metrics=True)

    metrics.reset()
    for _ in range(args.steps):
        ids_BS = torch.randint(0, 64, (4, 16), device=device)
        logits_TV = step_fn(ids_BS)
        loss = F.cross_entropy(logits_TV.float(), ids_BS.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    result = metrics.collect(per_layer=True)  # the one host read
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
