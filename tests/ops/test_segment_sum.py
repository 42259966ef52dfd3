"""``moe.segment_sum`` on CPU: opcheck, reference vs a float64 loop within the derived summation bound
(integers exact), bitwise equal repeated runs, masks and edge shapes, compiled without atomics, backward,
and argument errors that name the argument; ``moe.gather_segment_sum`` the same way. The Triton kernel is in
``triton/test_segment_sum_kernels.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

from moe_compile.ops import gather_segment_sum, segment_sum, segment_sum_reference
from moe_compile.ops.segment_sum import group_order, segment_sum_by_groups
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


# ===== moe.gather_segment_sum =====

GATHER_OP = torch.ops.moe.gather_segment_sum.default


def _gather_inputs(S, N, D, R, dtype=torch.float32, seed=0, sorted_idx=False):
    gen = torch.Generator().manual_seed(seed)
    src = torch.randn(S, D, generator=gen).to(dtype)
    src_idx = torch.randint(0, S, (N,), generator=gen)
    idx = torch.randint(0, R, (N,), generator=gen)
    if sorted_idx:
        idx = idx.sort().values
    weight = torch.randn(N, generator=gen, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    mask = torch.rand(N, generator=gen) > 0.3
    return src, src_idx, idx, weight, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("sorted_idx", [False, True])
def test_gather_matches_loop(dtype, sorted_idx):
    """Each row the weighted sum of its entries' gathered rows, within the n-term bound (plus the weight's product)."""
    S, N, D, R = 7, 41, 5, 9
    src, src_idx, idx, weight, mask = _gather_inputs(S, N, D, R, dtype, seed=4, sorted_idx=sorted_idx)
    src_idx = torch.where(mask, src_idx, -5)  # a skipped entry's row is not read (nor checked)
    got = gather_segment_sum(src, src_idx, idx, R, weight, mask, idx_sorted=sorted_idx)
    keep = mask.nonzero().flatten()
    terms = weight.double()[keep, None] * src.double()[src_idx[keep]]
    want = torch.zeros(R, D, dtype=torch.float64).index_add_(0, idx[keep], terms)
    mag = torch.zeros(R, D, dtype=torch.float64).index_add_(0, idx[keep], terms.abs())
    n = int(torch.bincount(idx[keep], minlength=R).max()) + 1
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    inner = tol.gamma(n, acc) * mag
    assert got.dtype == dtype and got.shape == (R, D)
    tol.assert_within(got, want, inner + tol.rounding_bound(want, dtype, inner=inner), f"gather_segment_sum {dtype}")
    assert torch.equal(gather_segment_sum(src, src_idx, idx, R, weight, mask, idx_sorted=sorted_idx), got)


def test_gather_without_weight_or_mask_is_segment_sum_of_gathered_rows():
    src, src_idx, idx, _, _ = _gather_inputs(6, 30, 4, 8, seed=2)
    assert torch.equal(gather_segment_sum(src, src_idx, idx, 8), segment_sum(src[src_idx], idx, 8))


@pytest.mark.parametrize("flags", [(False, False), (True, False), (False, True)])
def test_gather_backward(flags):
    """gradcheck in fp64, and the gradient w.r.t. ``src`` is the op with the index roles swapped, bitwise."""
    idx_sorted, src_idx_sorted = flags
    src, src_idx, idx, weight, mask = _gather_inputs(6, 25, 3, 5, torch.float64, seed=9, sorted_idx=idx_sorted)
    if src_idx_sorted:
        src_idx = src_idx.sort().values
    src.requires_grad_()
    weight.requires_grad_()
    fn = lambda s, w: gather_segment_sum(s, src_idx, idx, 5, w, mask, idx_sorted=idx_sorted,  # noqa: E731
                                         src_idx_sorted=src_idx_sorted)
    torch.autograd.gradcheck(fn, (src, weight))
    g = torch.randn(5, 3, dtype=torch.float64)
    grad_src, grad_w = torch.autograd.grad(fn(src, weight), (src, weight), g)
    assert torch.equal(grad_src, gather_segment_sum(g, idx, src_idx, 6, weight.detach(), mask))
    assert torch.equal(grad_w[~mask], torch.zeros_like(grad_w[~mask]))  # skipped entries: exactly zero


@pytest.mark.parametrize("sorted_idx", [False, True])
def test_gather_opcheck(sorted_idx):
    src, src_idx, idx, weight, mask = _gather_inputs(5, 12, 4, 6, seed=1, sorted_idx=sorted_idx)
    opcheck(GATHER_OP, (src.requires_grad_(), src_idx, idx, 6, weight.requires_grad_(), mask, sorted_idx, False))
    opcheck(GATHER_OP, (src, src_idx.to(torch.int32), idx, 6, None, None, sorted_idx, False))


def test_gather_compiled_matches_eager():
    src, src_idx, idx, weight, mask = _gather_inputs(9, 30, 6, 8, seed=7)
    want = gather_segment_sum(src, src_idx, idx, 8, weight, mask)
    torch._dynamo.reset()
    compiled = torch.compile(lambda s, w: gather_segment_sum(s, src_idx, idx, 8, w, mask), fullgraph=True)
    got = compiled(src, weight)
    torch._dynamo.reset()
    assert torch.equal(got, want)


@pytest.mark.parametrize("bad,match", [
    (dict(src=torch.zeros(4, 2, dtype=torch.int64)), "src must have dtype"),
    (dict(src_idx=torch.zeros(4)), "src_idx must have an integer dtype"),
    (dict(src_idx=torch.zeros(3, dtype=torch.int64)), "src_idx and idx must have one entry each"),
    (dict(src_idx=torch.tensor([0, 1, 3, 1])), r"src_idx values must be in \[0, 3\)"),
    (dict(idx=torch.zeros(4, 1, dtype=torch.int64)), "idx must be 1-D"),
    (dict(weight=torch.ones(4, dtype=torch.int64)), "weight must be a 1-D float tensor"),
    (dict(weight=torch.ones(3)), "weight must be a 1-D float tensor with one entry per entry of idx"),
    (dict(mask=torch.ones(4)), "mask must be a 1-D bool tensor"),
    (dict(num_rows=-1), "num_rows must be"),
    (dict(idx=torch.tensor([0, 2, 1, 3]), idx_sorted=True), "idx must be non-decreasing where idx_sorted=True"),
])
def test_gather_bad_arguments_name_the_argument(bad, match):
    args = dict(src=torch.zeros(3, 2), src_idx=torch.tensor([0, 1, 2, 1]), idx=torch.tensor([0, 1, 2, 1]),
                num_rows=5, weight=None, mask=None, idx_sorted=False)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        gather_segment_sum(args["src"], args["src_idx"], args["idx"], args["num_rows"], args["weight"], args["mask"],
                           idx_sorted=args["idx_sorted"])


# ===== segment_sum_by_groups: expert-choice indices (distinct within each expert), ordered without a sort =====


def _expert_choice_indices(T, E, C, expert_major, gen):
    """Each of ``E`` experts' top-``C`` tokens of random scores, as ``topk(scores.t(), C)`` (``[E, C]``) or
    ``topk(scores, C, dim=0)`` (``[C, E]``) lays them out, flat; and each entry's expert."""
    scores = torch.rand(T, E, generator=gen)
    n = torch.arange(E * C)
    if expert_major:
        return torch.topk(scores.t(), C, dim=-1).indices.reshape(-1), n // C
    return torch.topk(scores, C, dim=0).indices.reshape(-1), n % E


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("expert_major", [True, False], ids=["E_C", "C_E"])
def test_by_groups_is_segment_sum_in_expert_order(dtype, expert_major):
    """Bitwise the sort-based segment sum of the entries taken in expert order (for ``[E, C]`` indices that is
    their own order), on a fresh draw; rows no expert took are zero."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    T, E, C, D = 37, 6, 9, 5
    idx, group = _expert_choice_indices(T, E, C, expert_major, gen)
    src = torch.randn(E * C, D, generator=gen).to(dtype)
    got = segment_sum_by_groups(src, idx, T, group, E)
    order = torch.argsort(group, stable=True)
    assert torch.equal(got, segment_sum(src[order], idx[order], T))
    if expert_major:
        assert torch.equal(got, segment_sum(src, idx, T))
    untouched = torch.ones(T, dtype=torch.bool).index_fill_(0, idx, False)
    assert untouched.any() and not got[untouched].any()


def test_by_groups_skips_out_of_range_and_masked_entries():
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    T, E, C, D = 20, 4, 6, 3
    idx, group = _expert_choice_indices(T, E, C, True, gen)
    idx[2], idx[9], idx[-1] = -1, T, T + 5
    src = torch.randn(E * C, D, generator=gen)
    keep = (idx >= 0) & (idx < T)
    assert torch.equal(segment_sum_by_groups(src, idx, T, group, E), segment_sum(src, idx, T, keep))
    mask = torch.rand(E * C, generator=gen) > 0.3
    assert torch.equal(segment_sum_by_groups(src, idx, T, group, E, mask), segment_sum(src, idx, T, keep & mask))


@pytest.mark.parametrize("expert_major", [True, False], ids=["EC", "CE"])
def test_group_order_is_the_stable_sort_by_row_then_group(expert_major):
    """``group_order`` is a permutation of the entries: kept ones sorted by ``(idx, group)`` (what a stable sort on
    that key gives), skipped ones (out of range, masked) after them in entry order keyed ``num_rows``."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    T, E, C = 23, 5, 7
    idx, group = _expert_choice_indices(T, E, C, expert_major, gen)
    idx[3], idx[11] = -2, T + 1
    mask = torch.rand(E * C, generator=gen) > 0.2
    keep = (idx >= 0) & (idx < T) & mask
    entry, idx_sorted = group_order(idx, T, group, E, mask)
    key = torch.where(keep, idx * E + group, T * E)
    expected = torch.sort(key, stable=True).indices
    assert torch.equal(entry, expected)
    assert torch.equal(idx_sorted, torch.where(keep, idx, T)[expected])


def test_by_groups_integer_rows_take_the_sort():
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    idx, group = _expert_choice_indices(15, 3, 5, True, gen)
    src = torch.randint(-9, 9, (15, 2), generator=gen)
    assert torch.equal(segment_sum_by_groups(src, idx, 15, group, 3), segment_sum(src, idx, 15))


def test_by_groups_bad_arguments_name_the_argument():
    src, idx = torch.randn(6, 2), torch.tensor([0, 1, 2, 0, 1, 2])
    with pytest.raises(ValueError, match="group_N"):
        segment_sum_by_groups(src, idx, 3, torch.zeros(5, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="group_N"):
        segment_sum_by_groups(src, idx, 3, torch.zeros(6), 2)
    with pytest.raises(ValueError, match="num_groups"):
        segment_sum_by_groups(src, idx, 3, torch.zeros(6, dtype=torch.int64), -1)
