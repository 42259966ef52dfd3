"""Naive float64 references and shared helpers for the dispatch-op tests (loops and host syncs allowed)."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from hypothesis import strategies as st

# One tolerance table for every combine comparison (after TE's dtype_tols). Data movement is bitwise.
DTYPE_TOLS = {
    torch.float32: dict(rtol=1.3e-6, atol=1e-5),
    torch.float16: dict(rtol=1e-3, atol=1e-5),
    torch.bfloat16: dict(rtol=8e-3, atol=1e-5),
    torch.float64: dict(rtol=1e-12, atol=1e-12),
}
# fp32 dot products over H (prob gradients), compared against float64
DOT_TOLS = {
    torch.float32: dict(rtol=1e-5, atol=1e-4),
    torch.float16: dict(rtol=2e-3, atol=1e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
    torch.float64: dict(rtol=1e-12, atol=1e-12),
}

# The CPU op tests' case grid: dtypes, (num_experts, top_k) pairs and alignments.
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
EK = [(E, K) for E in (1, 7, 16, 64, 256) for K in (1, 2, 5, 8) if K <= E]
ALIGNS = (1, 16, 32, 128)


def sampled_large_cases(n: int, seed: int) -> list[tuple]:
    """``n`` random (T, H, (E, K), align, dtype) cases of the grid with T = 4096 or H = 1280."""
    rng = random.Random(seed)
    big = [c for c in itertools.product((37, 4096), (8, 1280), EK, ALIGNS, DTYPES) if c[0] == 4096 or c[1] == 1280]
    return rng.sample(big, n)


@st.composite
def random_small_case(draw: st.DrawFn) -> dict:
    """Keyword arguments (T, H, E, K, a, dtype, seed, with_probs) for a test's ``_check_case``: small random shapes."""
    T = draw(st.integers(0, 40))
    H = draw(st.integers(1, 24))
    E = draw(st.integers(1, 40))
    k_frac = draw(st.floats(0, 1))
    a = draw(st.sampled_from((1, 8, 16, 32, 64, 128, 256)))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**16))
    with_probs = draw(st.booleans())
    K = 1 + int(k_frac * (min(E, 8) - 1))
    return dict(T=T, H=H, E=E, K=K, a=a, dtype=dtype, seed=seed, with_probs=with_probs)


def naive_dispatch(ids_TK: torch.Tensor, num_experts: int, align: int) -> dict:
    """Destination row of every (t, k) by walking the flat ids in order, plus counts and offs."""
    T, K = ids_TK.shape
    flat = ids_TK.reshape(-1).tolist()
    counts = [0] * num_experts
    for e in flat:
        counts[e] += 1
    padded = [math.ceil(c / align) * align for c in counts]
    starts, acc = [], 0
    for p in padded:
        starts.append(acc)
        acc += p
    cursor = list(starts)
    dest = []
    for e in flat:
        dest.append(cursor[e])
        cursor[e] += 1
    return dict(
        dest_TK=torch.tensor(dest, dtype=torch.int64).reshape(T, K),
        counts=counts,
        padded=padded,
        starts=starts,
        offs=[s + p for s, p in zip(starts, padded)],
    )


def static_bound(n: int, num_experts: int, align: int) -> int:
    return n if align == 1 else (n + num_experts * (align - 1)) // align * align


def naive_permute_pad(x_TH, ids_TK, probs_TK, num_experts, align):
    """Returns (rows_MH in x.dtype, probs_M or None, meta dict)."""
    T, K = ids_TK.shape
    meta = naive_dispatch(ids_TK.cpu(), num_experts, align)
    M = static_bound(T * K, num_experts, align)
    dest = meta["dest_TK"].reshape(-1).to(x_TH.device)
    tok = torch.arange(T * K, device=x_TH.device) // K
    rows = torch.zeros(M, x_TH.shape[1], dtype=x_TH.dtype, device=x_TH.device)
    rows[dest] = x_TH[tok]
    probs_M = None
    if probs_TK is not None:
        probs_M = torch.zeros(M, dtype=probs_TK.dtype, device=x_TH.device)
        probs_M[dest] = probs_TK.reshape(-1)
    return rows, probs_M, meta


def naive_combine(rows_MH, dest_TK, probs_TK):
    """float64 y[t] = sum_k p[t, k] * rows[dest[t, k]]."""
    z = rows_MH.double()[dest_TK.to(rows_MH.device)]  # [T, K, H]
    if probs_TK is not None:
        z = z * probs_TK.double().unsqueeze(-1)
    return z.sum(1)


def check_row_map(row_map, dest_TK):
    """row_map[t, :K] ascending and {(row, slot)} == {(dest[t, k], k)}."""
    T, K = dest_TK.shape
    assert row_map.dtype == torch.int32 and tuple(row_map.shape) == (T, 2 * K)
    rows, slots = row_map[:, :K].long().cpu(), row_map[:, K:].long().cpu()
    if T:
        assert bool((rows[:, 1:] > rows[:, :-1]).all())
    assert torch.equal(dest_TK.gather(1, slots), rows)
    assert torch.equal(slots.sort(1).values, torch.arange(K).expand(T, K))


def check_invariants(out, ids_TK, num_experts, align):
    """offs monotone, offs[-1] == padded total, pad rows and tail zero, empty experts 0 rows, counts sum."""
    T, K = ids_TK.shape
    M = static_bound(T * K, num_experts, align)
    rows, offs, counts = out.rows_MH, out.offs_E.long().cpu(), out.counts_E.long().cpu()
    assert rows.shape[0] == M and offs.dtype == torch.int64 and out.offs_E.dtype == torch.int32
    assert int(counts.sum()) == T * K
    padded = (counts + align - 1) // align * align
    assert torch.equal(offs, padded.cumsum(0))
    assert bool((offs[1:] >= offs[:-1]).all()) if num_experts > 1 else True
    assert int(offs[-1]) <= M
    starts = offs - padded
    # real rows: [starts[e], starts[e] + counts[e]) for every expert
    within = torch.arange(T * K) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    used = torch.zeros(M, dtype=torch.bool)
    used[torch.repeat_interleave(starts, counts) + within] = True
    assert not bool(rows[~used.to(rows.device)].any())
    if out.probs_M is not None:
        assert not bool(out.probs_M[~used.to(rows.device)].any())


ROUTINGS = ("uniform", "first_k", "last_k", "one_hot_expert")


def make_routing(T: int, K: int, num_experts: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    """int64 [T, K] top-k ids with distinct experts per token.

    uniform: random K of E; first_k / last_k: only experts [0, K) / [E-K, E) are used (the rest empty);
    one_hot_expert: every token's slot 0 is expert E // 2 (all tokens on one expert), the rest uniform.
    """
    if kind == "uniform":
        return torch.rand(T, num_experts, generator=gen).argsort(1)[:, :K]
    if kind in ("first_k", "last_k"):
        ids = torch.rand(T, K, generator=gen).argsort(1)
        return ids if kind == "first_k" else ids + (num_experts - K)
    if kind == "one_hot_expert":
        hot = num_experts // 2
        others = torch.rand(T, num_experts, generator=gen)
        others[:, hot] = 2.0  # sorts last: never among the other K-1
        ids = others.argsort(1)[:, : K - 1]
        return torch.cat([torch.full((T, 1), hot, dtype=torch.int64), ids], 1)
    raise ValueError(kind)


@pytest.fixture(autouse=True, scope="module")
def _single_intra_op_thread():
    """These tests run thousands of tiny ops: the intra-op thread pool only adds wake-up latency."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
