"""``torch.ops.moe.unpad_unpermute``: the inverse of ``permute_pad``, a deterministic weighted gather-sum.

Shapes: ``T`` tokens, ``H`` hidden, ``K`` top-k, ``R`` rows of the padded buffer (``M`` of permute_pad).

``y_TH[t] = sum_j probs[t, slot_j] * rows_RH[row_j]`` over token ``t``'s ``K`` rows, where
``(row_j, slot_j) = (row_map[t, j], row_map[t, K + j])`` and the rows are visited in ascending order
(= ascending expert id), accumulated in fp32 (fp64 for fp64 inputs) and cast once to ``rows_RH.dtype``.
Without probs the weights are 1. Pad and tail rows are never read. No atomics anywhere.

NOTE [expert-order gather-sum]: the fixed ascending order makes the result bitwise reproducible, and
it equals other combines (HF's sum over top-k slots, ``index_add_``) only to a tolerance.

Backward (``moe::unpad_unpermute_backward``):
``grad_rows[row(t, k)] = (g[t] * p[t, k]).to(rows.dtype)`` (a permute of ``g``), rows not in ``row_map``
(pad rows, tail) are zero; ``grad_probs[t, k] = <rows[row(t, k)], g[t]>`` in fp32, one program per token
on CUDA (no atomics across ``H`` tiles).

Both ops are built like ``torch.library.triton_op`` (NOTE [device-decomposed triton ops] (moe_compile/ops/_common.py)):
on CUDA, ``torch.compile`` sees their Triton launches; on CPU the body is the
gather-only reference (NOTE [gather-only reference] (moe_compile/ops/permute_pad.py)). Eager CUDA launches
disable fp contraction, so the combine equals the reference bitwise; Inductor compiles the kernels
with its own options (contraction on), which may move a result by one rounding of the fp32 sum.

The zero-prob rule (see NOTE [zero-prob rule] (moe_compile/ops/permute_pad.py)) is not applied: a ``0.0`` prob simply
weights its row by zero.

NOTE [poisoned tokens]:
A row-map entry is *bad* when its row is outside ``[0, R)`` (``permute_pad`` writes ``-1`` for an expert id
outside ``[0, E)``, NOTE [dropped entries] (moe_compile/ops/permute_pad.py); any other such row is a corrupt map),
or, where the slot is read (with probs), when its slot is outside ``[0, K)``. What happens to such input:

* CPU, eager: the op raises ``ValueError`` naming ``row_map`` (the host reads the map anyway).
* CUDA with ``debug=True``: a device-side assert (no host sync).
* CUDA by default, and every reference: no load leaves its tensor (bad rows and slots are masked or clamped), and
  the token is *poisoned*: ``y[t]`` is NaN in every column, so the loss shows it. Backward: the token's gradients
  are NaN too (its incoming gradient is read as NaN: ``grad_rows`` of its in-range rows and ``grad_probs[t, :]``),
  never finite-and-wrong; ``permute_pad``'s backward, the same gather over the map, gives ``grad_x[t]`` and
  ``grad_probs[t, :]`` NaN for a token with a dropped entry. Every other token's results are bitwise those of the
  same call without the bad entry, and the kernels' cost on valid input is a few compares per token (nothing is
  read back on the host).

Count them on the device: ``PermutePadOut.invalid_ids()`` per call, or ``moe/invalid_ids`` from
:mod:`moe_compile.metrics` per layer (the router's ids outside ``[0, E)``). A bad row that is not a dropped entry
only comes from a corrupt map and has no counter: counting it would need another output of the op (an integer
per call, reduced across programs), a schema change for a case the ops never produce themselves.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe_compile.ops import _common, _eager_launch

__all__ = ["unpad_unpermute", "unpad_unpermute_backward_reference", "unpad_unpermute_reference"]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ===== reference =====


def unpad_unpermute_reference(rows_RH: Tensor, row_map: Tensor, probs_TK: Tensor | None = None) -> Tensor:
    """Pure-PyTorch, sync-free unpad + unpermute (the CPU kernel and the test oracle).

    Args:
        rows_RH: ``[R, H]`` expert-major rows (output of the experts).
        row_map: int32 ``[T, 2K]`` from :func:`moe_compile.ops.permute_pad`.
        probs_TK: optional ``[T, K]`` merging probs (in top-k slot order, like ``expert_idx``).

    Returns:
        ``[T, H]`` in ``rows_RH.dtype``: fp32 accumulation in ascending row order, cast once; NaN rows for
        tokens with a bad entry (NOTE [poisoned tokens]).
    """
    T, K = row_map.shape[0], row_map.shape[1] // 2
    R, H = rows_RH.shape
    acc_dtype = _acc_dtype(rows_RH.dtype)
    rows_TK, ok_TK = _rows_in_range(row_map, R)
    probs_sorted_TK = None
    if probs_TK is not None:
        slots_TK, slots_ok_TK = _slots_in_range(row_map)
        ok_TK = ok_TK & slots_ok_TK
        probs_sorted_TK = probs_TK.gather(1, slots_TK).to(acc_dtype)
    acc_TH = torch.zeros((T, H), dtype=acc_dtype, device=rows_RH.device)
    for j in range(K):  # ascending rows: fixed, documented summation order
        term_TH = (
            rows_RH.index_select(0, rows_TK[:, j]).to(acc_dtype) if R > 0 else acc_TH.new_zeros(T, H)
        )
        if probs_sorted_TK is not None:
            term_TH = term_TH * probs_sorted_TK[:, j : j + 1]
        acc_TH = acc_TH + term_TH
    return _poison_tokens(acc_TH.to(rows_RH.dtype), ok_TK)


def _rows_in_range(row_map: Tensor, num_rows: int) -> tuple[Tensor, Tensor]:
    """``(rows_TK, ok_TK)``: the row half as int64 clamped into ``[0, num_rows)`` (safe to gather with), and where
    it was in range (NOTE [poisoned tokens])."""
    K = row_map.shape[1] // 2
    rows_TK = row_map[:, :K].long()
    ok_TK = (rows_TK >= 0) & (rows_TK < num_rows)
    return rows_TK.clamp(0, max(num_rows - 1, 0)), ok_TK


def _slots_in_range(row_map: Tensor) -> tuple[Tensor, Tensor]:
    """``(slots_TK, ok_TK)``: the slot half as int64 clamped into ``[0, K)``, and where it was in range."""
    K = row_map.shape[1] // 2
    slots_TK = row_map[:, K:].long()
    ok_TK = (slots_TK >= 0) & (slots_TK < K)
    return slots_TK.clamp(0, K - 1), ok_TK


def _poison_tokens(t_TX: Tensor, ok_TK: Tensor) -> Tensor:
    """``t_TX`` with NaN rows for the tokens that have an entry not ``ok`` (NOTE [poisoned tokens])."""
    return torch.where(ok_TK.all(1, keepdim=True), t_TX, torch.full((), float("nan"), dtype=t_TX.dtype,
                                                                     device=t_TX.device))


def place_of_slot(slots_TK: Tensor) -> Tensor:
    """int64 ``[T, K]``: where each top-k slot ``k`` sits in ``slots_TK`` (each row a permutation of ``0..K-1``),
    the inverse permutation: a sort, or compares at small sizes
    (NOTE [few library calls] (moe_compile/ops/_common.py))."""
    T, K = slots_TK.shape
    if T * K * K > _common.SMALL_COMPARES:
        return slots_TK.argsort(dim=1)
    k = torch.arange(K, device=slots_TK.device)
    # (the clamp keeps a row that is no permutation, a poisoned token's, inside [0, K): NOTE [poisoned tokens])
    return ((slots_TK[:, None, :] == k[None, :, None]) * k[None, None, :]).sum(2).clamp_max(K - 1)


def rows_by_slot(row_map: Tensor) -> Tensor:
    """int64 ``[T, K]``: the row of each top-k slot (``row_map`` lists rows ascending, with their slots).

    A gather through the inverse of each token's slot permutation, not a scatter.
    """
    K = row_map.shape[1] // 2
    return row_map[:, :K].long().gather(1, place_of_slot(row_map[:, K:].long()))


def unpad_unpermute_backward_reference(
    grad_y_TH: Tensor, row_map: Tensor, probs_TK: Tensor | None, rows_RH: Tensor | None, num_rows: int
) -> tuple[Tensor, Tensor | None]:
    """Gradients of :func:`unpad_unpermute_reference` (gathers only:
    NOTE [gather-only reference] (moe_compile/ops/permute_pad.py)).

    Returns ``(grad_rows_RH, grad_probs_TK)``; ``grad_probs_TK`` is None unless both ``probs_TK`` and
    ``rows_RH`` are given. Rows of ``grad_rows_RH`` that ``row_map`` does not reference are zero.
    """
    T, K = row_map.shape[0], row_map.shape[1] // 2
    N = T * K
    H = grad_y_TH.shape[1]
    device = grad_y_TH.device
    acc_dtype = _acc_dtype(grad_y_TH.dtype)
    # a token with a bad entry gets NaN gradients (its incoming gradient reads NaN: NOTE [poisoned tokens]); the
    # unclamped rows decide which rows an entry writes (a row outside [0, num_rows) matches none)
    rows_TK = row_map[:, :K].long()
    safe_rows_TK, ok_TK = _rows_in_range(row_map, num_rows)
    if probs_TK is not None:
        slots_TK, slots_ok_TK = _slots_in_range(row_map)
        ok_TK = ok_TK & slots_ok_TK
    else:
        slots_TK = row_map[:, K:].long()
    grad_y_TH = _poison_tokens(grad_y_TH, ok_TK)
    if probs_TK is None:
        vals_TKH = grad_y_TH.unsqueeze(1).expand(T, K, H)
    else:
        probs_sorted_TK = probs_TK.gather(1, slots_TK).to(acc_dtype)
        vals_TKH = (grad_y_TH.to(acc_dtype).unsqueeze(1) * probs_sorted_TK.unsqueeze(2)).to(grad_y_TH.dtype)
    # row r takes the value of the entry (t, j) that references it, found by a sort of the referenced
    # rows and a search; unreferenced rows (pad, tail) are zero
    if N > 0:
        r_R = torch.arange(num_rows, device=device, dtype=torch.int64)
        if N * num_rows <= _common.SMALL_COMPARES:  # NOTE [few library calls] (moe_compile/ops/_common.py)
            hit_RN = (rows_TK.reshape(1, N) == r_R[:, None]).to(torch.int32)
            is_used_R = hit_RN.amax(1) > 0
            src_R = hit_RN.argmax(1)  # the first entry that references row r
        else:
            sorted_rows_N, entry_N = torch.sort(rows_TK.reshape(N))
            pos_R = torch.searchsorted(sorted_rows_N, r_R).clamp_max(N - 1)
            is_used_R = sorted_rows_N.index_select(0, pos_R) == r_R
            src_R = entry_N.index_select(0, pos_R)
        gathered_RH = vals_TKH.reshape(N, H).index_select(0, src_R)
        grad_rows_RH = torch.where(is_used_R[:, None], gathered_RH, grad_y_TH.new_zeros(()))
    else:
        grad_rows_RH = grad_y_TH.new_zeros((num_rows, H))
    if probs_TK is None or rows_RH is None:
        return grad_rows_RH, None
    if num_rows > 0:
        z_TKH = rows_RH.index_select(0, safe_rows_TK.reshape(-1)).reshape(T, K, H).to(acc_dtype)
    else:
        z_TKH = grad_y_TH.new_zeros(T, K, H, dtype=acc_dtype)
    dots_TK = (z_TKH * grad_y_TH.to(acc_dtype).unsqueeze(1)).sum(dim=2)
    # dots are in ascending-row order; slot k's dot sits at the position of k among the token's slots
    grad_probs_TK = dots_TK.gather(1, place_of_slot(slots_TK)).to(probs_TK.dtype)
    return grad_rows_RH, _poison_tokens(grad_probs_TK, ok_TK)


# ===== validation =====


def _check_args(rows: Tensor, row_map: Tensor, probs: Tensor | None, debug: bool = False) -> None:
    # Fast path over the common case; anything off goes to the detailed checks (first failing argument).
    if (
        type(debug) is bool
        and isinstance(rows, Tensor)
        and isinstance(row_map, Tensor)
        and rows.dtype in _common.FLOAT_DTYPE_SET
        and row_map.dtype == torch.int32
        and rows.dim() == 2
        and row_map.dim() == 2
        and row_map.shape[1] >= 2
        and row_map.shape[1] % 2 == 0
        and row_map.device == rows.device
        and (
            probs is None
            or (
                isinstance(probs, Tensor)
                and probs.dtype in _common.FLOAT_DTYPE_SET
                and probs.dim() == 2
                and probs.shape[0] == row_map.shape[0]
                and probs.shape[1] == row_map.shape[1] // 2
                and probs.device == rows.device
            )
        )
    ):
        return
    _check_args_detailed(rows, row_map, probs, debug)


def _check_args_detailed(rows: Tensor, row_map: Tensor, probs: Tensor | None, debug: bool = False) -> None:
    _common.check_float_tensor(rows, "rows", 2)
    _common.check_int_tensor(row_map, "row_map", 2, dtypes=(torch.int32,))
    width = row_map.shape[1]
    if width < 2 or width % 2 != 0:
        raise ValueError(f"row_map must have shape [T, 2K] with K >= 1 (from permute_pad), got {tuple(row_map.shape)}")
    if probs is not None:
        _common.check_float_tensor(probs, "probs", 2)
        if probs.shape[0] != row_map.shape[0] or probs.shape[1] != width // 2:
            raise ValueError(
                f"probs must have shape [T, K] = [{row_map.shape[0]}, {width // 2}] to match "
                f"row_map.shape={tuple(row_map.shape)}, got probs.shape={tuple(probs.shape)}"
            )
    _common.check_same_device(rows=rows, row_map=row_map, probs=probs)
    _common.check_bool(debug, "debug")


def _check_map_values(row_map: Tensor, num_rows: int) -> None:
    """Host checks (CPU tensors) of both halves of ``row_map``: rows in ``[0, num_rows)``; each token's slots a
    permutation of ``0..K-1`` (NOTE [poisoned tokens] says what the device does instead)."""
    K = row_map.shape[1] // 2
    _common.check_ids_in_range(row_map[:, :K], 0, num_rows, "row_map (rows)")
    slots = row_map[:, K:]
    _common.check_ids_in_range(slots, 0, K, "row_map (slots)")
    if slots.numel() and not torch.equal(slots.sort(dim=1).values, torch.arange(K, dtype=slots.dtype).expand_as(slots)):
        bad = int((slots.sort(dim=1).values != torch.arange(K, dtype=slots.dtype)).any(1).nonzero()[0, 0])
        raise ValueError(
            f"row_map (slots) of each token must be a permutation of 0..{K - 1} (from permute_pad), "
            f"got {slots[bad].tolist()} for token {bad}"
        )


# ===== Triton launchers (CUDA; also run on CPU tensors under TRITON_INTERPRET=1 in the tests) =====


def _acc_tl_dtype(dtype: torch.dtype):
    import triton.language as tl

    return tl.float64 if dtype == torch.float64 else tl.float32


_GATHER_SUM_REPLAYS = _eager_launch.Replays()
_BACKWARD_REPLAYS = _eager_launch.Replays()


def launch_gather_sum_triton(
    rows: Tensor,
    row_map: Tensor,
    probs: Tensor | None,
    debug: bool = False,
    *,
    grad_probs_M: Tensor | None = None,
    block_h: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``y[t] = sum_j p_j * rows[row_j]`` (one launch). With ``grad_probs_M`` (permute_pad backward) it
    also gathers ``grad_probs[t, k] = grad_probs_M[row(t, k)]``. Returns ``(y_TH, grad_probs_TK or None)``.
    Needs ``T > 0`` and ``H > 0``. Under a trace the kernel goes through ``wrap_triton``.
    """
    from moe_compile.ops.triton import dispatch as kernels

    T, K, R, H = _common.static_ints(row_map.shape[0], row_map.shape[1] // 2, *rows.shape)
    traced = rows.is_cuda and _common.is_traced(rows)
    rows, row_map = rows.contiguous(), row_map.contiguous()
    probs = probs.contiguous() if probs is not None else None
    grad_probs_M = grad_probs_M.contiguous() if grad_probs_M is not None else None
    replay_key = replayed = None
    if not traced:  # NOTE [replayed eager launches] (moe_compile/ops/_eager_launch.py)
        replay_key = _eager_launch.replay_key((T, K, R, H, debug, block_h), rows, row_map, probs, grad_probs_M)
        replayed = _GATHER_SUM_REPLAYS.get(replay_key, rows.get_device())
    empty = _common.eager_cuda_allocator(rows, traced)
    out = empty((T, H), rows.dtype)
    grad_probs = empty((T, K), grad_probs_M.dtype) if grad_probs_M is not None else None
    args = (
        rows, row_map, probs if probs is not None else rows, out,
        grad_probs_M if grad_probs_M is not None else rows,
        # unused without GATHER_PROB_GRAD: a fresh placeholder, so that no output aliases another
        grad_probs if grad_probs is not None else out.new_empty(0),
        R, H,
    )  # fmt: skip
    if replayed is not None:
        _eager_launch.replay(*replayed, args)
        return out, grad_probs
    bh, num_warps = _common.row_block(H, rows.element_size())
    bh = block_h or bh
    record = [] if replay_key is not None else None
    _common.launch_kernel(
        kernels._unpermute_rows_kernel, (T, _common.cdiv(H, bh)), *args,
        K=K, K_PAD=max(2, _common.next_power_of_2(K)), HAS_PROBS=probs is not None,
        GATHER_PROB_GRAD=grad_probs_M is not None, ACC_DTYPE=_acc_tl_dtype(rows.dtype), BLOCK_H=bh, DEBUG=debug,
        traced=traced, record=record, options=dict(num_warps=num_warps, debug=debug, enable_fp_fusion=False),
    )  # fmt: skip
    if record is not None:
        _GATHER_SUM_REPLAYS.keep(replay_key, record, 1)
    return out, grad_probs


def launch_unpad_unpermute_backward_triton(
    grad_y: Tensor,
    row_map: Tensor,
    probs: Tensor | None,
    rows: Tensor | None,
    num_rows: int,
    debug: bool = False,
    *,
    block_h: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Two launches after a ``num_rows``-byte memset: mark referenced rows, then one kernel that writes
    ``grad_rows`` (token programs, plus zero programs for unreferenced rows) and the prob gradient.
    Needs ``H > 0``. Returns ``(grad_rows, grad_probs or None)``.
    """
    from moe_compile.ops.triton import dispatch as kernels

    T, K, H, num_rows = _common.static_ints(row_map.shape[0], row_map.shape[1] // 2, grad_y.shape[1], num_rows)
    dev = grad_y.device
    traced = grad_y.is_cuda and _common.is_traced(grad_y)
    grad_y, row_map = grad_y.contiguous(), row_map.contiguous()
    need_prob_grad = probs is not None and rows is not None
    probs = probs.contiguous() if probs is not None else None
    rows = rows.contiguous() if need_prob_grad else None
    replay_key = replayed = None
    if not traced:  # NOTE [replayed eager launches] (moe_compile/ops/_eager_launch.py)
        replay_key = _eager_launch.replay_key((T, K, H, num_rows, debug, block_h), grad_y, row_map, probs, rows)
        replayed = _BACKWARD_REPLAYS.get(replay_key, grad_y.get_device())
    empty = _common.eager_cuda_allocator(grad_y, traced)
    grad_rows = empty((num_rows, H), grad_y.dtype)
    # without the prob gradient: the op's empty placeholder output doubles as the unused pointer
    grad_probs = empty((T, K), probs.dtype) if need_prob_grad else grad_y.new_empty(0)
    used = torch.zeros(num_rows, dtype=torch.int8, device=dev)
    if traced and _common.ttir_writes_follow_loads():
        # both kernels store at rows read from row_map: give them a private copy
        # (NOTE [no load-derived store addresses on graph inputs] (moe_compile/ops/triton/dispatch.py))
        row_map = row_map.clone()
    mark_args = (row_map, used, T * K, num_rows)
    args = (
        grad_y, rows if need_prob_grad else grad_y, row_map, probs if probs is not None else grad_y, used,
        grad_rows, grad_probs, T, num_rows, H,
    )  # fmt: skip
    if replayed is not None:
        _eager_launch.replay(*replayed, *((mark_args,) if T * K > 0 else ()), args)
        return grad_rows, (grad_probs if need_prob_grad else None)
    record = [] if replay_key is not None else None
    if T * K > 0:
        _common.launch_kernel(
            kernels._mark_used_rows_kernel, (_common.cdiv(T * K, 1024),), *mark_args,
            K=K, BLOCK=1024, traced=traced, record=record, options=dict(num_warps=4),
        )  # fmt: skip
    k_pad = max(2, _common.next_power_of_2(K))
    # tiles are [K_PAD, BLOCK_H]: keep them at <= 8 KiB of activations
    bh, num_warps = _common.row_block(H, grad_y.element_size(), max_bytes=max(256, 8192 // k_pad))
    bh = block_h or bh
    num_warps = max(num_warps, 4)
    zero_rows = max(2, min(16, 4096 // bh))
    grid = (T + _common.cdiv(num_rows, zero_rows), 1 if need_prob_grad else _common.cdiv(H, bh))
    _common.launch_kernel(
        kernels._unpermute_backward_kernel, grid, *args,
        K=K, K_PAD=k_pad, HAS_PROBS=probs is not None, NEED_PROB_GRAD=need_prob_grad,
        LOOP_H=need_prob_grad, ACC_DTYPE=_acc_tl_dtype(grad_y.dtype), BLOCK_H=bh, ZERO_ROWS=zero_rows,
        DEBUG=debug, traced=traced, record=record,
        options=dict(num_warps=num_warps, debug=debug, enable_fp_fusion=False),
    )  # fmt: skip
    if record is not None:
        _BACKWARD_REPLAYS.keep(replay_key, record, 2 if T * K > 0 else 1)
    return grad_rows, (grad_probs if need_prob_grad else None)


def _unpad_unpermute_cuda(rows, row_map, probs, debug=False):
    """The CUDA path (Triton; the reference for empty shapes). Runs on CPU tensors under the interpreter."""
    _check_args(rows, row_map, probs, debug)
    if rows.shape[1] == 0 or row_map.shape[0] == 0:
        return unpad_unpermute_reference(rows, row_map, probs)
    return launch_gather_sum_triton(rows, row_map, probs, debug)[0]


def _unpad_unpermute_backward_cuda(grad_y, row_map, probs, rows, num_rows):
    if grad_y.shape[1] == 0:
        grad_rows, grad_probs = unpad_unpermute_backward_reference(grad_y, row_map, probs, rows, num_rows)
    else:
        grad_rows, grad_probs = launch_unpad_unpermute_backward_triton(grad_y, row_map, probs, rows, num_rows)
    return grad_rows, (grad_probs if grad_probs is not None else grad_y.new_empty(0))


# ===== ops (NOTE [device-decomposed triton ops] (moe_compile/ops/_common.py)) =====


def _unpad_unpermute_body(rows: Tensor, row_map: Tensor, probs: Tensor | None, debug: bool = False) -> Tensor:
    if rows.device.type == "cuda":
        return _unpad_unpermute_cuda(rows, row_map, probs, debug)
    _check_args(rows, row_map, probs, debug)
    if not _common.is_traced(rows):  # eager CPU: the map is on the host anyway
        _check_map_values(row_map, rows.shape[0])
    return unpad_unpermute_reference(rows, row_map, probs)


def _unpad_unpermute_fake(rows, row_map, probs, debug=False):
    _check_args(rows, row_map, probs, debug)
    return rows.new_empty(row_map.shape[0], rows.shape[1])


_unpad_unpermute_op = _common.dispatch_triton_op(
    "moe::unpad_unpermute",
    _unpad_unpermute_body,
    schema="(Tensor rows, Tensor row_map, Tensor? probs, bool debug=False) -> Tensor",
    fake=_unpad_unpermute_fake,
)


def _unpad_unpermute_backward_body(
    grad_y: Tensor, row_map: Tensor, probs: Tensor | None, rows: Tensor | None, num_rows: int
) -> tuple[Tensor, Tensor]:
    # Returns (grad_rows [R, H], grad_probs [T, K]); grad_probs is empty unless probs and rows are given.
    if grad_y.device.type == "cuda":
        return _unpad_unpermute_backward_cuda(grad_y, row_map, probs, rows, num_rows)
    grad_rows, grad_probs = unpad_unpermute_backward_reference(grad_y, row_map, probs, rows, num_rows)
    return grad_rows, (grad_probs if grad_probs is not None else grad_y.new_empty(0))


def _unpad_unpermute_backward_fake(grad_y, row_map, probs, rows, num_rows):
    grad_rows = grad_y.new_empty(num_rows, grad_y.shape[1])
    if probs is not None and rows is not None:
        return grad_rows, probs.new_empty(probs.shape)
    return grad_rows, grad_y.new_empty(0)


_unpad_unpermute_backward_op = _common.dispatch_triton_op(
    "moe::unpad_unpermute_backward",
    _unpad_unpermute_backward_body,
    schema="(Tensor grad_y, Tensor row_map, Tensor? probs, Tensor? rows, SymInt num_rows) -> (Tensor, Tensor)",
    fake=_unpad_unpermute_backward_fake,
)


# ===== autograd =====


def _setup_context(ctx, inputs, output) -> None:
    rows, row_map, probs, debug = inputs
    ctx.num_rows = rows.shape[0]
    ctx.has_probs = probs is not None
    # rows are only needed for the prob gradient: do not keep them alive otherwise
    ctx.needs_rows = probs is not None and probs.requires_grad
    ctx.save_for_backward(row_map, probs, rows if ctx.needs_rows else None)


def _backward(ctx, grad_y, backward_op=None):
    row_map, probs, rows = ctx.saved_tensors
    grad_rows, grad_probs = (backward_op or torch.ops.moe.unpad_unpermute_backward)(
        grad_y.contiguous(), row_map, probs, rows, ctx.num_rows
    )
    return grad_rows, None, (grad_probs if ctx.needs_rows else None), None


_unpad_unpermute_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerUnpadUnpermute(torch.autograd.Function):
    """NOTE [eager fast path] (moe_compile/ops/_common.py) when a gradient is needed: the op's autograd formula around
    its CUDA kernels."""

    @staticmethod
    def forward(ctx, rows, row_map, probs, debug):
        y = _unpad_unpermute_cuda(rows, row_map, probs, debug)
        _setup_context(ctx, (rows, row_map, probs, debug), y)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        return _backward(ctx, grad_y, backward_op=_unpad_unpermute_backward_body)

_UNPAD_UNPERMUTE = torch.ops.moe.unpad_unpermute.default
# device types whose kernel was turned off with `_unpad_unpermute_op.set_kernel_enabled(...)` (torch's own set)
_CUDA_KERNEL_DISABLED = getattr(_unpad_unpermute_op, "_disabled_kernel", set())


# ===== public wrapper =====


def unpad_unpermute(
    rows_RH: Tensor, row_map: Tensor, probs_TK: Tensor | None = None, debug: bool = False
) -> Tensor:
    """Combine expert rows back into token order (``torch.ops.moe.unpad_unpermute``).

    Args:
        rows_RH: ``[R, H]`` rows in the layout produced by :func:`moe_compile.ops.permute_pad`
            (``R`` is usually its ``M``), bf16/fp16/fp32.
        row_map: int32 ``[T, 2K]`` from :func:`moe_compile.ops.permute_pad`: rows in ``[0, R)``, each token's
            slots a permutation of ``0..K-1``. A row outside ``[0, R)`` (``permute_pad``'s ``-1`` for a dropped
            expert id) or, with probs, a slot outside ``[0, K)``: CPU raises; CUDA asserts with ``debug=True``,
            else poisons the token (``y[t]`` and its gradients NaN; NOTE [poisoned tokens]).
        probs_TK: optional ``[T, K]`` float merging probs, in top-k slot order (like ``expert_idx``).
        debug: on CUDA, add device-side asserts that ``row_map`` rows are in ``[0, R)`` (and slots in
            ``[0, K)`` with probs).

    Returns:
        ``y_TH`` ``[T, H]`` in ``rows_RH.dtype``: ``y[t] = sum over t's K rows, ascending, of
        prob * row``, accumulated in fp32 and cast once.

    Raises:
        ValueError: wrong dtype/rank/shape/device (messages name the argument), or (CPU) ``row_map`` values out
            of range. TypeError: ``debug`` not a bool.
    """
    if not (isinstance(rows_RH, Tensor) and isinstance(row_map, Tensor) and type(debug) is bool):
        _check_args_detailed(rows_RH, row_map, probs_TK, debug)  # raises, naming the argument
    # the op's kernels (and its fake, when traced) validate the arguments: checked once per call
    fast = _common.eager_fast_path(rows_RH, row_map, probs_TK)
    if fast and "cuda" not in _CUDA_KERNEL_DISABLED:
        # NOTE [eager fast path] (moe_compile/ops/_common.py): same kernels, without the dispatcher's Python layers
        launch = _EagerUnpadUnpermute.apply if fast is _common.FAST_WITH_GRAD else _unpad_unpermute_cuda
        return launch(rows_RH, row_map, probs_TK, debug)
    return _UNPAD_UNPERMUTE(rows_RH, row_map, probs_TK, debug)
