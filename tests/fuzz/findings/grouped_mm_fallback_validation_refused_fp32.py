# validation_refused [passes] seed=29638,tokens=5,hidden=8,inter=8,top_k=1,align=16,depth=2,dtype=fp32,mode=eval_grad,validate=True,second_call=new_shape,router=linear,groups=2,renorm=sum_inplace,weights_dtype=act,dispatch=masked,flatten=view,permute=masked_select,counts=histc_max_E,count_place=host,exec=hf_fallback,glu_split=interleaved,weight=before_experts,combine=scatter_add,shared=gated
#   rewrites: deterministic_accumulate, replace_grouped_mm_fallback, strip_host_padding; worst: call1:grad:blocks.1.w2_EHI (0.661 of bound); 6.2 s
#   replace_grouped_mm_fallback: the rewrite changed the results; worst: grad of input 9: max (vs the reference) error 1.05e-06 > bound 7.44e-07; kept the original graph; replace_grouped_mm_fallback: the rewrite changed the results; worst: grad of input 9: max (vs the reference) error 1.05e-06 > bound 7.44e-07; kept the original graph
#   tensor: |moe - ref| |eager - ref| |plain - ref| bound ratio
#     call1:grad:blocks.1.w2_EHI: 8.31e-07 2.31e-07 - 1.26e-06 0.661
#     grad:blocks.1.s_down: 6.65e-07 3.07e-07 - 1.5e-06 0.445
#     call1:grad:blocks.0.w2_EHI: 1.49e-06 1.01e-06 - 4.38e-06 0.34
#     grad:blocks.1.s_gate: 1.7e-07 1.26e-07 - 5.51e-07 0.309
#     out0: 2.79e-07 1.91e-07 - 9.11e-07 0.306
#     call1:grad:x: 9.95e-07 8.02e-07 - 3.55e-06 0.28
#     call1:grad:blocks.0.w13_EIH: 1.04e-06 9e-07 - 3.9e-06 0.266
#     call1:out0: 5.33e-07 4.32e-07 - 2.07e-06 0.258
"""MoE layer written by tests.fuzz: seed=29638,tokens=5,hidden=8,inter=8,top_k=1,align=16,depth=2,dtype=fp32,mode=eval_grad,validate=True,second_call=new_shape,router=linear,groups=2,renorm=sum_inplace,weights_dtype=act,dispatch=masked,flatten=view,permute=masked_select,counts=histc_max_E,count_place=host,exec=hf_fallback,glu_split=interleaved,weight=before_experts,combine=scatter_add,shared=gated"""

import itertools  # noqa: F401

import torch
import torch.nn.functional as F
from torch import nn
import transformers.integrations.moe  # noqa: F401


class Block(nn.Module):
    def __init__(self, dtype=torch.bfloat16, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.num_experts, self.top_k, self.align = 4, 1, 16
        self.gate = nn.Linear(8, 4, bias=False, dtype=dtype)
        with torch.no_grad():
            self.gate.weight.copy_(8 ** -0.5 * torch.randn(4, 8, generator=gen))
        self.w13_EIH = nn.Parameter((8 ** -0.5 * torch.randn(4, 16, 8, generator=gen)).to(dtype))
        self.w2_EHI = nn.Parameter((8 ** -0.5 * torch.randn(4, 8, 8, generator=gen)).to(dtype))
        self.s_up = nn.Parameter((8 ** -0.5 * torch.randn(16, 8, generator=gen)).to(dtype))
        self.s_down = nn.Parameter((8 ** -0.5 * torch.randn(8, 8, generator=gen)).to(dtype))
        self.s_gate = nn.Parameter((8 ** -0.5 * torch.randn(1, 8, generator=gen)).to(dtype))

    def forward(self, x):
        x_TH = x
        T, H = x_TH.shape
        E, K = self.num_experts, self.top_k
        logits_TE = self.gate(x_TH).float()
        scores_TE = logits_TE.softmax(-1)
        choice_TE = scores_TE
        group_TG = choice_TE.view(T, 2, 2).topk(2, dim=-1)[0].sum(-1)
        gidx_TG = torch.topk(group_TG, k=1, dim=-1, sorted=False)[1]
        gmask_TG = torch.zeros_like(group_TG).scatter_(1, gidx_TG, 1)
        smask_TE = gmask_TG.unsqueeze(-1).expand(T, 2, 2).reshape(T, E)
        choice_TE = choice_TE.masked_fill(~smask_TE.bool(), 0.0)
        idx_TK = torch.topk(choice_TE, K, dim=-1, sorted=False)[1]
        w_TK = scores_TE.gather(1, idx_TK)
        w_TK /= w_TK.sum(dim=-1, keepdim=True)
        w_TK = w_TK.to(x_TH.dtype)
        ids_S = idx_TK.view(-1)
        map_ET = torch.zeros(T, E, dtype=torch.bool, device=x_TH.device).scatter(1, idx_TK, True).T.contiguous()
        token_S = torch.arange(T, device=x_TH.device).unsqueeze(0).expand(E, -1).masked_select(map_ET)
        probs_TE = torch.zeros(T, E, dtype=w_TK.dtype, device=x_TH.device).scatter(1, idx_TK, w_TK)
        w_S = probs_TE.T.contiguous().masked_select(map_ET)
        rows_SH, ids_sorted_S, perm_S = x_TH.index_select(0, token_S), None, None
        rows_SH = rows_SH * w_S.unsqueeze(-1).to(rows_SH.dtype)
        counts_E = torch.histc(ids_S.float(), bins=E, min=0, max=E)
        sizes = counts_E.long().tolist()
        offs_E = torch.tensor(sizes, device=rows_SH.device).cumsum(0).to(torch.int32)
        ys_SH = self.grouped(rows_SH, offs_E)
        out_TH = torch.zeros(T, H, dtype=ys_SH.dtype, device=ys_SH.device)
        out_TH.scatter_add_(0, token_S.unsqueeze(1).expand(-1, H), ys_SH)
        out_TH = out_TH.to(x_TH.dtype)
        gate_TI, up_TI = F.linear(x_TH, self.s_up).chunk(2, dim=-1)
        shared_TH = F.linear(F.silu(gate_TI) * up_TI, self.s_down)
        shared_TH = shared_TH * torch.sigmoid(F.linear(x_TH, self.s_gate))
        out_TH = out_TH + shared_TH
        return out_TH

    def grouped(self, rows, offs, ids=None):
        h = torch.ops.transformers.grouped_mm_fallback(rows, self.w13_EIH.transpose(-2, -1), offs=offs)
        gate, up = h[..., ::2], h[..., 1::2]
        a = F.silu(gate) * up
        return torch.ops.transformers.grouped_mm_fallback(a, self.w2_EHI.transpose(-2, -1), offs=offs)


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

    result = check_module(sys.modules[__name__], Spec(seed=29638, tokens=5, hidden=8, inter=8, experts=4, top_k=1, align=16, batch3d=False, depth=2, dtype='fp32', mode='eval_grad', x_grad=True, frozen='none', entry='fullgraph', dynamic=False, validate=True, second_call='new_shape', router='linear', router_dtype='fp32', score='softmax', topk_on='scores', groups=2, expert_bias=False, renorm='sum_inplace', route_scale=1.0, router_fn='none', weights_dtype='act', aux_loss=False, dispatch='masked', flatten='view', permute='masked_select', token='div', gather='index', counts='histc_max_E', count_place='host', offsets='cumsum_int32', padding='none', exec='hf_fallback', select='eq', layout='stacked_cat', mlp='swiglu', glu_split='interleaved', bias=False, weight='before_experts', combine='scatter_add', shared='gated', rows_fn='none'), backend='passes')
    print(result.summary())
    sys.exit(0 if result.ok else 1)
