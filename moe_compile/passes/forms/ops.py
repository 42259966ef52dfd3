"""Op-name tables for Dynamo's Torch IR (names as :func:`moe_compile.passes._graph.op_name` spells them),
shared by every pass that proves a region row-wise. One place: add an op here and every pass knows it.

Also the two Torch-IR tests built directly on them: :func:`strip_casts` and :func:`is_zeros` (a fresh
all-zero tensor; ATen IR has its own, :func:`moe_compile.passes.forms.accumulate.is_zeros`); and the attention
passes' reading of an SDPA call (:data:`SDPA`, :func:`sdpa_args`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from moe_compile.passes._graph import arg, known_int, op_name, tensor_val

GROUPED_MM = frozenset({"_grouped_mm", "grouped_mm", "aten._grouped_mm", "transformers.grouped_mm_fallback",
                        "moe.grouped_mm"})
FLAT_VIEWS = frozenset({"reshape", "view", "flatten", "contiguous", "ravel"})
# value-preserving conversions and copies (per element)
CASTS = frozenset({"to", "float", "double", "half", "bfloat16", "type_as", "type", "contiguous", "clone", "detach",
                   "int", "long"})
# the casts that keep every value of an integer index tensor (offsets, destinations): no 16-bit floats
INDEX_CASTS = CASTS - {"half", "bfloat16", "type_as"}
# elementwise ops of one tensor
UNARY = frozenset({
    "neg", "silu", "gelu", "relu", "sigmoid", "tanh", "exp", "log", "sqrt", "rsqrt", "abs", "clamp", "clamp_min",
    "clamp_max", "softplus", "leaky_relu", "elu", "hardtanh", "erf", "sin", "cos", "square", "reciprocal", "mish",
    "relu6", "hardswish", "hardsigmoid", "logsigmoid", "selu", "celu", "silu_", "relu_", "gelu_", "sigmoid_",
    "tanh_", "clamp_", "nan_to_num", "sign", "floor", "ceil", "round", "trunc", "exp2", "log1p", "expm1",
    "sinh", "cosh", "logical_not", "bitwise_not",
})
# elementwise ops of several (broadcast) tensors
BINARY = frozenset({
    "add", "sub", "mul", "truediv", "div", "pow", "maximum", "minimum", "where", "masked_fill", "add_", "sub_",
    "mul_", "div_", "truediv_", "masked_fill_", "rsub", "eq", "ne", "lt", "le", "gt", "ge", "fmod", "remainder",
    "mod", "and", "or", "logical_and", "logical_or", "bitwise_and", "bitwise_or", "lerp", "addcmul", "addcdiv",
    "copysign", "atan2", "hypot", "xlogy", "float_power",
})
REDUCTIONS = frozenset({"sum", "mean", "amax", "amin", "prod", "norm", "var", "std", "logsumexp", "max", "min", "all",
                        "any"})
# ops along one dim that keep rows apart when that dim is not the row dim
ALONG_DIM = frozenset({"softmax", "log_softmax", "glu", "normalize", "cumsum", "cumprod"})
SPLITS = frozenset({"chunk", "split", "tensor_split", "unbind", "split_with_sizes"})
LAST_DIM_SPLITS = frozenset({"chunk", "split", "unbind", "tensor_split", "narrow"})


# ``F.scaled_dot_product_attention`` as Dynamo's graph calls it, and its positional parameters
SDPA = torch._C._nn.scaled_dot_product_attention
SDPA_POSITIONAL = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")


def sdpa_args(node: fx.Node) -> dict[str, Any]:
    """An SDPA call's arguments by name (positional ones named, keywords as given)."""
    args = dict(zip(SDPA_POSITIONAL, node.args))
    args.update(node.kwargs)
    return args


def strip_casts(node: Any, casts: frozenset[str] = CASTS) -> Any:
    """``node`` through the unary ops named in ``casts`` (a ``to`` whose dtype comes from a tensor stops)."""
    while isinstance(node, fx.Node) and op_name(node) in casts and node.args:
        if op_name(node) == "to" and any(isinstance(a, fx.Node) for a in node.args[1:]):
            break
        node = node.args[0]
    return node


def is_zeros(node: Any) -> bool:
    """A freshly created all-zero tensor in Torch IR, through casts: ``zeros``, ``zeros_like``, ``new_zeros``,
    ``full`` / ``new_full`` / ``full_like`` with fill 0, ``tensor([0])``."""
    node = strip_casts(node)
    if not isinstance(node, fx.Node):
        return False
    name = op_name(node)
    if name in ("zeros", "zeros_like", "new_zeros"):
        return True
    if name in ("full", "new_full", "full_like"):
        return arg(node, 2 if name == "new_full" else 1, "fill_value") in (0, 0.0)
    if name == "tensor":
        return arg(node, 0, "data") in ([0], (0,), [0.0])
    return False


def flat_source(node: fx.Node) -> fx.Node:
    """Walk back through flatten-like views (``reshape(-1)``, ``view(-1)``, ``flatten()``)."""
    while isinstance(node, fx.Node) and op_name(node) in FLAT_VIEWS:
        src = node.args[0]
        sv = tensor_val(src)
        if sv is None or sv.numel() != tensor_val(node).numel():
            break
        node = src
    return node


# casts that keep every expert id (a router has far fewer than 2**15 experts)
_ID_DTYPES = (torch.int16, torch.int32, torch.int64)


def ids_below(ids_flat: fx.Node, num_experts: int) -> bool:
    """Whether ``ids_flat`` is provably in ``[0, E)``: through flatten views and integer casts, the indices
    of a ``topk`` along the last dim of a tensor whose last dim is ``E`` (every router's top-k)."""
    node = flat_source(ids_flat)
    while isinstance(node, fx.Node) and op_name(node) in ("to", "long", "int", "type"):
        v = tensor_val(node)
        if v is None or v.dtype not in _ID_DTYPES:
            return False
        node = node.args[0]
    if not isinstance(node, fx.Node):
        return False
    is_indices = (op_name(node) == "getitem" and node.args[1] == 1) or (
        node.op == "call_function" and node.target is getattr and node.args[1] == "indices")
    topk = node.args[0] if is_indices else None
    if not isinstance(topk, fx.Node) or op_name(topk) != "topk":
        return False
    scores = tensor_val(topk.args[0])
    if scores is None or scores.dim() == 0 or known_int(scores.shape[-1]) != num_experts:
        return False
    dim = known_int(arg(topk, 2, "dim", -1))
    return dim is not None and dim % scores.dim() == scores.dim() - 1
