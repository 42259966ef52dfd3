"""With ``deterministic=True``: attention under a mask tensor runs ``moe.masked_attention`` (no atomics).

SDPA with an ``attn_mask`` runs memory-efficient attention (flash takes no mask), whose deterministic backward is
several times slower than its default one. A mask reaches SDPA wherever ``causal_mask`` cannot prove it causal: a
padding mask, a sliding window, a packed-sequence mask, and every layer under FSDP2, whose graphs take the causal
mask as an input (its hooks break the graph between the mask and the layers). ``moe.masked_attention`` computes the
same attention with separate ``dQ`` and ``dK``/``dV`` kernels, so its backward is reproducible at full speed, and it
skips the blocks the mask removes:
NOTE [attention backward in a fixed order] (moe_compile/ops/triton/masked_attention.py).

Matches (Dynamo's graph, after ``causal_mask`` and ``pad_attention_value``)::

    o = scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=s, enable_gqa=g)
    # q [B, H, M, Dk], k [B, Hkv, N, Dk], v [B, Hkv, N, Dv]; mask bool or float, broadcastable to [B, H, M, N]

Rewrites to::

    o = moe.masked_attention(q, k, v, mask, s or 1/sqrt(Dk))[0]

Skips when (reason tags): ``dropout``, ``mask_requires_grad`` (the op gives the mask no gradient), ``dtype`` (not
bf16/fp16/fp32, or a mask neither bool nor float), ``layout`` (not 4-D, batch sizes that broadcast, key/value heads
that do not divide the query's without ``enable_gqa``, a mask that does not broadcast), ``head_dim_too_large``
(above 256), ``symbolic_shape``. SDPA without a mask is no match (nothing recorded).

Stage:
    pre_grad (Dynamo's Torch IR), last of the attention passes: before AOTAutograd picks the SDPA kernel.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from moe_compile.ops import masked_attention as op
from moe_compile.passes import NoMatch, PassContext
from moe_compile.passes._graph import graph_call, known_int, layer_name, tensor_val
from moe_compile.passes.forms.ops import SDPA, sdpa_args


def run(graph: fx.Graph, ctx: PassContext) -> None:
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not SDPA:
            continue
        args = sdpa_args(node)
        if args.get("attn_mask") is None:
            continue
        try:
            scale, shape = _check(args)
        except NoMatch as skip:
            ctx.skip(layer_name(node), skip.reason, skip.detail)
            continue
        with graph.inserting_before(node):
            call = graph_call(graph, torch.ops.moe.masked_attention.default, args["query"], args["key"],
                              args["value"], args["attn_mask"], scale, meta_from=node)
            out = graph_call(graph, operator.getitem, call, 0, meta_from=node)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        ctx.rewrite(layer_name(out), f"scaled_dot_product_attention(attn_mask {shape})",
                    "moe.masked_attention (dQ and dK/dV in separate kernels: no atomics)", moe=False)


def _check(args: dict) -> tuple[float, str]:
    """``(scale, mask description)`` of a call the op can take, or ``NoMatch``."""
    if args.get("dropout_p", 0.0) != 0.0:
        raise NoMatch("dropout", f"dropout_p={args.get('dropout_p')}")
    if args.get("is_causal", False):
        raise NoMatch("layout", "is_causal=True together with an attn_mask")
    q, k, v, mask = (tensor_val(args.get(name)) for name in ("query", "key", "value", "attn_mask"))
    if any(t is None for t in (q, k, v, mask)):
        raise NoMatch("layout", "an argument without an example tensor")
    if mask.requires_grad:
        raise NoMatch("mask_requires_grad", "the mask needs a gradient, which moe.masked_attention does not give")
    if q.dtype not in op.DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise NoMatch("dtype", f"query/key/value {q.dtype}/{k.dtype}/{v.dtype}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise NoMatch("dtype", f"mask {mask.dtype}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise NoMatch("layout", f"query/key/value of {q.dim()}/{k.dim()}/{v.dim()} dims (4 taken)")
    sizes = [known_int(s) for t in (q, k, v, mask) for s in t.shape]
    if any(s is None for s in sizes):
        raise NoMatch("symbolic_shape", "a size of query, key, value or mask is not a number")
    H, Hkv = q.shape[1], k.shape[1]
    if H != Hkv and not (args.get("enable_gqa", False) and Hkv > 0 and H % Hkv == 0):
        raise NoMatch("layout", f"{H} query heads and {Hkv} key/value heads without enable_gqa")
    if max(q.shape[-1], v.shape[-1]) > op.MAX_HEAD_DIM:
        raise NoMatch("head_dim_too_large", f"head dims {q.shape[-1]} / {v.shape[-1]} > {op.MAX_HEAD_DIM}")
    try:
        op.check_args(q, k, v, mask, 1.0, op.DTYPES)
    except ValueError as bad:
        raise NoMatch("layout", str(bad)) from None
    scale = args.get("scale")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or scale <= 0:
        raise NoMatch("layout", f"scale {scale!r} is not a positive number")
    return float(scale), f"{mask.dtype} {list(mask.shape)}"
