"""``torch.ops.moe.permute_pad``: group token rows by expert and pad each group to a multiple of ``align``.

Shapes: ``T`` tokens, ``H`` hidden, ``E`` experts, ``K`` top-k, ``N = T*K`` routed rows,
``M = static_row_bound(N, E, align)`` rows of the padded buffer.

Contract (see ``shared/notes/dispatch-semantics.md`` section 1):

* ``rows_MH[M, H]`` (dtype of ``x``) is expert-major; inside an expert, rows are in ascending token
  order (a stable sort of the flattened ids ``t*K + k``). Expert ``e``'s segment starts at
  ``sum_{j<e} ceil(n_j/a)*a``; its ``n_e`` real rows come first, then ``ceil(n_e/a)*a - n_e`` zero pad
  rows. Empty experts get 0 rows. Rows past ``offs_E[-1]`` (the tail) are zero.
* ``probs_M[M]`` (dtype of ``probs``): the routing probs permuted alongside; 0 on pad and tail rows.
* ``offs_E`` int32: cumulative END offsets over padded counts, ready for ``torch._grouped_mm(offs=)``.
* ``row_map`` int32 ``[T, 2K]``: ``row_map[t, :K]`` are token ``t``'s destination rows in ascending
  order (= ascending expert order), ``row_map[t, K:]`` the top-k slot ``k`` each of them came from.
  Treat it as opaque: only :func:`moe_compile.ops.unpad_unpermute` and the backward ops read it.
* ``counts_E`` int32: unpadded tokens per expert (``counts_E.sum() == N``).

Everything is computed on the device with static shapes (no host sync, no unbacked symbols), so the op
is CUDA-graph safe. The data movement is exact (bitwise) and deterministic.

NOTE [zero-prob rule]: TransformerEngine's ``moe_permute_with_probs`` writes a zero row for a routed
entry whose prob is exactly ``0.0``. We do NOT adopt that rule: these ops are pure data movement, a
``0.0`` prob routes its token's row like any other prob, and padding only ever comes from explicit pad
rows. (Adopting it would make the op data dependent and change the prob gradient of genuine zeros.)

CPU (and any non-CUDA device): :func:`permute_pad_reference`, pure PyTorch, sync-free, gathers only
(NOTE [gather-only reference]), plus a host check that ``expert_idx`` is in ``[0, E)``. CUDA: two
Triton launches (``moe_compile/ops/triton/dispatch.py``: the index kernel, then the permute);
``debug=True`` adds device-side range asserts on ``expert_idx``; without it, an id outside ``[0, E)`` is dropped
and its token poisoned (NOTE [dropped entries]). The op is built like a
``torch.library.triton_op`` (NOTE [device-decomposed triton ops] (moe_compile/ops/_common.py)): under
``torch.compile`` on CUDA it dissolves into its kernel launches, which Inductor emits in its own code.
Backward: ``moe::permute_pad_backward``, a gather (``dx[t] = sum_k g[row(t,k)]`` in fp32, ascending rows;
``dprobs[t,k] = g_probs[row(t,k)]``); never a scatter-add.

NOTE [dropped entries]:
An expert id outside ``[0, E)`` (``E``, ``-1``, ``2**40``, ...) has no segment. CPU eager raises ``ValueError``
naming ``expert_idx``; a CPU graph asserts on the device; CUDA with ``debug=True`` asserts on the device. Otherwise
(CUDA by default, and :func:`permute_pad_reference` itself) the entry is *dropped*: it gets no row, is in no
count (``counts_E.sum() = N - dropped``), and its ``row_map`` row is ``-1``, listed after the token's real rows (in
slot order). The pad rows and the tail stay zero (the token programs of dropped entries zero the ``dropped``
non-real rows that the zero programs, sized for ``M - N``, do not reach). Every other output is bitwise that of the
same call without the bad entries, i.e. on ``E + 1`` experts with the bad ids set to ``E``, up to the extra
expert's rows (which follow ``offs_E[-1]``). The ``-1`` is the poison: every consumer of the map reads it as NaN
(NOTE [poisoned tokens] (moe_compile/ops/unpad_unpermute.py)), so ``unpad_unpermute`` gives the token a NaN output
whatever the probs (combined there, applied to the rows through ``probs_M``, or none), and the backward gives it NaN
gradients (``grad_x[t]``, ``grad_probs[t, :]``); ``expert_gemm``'s gather through the map skips the ``-1``. Nothing
is read on the host: ``PermutePadOut.invalid_ids()`` counts the dropped entries on the device, and the router metrics
count them per layer (``moe/invalid_ids``, :mod:`moe_compile.metrics`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import Tensor

from moe_compile.ops import _common, _eager_launch
from moe_compile.ops._common import SUPPORTED_ALIGNMENTS, static_row_bound
from moe_compile.ops.unpad_unpermute import (
    _poison_tokens,
    _rows_in_range,
    _slots_in_range,
    launch_gather_sum_triton,
    place_of_slot,
    rows_by_slot,
    unpad_unpermute_reference,
)

__all__ = ["PermutePadOut", "permute_pad", "permute_pad_backward_reference", "permute_pad_reference"]


class PermutePadOut(NamedTuple):
    """Result of :func:`permute_pad`. The field order is fixed."""

    rows_MH: Tensor  # [M, H] x.dtype, expert-major, pad rows and tail zero
    probs_M: Tensor | None  # [M] probs.dtype (pad rows 0), or None when no probs were given
    offs_E: Tensor  # int32 [E] cumulative end offsets over padded counts
    row_map: Tensor  # int32 [T, 2K], opaque; input of unpad_unpermute
    counts_E: Tensor  # int32 [E] unpadded tokens per expert

    def invalid_ids(self) -> Tensor:
        """int64 0-dim tensor on the device: the routed entries whose expert id was outside ``[0, E)`` (dropped,
        NOTE [dropped entries]), ``T*K - counts_E.sum()``; no host sync (one reduction over ``E``)."""
        T, K = self.row_map.shape[0], self.row_map.shape[1] // 2
        return T * K - self.counts_E.sum(dtype=torch.int64)


# ===== reference =====


def permute_pad_reference(
    x_TH: Tensor, expert_idx_TK: Tensor, probs_TK: Tensor | None, num_experts: int, align: int
) -> PermutePadOut:
    """Pure-PyTorch, sync-free permute + pad (the CPU kernel and the test oracle).

    Args:
        x_TH: ``[T, H]`` token rows.
        expert_idx_TK: ``[T, K]`` integer expert ids; an id outside ``[0, num_experts)`` is dropped
            (NOTE [dropped entries]; not checked here).
        probs_TK: optional ``[T, K]`` routing probs, permuted alongside the rows.
        num_experts: ``E``.
        align: rows per expert segment are rounded up to a multiple of ``align``.

    Returns:
        :class:`PermutePadOut` with the same static shapes as the op.
    """
    T, H = x_TH.shape
    K = expert_idx_TK.shape[1]
    N = T * K
    M = static_row_bound(N, num_experts, align)
    device = x_TH.device
    i64 = torch.int64
    ids_N = expert_idx_TK.reshape(N).to(i64)
    # an id outside [0, E) sorts after every expert (key E) and is counted by none: NOTE [dropped entries]
    valid_N = (ids_N >= 0) & (ids_N < num_experts)
    ids_N = torch.where(valid_N, ids_N, num_experts)
    experts_E = torch.arange(num_experts, device=device, dtype=i64)
    inverse_N = None  # inverse_N[i]: the sorted position of flat entry i
    if 0 < N * N <= _common.SMALL_COMPARES:
        # NOTE [few library calls] (moe_compile/ops/_common.py): a stable sort by compares
        j_N = torch.arange(N, device=device)
        same_NN = ids_N[None, :] == ids_N[:, None]
        inverse_N = ((ids_N[None, :] < ids_N[:, None]) | (same_NN & (j_N[None, :] < j_N[:, None]))).sum(1)
        order_N = (inverse_N[None, :] == j_N[:, None]).to(torch.int32).argmax(1)
    else:
        _, order_N = torch.sort(ids_N, stable=True)  # order_N[p] = flat index t*K + k
    # one past each expert's last sorted position
    ends_E = _common.count_at_most(ids_N.index_select(0, order_N), experts_E)
    starts_E = torch.cat([ends_E.new_zeros(1), ends_E[:-1]])  # (ids in [0, E): expert e starts where e-1 ends)
    counts_E = ends_E - starts_E
    padded_E = (counts_E + (align - 1)) // align * align
    # NOTE [few library calls] (moe_compile/ops/_common.py): the cumsum over E by compares at small sizes
    small = num_experts * num_experts <= _common.SMALL_COMPARES
    offs_E = (
        (padded_E[None, :] * (experts_E[None, :] <= experts_E[:, None])).sum(1) if small else torch.cumsum(padded_E, 0)
    )
    seg_start_E = offs_E - padded_E

    # NOTE [gather-only reference]: every output element is read from its source (no scatter, no
    # index_put), so a traced reference compiles without atomics. Row m belongs to the expert whose
    # segment holds it; it is real when it lies among the expert's first counts[e] rows.
    rows_M = torch.arange(M, device=device, dtype=i64)
    owner_M = _common.count_at_most(offs_E, rows_M).clamp_max(num_experts - 1)
    within_M = rows_M - seg_start_E.index_select(0, owner_M)
    is_real_M = within_M < counts_E.index_select(0, owner_M)  # (tail rows: within >= padded)
    sorted_pos_M = (starts_E.index_select(0, owner_M) + within_M).clamp(0, max(N - 1, 0))
    src_M = order_N.index_select(0, sorted_pos_M) if N > 0 else rows_M.new_zeros(M)  # flat index t*K + k
    zero = x_TH.new_zeros(())
    rows_MH = torch.where(is_real_M[:, None], x_TH.index_select(0, src_M // K), zero) if T > 0 else x_TH.new_zeros(M, H)
    probs_M = None
    if probs_TK is not None:
        probs_M = (
            torch.where(is_real_M, probs_TK.reshape(N).index_select(0, src_M), probs_TK.new_zeros(()))
            if N > 0 else probs_TK.new_zeros(M)
        )
    # destination of flat entry i: its sorted position (the inverse permutation of order_N: from the compares
    # above, or another sort) shifted to its expert's segment
    if inverse_N is None:
        inverse_N = torch.argsort(order_N)
    dest_N = inverse_N + (seg_start_E - starts_E).index_select(0, ids_N.clamp_max(num_experts - 1))
    # a dropped entry's row is -1, and it sorts after the token's real rows (in slot order): key M + k
    slot_N = torch.arange(N, device=device, dtype=i64) % K
    key_TK = torch.where(valid_N, dest_N, M + slot_N).reshape(T, K)
    if T * K * K <= _common.SMALL_COMPARES:
        # NOTE [few library calls] (moe_compile/ops/_common.py): a token's keys are distinct, rank them
        rank_TK = (key_TK[:, None, :] < key_TK[:, :, None]).sum(2)  # rank_TK[t, k]: k's place in t's order
        slots_TK = place_of_slot(rank_TK)  # the slot at each place: the inverse permutation
        sorted_keys_TK = key_TK.gather(1, slots_TK)
    else:
        sorted_keys_TK, slots_TK = key_TK.sort(dim=1)
    sorted_rows_TK = torch.where(sorted_keys_TK < M, sorted_keys_TK, -1)
    row_map = torch.cat([sorted_rows_TK, slots_TK], dim=1).to(torch.int32)
    return PermutePadOut(rows_MH, probs_M, offs_E.to(torch.int32), row_map, counts_E.to(torch.int32))


def permute_pad_backward_reference(
    grad_rows_MH: Tensor, grad_probs_M: Tensor | None, row_map: Tensor
) -> tuple[Tensor, Tensor | None]:
    """Gradients of :func:`permute_pad_reference` w.r.t. ``x`` and ``probs`` (gathers only).

    Returns ``(grad_x_TH, grad_probs_TK)``: ``grad_x[t] = sum over t's rows r (ascending) of
    grad_rows[r]`` accumulated in fp32; ``grad_probs[t, k] = grad_probs_M[row(t, k)]`` (None if
    ``grad_probs_M`` is None). A token with a dropped entry (row ``-1``) gets NaN gradients
    (NOTE [poisoned tokens] (moe_compile/ops/unpad_unpermute.py)).
    """
    grad_x_TH = unpad_unpermute_reference(grad_rows_MH, row_map, None)
    if grad_probs_M is None:
        return grad_x_TH, None
    M = grad_probs_M.shape[0]
    _, rows_ok_TK = _rows_in_range(row_map, M)
    _, slots_ok_TK = _slots_in_range(row_map)
    row_of_slot_TK = rows_by_slot(row_map).clamp(0, max(M - 1, 0))
    grad_probs_TK = (
        grad_probs_M.index_select(0, row_of_slot_TK.reshape(-1)).reshape(row_of_slot_TK.shape)
        if M > 0 else grad_probs_M.new_zeros(row_of_slot_TK.shape)
    )
    return grad_x_TH, _poison_tokens(grad_probs_TK, rows_ok_TK & slots_ok_TK)


# ===== validation =====


def _check_args(
    x: Tensor, expert_idx: Tensor, probs: Tensor | None, num_experts: int, align: int, debug: bool = False
) -> None:
    # Fast path: one expression over the common case; anything off goes to the detailed checks below,
    # which raise with the message for the first failing argument.
    if (
        type(debug) is bool
        and isinstance(x, Tensor)
        and isinstance(expert_idx, Tensor)
        and x.dtype in _common.FLOAT_DTYPE_SET
        and expert_idx.dtype in _common.INT_DTYPES
        and x.dim() == 2
        and expert_idx.dim() == 2
        and type(num_experts) is int
        and type(align) is int
        and align in SUPPORTED_ALIGNMENTS
        and 1 <= expert_idx.shape[1] <= num_experts
        and expert_idx.shape[0] == x.shape[0]
        and expert_idx.device == x.device
        and (
            probs is None
            or (
                isinstance(probs, Tensor)
                and probs.dtype in _common.FLOAT_DTYPE_SET
                and probs.shape == expert_idx.shape
                and probs.device == x.device
            )
        )
    ):
        return
    _check_args_detailed(x, expert_idx, probs, num_experts, align, debug)


def _check_args_detailed(
    x: Tensor, expert_idx: Tensor, probs: Tensor | None, num_experts: int, align: int, debug: bool = False
) -> None:
    _common.check_float_tensor(x, "x", 2)
    _common.check_int_tensor(expert_idx, "expert_idx", 2)
    if expert_idx.shape[0] != x.shape[0]:
        raise ValueError(
            f"expert_idx must have one row per token of x: expert_idx.shape={tuple(expert_idx.shape)}, "
            f"x.shape={tuple(x.shape)}"
        )
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")
    K = expert_idx.shape[1]
    if K < 1:
        raise ValueError(f"expert_idx must have at least one column (top-k >= 1), got shape {tuple(expert_idx.shape)}")
    if K > num_experts:
        raise ValueError(f"top-k K={K} (expert_idx.shape[1]) must be <= num_experts={num_experts}")
    _common.check_alignment(align)
    if probs is not None:
        _common.check_float_tensor(probs, "probs", 2)
        if probs.shape != expert_idx.shape:
            raise ValueError(
                f"probs must have the shape of expert_idx: probs.shape={tuple(probs.shape)}, "
                f"expert_idx.shape={tuple(expert_idx.shape)}"
            )
    _common.check_same_device(x=x, expert_idx=expert_idx, probs=probs)
    _common.check_bool(debug, "debug")


# ===== Triton launchers (CUDA; also run on CPU tensors under TRITON_INTERPRET=1 in the tests) =====

# Largest E handled by the Triton index kernels (the scan holds an [E_PAD] vector, the zero programs
# an [ZERO_ROWS, E_PAD] tile); beyond it the CUDA kernel falls back to the (sync-free, slower) reference.
MAX_TRITON_EXPERTS = 8192
# The index kernel is one program, so its time is serial: it histograms BLOCK_N ids per iteration
# (``tl.histogram`` over E_PAD bins, each lane of a warp visiting bins / 32 of them per id) and scans.
# One block per iteration (SUB 1) of 1024 ids is the fastest at every size tried: more bins per iteration cost
# more than the trips they save (benchmarks/results/dispatch.json).
INDEX_BLOCK_N = 1024
# Entries of the [NB, E_PAD] block table (8K int32 = 32 KiB): past it BLOCK_N grows, up to MAX_BLOCK_N
# (then the table grows instead).
TABLE_ENTRIES = 8192
MIN_BLOCK_N = 16
MAX_BLOCK_N = 2048  # each token program compares its ids with up to BLOCK_N + K - 1 earlier ids
INDEX_NUM_WARPS = 16
# From this many blocks on, the histograms are computed by one program per block (a third launch) and the
# index kernel scans them (NOTE [destination rows in two launches] (moe_compile/ops/triton/dispatch.py)): the serial
# index kernel is slower from 16 blocks on, and below it the extra launch's host time matters more
# (benchmarks/results/dispatch.json).
PARALLEL_HISTOGRAM_BLOCKS = 8
# Table entries the scan reads per trip when the histograms are in the table, and its warps: 4 warps scan faster than
# 16, tiles of 8192 entries gain nothing over 4096 (benchmarks/results/dispatch.json).
SCAN_TILE_ENTRIES = 4096
SCAN_NUM_WARPS = 4
# With the histograms in parallel and few experts (E_PAD <= 32), blocks of 256 ids: each token program then
# compares its ids with at most 255 earlier ones. Smaller blocks help with few experts; with many experts the
# longer table costs the scan more than it saves; in CUDA graphs, with the overlapped launches, 512 / 256 / 128
# are within noise of each other (benchmarks/results/dispatch.json, benchmarks/results/host_cost.json).
FEW_EXPERTS_PAD = 32
FEW_EXPERTS_BLOCK_N = 256


class _PermutePlan(NamedTuple):
    """Launch parameters of :func:`_launch_triton`, a function of the shapes only (cached)."""

    N: int
    M: int
    e_pad: int
    k_pad: int
    block_n: int
    num_blocks: int
    sub: int
    chunk: int
    drop_e_chunk: int
    block_h: int
    num_warps: int
    zero_rows: int
    rows_grid: tuple[int, int]
    parallel_histogram: bool


@functools.lru_cache(maxsize=512)
def _permute_plan(
    T: int, H: int, K: int, num_experts: int, align: int, elem_size: int,
    block_n: int | None = None, block_h: int | None = None, num_warps: int | None = None, sub: int | None = None,
    parallel_histogram: bool | None = None,
) -> _PermutePlan:  # fmt: skip
    N = T * K
    M = static_row_bound(N, num_experts, align)
    e_pad = max(16, _common.next_power_of_2(num_experts))
    k_pad = max(2, _common.next_power_of_2(K))
    fixed_block_n = block_n is not None
    if block_n is None:
        block_n = min(INDEX_BLOCK_N, max(MIN_BLOCK_N, _common.next_power_of_2(N)))
        while block_n < MAX_BLOCK_N and _common.cdiv(N, block_n) * e_pad > TABLE_ENTRIES:
            block_n *= 2
    num_blocks = _common.cdiv(N, block_n)
    if parallel_histogram is None:
        parallel_histogram = num_blocks >= PARALLEL_HISTOGRAM_BLOCKS
    if parallel_histogram and not fixed_block_n and e_pad <= FEW_EXPERTS_PAD and block_n > FEW_EXPERTS_BLOCK_N:
        block_n = FEW_EXPERTS_BLOCK_N  # less rank work per token; the parallel scan of a longer table is cheap
        num_blocks = _common.cdiv(N, block_n)
    # table blocks per index-kernel iteration (tests set more, to cover the loop); a scan of histograms
    # already in the table reads a whole tile per trip
    if sub is None:
        sub = min(_common.next_power_of_2(num_blocks), max(1, SCAN_TILE_ENTRIES // e_pad)) if parallel_histogram else 1
    # the rank loop's [K_PAD, CHUNK] compare tile: <= 4K entries, at most the span it has to cover
    chunk = max(16, min(_common.next_power_of_2(block_n + K), 4096 // k_pad))
    # the dropped entries' branch (bad input only) reads the table in [K_PAD, drop_e_chunk] tiles: <= 4K entries
    drop_e_chunk = min(e_pad, max(16, 4096 // k_pad))
    bh, warps = _common.row_block(H, elem_size, max_bytes=16384)
    bh = block_h or bh
    warps = num_warps or warps
    zero_rows = max(2, min(16, 4096 // bh, 16384 // e_pad))
    rows_grid = (T + _common.cdiv(M - N, zero_rows), _common.cdiv(H, bh))
    return _PermutePlan(
        N, M, e_pad, k_pad, block_n, num_blocks, sub, chunk, drop_e_chunk, bh, warps, zero_rows, rows_grid,
        parallel_histogram,
    )


_REPLAYS = _eager_launch.Replays()


def _launch_triton(
    x: Tensor,
    expert_idx: Tensor,
    probs: Tensor | None,
    num_experts: int,
    align: int,
    debug: bool = False,
    *,
    block_n: int | None = None,
    block_h: int | None = None,
    num_warps: int | None = None,
    sub: int | None = None,
    parallel_histogram: bool | None = None,
    use_pdl: bool | None = None,
    copy_ids: bool | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Two launches, no host sync: the index kernel (histogram + scan), then the permute (+ zero rows); at large
    ``N`` three (``parallel_histogram``: the histograms first, one program per block).

    See NOTE [destination rows in two launches] (moe_compile/ops/triton/dispatch.py) and
    NOTE [overlapping the launches] (moe_compile/ops/triton/dispatch.py) (``use_pdl``: default on for eager CUDA
    launches where supported). Under a trace (fake/functional tensors) the kernels go through ``wrap_triton``, so
    Inductor launches them from its generated code. ``block_n`` / ``block_h`` / ``num_warps`` / ``sub`` (table blocks
    per index-kernel iteration, a power of two) and ``parallel_histogram`` override the plan (tests use small blocks
    to cover several); ``copy_ids`` overrides whether the permute kernel reads the int32 copy of the ids (default:
    on the traced path where Inductor needs it, see
    NOTE [no load-derived store addresses on graph inputs] (moe_compile/ops/triton/dispatch.py); tests set it to run
    that path under the interpreter).
    """
    from moe_compile.ops.triton import dispatch as kernels

    T, H, K = _common.static_ints(x.shape[0], x.shape[1], expert_idx.shape[1])
    plan_args = (T, H, K, num_experts, align, x.element_size(), block_n, block_h, num_warps, sub, parallel_histogram)
    plan = _permute_plan(*plan_args)
    traced = x.is_cuda and _common.is_traced(x)
    if use_pdl is None:
        use_pdl = not traced and _common.pdl_supported(x.device)
    use_pdl = use_pdl and not traced
    if copy_ids is None:
        copy_ids = traced and _common.ttir_writes_follow_loads()
    if x.stride(1) != 1:
        x = x.contiguous()
    if not expert_idx.is_contiguous():
        expert_idx = expert_idx.contiguous()
    if probs is not None and not probs.is_contiguous():
        probs = probs.contiguous()
    replay_key = replayed = None
    if not traced:  # NOTE [replayed eager launches] (moe_compile/ops/_eager_launch.py)
        replay_key = _eager_launch.replay_key((plan_args, debug, use_pdl, copy_ids, x.stride(0)), x, expert_idx, probs)
        replayed = _REPLAYS.get(replay_key, x.get_device())
    empty = _common.eager_cuda_allocator(x, traced)
    i32 = torch.int32
    e_pad = plan.e_pad

    # NOTE [one table] (moe_compile/ops/triton/dispatch.py): counts, before_blocks, seg_start, then the ids copy if
    # traced
    # NOTE [no load-derived store addresses on graph inputs] (moe_compile/ops/triton/dispatch.py)
    ids_offset = (plan.num_blocks + 2) * e_pad
    table = empty((ids_offset + (plan.N if copy_ids else 0),), i32)
    offs = empty((num_experts,), i32)
    rows = empty((plan.M, H), x.dtype)
    # without probs, probs_M is the empty placeholder output: it doubles as the unused pointer
    probs_M = empty((plan.M,), probs.dtype) if probs is not None else x.new_empty(0)
    row_map = empty((T, 2 * K), i32)
    index_args = (expert_idx, table, offs, plan.N, num_experts, plan.num_blocks, ids_offset)
    rows_args = (
        x, expert_idx, table, x if probs is None else probs, rows, probs_M, row_map,
        T, H, _common.static_ints(x.stride(0))[0], num_experts, plan.num_blocks, plan.M, plan.M - plan.N, ids_offset,
    )  # fmt: skip
    histogram_args = (expert_idx, table, plan.N, num_experts, ids_offset)
    if replayed is not None:
        _eager_launch.replay(*replayed, *((histogram_args,) if plan.parallel_histogram else ()), index_args, rows_args)
        return rows, probs_M, offs, row_map, table.narrow(0, 0, num_experts)
    record = [] if replay_key is not None else None
    if plan.parallel_histogram:
        _common.launch_kernel(
            kernels._block_histogram_kernel, (plan.num_blocks,), *histogram_args,
            E_PAD=e_pad, BLOCK_N=plan.block_n, COPY_IDS=copy_ids, DEBUG=debug, USE_PDL=use_pdl,
            traced=traced, record=record, options=dict(num_warps=4, debug=debug),
        )  # fmt: skip
    pdl = {"launch_pdl": True} if use_pdl else {}
    _common.launch_kernel(
        kernels._expert_offsets_kernel, (1,), *index_args,
        ALIGN=align, E_PAD=e_pad, BLOCK_N=plan.block_n, SUB=plan.sub, FROM_TABLE=plan.parallel_histogram,
        COPY_IDS=copy_ids and not plan.parallel_histogram, DEBUG=debug and not plan.parallel_histogram,
        USE_PDL=use_pdl, traced=traced, record=record,
        options=dict(num_warps=SCAN_NUM_WARPS if plan.parallel_histogram else INDEX_NUM_WARPS, debug=debug,
                     # NOTE [overlapping the launches] (moe_compile/ops/triton/dispatch.py)
                     **(pdl if plan.parallel_histogram else {})),
    )  # fmt: skip
    _common.launch_kernel(
        kernels._permute_rows_kernel, plan.rows_grid, *rows_args,
        K=K, K_PAD=plan.k_pad, ALIGN=align, E_PAD=e_pad, BLOCK_N=plan.block_n, CHUNK=plan.chunk,
        DROP_E_CHUNK=plan.drop_e_chunk,
        HAS_PROBS=probs is not None, BLOCK_H=plan.block_h, ZERO_ROWS=plan.zero_rows, IDS_IN_TABLE=copy_ids,
        USE_PDL=use_pdl, traced=traced, record=record, options=dict(num_warps=plan.num_warps, **pdl),
    )  # fmt: skip
    if record is not None:
        _REPLAYS.keep(replay_key, record, 3 if plan.parallel_histogram else 2)
    # counts: a view of the table (NOTE [one table] (moe_compile/ops/triton/dispatch.py)), taken after the launches
    # (traced, a view taken before a kernel writes its base would make functionalization copy the table)
    return rows, probs_M, offs, row_map, table.narrow(0, 0, num_experts)


def _use_triton(x: Tensor, expert_idx: Tensor, num_experts: int) -> bool:
    return x.numel() > 0 and expert_idx.numel() > 0 and num_experts <= MAX_TRITON_EXPERTS


def _reference_tuple(x, expert_idx, probs, num_experts, align):
    out = permute_pad_reference(x, expert_idx, probs, num_experts, align)
    probs_M = out.probs_M if out.probs_M is not None else x.new_empty(0)
    return out.rows_MH, probs_M, out.offs_E, out.row_map, out.counts_E


def _permute_pad_cuda(x, expert_idx, probs, num_experts, align, debug=False):
    """The CUDA path: the Triton kernels, or the reference where they do not apply (empty inputs, huge E).
    Runs on CPU tensors too under ``TRITON_INTERPRET=1`` (the kernel tests)."""
    _check_args(x, expert_idx, probs, num_experts, align, debug)
    if not _use_triton(x, expert_idx, num_experts):
        return _reference_tuple(x, expert_idx, probs, num_experts, align)
    return _launch_triton(x, expert_idx, probs, num_experts, align, debug)


def _permute_pad_backward_cuda(grad_rows, grad_probs, row_map):
    if grad_rows.shape[1] == 0 or row_map.shape[0] == 0:
        return _permute_pad_backward_default(grad_rows, grad_probs, row_map)
    grad_x, grad_probs_TK = launch_gather_sum_triton(grad_rows, row_map, None, grad_probs_M=grad_probs)
    return grad_x, (grad_probs_TK if grad_probs_TK is not None else grad_rows.new_empty(0))


def _permute_pad_backward_default(grad_rows, grad_probs, row_map):
    grad_x, grad_probs_TK = permute_pad_backward_reference(grad_rows, grad_probs, row_map)
    return grad_x, (grad_probs_TK if grad_probs_TK is not None else grad_rows.new_empty(0))


# ===== ops (NOTE [device-decomposed triton ops] (moe_compile/ops/_common.py)) =====


def _permute_pad_body(
    x: Tensor, expert_idx: Tensor, probs: Tensor | None, num_experts: int, align: int, debug: bool = False
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    # `probs_M` is an empty tensor when no probs are given (ops cannot return None)
    if x.device.type == "cuda":
        return _permute_pad_cuda(x, expert_idx, probs, num_experts, align, debug)
    _check_args(x, expert_idx, probs, num_experts, align, debug)
    if not _common.is_traced(x):  # eager CPU: the ids are on the host anyway
        _common.check_ids_in_range(expert_idx, 0, num_experts, "expert_idx")
    else:
        # traced into a CPU graph (NOTE [device-decomposed triton ops] (moe_compile/ops/_common.py)): checked there, on
        # every call
        torch._assert_async(((expert_idx >= 0) & (expert_idx < num_experts)).all(),
                            "expert_idx values must be in [0, num_experts)")
    return _reference_tuple(x, expert_idx, probs, num_experts, align)


def _permute_pad_fake(x, expert_idx, probs, num_experts, align, debug=False):
    _check_args(x, expert_idx, probs, num_experts, align, debug)
    T, H = x.shape
    K = expert_idx.shape[1]
    M = static_row_bound(T * K, num_experts, align)
    probs_M = probs.new_empty(M) if probs is not None else x.new_empty(0)
    return (
        x.new_empty(M, H),
        probs_M,
        x.new_empty(num_experts, dtype=torch.int32),
        x.new_empty(T, 2 * K, dtype=torch.int32),
        x.new_empty(num_experts, dtype=torch.int32),
    )


_permute_pad_op = _common.dispatch_triton_op(
    "moe::permute_pad",
    _permute_pad_body,
    # plain `int`s (not SymInt): E and align are static, they size the output and pick kernels
    schema="(Tensor x, Tensor expert_idx, Tensor? probs, int num_experts, int align, bool debug=False) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    fake=_permute_pad_fake,
)


def _permute_pad_backward_body(
    grad_rows: Tensor, grad_probs: Tensor | None, row_map: Tensor
) -> tuple[Tensor, Tensor]:
    # Returns (grad_x [T, H], grad_probs [T, K]); grad_probs is empty when `grad_probs` is None.
    if grad_rows.device.type == "cuda":
        return _permute_pad_backward_cuda(grad_rows, grad_probs, row_map)
    return _permute_pad_backward_default(grad_rows, grad_probs, row_map)


def _permute_pad_backward_fake(grad_rows, grad_probs, row_map):
    T, K = row_map.shape[0], row_map.shape[1] // 2
    grad_x = grad_rows.new_empty(T, grad_rows.shape[1])
    grad_probs_TK = grad_probs.new_empty(T, K) if grad_probs is not None else grad_rows.new_empty(0)
    return grad_x, grad_probs_TK


_permute_pad_backward_op = _common.dispatch_triton_op(
    "moe::permute_pad_backward",
    _permute_pad_backward_body,
    schema="(Tensor grad_rows, Tensor? grad_probs, Tensor row_map) -> (Tensor, Tensor)",
    fake=_permute_pad_backward_fake,
)


# ===== autograd =====


def _setup_context(ctx, inputs, output) -> None:
    x, expert_idx, probs, num_experts, align, debug = inputs
    ctx.has_probs = probs is not None
    ctx.save_for_backward(output[3])


def _backward(ctx, grad_rows, grad_probs_M, grad_offs, grad_row_map, grad_counts, backward_op=None):
    (row_map,) = ctx.saved_tensors
    grad_x, grad_probs_TK = (backward_op or torch.ops.moe.permute_pad_backward)(
        grad_rows.contiguous(), grad_probs_M.contiguous() if ctx.has_probs else None, row_map
    )
    return grad_x, None, (grad_probs_TK if ctx.has_probs else None), None, None, None


_permute_pad_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerPermutePad(torch.autograd.Function):
    """NOTE [eager fast path] (moe_compile/ops/_common.py) when a gradient is needed: the op's autograd formula around
    its CUDA kernels."""

    @staticmethod
    def forward(ctx, x, expert_idx, probs, num_experts, align, debug):
        output = _permute_pad_cuda(x, expert_idx, probs, num_experts, align, debug)
        _setup_context(ctx, (x, expert_idx, probs, num_experts, align, debug), output)
        ctx.mark_non_differentiable(*output[2:])
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        return _backward(ctx, *grads, backward_op=_permute_pad_backward_body)

_PERMUTE_PAD = torch.ops.moe.permute_pad.default
# device types whose kernel was turned off with `_permute_pad_op.set_kernel_enabled(...)` (torch's own set)
_CUDA_KERNEL_DISABLED = getattr(_permute_pad_op, "_disabled_kernel", set())


# ===== public wrapper =====


def permute_pad(
    x_TH: Tensor,
    expert_idx_TK: Tensor,
    probs_TK: Tensor | None = None,
    num_experts: int | None = None,
    align: int = 1,
    debug: bool = False,
) -> PermutePadOut:
    """Permute token rows into expert-major order and pad each expert's segment (``torch.ops.moe.permute_pad``).

    Args:
        x_TH: ``[T, H]`` activations, bf16/fp16/fp32.
        expert_idx_TK: ``[T, K]`` integer expert ids in ``[0, num_experts)``. Outside it: CPU raises; CUDA
            asserts with ``debug=True``, else drops the entry and poisons its token: its combine in
            :func:`moe_compile.ops.unpad_unpermute` and its gradients are NaN, other tokens are unchanged
            (NOTE [dropped entries]; count them with ``.invalid_ids()``).
        probs_TK: optional ``[T, K]`` float routing probs, permuted alongside the rows.
        num_experts: ``E`` (required), ``>= K``.
        align: segment alignment, one of ``SUPPORTED_ALIGNMENTS``.
        debug: on CUDA, add device-side asserts that ``expert_idx`` is in range (no host sync).
            On CPU the range is always checked.

    Returns:
        :class:`PermutePadOut` ``(rows_MH, probs_M, offs_E, row_map, counts_E)``, with
        ``M = static_row_bound(T*K, E, align)``; see the module docstring for the layout.

    Raises:
        ValueError: wrong dtype/rank/shape/device, ``K > E``, unsupported ``align``, ``num_experts < 1``,
            or (CPU) expert ids out of range. Messages name the argument.
    """
    if num_experts is None:
        raise ValueError("num_experts is required")
    if not (
        isinstance(x_TH, Tensor) and isinstance(expert_idx_TK, Tensor) and type(num_experts) is int
        and type(align) is int and type(debug) is bool
    ):  # (the dispatcher would turn a bool into an int)
        _check_args_detailed(x_TH, expert_idx_TK, probs_TK, num_experts, align, debug)  # raises, naming the argument
    # the op's kernels (and its fake, when traced) validate the arguments: checked once per call
    fast = _common.eager_fast_path(x_TH, expert_idx_TK, probs_TK)
    if fast and "cuda" not in _CUDA_KERNEL_DISABLED:
        # NOTE [eager fast path] (moe_compile/ops/_common.py): same kernels, without the dispatcher's Python layers
        launch = _EagerPermutePad.apply if fast is _common.FAST_WITH_GRAD else _permute_pad_cuda
        rows_MH, probs_M, offs_E, row_map, counts_E = launch(x_TH, expert_idx_TK, probs_TK, num_experts, align, debug)
    else:
        rows_MH, probs_M, offs_E, row_map, counts_E = _PERMUTE_PAD(
            x_TH, expert_idx_TK, probs_TK, num_experts, align, debug
        )
    return PermutePadOut(rows_MH, probs_M if probs_TK is not None else None, offs_E, row_map, counts_E)
