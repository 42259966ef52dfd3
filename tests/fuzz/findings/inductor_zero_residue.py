"""Finding (fuzzer, inductor mode; class: Inductor, not moe_compile): a gradient exactly zero in eager is rounding
residue under plain Inductor, and so under moe_compile (which rewrites nothing here).

Top-1 routing renormalised (``w /= w.sum()``, so ``w == 1``): the router's gradient is zero in exact arithmetic; eager
PyTorch rounds it to exactly 0.0 for this draw (not for every draw: seed 0 leaves 7e-8 in eager too), Inductor's
fused softmax / top-k / division backward to ~3.5e-7. Not a wrong result (the residue is ~1e-7 of the other
gradients), but it breaks the "exactly zero in eager stays exactly zero" rule under plain Inductor, so the fuzzer
refuses these layers with the tag ``inductor_also`` (``tests/fuzz/known.py``) when moe_compile is no further off.

    python tests/fuzz/findings/inductor_zero_residue.py [inductor|moe_compile|aot_eager] [seed]
"""

import sys

import torch

T, H, E = 8, 16, 8
backend = sys.argv[1] if len(sys.argv) > 1 else "inductor"
g = torch.Generator().manual_seed(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
router = torch.randn(E, H, generator=g).bfloat16().requires_grad_()
x = torch.randn(T, H, generator=g).bfloat16()
cot = torch.randn(T, H, generator=g)


def layer(x, router):
    w, idx = torch.topk((x @ router.T).float().softmax(-1), 1, dim=-1)
    w /= w.sum(dim=-1, keepdim=True)
    return x * w.to(x.dtype)


def router_grad(fn):
    router.grad = None
    (fn(x, router).float() * cot).sum().backward()
    return router.grad.clone()


if backend == "moe_compile":
    import moe_compile  # noqa: F401
eager = router_grad(layer)
torch._dynamo.reset()
compiled = router_grad(torch.compile(layer, backend=backend, fullgraph=True))
print(f"router grad max |.|: eager {eager.abs().max().item():.3g}, {backend} {compiled.abs().max().item():.3g}")
# torch 2.13.0+cpu, seed 1: eager 0, inductor 3.52e-07, moe_compile 3.52e-07, aot_eager 0
