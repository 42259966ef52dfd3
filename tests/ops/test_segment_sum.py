"""``moe.segment_sum`` on CPU: opcheck, reference vs a float64 loop within the derived summation bound
(integers exact), bitwise equal repeated runs, masks and edge shapes, compiled without atomics, backward,
and argument errors that name the argument. The Triton kernel is in ``triton/test_segment_sum_kernels.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

from moe_compile.ops import segment_sum, segment_sum_reference
from tests import _tolerance as tol
from tests.passes._harness import ATOMIC_ADD

OP = torch.ops.moe.segment_sum.default


def _inputs(N, D, R, dtype=torch.float32, seed=0, masked=False):
    gen = torch.Generator().manual_seed(seed)
    src = torch.randn(N, D, generator=gen).to(dtype) if dtype.is_floating_point else \
        torch.randint(-50, 50, (N, D), generator=gen).to(dtype)
    idx = torch.randint(0, max(R, 1), (N,), generator=gen)
    mask = torch.rand(N, generator=gen) > 0.3 if masked else None
    return src, idx, mask


def _loop_sum(src, idx, R, mask=None):
    """Float64 (or int64) loop: the exact-order oracle, and ``sum |src|`` per row for the bound."""
    D = src.shape[1]
    wide = torch.float64 if src.is_floating_point() else torch.int64
    out, mag = torch.zeros(R, D, dtype=wide), torch.zeros(R, D, dtype=wide)
    counts = [0] * R
    for i in range(src.shape[0]):
        if mask is not None and not mask[i]:
            continue
        r = int(idx[i])
        out[r] += src[i].to(wide)
        mag[r] += src[i].to(wide).abs()
        counts[r] += 1
    return out, mag, max(counts, default=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.int32])
@pytest.mark.parametrize("masked", [False, True])
def test_reference_matches_loop(dtype, masked):
    src, idx, mask = _inputs(37, 5, 9, dtype, seed=3, masked=masked)
    got = segment_sum(src, idx, 9, mask)
    want, mag, n = _loop_sum(src, idx, 9, mask)
    assert got.dtype == dtype and got.shape == (9, 5)
    if not dtype.is_floating_point:
        assert torch.equal(got.to(torch.int64), want)
        return
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    # n-term sum in the accumulator (the float64 loop is exact next to it), then one rounding to dtype
    bound = tol.gamma(max(n, 1), acc) * mag + tol.rounding_bound(want, dtype, inner=tol.gamma(max(n, 1), acc) * mag)
    tol.assert_within(got, want, bound, f"segment_sum {dtype}")


def test_rows_nobody_adds_to_are_zero_and_repeat_is_bitwise():
    src, idx, _ = _inputs(64, 7, 40, torch.bfloat16, seed=1)
    first = segment_sum(src, idx, 40)
    empty = torch.ones(40, dtype=torch.bool)
    empty[idx] = False
    assert torch.equal(first[empty], torch.zeros_like(first[empty]))
    for _ in range(3):
        assert torch.equal(segment_sum(src, idx, 40), first)


def test_sum_order_is_ascending_entry_order():
    """The reference sums each row in entry order: cancellation shows the order exactly (fp32:
    ((1e8 + 1) - 1e8) + 1 = 1, since 1e8 + 1 rounds to 1e8; sorted by magnitude it would be 2 or 0)."""
    src = torch.tensor([[1e8], [1.0], [-1e8], [1.0]])
    idx = torch.tensor([0, 0, 0, 0])
    assert segment_sum(src, idx, 1).item() == 1.0


@pytest.mark.parametrize("N,D,R", [(0, 4, 3), (5, 0, 3), (4, 3, 0), (1, 1, 1), (6, 2, 1)])
def test_edge_shapes(N, D, R):
    src = torch.randn(N, D)
    idx = torch.zeros(N, dtype=torch.int64) if R else torch.zeros(0, dtype=torch.int64)
    src = src[: idx.shape[0]]
    out = segment_sum(src, idx, R)
    assert out.shape == (R, D)
    if R:
        torch.testing.assert_close(out[0], src.sum(0), rtol=0, atol=1e-6)


def test_masked_entries_are_skipped_whatever_their_index():
    src = torch.arange(12.0).reshape(6, 2)
    idx = torch.tensor([1, 99, 0, -7, 1, 2])
    mask = torch.tensor([True, False, True, False, True, True])
    out = segment_sum(src, idx, 3, mask)
    assert torch.equal(out, torch.tensor([[4.0, 5.0], [8.0 + 0, 10.0], [10.0, 11.0]]))


@pytest.mark.parametrize("masked", [False, True])
def test_opcheck(masked):
    src, idx, mask = _inputs(11, 4, 6, seed=2, masked=masked)
    opcheck(OP, (src.requires_grad_(), idx, 6, mask))
    opcheck(OP, (torch.randint(0, 5, (11, 3)), idx.to(torch.int32), 6, mask))


def test_backward_is_the_gather():
    src, idx, mask = _inputs(10, 3, 4, torch.float64, seed=5, masked=True)
    src.requires_grad_()
    torch.autograd.gradcheck(lambda s: segment_sum(s, idx, 4, mask), (src,))
    g = torch.randn(4, 3, dtype=torch.float64)
    (grad,) = torch.autograd.grad(segment_sum(src, idx, 4, mask), src, g)
    assert torch.equal(grad, torch.where(mask[:, None], g[idx], 0.0))


def test_compiled_without_atomics_matches_eager():
    from torch._inductor.utils import run_and_get_code

    src, idx, mask = _inputs(30, 6, 8, seed=7, masked=True)
    want = segment_sum(src, idx, 8, mask)
    torch._dynamo.reset()
    compiled = torch.compile(lambda s, i, m: segment_sum(s * 2, i, 8, m), fullgraph=True)
    got, code = run_and_get_code(compiled, src, idx, mask)
    torch._dynamo.reset()
    assert torch.equal(got, segment_sum_reference(src * 2, idx, 8, mask))
    assert torch.equal(got, 2 * want)  # exact: doubling commutes with the sum
    assert not any(ATOMIC_ADD.search(c) for c in code)


@pytest.mark.parametrize("bad,match", [
    (dict(idx=torch.zeros(4)), "idx must have an integer dtype"),
    (dict(idx=torch.zeros(4, 1, dtype=torch.int64)), "idx must be 1-D"),
    (dict(idx=torch.zeros(3, dtype=torch.int64)), "idx must have one entry per row of src"),
    (dict(idx=torch.tensor([0, 1, 5, 1])), r"idx values must be in \[0, 5\), got min 0, max 5"),
    (dict(idx=torch.tensor([0, -1, 2, 1])), r"idx values must be in \[0, 5\)"),
    (dict(src=torch.zeros(4, 2, dtype=torch.bool)), "src must have dtype in"),
    (dict(src=torch.zeros(4)), "src must be 2-D"),
    (dict(num_rows=-1), "num_rows must be an int >= 0"),
    (dict(mask=torch.ones(4)), "mask must be a 1-D bool tensor"),
    (dict(mask=torch.ones(3, dtype=torch.bool)), "mask must have one entry per entry of idx"),
])
@pytest.mark.parametrize("debug", [False, True])
def test_bad_arguments_name_the_argument(bad, match, debug):
    args = dict(src=torch.zeros(4, 2), idx=torch.tensor([0, 1, 2, 1]), num_rows=5, mask=None)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        segment_sum(args["src"], args["idx"], args["num_rows"], args["mask"], debug=debug)


def test_debug_must_be_a_bool():
    with pytest.raises(TypeError, match="debug must be a bool"):
        segment_sum(torch.zeros(4, 2), torch.tensor([0, 1, 2, 1]), 5, None, debug="false")
