# validation_refused [passes] seed=3896,tokens=8,inter=8,align=16,depth=2,mode=eval_grad,x_grad=False,frozen=router,validate=True,second_call=new_shape,score=softmax_dtype,groups=2,expert_bias=True,renorm=sum_inplace,route_scale=2.5,flatten=view,permute=argsort_method_gather,token=floor_divide,gather=index_select,counts=bincount,layout=module_list,mlp=swiglu_manual,bias=True,weight=rows_act,shared=plain
#   rewrites: deterministic_accumulate, fuse_dispatch; worst: grad:blocks.1.experts.0.gate_proj.bias (0.554 of bound); 19.1 s
#   fuse_dispatch: the rewrite changed the results; worst: grad of input 5: max (vs the reference) error 4.75e+04 > bound 3.81e+04; kept the original graph; fuse_dispatch: the rewrite changed the results; worst: grad of input 5: max (vs the reference) error 4.75e+04 > bound 3.81e+04; kept the original graph
#   tensor: |moe - ref| |eager - ref| |plain - ref| bound ratio
#     grad:blocks.1.experts.0.gate_proj.bias: 0.0528 0.0215 - 0.0953 0.554
#     grad:blocks.1.experts.1.down_proj.weight: 0.917 0.352 - 1.66 0.553
#     grad:blocks.1.experts.0.gate_proj.weight: 0.338 0.158 - 0.696 0.486
#     grad:blocks.1.s_down: 0.488 0.238 - 1.06 0.461
#     grad:blocks.0.experts.1.down_proj.bias: 0.156 0.0784 - 0.355 0.439
#     grad:blocks.1.s_up: 0.813 0.433 - 2.02 0.403
#     grad:blocks.1.experts.0.down_proj.weight: 0.155 0.0925 - 0.39 0.397
#     grad:blocks.0.experts.0.down_proj.weight: 0.508 0.288 - 1.3 0.391
"""MoE layer written by tests.fuzz: seed=3896,tokens=8,inter=8,align=16,depth=2,mode=eval_grad,x_grad=False,frozen=router,validate=True,second_call=new_shape,score=softmax_dtype,groups=2,expert_bias=True,renorm=sum_inplace,route_scale=2.5,flatten=view,permute=argsort_method_gather,token=floor_divide,gather=index_select,counts=bincount,layout=module_list,mlp=swiglu_manual,bias=True,weight=rows_act,shared=plain"""

import itertools  # noqa: F401

import torch
import torch.nn.functional as F
from torch import nn


class SigmoidGate(nn.Module):
    def forward(self, g):
        return g * torch.sigmoid(g)


class Expert(nn.Module):
    def __init__(self, hidden, inter):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=True)
        self.up_proj = nn.Linear(hidden, inter, bias=True)
        self.down_proj = nn.Linear(inter, hidden, bias=True)
        self.act_fn = SigmoidGate()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, dtype=torch.bfloat16, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.num_experts, self.top_k, self.align = 4, 2, 16
        self.router = nn.Parameter((16 ** -0.5 * torch.randn(4, 16, generator=gen)).to(dtype))
        self.register_buffer('e_bias', 0.1 * torch.randn(4, generator=gen))
        self.experts = nn.ModuleList(Expert(16, 8) for _ in range(4)).to(dtype)
        with torch.no_grad():
            for p in self.experts.parameters():
                scale = 0.1 if p.dim() == 1 else p.shape[-1] ** -0.5
                p.copy_(scale * torch.randn(p.shape, generator=gen))
        self.s_up = nn.Parameter((16 ** -0.5 * torch.randn(16, 16, generator=gen)).to(dtype))
        self.s_down = nn.Parameter((8 ** -0.5 * torch.randn(16, 8, generator=gen)).to(dtype))

    def forward(self, x):
        x_TH = x
        T, H = x_TH.shape
        E, K = self.num_experts, self.top_k
        logits_TE = F.linear(x_TH, self.router).float()
        scores_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
        choice_TE = scores_TE + self.e_bias
        group_TG = choice_TE.view(T, 2, 2).topk(2, dim=-1)[0].sum(-1)
        gidx_TG = torch.topk(group_TG, k=1, dim=-1, sorted=False)[1]
        gmask_TG = torch.zeros_like(group_TG).scatter_(1, gidx_TG, 1)
        smask_TE = gmask_TG.unsqueeze(-1).expand(T, 2, 2).reshape(T, E)
        choice_TE = choice_TE.masked_fill(~smask_TE.bool(), 0.0)
        idx_TK = torch.topk(choice_TE, K, dim=-1, sorted=False)[1]
        w_TK = scores_TE.gather(1, idx_TK)
        w_TK /= w_TK.sum(dim=-1, keepdim=True)
        w_TK = w_TK * 2.5
        ids_S = idx_TK.view(-1)
        perm_S = ids_S.argsort(stable=True)
        ids_sorted_S = ids_S.gather(0, perm_S)
        token_S = torch.div(perm_S, K, rounding_mode='floor')
        w_S = w_TK.reshape(-1)[perm_S]
        rows_SH = x_TH.index_select(0, token_S)
        counts_E = torch.bincount(ids_S, minlength=E)
        ys_SH = self.grouped(rows_SH, torch.cumsum(counts_E, 0, dtype=torch.int32), ids_sorted_S)
        ys_SH = ys_SH * w_S.unsqueeze(-1).to(ys_SH.dtype)
        out_TH = torch.zeros(T, H, dtype=ys_SH.dtype, device=ys_SH.device)
        out_TH.index_add_(0, token_S, ys_SH)
        out_TH = out_TH.to(x_TH.dtype)
        gate_TI, up_TI = F.linear(x_TH, self.s_up).chunk(2, dim=-1)
        shared_TH = F.linear(F.silu(gate_TI) * up_TI, self.s_down)
        out_TH = out_TH + shared_TH
        return out_TH

    def grouped(self, rows, offs, ids=None):
        h = torch._grouped_mm(rows, torch.stack([m.gate_proj.weight for m in self.experts]).transpose(-2, -1), offs=offs) + torch.stack([m.gate_proj.bias for m in self.experts])[ids]
        gate = h
        up = torch._grouped_mm(rows, torch.stack([m.up_proj.weight for m in self.experts]).transpose(-2, -1), offs=offs) + torch.stack([m.up_proj.bias for m in self.experts])[ids]
        a = gate * torch.sigmoid(gate) * up
        return torch._grouped_mm(a, torch.stack([m.down_proj.weight for m in self.experts]).transpose(-2, -1), offs=offs) + torch.stack([m.down_proj.bias for m in self.experts])[ids]


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

    result = check_module(sys.modules[__name__], Spec(seed=3896, tokens=8, hidden=16, inter=8, experts=4, top_k=2, align=16, batch3d=False, depth=2, dtype='bf16', mode='eval_grad', x_grad=False, frozen='router', entry='fullgraph', dynamic=False, validate=True, second_call='new_shape', router='param', router_dtype='fp32', score='softmax_dtype', topk_on='scores', groups=2, expert_bias=True, renorm='sum_inplace', route_scale=2.5, router_fn='none', weights_dtype='fp32', aux_loss=False, dispatch='sorted', flatten='view', permute='argsort_method_gather', token='floor_divide', gather='index_select', counts='bincount', count_place='device', offsets='cumsum_int32', padding='none', exec='grouped_mm', select='eq', layout='module_list', mlp='swiglu_manual', glu_split='chunk', bias=True, weight='rows_act', combine='index_add', shared='plain', rows_fn='none'), backend='passes')
    print(result.summary())
    sys.exit(0 if result.ok else 1)
