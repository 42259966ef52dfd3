"""GPU tests of the Triton path of ``moe::segment_sum`` and ``moe::gather_segment_sum`` (skipped without CUDA):
the kernel against the CPU reference within the sum's bound, bitwise run to run, and the same values when Inductor
launches it from a compiled graph."""

from __future__ import annotations

import pytest
import torch

from moe_compile.ops import gather_segment_sum, gather_segment_sum_reference, segment_sum, segment_sum_reference
from tests import _tolerance as tol

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _bound(terms_abs_ND, idx_N, keep_N, R, want, dtype):
    """n-term sum in fp32 on both sides (different orders), plus each side's rounding to ``dtype``."""
    mag = torch.zeros(R, terms_abs_ND.shape[1], dtype=torch.float64).index_add_(0, idx_N[keep_N], terms_abs_ND[keep_N])
    n = int(torch.bincount(idx_N[keep_N], minlength=R).max()) + 1 if keep_N.any() else 1
    inner = 2 * tol.gamma(n, torch.float32) * mag
    return inner + 2 * tol.rounding_bound(want, dtype, inner=inner)


# (S source rows, N entries, H, R output rows, dtype, idx sorted); the capacity dispatch's shape: one entry per slot
SHAPES = [(64, 300, 96, 40, torch.float32, False), (512, 4096, 2048, 5120, torch.bfloat16, False),
          (4096, 8192, 1024, 4096, torch.bfloat16, True), (33, 1000, 70, 7, torch.float16, False)]


@pytest.mark.parametrize("S,N,H,R,dtype,idx_sorted", SHAPES)
def test_gather_segment_sum_kernel(S, N, H, R, dtype, idx_sorted):
    gen = torch.Generator().manual_seed(S + N)
    src = torch.randn(S, H, generator=gen).to(dtype)
    src_idx = torch.randint(0, S, (N,), generator=gen)
    idx = torch.randint(0, R, (N,), generator=gen)
    idx = idx.sort().values if idx_sorted else idx
    weight = torch.rand(N, generator=gen)
    mask = torch.rand(N, generator=gen) > 0.2
    want = gather_segment_sum_reference(src, src_idx, idx, R, weight, mask)
    args = [t.cuda() for t in (src, src_idx, idx)]
    got = gather_segment_sum(*args, R, weight.cuda(), mask.cuda(), idx_sorted=idx_sorted, debug=True)
    terms = src.double()[src_idx].abs() * weight.double()[:, None]
    tol.assert_within(got.cpu(), want, _bound(terms, idx, mask, R, want, dtype), "gather_segment_sum cuda vs cpu")
    for _ in range(3):
        assert torch.equal(gather_segment_sum(*args, R, weight.cuda(), mask.cuda(), idx_sorted=idx_sorted), got)
    torch._dynamo.reset()
    compiled = torch.compile(lambda s, w: gather_segment_sum(s, args[1], args[2], R, w, mask.cuda(),
                                                             idx_sorted=idx_sorted), fullgraph=True)
    assert torch.equal(compiled(args[0], weight.cuda()), got)  # Inductor launches the same kernel
    torch._dynamo.reset()


def test_gather_segment_sum_backward_on_cuda():
    """The gradients equal the CPU op's in fp64 up to the sums' order (bound), and repeat bitwise."""
    gen = torch.Generator().manual_seed(3)
    S, N, H, R = 50, 400, 64, 30
    src = torch.randn(S, H, generator=gen, dtype=torch.float64)
    src_idx, idx = torch.randint(0, S, (N,), generator=gen), torch.randint(0, R, (N,), generator=gen)
    weight, mask = torch.randn(N, generator=gen, dtype=torch.float64), torch.rand(N, generator=gen) > 0.3
    g = torch.randn(R, H, generator=gen, dtype=torch.float64)

    def grads(device):
        s, w = src.to(device).requires_grad_(), weight.to(device).requires_grad_()
        out = gather_segment_sum(s, src_idx.to(device), idx.to(device), R, w, mask.to(device))
        return [t.cpu() for t in torch.autograd.grad(out, (s, w), g.to(device))]

    want, got = grads("cpu"), grads("cuda")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)  # fp64 sums of < 40 terms of size ~10
    assert all(torch.equal(a, b) for a, b in zip(grads("cuda"), got))


def test_segment_sum_int32_sort_keys_unchanged_result():
    """``segment_sum`` on CUDA (int32 sort keys) against the CPU reference, masked and out-of-range entries."""
    gen = torch.Generator().manual_seed(5)
    src, idx = torch.randn(3000, 128, generator=gen), torch.randint(-3, 515, (3000,), generator=gen)
    mask = torch.rand(3000, generator=gen) > 0.1
    want = segment_sum_reference(src, idx, 512, mask)
    got = segment_sum(src.cuda(), idx.cuda(), 512, mask.cuda())
    keep = mask & (idx >= 0) & (idx < 512)
    tol.assert_within(got.cpu(), want, _bound(src.double().abs(), idx, keep, 512, want, torch.float32), "segment_sum")


@pytest.mark.parametrize("expert_major", [True, False], ids=["E_C", "C_E"])
def test_by_groups_compiled_has_no_sort_and_matches_segment_sum(expert_major):
    """Expert-choice indices (each expert's top-C tokens) summed by ``segment_sum_by_groups`` under Inductor: no
    sort in the generated code, within the sum's bound of the exact sums, bitwise run to run."""
    from torch._inductor.utils import run_and_get_code

    from moe_compile.ops.segment_sum import segment_sum_by_groups

    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    T, E, C, D = 4096, 64, 128, 256
    scores = torch.rand(T, E, device="cuda", generator=gen)
    n = torch.arange(E * C, device="cuda")
    if expert_major:
        idx, group = torch.topk(scores.t(), C, dim=-1).indices.reshape(-1), n // C
    else:
        idx, group = torch.topk(scores, C, dim=0).indices.reshape(-1), n % E
    src = torch.randn(E * C, D, device="cuda", generator=gen).to(torch.bfloat16)
    torch._dynamo.reset()
    got, code = run_and_get_code(torch.compile(segment_sum_by_groups, fullgraph=True), src, idx, T, group, E)
    assert not [c for c in code if "aten.sort" in c or "torch.sort" in c], "a sort in the compiled code"
    exact = torch.zeros(T, D, dtype=torch.float64, device="cuda").index_add_(0, idx, src.double())
    keep = torch.ones_like(idx, dtype=torch.bool)
    bound = _bound(src.double().abs().cpu(), idx.cpu(), keep.cpu(), T, exact.cpu(), torch.bfloat16)
    assert ((got.double() - exact).abs().cpu() <= bound).all()
    again = torch.compile(segment_sum_by_groups, fullgraph=True)(src, idx, T, group, E)
    assert torch.equal(got, again)
