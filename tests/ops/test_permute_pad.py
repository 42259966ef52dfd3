"""CPU tests of ``torch.ops.moe.permute_pad`` against a naive float64 reference (bitwise data movement)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings

from moe_compile.ops import (
    PermutePadOut,
    permute_pad,
    permute_pad_reference,
    static_row_bound,
    unpad_unpermute,
    unpad_unpermute_reference,
)

from ._dispatch_reference import (  # noqa: F401 (_single_intra_op_thread is an autouse fixture)
    ALIGNS,
    DTYPES,
    EK,
    ROUTINGS,
    _single_intra_op_thread,
    check_invariants,
    check_row_map,
    make_routing,
    naive_permute_pad,
    random_small_case,
    sampled_large_cases,
)


def _inputs(T, H, E, K, dtype, routing="uniform", seed=0, with_probs=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(dtype)
    ids = make_routing(T, K, E, routing, gen)
    probs = torch.rand(T, K, generator=gen).to(dtype) if with_probs else None
    return x, ids, probs


def _check_case(T, H, E, K, a, dtype, routing="uniform", seed=0, with_probs=True, ids_dtype=torch.int64):
    x, ids, probs = _inputs(T, H, E, K, dtype, routing, seed, with_probs)
    out = permute_pad(x, ids.to(ids_dtype), probs, num_experts=E, align=a)
    rows_ref, probs_ref, meta = naive_permute_pad(x, ids, probs, E, a)
    assert out.rows_MH.dtype == dtype and out.rows_MH.shape == (static_row_bound(T * K, E, a), H)
    assert torch.equal(out.rows_MH, rows_ref)  # pure data movement: bitwise
    if with_probs:
        assert out.probs_M.dtype == probs.dtype and torch.equal(out.probs_M, probs_ref)
    else:
        assert out.probs_M is None
    assert out.offs_E.tolist() == meta["offs"] and out.counts_E.tolist() == meta["counts"]
    check_row_map(out.row_map, meta["dest_TK"])
    check_invariants(out, ids, E, a)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T", (0, 1, 37))
def test_full_product_small(T, dtype):
    for (E, K), a in itertools.product(EK, ALIGNS):
        _check_case(T, 8, E, K, a, dtype, seed=T * 1000 + E * 10 + K)


@pytest.mark.parametrize("T,H,EK_,a,dtype", sampled_large_cases(n=10, seed=1234), ids=str)
def test_sampled_large(T, H, EK_, a, dtype):
    E, K = EK_
    _check_case(T, H, E, K, a, dtype, seed=T + H + E + K + a)


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("E,K", [(7, 5), (64, 8), (256, 2), (16, 1)])
def test_skewed_routing(routing, E, K):
    out = _check_case(50, 16, E, K, 32, torch.bfloat16, routing=routing, seed=E + K)
    counts = out.counts_E.tolist()
    if routing in ("first_k", "last_k") and E > K:
        assert counts.count(0) == E - K  # empty experts have 0 rows
        assert (counts[:K] if routing == "first_k" else counts[-K:]) == [50] * K
    if routing == "one_hot_expert":
        assert counts[E // 2] == 50


def test_fewer_routed_rows_than_experts():
    out = _check_case(3, 8, 64, 2, 16, torch.float32)  # T*K < E: most experts empty
    assert int((out.counts_E > 0).sum()) <= 6


def test_worst_case_padding_every_count_one_mod_align():
    E, a = 4, 16
    ids = torch.arange(E).repeat_interleave(a + 1).reshape(-1, 1)  # each count = a + 1
    x = torch.randn(ids.shape[0], 8)
    out = permute_pad(x, ids, None, num_experts=E, align=a)
    assert out.offs_E.tolist() == [2 * a * (e + 1) for e in range(E)]
    check_invariants(out, ids, E, a)


def test_int32_ids_and_no_probs():
    _check_case(37, 8, 16, 2, 16, torch.float32, with_probs=False, ids_dtype=torch.int32)


def test_zero_prob_routes_row_normally():
    # NOTE [zero-prob rule] (moe_compile/ops/permute_pad.py): not adopted; a 0.0 prob moves the token's row like any
    # other
    x, ids, probs = _inputs(6, 8, 7, 2, torch.float32)
    probs[2, 1] = 0.0
    out = permute_pad(x, ids, probs, num_experts=7, align=8)
    row = out.row_map[2, : 2][out.row_map[2, 2:] == 1].item()
    assert torch.equal(out.rows_MH[row], x[2]) and out.probs_M[row].item() == 0.0
    y = unpad_unpermute(out.rows_MH, out.row_map, probs)
    z_slot0 = out.rows_MH[out.row_map[2, :2][out.row_map[2, 2:] == 0].item()]
    torch.testing.assert_close(y[2], z_slot0 * probs[2, 0])


def test_non_contiguous_inputs():
    x, ids, probs = _inputs(20, 16, 8, 2, torch.float32)
    xt = torch.randn(16, 20).t()  # non-contiguous [20, 16]
    out = permute_pad(xt, ids.t().contiguous().t(), probs.t().contiguous().t(), num_experts=8, align=16)
    ref = permute_pad_reference(xt.contiguous(), ids, probs, 8, 16)
    assert all(torch.equal(a, b) for a, b in zip(out, ref))


@pytest.mark.parametrize("with_probs", (True, False))
@pytest.mark.parametrize("a,T", [(1, 5), (16, 0), (32, 9), (128, 3)])
def test_opcheck(with_probs, a, T):
    x, ids, probs = _inputs(T, 8, 7, 2, torch.float32, with_probs=with_probs)
    torch.library.opcheck(torch.ops.moe.permute_pad.default, (x, ids, probs, 7, a, False))


def test_opcheck_backward_op():
    x, ids, probs = _inputs(9, 8, 7, 2, torch.float32)
    out = permute_pad(x, ids, probs, num_experts=7, align=16)
    g = torch.randn_like(out.rows_MH)
    torch.library.opcheck(torch.ops.moe.permute_pad_backward.default, (g, torch.randn_like(out.probs_M), out.row_map))
    torch.library.opcheck(torch.ops.moe.permute_pad_backward.default, (g, None, out.row_map))


@pytest.mark.parametrize("a", (1, 16))
def test_gradcheck(a):
    x, ids, probs = _inputs(7, 4, 5, 2, torch.float64)
    x.requires_grad_(True)
    probs.requires_grad_(True)
    torch.autograd.gradcheck(lambda x, p: tuple(permute_pad(x, ids, p, num_experts=5, align=a)[:2]), (x, probs))
    torch.autograd.gradcheck(lambda x: permute_pad(x, ids, None, num_experts=5, align=a).rows_MH, (x,))


def test_backward_matches_naive():
    x, ids, probs = _inputs(33, 8, 16, 5, torch.float32)
    x.requires_grad_(True)
    probs.requires_grad_(True)
    out = permute_pad(x, ids, probs, num_experts=16, align=32)
    g_rows, g_probs = torch.randn_like(out.rows_MH), torch.randn_like(out.probs_M)
    gx, gp = torch.autograd.grad((out.rows_MH, out.probs_M), (x, probs), (g_rows, g_probs))
    _, _, meta = naive_permute_pad(x.detach(), ids, probs.detach(), 16, 32)
    dest = meta["dest_TK"]
    torch.testing.assert_close(gx.double(), g_rows.double()[dest].sum(1), rtol=1e-6, atol=1e-5)
    assert torch.equal(gp, g_probs[dest])  # a gather: bitwise


def test_compile_fullgraph_matches_eager():
    x, ids, probs = _inputs(24, 16, 8, 2, torch.float32)

    def f(x, ids, probs):
        out = permute_pad(x, ids, probs, num_experts=8, align=16)
        return unpad_unpermute(out.rows_MH * 2.0, out.row_map, probs), out.offs_E

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    y, offs = compiled(x, ids, probs)
    y_ref, offs_ref = f(x, ids, probs)
    assert torch.equal(offs, offs_ref)
    torch.testing.assert_close(y, y_ref)


def test_reference_is_sync_free_and_static():
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    x, ids, probs = _inputs(24, 16, 8, 2, torch.float32)
    backend = AotEagerAndRecordGraphs()
    out = torch.compile(permute_pad_reference, fullgraph=True, backend=backend)(x, ids, probs, 8, 16)
    assert all(torch.equal(a, b) for a, b in zip(out, permute_pad_reference(x, ids, probs, 8, 16)))
    for gm in backend.fw_graphs:
        for node in gm.graph.nodes:
            assert not node.meta.get("unbacked_bindings"), node
            assert "_local_scalar_dense" not in str(node.target) and "nonzero" not in str(node.target), node


@pytest.mark.parametrize("decompose", [False, True], ids=["one_node", "traced"])
def test_op_graph_has_no_unbacked_symbols(decompose):
    """One node each way (decomposition off, torch.export's setting), or the traced reference (CPU default)."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    x, ids, probs = _inputs(24, 16, 8, 2, torch.float32)
    x.requires_grad_(True)
    backend = AotEagerAndRecordGraphs()
    with torch._functorch.config.patch(decompose_custom_triton_ops=decompose):
        out = torch.compile(lambda *a: permute_pad(*a, num_experts=8, align=16), fullgraph=True, backend=backend)(
            x, ids, probs
        )
        out.rows_MH.sum().backward()
    fw_targets = [str(n.target) for gm in backend.fw_graphs for n in gm.graph.nodes]
    bw_targets = [str(n.target) for gm in backend.bw_graphs for n in gm.graph.nodes]
    if decompose:
        assert not [t for t in fw_targets + bw_targets if t.startswith("moe.")], (fw_targets, bw_targets)
    else:
        assert fw_targets.count("moe.permute_pad.default") == 1
        assert "moe.permute_pad_backward.default" in bw_targets
    for gm in backend.fw_graphs + backend.bw_graphs:
        assert not any(n.meta.get("unbacked_bindings") for n in gm.graph.nodes)


def test_fake_shapes_are_static():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, ids, probs = torch.empty(10, 6), torch.zeros(10, 2, dtype=torch.int64), torch.empty(10, 2)
        out = torch.ops.moe.permute_pad(x, ids, probs, 8, 32)
    assert [tuple(t.shape) for t in out] == [
        (static_row_bound(20, 8, 32), 6),
        (static_row_bound(20, 8, 32),),
        (8,),
        (10, 4),
        (8,),
    ]
    assert [t.dtype for t in out[2:]] == [torch.int32] * 3


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(x=torch.randn(4, 8).to(torch.int32)), "x must have dtype"),
        (dict(x=torch.randn(4, 8, 1)), "x must be 2-D"),
        (dict(ids=torch.zeros(4, 2)), "expert_idx must have an integer dtype"),
        (dict(ids=torch.zeros(4, dtype=torch.int64)), "expert_idx must be 2-D"),
        (dict(ids=torch.zeros(5, 2, dtype=torch.int64)), "expert_idx must have one row per token"),
        (dict(ids=torch.zeros(4, 0, dtype=torch.int64)), "at least one column"),
        (dict(probs=torch.rand(4, 3)), "probs must have the shape of expert_idx"),
        (dict(probs=torch.rand(4, 2).to(torch.int64)), "probs must have dtype"),
        (dict(E=1), "K=2 .* must be <= num_experts=1"),
        (dict(E=0), "num_experts must be an int >= 1"),
        (dict(a=4), "align=4 is not supported"),
        (dict(ids=torch.tensor([[0, 1], [2, 3], [4, 8], [0, 1]])), r"expert_idx values must be in \[0, 8\)"),
        (dict(ids=torch.tensor([[0, 1], [2, 3], [4, -1], [0, 1]])), r"expert_idx .*min -1"),
    ],
)
def test_bad_input_errors(kwargs, match):
    args = dict(x=torch.randn(4, 8), ids=torch.zeros(4, 2, dtype=torch.int64), probs=None, E=8, a=16)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        permute_pad(args["x"], args["ids"], args["probs"], num_experts=args["E"], align=args["a"])


def test_op_validates_too():
    with pytest.raises(ValueError, match="align=3"):
        torch.ops.moe.permute_pad(torch.randn(4, 8), torch.zeros(4, 2, dtype=torch.int64), None, 8, 3)
    with pytest.raises(ValueError, match="expert_idx values"):
        torch.ops.moe.permute_pad(torch.randn(1, 8), torch.tensor([[0, 9]]), None, 8, 1)


def test_named_tuple_fields():
    assert PermutePadOut._fields == ("rows_MH", "probs_M", "offs_E", "row_map", "counts_E")


@settings(max_examples=25, deadline=None)
@given(case=random_small_case())
def test_property_random_shapes(case):
    _check_case(**case)


@pytest.mark.parametrize("T,E,K,a", [(37, 8, 2, 16), (9, 5, 3, 32), (0, 4, 2, 16)])
def test_reference_compares_and_library_calls_agree(T, E, K, a, monkeypatch):
    """NOTE [few library calls] (moe_compile/ops/_common.py): the references' compare paths (small sizes) and their sort
    / search paths give the same integers and rows, forward and backward, bitwise."""
    from moe_compile.ops import _common
    from moe_compile.ops.unpad_unpermute import unpad_unpermute_backward_reference

    x, ids, probs = _inputs(T, 24, E, K, torch.float32, seed=torch.seed() % 2**31)
    outs = []
    for small in (1 << 62, 0):  # every compare path, then every library call
        monkeypatch.setattr(_common, "SMALL_COMPARES", small)
        out = permute_pad_reference(x, ids, probs, num_experts=E, align=a)
        grad_y = torch.randn(T, 24, generator=torch.Generator().manual_seed(1))
        grads = unpad_unpermute_backward_reference(grad_y, out.row_map, probs, out.rows_MH, out.rows_MH.shape[0])
        outs.append([*out, *grads])
    rows_ref, probs_ref, _ = naive_permute_pad(x, ids, probs, E, a)
    assert torch.equal(outs[0][0], rows_ref) and torch.equal(outs[0][1], probs_ref)
    for got, want in zip(outs[1], outs[0]):
        assert torch.equal(got, want)


@pytest.mark.parametrize("bad", (8, -1, 2**40), ids=("E", "minus_1", "2_pow_40"))
@pytest.mark.parametrize("a", (1, 16))
def test_reference_drops_bad_ids_and_leaves_the_rest_bitwise(bad, a, monkeypatch):
    """NOTE [dropped entries] (moe_compile/ops/permute_pad.py): the reference (the CUDA fallback, the kernels' oracle)
    gives a bad id no row, no count and a -1 in the map, listed last; everything else is bitwise the call on E + 1
    experts with the bad ids set to E, up to that expert's rows. Both reference paths (compares, library calls)."""
    from moe_compile.ops import _common

    T, E, K = 13, 8, 3
    x, ids, probs = _inputs(T, 16, E, K, torch.float32, seed=int(torch.seed() % 2**31))
    gen = torch.Generator().manual_seed(int(torch.seed() % 2**31))
    bad_TK = torch.rand(T, K, generator=gen) < 0.25
    bad_TK[3] = True
    ids_bad = torch.where(bad_TK, bad, ids)
    for small in (1 << 62, 0):
        monkeypatch.setattr(_common, "SMALL_COMPARES", small)
        out = permute_pad_reference(x, ids_bad, probs, E, a)
        plus = permute_pad_reference(x, torch.where(bad_TK, E, ids), probs, E + 1, a)
        used = int(out.offs_E[-1])
        assert used == int(plus.offs_E[E - 1]) and out.rows_MH.shape[0] == static_row_bound(T * K, E, a)
        assert torch.equal(out.rows_MH[:used], plus.rows_MH[:used]) and not out.rows_MH[used:].any()
        assert torch.equal(out.probs_M[:used], plus.probs_M[:used]) and not out.probs_M[used:].any()
        assert torch.equal(out.offs_E, plus.offs_E[:E]) and torch.equal(out.counts_E, plus.counts_E[:E])
        rows_plus = plus.row_map[:, :K]
        assert torch.equal(out.row_map[:, :K], torch.where(rows_plus >= used, -1, rows_plus))
        assert torch.equal(out.row_map[:, K:], plus.row_map[:, K:])
        assert int(out.invalid_ids()) == int(bad_TK.sum())
        y = unpad_unpermute_reference(out.rows_MH, out.row_map, probs)
        assert torch.equal(y.isnan().any(1), bad_TK.any(1))


def test_bool_and_flag_arguments_name_the_argument():
    x, ids = torch.randn(4, 8), torch.zeros(4, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="num_experts must be an int"):
        permute_pad(x, ids, None, num_experts=True)
    with pytest.raises(ValueError, match="align=True is not supported"):
        permute_pad(x, ids, None, num_experts=4, align=True)
    with pytest.raises(TypeError, match="debug must be a bool"):
        permute_pad(x, ids, None, num_experts=4, align=1, debug="no")
