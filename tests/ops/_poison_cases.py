"""Bad input to the dispatch ops in the default mode: the checks, shared by the interpreter worker (CPU tensors under
``TRITON_INTERPRET=1``) and the GPU tests, so that the GPU tests run here first.

NOTE [dropped entries] (moe_compile/ops/permute_pad.py) and NOTE [poisoned tokens] (moe_compile/ops/unpad_unpermute.py)
say what the ops do. Each check runs the ops' kernels (``kernel_ops(device)``: on CUDA the public wrappers, on CPU the
eager autograd functions around the same kernels) on fresh random inputs with one kind of bad entry, and compares with

* the same call without the bad entries: for ``permute_pad`` the call on ``E + 1`` experts with every bad id set to
  ``E`` (the only difference is the extra expert's rows), for ``unpad_unpermute`` the call with the valid map;
  tokens without a bad entry must be bitwise equal there, forward and backward, and the tokens with one all NaN;
* the poisoning references (``permute_pad_reference`` / ``*_backward_reference`` on CPU), bitwise (NaN where NaN).

Standard library and torch only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

# (name, bad expert id): an id past the experts, a negative one, one that int32 would wrap into [0, E)
BAD_IDS = {"id_E": None, "id_minus_1": -1, "id_2_pow_40": 2**40}
# (name, which half, value relative to R or K): rows past the end / far past / negative, slots past / negative
BAD_MAPS = {
    "row_R": ("row", 0), "row_R_plus_1000": ("row", 1000), "row_minus_5": ("row", -5 - 10**9),
    "slot_K": ("slot", 0), "slot_K_plus_1000": ("slot", 1000), "slot_minus_1": ("slot", -1 - 10**9),
}  # fmt: skip


@dataclasses.dataclass
class KernelOps:
    """The kernels behind the public ops on ``device``, with autograd: ``permute(x, ids, probs, E, align)`` returns
    the five outputs; ``unpermute(rows, row_map, probs)`` the combine."""

    permute: Callable
    unpermute: Callable


def kernel_ops(device: str) -> KernelOps:
    import importlib

    # the modules (the package exports the wrappers under the same names)
    pp = importlib.import_module("moe_compile.ops.permute_pad")
    uu = importlib.import_module("moe_compile.ops.unpad_unpermute")

    if device == "cuda":
        return KernelOps(lambda x, ids, p, E, a: tuple(pp.permute_pad(x, ids, p, num_experts=E, align=a)),
                         lambda z, m, p: uu.unpad_unpermute(z, m, p))
    # CPU tensors: the public ops would take the CPU reference; these run the Triton kernels (interpreter)
    return KernelOps(lambda x, ids, p, E, a: pp._EagerPermutePad.apply(x, ids, p, E, a, False),
                     lambda z, m, p: uu._EagerUnpadUnpermute.apply(z, m, p, False))


def _equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bitwise, NaN where NaN."""
    got, want = got.detach().cpu(), want.detach().cpu()
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    if got.is_floating_point():
        assert torch.equal(got.isnan(), want.isnan()), (what, got, want)
        got, want = got.nan_to_num(0.0), want.nan_to_num(0.0)
    assert torch.equal(got, want), (what, got, want)


def _nan_rows(t: torch.Tensor, bad_T: torch.Tensor, what: str) -> None:
    """Rows of bad tokens all NaN, the others none."""
    t = t.detach().cpu()
    nan = t.isnan().reshape(t.shape[0], -1)
    assert bool(nan[bad_T].all()), (what, "a bad token's row is not all NaN", t[bad_T])
    assert not bool(nan[~bad_T].any()), (what, "NaN outside the bad tokens")


def _inputs(T: int, H: int, E: int, K: int, dtype: torch.dtype, device: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(dtype)
    ids = torch.rand(T, E, generator=gen).argsort(1)[:, :K]
    probs = torch.rand(T, K, generator=gen).to(dtype)
    w = torch.randn(H, generator=gen).to(dtype)  # the "expert": rows * w, so the combine reads real values
    g = torch.randn(T, H, generator=gen).to(dtype)
    return [t.to(device) for t in (x, ids, probs, w, g)]


def _bad_entries(T: int, K: int, seed: int) -> torch.Tensor:
    """bool [T, K]: a few bad entries, one token with all K bad, at least one good token."""
    gen = torch.Generator().manual_seed(seed + 1)
    bad = torch.rand(T, K, generator=gen) < 0.2
    bad[T // 2] = True
    bad[0] = False
    return bad


def check_bad_expert_ids(
    device: str, kind: str, T: int = 11, H: int = 24, E: int = 6, K: int = 3, align: int = 16,
    dtype: torch.dtype = torch.float32, ids_dtype: torch.dtype = torch.int64, seed: int = 0,
    ops: KernelOps | None = None,
) -> None:  # fmt: skip
    """``permute_pad`` given expert ids outside ``[0, E)`` (``kind`` in :data:`BAD_IDS`), then ``unpad_unpermute``
    three ways (probs in the combine; probs applied to the rows through ``probs_M``; no probs), forward and
    backward: NOTE [dropped entries] (moe_compile/ops/permute_pad.py)."""
    from moe_compile.ops import PermutePadOut, permute_pad_reference
    from moe_compile.ops.router_metrics import STATS, router_stats

    ops = ops or kernel_ops(device)
    x0, ids, probs0, w, g = _inputs(T, H, E, K, dtype, device, seed)
    ids = ids.to(ids_dtype)
    bad_TK = _bad_entries(T, K, seed).to(device)
    bad_value = E if BAD_IDS[kind] is None else BAD_IDS[kind]
    ids_bad = torch.where(bad_TK, torch.full_like(ids, bad_value), ids)
    ids_plus = torch.where(bad_TK, torch.full_like(ids, E), ids)  # the same call without them: expert E of E + 1
    bad_T = bad_TK.any(1).cpu()

    out = PermutePadOut(*ops.permute(x0, ids_bad, probs0, E, align))
    plus = PermutePadOut(*ops.permute(x0, ids_plus, probs0, E + 1, align))
    ref = permute_pad_reference(x0.cpu(), ids_bad.cpu(), probs0.cpu(), E, align)
    for got, want, what in zip(out, ref, PermutePadOut._fields):
        _equal(got, want, f"{what} vs the reference")
    M, used = out.rows_MH.shape[0], int(out.offs_E[-1])
    assert used == int(plus.offs_E[E - 1]) and used <= M
    _equal(out.rows_MH[:used], plus.rows_MH[:used], "rows of the experts")
    assert not bool(out.rows_MH[used:].cpu().any()) and not bool(out.probs_M[used:].cpu().any()), "tail not zero"
    _equal(out.probs_M[:used], plus.probs_M[:used], "probs_M of the experts")
    _equal(out.offs_E, plus.offs_E[:E], "offs_E")
    _equal(out.counts_E, plus.counts_E[:E], "counts_E")
    rows_plus = plus.row_map[:, :K]
    _equal(out.row_map, torch.cat([torch.where(rows_plus >= used, -1, rows_plus), plus.row_map[:, K:]], 1), "row_map")
    # the count, on the device (no host sync): per call, and in the router metrics
    n_bad = int(bad_TK.sum())
    assert int(out.invalid_ids()) == n_bad
    stats = router_stats(torch.randn(T, E, device=device), ids_bad)
    assert int(stats[STATS.index("invalid_ids")]) == n_bad

    for variant in ("probs_in_combine", "probs_on_rows", "no_probs"):
        results = []
        for ids_, E_ in ((ids_bad, E), (ids_plus, E + 1)):
            x, probs = x0.clone().requires_grad_(True), probs0.clone().requires_grad_(True)
            rows, probs_M, _, row_map, _ = ops.permute(x, ids_, probs, E_, align)
            z = rows * w
            if variant == "probs_on_rows":
                z = z * probs_M[:, None]
            y = ops.unpermute(z, row_map, probs if variant == "probs_in_combine" else None)
            grad_x, grad_p = torch.autograd.grad(y, (x, probs), g, allow_unused=True)
            results.append((y, grad_x, grad_p))
        (y, grad_x, grad_p), (y_ok, grad_x_ok, grad_p_ok) = results
        _nan_rows(y, bad_T, f"{variant}: y")
        _nan_rows(grad_x, bad_T, f"{variant}: grad x")
        _equal(y[~bad_T], y_ok[~bad_T], f"{variant}: y of the good tokens")
        _equal(grad_x[~bad_T], grad_x_ok[~bad_T], f"{variant}: grad x of the good tokens")
        if variant != "no_probs":
            _nan_rows(grad_p, bad_T, f"{variant}: grad probs")
            _equal(grad_p[~bad_T], grad_p_ok[~bad_T], f"{variant}: grad probs of the good tokens")


def check_bad_row_map(
    device: str, kind: str, T: int = 9, H: int = 20, E: int = 5, K: int = 3, align: int = 8,
    dtype: torch.dtype = torch.float32, seed: int = 0, ops: KernelOps | None = None,
) -> None:  # fmt: skip
    """``unpad_unpermute`` given a row map with bad entries (``kind`` in :data:`BAD_MAPS`), with and without probs,
    forward and backward: NOTE [poisoned tokens] (moe_compile/ops/unpad_unpermute.py). The rows and probs are views
    into larger buffers of huge values, so a read past either would show as a finite result instead of NaN."""
    from moe_compile.ops import permute_pad_reference
    from moe_compile.ops.unpad_unpermute import unpad_unpermute_backward_reference, unpad_unpermute_reference

    ops = ops or kernel_ops(device)
    x, ids, probs_, w, g = _inputs(T, H, E, K, dtype, device, seed)
    ref = permute_pad_reference(x.cpu(), ids.cpu(), None, E, align)
    M, row_map = ref.rows_MH.shape[0], ref.row_map.to(device)
    gen = torch.Generator().manual_seed(seed + 2)
    rows_ = torch.randn(M, H, generator=gen).to(dtype)

    huge = torch.finfo(dtype).max / 4

    def views() -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh ``(rows [M, H], probs [T, K])`` that require grad, views into buffers of huge values."""
        rows_buf = torch.full((M + 4, H), huge, dtype=dtype)
        rows_buf[2 : 2 + M] = rows_
        probs_buf = torch.full((T * K + 8,), huge, dtype=dtype)
        probs_buf[4 : 4 + T * K] = probs_.cpu().reshape(-1)
        rows_buf, probs_buf = rows_buf.to(device).requires_grad_(True), probs_buf.to(device).requires_grad_(True)
        return rows_buf[2 : 2 + M], probs_buf[4 : 4 + T * K].view(T, K)

    half, offset = BAD_MAPS[kind]
    bad_TK = _bad_entries(T, K, seed).to(device)
    bad_map = row_map.clone()
    if half == "row":
        bad_map[:, :K] = torch.where(bad_TK, M + offset, row_map[:, :K]).to(torch.int32)
    else:
        bad_map[:, K:] = torch.where(bad_TK, K + offset, row_map[:, K:]).to(torch.int32)
    bad_T = bad_TK.any(1).cpu()
    z_cpu, p_cpu = rows_, probs_.cpu()
    for with_probs in (True, False):
        poisoned = bad_T if (half == "row" or with_probs) else torch.zeros_like(bad_T)  # slots unread without probs
        results = []
        for map_ in (bad_map, row_map):
            z, probs = views()
            y = ops.unpermute(z, map_, probs if with_probs else None)
            grad_z, grad_p = torch.autograd.grad(y, (z, probs), g, allow_unused=True)
            results.append((y, grad_z, grad_p))
        (y, grad_z, grad_p), (y_ok, grad_z_ok, grad_p_ok) = results
        what = f"{kind}, probs {with_probs}"
        _nan_rows(y, poisoned, f"{what}: y")
        _equal(y[~poisoned], y_ok[~poisoned], f"{what}: y of the good tokens")
        _equal(y, unpad_unpermute_reference(z_cpu, bad_map.cpu(), p_cpu if with_probs else None), f"{what}: y vs ref")
        # backward: the rows the good tokens read get their usual gradient; a poisoned token's in-range rows NaN
        good_rows = row_map[~poisoned.to(device), :K].reshape(-1).long()
        _equal(grad_z[good_rows], grad_z_ok[good_rows], f"{what}: grad rows of the good tokens")
        bad_rows = bad_map[poisoned.to(device), :K].reshape(-1).long()
        bad_rows = bad_rows[(bad_rows >= 0) & (bad_rows < M)]
        assert bool(grad_z[bad_rows].isnan().all()), (what, "a poisoned token's rows have finite gradients")
        want_z, want_p = unpad_unpermute_backward_reference(
            g.cpu(), bad_map.cpu(), p_cpu if with_probs else None, z_cpu if with_probs else None, M
        )
        _equal(grad_z, want_z, f"{what}: grad rows vs the reference")
        if with_probs:
            _nan_rows(grad_p, poisoned, f"{what}: grad probs")
            _equal(grad_p[~poisoned], grad_p_ok[~poisoned], f"{what}: grad probs of the good tokens")
            # the kernel's dot over H runs in another order than the reference's: close, not bitwise (then cast)
            tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}.get(dtype, 1e-12)
            torch.testing.assert_close(grad_p.detach().cpu(), want_p, rtol=tol, atol=tol, equal_nan=True)
