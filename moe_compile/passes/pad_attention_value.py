"""With ``deterministic=True``: attention whose value head dim is smaller than the query's runs as flash attention.

Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, LongCat-Flash) has a query/key head dim of 192 and a
value head dim of 128. FlashAttention takes only equal head dims, so SDPA runs the memory-efficient kernel,
whose deterministic backward is several times slower than its default one (and than flash's deterministic
one). Zero columns appended to the value change nothing in the first ``Dv`` columns of the output (each
output column is ``softmax(q k^T) @ v[:, c]`` on its own, and the softmax scale is taken from the query):
the output is sliced back and the padded value's gradient columns are dropped by the pad's backward.

Matches (Dynamo's graph, after ``causal_mask``: no mask left, or none there)::

    o = scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, ...)   # q, k [.., Dqk], v [.., Dv]

Rewrites to::

    v_pad = pad(v, (0, Dqk - Dv))                                                    # [.., Dqk]
    o = scaled_dot_product_attention(q, k, v_pad, attn_mask=None, dropout_p=0.0, ...)[..., :Dv]

Skips when (reason tags): ``masked`` (an ``attn_mask`` is left: flash would not run anyway), ``dropout``,
``head_dim_too_large`` (``Dqk`` above flash's 256), ``symbolic_shape`` (a head dim that is not a number).
Equal head dims and ``Dv > Dqk`` are no match (nothing recorded).

Stage:
    pre_grad (Dynamo's Torch IR), after ``causal_mask``: before AOTAutograd picks the SDPA kernel.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from moe_compile.passes import NoMatch, PassContext
from moe_compile.passes._graph import graph_call, known_int, layer_name, refresh_example_values, tensor_val
from moe_compile.passes.forms.ops import SDPA, sdpa_args

# the largest head dim FlashAttention-2 (and torch's SDPA flash backend) takes
FLASH_MAX_HEAD_DIM = 256


def run(graph: fx.Graph, ctx: PassContext) -> None:
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not SDPA:
            continue
        args = sdpa_args(node)
        q, v = tensor_val(args["query"]), tensor_val(args["value"])
        if q is None or v is None or q.dim() < 1 or v.dim() < 1:
            continue
        d_qk, d_v = known_int(q.shape[-1]), known_int(v.shape[-1])
        try:
            if d_qk is None or d_v is None:
                raise NoMatch("symbolic_shape", f"head dims {q.shape[-1]} / {v.shape[-1]}")
            if d_v >= d_qk:
                continue
            _check(args, d_qk)
        except NoMatch as skip:
            ctx.skip(layer_name(node), skip.reason, skip.detail)
            continue
        with graph.inserting_before(node):
            padded = graph_call(graph, F.pad, args["value"], (0, d_qk - d_v), meta_from=node)
        node.replace_input_with(args["value"], padded)
        refresh_example_values([node])
        with graph.inserting_after(node):
            sliced = graph_call(graph, torch.narrow, node, -1, 0, d_v, meta_from=node)
        node.replace_all_uses_with(sliced, delete_user_cb=lambda user: user is not sliced)
        ctx.rewrite(layer_name(node), f"scaled_dot_product_attention(value head dim {d_v} < {d_qk})",
                    f"scaled_dot_product_attention(value zero-padded to {d_qk})[..., :{d_v}] (flash: deterministic "
                    "backward)", moe=False)


def _check(args: dict, d_qk: int) -> None:
    if args.get("attn_mask") is not None:
        raise NoMatch("masked", "an attn_mask is left (flash takes none): value not padded")
    if args.get("dropout_p", 0.0) != 0.0:
        raise NoMatch("dropout", f"dropout_p={args.get('dropout_p')}")
    if d_qk > FLASH_MAX_HEAD_DIM:
        raise NoMatch("head_dim_too_large", f"query head dim {d_qk} > {FLASH_MAX_HEAD_DIM} (flash's largest)")
