# abort [passes] seed=38303,tokens=1,hidden=8,inter=16,experts=8,align=16,depth=2,x_grad=False,frozen=router,entry=default,validate=True,second_call=new_shape,topk_on=logits,renorm=none,dispatch=expert_choice,mlp=geglu,bias=True,shared=gated
#   FINDINGS B4: the process died (SIGABRT, an index check in Inductor's generated code) before the workaround in moe_compile/inductor_workarounds/expand_size_one.py
"""MoE layer written by tests.fuzz: seed=38303,tokens=1,hidden=8,inter=16,experts=8,align=16,depth=2,x_grad=False,frozen=router,entry=default,validate=True,second_call=new_shape,topk_on=logits,renorm=none,dispatch=expert_choice,mlp=geglu,bias=True,shared=gated"""

import itertools  # noqa: F401

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, dtype=torch.bfloat16, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.num_experts, self.top_k, self.align = 8, 2, 16
        self.router = nn.Parameter((8 ** -0.5 * torch.randn(8, 8, generator=gen)).to(dtype))
        self.w13_EIH = nn.Parameter((8 ** -0.5 * torch.randn(8, 32, 8, generator=gen)).to(dtype))
        self.w2_EHI = nn.Parameter((16 ** -0.5 * torch.randn(8, 8, 16, generator=gen)).to(dtype))
        self.b13_EI = nn.Parameter((0.1 * torch.randn(8, 32, generator=gen)).to(dtype))
        self.b2_EH = nn.Parameter((0.1 * torch.randn(8, 8, generator=gen)).to(dtype))
        self.s_up = nn.Parameter((8 ** -0.5 * torch.randn(32, 8, generator=gen)).to(dtype))
        self.s_down = nn.Parameter((16 ** -0.5 * torch.randn(8, 16, generator=gen)).to(dtype))
        self.s_gate = nn.Parameter((8 ** -0.5 * torch.randn(1, 8, generator=gen)).to(dtype))

    def forward(self, x):
        x_TH = x
        T, H = x_TH.shape
        E, K = self.num_experts, self.top_k
        logits_TE = F.linear(x_TH, self.router).float()
        top_TK, idx_TK = torch.topk(logits_TE, K, dim=-1)
        w_TK = top_TK.softmax(-1)
        scores_TE = logits_TE.softmax(-1)
        C = max(1, 2 * T // E)
        g_EC, tok_EC = torch.topk(scores_TE.t(), C, dim=-1)
        y_ECH = self.all_experts(x_TH[tok_EC])
        y_NH = y_ECH.reshape(-1, H).float() * g_EC.reshape(-1, 1)
        out_TH = torch.zeros(T, H, dtype=y_NH.dtype, device=x_TH.device)
        out_TH.index_add_(0, tok_EC.reshape(-1), y_NH)
        out_TH = out_TH.to(x_TH.dtype)
        gate_TI, up_TI = F.linear(x_TH, self.s_up).chunk(2, dim=-1)
        shared_TH = F.linear(F.silu(gate_TI) * up_TI, self.s_down)
        shared_TH = shared_TH * torch.sigmoid(F.linear(x_TH, self.s_gate))
        out_TH = out_TH + shared_TH
        return out_TH

    def all_experts(self, x_ERH):
        h = torch.bmm(x_ERH, self.w13_EIH.transpose(-2, -1)) + self.b13_EI[:, None]
        gate, up = h.chunk(2, dim=-1)
        a = F.gelu(gate) * up
        return torch.bmm(a, self.w2_EHI.transpose(-2, -1)) + self.b2_EH[:, None]


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

    result = check_module(sys.modules[__name__], Spec(seed=38303, tokens=1, hidden=8, inter=16, experts=8, top_k=2, align=16, batch3d=False, depth=2, dtype='bf16', mode='train', x_grad=False, frozen='router', entry='default', dynamic=False, validate=True, second_call='new_shape', router='param', router_dtype='fp32', score='softmax', topk_on='logits', groups=0, expert_bias=False, renorm='none', route_scale=1.0, router_fn='none', weights_dtype='fp32', aux_loss=False, dispatch='expert_choice', flatten='reshape', permute='sort', token='div', gather='index', counts='histc', count_place='device', offsets='cumsum_int32', padding='none', exec='grouped_mm', select='eq', layout='stacked_cat', mlp='geglu', glu_split='chunk', bias=True, weight='rows_fp32', combine='index_add', shared='gated', rows_fn='none'), backend='passes')
    print(result.summary())
    sys.exit(0 if result.ok else 1)
