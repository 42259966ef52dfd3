"""Op-name tables for Dynamo's Torch IR (names as :func:`moe_compile.passes._graph.op_name` spells them),
shared by every pass that proves a region row-wise. One place: add an op here and every pass knows it.
"""

from __future__ import annotations

GROUPED_MM = frozenset({"_grouped_mm", "grouped_mm", "aten._grouped_mm", "transformers.grouped_mm_fallback",
                        "moe.grouped_mm"})
FLAT_VIEWS = frozenset({"reshape", "view", "flatten", "contiguous", "ravel"})
# value-preserving conversions and copies (per element)
CASTS = frozenset({"to", "float", "double", "half", "bfloat16", "type_as", "type", "contiguous", "clone", "detach",
                   "int", "long"})
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
