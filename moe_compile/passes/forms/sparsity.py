"""How many entries of a tensor can be non-zero, read from how it is computed (Dynamo's Torch IR).

:func:`nonzeros` bounds the non-zero entries in every slice of a node's value over a set of its axes (the other
axes fixed): a routing tensor ``[T, E, C]`` that is a sum of ``K`` one-hot products has at most ``K`` per token over
``{e, c}``, however it was spelled. The bound is proven from the ops, never from values:

* sources: ``one_hot`` (1 along its class axis), ``a == arange`` with ``a`` broadcast along the arange's axis
  (1: the arange's values are distinct), a ``scatter`` into zeros (as many per slice as the index writes), zeros;
* products (``mul``, ``bmm`` / ``matmul`` / ``einsum`` that contract nothing): the least of the factors' bounds,
  and their product where the factors' axes are disjoint (an outer product of two one-hots has 1);
* sums (``add``, ``sub``): the sum of the bounds; ``sum`` over axes: the summand's bound over those axes too;
* ``where(c, x, 0)``, ``masked_fill(x, m, 0)``, casts, ``bool()``, ``x != 0``, ``x > 0``, ``abs``, ``neg``: no more
  than ``x``; views, permutes, ``unsqueeze`` / ``squeeze``, ``expand``, basic indexing: the axes followed.

Anything else is bounded by the slice's size. The zeros counted are structural: they come from integer or boolean
tensors and from fresh zeros, so no gradient flows through them (``d(w * m)/dw = m = 0`` where ``m`` is 0).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch.fx as fx

from moe_compile.passes._graph import aliased_inputs, arg, einsum_terms, op_name, written_args
from moe_compile.passes._graph import static_shape as shape_of
from moe_compile.passes.forms.ops import CASTS, is_zeros

Axes = frozenset[int]

# ops whose value is non-zero only where their (first) argument is
_ZERO_KEEPING = CASTS | {"bool", "abs", "neg", "relu", "square", "sign", "clone", "detach", "contiguous",
                         "float", "half", "bfloat16", "double", "long", "int"}
_VIEWS = frozenset({"view", "reshape", "flatten", "unflatten", "view_as", "reshape_as", "ravel"})
_PERMUTES = frozenset({"permute", "transpose", "t", "movedim", "swapaxes", "swapdims"})
_MULS = frozenset({"mul", "mul_", "logical_and", "and", "bitwise_and"})
_ADDS = frozenset({"add", "add_", "sub", "sub_", "logical_or", "or", "bitwise_or"})


def nonzeros(node: Any, axes: Iterable[int], memo: dict | None = None, at: fx.Node | None = None) -> int | None:
    """A proven upper bound on the non-zero entries of ``node``'s value, as ``at`` reads it (default: after the
    graph), in every slice over ``axes`` (the other axes fixed); None when its shape is not static."""
    shape = shape_of(node)
    if shape is None:
        return None
    cols = frozenset(a % len(shape) for a in axes) if shape else frozenset()
    return _bound(node, cols, {} if memo is None else memo, at)


def _size(shape: tuple[int, ...], axes: Iterable[int]) -> int:
    return math.prod(shape[a] for a in axes)


def _bound(node: Any, cols: Axes, memo: dict, at: fx.Node | None) -> int:
    """The bound of ``node``'s value as the node ``at`` reads it."""
    shape = shape_of(node)
    if shape is None:
        return _scalar_bound(node)
    trivial = _size(shape, cols)
    key = (node, cols, at)
    if key not in memo and isinstance(node, fx.Node):
        written = _writes_between(node, at, memo)
        if written:  # read after in-place writes: the last write's value, where nothing else aliases the tensor
            last = written[-1]
            memo[key] = _bound(last, cols, memo, at) if _only_writers(node, memo) and shape_of(last) == shape \
                else trivial
    if key not in memo:
        memo[key] = trivial  # cycles cannot happen in a DAG; this also caps the recursion's cost
        try:
            found = _rule(node, shape, cols, memo)
        except (TypeError, ValueError, IndexError):
            found = None
        memo[key] = trivial if found is None else min(trivial, found)
    return memo[key]


def _writes_between(node: fx.Node, at: fx.Node | None, memo: dict) -> list[fx.Node]:
    """The in-place ops after ``node`` and before ``at`` that write into its storage (through the views and in-place
    ops that alias it), in graph order: ``at`` reads another value than ``node``'s op computed where there are any
    (``z = zeros(..); z.scatter_(..); use(z)``)."""
    if "aliases" not in memo:
        memo["aliases"] = _alias_classes(node.graph)
    order, cls_of, writers, _ = memo["aliases"]
    end = order.get(at, len(order)) if at is not None else len(order)
    return [w for w in writers.get(cls_of.get(node), ()) if order[node] < order[w] < end]


def _only_writers(node: fx.Node, memo: dict) -> bool:
    """True when every alias of ``node`` is ``node`` or an in-place op on it (no view shares its storage)."""
    _, cls_of, writers, members = memo["aliases"]
    cls = cls_of.get(node)
    return set(members.get(cls, ())) <= {node, *writers.get(cls, ())}


def _alias_classes(graph: fx.Graph) -> tuple[dict, dict, dict, dict]:
    """``(position, class of each node, in-place writers of each class, members of each class)``: nodes joined
    through views (:func:`~moe_compile.passes._graph.aliased_inputs`) and the arguments in-place ops write
    (:func:`~moe_compile.passes._graph.written_args`)."""
    parent: dict[fx.Node, fx.Node] = {}

    def find(n: fx.Node) -> fx.Node:
        while parent.get(n, n) is not n:
            n = parent[n]
        return n

    order = {n: i for i, n in enumerate(graph.nodes)}
    written = {n: [a for a in written_args(n) if isinstance(a, fx.Node)] for n in graph.nodes
               if n.op in ("call_function", "call_method")}
    for n in graph.nodes:
        if n.op in ("call_function", "call_method"):
            for a in aliased_inputs(n) + written[n]:
                parent[find(n)] = find(a)
    cls_of = {n: find(n) for n in graph.nodes}
    writers: dict[fx.Node, list[fx.Node]] = {}
    members: dict[fx.Node, list[fx.Node]] = {}
    for n in graph.nodes:
        members.setdefault(cls_of[n], []).append(n)
        if written.get(n):
            writers.setdefault(cls_of[n], []).append(n)
    return order, cls_of, writers, members


def _scalar_bound(value: Any) -> int:
    if isinstance(value, (int, float, bool)):
        return 0 if value == 0 else 1
    return 1


def _rule(node: fx.Node, shape: tuple[int, ...], cols: Axes, memo: dict) -> int | None:  # noqa: C901, PLR0911
    if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method"):
        return None
    name = op_name(node)
    x = node.args[0] if node.args else None
    if is_zeros(node):
        return 0
    if name == "one_hot":
        last = len(shape) - 1
        return _size(shape, cols - {last}) if last in cols else None
    if name in ("scatter", "scatter_"):
        return _scatter(node, shape, cols, memo)
    if name == "eq":
        return _eq(node, shape, cols)
    if name in _ZERO_KEEPING:
        return _bound(x, cols, memo, node) if shape_of(x) == shape else None
    if name in ("ne", "gt") and len(node.args) == 2 and node.args[1] == 0:
        return _bound(x, cols, memo, node)
    if name in _MULS:
        return _product(shape, cols, [(a, _right_aligned(a, shape)) for a in node.args[:2]], memo, node)
    if name in _ADDS:
        return sum(_broadcast_bound(a, _right_aligned(a, shape), shape, cols, memo, node) for a in node.args[:2])
    if name == "where" and len(node.args) == 3:
        cond, a, b = node.args
        if _scalar_zero(b):
            operands = [(cond, _right_aligned(cond, shape)), (a, _right_aligned(a, shape))]
            return _product(shape, cols, operands, memo, node)
        return sum(_broadcast_bound(v, _right_aligned(v, shape), shape, cols, memo, node) for v in (a, b))
    if name in ("masked_fill", "masked_fill_") and _scalar_zero(arg(node, 2, "value")):
        return _broadcast_bound(x, _right_aligned(x, shape), shape, cols, memo, node)
    if name in ("bmm", "matmul", "einsum"):
        operands = _outer_operands(node, shape)
        return None if operands is None else _product(shape, cols, operands, memo, node)
    if name == "sum":
        return _sum(node, shape, cols, memo)
    in_shape = shape_of(x)
    if in_shape is None:
        return None
    mapping = _axis_map(node, name, in_shape, shape)
    if mapping is None:
        return None
    in_cols, factor = mapping(cols)
    return _bound(x, in_cols, memo, node) * factor


def _scalar_zero(value: Any) -> bool:
    return isinstance(value, (int, float, bool)) and value == 0 or is_zeros(value)


# ----- broadcasting: each operand axis is the output axis it lines up with, or None (a size-1 / missing axis) -----

def _right_aligned(operand: Any, out_shape: tuple[int, ...]) -> list[int | None] | None:
    """For each output axis, the operand's axis that holds it (None where the operand broadcasts); None for a
    scalar."""
    op_shape = shape_of(operand)
    if op_shape is None:
        return None
    lead = len(out_shape) - len(op_shape)
    out: list[int | None] = []
    for i, size in enumerate(out_shape):
        j = i - lead
        out.append(j if j >= 0 and (op_shape[j] == size or size == 1) else None)
    return out


def _broadcast_bound(operand: Any, align: list[int | None] | None, out_shape: tuple[int, ...], cols: Axes,
                     memo: dict, node: fx.Node) -> int:
    """The operand's bound over the output slice: its own axes among ``cols``, times the axes it broadcasts over."""
    if align is None:
        return _scalar_bound(operand) * _size(out_shape, cols)
    own = frozenset(align[c] for c in cols if align[c] is not None)
    spread = _size(out_shape, [c for c in cols if align[c] is None])
    return _bound(operand, own, memo, node) * spread


def _product(out_shape: tuple[int, ...], cols: Axes, operands: list[tuple[Any, list[int | None] | None]],
             memo: dict, node: fx.Node) -> int:
    """Non-zero only where every factor is: the least factor bound; or, the axes of ``cols`` that several factors
    hold taken one value at a time, the product of the factors' bounds over the axes each holds alone."""
    best = min(_broadcast_bound(a, al, out_shape, cols, memo, node) for a, al in operands)
    holders: dict[int, int] = {}
    for _, al in operands:
        for c in cols:
            if al is not None and al[c] is not None:
                holders[c] = holders.get(c, 0) + 1
    shared = [c for c in cols if holders.get(c, 0) > 1]
    total = _size(out_shape, [c for c in cols if c not in holders]) * _size(out_shape, shared)
    for a, al in operands:
        if al is None:
            total *= _scalar_bound(a)
            continue
        own = frozenset(al[c] for c in cols if al[c] is not None and c not in shared)
        total *= _bound(a, own, memo, node)
    return min(best, total)


def _outer_operands(node: fx.Node, shape: tuple[int, ...]) -> list[tuple[Any, list[int | None]]] | None:
    """A ``bmm`` / ``matmul`` over a contracted size of 1, or an ``einsum`` that contracts nothing, as the product
    of its operands broadcast to the output: ``[(operand, alignment)]``; None for a real contraction."""
    name = op_name(node)
    if name == "einsum":
        spec = einsum_terms(node)
        if spec is None or len(spec[0]) != 2 or any(ch not in spec[1] for term in spec[0] for ch in term):
            return None
        ins, out, operands = spec
        return [(a, [term.index(ch) if ch in term else None for ch in out]) for a, term in zip(operands, ins)]
    a, b = node.args[:2]
    sa, sb = shape_of(a), shape_of(b)
    if sa is None or sb is None or len(sa) != 3 or len(sb) != 3 or sa[2] != 1 or sb[1] != 1 or len(shape) != 3:
        return None
    return [(a, [0, 1, None]), (b, [0, None, 2])]


def _scatter(node: fx.Node, shape: tuple[int, ...], cols: Axes, memo: dict) -> int | None:
    base, dim, index = node.args[0], arg(node, 1, "dim"), arg(node, 2, "index")
    idx_shape = shape_of(index)
    if not isinstance(dim, int) or idx_shape is None or arg(node, 5, "reduce") is not None:
        return None
    dim %= len(shape)
    if dim not in cols:
        return None
    written = idx_shape[dim] * _size(shape, cols - {dim})
    return written + _bound(base, cols, memo, node)


def _eq(node: fx.Node, shape: tuple[int, ...], cols: Axes) -> int | None:
    """``a == r`` with ``r`` an arange along one output axis that ``a`` broadcasts over: one match per slice along
    that axis."""
    if len(node.args) != 2:
        return None
    for r, a in (node.args, node.args[::-1]):
        axis = _arange_axis(r, shape)
        if axis is None or axis not in cols:
            continue
        align = _right_aligned(a, shape)
        if align is None or align[axis] is None:
            return _size(shape, cols - {axis})
    return None


def _arange_axis(node: Any, out_shape: tuple[int, ...]) -> int | None:
    """The output axis along which ``node`` (an ``arange`` through ``view`` / ``unsqueeze`` / ``reshape`` to a shape
    of one non-1 size) varies, its values distinct; None otherwise."""
    src = node
    while isinstance(src, fx.Node) and op_name(src) in ("view", "unsqueeze", "reshape", "to", "long", "int"):
        src = src.args[0]
    if not (isinstance(src, fx.Node) and op_name(src) == "arange"):
        return None
    shape = shape_of(node)
    if shape is None or sum(1 for s in shape if s != 1) != 1:
        return None
    align = _right_aligned(node, out_shape)
    if align is None:
        return None
    varying = [i for i, j in enumerate(align) if j is not None and shape[j] != 1]
    return varying[0] if len(varying) == 1 else None


def _sum(node: fx.Node, shape: tuple[int, ...], cols: Axes, memo: dict) -> int | None:
    x = node.args[0]
    in_shape = shape_of(x)
    dims = arg(node, 1, "dim")
    if in_shape is None or dims is None:
        return None
    dims = {d % len(in_shape) for d in (dims if isinstance(dims, (list, tuple)) else (dims,))}
    keep = bool(arg(node, 2, "keepdim", False))
    kept = list(range(len(in_shape))) if keep else [d for d in range(len(in_shape)) if d not in dims]
    in_cols = frozenset(kept[c] for c in cols) | dims
    return _bound(x, in_cols, memo, node)


# ----- axis maps of the ops that move axes: output cols -> (input cols, factor) -----

def _axis_map(node: fx.Node, name: str | None, in_shape: tuple[int, ...], shape: tuple[int, ...]):  # noqa: C901
    if name in _VIEWS:
        groups = _view_groups(in_shape, shape)
        if groups is None:
            return None

        def view(cols: Axes) -> tuple[Axes, int]:
            return frozenset(i for ins, outs in groups if cols & outs for i in ins), 1
        return view
    if name in _PERMUTES:
        order = _permutation(node, name, len(in_shape))
        if order is None:
            return None
        return lambda cols: (frozenset(order[c] for c in cols), 1)
    if name in ("unsqueeze", "squeeze", "expand", "expand_as", "broadcast_to", "getitem"):
        align = _getitem_align(node, in_shape, shape) if name == "getitem" else _right_aligned(node.args[0], shape)
        if align is None:
            return None
        if name == "squeeze":
            kept = [i for i, s in enumerate(in_shape) if s != 1]
            if len(kept) != len([s for s in shape if s != 1]):
                return None
            out_kept = [i for i, s in enumerate(shape) if s != 1]
            align = [None] * len(shape)
            for o, i in zip(out_kept, kept):
                align[o] = i
        elif name == "unsqueeze":
            d = arg(node, 1, "dim")
            if not isinstance(d, int):
                return None
            d %= len(shape)
            align = [i if i < d else (None if i == d else i - 1) for i in range(len(shape))]

        def follow(cols: Axes) -> tuple[Axes, int]:
            spread = math.prod(shape[c] for c in cols if align[c] is None or (in_shape[align[c]] == 1 != shape[c]))
            return frozenset(align[c] for c in cols if align[c] is not None), spread
        return follow
    return None


def _view_groups(a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[frozenset, frozenset]] | None:
    """Pairs of axis groups of equal size product (the minimal ones) that a view of ``a`` as ``b`` maps onto each
    other; size-1 axes join their neighbours."""
    if math.prod(a) != math.prod(b):
        return None
    groups, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        gi, gj = [i] if i < len(a) else [], [j] if j < len(b) else []
        pa = a[i] if i < len(a) else 1
        pb = b[j] if j < len(b) else 1
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb and i < len(a):
                pa *= a[i]
                gi.append(i)
                i += 1
            elif j < len(b):
                pb *= b[j]
                gj.append(j)
                j += 1
            else:
                return None
        groups.append((frozenset(gi), frozenset(gj)))
    return groups


def _permutation(node: fx.Node, name: str, ndim: int) -> list[int] | None:
    """``order[out_axis] = in_axis``."""
    args = node.args[1:]
    if name == "t":
        return list(range(ndim))[::-1] if ndim <= 2 else None
    if name in ("transpose", "swapaxes", "swapdims"):
        d0, d1 = (list(args) + [node.kwargs.get("dim0"), node.kwargs.get("dim1")])[:2]
        if not isinstance(d0, int) or not isinstance(d1, int):
            return None
        order = list(range(ndim))
        order[d0 % ndim], order[d1 % ndim] = order[d1 % ndim], order[d0 % ndim]
        return order
    if name == "permute":
        dims = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else args
        dims = dims or node.kwargs.get("dims", ())
        return [d % ndim for d in dims] if len(dims) == ndim and all(isinstance(d, int) for d in dims) else None
    if name == "movedim" and len(args) == 2 and all(isinstance(d, int) for d in args):
        order = list(range(ndim))
        src = order.pop(args[0] % ndim)
        order.insert(args[1] % ndim, src)
        return order
    return None


def _getitem_align(node: fx.Node, in_shape: tuple[int, ...], shape: tuple[int, ...]) -> list[int | None] | None:
    """Basic indexing (slices, ``None``, ``...``, ints): for each output axis the input axis it reads, or None."""
    index = node.args[1]
    items = list(index) if isinstance(index, tuple) else [index]
    if any(not (isinstance(i, (slice, int)) or i is None or i is Ellipsis) for i in items):
        return None
    if items.count(Ellipsis) > 1:
        return None
    if Ellipsis in items:
        k = items.index(Ellipsis)
        used = sum(1 for i in items if i is not None and i is not Ellipsis)
        items = items[:k] + [slice(None)] * (len(in_shape) - used) + items[k + 1:]
    items += [slice(None)] * (len(in_shape) - sum(1 for i in items if i is not None))
    align: list[int | None] = []
    src = 0
    for i in items:
        if i is None:
            align.append(None)
        elif isinstance(i, int):
            src += 1
        else:
            align.append(src)
            src += 1
    return align if len(align) == len(shape) else None


__all__ = ["nonzeros", "shape_of"]
