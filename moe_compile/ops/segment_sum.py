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

__all__ = ["segment_sum", "segment_sum_reference"]

# dtypes ``src`` may have: floats (fp32/fp64 accumulators) and integers (int64 accumulator)
SRC_DTYPES = (*_common.FLOAT_DTYPES, torch.int32, torch.int64)


# ===== reference =====


def _segments(idx_N: Tensor, num_rows: int, mask_N: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(order_N, offsets_R1)``: the stable sort permutation of the row keys (skipped entries keyed
    ``R``, after every row) and each row's segment ``[offsets[r], offsets[r + 1])`` of sorted positions."""
    key_N = idx_N.to(torch.int64)
    if mask_N is not None:
        key_N = torch.where(mask_N, key_N, num_rows)
    sorted_N, order_N = torch.sort(key_N, stable=True)
    rows_R1 = torch.arange(num_rows + 1, device=idx_N.device, dtype=torch.int64)
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


def _launch_triton(src: Tensor, idx: Tensor, num_rows: int, mask: Tensor | None, debug: bool = False, *,
                   block_d: int | None = None, block_j: int | None = None) -> Tensor:
    """Stable sort + offsets (PyTorch), then one launch over ``(R, D / BLOCK_D)`` programs."""
    from moe_compile.ops.triton import segment_sum as kernels

    N, D = _common.static_ints(*src.shape)
    out = torch.empty((num_rows, D), dtype=src.dtype, device=src.device)
    if debug:
        ok = (idx >= 0) & (idx < num_rows)
        if mask is not None:
            ok = ok | ~mask
        torch._assert_async(ok.all(), "moe.segment_sum: idx values must be in [0, num_rows) (debug=True)")
    if num_rows == 0 or D == 0:
        return out
    order, offsets = _segments(idx, num_rows, mask)
    if src.stride(1) != 1:
        src = src.contiguous()
    bd, num_warps = _common.row_block(D, src.element_size())
    bd = block_d or bd
    acc = kernels.ACC_INT64 if not src.is_floating_point() else \
        kernels.ACC_FP64 if src.dtype == torch.float64 else kernels.ACC_FP32
    _common.launch_kernel(
        kernels._segment_sum_kernel, (num_rows, _common.cdiv(D, bd)),
        src, order, offsets, out, D, _common.static_ints(src.stride(0))[0],
        ACC=acc, BLOCK_J=block_j or BLOCK_J, BLOCK_D=bd,
        traced=src.is_cuda and _common.is_traced(src), options=dict(num_warps=num_warps),
    )  # fmt: skip
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
