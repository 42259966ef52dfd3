"""With ``deterministic=True``: an attention mask that is provably causal becomes ``is_causal=True``.

Under ``torch.compile`` transformers always materialises the causal mask and passes it to SDPA as
``attn_mask``. FlashAttention takes no mask, so SDPA then runs the memory-efficient kernel (or cuDNN's,
which has no deterministic backward), whose deterministic backward is several times slower than flash's
(a deterministic Qwen3-MoE training step with the mask took nearly twice as long as one without
``deterministic``; measured at commit 77084fe). A mask built from nothing but shapes and ``arange`` (no graph
input) is a constant of the compiled graph; this pass evaluates it once and, when it is exactly the
lower-triangular mask, drops it for ``is_causal=True`` (the same attention, computed by flash).

Matches (Dynamo's graph; ``M`` has no placeholder or attribute among its ancestors, static shapes)::

    m = <arange / compare / expand ... from constants>            # [B, 1 or H, S, S], bool or additive
    o = scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=0.0, is_causal=False, ...)

Rewrites to::

    o = scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True, ...)

Skips when (reason tags): ``mask_from_inputs`` (the mask depends on a graph input, e.g. a padding
``attention_mask``), ``symbolic_shape``, ``not_causal`` (a sliding window, a packed-sequence mask that
cuts, a non-square mask), ``dropout``.

Stage:
    pre_grad (Dynamo's Torch IR): the mask and the SDPA call before AOTAutograd picks a kernel.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from moe_compile.passes import NoMatch, PassContext
from moe_compile.passes._graph import layer_name, val
from moe_compile.passes.forms.ops import SDPA, SDPA_POSITIONAL, sdpa_args


def run(graph: fx.Graph, ctx: PassContext) -> None:
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not SDPA:
            continue
        args = sdpa_args(node)
        mask = args.get("attn_mask")
        if not isinstance(mask, fx.Node) or args.get("is_causal", False):
            continue
        try:
            _check_causal(mask, args.get("dropout_p", 0.0))
        except NoMatch as skip:
            ctx.skip(layer_name(node), skip.reason, skip.detail)
            continue
        kwargs = {name: args[name] for name in args if name not in SDPA_POSITIONAL[:3]}
        kwargs.update(attn_mask=None, is_causal=True)
        node.args = (args["query"], args["key"], args["value"])
        node.kwargs = kwargs
        ctx.rewrite(layer_name(node), "scaled_dot_product_attention(attn_mask=<causal constant>)",
                    "scaled_dot_product_attention(is_causal=True) (flash: deterministic backward)", moe=False)


def _check_causal(mask: fx.Node, dropout_p) -> None:
    if dropout_p != 0.0:
        raise NoMatch("dropout", f"dropout_p={dropout_p}")
    value = _evaluate(mask)
    if value.dim() < 2 or value.shape[-1] != value.shape[-2]:
        raise NoMatch("not_causal", f"mask of shape {tuple(value.shape)} is not square")
    if value.dtype == torch.bool:
        allowed = value
    else:  # additive: 0 where allowed, -inf or the dtype's minimum where not
        allowed = value == 0
        blocked = torch.isneginf(value) | (value <= torch.finfo(value.dtype).min)
        if not bool((allowed | blocked).all()):
            raise NoMatch("not_causal", "an additive mask with values other than 0 and -inf / min")
    size = value.shape[-1]
    tril = torch.ones(size, size, dtype=torch.bool, device=value.device).tril()
    if not bool((allowed == tril).all()):
        raise NoMatch("not_causal", "the mask is not the lower-triangular one (window, packing or padding)")


def _evaluate(mask: fx.Node) -> torch.Tensor:
    """The value of ``mask`` when it is a constant of the graph (computed on its device, once)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    nodes, stack = {}, [mask]
    while stack:
        node = stack.pop()
        if node in nodes:
            continue
        if node.op in ("placeholder", "get_attr", "call_module"):
            raise NoMatch("mask_from_inputs", f"the mask depends on {node.op} {node.target}")
        example = val(node)
        if isinstance(example, torch.Tensor) and any(not isinstance(s, int) for s in example.shape):
            raise NoMatch("symbolic_shape", f"{node.name} has a symbolic shape")
        nodes[node] = None
        stack.extend(node.all_input_nodes)
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in mask.graph.nodes:  # graph order is a topological order
        if node in nodes:
            env[node] = sub.node_copy(node, lambda n: env[n])
    sub.output(env[mask])
    with unset_fake_temporarily(), torch.no_grad():
        value = fx.GraphModule(torch.nn.Module(), sub)()
    if not isinstance(value, torch.Tensor):
        raise NoMatch("not_causal", f"the mask is a {type(value).__name__}")
    return value
