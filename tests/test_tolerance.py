"""The derived bounds of ``tests/_tolerance.py`` catch bugs: one deliberate bug each, on fresh random inputs.

Each test computes a grouped GEMM through ``moe_compile``'s ops (CPU paths) twice, once right and once with
one thing perturbed on purpose, and checks both against an independent float64 loop over experts: the right
one passes the derived comparison and the perturbed one fails it. Hypothesis draws the inputs (seed,
shapes, routing); a failure prints the example and the blob that replays it (``tests/conftest.py``).
The last tests check ``within_eager_bound`` (a compiled step against eager's own distance from a reference)
the same way: a value past the bound, or off an exact zero, fails.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from moe_compile.ops import grouped_mm as gmm
from tests import _tolerance as tol

F32, F64 = torch.float32, torch.float64
DTYPES = st.sampled_from([torch.float32, torch.bfloat16])


def _loop_reference(x_MK: torch.Tensor, w_ENK: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """float64, per-expert slices with host offsets: the semantics written out (never the op's own code)."""
    out, start = torch.zeros(x_MK.shape[0], w_ENK.shape[1], dtype=F64), 0
    for e, c in enumerate(counts):
        out[start : start + c] = x_MK[start : start + c].double() @ w_ENK[e].double().T
        start += c
    return out


@st.composite
def problems(draw, k_multiple: int = 1):
    """(seed, counts per expert with one non-empty expert at least, N, K, dtype)."""
    experts = draw(st.integers(2, 6))
    counts = draw(st.lists(st.integers(0, 6), min_size=experts, max_size=experts).filter(lambda c: sum(c) > 0))
    n = draw(st.integers(1, 24))
    k = k_multiple * draw(st.integers(1, 4 if k_multiple > 1 else 96))
    return draw(st.integers(0, 2**32 - 1)), counts, n, k, draw(DTYPES)


def _offs(counts: list[int]) -> torch.Tensor:
    return torch.cumsum(torch.tensor(counts), 0).to(torch.int32)


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> None:
    """The derived comparison: op (fp32 accumulate, stored in x's dtype) vs the float64 loop."""
    want = _loop_reference(x, w, counts)
    mag = tol.grouped_abs_matmul(x, w, _offs(counts))
    bound = tol.matmul_bound(mag, x.shape[1], want, acc_dtypes=(F32, F64), got_dtype=got.dtype)
    tol.assert_within(got, want, bound)


def _floor(x: torch.Tensor, w: torch.Tensor, counts: list[int], dtype: torch.dtype) -> torch.Tensor:
    """The bound of :func:`_check`: a bug whose effect stays below it on every element is invisible."""
    mag = tol.grouped_abs_matmul(x, w, _offs(counts))
    return tol.matmul_bound(mag, x.shape[1], _loop_reference(x, w, counts), acc_dtypes=(F32, F64), got_dtype=dtype)


def _fails(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> bool:
    try:
        _check(got, x, w, counts)
    except AssertionError:
        return True
    return False


def _random_mxfp8(gen: torch.Generator, E: int, N: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    qdata = (torch.randn(E, N, K, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.randint(120, 135, (E, N, K // gmm.MX_BLOCK), generator=gen, dtype=torch.int32).to(torch.uint8)
    return qdata, scale


@settings(max_examples=40)
@given(problems(k_multiple=gmm.MX_BLOCK), st.data())
def test_mxfp8_scale_exponent_off_by_one_fails(problem, data):
    """An e8m0 scale exponent off by one (one block of 32 weights scaled 2x or 0.5x) fails the comparison."""
    seed, counts, N, K, dtype = problem
    gen = torch.Generator().manual_seed(seed)
    E, M = len(counts), sum(counts)
    x = torch.randn(M, K, generator=gen).to(dtype)
    qdata, scale = _random_mxfp8(gen, E, N, K)
    offs, w = _offs(counts), gmm.dequantize_mxfp8(qdata, scale, F64)
    _check(gmm.grouped_mm_mxfp8(x, qdata, scale, offs), x, w, counts)
    # the bug: one block of an expert that has rows, exponent +-1; it must touch a non-zero product
    e = data.draw(st.sampled_from([i for i, c in enumerate(counts) if c]), "expert")
    n, b = data.draw(st.integers(0, N - 1), "row of w"), data.draw(st.integers(0, K // gmm.MX_BLOCK - 1), "block")
    step = data.draw(st.sampled_from([1, -1]), "exponent step")
    start = sum(counts[:e])
    block = slice(b * gmm.MX_BLOCK, (b + 1) * gmm.MX_BLOCK)
    # the bug moves y[rows of e, n] by the block's partial sum times 1 (2x) or 1/2 (0.5x); where that stays
    # within the bound (a block scaled far below the row's others) there is nothing to catch
    partial = (x[start : start + counts[e], block].double() @ w[e, n, block]).abs() * (1 if step == 1 else 0.5)
    assume((partial > 4 * _floor(x, w, counts, dtype)[start : start + counts[e], n]).any())
    bad = scale.clone()
    bad[e, n, b] += step
    assert _fails(gmm.grouped_mm_mxfp8(x, qdata, bad, offs), x, w, counts)


def _plain_problem(problem: tuple) -> tuple[torch.Tensor, torch.Tensor, list[int], torch.Tensor, torch.dtype]:
    """Random bf16/fp32 operands of a drawn problem, checked to pass unperturbed: (x, w, counts, offs, dtype)."""
    seed, counts, N, K, dtype = problem
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), K, generator=gen).to(dtype)
    w = torch.randn(len(counts), N, K, generator=gen).to(dtype)
    offs = _offs(counts)
    _check(gmm.grouped_mm(x, w, offs), x, w, counts)
    return x, w, counts, offs, dtype


@settings(max_examples=40)
@given(problems(), st.data())
def test_expert_offset_shifted_by_one_row_fails(problem, data):
    """One expert's end offset one row early or late (a boundary row multiplied by the neighbour's weights)."""
    x, w, counts, offs, dtype = _plain_problem(problem)
    # the bug: offs[e] += 1 or -= 1 for an inner boundary, kept monotone (so the op still accepts it)
    candidates = [(e, d) for e in range(len(counts) - 1) for d in (1, -1)
                  if 0 <= int(offs[e]) + d <= sum(counts)
                  and (e == 0 or int(offs[e - 1]) <= int(offs[e]) + d) and int(offs[e]) + d <= int(offs[e + 1])]
    assume(candidates)
    e, d = data.draw(st.sampled_from(candidates), "boundary, shift")
    row = int(offs[e]) if d == 1 else int(offs[e]) - 1  # the row that changes expert
    change = (x[row].double() @ (w[e].double() - w[e + 1].double()).T).abs()
    # both experts give that row (about) the same result: nothing to see (a discarded example; Hypothesis
    # fails the test if it discards most of them, so the check cannot pass by never running)
    assume((change > 4 * _floor(x, w, counts, dtype)[row]).any())
    bad = offs.clone()
    bad[e] += d
    assert _fails(gmm.grouped_mm(x, w, bad), x, w, counts)


@settings(max_examples=40)
@given(problems(), st.data())
def test_dropped_k_term_fails(problem, data):
    """One term of the K sum left out (column k of x zeroed for the op) fails wherever it was not ~0."""
    x, w, counts, offs, dtype = _plain_problem(problem)
    k = data.draw(st.integers(0, x.shape[1] - 1), "dropped k")
    dropped = x.clone()
    dropped[:, k] = 0
    # the term is the bug's whole effect; when it is below every element's bound (|x_k| tiny on every row),
    # there is nothing to catch, and the largest term is what the bound must see
    term = (x[:, k, None].double() * gmm.grouped_mm_reference(torch.ones_like(x[:, :1]).double(),
                                                               w[:, :, k : k + 1].double(), offs)).abs()
    assume((term > 4 * _floor(x, w, counts, dtype)).any())
    assert _fails(gmm.grouped_mm(dropped, w, offs), x, w, counts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unperturbed_passes_on_many_seeds(dtype):
    """The other half of the claim, on 20 fixed seeds (not only the examples Hypothesis draws)."""
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        counts = [3, 0, 5, 2, 7]
        x = torch.randn(sum(counts), 96, generator=gen).to(dtype)
        qdata, scale = _random_mxfp8(gen, len(counts), 16, 96)
        _check(gmm.grouped_mm_mxfp8(x, qdata, scale, _offs(counts)), x, gmm.dequantize_mxfp8(qdata, scale, F64),
               counts)


def test_assert_within_names_the_worst_element():
    want = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    got = want.clone()
    got[1, 0] += 0.5
    got[0, 1] += 0.2
    with pytest.raises(AssertionError, match=r"2 / 4 elements outside .* worst at \(1, 0\): got 3.5, want 3"):
        tol.assert_within(got, want, 0.1, "demo")
    tol.assert_within(got, want, 0.5)


def test_gamma():
    u = 2.0**-24
    assert tol.gamma(96) == pytest.approx(96 * u / (1 - 96 * u), rel=1e-12)
    assert tol.accumulation_rel(96) == pytest.approx(2 * tol.gamma(96), rel=1e-12)
    assert tol.unit_roundoff(torch.bfloat16) == 2.0**-8 and tol.unit_roundoff(torch.bfloat16, truncate=True) == 2.0**-7


def test_bound_leaves_out_only_noise_it_cannot_judge():
    """``within_eager_bound`` on fresh random tensors: an error beyond the bound fails where bf16 has signal, and is
    left unjudged only where bf16 eager or plain Inductor is itself half the tensor's magnitude off."""

    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    ref = torch.randn(64, 32, generator=gen)
    scale = ref.abs().max().item()
    noise = torch.randn(64, 32, generator=gen)
    small, big = 1e-3 * scale * noise / noise.abs().max(), 0.6 * scale * noise / noise.abs().max()

    def run(eager_err, ind_err, got_err):
        loss = torch.tensor(1.0)
        step = lambda err: {"loss": loss, "w": ref + err}  # noqa: E731
        return tol.within_eager_bound(step(got_err), step(eager_err), step(0.0), step(ind_err))

    bound = 4 * small.abs().max().item() + 2**-8 * scale + small.abs().max().item()
    ok, worst, unjudged = run(small, small, 2 * bound / scale * ref)  # wrong by 2x the bound, bf16 has signal
    assert not ok and worst[0] == "w" and unjudged == []
    ok, _, unjudged = run(small, small, 0.5 * bound / scale * ref)  # within the bound
    assert ok and unjudged == []
    ok, _, unjudged = run(small, big, 3 * big)  # beyond the bound, but plain Inductor is 0.6x off: no signal
    assert ok and unjudged == ["w"]
    ok, worst, unjudged = run(small, big, 0.5 * big)  # noisy but within the bound: judged
    assert ok and unjudged == [] and worst[0] == "w"


def test_non_finite_inductor_distance_adds_nothing():
    """FINDINGS B3: plain Inductor's NaN (or inf) on a tensor neither widens the bound nor makes it NaN: a compiled
    step within eager's bound passes, one past it fails, as without an Inductor run."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    ref = torch.randn(64, 32, generator=gen)
    scale = ref.abs().max().item()
    eager = ref + 1e-3 * scale * torch.randn(64, 32, generator=gen).clamp(-1, 1)
    bound = 4 * (eager - ref).abs().max().item() + 2**-8 * scale
    for bad in (float("nan"), float("inf")):
        inductor = ref.clone()
        inductor[3, 5] = bad
        step = lambda w: {"loss": torch.tensor(1.0), "w": w}  # noqa: E731
        ok, _, unjudged = tol.within_eager_bound(step(ref + 0.5 * bound / scale * ref), step(eager), step(ref),
                                                 step(inductor))
        assert ok and unjudged == []
        ok, worst, _ = tol.within_eager_bound(step(ref + 2 * bound / scale * ref), step(eager), step(ref),
                                              step(inductor))
        assert not ok and worst[0] == "w" and 1.5 < worst[1] < 2.5


def test_bound_keeps_exact_zeros():
    """``within_eager_bound`` where eager or the float32 reference is exactly zero: no relative bound can judge those,
    so a compiled value off zero fails (PhiMoE's router gradient once passed as unjudged noise)."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    loss = torch.tensor(1.0)
    zero, residue = torch.zeros(8, 4), 1e-4 * torch.randn(8, 4, generator=gen)
    step = lambda w: {"loss": loss, "w": w}  # noqa: E731
    ok, worst, _ = tol.within_eager_bound(step(residue), step(zero), step(zero), step(zero))
    assert not ok and worst[0].startswith("w: exactly zero")
    assert tol.within_eager_bound(step(zero.clone()), step(zero), step(zero), step(zero))[0]
    # eager nonzero but the float32 reference exactly zero: judged, not left out as noise
    ok, worst, unjudged = tol.within_eager_bound(step(100 * residue), step(residue), step(zero), step(residue))
    assert not ok and worst[0] == "w" and unjudged == []


def test_bound_keeps_structural_zeros():
    """An element exactly zero in eager and in the reference (an expert no token reached, a masked entry) must stay
    exactly zero compiled, however small the residue and however large the rest of the tensor; where plain
    Inductor's element is not zero either, the residue is the compile's, not the rewrite's."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    ref = torch.randn(8, 4, generator=gen)
    row = int(torch.randint(0, 8, (), generator=gen))
    ref[row] = 0
    eager = ref + 1e-3 * torch.randn(8, 4, generator=gen)
    eager[row] = 0
    got = eager.clone()
    got[row, 1] = 1e-30
    ok, worst, _ = tol.within_eager_bound({"w": got}, {"w": eager}, {"w": ref})
    assert not ok and "exactly zero in eager and the reference" in worst[0]
    assert tol.within_eager_bound({"w": got}, {"w": eager}, {"w": ref}, {"w": got})[0]
    assert tol.within_eager_bound({"w": eager.clone()}, {"w": eager}, {"w": ref})[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_bound_floor_is_one_rounding_in_the_compute_dtype(dtype):
    """Where eager is exactly the reference, the bound is one rounding of the largest value in ``dtype``."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    ref = torch.randn(16, dtype=F64, generator=gen)
    floor = tol.unit_roundoff(dtype) * ref.abs().max().item()
    sign = torch.sign(torch.randn(16, dtype=F64, generator=gen))
    for factor, ok in ((0.9, True), (1.1, False)):
        got = ref + factor * floor * sign
        assert tol.within_eager_bound({"w": got}, {"w": ref}, {"w": ref}, dtype=dtype)[0] is ok


def test_few_samples_counts_the_steps_noise():
    """``few_samples``: a tensor whose eager error is one lucky draw (one token) is judged with the step's noise
    (eager's largest relative error over tensors of at least 64 elements) as eager's floor; without it the same
    error fails, and a wrong value (a dropped term: off by its own magnitude) fails either way."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    big, w = torch.randn(64, 32, generator=gen), torch.randn(16, 16, generator=gen)
    noise = 1e-4 * big.abs().max() * torch.randn(64, 32, generator=gen).sign()
    lucky = 1e-7 * w.abs().max() * torch.randn(16, 16, generator=gen).sign()  # eager's error on w: a tiny draw
    ref = {"big": big, "w": w}
    eager = {"big": big + noise, "w": w + lucky}
    rel = float((noise.abs().max() / big.abs().max()))
    plausible = {"big": big + noise, "w": w + 2 * rel * w}  # another order of the same sums: the step's noise
    assert not tol.within_eager_bound(plausible, eager, ref, dtype=torch.float32, always_judged=())[0]
    ok, worst, _ = tol.within_eager_bound(plausible, eager, ref, dtype=torch.float32, always_judged=(),
                                          few_samples={"w"})
    assert ok and worst[0] == "w"
    wrong = {"big": big + noise, "w": w - w * (torch.rand(16, 16, generator=gen) < 0.5)}
    assert not tol.within_eager_bound(wrong, eager, ref, dtype=torch.float32, always_judged=(), few_samples={"w"})[0]


def test_tensor_absent_in_eager_and_compiled_is_unjudged_but_not_one_side():
    """A gradient only the wider reference has (its routing sent a token to an expert that eager's, in the low
    precision, did not; FINDINGS C6) is left unjudged when neither eager nor the compiled step has it; a tensor that
    one of the two lacks still fails."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    out, w = torch.randn(8, 4, generator=gen), torch.randn(4, 4, generator=gen)
    ref = {"out": out, "grad:w": w}
    ok, _, unjudged = tol.within_eager_bound({"out": out.clone()}, {"out": out.clone()}, ref, always_judged=("out",))
    assert ok and unjudged == ["grad:w"]
    for got, eager in (({"out": out.clone()}, dict(ref)), (dict(ref), {"out": out.clone()})):
        ok, worst, _ = tol.within_eager_bound(got, eager, ref, always_judged=("out",))
        assert not ok and worst[0] == "grad:w: missing"
