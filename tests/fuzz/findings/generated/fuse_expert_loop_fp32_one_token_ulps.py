# validation_refused [passes] seed=63188,tokens=1,inter=16,top_k=3,depth=2,dtype=fp32,frozen=router,validate=True,router_dtype=linear_fp32,route_scale=2.5,aux_loss=True,dispatch=loop,layout=module_list,mlp=geglu_tanh,bias=True,weight=before_experts
#   rewrites: -; worst: grad:blocks.1.experts.1.up_proj.bias (0.405 of bound); 7.1 s
#   fuse_expert_loop: the rewrite changed the results; worst: grad of input 11: max (vs the reference) error 2.84e-06 > bound 2.12e-06; kept the original graph; fuse_expert_loop: the rewrite changed the results; worst: grad of input 11: max (vs the reference) error 2.84e-06 > bound 2.12e-06; kept the original graph
#   tensor: |moe - ref| |eager - ref| |plain - ref| bound ratio
#     grad:blocks.1.experts.1.up_proj.bias: 5.78e-08 3.09e-08 - 1.43e-07 0.405
#     grad:blocks.0.experts.3.gate_proj.bias: 9.08e-07 6.69e-07 - 2.83e-06 0.321
#     grad:blocks.0.experts.3.gate_proj.weight: 1.9e-06 1.42e-06 - 6e-06 0.317
#     grad:blocks.0.experts.0.gate_proj.bias: 2.41e-07 1.84e-07 - 8.3e-07 0.29
#     grad:blocks.0.experts.0.gate_proj.weight: 2.18e-07 1.71e-07 - 7.7e-07 0.283
#     grad:blocks.1.experts.0.up_proj.bias: 3.25e-07 2.78e-07 - 1.2e-06 0.27
#     grad:blocks.1.experts.1.up_proj.weight: 2.46e-08 2.1e-08 - 9.26e-08 0.266
#     grad:blocks.0.experts.3.down_proj.weight: 7.4e-07 6.69e-07 - 2.8e-06 0.264
"""MoE layer written by tests.fuzz: seed=63188,tokens=1,inter=16,top_k=3,depth=2,dtype=fp32,frozen=router,validate=True,router_dtype=linear_fp32,route_scale=2.5,aux_loss=True,dispatch=loop,layout=module_list,mlp=geglu_tanh,bias=True,weight=before_experts"""

import itertools  # noqa: F401

import torch
import torch.nn.functional as F
from torch import nn


class Expert(nn.Module):
    def __init__(self, hidden, inter):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=True)
        self.up_proj = nn.Linear(hidden, inter, bias=True)
        self.down_proj = nn.Linear(inter, hidden, bias=True)
        self.act_fn = nn.GELU(approximate='tanh')

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, dtype=torch.bfloat16, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.num_experts, self.top_k, self.align = 4, 3, 8
        self.router = nn.Parameter((16 ** -0.5 * torch.randn(4, 16, generator=gen)).to(dtype))
        self.experts = nn.ModuleList(Expert(16, 16) for _ in range(4)).to(dtype)
        with torch.no_grad():
            for p in self.experts.parameters():
                scale = 0.1 if p.dim() == 1 else p.shape[-1] ** -0.5
                p.copy_(scale * torch.randn(p.shape, generator=gen))

    def forward(self, x):
        x_TH = x
        T, H = x_TH.shape
        E, K = self.num_experts, self.top_k
        logits_TE = F.linear(x_TH.float(), self.router.float())
        scores_TE = logits_TE.softmax(-1)
        w_TK, idx_TK = torch.topk(scores_TE, K, dim=-1)
        w_TK = w_TK / w_TK.sum(-1, keepdim=True)
        w_TK = w_TK * 2.5
        out_TH = torch.zeros_like(x_TH)
        for e in range(E):
            tok, kpos = torch.where(idx_TK == e)
            w_R = w_TK[tok, kpos, None]
            rows_RH = x_TH[tok]
            y_RH = self.expert(e, rows_RH * w_R.to(rows_RH.dtype))
            out_TH.index_add_(0, tok, y_RH.to(out_TH.dtype))
        out_TH = out_TH.to(x_TH.dtype)
        if self.training:
            frac_E = F.one_hot(idx_TK, E).sum((0, 1)).float() / (T * K)
            aux = E * (frac_E * scores_TE.float().mean(0)).sum()
            return out_TH, aux
        return out_TH

    def expert(self, e, rows):
        return self.experts[e](rows)


class Layer(nn.Module):
    """2 MoE blocks with residual connections (the aux losses summed)."""

    def __init__(self, dtype=torch.bfloat16, seed=0):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dtype, seed + i) for i in range(2))

    def forward(self, x):
        aux = None
        for block in self.blocks:
            out = block(x)
            if isinstance(out, tuple):
                out, a = out
                aux = a if aux is None else aux + a
            x = x + out
        return x if aux is None else (x, aux)



if __name__ == "__main__":
    import sys

    from tests.fuzz.grammar import Spec
    from tests.fuzz.harness import check_module

    result = check_module(sys.modules[__name__], Spec(seed=63188, tokens=1, hidden=16, inter=16, experts=4, top_k=3, align=8, batch3d=False, depth=2, dtype='fp32', mode='train', x_grad=True, frozen='router', entry='fullgraph', dynamic=False, validate=True, second_call='none', router='param', router_dtype='linear_fp32', score='softmax', topk_on='scores', groups=0, expert_bias=False, renorm='sum', route_scale=2.5, router_fn='none', weights_dtype='fp32', aux_loss=True, dispatch='loop', flatten='reshape', permute='sort', token='div', gather='index', counts='histc', count_place='device', offsets='cumsum_int32', padding='none', exec='grouped_mm', select='eq', layout='module_list', mlp='geglu_tanh', glu_split='chunk', bias=True, weight='before_experts', combine='index_add', shared='none', rows_fn='none'), backend='passes')
    print(result.summary())
    sys.exit(0 if result.ok else 1)
