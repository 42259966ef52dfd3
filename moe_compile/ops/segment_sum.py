"""``torch.ops.moe.segment_sum``: sum rows of ``src`` into rows ``idx`` of a fresh ``[R, D]`` tensor, in a fixed order.

Shapes: ``N`` entries, ``D`` columns, ``R = num_rows`` output rows.

Contract:

* ``out_RD[r] = sum of src_ND[i] over the entries i with idx_N[i] == r (and mask_N[i], if given)``, in a
  fixed order that depends only on ``idx`` and ``mask`` (CPU: ascending ``i``; CUDA: tiles of ``BLOCK_J``
  entries in ascending ``i``, each summed as a fixed tree); rows nobody adds to are zero. ``out`` has ``src``'s dtype;
  floating sums accumulate in fp32 (fp64 for fp64), integer sums in int64 (exact).
* It is the deterministic form of ``index_put(zeros, [idx], src, accumulate=True)`` /
  ``index_add`` / ``scatter_add`` / the embedding backward (``moe_compile.passes.deterministic_scatter``
  lowers those to it): no atomics, every output element has one writer and a fixed order of adds, so
  results are bitwise reproducible run to run
  (NOTE [segment sum in a fixed order] (moe_compile/ops/triton/segment_sum.py)).
* Entries with ``mask_N[i] == False`` are skipped whatever their index (the masked index_put of
  Inductor's embedding backward). Other entries must have ``0 <= idx < R``: on CPU that is checked on the
  host (``ValueError`` naming ``idx``); on CUDA ``debug=True`` adds a device-side assert, and without it
  out-of-range entries are dropped.
* Static shapes, no host sync on CUDA (CUDA-graph safe).

CPU (and any non-CUDA device): :func:`segment_sum_reference`, a stable sort of the row keys, segment
offsets by ``searchsorted``, a gather of the sorted rows and ``segment_reduce`` over the offsets (each
segment summed in order; integer sums as exact prefix-sum differences): no ``index_add`` /
``scatter_add`` / ``index_put``. CUDA: the same sort and offsets, then one Triton launch. The op is built
like a ``torch.library.triton_op`` (NOTE [device-decomposed triton ops] (moe_compile/ops/_common.py)).
Backward (w.r.t. ``src``): a gather, ``grad_src[i] = grad_out[idx[i]]`` (0 for skipped entries).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe_compile.ops import _common

__all__ = ["gather_segment_sum", "gather_segment_sum_reference", "group_order", "segment_sum",
           "segment_sum_by_groups", "segment_sum_reference"]

# dtypes ``src`` may have: floats (fp32/fp64 accumulators) and integers (int64 accumulator)
SRC_DTYPES = (*_common.FLOAT_DTYPES, torch.int32, torch.int64)


# ===== reference =====


def _segments(idx_N: Tensor, num_rows: int, mask_N: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(order_N, offsets_R1)``: the stable sort permutation of the row keys (skipped and out-of-range entries
    keyed ``R``, after every row) and each row's segment ``[offsets[r], offsets[r + 1])`` of sorted positions."""
    ok_N = (idx_N >= 0) & (idx_N < num_rows)
    if mask_N is not None:
        ok_N = ok_N & mask_N
    # int32 keys where they fit: a radix sort's passes go by the key's bits
    key_dtype = torch.int32 if num_rows < 2**31 - 1 else torch.int64
    key_N = torch.where(ok_N, idx_N, num_rows).to(key_dtype)
    sorted_N, order_N = torch.sort(key_N, stable=True)
    rows_R1 = torch.arange(num_rows + 1, device=idx_N.device, dtype=key_dtype)
    return order_N, torch.searchsorted(sorted_N, rows_R1)


def segment_sum_reference(src_ND: Tensor, idx_N: Tensor, num_rows: int, mask_N: Tensor | None = None) -> Tensor:
    """Pure-PyTorch, sync-free segment sum (the CPU kernel and the test oracle); see the module docstring.

    Args:
        src_ND: ``[N, D]`` rows to add (float or int32/int64).
        idx_N: ``[N]`` integer row of each entry (in ``[0, num_rows)`` where not masked; not checked here).
        num_rows: ``R``.
        mask_N: optional ``[N]`` bool; entries with ``False`` are skipped.

    Returns:
        ``[R, D]`` tensor of ``src_ND.dtype``.
    """
    N, D = src_ND.shape
    order_N, offsets_R1 = _segments(idx_N, num_rows, mask_N)
    if src_ND.is_floating_point():
        acc = torch.float64 if src_ND.dtype == torch.float64 else torch.float32
        sorted_ND = src_ND.index_select(0, order_N).to(acc)
        out = torch.segment_reduce(sorted_ND, "sum", offsets=offsets_R1, axis=0, unsafe=True)
        return out.to(src_ND.dtype)
    # integers: prefix-sum differences are exact (and segment_reduce has no integer CPU kernel)
    prefix = torch.cat([src_ND.new_zeros(1, D, dtype=torch.int64),
                        src_ND.index_select(0, order_N).to(torch.int64).cumsum(0)])
    return (prefix.index_select(0, offsets_R1[1:]) - prefix.index_select(0, offsets_R1[:-1])).to(src_ND.dtype)


def segment_sum_backward_reference(grad_RD: Tensor, idx_N: Tensor, mask_N: Tensor | None) -> Tensor:
    """``grad_src[i] = grad_out[idx[i]]``, 0 for masked-out or out-of-range entries (a gather)."""
    R = grad_RD.shape[0]
    key_N = idx_N.to(torch.int64)
    ok_N = (key_N >= 0) & (key_N < R)
    if mask_N is not None:
        ok_N = ok_N & mask_N
    picked = (
        grad_RD.index_select(0, torch.where(ok_N, key_N, 0))
        if R > 0
        else grad_RD.new_zeros(idx_N.shape[0], grad_RD.shape[1])
    )
    return torch.where(ok_N[:, None], picked, torch.zeros((), dtype=grad_RD.dtype, device=grad_RD.device))


# ===== validation =====


def _check_args(src: Tensor, idx: Tensor, num_rows: int, mask: Tensor | None, debug: bool = False) -> None:
    if not isinstance(src, Tensor):
        raise ValueError(f"src must be a torch.Tensor, got {type(src).__name__}")
    if src.dtype not in SRC_DTYPES:
        raise ValueError(f"src must have dtype in {SRC_DTYPES}, got {src.dtype}")
    if src.dim() != 2:
        raise ValueError(f"src must be 2-D [N, D], got shape {tuple(src.shape)}")
    _common.check_int_tensor(idx, "idx", 1)
    if idx.shape[0] != src.shape[0]:
        raise ValueError(f"idx must have one entry per row of src: idx.shape={tuple(idx.shape)}, "
                         f"src.shape={tuple(src.shape)}")
    if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 0:
        raise ValueError(f"num_rows must be an int >= 0, got {num_rows!r}")
    if mask is not None:
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.dim() != 1:
            raise ValueError(f"mask must be a 1-D bool tensor, got "
                             f"{mask.dtype if isinstance(mask, Tensor) else type(mask).__name__} "
                             f"of shape {tuple(getattr(mask, 'shape', ()))}")
        if mask.shape[0] != idx.shape[0]:
            raise ValueError(f"mask must have one entry per entry of idx: mask.shape={tuple(mask.shape)}, "
                             f"idx.shape={tuple(idx.shape)}")
    _common.check_same_device(src=src, idx=idx, mask=mask)
    _common.check_bool(debug, "debug")


def _check_idx_in_range(idx: Tensor, num_rows: int, mask: Tensor | None) -> None:
    """Host check (CPU tensors): every entry that is not masked out has ``0 <= idx < num_rows``."""
    if mask is not None:
        idx = idx[mask]
    _common.check_ids_in_range(idx, 0, num_rows, "idx")


# ===== Triton launcher (CUDA; also runs on CPU tensors under TRITON_INTERPRET=1 in the tests) =====

# Entries per tile of the segment loop: enough loads in flight per program for typical segments
# (a few tokens per vocabulary row) while a long segment still moves BLOCK_J rows per iteration.
BLOCK_J = 16
# moe.gather_segment_sum's segments are short (a capacity slot holds one entry, a token K): small tiles
GATHER_BLOCK_J = 2


def _launch_triton(src: Tensor, idx: Tensor, num_rows: int, mask: Tensor | None, debug: bool = False, *,
                   gather: Tensor | None = None, weight: Tensor | None = None, idx_sorted: bool = False,
                   block_d: int | None = None, block_j: int | None = None) -> Tensor:
    """Stable sort + offsets (PyTorch; offsets only where ``idx_sorted``), then one launch over
    ``(R, D / BLOCK_D)`` programs. ``gather``/``weight``: ``moe.gather_segment_sum``'s entries."""
    from moe_compile.ops.triton import segment_sum as kernels

    D = _common.static_ints(src.shape[1])[0]
    out = torch.empty((num_rows, D), dtype=src.dtype, device=src.device)
    if debug:
        ok = (idx >= 0) & (idx < num_rows)
        if mask is not None:
            ok = ok | ~mask
        torch._assert_async(ok.all(), "moe.segment_sum: idx values must be in [0, num_rows) (debug=True)")
        if idx_sorted:
            torch._assert_async((idx[1:] >= idx[:-1]).all(), "moe.gather_segment_sum: idx must be sorted "
                                "(idx_sorted=True, debug=True)")
    if num_rows == 0 or D == 0:
        return out
    if idx_sorted:
        order = None
        offsets = _sorted_offsets(idx, num_rows)
    else:
        order, offsets = _segments(idx, num_rows, mask)
    if src.stride(1) != 1:
        src = src.contiguous()
    bd, num_warps = _common.row_block(D, src.element_size())
    bd = block_d or bd
    acc = kernels.ACC_INT64 if not src.is_floating_point() else \
        kernels.ACC_FP64 if src.dtype == torch.float64 else kernels.ACC_FP32
    has_mask = idx_sorted and mask is not None
    default_j = BLOCK_J if gather is None else GATHER_BLOCK_J
    _common.launch_kernel(
        kernels._segment_sum_kernel, (num_rows, _common.cdiv(D, bd)),
        src, order if order is not None else offsets, offsets, gather if gather is not None else offsets,
        weight if weight is not None else src, mask if has_mask else offsets, out, D,
        _common.static_ints(src.stride(0))[0],
        ACC=acc, ORDERED=order is None, HAS_GATHER=gather is not None, HAS_WEIGHT=weight is not None,
        HAS_MASK=has_mask, BLOCK_J=block_j or default_j, BLOCK_D=bd,
        traced=src.is_cuda and _common.is_traced(src), options=dict(num_warps=num_warps),
    )  # fmt: skip
    return out


SEARCH_BLOCK = 256  # queries per program of the sorted offsets' binary search


def _sorted_offsets(idx: Tensor, num_rows: int) -> Tensor:
    """int64 ``[R + 1]``: ``offsets[r]`` = the first position of the non-decreasing ``idx`` whose value is ``>= r``
    (``torch.searchsorted(idx, arange(R + 1))``, by a Triton binary search: Inductor 2.11 cannot lower
    ``searchsorted`` over a view of a computed tensor, the combine's ``tok`` among them)."""
    from moe_compile.ops.triton import segment_sum as kernels

    N = _common.static_ints(idx.shape[0])[0]
    out = torch.empty(num_rows + 1, dtype=torch.int64, device=idx.device)
    steps = max(1, (N + 1).bit_length())
    _common.launch_kernel(kernels._lower_bound_kernel, (_common.cdiv(num_rows + 1, SEARCH_BLOCK),),
                          idx, out, N, num_rows + 1, STEPS=steps, BLOCK=SEARCH_BLOCK,
                          traced=_common.is_traced(idx), options=dict(num_warps=4))
    return out


# ===== op (NOTE [device-decomposed triton ops] (moe_compile/ops/_common.py)) =====


def _segment_sum_body(src: Tensor, idx: Tensor, num_rows: int, mask: Tensor | None = None,
                      debug: bool = False) -> Tensor:
    _check_args(src, idx, num_rows, mask, debug)
    if src.device.type == "cuda":
        return _launch_triton(src, idx, num_rows, mask, debug)
    if not _common.is_traced(src):  # eager CPU: the indices are on the host anyway
        _check_idx_in_range(idx, num_rows, mask)
    return segment_sum_reference(src, idx, num_rows, mask)


def _segment_sum_fake(src, idx, num_rows, mask=None, debug=False):
    _check_args(src, idx, num_rows, mask, debug)
    return src.new_empty(num_rows, src.shape[1])


_segment_sum_op = _common.dispatch_triton_op(
    "moe::segment_sum",
    _segment_sum_body,
    # plain `int` num_rows: it sizes the output and the grid
    schema="(Tensor src, Tensor idx, int num_rows, Tensor? mask=None, bool debug=False) -> Tensor",
    fake=_segment_sum_fake,
)


# ===== autograd =====


def _setup_context(ctx, inputs, output) -> None:
    src, idx, num_rows, mask, debug = inputs
    ctx.has_mask = mask is not None
    ctx.save_for_backward(idx, mask if mask is not None else idx.new_empty(0, dtype=torch.bool))


def _backward(ctx, grad_out):
    idx, mask = ctx.saved_tensors
    if not torch.is_floating_point(grad_out):
        return None, None, None, None, None
    grad_src = segment_sum_backward_reference(grad_out, idx, mask if ctx.has_mask else None)
    return grad_src, None, None, None, None


_segment_sum_op.register_autograd(_backward, setup_context=_setup_context)
_SEGMENT_SUM = torch.ops.moe.segment_sum.default


# ===== public wrapper =====


def segment_sum(src_ND: Tensor, idx_N: Tensor, num_rows: int, mask_N: Tensor | None = None,
                debug: bool = False) -> Tensor:
    """Deterministic ``zeros(R, D).index_add_(0, idx, src)`` (``torch.ops.moe.segment_sum``).

    Args:
        src_ND: ``[N, D]`` rows, bf16/fp16/fp32/fp64 or int32/int64.
        idx_N: ``[N]`` integer output row of each entry, in ``[0, num_rows)`` where not masked out.
        num_rows: ``R`` (a plain int: it sizes the output).
        mask_N: optional ``[N]`` bool; entries with ``False`` are skipped (their index is not checked).
        debug: on CUDA, a device-side assert that ``idx`` is in range (no host sync). On CPU the range is
            always checked.

    Returns:
        ``[R, D]`` tensor of ``src_ND.dtype``: row ``r`` holds the sum of the entries with index ``r``,
        added in a fixed order (module docstring; fp32 accumulation for floats, int64 for integers).

    Raises:
        ValueError: wrong dtype/rank/shape/device, ``num_rows`` not an int ``>= 0``, or (CPU) indices out of
            range. Messages name the argument.
    """
    _check_args(src_ND, idx_N, num_rows, mask_N, debug)
    return _SEGMENT_SUM(src_ND, idx_N, num_rows, mask_N, debug)


# ===== moe.gather_segment_sum: the entries' rows gathered and weighted in the sum =====


def gather_segment_sum_reference(src_SD: Tensor, src_idx_N: Tensor, idx_N: Tensor, num_rows: int,
                                 weight_N: Tensor | None = None, mask_N: Tensor | None = None) -> Tensor:
    """Pure-PyTorch ``moe.gather_segment_sum`` (the CPU kernel and the test oracle): each row the sum, in entry
    order, of ``weight[i] * src[src_idx[i]]`` over its entries ``i`` (fp32 accumulation for 16-bit ``src``). Sorted
    ``idx`` or not: the stable sort keeps each row's entries in entry order (``idx_sorted`` saves it on CUDA only)."""
    keep_N = (idx_N >= 0) & (idx_N < num_rows)
    if mask_N is not None:
        keep_N = keep_N & mask_N
    acc = torch.float64 if src_SD.dtype == torch.float64 else torch.float32
    order_N, offsets_R1 = _segments(idx_N, num_rows, keep_N)
    rows_N = torch.where(keep_N, src_idx_N, 0).index_select(0, order_N)
    vals = src_SD.index_select(0, rows_N).to(acc) if src_SD.shape[0] else \
        src_SD.new_zeros(idx_N.shape[0], src_SD.shape[1], dtype=acc)
    if weight_N is not None:
        vals = vals * weight_N.index_select(0, order_N).to(acc)[:, None]
    out = torch.segment_reduce(vals, "sum", offsets=offsets_R1, axis=0, unsafe=True)
    return out.to(src_SD.dtype)


def _check_gather_args(src, src_idx, idx, num_rows, weight, mask, idx_sorted, src_idx_sorted, debug) -> None:
    _common.check_float_tensor(src, "src", 2)
    _common.check_int_tensor(src_idx, "src_idx", 1)
    _common.check_int_tensor(idx, "idx", 1)
    if src_idx.shape[0] != idx.shape[0]:
        raise ValueError(f"src_idx and idx must have one entry each per entry: src_idx.shape={tuple(src_idx.shape)}, "
                         f"idx.shape={tuple(idx.shape)}")
    _common.check_count(num_rows, "num_rows")
    if weight is not None:
        if not isinstance(weight, Tensor) or not weight.is_floating_point() or weight.dim() != 1 \
                or weight.shape[0] != idx.shape[0]:
            raise ValueError(f"weight must be a 1-D float tensor with one entry per entry of idx ({idx.shape[0]}), "
                             f"got {getattr(weight, 'dtype', type(weight).__name__)} of shape "
                             f"{tuple(getattr(weight, 'shape', ()))}")
    if mask is not None:
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.dim() != 1 \
                or mask.shape[0] != idx.shape[0]:
            raise ValueError(f"mask must be a 1-D bool tensor with one entry per entry of idx ({idx.shape[0]}), "
                             f"got {getattr(mask, 'dtype', type(mask).__name__)} of shape "
                             f"{tuple(getattr(mask, 'shape', ()))}")
    _common.check_same_device(src=src, src_idx=src_idx, idx=idx, weight=weight, mask=mask)
    for name, flag in (("idx_sorted", idx_sorted), ("src_idx_sorted", src_idx_sorted), ("debug", debug)):
        _common.check_bool(flag, name)


def _check_gather_values(src, src_idx, idx, mask, idx_sorted) -> None:
    """Host checks (CPU tensors, not traced): the read rows in range; ``idx`` sorted where it says so."""
    if mask is not None:
        src_idx = src_idx[mask]
    _common.check_ids_in_range(src_idx, 0, src.shape[0], "src_idx")
    if idx_sorted and idx.numel() > 1 and not bool((idx[1:] >= idx[:-1]).all()):
        raise ValueError("idx must be non-decreasing where idx_sorted=True")


def _gather_segment_sum_body(src: Tensor, src_idx: Tensor, idx: Tensor, num_rows: int, weight: Tensor | None = None,
                             mask: Tensor | None = None, idx_sorted: bool = False, src_idx_sorted: bool = False,
                             debug: bool = False) -> Tensor:
    _check_gather_args(src, src_idx, idx, num_rows, weight, mask, idx_sorted, src_idx_sorted, debug)
    if src.device.type == "cuda":
        if debug:
            ok = (src_idx >= 0) & (src_idx < src.shape[0])
            torch._assert_async((ok if mask is None else ok | ~mask).all(),
                                "moe.gather_segment_sum: src_idx values must be in [0, src rows) (debug=True)")
        return _launch_triton(src, idx, num_rows, mask, debug, gather=src_idx, weight=weight, idx_sorted=idx_sorted)
    if not _common.is_traced(src):
        _check_gather_values(src, src_idx, idx, mask, idx_sorted)
    return gather_segment_sum_reference(src, src_idx, idx, num_rows, weight, mask)


def _gather_segment_sum_fake(src, src_idx, idx, num_rows, weight=None, mask=None, idx_sorted=False,
                             src_idx_sorted=False, debug=False):
    _check_gather_args(src, src_idx, idx, num_rows, weight, mask, idx_sorted, src_idx_sorted, debug)
    return src.new_empty(num_rows, src.shape[1])


_gather_segment_sum_op = _common.dispatch_triton_op(
    "moe::gather_segment_sum",
    _gather_segment_sum_body,
    schema="(Tensor src, Tensor src_idx, Tensor idx, int num_rows, Tensor? weight=None, Tensor? mask=None, "
           "bool idx_sorted=False, bool src_idx_sorted=False, bool debug=False) -> Tensor",
    fake=_gather_segment_sum_fake,
)


def _gather_setup_context(ctx, inputs, output) -> None:
    src, src_idx, idx, num_rows, weight, mask, idx_sorted, src_idx_sorted, debug = inputs
    ctx.src_rows, ctx.flags = src.shape[0], (idx_sorted, src_idx_sorted)
    ctx.has = (weight is not None, mask is not None)
    empty = idx.new_empty(0)
    need_w = weight is not None and ctx.needs_input_grad[4]
    ctx.save_for_backward(src_idx, idx, weight if weight is not None else empty, mask if mask is not None else empty,
                          src if need_w else empty)


def _gather_backward(ctx, grad_out):
    """``grad_src``: the same op with the two index roles swapped (a fixed-order sum over each source row's
    entries); ``grad_weight[i] = <grad_out[idx[i]], src[src_idx[i]]>`` (fp32), 0 for skipped entries."""
    src_idx, idx, weight, mask, src = ctx.saved_tensors
    weight = weight if ctx.has[0] else None
    R = grad_out.shape[0]
    keep = (idx >= 0) & (idx < R)
    if ctx.has[1]:
        keep = keep & mask
    idx_sorted, src_idx_sorted = ctx.flags
    safe = torch.where(keep, idx, 0)
    grad_src = grad_weight = None
    if ctx.needs_input_grad[0]:
        grad_src = _GATHER_SEGMENT_SUM(grad_out, safe, src_idx, ctx.src_rows, weight, keep, src_idx_sorted, idx_sorted)
    if weight is not None and ctx.needs_input_grad[4]:
        acc = torch.float64 if grad_out.dtype == torch.float64 else torch.float32
        dots = (grad_out.index_select(0, safe).to(acc) * src.index_select(0, torch.where(keep, src_idx, 0)).to(acc)
                ).sum(-1)
        grad_weight = torch.where(keep, dots, torch.zeros((), dtype=acc, device=dots.device)).to(weight.dtype)
    return grad_src, None, None, None, grad_weight, None, None, None, None


_gather_segment_sum_op.register_autograd(_gather_backward, setup_context=_gather_setup_context)
_GATHER_SEGMENT_SUM = torch.ops.moe.gather_segment_sum.default


def gather_segment_sum(src_SD: Tensor, src_idx_N: Tensor, idx_N: Tensor, num_rows: int,
                       weight_N: Tensor | None = None, mask_N: Tensor | None = None, *, idx_sorted: bool = False,
                       src_idx_sorted: bool = False, debug: bool = False) -> Tensor:
    """``out[r] = sum of weight[i] * src[src_idx[i]]`` over the entries ``i`` with ``idx[i] == r`` (and ``mask[i]``),
    in a fixed order (``torch.ops.moe.gather_segment_sum``): :func:`segment_sum` of gathered, weighted rows without
    materialising them. A gather-and-weight of rows into slots (a capacity dispatch) and a gather-and-sum of slots
    into tokens (its combine) are both this op; each one's backward (w.r.t. ``src``) is the other.

    Args:
        src_SD: ``[S, D]`` float rows.
        src_idx_N: ``[N]`` integer source row of each entry, in ``[0, S)`` where not masked out.
        idx_N: ``[N]`` integer output row of each entry; entries outside ``[0, num_rows)`` are skipped.
        num_rows: ``R`` (a plain int: it sizes the output).
        weight_N: optional ``[N]`` float weight of each entry (multiplied in the accumulator dtype).
        mask_N: optional ``[N]`` bool; entries with ``False`` are skipped (their indices are not read).
        idx_sorted: ``idx`` is non-decreasing (every entry, masked or not): no sort; entries summed in order.
        src_idx_sorted: ``src_idx`` is non-decreasing: the backward's sum needs no sort.
        debug: on CUDA, device-side asserts of the index ranges and of ``idx_sorted`` (no host sync). On CPU
            they are checked on the host.

    Returns:
        ``[R, D]`` tensor of ``src_SD.dtype`` (fp32 accumulation for 16-bit floats, fp64 for fp64).

    Raises:
        ValueError: wrong dtype/rank/shape/device, or (CPU) indices out of range / ``idx`` not sorted where
            ``idx_sorted``. Messages name the argument.
    """
    _check_gather_args(src_SD, src_idx_N, idx_N, num_rows, weight_N, mask_N, idx_sorted, src_idx_sorted, debug)
    return _GATHER_SEGMENT_SUM(src_SD, src_idx_N, idx_N, num_rows, weight_N, mask_N, idx_sorted, src_idx_sorted,
                               debug)


# ===== segments of distinct-within-group entries: a table and a prefix sum instead of a sort =====

# cells of the [rows, groups] presence table above which segment_sum_by_groups sorts instead
MAX_GROUP_TABLE = 1 << 26


def _check_groups(idx_N: Tensor, group_N: Tensor, num_groups: int) -> None:
    _common.check_int_tensor(group_N, "group_N", 1)
    if group_N.shape[0] != idx_N.shape[0]:
        raise ValueError(f"group_N must have one entry per entry of idx_N: group_N.shape={tuple(group_N.shape)}, "
                         f"idx_N.shape={tuple(idx_N.shape)}")
    _common.check_count(num_groups, "num_groups")


def group_order(idx_N: Tensor, num_rows: int, group_N: Tensor, num_groups: int,
                mask_N: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The entries of :func:`segment_sum_by_groups` sorted by ``(idx, group)`` without a sort: ``(entry_N,
    idx_sorted_N)``, each position's entry and its ``idx`` (non-decreasing; skipped entries last, keyed
    ``num_rows``), the index pair ``moe.gather_segment_sum(src, entry_N, idx_sorted_N, num_rows, idx_sorted=True)``
    sums by. ``idx_N`` distinct within each group where kept; a ``[num_rows, num_groups]`` presence table (a scatter
    of ``True``: every writer writes the same value) and its prefix sum give each kept entry its position, one scatter
    to those (distinct) positions sorts the entries. Entries with ``idx`` outside ``[0, num_rows)``, or ``False`` in
    ``mask_N``, are skipped."""
    _common.check_int_tensor(idx_N, "idx_N", 1)
    _common.check_count(num_rows, "num_rows")
    _check_groups(idx_N, group_N, num_groups)
    cells = num_rows * num_groups
    N, device = idx_N.shape[0], idx_N.device
    ok_N = (idx_N >= 0) & (idx_N < num_rows)
    if mask_N is not None:
        ok_N = ok_N & mask_N
    cell_N = idx_N.to(torch.int64) * num_groups + group_N.to(torch.int64)
    present = torch.zeros(cells + 1, dtype=torch.bool, device=device).scatter(
        0, torch.where(ok_N, cell_N, cells), True)[:cells]
    position = torch.cumsum(present, 0) - 1  # of each present cell among the sorted entries
    kept = present.sum()
    skipped_rank_N = torch.cumsum(~ok_N, 0) - 1  # skipped entries go last, keyed num_rows
    dest_N = torch.where(ok_N, position.index_select(0, torch.where(ok_N, cell_N, 0)), kept + skipped_rank_N)
    entry_N = torch.zeros(N, dtype=torch.int64, device=device).scatter(
        0, dest_N, torch.arange(N, device=device, dtype=torch.int64))
    idx_sorted_N = torch.zeros(N, dtype=torch.int64, device=device).scatter(
        0, dest_N, torch.where(ok_N, idx_N.to(torch.int64), num_rows))
    return entry_N, idx_sorted_N


def segment_sum_by_groups(src_ND: Tensor, idx_N: Tensor, num_rows: int, group_N: Tensor,
                          num_groups: int, mask_N: Tensor | None = None) -> Tensor:
    """:func:`segment_sum` of entries that come in ``num_groups`` groups, no two entries of one group with the same
    ``idx`` (each expert's top-``C`` tokens in expert-choice routing): each row's entries summed in ascending group
    order (fp32 accumulation), ordered by :func:`group_order` (no sort) and summed by ``moe.gather_segment_sum``.

    Bitwise :func:`segment_sum` wherever the groups are consecutive runs of entries (ascending group order is then
    ascending entry order). Entries with ``idx`` outside ``[0, num_rows)``, or ``False`` in ``mask_N``, are skipped.
    Float ``src`` only; beyond ``MAX_GROUP_TABLE`` cells (or for integer ``src``) it is :func:`segment_sum` (a sort,
    entry order).

    Args:
        src_ND: ``[N, D]`` float rows.
        idx_N: ``[N]`` integer output row of each entry, distinct within each group.
        num_rows: ``R``.
        group_N: ``[N]`` integer group of each entry, in ``[0, num_groups)``.
        num_groups: ``G``.
        mask_N: optional ``[N]`` bool; entries with ``False`` are skipped (distinct or not).
    """
    _check_args(src_ND, idx_N, num_rows, mask_N)
    _check_groups(idx_N, group_N, num_groups)
    if not src_ND.is_floating_point() or num_rows * num_groups > MAX_GROUP_TABLE:
        return segment_sum(src_ND, idx_N, num_rows, mask_N)
    entry_N, idx_sorted_N = group_order(idx_N, num_rows, group_N, num_groups, mask_N)
    return gather_segment_sum(src_ND, entry_N, idx_sorted_N, num_rows, idx_sorted=True)
