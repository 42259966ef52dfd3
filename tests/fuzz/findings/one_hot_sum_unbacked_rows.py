"""Finding A5 (fuzzer, inductor mode; class: moe_compile, open): ``RuntimeError: Ne(u0, 0)`` from moe_compile's
generated code where plain Inductor runs.

A per-expert ``torch.where`` loop (transformers 4.x style) in training, one token, top-2 of 3 experts: one expert gets
no token. ``deterministic_accumulate`` rule (b) rewrites the backward of ``x[tok]`` (``index_put(accumulate=True)``
into ``[T, H]`` zeros) into a one-hot GEMM; its traced ``src.reshape(idx_M.shape[0], -1)`` has an unbacked row count
``M`` (the ``nonzero``'s), and inferring ``-1`` makes the tracer assume ``M != 0``; Inductor emits that as a runtime
assert, which fails for the expert with no token. Fix (``moe_compile/passes/deterministic_accumulate.py``,
``_one_hot_sum``): reshape to an explicit width computed outside the traced function,
``width = prod(base.shape[1:])``, ``src.reshape(idx_M.shape[0], width)`` (main, cdff8a9).

    python tests/fuzz/findings/one_hot_sum_unbacked_rows.py [moe_compile|inductor]
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn

import moe_compile  # noqa: F401


class GradScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, scale):
        ctx.scale = scale
        return t.clone()

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


class Loop(nn.Module):
    def __init__(self, E=3, H=8, I=8):  # noqa: E741
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.router = nn.Parameter((H ** -0.5 * torch.randn(E, H, generator=gen)).bfloat16())
        self.w13 = nn.Parameter((H ** -0.5 * torch.randn(E, 2 * I, H, generator=gen)).bfloat16())
        self.w2 = nn.Parameter((I ** -0.5 * torch.randn(E, H, I, generator=gen)).bfloat16())

    def forward(self, x):
        w, idx = torch.topk(F.linear(x, self.router).float().softmax(-1), 2, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros(x.shape, dtype=torch.float32)
        for e in range(self.router.shape[0]):
            tok, kpos = torch.where(idx == e)
            gate, up = F.linear(x[tok], self.w13[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.w2[e]).float() * w[tok, kpos, None]
            out.index_add_(0, tok, GradScale.apply(y, 0.5))
        return out.to(x.dtype)


backend = sys.argv[1] if len(sys.argv) > 1 else "moe_compile"
model = Loop()
x = torch.randn(1, 8, generator=torch.Generator().manual_seed(1)).bfloat16().requires_grad_()
compiled = torch.compile(model, backend=backend, fullgraph=True)
with torch._inductor.config.patch(force_disable_caches=True):
    cot = torch.randn(1, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    (compiled(x).double() * cot).sum().backward()
print(backend, "ok")
# torch 2.13.0+cpu: at dccff49 moe_compile -> RuntimeError: Ne(u0, 0) (from the generated code), inductor -> ok;
# from cdff8a9 on both ok
