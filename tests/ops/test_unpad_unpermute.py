"""CPU tests of ``torch.ops.moe.unpad_unpermute`` (and its backward) against a naive float64 reference."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings

from moe_compile.ops import (
    permute_pad,
    permute_pad_reference,
    unpad_unpermute,
    unpad_unpermute_backward_reference,
    unpad_unpermute_reference,
)

from ._dispatch_reference import (  # noqa: F401 (_single_intra_op_thread is an autouse fixture)
    ALIGNS,
    DOT_TOLS,
    DTYPE_TOLS,
    DTYPES,
    EK,
    ROUTINGS,
    _single_intra_op_thread,
    make_routing,
    naive_combine,
    naive_dispatch,
    random_small_case,
    sampled_large_cases,
)


def _setup(T, H, E, K, a, dtype, routing="uniform", seed=0, probs_dtype=None):
    """Permuted rows (random content, pad rows random too: they must never be read) and the map."""
    gen = torch.Generator().manual_seed(seed)
    ids = make_routing(T, K, E, routing, gen)
    probs = torch.rand(T, K, generator=gen).to(probs_dtype or dtype)
    out = permute_pad_reference(torch.zeros(T, H, dtype=dtype), ids, None, E, a)
    rows = torch.randn(out.rows_MH.shape, generator=gen).to(dtype)
    dest = naive_dispatch(ids, E, a)["dest_TK"]
    return rows, out.row_map, probs, dest


def _check_case(T, H, E, K, a, dtype, routing="uniform", seed=0, with_probs=True):
    rows, row_map, probs, dest = _setup(T, H, E, K, a, dtype, routing, seed)
    probs = probs if with_probs else None
    y = unpad_unpermute(rows, row_map, probs)
    assert y.dtype == dtype and y.shape == (T, H)
    torch.testing.assert_close(y.double(), naive_combine(rows, dest, probs), **DTYPE_TOLS[dtype])
    # fixed ascending-row fp32 order: equal to the reference bitwise
    assert torch.equal(y, unpad_unpermute_reference(rows, row_map, probs))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T", (0, 1, 37))
def test_full_product_small(T, dtype):
    for (E, K), a in itertools.product(EK, ALIGNS):
        _check_case(T, 8, E, K, a, dtype, seed=T * 1000 + E * 10 + K, with_probs=(E + a) % 2 == 0 or K == 1)


@pytest.mark.parametrize("T,H,EK_,a,dtype", sampled_large_cases(n=8, seed=4321), ids=str)
def test_sampled_large(T, H, EK_, a, dtype):
    E, K = EK_
    _check_case(T, H, E, K, a, dtype, seed=T + H + E + K + a)


@pytest.mark.parametrize("routing", ROUTINGS)
def test_skewed_routing(routing):
    _check_case(40, 16, 16, 5, 32, torch.float32, routing=routing)


def test_mixed_prob_dtype():
    rows, row_map, probs, dest = _setup(20, 16, 8, 2, 16, torch.bfloat16, probs_dtype=torch.float32)
    y = unpad_unpermute(rows, row_map, probs)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), naive_combine(rows, dest, probs), **DTYPE_TOLS[torch.bfloat16])


def test_roundtrip_without_probs_sums_k_copies():
    x = torch.randn(30, 8)
    ids = make_routing(30, 3, 8, "uniform", torch.Generator().manual_seed(0))
    out = permute_pad(x, ids, None, num_experts=8, align=16)
    torch.testing.assert_close(unpad_unpermute(out.rows_MH, out.row_map), 3 * x)


@pytest.mark.parametrize("with_probs", (True, False))
@pytest.mark.parametrize("a,T", [(1, 5), (16, 0), (128, 3)])
def test_opcheck(with_probs, a, T):
    rows, row_map, probs, _ = _setup(T, 8, 7, 2, a, torch.float32)
    torch.library.opcheck(torch.ops.moe.unpad_unpermute.default, (rows, row_map, probs if with_probs else None, False))


@pytest.mark.parametrize("with_probs", (True, False))
def test_opcheck_backward_op(with_probs):
    rows, row_map, probs, _ = _setup(9, 8, 7, 2, 16, torch.float32)
    g = torch.randn(9, 8)
    args = (g, row_map, probs, rows, rows.shape[0]) if with_probs else (g, row_map, None, None, rows.shape[0])
    torch.library.opcheck(torch.ops.moe.unpad_unpermute_backward.default, args)


@pytest.mark.parametrize("a", (1, 16))
def test_gradcheck(a):
    rows, row_map, probs, _ = _setup(7, 4, 5, 2, a, torch.float64)
    rows.requires_grad_(True)
    probs.requires_grad_(True)
    torch.autograd.gradcheck(lambda z, p: unpad_unpermute(z, row_map, p), (rows, probs))
    torch.autograd.gradcheck(lambda z: unpad_unpermute(z, row_map), (rows,))


def test_gradcheck_through_both_ops():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    ids = make_routing(6, 2, 4, "uniform", gen)
    p = torch.rand(6, 2, dtype=torch.float64, generator=gen, requires_grad=True)

    def f(x, p):
        out = permute_pad(x, ids, p, num_experts=4, align=8)
        return unpad_unpermute(out.rows_MH * out.probs_M.unsqueeze(1), out.row_map, p)

    torch.autograd.gradcheck(f, (x, p))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_matches_naive(dtype):
    rows, row_map, probs, dest = _setup(33, 16, 16, 5, 32, dtype)
    rows.requires_grad_(True)
    probs.requires_grad_(True)
    g = torch.randn(33, 16).to(dtype)
    d_rows, d_probs = torch.autograd.grad(unpad_unpermute(rows, row_map, probs), (rows, probs), g)
    expect_rows = torch.zeros_like(rows)
    expect_rows[dest.reshape(-1)] = (g.float()[:, None, :] * probs.float()[:, :, None]).to(dtype).reshape(-1, 16)
    assert torch.equal(d_rows, expect_rows)  # one multiply, one cast: bitwise; unused rows zero
    dots = (rows.detach().double()[dest] * g.double()[:, None, :]).sum(-1)
    torch.testing.assert_close(d_probs.double(), dots, **DOT_TOLS[dtype])
    # without probs: a pure permute of g
    d_rows2 = torch.autograd.grad(unpad_unpermute(rows, row_map), rows, g)[0]
    expect_rows.zero_()[dest.reshape(-1)] = g.unsqueeze(1).expand(33, 5, 16).reshape(-1, 16)
    assert torch.equal(d_rows2, expect_rows)


def test_backward_reference_probs_grad_needs_rows():
    rows, row_map, probs, _ = _setup(5, 8, 4, 2, 8, torch.float32)
    g = torch.randn(5, 8)
    assert unpad_unpermute_backward_reference(g, row_map, probs, None, rows.shape[0])[1] is None
    # probs without requires_grad: no prob grad, rows not saved
    rows.requires_grad_(True)
    (d_rows,) = torch.autograd.grad(unpad_unpermute(rows, row_map, probs), (rows,), g)
    assert d_rows.shape == rows.shape


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(rows=torch.randn(32, 8).to(torch.int64)), "rows must have dtype"),
        (dict(rows=torch.randn(32)), "rows must be 2-D"),
        (dict(row_map=torch.zeros(4, 4, dtype=torch.int64)), "row_map must have dtype"),
        (dict(row_map=torch.zeros(4, 3, dtype=torch.int32)), r"row_map must have shape \[T, 2K\]"),
        (dict(probs=torch.rand(4, 3)), r"probs must have shape \[T, K\] = \[4, 2\]"),
        (dict(probs=torch.rand(5, 2)), r"probs must have shape \[T, K\]"),
        (dict(probs=torch.ones(4, 2, dtype=torch.int32)), "probs must have dtype"),
        (dict(row_map=torch.full((4, 4), 32, dtype=torch.int32)), r"row_map \(rows\) values must be in \[0, 32\)"),
    ],
)
def test_bad_input_errors(kwargs, match):
    args = dict(rows=torch.randn(32, 8), row_map=torch.zeros(4, 4, dtype=torch.int32), probs=None)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        unpad_unpermute(args["rows"], args["row_map"], args["probs"])


@settings(max_examples=25, deadline=None)
@given(case=random_small_case())
def test_property_random_shapes(case):
    _check_case(**case)


@pytest.mark.parametrize("probs_need_grad", (True, False))
def test_compiled_training_matches_eager(probs_need_grad):
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(24, 16, generator=gen)
    ids = make_routing(24, 2, 8, "uniform", gen)
    probs = torch.rand(24, 2, generator=gen)

    def step(x, probs):
        out = permute_pad(x, ids, probs, num_experts=8, align=16)
        return unpad_unpermute(out.rows_MH.sin(), out.row_map, probs).square().sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    grads = []
    for fn in (step, compiled):
        xx, pp = x.clone().requires_grad_(True), probs.clone().requires_grad_(probs_need_grad)
        fn(xx, pp).backward()
        grads.append((xx.grad, pp.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    if probs_need_grad:
        torch.testing.assert_close(grads[0][1], grads[1][1])
    else:
        assert grads[1][1] is None


def test_public_api_exports():
    import moe_compile.ops as ops

    expected = {
        "PermutePadOut",
        "permute_pad",
        "permute_pad_reference",
        "permute_pad_backward_reference",
        "unpad_unpermute",
        "unpad_unpermute_reference",
        "unpad_unpermute_backward_reference",
        "static_row_bound",
        "SUPPORTED_ALIGNMENTS",
    }
    assert expected <= set(ops.__all__)
    assert all(hasattr(ops, name) for name in ops.__all__)
    for op in ("permute_pad", "unpad_unpermute", "permute_pad_backward", "unpad_unpermute_backward"):
        assert hasattr(torch.ops.moe, op)


# ===== issue 35: bad row maps (NOTE [poisoned tokens] (moe_compile/ops/unpad_unpermute.py)) =====


def _random_map(seed: int):
    gen = torch.Generator().manual_seed(seed)
    T, H, E, K, a = 7, 8, 6, 3, 8
    ids = make_routing(T, K, E, "uniform", gen)
    out = permute_pad_reference(torch.randn(T, H, generator=gen), ids, None, E, a)
    rows = torch.randn(out.rows_MH.shape, generator=gen)
    return rows, out.row_map, torch.rand(T, K, generator=gen), gen


@pytest.mark.parametrize("slot", (3, 1000, -1), ids=("K", "K_plus_1000", "minus_1"))
@pytest.mark.parametrize("with_probs", (True, False))
def test_slot_half_out_of_range_names_the_argument(slot, with_probs):
    # before: a raw IndexError from gather that does not name row_map (and none at all without probs)
    rows, row_map, probs, gen = _random_map(int(torch.seed() % 2**31))
    t = int(torch.randint(0, row_map.shape[0], (1,), generator=gen))
    row_map[t, 3 + int(torch.randint(0, 3, (1,), generator=gen))] = slot
    with pytest.raises(ValueError, match=r"row_map \(slots\) values must be in \[0, 3\)"):
        unpad_unpermute(rows, row_map, probs if with_probs else None)
    with pytest.raises(ValueError, match=r"row_map \(slots\)"):
        torch.ops.moe.unpad_unpermute(rows, row_map, probs if with_probs else None)


def test_slot_half_not_a_permutation_names_the_argument():
    rows, row_map, probs, _ = _random_map(int(torch.seed() % 2**31))
    row_map[2, 3:] = row_map[2, 3]  # every slot of token 2 the same (in range)
    with pytest.raises(ValueError, match=r"row_map \(slots\) of each token must be a permutation of 0..2.* token 2"):
        unpad_unpermute(rows, row_map, probs)


def test_debug_must_be_a_bool():
    rows, row_map, probs, _ = _random_map(0)
    with pytest.raises(TypeError, match="debug must be a bool"):
        unpad_unpermute(rows, row_map, probs, debug="false")
    with pytest.raises(TypeError, match="debug must be a bool"):
        permute_pad(torch.randn(4, 8), torch.zeros(4, 2, dtype=torch.int64), None, num_experts=4, debug=None)


@pytest.mark.parametrize("bad", ("row_R", "row_minus_1", "slot_K"))
def test_references_poison_the_token_and_leave_the_others_bitwise(bad):
    """The references define what the CUDA kernels do with a bad entry (and what a CPU graph computes, where the map
    is not checked on the host): the token's output and gradients are NaN, the others bitwise unchanged."""
    from moe_compile.ops import permute_pad_backward_reference

    rows, row_map, probs, gen = _random_map(int(torch.seed() % 2**31))
    T, K, R = row_map.shape[0], row_map.shape[1] // 2, rows.shape[0]
    bad_map = row_map.clone()
    t = int(torch.randint(0, T, (1,), generator=gen))
    j = int(torch.randint(0, K, (1,), generator=gen))
    bad_map[t, j if bad.startswith("row") else K + j] = {"row_R": R, "row_minus_1": -1, "slot_K": K}[bad]
    good = torch.arange(T) != t
    g = torch.randn(T, rows.shape[1], generator=gen)
    for p in (probs, None):
        poisoned = bad.startswith("row") or p is not None
        y, y_ok = unpad_unpermute_reference(rows, bad_map, p), unpad_unpermute_reference(rows, row_map, p)
        assert bool(y[t].isnan().all()) == poisoned and not y[good].isnan().any()
        assert torch.equal(y[good], y_ok[good])
        d_rows, d_probs = unpad_unpermute_backward_reference(g, bad_map, p, rows, R)
        d_rows_ok, d_probs_ok = unpad_unpermute_backward_reference(g, row_map, p, rows, R)
        mine = bad_map[t, :K].long()
        mine = mine[(mine >= 0) & (mine < R)]
        assert bool(d_rows[mine].isnan().all()) == poisoned
        others = row_map[good, :K].reshape(-1).long()
        assert torch.equal(d_rows[others], d_rows_ok[others])
        if p is not None:
            assert bool(d_probs[t].isnan().all()) and torch.equal(d_probs[good], d_probs_ok[good])
    # permute_pad's backward, the same gather over the map: the token's grad_x (and grad_probs) NaN
    g_rows, g_probs = torch.randn(R, rows.shape[1], generator=gen), torch.randn(R, generator=gen)
    gx, gp = permute_pad_backward_reference(g_rows, g_probs, bad_map)
    gx_ok, gp_ok = permute_pad_backward_reference(g_rows, g_probs, row_map)
    assert bool(gx[t].isnan().all()) == bad.startswith("row") and torch.equal(gx[good], gx_ok[good])
    assert bool(gp[t].isnan().all()) and torch.equal(gp[good], gp_ok[good])


def test_cpu_graph_poisons_a_bad_row_map():
    """Traced on CPU the map is not read on the host: the decomposed reference poisons instead of reading past."""
    rows, row_map, probs, _ = _random_map(5)
    bad_map = row_map.clone()
    bad_map[4, 0] = rows.shape[0] + 7
    f = torch.compile(lambda z, m, p: unpad_unpermute(z, m, p), backend="aot_eager", fullgraph=True)
    y = f(rows, bad_map, probs)
    assert bool(y[4].isnan().all()) and not y[torch.arange(7) != 4].isnan().any()
    torch._dynamo.reset()
