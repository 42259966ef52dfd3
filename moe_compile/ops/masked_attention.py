"""``torch.ops.moe.masked_attention``: SDPA under a mask tensor, with a backward in a fixed order.

Shapes: ``B`` batch, ``H`` query heads, ``Hkv`` key/value heads (``H % Hkv == 0``; query head ``h`` reads key/value
head ``h // (H / Hkv)``, SDPA's ``enable_gqa``), ``M`` queries, ``N`` keys, ``Dk`` query/key head dim, ``Dv`` value
head dim (may differ: MLA).

Contract:

* ``out = softmax(scale * q k^T + mask) v`` per batch and head, with ``mask`` a bool tensor (``True`` allows) or a
  float tensor added to the scores, broadcastable to ``[B, H, M, N]`` (SDPA's ``attn_mask``). A query row the mask
  allows nothing in gets output 0 and gradient 0 (SDPA's own rule). A float mask value whose product with ``log2(e)``
  overflows fp32 (``finfo.min``) forbids its entry, as in the CUDA kernel SDPA runs for a masked call:
  NOTE [large finite mask values] (moe_compile/ops/triton/masked_attention.py). No dropout; the mask gets no
  gradient.
* Scores, softmax and both products accumulate in fp32; ``out`` has ``q``'s dtype, laid out as SDPA's
  (``[B, M, H, Dv]`` in memory, so ``out.transpose(1, 2)`` is contiguous).
* The backward has no atomics: bitwise reproducible run to run
  (NOTE [attention backward in a fixed order] (moe_compile/ops/triton/masked_attention.py)). This is why the
  op exists: with ``deterministic=True`` a masked SDPA would run memory-efficient attention's deterministic
  backward, several times slower than its default one (``moe_compile.passes.masked_attention``).
* Static shapes, no host sync (CUDA-graph safe).

CPU (and any non-CUDA device): :func:`masked_attention_reference` and its backward, fp32 math in PyTorch. CUDA: one
Triton launch forward, two backward (``dQ``; ``dK`` and ``dV``), plus ``delta = rowsum(dO * O)`` in PyTorch. The op
is built like a ``torch.library.triton_op`` (NOTE [device-decomposed triton ops] (moe_compile/ops/_common.py)).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from moe_compile.ops import _common

__all__ = ["masked_attention", "masked_attention_backward_reference", "masked_attention_reference"]

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
REFERENCE_DTYPES = (*DTYPES, torch.float64)  # gradcheck on CPU
MAX_HEAD_DIM = 256
LOG2E = 1.4426950408889634


# ===== reference =====


def _grouped(t_BHkvND: Tensor, heads: int) -> Tensor:
    """Key/value heads repeated for the query heads that read them (``h // G``)."""
    return t_BHkvND.repeat_interleave(heads // t_BHkvND.shape[1], dim=1)


def allowed_by(mask: Tensor) -> Tensor:
    """Where a float mask allows: its value times ``log2(e)`` in fp32 is not ``-inf``:
    NOTE [large finite mask values] (moe_compile/ops/triton/masked_attention.py)."""
    return (mask.float() * LOG2E) > float("-inf")


def _scores(q: Tensor, k: Tensor, mask: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """``(s, allowed)``: ``scale q k^T + mask`` in the accumulator dtype, ``-inf`` where forbidden."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    s = torch.matmul(q.to(acc), _grouped(k, q.shape[1]).to(acc).transpose(-1, -2)) * scale
    if mask.dtype == torch.bool:
        allowed = mask.expand_as(s)
    else:  # NOTE [large finite mask values] (moe_compile/ops/triton/masked_attention.py)
        allowed = allowed_by(mask).expand_as(s)
        s = s + mask.to(acc)
    return s.masked_fill(~allowed, float("-inf")), allowed


def _softmax(s: Tensor, allowed: Tensor) -> tuple[Tensor, Tensor]:
    """``(p, stats)``: the softmax over keys (0 in rows nothing is allowed in) and ``[m, log2(l)]`` as the kernel keeps
    them, ``[2, B, H, M]`` fp32 (row max in the log2 domain, 0 in such rows;
    ``log2`` of the row sum, ``+inf`` there;
    NOTE [large finite mask values] (moe_compile/ops/triton/masked_attention.py))."""
    some = allowed.any(-1, keepdim=True)
    s2 = torch.where(allowed, s * LOG2E, float("-inf"))
    row_max = torch.where(some, s2.amax(-1, keepdim=True), 0.0)
    e = torch.exp2(s2 - row_max)
    total = torch.where(some, e.sum(-1, keepdim=True), 1.0)
    log_l = torch.where(some, torch.log2(total), float("inf"))
    return e / total, torch.stack([row_max.squeeze(-1), log_l.squeeze(-1)]).float()


def masked_attention_reference(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Pure-PyTorch forward (the CPU kernel and the test oracle): ``(out, stats)``; see the module docstring."""
    p, stats = _softmax(*_scores(q, k, mask, scale))
    out = torch.matmul(p, _grouped(v, q.shape[1]).to(p.dtype)).to(q.dtype)
    return _sdpa_layout(out), stats


def _sdpa_layout(out_BHMD: Tensor) -> Tensor:
    """The values of ``out_BHMD`` in a fresh ``[B, M, H, D]``-major tensor (SDPA's output layout)."""
    return out_BHMD.transpose(1, 2).contiguous().transpose(1, 2)


def _head_sum(t_BHND: Tensor, kv_heads: int) -> Tensor:
    """Sum the query heads of each group (``[B, H, N, D] -> [B, Hkv, N, D]``), in head order."""
    B, H, N, D = t_BHND.shape
    return t_BHND.reshape(B, kv_heads, H // kv_heads, N, D).sum(2)


def masked_attention_backward_reference(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Tensor,
                                        scale: float, out: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` by the softmax backward formulas in fp32, ``ds = p * (dp - rowsum(dO * O))``, on the forward's
    rounded ``out`` when given (as the kernels)."""
    p, _ = _softmax(*_scores(q, k, mask, scale))
    acc = p.dtype
    do = grad_out.to(acc)
    vg = _grouped(v, q.shape[1]).to(acc)
    o = out.to(acc) if out is not None else torch.matmul(p, vg)
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, vg.transpose(-1, -2))
    ds = p * (dp - (do * o).sum(-1, keepdim=True))
    dq = torch.matmul(ds, _grouped(k, q.shape[1]).to(acc)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.to(acc)) * scale
    kv_heads = k.shape[1]
    return dq.to(q.dtype), _head_sum(dk, kv_heads).to(k.dtype), _head_sum(dv, kv_heads).to(v.dtype)


# ===== validation =====


def check_args(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, dtypes=REFERENCE_DTYPES) -> None:
    """Raise ``ValueError`` naming the argument unless the shapes, dtypes and devices are ones the op takes."""
    for name, t in (("query", q), ("key", k), ("value", v)):
        _common.check_float_tensor(t, name, 4)
        if t.dtype not in dtypes:
            raise ValueError(f"{name} must have dtype in {dtypes}, got {t.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"query, key and value must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    B, H, M, Dk = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"key and value must have query's batch {B}, got {k.shape[0]} and {v.shape[0]}")
    if k.shape[1] != v.shape[1] or k.shape[1] < 1 or H % k.shape[1]:
        raise ValueError(f"key and value must have one head count dividing query's {H}, got {k.shape[1]} "
                         f"and {v.shape[1]}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"key and value must have the same length, got {k.shape[2]} and {v.shape[2]}")
    if k.shape[3] != Dk:
        raise ValueError(f"key must have query's head dim {Dk}, got {k.shape[3]}")
    if max(Dk, v.shape[3]) > MAX_HEAD_DIM:
        raise ValueError(f"head dims must be at most {MAX_HEAD_DIM}, got query {Dk}, value {v.shape[3]}")
    if not isinstance(mask, Tensor):
        raise ValueError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool and mask.dtype not in _common.FLOAT_DTYPES:
        raise ValueError(f"mask must be bool or floating point, got {mask.dtype}")
    if mask.dim() > 4 or mask.dim() < 2:
        raise ValueError(f"mask must be 2-D to 4-D (broadcastable to [B, H, M, N]), got shape {tuple(mask.shape)}")
    full = (B, H, M, k.shape[2])
    for size, want in zip(reversed(mask.shape), reversed(full)):
        if size not in (1, want):
            raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to [B, H, M, N] = {list(full)}")
    # comparisons only (Dynamo traces them; NaN fails both)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf:
        raise ValueError(f"scale must be a finite float > 0, got {scale!r}")
    _common.check_same_device(query=q, key=k, value=v, mask=mask)


# ===== Triton launchers (CUDA; also run on CPU tensors under TRITON_INTERPRET=1 in the tests) =====


def _mask_strides(mask: Tensor) -> tuple[int, int, int, int]:
    """Strides of ``mask`` seen as ``[B, H, M, N]``: 0 along the dims it broadcasts over."""
    shape = (1,) * (4 - mask.dim()) + tuple(mask.shape)
    strides = (0,) * (4 - mask.dim()) + tuple(mask.stride())
    return tuple(0 if size == 1 else int(stride) for size, stride in zip(shape, strides))


def block_ranges(mask: Tensor, M: int, N: int, block_m: int, block_n: int, by_keys: bool = False
                 ) -> tuple[Tensor, Tensor, int, int]:
    """NOTE [blocks the mask removes] (moe_compile/ops/triton/masked_attention.py): ``(lo, hi, stride_b, stride_h)``,
    int32 ``[Bm, Hm, R]`` (``Bm``/``Hm`` the mask's own batch and head sizes): for each block of queries (``R`` of
    them), the key blocks ``[lo, hi)`` between the first and the last that the mask allows anything in; with
    ``by_keys``, the same for each block of keys over the query blocks. Empty ranges are ``[0, 0)``."""
    mask4 = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    Bm, Hm = mask4.shape[0], mask4.shape[1]
    allowed = (mask4 if mask4.dtype == torch.bool else allowed_by(mask4)).expand(Bm, Hm, M, N)
    MB, NB = _common.cdiv(M, block_m), _common.cdiv(N, block_n)
    padded = torch.nn.functional.pad(allowed.to(torch.uint8), (0, NB * block_n - N, 0, MB * block_m - M))
    any_MN = padded.view(Bm, Hm, MB, block_m, NB, block_n).amax(dim=(3, 5)) > 0
    if by_keys:
        any_MN = any_MN.transpose(2, 3)
    blocks = any_MN.shape[-1]
    index = torch.arange(blocks, device=mask.device, dtype=torch.int32)
    hi = torch.where(any_MN, index + 1, 0).amax(-1).to(torch.int32)
    lo = torch.minimum(torch.where(any_MN, index, blocks).amin(-1).to(torch.int32), hi)
    rows = any_MN.shape[2]
    return lo.contiguous(), hi.contiguous(), 0 if Bm == 1 else Hm * rows, 0 if Hm == 1 else rows


def launch_plan(dk: int, dv: int, dtype: torch.dtype) -> dict:
    """Block sizes and warps per kernel: ``{"fwd" | "dq" | "dkdv": (BLOCK_M, BLOCK_N, num_warps)}`` and the dims'
    blocks. Larger head dims take smaller tiles (the fp32 accumulators live in registers). From
    ``benchmarks/bench_attention.py --sweep`` (``benchmarks/results/attention.json``; its last sweep, after these
    were measured in the training step, found ``(32, 64, 4)`` faster for dK/dV at head dim 128: not yet taken)."""
    bdk, bdv = max(16, _common.next_power_of_2(dk)), max(16, _common.next_power_of_2(dv))
    wide = max(bdk, bdv) > 128 or dtype == torch.float32
    return {
        "BLOCK_DK": bdk, "BLOCK_DV": bdv,
        "fwd": (64, 32, 4) if wide else (128, 64, 8),
        "dq": (64, 32, 4),
        "dkdv": (32, 64, 4) if wide else (64, 64, 4),
    }  # fmt: skip


def _common_args(q, k, v, mask):
    B, H, M, Dk = _common.static_ints(*q.shape)
    Hkv, N, Dv = _common.static_ints(k.shape[1], k.shape[2], v.shape[3])
    strides = (*_common.static_ints(*q.stride()), *_common.static_ints(*k.stride()), *_common.static_ints(*v.stride()),
               *_mask_strides(mask))
    return (B, H, Hkv, M, N, Dk, Dv), strides


def _ieee_dot(t: Tensor) -> bool:
    """fp32 data, or the interpreter (``_dot`` in the kernels)."""
    return t.dtype == torch.float32 or not t.is_cuda


def launch_forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, *,
                   blocks: tuple[int, int, int] | None = None) -> tuple[Tensor, Tensor]:
    """``(out, stats)`` by the forward kernel (``stats``: ``[2, B, H, M]`` fp32, the row max and ``log2`` of the row
    sum)."""
    from moe_compile.ops.triton import masked_attention as kernels

    (B, H, Hkv, M, N, Dk, Dv), strides = _common_args(q, k, v, mask)
    plan = launch_plan(Dk, Dv, q.dtype)
    bm, bn, warps = blocks or plan["fwd"]
    out = torch.empty((B, M, H, Dv), dtype=q.dtype, device=q.device).transpose(1, 2)
    stats = torch.empty((2, B, H, M), dtype=torch.float32, device=q.device)
    if B * H * M == 0:
        return out, stats
    if N == 0:  # no keys: every row is empty (row max 0, log2 of the sum +inf)
        empty = torch.zeros((B, H, M), dtype=torch.float32, device=q.device)
        return out.zero_(), torch.stack([empty, empty + float("inf")])
    lo, hi, srb, srh = block_ranges(mask, M, N, bm, bn)
    kind = kernels.MASK_BOOL if mask.dtype == torch.bool else kernels.MASK_ADDITIVE
    _common.launch_kernel(
        kernels._masked_attention_fwd_kernel, (_common.cdiv(M, bm), B * H),
        q, k, v, mask, out, stats, lo, hi, scale * LOG2E, M, N, H, H // Hkv, B * H * M, srb, srh, lo.shape[-1],
        *strides,
        *_common.static_ints(*out.stride()),
        DK=Dk, DV=Dv, MASK_KIND=kind, IEEE_DOT=_ieee_dot(q), BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_DK=plan["BLOCK_DK"], BLOCK_DV=plan["BLOCK_DV"],
        traced=q.is_cuda and _common.is_traced(q), options=dict(num_warps=warps),
    )  # fmt: skip
    return out, stats


def launch_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, out: Tensor, stats: Tensor,
                    scale: float, *, blocks_dq: tuple[int, int, int] | None = None,
                    blocks_dkdv: tuple[int, int, int] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` by the ``dQ`` kernel and the ``dK``/``dV`` kernel (no atomics)."""
    from moe_compile.ops.triton import masked_attention as kernels

    (B, H, Hkv, M, N, Dk, Dv), strides = _common_args(q, k, v, mask)
    plan = launch_plan(Dk, Dv, q.dtype)
    dq = torch.empty((B, H, M, Dk), dtype=q.dtype, device=q.device)
    G = H // Hkv
    # per query head: in the inputs' dtype when each key/value head has one, else fp32 summed over the group below
    per_head = k.dtype if G == 1 else torch.float32
    dk = torch.empty((B, H, N, Dk), dtype=per_head, device=q.device)
    dv = torch.empty((B, H, N, Dv), dtype=per_head, device=q.device)
    if B * H * M == 0 or N == 0:
        return dq.zero_(), k.new_zeros(k.shape), v.new_zeros(v.shape)
    delta = (grad_out.float() * out.float()).sum(-1).contiguous()
    stats = stats.contiguous()
    kind = kernels.MASK_BOOL if mask.dtype == torch.bool else kernels.MASK_ADDITIVE
    shared = dict(DK=Dk, DV=Dv, MASK_KIND=kind, IEEE_DOT=_ieee_dot(q), BLOCK_DK=plan["BLOCK_DK"],
                  BLOCK_DV=plan["BLOCK_DV"])
    traced = q.is_cuda and _common.is_traced(q)
    do_strides = _common.static_ints(*grad_out.stride())
    bm, bn, warps = blocks_dq or plan["dq"]
    lo, hi, srb, srh = block_ranges(mask, M, N, bm, bn)
    _common.launch_kernel(
        kernels._masked_attention_dq_kernel, (_common.cdiv(M, bm), B * H),
        q, k, v, mask, grad_out, stats, delta, dq, lo, hi, scale * LOG2E, scale, M, N, H, H // Hkv, B * H * M, srb, srh,
        lo.shape[-1], *strides, *do_strides,
        BLOCK_M=bm, BLOCK_N=bn, **shared, traced=traced, options=dict(num_warps=warps),
    )  # fmt: skip
    bm, bn, warps = blocks_dkdv or plan["dkdv"]
    lo, hi, srb, srh = block_ranges(mask, M, N, bm, bn, by_keys=True)
    _common.launch_kernel(
        kernels._masked_attention_dkdv_kernel, (_common.cdiv(N, bn), B * H),
        q, k, v, mask, grad_out, stats, delta, dk, dv, lo, hi, scale * LOG2E, scale, M, N, H, H // Hkv, B * H * M, srb,
        srh, lo.shape[-1], *strides, *do_strides,
        BLOCK_M=bm, BLOCK_N=bn, **shared, traced=traced, options=dict(num_warps=warps),
    )  # fmt: skip
    if G > 1:  # each key/value head's group of query heads, summed in head order (NOTE in the kernels)
        dk = dk.view(B, Hkv, G, N, Dk).sum(2).to(k.dtype)
        dv = dv.view(B, Hkv, G, N, Dv).sum(2).to(v.dtype)
    return dq, dk, dv


# ===== ops (NOTE [device-decomposed triton ops] (moe_compile/ops/_common.py)) =====


def _forward_body(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    if query.device.type == "cuda":
        check_args(query, key, value, mask, scale, DTYPES)
        return launch_forward(query, key, value, mask, scale)
    check_args(query, key, value, mask, scale)
    return masked_attention_reference(query, key, value, mask, scale)


def _forward_fake(query, key, value, mask, scale):
    check_args(query, key, value, mask, scale)
    B, H, M, _ = query.shape
    out = query.new_empty(B, M, H, value.shape[3]).transpose(1, 2)
    return out, query.new_empty(2, B, H, M, dtype=torch.float32)


_forward_op = _common.dispatch_triton_op(
    "moe::masked_attention",
    _forward_body,
    schema="(Tensor query, Tensor key, Tensor value, Tensor mask, float scale) -> (Tensor, Tensor)",
    fake=_forward_fake,
)


def _backward_body(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, mask: Tensor, out: Tensor,
                   stats: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    if query.device.type == "cuda":
        return launch_backward(grad_out, query, key, value, mask, out, stats, scale)
    return masked_attention_backward_reference(grad_out, query, key, value, mask, scale, out)


def _backward_fake(grad_out, query, key, value, mask, out, stats, scale):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


_backward_op = _common.dispatch_triton_op(
    "moe::masked_attention_backward",
    _backward_body,
    schema="(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor mask, Tensor out, Tensor stats, "
           "float scale) -> (Tensor, Tensor, Tensor)",
    fake=_backward_fake,
)


def _setup_context(ctx, inputs, output) -> None:
    query, key, value, mask, scale = inputs
    out, stats = output
    ctx.scale = scale
    ctx.save_for_backward(query, key, value, mask, out, stats)


def _backward(ctx, grad_out, grad_stats):
    query, key, value, mask, out, stats = ctx.saved_tensors
    if grad_out is None:
        return None, None, None, None, None
    dq, dk, dv = _BACKWARD(grad_out, query, key, value, mask, out, stats, ctx.scale)
    return dq, dk, dv, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)
_FORWARD = torch.ops.moe.masked_attention.default
_BACKWARD = torch.ops.moe.masked_attention_backward.default


# ===== public wrapper =====


def masked_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scale: float | None = None) -> Tensor:
    """``scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=True)`` with a
    backward in a fixed order (``torch.ops.moe.masked_attention``).

    Args:
        query: ``[B, H, M, Dk]``, bf16/fp16/fp32 (fp64 on CPU).
        key: ``[B, Hkv, N, Dk]``, ``H % Hkv == 0``.
        value: ``[B, Hkv, N, Dv]``.
        mask: bool (``True`` allows) or float (added to the scores), broadcastable to ``[B, H, M, N]``; no gradient.
        scale: the scores' factor, ``1 / sqrt(Dk)`` by default.

    Returns:
        ``[B, H, M, Dv]`` of ``query``'s dtype (rows the mask allows nothing in are 0).

    Raises:
        ValueError: shapes, dtypes, devices or ``scale`` the op does not take; the message names the argument.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    check_args(query, key, value, mask, scale)
    if mask.requires_grad:
        raise ValueError("mask must not require grad: masked_attention gives the mask no gradient")
    return _FORWARD(query, key, value, mask, float(scale))[0]
