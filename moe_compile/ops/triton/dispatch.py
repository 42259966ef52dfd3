"""Triton kernels for ``moe::permute_pad`` / ``moe::unpad_unpermute`` and their backward ops.

Kernels only: the launchers (allocation, grids, block sizes) live in ``moe_compile/ops/permute_pad.py``
and ``moe_compile/ops/unpad_unpermute.py``. Shape suffixes as there: ``T`` tokens, ``H`` hidden, ``E``
experts, ``K`` top-k, ``N = T*K`` routed entries (flat index ``i = t*K + k``), ``M`` padded rows,
``NB`` blocks of ``BLOCK_N`` flat entries. No atomics anywhere: every output element has one writer,
so results are bitwise reproducible, and nothing is read back on the host (CUDA-graph safe).

NOTE [destination rows in two launches]
The padded destination row of entry ``i`` (expert ``e``) is
``seg_start[e] + #{j < i : ids[j] == e}`` (stable: ascending token, then slot). With blocks of
``BLOCK_N`` flat entries it splits into ``seg_start[e] + before_blocks[b, e] + #{j in block b, j < i :
ids[j] == e}``. Launch 1 (one program) streams the ids ``SUB`` blocks at a time, histograms them
(one ``tl.histogram`` over ``SUB * E_PAD`` bins keyed ``block * E_PAD + e``) and scans the histograms
as it goes, writing the ``[NB, E]`` table of ``before_blocks``, then ``counts``, ``offs`` and
``seg_start`` (NOTE [one table]). The permute kernel counts the last term itself: each token program
compares its ``K`` ids with the entries of its block that precede them (at most ``BLOCK_N + K - 1`` ids, read from L2),
so no sort and no ``dest`` buffer. One program for the index work saves a launch (and its latency),
and decode steps are launch bound (their host time is mostly launches); but its trips are serial, so at
large ``N`` (many blocks) it costs tens of microseconds (benchmarks/results/dispatch.json). There the
histograms come first from ``_block_histogram_kernel`` (one program per block, in parallel) and the
index kernel only scans them (``FROM_TABLE``): three launches. Worked example, ``E = 3``, ``a = 4``, ``BLOCK_N = 4``,
``SUB = 2``, ids ``[[2, 0], [1, 2], [0, 2], [2, 1]]`` (flat ``[2, 0, 1, 2 | 0, 2, 2, 1]``):

    launch 1 (_expert_offsets_kernel)  iteration 0 covers blocks 0 and 1: keys = ids + 4 * block,
                                       hist = [[1, 1, 2], [1, 1, 2]]
                                       table[1 + b] = before_blocks = [[0, 0, 0], [1, 1, 2]]
                                       table[0] = counts = [2, 2, 4], padded = [4, 4, 4], offs = [4, 8, 12]
                                       table[1 + NB] = seg_start = [0, 4, 8]
    launch 2 (_permute_rows_kernel)    token 3 (flat 6, 7; block 1): ids 2 and 1; earlier entries of
                                       block 1 with the same id: 1 (flat 5) and 0, so
                                       dest = seg_start + before_blocks + rank = [8+2+1, 4+1+0] = [11, 5];
                                       row_map[3] = [5, 11 | 1, 0]. All dests: [8, 0, 4, 9 | 1, 10, 11, 5].
                                       Zero programs fill the M - N = 8 non-real rows 2, 3, 6, 7, 12..15

NOTE [overlapping the launches]:
With ``USE_PDL`` (Hopper and newer, eager launches with ``launch_pdl=True``), the permute kernel is
started before the index kernel has finished (programmatic dependent launch): the index kernel
signals ``gdc_launch_dependents`` at once, and the permute kernel does the work that needs only the
op's inputs (its row of ``x`` and the rank of its entries) before ``gdc_wait``, which returns once the
index grid has completed and its writes are visible. Only ``table`` (written by the index kernel) is read
after the wait. The op's first kernel is launched normally, so everything
before the op has completed when any of its kernels runs. With parallel histograms the chain is one
longer: the histogram kernel signals at once too, and the index kernel, launched with PDL, waits before
it reads the table, as the earlier three-launch version did (without that overlap this version was
slower in CUDA graphs; benchmarks/results/host_cost.json). Launches from Inductor's generated code (the traced
path) do not use PDL.

NOTE [one table]:
The index kernels write one int32 buffer, rows of ``E_PAD``: row 0 ``counts``, rows ``1 .. NB``
``before_blocks``, row ``NB + 1`` ``seg_start``, then (traced launches) the int32 copy of the ids
(NOTE [no load-derived store addresses on graph inputs]). The op's ``counts`` output is ``table[:E]``, a view at storage
offset 0 (the fake's layout), so a decode step allocates one buffer where it allocated three (each allocation in
Inductor's generated code costs host time, which decode steps are bound by).

NOTE [no load-derived store addresses on graph inputs]:
When Inductor traces a ``wrap_triton`` launch it finds the written tensors by walking back from each
store's address; torch 2.11 walks through loads too, so a tensor whose *values* feed a store address
counts as written. A graph input counted as written is an input mutation (a copy back into it, and
CUDA-graph trees skip the graph); an op output counted as written is cloned first. So on the traced
path: the permute kernel reads the ids from an int32 copy that the index kernel writes (``COPY_IDS``)
into the table (an intermediate; ``counts`` is a view of it taken after the last launch), never from
``expert_idx``; the
prob gradients are stored at ``t*K + k`` after an in-register reorder (``_to_slot_order``); only the
unpad backward's row scatter reads addresses from ``row_map``, and its launcher passes a copy there.

NOTE [zero rows without a memset]:
The rows that hold no token are exactly ``M - N`` (a static count): pad rows, expert by expert, then
the tail. The ``j``-th of them is row ``j + sum(counts[e] for e with pad_before[e] <= j)`` where
``pad_before`` is the exclusive prefix sum of per-expert pad lengths; so the zero programs find their
rows with one vector compare against ``counts``, and only those rows are written.
"""

from __future__ import annotations

import triton
import triton.language as tl

try:  # Hopper+ programmatic dependent launch (see NOTE [overlapping the launches]); absent in old Triton
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - the launchers then never set USE_PDL
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def _block_ids(ids_ptr, ids_copy_ptr, blocks, N, num_experts, BLOCK_N: tl.constexpr, COPY_IDS: tl.constexpr,
               DEBUG: tl.constexpr):
    """The ids of ``blocks`` (a [SUB, BLOCK_N] tile) and which are real entries with an id in range."""
    offs = blocks.to(tl.int64)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    in_bounds = offs < N
    ids = tl.load(ids_ptr + offs, mask=in_bounds, other=0)
    valid = in_bounds & (ids >= 0) & (ids < num_experts)
    if DEBUG:
        tl.device_assert(valid | ~in_bounds, "expert_idx out of range [0, num_experts)")
    if COPY_IDS:  # NOTE [no load-derived store addresses on graph inputs]
        # out-of-range ids become -1, so that the int32 copy cannot wrap an id like 2**40 into [0, E)
        tl.store(ids_copy_ptr + offs, tl.where(valid, ids, -1).to(tl.int32), mask=in_bounds)
    return ids, valid


@triton.jit
def _block_histogram_kernel(
    ids_ptr,  # [N] expert ids, any integer dtype
    table_ptr,  # int32 table (NOTE [one table]) out: row 1 + b = block b's histogram; the ids copy (if COPY_IDS)
    N,
    num_experts,
    ids_copy_offset,  # where the int32 copy of the ids starts in the table
    E_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    COPY_IDS: tl.constexpr,
    DEBUG: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # grid (NB,): NOTE [destination rows in two launches], large N (the index kernel then scans the table)
    if USE_PDL:
        gdc_launch_dependents()  # NOTE [overlapping the launches]
    block = tl.program_id(0)
    ids, valid = _block_ids(ids_ptr, table_ptr + ids_copy_offset, block + tl.arange(0, 1), N, num_experts, BLOCK_N,
                            COPY_IDS, DEBUG)
    hist = tl.histogram(tl.reshape(tl.where(valid, ids, 0).to(tl.int32), [BLOCK_N]), E_PAD,
                        mask=tl.reshape(valid, [BLOCK_N]))
    tl.store(table_ptr + (1 + block) * E_PAD + tl.arange(0, E_PAD), hist)


@triton.jit
def _expert_offsets_kernel(
    ids_ptr,  # [N] expert ids, any integer dtype
    table_ptr,  # int32 table out (NOTE [one table]): counts, before_blocks, seg_start; the ids copy (if COPY_IDS)
    offs_ptr,  # int32 [E] out
    N,
    num_experts,
    num_blocks,
    ids_copy_offset,  # where the int32 copy of the ids (for the permute kernel) starts in the table
    ALIGN: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SUB: tl.constexpr,
    FROM_TABLE: tl.constexpr,
    COPY_IDS: tl.constexpr,
    DEBUG: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # one program (NOTE [destination rows in two launches]): histogram + exclusive scan, SUB blocks of
    # BLOCK_N ids per iteration; FROM_TABLE: the histograms are in the table already (_block_histogram_kernel)
    if USE_PDL:
        gdc_launch_dependents()  # NOTE [overlapping the launches]
        if FROM_TABLE:
            gdc_wait()  # the table is written by the histogram kernel
    experts = tl.arange(0, E_PAD)
    sub = tl.arange(0, SUB)
    blocks_ptr = table_ptr + E_PAD  # before_blocks, then seg_start
    running = tl.zeros([E_PAD], dtype=tl.int32)
    for b0 in tl.range(0, num_blocks, SUB, num_stages=3):  # the loads of later trips in flight
        blocks = b0 + sub
        tile = blocks[:, None] * E_PAD + experts[None, :]
        if FROM_TABLE:
            hist = tl.load(blocks_ptr + tile, mask=(blocks < num_blocks)[:, None], other=0)
        else:
            ids, valid = _block_ids(ids_ptr, table_ptr + ids_copy_offset, blocks, N, num_experts, BLOCK_N, COPY_IDS,
                                    DEBUG)
            keys = sub[:, None] * E_PAD + tl.where(valid, ids, 0).to(tl.int32)
            hist = tl.histogram(tl.reshape(keys, [SUB * BLOCK_N]), SUB * E_PAD,
                                mask=tl.reshape(valid, [SUB * BLOCK_N]))
            hist = tl.reshape(hist, [SUB, E_PAD])
        tl.store(blocks_ptr + tile, tl.cumsum(hist, 0) - hist + running[None, :], mask=(blocks < num_blocks)[:, None])
        running += tl.sum(hist, 0)
    padded = (running + (ALIGN - 1)) // ALIGN * ALIGN
    offs_e = tl.cumsum(padded, 0)
    expert_mask = experts < num_experts
    tl.store(table_ptr + experts, running)  # the op's `counts` output is a view of this row
    tl.store(offs_ptr + experts, offs_e, mask=expert_mask)
    tl.store(blocks_ptr + num_blocks * E_PAD + experts, offs_e - padded)


@triton.jit
def _permute_rows_kernel(
    x_ptr,  # [T, H] (row stride stride_x)
    ids_ptr,  # [N] expert ids, any integer dtype (unread if IDS_IN_TABLE)
    table_ptr,  # int32 table from _expert_offsets_kernel (NOTE [one table])
    probs_ptr,  # [T, K] (if HAS_PROBS)
    rows_ptr,  # [M, H] out
    probs_out_ptr,  # [M] out (if HAS_PROBS)
    row_map_ptr,  # int32 [T, 2K] out
    num_tokens,
    H,
    stride_x,
    num_experts,
    num_blocks,
    num_rows,  # M
    num_zero_rows,  # M - N
    ids_offset,  # where the ids start in the table (if IDS_IN_TABLE)
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    ALIGN: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr,
    # experts per tile of the dropped entries' branch (NOTE [dropped entries] (moe_compile/ops/permute_pad.py))
    DROP_E_CHUNK: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ZERO_ROWS: tl.constexpr,
    IDS_IN_TABLE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # grid (T + cdiv(M - N, ZERO_ROWS), cdiv(H, BLOCK_H)): token programs, then zero programs
    pid = tl.program_id(0)
    pid_h = tl.program_id(1)
    cols = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = cols < H
    if pid < num_tokens:
        t = pid.to(tl.int64)
        vals = tl.load(x_ptr + t * stride_x + cols, mask=col_mask)  # each source row is read once
        # NOTE [destination rows in two launches]: dest = seg_start + before_blocks + rank in block
        if IDS_IN_TABLE:  # NOTE [no load-derived store addresses on graph inputs]
            ids_src = table_ptr + ids_offset
        else:
            ids_src = ids_ptr
        slots = tl.arange(0, K_PAD)
        slot_mask = slots < K
        flat_K = t * K + slots
        ids_K = tl.load(ids_src + flat_K, mask=slot_mask, other=0)
        valid_K = slot_mask & (ids_K >= 0) & (ids_K < num_experts)
        block_start_K = flat_K // BLOCK_N * BLOCK_N
        rank_K = tl.zeros([K_PAD], dtype=tl.int32)
        # entries j in [block start, flat) with the same id; compared in the ids' own dtype
        for j0 in range(t * K // BLOCK_N * BLOCK_N, t * K + K - 1, CHUNK):
            j = j0 + tl.arange(0, CHUNK)
            ids_j = tl.load(ids_src + j, mask=j < t * K + K - 1, other=0)
            same = (ids_j[None, :] == ids_K[:, None]) & (j[None, :] >= block_start_K[:, None])
            rank_K += tl.sum((same & (j[None, :] < flat_K[:, None])).to(tl.int32), 1)
        if USE_PDL:
            gdc_wait()  # NOTE [overlapping the launches]: `table` is written by the index kernel
        experts_K = tl.where(valid_K, ids_K, 0).to(tl.int32)
        before_K = tl.load(table_ptr + (1 + flat_K // BLOCK_N) * E_PAD + experts_K, mask=valid_K, other=0)
        seg_start_K = tl.load(table_ptr + (1 + num_blocks) * E_PAD + experts_K, mask=valid_K, other=0)
        dest_K = seg_start_K + before_K + rank_K
        dest_ok = valid_K & (dest_K < num_rows)  # (always true for consistent inputs; memory safety)
        dest_K = tl.where(dest_ok, dest_K, -1)
        for k in tl.static_range(K):
            dest = tl.sum(tl.where(slots == k, dest_K, 0), 0)
            # (cols * 0 + dest): a vector, because the interpreter cannot AND a vector with a scalar mask
            tl.store(rows_ptr + dest.to(tl.int64) * H + cols, vals, mask=col_mask & ((cols * 0 + dest) >= 0))
        bad_K = slot_mask & ~valid_K
        if tl.max(bad_K.to(tl.int32), 0) > 0:  # bad input only: NOTE [dropped entries] (moe_compile/ops/permute_pad.py)
            _zero_rows_of_dropped(
                ids_src, table_ptr, rows_ptr, probs_out_ptr, t, flat_K, bad_K, cols, col_mask, pid_h, H,
                num_experts, num_rows, num_zero_rows, K, K_PAD, ALIGN, E_PAD, BLOCK_N, CHUNK, DROP_E_CHUNK, HAS_PROBS,
                BLOCK_H,
            )  # fmt: skip
        if pid_h == 0:
            if HAS_PROBS:
                p = tl.load(probs_ptr + flat_K, mask=slot_mask)
                tl.store(probs_out_ptr + dest_K, p, mask=dest_ok)
            # row_map[t] = [rows ascending | their slots]: slot k goes to position rank(k), the number
            # of slots with a smaller key (keys are distinct; invalid rows sort last and read -1)
            keys = tl.where(dest_ok, dest_K, num_rows).to(tl.int64) * K_PAD + slots
            order = tl.sum((keys[None, :] < keys[:, None]).to(tl.int32), 1)
            row_map_t = row_map_ptr + t * (2 * K)
            tl.store(row_map_t + order, dest_K, mask=slot_mask)
            tl.store(row_map_t + K + order, slots, mask=slot_mask)
    else:
        # NOTE [zero rows without a memset]
        if USE_PDL:
            gdc_wait()  # `table` is written by the index kernel
        j = (pid - num_tokens) * ZERO_ROWS + tl.arange(0, ZERO_ROWS)
        j_mask = j < num_zero_rows
        experts = tl.arange(0, E_PAD)
        counts = tl.load(table_ptr + experts, mask=experts < num_experts, other=0)
        pad = (counts + (ALIGN - 1)) // ALIGN * ALIGN - counts
        pad_before = tl.cumsum(pad, 0) - pad
        row = j + tl.sum(tl.where(pad_before[None, :] <= j[:, None], counts[None, :], 0), 1)
        zeros = tl.zeros([ZERO_ROWS, BLOCK_H], dtype=rows_ptr.dtype.element_ty)
        row_mask = j_mask & (row < num_rows)
        ptrs = rows_ptr + row.to(tl.int64)[:, None] * H + cols[None, :]
        tl.store(ptrs, zeros, mask=row_mask[:, None] & col_mask[None, :])
        if HAS_PROBS:
            if pid_h == 0:
                tl.store(
                    probs_out_ptr + row, tl.zeros([ZERO_ROWS], dtype=probs_out_ptr.dtype.element_ty), mask=row_mask
                )


@triton.jit
def _zero_rows_of_dropped(
    ids_src, table_ptr, rows_ptr, probs_out_ptr, t, flat_K, bad_K, cols, col_mask, pid_h, H,
    num_experts, num_rows, num_zero_rows,
    K: tl.constexpr, K_PAD: tl.constexpr, ALIGN: tl.constexpr, E_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr, E_CHUNK: tl.constexpr, HAS_PROBS: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """The token's dropped entries (``bad_K``) zero the non-real rows ``M - N + g`` (``g``: the entry's rank among
    all dropped entries, in flat order), which the zero programs do not cover;
    NOTE [dropped entries] (moe_compile/ops/permute_pad.py). Tiles of ``[K_PAD, E_CHUNK]`` (at most 4K entries)."""
    block_K = flat_K // BLOCK_N
    # dropped entries before flat = flat - valid entries before it: those of the earlier blocks (the sum over the
    # experts of before_blocks) and those of its own block before it
    valid_before_K = tl.zeros([K_PAD], dtype=tl.int32)
    for e0 in range(0, E_PAD, E_CHUNK):
        experts = e0 + tl.arange(0, E_CHUNK)
        before = tl.load(table_ptr + (1 + block_K)[:, None] * E_PAD + experts[None, :], mask=bad_K[:, None], other=0)
        valid_before_K += tl.sum(before, 1)
    block_start_K = block_K * BLOCK_N
    for j0 in range(t * K // BLOCK_N * BLOCK_N, t * K + K - 1, CHUNK):
        j = j0 + tl.arange(0, CHUNK)
        ids_j = tl.load(ids_src + j, mask=j < t * K + K - 1, other=0)
        ok_j = (ids_j >= 0) & (ids_j < num_experts)
        earlier = (j[None, :] >= block_start_K[:, None]) & (j[None, :] < flat_K[:, None])
        valid_before_K += tl.sum((ok_j[None, :] & earlier).to(tl.int32), 1)
    j_K = num_zero_rows + (flat_K - valid_before_K)  # its place among the non-real rows
    # the j-th non-real row (NOTE [zero rows without a memset]): j + the counts of the experts whose pad rows start
    # at or before it
    row_K = j_K
    pad_done = 0  # pad rows of the experts before the chunk
    for e0 in range(0, E_PAD, E_CHUNK):
        experts = e0 + tl.arange(0, E_CHUNK)
        counts = tl.load(table_ptr + experts, mask=experts < num_experts, other=0)
        pad = (counts + (ALIGN - 1)) // ALIGN * ALIGN - counts
        pad_before = pad_done + tl.cumsum(pad, 0) - pad
        row_K += tl.sum(tl.where(pad_before[None, :] <= j_K[:, None], counts[None, :], 0), 1)
        pad_done += tl.sum(pad, 0)
    row_K = tl.where(bad_K & (row_K < num_rows), row_K, -1)
    zeros = tl.zeros([BLOCK_H], dtype=rows_ptr.dtype.element_ty)
    slots = tl.arange(0, K_PAD)
    for k in tl.static_range(K):
        row = tl.sum(tl.where(slots == k, row_K, 0), 0)
        tl.store(rows_ptr + row.to(tl.int64) * H + cols, zeros, mask=col_mask & ((cols * 0 + row) >= 0))
    if HAS_PROBS:
        if pid_h == 0:
            tl.store(probs_out_ptr + row_K, tl.zeros([K_PAD], dtype=probs_out_ptr.dtype.element_ty), mask=row_K >= 0)


@triton.jit
def _to_slot_order(vals_j, src_slots_j, slots_k):
    """``out[k] = vals[j]`` for the ``j`` with ``src_slots[j] == k``: a [K_PAD, K_PAD] select, so the
    store that follows has a load-free address (NOTE [no load-derived store addresses on graph inputs]).
    Summing one value with ``-0.0`` is exact, signed zeros included; done in fp32 (fp64 for fp64), since
    the interpreter's 16-bit float reductions are not exact."""
    pick = src_slots_j[None, :] == slots_k[:, None]
    if vals_j.dtype == tl.float64:
        wide = vals_j
    else:
        wide = vals_j.to(tl.float32)
    return tl.sum(tl.where(pick, wide[None, :], -0.0), 1).to(vals_j.dtype)


@triton.jit
def _unpermute_rows_kernel(
    rows_ptr,  # [R, H]
    row_map_ptr,  # int32 [T, 2K]
    probs_ptr,  # [T, K] (if HAS_PROBS)
    out_ptr,  # [T, H] out
    grad_probs_M_ptr,  # [R] (if GATHER_PROB_GRAD): the permute_pad backward's prob gather
    grad_probs_ptr,  # [T, K] out (if GATHER_PROB_GRAD)
    num_rows,
    H,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    GATHER_PROB_GRAD: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    DEBUG: tl.constexpr,
):
    # grid (T, cdiv(H, BLOCK_H)); y[t] = sum_j p_j * rows[row_j], rows ascending, one rounding at the end.
    # Launched with fp fusion off, so `acc + p * z` rounds like the PyTorch reference (bitwise equal).
    # NOTE [poisoned tokens] (moe_compile/ops/unpad_unpermute.py): a row outside [0, num_rows) reads NaN, and so does
    # the prob of a slot outside [0, K); neither load leaves its tensor.
    t = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)
    cols = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = cols < H
    acc = tl.zeros([BLOCK_H], dtype=ACC_DTYPE)
    for j in tl.static_range(K):
        row = tl.load(row_map_ptr + t * (2 * K) + j)
        if DEBUG:
            tl.device_assert((row >= 0) & (row < num_rows), "row_map row out of range [0, rows.shape[0])")
        row_vec = cols * 0 + row
        row_mask = col_mask & (row_vec >= 0) & (row_vec < num_rows)
        vals = tl.load(rows_ptr + row.to(tl.int64) * H + cols, mask=row_mask, other=float("nan")).to(ACC_DTYPE)
        if HAS_PROBS:
            slot = tl.load(row_map_ptr + t * (2 * K) + K + j)
            if DEBUG:
                tl.device_assert((slot >= 0) & (slot < K), "row_map slot out of range [0, K)")
            slot_ok = (slot >= 0) & (slot < K)
            p = tl.load(probs_ptr + t * K + tl.where(slot_ok, slot, 0)).to(ACC_DTYPE)
            vals = vals * tl.where(slot_ok, p, float("nan"))
        acc = acc + vals
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=col_mask)
    if GATHER_PROB_GRAD:
        if pid_h == 0:
            slots = tl.arange(0, K_PAD)
            slot_mask = slots < K
            rows = tl.load(row_map_ptr + t * (2 * K) + slots, mask=slot_mask, other=-1)
            src_slots = tl.load(row_map_ptr + t * (2 * K) + K + slots, mask=slot_mask, other=-1)
            rows_ok = slot_mask & (rows >= 0) & (rows < num_rows)
            g = tl.load(grad_probs_M_ptr + rows, mask=rows_ok, other=0.0)
            g = _to_slot_order(g, src_slots, slots)
            # NOTE [poisoned tokens] (moe_compile/ops/unpad_unpermute.py)
            bad = slot_mask & (~rows_ok | (src_slots < 0) | (src_slots >= K))
            g = tl.where(tl.max(bad.to(tl.int32), 0) > 0, float("nan"), g)
            tl.store(grad_probs_ptr + t * K + slots, g, mask=slot_mask)


@triton.jit
def _mark_used_rows_kernel(
    row_map_ptr,  # int32 [T, 2K]
    used_ptr,  # int8 [R], zero-initialised; out: 1 for every row that row_map references
    num_entries,  # T * K
    num_rows,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < num_entries
    rows = tl.load(row_map_ptr + (i // K) * (2 * K) + i % K, mask=mask, other=-1)
    ones = tl.full([BLOCK], 1, dtype=tl.int8)
    tl.store(used_ptr + rows, ones, mask=mask & (rows >= 0) & (rows < num_rows))  # same value: no race


@triton.jit
def _unpermute_backward_kernel(
    grad_y_ptr,  # [T, H]
    rows_ptr,  # [R, H] (if NEED_PROB_GRAD)
    row_map_ptr,  # int32 [T, 2K]
    probs_ptr,  # [T, K] (if HAS_PROBS)
    used_ptr,  # int8 [R] from _mark_used_rows_kernel
    grad_rows_ptr,  # [R, H] out
    grad_probs_ptr,  # [T, K] out (if NEED_PROB_GRAD)
    num_tokens,
    num_rows,
    H,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    NEED_PROB_GRAD: tl.constexpr,
    LOOP_H: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ZERO_ROWS: tl.constexpr,
    DEBUG: tl.constexpr,
):
    # grid (T + cdiv(R, ZERO_ROWS), 1 if LOOP_H else cdiv(H, BLOCK_H)). Token programs write
    # grad_rows[row_j] = g[t] * p_j and (NEED_PROB_GRAD, then LOOP_H: one program per token, so no
    # atomics across H tiles) grad_probs[t, slot_j] = <rows[row_j], g[t]>; zero programs zero the rows
    # that no token references (pad rows, tail).
    pid = tl.program_id(0)
    pid_h = tl.program_id(1)
    if LOOP_H:
        h_start = 0
        h_end = H
    else:
        h_start = pid_h * BLOCK_H
        h_end = h_start + BLOCK_H
    if pid < num_tokens:
        t = pid.to(tl.int64)
        slots = tl.arange(0, K_PAD)
        slot_mask = slots < K
        rows = tl.load(row_map_ptr + t * (2 * K) + slots, mask=slot_mask, other=-1)
        rows_ok = slot_mask & (rows >= 0) & (rows < num_rows)
        if DEBUG:
            tl.device_assert(rows_ok | ~slot_mask, "row_map row out of range [0, rows.shape[0])")
        rows64 = rows.to(tl.int64)
        src_slots = tl.load(row_map_ptr + t * (2 * K) + K + slots, mask=slot_mask, other=-1)
        # NOTE [poisoned tokens] (moe_compile/ops/unpad_unpermute.py): a token whose forward read a bad entry (a row
        # outside [0, num_rows), or with probs a slot outside [0, K)) gets NaN gradients
        bad = slot_mask & ~rows_ok
        if HAS_PROBS:
            slot_ok = slot_mask & (src_slots >= 0) & (src_slots < K)
            bad = bad | (slot_mask & ~slot_ok)
            p = tl.load(probs_ptr + t * K + src_slots, mask=slot_ok, other=0.0).to(ACC_DTYPE)
        poisoned = tl.max(bad.to(tl.int32), 0) > 0
        dots = tl.zeros([K_PAD, BLOCK_H], dtype=ACC_DTYPE)
        for h0 in range(h_start, h_end, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            col_mask = cols < H
            g = tl.load(grad_y_ptr + t * H + cols, mask=col_mask, other=0.0)
            g = tl.where(poisoned, float("nan"), g)
            if HAS_PROBS:
                grad_vals = (g.to(ACC_DTYPE)[None, :] * p[:, None]).to(grad_rows_ptr.dtype.element_ty)
            else:
                grad_vals = tl.broadcast_to(g[None, :], [K_PAD, BLOCK_H])
            tile_mask = rows_ok[:, None] & col_mask[None, :]
            tl.store(grad_rows_ptr + rows64[:, None] * H + cols[None, :], grad_vals, mask=tile_mask)
            if NEED_PROB_GRAD:
                z = tl.load(rows_ptr + rows64[:, None] * H + cols[None, :], mask=tile_mask, other=0.0)
                dots += z.to(ACC_DTYPE) * g.to(ACC_DTYPE)[None, :]
        if NEED_PROB_GRAD:
            dot = _to_slot_order(tl.sum(dots, 1), src_slots, slots)
            dot = tl.where(poisoned, float("nan"), dot)  # (a slot no entry names would read -0.0)
            tl.store(grad_probs_ptr + t * K + slots, dot.to(grad_probs_ptr.dtype.element_ty), mask=slot_mask)
    else:
        r = (pid - num_tokens).to(tl.int64) * ZERO_ROWS + tl.arange(0, ZERO_ROWS)
        r_mask = r < num_rows
        used = tl.load(used_ptr + r, mask=r_mask, other=1)
        zero_mask = r_mask & (used == 0)
        zeros = tl.zeros([ZERO_ROWS, BLOCK_H], dtype=grad_rows_ptr.dtype.element_ty)
        if tl.max(zero_mask.to(tl.int32), 0) > 0:  # most row blocks are fully referenced: skip them
            for h0 in range(h_start, h_end, BLOCK_H):
                cols = h0 + tl.arange(0, BLOCK_H)
                ptrs = grad_rows_ptr + r[:, None] * H + cols[None, :]
                tl.store(ptrs, zeros, mask=zero_mask[:, None] & (cols < H)[None, :])
