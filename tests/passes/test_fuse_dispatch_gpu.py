"""fuse_dispatch on CUDA-traced transformers blocks (``histc`` on int ids there, float ids on CPU).

Through the real backend (Inductor + Triton): the block rewrites once, matches eager in forward and
grads, its forward and backward code holds no atomic add / scatter-add, and two training steps give
bitwise identical outputs and gradients (K=8: plain Inductor's atomic-add backward is not reproducible).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

transformers = pytest.importorskip("transformers")

from tests.models.hf_models import block_output, build_sparse_moe_block  # noqa: E402
from tests.passes._harness import check_rewrite, no_scatter_add  # noqa: E402


def _loss(out):
    return block_output(out).float().pow(2).mean()


def _block_and_input(family, top_k, dtype, tokens=64, seed=0):
    block = build_sparse_moe_block(family, dtype=dtype, device="cuda", seed=seed, num_experts_per_tok=top_k)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    x = torch.randn(2, tokens // 2, block_hidden(block), generator=gen, device="cuda").to(dtype)
    return block, x.requires_grad_(True)


def block_hidden(block) -> int:
    return next(p for n, p in block.named_parameters() if n.endswith("gate.weight")).shape[1]


@pytest.mark.parametrize("family,top_k", [("mixtral", 2), ("qwen3_moe", 8)])
def test_cuda_block_rewrites_matches_eager_no_atomics(family, top_k):
    block, x = _block_and_input(family, top_k, torch.bfloat16)
    run = check_rewrite(block, (x,), {"fuse_dispatch": 1}, backend="moe_compile", train=True,
                        code_checks=[no_scatter_add], loss_fn=_loss)
    (rec,) = [r for r in run.report.rewrites if r.pass_name == "fuse_dispatch"]
    assert "counts(histc)" in rec.what, rec.what  # CUDA graph: histc on int32 ids


def test_cuda_block_training_step_is_bitwise_reproducible():
    block, x = _block_and_input("qwen3_moe", 8, torch.bfloat16, tokens=256)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="moe_compile")

    def step():
        x.grad = None
        for p in block.parameters():
            p.grad = None
        out = block_output(compiled(x))
        _loss(out).backward()
        return [out.detach().clone(), x.grad.clone(), *(p.grad.clone() for p in block.parameters())]

    first = step()
    for _ in range(3):
        again = step()
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    torch._dynamo.reset()


def test_cuda_fp32_block_replaces_fallback():
    """fp32 weights take transformers' grouped_mm_fallback under compile; both passes fire."""
    block, x = _block_and_input("qwen3_moe", 4, torch.float32)
    check_rewrite(block, (x,), {"fuse_dispatch": 1, "replace_grouped_mm_fallback": 2}, backend="moe_compile",
                  train=True, loss_fn=_loss)


def test_cuda_block_inference_rewrites():
    block, x = _block_and_input("mixtral", 2, torch.bfloat16)
    check_rewrite(block, (x.detach(),), {"fuse_dispatch": 1}, backend="moe_compile", train=False,
                  code_checks=[no_scatter_add], loss_fn=_loss)
