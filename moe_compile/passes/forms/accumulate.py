"""What an accumulating scatter looks like in ATen graphs, when its indices provably never collide, and
which library ops are non-deterministic (:data:`NONDETERMINISTIC_OPS`).

One table for every pass and check that needs it (:mod:`~moe_compile.passes.deterministic_accumulate`
rewrites these nodes; :mod:`moe_compile.passes.audit` reports the ones left). Each row of
:data:`ACCUMULATING_FORMS` reads one op's ``(base, dim, index, src)``; extend the table to teach every
user a new spelling.

Distinct indices (:func:`distinct_along`) are proven from where the index comes from, never from its
values: the indices of a ``topk`` or of a ``sort`` / ``argsort`` along the scatter's dim are a choice of
distinct positions in every slice, through integer casts and clones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from moe_compile.passes._graph import arg, known_int, op_name, tensor_val

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class Accumulate:
    """``base`` with ``src`` added at ``index`` along ``dim`` (``index`` is a 1-D tensor over ``dim`` for
    ``index_put`` / ``index_add``, an index of ``src``'s shape for ``scatter_add``)."""

    node: fx.Node
    kind: str  # "index_put" | "scatter_add" | "index_add"
    base: Any
    dim: int
    index: Any
    src: Any


def _index_put(node: fx.Node) -> Accumulate | None:
    if not arg(node, 3, "accumulate", False):
        return None
    indices = arg(node, 1, "indices")
    if not isinstance(indices, (list, tuple)) or len(indices) != 1 or not isinstance(indices[0], fx.Node):
        return None  # several index tensors (or None holes): not a row scatter we reason about
    return Accumulate(node, "index_put", node.args[0], 0, indices[0], arg(node, 2, "values"))


def _scatter_add(node: fx.Node) -> Accumulate | None:
    return Accumulate(node, "scatter_add", node.args[0], int(arg(node, 1, "dim")), arg(node, 2, "index"),
                      arg(node, 3, "src"))


def _index_add(node: fx.Node) -> Accumulate | None:
    if arg(node, 4, "alpha", 1) != 1:
        return None
    return Accumulate(node, "index_add", node.args[0], int(arg(node, 1, "dim")), arg(node, 2, "index"),
                      arg(node, 3, "source"))


# op -> reader of (base, dim, index, src); None from a reader means "accumulates, but not in a form we read"
ACCUMULATING_FORMS: dict[Any, Callable[[fx.Node], Accumulate | None]] = {
    aten.index_put.default: _index_put,
    aten.index_put_.default: _index_put,
    aten._unsafe_index_put.default: _index_put,
    aten.scatter_add.default: _scatter_add,
    aten.scatter_add_.default: _scatter_add,
    aten.index_add.default: _index_add,
    aten.index_add_.default: _index_add,
}


def is_accumulating(node: fx.Node) -> bool:
    """Whether ``node`` adds into a tensor at computed indices (atomic adds once Inductor lowers it)."""
    if node.op != "call_function":
        return False
    if node.target in (aten.index_put.default, aten.index_put_.default, aten._unsafe_index_put.default):
        return bool(arg(node, 3, "accumulate", False))
    if node.target in ACCUMULATING_FORMS:
        return True
    if node.target in (aten._index_put_impl_.default, aten.put.default, aten.put_.default):
        return bool(arg(node, 3 if "index_put" in str(node.target) else 2, "accumulate", False))
    return node.target in _ALWAYS_ACCUMULATING


# ops that always add at computed indices (Inductor: atomic adds on the GPU)
_ALWAYS_ACCUMULATING = {
    aten.scatter_reduce.two, aten.scatter_reduce_.two, aten.index_reduce.default, aten.index_reduce_.default,
    aten.embedding_dense_backward.default,
    # what Inductor's decompositions turn the embedding backward into
    aten._unsafe_masked_index_put_accumulate.default,
}


@dataclasses.dataclass(frozen=True)
class Nondeterministic:
    """A library kernel that is not bitwise reproducible run to run (Inductor calls it, it does not
    generate it): ``why`` in a few words, ``devices`` where it is (None: every device)."""

    why: str
    devices: frozenset[str] | None = frozenset({"cuda"})


# (deterministic=True calls these two with torch's deterministic flag on: passes/deterministic_attention.py)
_FLASH_BWD = Nondeterministic("FlashAttention backward: dQ accumulated with atomic adds")
_EFFICIENT_BWD = Nondeterministic("memory-efficient attention backward: atomic adds")
_CUDNN_BWD = Nondeterministic("cuDNN attention backward: non-deterministic algorithm")

# Known non-deterministic library ops, by ``op_name`` (``"aten.<name>"``; names, so that an op a torch
# version lacks costs nothing). Accumulating scatters are not listed: :func:`is_accumulating` knows them,
# and :mod:`moe_compile.passes.deterministic_scatter` rewrites them. Extend the table to teach the audit
# (``nondeterministic`` leftovers) a new op.
NONDETERMINISTIC_OPS: dict[str, Nondeterministic] = {
    "aten._scaled_dot_product_flash_attention_backward": _FLASH_BWD,
    "aten._flash_attention_backward": _FLASH_BWD,
    "aten._scaled_dot_product_efficient_attention_backward": _EFFICIENT_BWD,
    "aten._efficient_attention_backward": _EFFICIENT_BWD,
    "aten._scaled_dot_product_cudnn_attention_backward": _CUDNN_BWD,
    "aten._cudnn_attention_backward": _CUDNN_BWD,
    "aten._scaled_dot_product_fused_attention_overrideable_backward":
        Nondeterministic("backend-defined fused attention backward: no determinism guarantee", None),
    "aten._embedding_bag_dense_backward": Nondeterministic("embedding_bag backward: atomic adds"),
    "aten._embedding_bag_per_sample_weights_backward": Nondeterministic("embedding_bag backward: atomic adds"),
    "aten.grid_sampler_2d_backward": Nondeterministic("grid_sampler backward: atomic adds"),
    "aten.grid_sampler_3d_backward": Nondeterministic("grid_sampler backward: atomic adds"),
    "aten._ctc_loss_backward": Nondeterministic("CTC loss backward: atomic adds"),
    "aten.histc": Nondeterministic("histc: atomic adds of float counts"),
}


def nondeterministic_reason(node: fx.Node) -> str | None:
    """Why ``node`` (a library op in :data:`NONDETERMINISTIC_OPS`) is not reproducible on its device, else
    None. A node whose device is unknown (no tensor value) counts as on every device."""
    if node.op != "call_function":
        return None
    entry = NONDETERMINISTIC_OPS.get(op_name(node) or "")
    if entry is None:
        return None
    if entry.devices is not None:
        device = _device_of(node)
        if device is not None and device not in entry.devices:
            return None
    return entry.why


def _device_of(node: fx.Node) -> str | None:
    for value in torch.utils._pytree.tree_leaves((tensor_val(node), [tensor_val(a) for a in node.all_input_nodes])):
        if isinstance(value, torch.Tensor) and value.device.type != "meta":
            return value.device.type
    return None


def read(node: fx.Node) -> Accumulate | None:
    reader = ACCUMULATING_FORMS.get(node.target) if node.op == "call_function" else None
    return reader(node) if reader is not None else None


# ops that keep every index value (int casts, copies)
_VALUE_PRESERVING = {"aten.clone", "aten._to_copy", "prims.convert_element_type", "aten.alias"}
_INT_DTYPES = (torch.int16, torch.int32, torch.int64)


def _strip_copies(node: Any) -> Any:
    while isinstance(node, fx.Node) and op_name(node) in _VALUE_PRESERVING and node.args:
        out = tensor_val(node)
        if out is None or out.dtype not in _INT_DTYPES:
            return node
        node = node.args[0]
    return node


def _norm_dim(dim: Any, ndim: int) -> int | None:
    if isinstance(dim, bool) or not isinstance(dim, int):
        return None
    return dim + ndim if dim < 0 else dim


def distinct_along(index: Any, dim: int) -> bool:
    """True when ``index`` holds distinct values in every slice along ``dim`` (so a scatter-add with it
    never adds two values into one element): the indices output of ``topk`` / ``sort`` / ``argsort``
    taken along ``dim``, or any index of size 1 along ``dim``."""
    node = _strip_copies(index)
    if not isinstance(node, fx.Node):
        return False
    out = tensor_val(index)
    if out is None or out.dim() == 0:
        return False
    want = _norm_dim(dim, out.dim())
    if want is not None and want < out.dim() and known_int(out.shape[want]) == 1:
        return True  # one index per slice (a top-1 / max selection): nothing to collide with
    name = op_name(node)
    if name == "getitem" and node.args[1] == 1 and isinstance(node.args[0], fx.Node):
        producer = node.args[0]
        pname = op_name(producer)
        if pname == "aten.topk":
            src_dim = arg(producer, 2, "dim", -1)
        elif pname == "aten.sort":
            src_dim = arg(producer, 1, "dim", -1) if producer.target != aten.sort.stable else \
                producer.kwargs.get("dim", -1)
        else:
            return False
        src = tensor_val(producer.args[0])
        if src is None or src.dim() != out.dim():
            return False
        return _norm_dim(src_dim, src.dim()) == want
    return False


# ops whose output values are values of their first argument (moved, repeated, sorted or left out): a property of
# every value of the input (each is a routing choice) holds for every value of the output
_VALUE_MOVING = {"aten.view", "aten.reshape", "aten._unsafe_view", "aten.expand", "aten.squeeze", "aten.unsqueeze",
                 "aten.permute", "aten.t", "aten.transpose", "aten.slice", "aten.select", "aten.index", "aten.gather",
                 "aten.repeat", "aten.repeat_interleave", "aten.contiguous", "aten.flatten"}
# the positions these ops pick along ``dim`` of their input: (the getitem index of the positions, or None for the
# output itself; the position of ``dim`` in the op's arguments; its default)
_CHOOSERS = {"aten.topk": (1, 2, -1), "aten.max": (1, 1, None), "aten.argmax": (None, 1, None),
             "aten.sort": (1, 1, -1)}


def routing_choice(index: Any, rows: int) -> bool:
    """True when every value of ``index`` is a position that a ``topk`` / ``max`` / ``argmax`` / ``sort`` picked
    along a dim of ``rows`` candidates (a router's expert ids: top-k over ``E`` scores), through value-moving views
    and gathers, integer casts, ``sort`` values and a clamp to ``[0, rows)``.

    What :mod:`~moe_compile.passes.deterministic_accumulate`'s one-hot rule asks of an index into a ``rows``-row
    table: a table gathered by such an index is a per-expert tensor (``bias_EN[ids]``), and its backward an expert
    dispatch's; a table gathered by the user's own indices (an embedding) is not.
    """
    node = _strip_copies(index)
    seen = 0
    while isinstance(node, fx.Node) and seen < 64:
        seen += 1
        name = op_name(node)
        if name in _VALUE_MOVING and node.args:
            node = _strip_copies(node.args[0])
        elif name in ("aten.clamp", "aten.clamp_min", "aten.clamp_max") and _clamps_into(node, rows):
            node = _strip_copies(node.args[0])
        elif name == "getitem" and isinstance(node.args[0], fx.Node) and op_name(node.args[0]) in _CHOOSERS:
            producer, which = node.args[0], node.args[1]
            if op_name(producer) == "aten.sort" and which == 0:  # the sorted values: the same values
                node = _strip_copies(producer.args[0])
                continue
            return which == _CHOOSERS[op_name(producer)][0] and _chooses_among(producer, rows)
        elif name == "aten.argmax":
            return _chooses_among(node, rows)
        else:
            return False
    return False


def _chooses_among(chooser: fx.Node, rows: int) -> bool:
    """Whether ``chooser`` (a :data:`_CHOOSERS` op) picks along a dim of exactly ``rows`` entries."""
    _, dim_pos, default = _CHOOSERS[op_name(chooser)]
    src = tensor_val(chooser.args[0])
    dim = chooser.kwargs.get("dim", chooser.args[dim_pos] if len(chooser.args) > dim_pos else default)
    if src is None or src.dim() == 0:
        return False
    if dim is None:  # argmax over the flattened input
        return src.dim() == 1 and known_int(src.shape[0]) == rows
    d = _norm_dim(dim, src.dim())
    return d is not None and d < src.dim() and known_int(src.shape[d]) == rows


def _clamps_into(node: fx.Node, rows: int) -> bool:
    """A clamp of ids to ``[0, rows - 1]`` or a part of it: the identity on routing choices."""
    name = op_name(node)
    low = arg(node, 1, "min") if name in ("aten.clamp", "aten.clamp_min") else None
    high = arg(node, 2, "max") if name == "aten.clamp" else arg(node, 1, "max") if name == "aten.clamp_max" else None
    return all(b is None or (isinstance(b, int) and 0 <= b <= rows - 1) for b in (low, high)) and \
        (low is None or low <= 0) and (high is None or high >= rows - 1)


def adds_at_most_once(node: fx.Node) -> bool:
    """A ``scatter_add`` whose index is distinct along its dim (:func:`distinct_along`): every element of the
    result takes at most one add, so no order of adds (atomic ones included) changes a bit. Such a node needs
    no rewrite for determinism, and a rewrite into another form can change its bits under Inductor's fusion
    (NOTE [one add into a live tensor])."""
    a = read(node)
    return a is not None and a.kind == "scatter_add" and distinct_along(a.index, a.dim)


def order_dependent(node: fx.Node) -> bool:
    """An accumulation whose bits can depend on the order of its adds: what the audit reports and
    ``deterministic_scatter`` rewrites (every accumulation but one that adds at most once per element)."""
    return is_accumulating(node) and not adds_at_most_once(node)


# NOTE [one add into a live tensor]: ``scatter_add(base, d, idx, src)`` with ``idx`` distinct along ``d`` (PhiMoE's
# router backward: ``(masked_gates * -g).scatter_add_(-1, selected_experts, g)``) is not rewritten. As
# ``scatter(base, d, idx, gather(base, d, idx) + src)`` it computes the same values in eager, but Inductor fuses
# the gather with base's producer and adds in fp32 without rounding base to its dtype first, where its own
# scatter_add stores base (rounded) and adds to that: PhiMoE's router gradient, exactly zero in eager and in plain
# Inductor (``-1 * g + g``), came out as bf16 rounding residue. Its atomic adds add once per element: reproducible.


def is_zeros(node: Any) -> bool:
    """A freshly created all-zero tensor (``full(..., 0)``, ``zeros``, ``new_zeros``, ``zeros_like``)."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    if node.target in (aten.zeros.default, aten.new_zeros.default, aten.zeros_like.default):
        return True
    if node.target in (aten.full.default, aten.new_full.default):
        fill = arg(node, 1, "fill_value") if node.target == aten.full.default else arg(node, 2, "fill_value")
        return not isinstance(fill, bool) and fill == 0
    if node.target == aten.full_like.default:
        fill = arg(node, 1, "fill_value")
        return not isinstance(fill, bool) and fill == 0
    return False


__all__ = [
    "ACCUMULATING_FORMS", "NONDETERMINISTIC_OPS", "Accumulate", "Nondeterministic", "adds_at_most_once",
    "distinct_along", "is_accumulating", "is_zeros", "nondeterministic_reason", "order_dependent", "read",
    "routing_choice",
]
