"""With ``deterministic=True``: every accumulating scatter left in the joint graph becomes ``moe.segment_sum``.

Inductor lowers ``index_put(accumulate=True)`` / ``scatter_add`` / ``index_add`` and the token embedding's
backward to atomic adds on the GPU, whose order (so the rounding of float sums) changes run to run.
:mod:`~moe_compile.passes.deterministic_accumulate` removes the ones next to MoE layers that need no
accumulation or fit a one-hot GEMM; this pass takes every one that is left, anywhere in the graph, through
one deterministic op: ``moe.segment_sum(src_ND, idx_N, R, mask_N)`` (stable sort of the row indices,
segment offsets, each output row sums its segment in order; ``moe_compile/ops/segment_sum.py``).
Shapes: ``N`` entries, ``D`` columns per entry, ``R`` rows of the target.

Matches (one node each; which ops accumulate is :func:`moe_compile.passes.forms.accumulate.is_accumulating`)::

    (a) index_put(base_RD, [idx_S], values, True) / _unsafe_index_put(..., True)   (idx of any shape S; k index
        tensors for the k leading dims: one flat index)
    (b) _unsafe_masked_index_put_accumulate(base_RD, mask, [idx_S], values)       (Inductor's embedding
        backward: mask = 0 <= idx < R & idx != padding_idx, constant along D)
    (c) embedding_dense_backward(grad_SD, idx_S, R, padding_idx, scale_grad_by_freq)
    (d) index_add(base, dim, idx_N, src, alpha=a)
    (e) scatter_add(base, dim, index, src)                                       (elementwise indices)
    (f) scatter_reduce(base, dim, index, src, "sum", include_self)                 (as (e): the base included, or
                                                                                  zeros)

Rewrites to::

    (a, b) s = segment_sum(values.expand(S + D).reshape(N, D), idx.reshape(N) (negatives wrapped), R,
                           mask.reshape(N)).reshape(base)
    (c)    s = segment_sum(grad / count[idx] if scale_grad_by_freq else grad, idx, R, idx != padding_idx)
           (count = segment_sum(ones, idx, R): exact int64)
    (d)    base.movedim(dim, 0) rows: segment_sum(a * src.movedim(dim, 0).reshape(N, D), idx, R)
    (e, f) a [numel, 1] view: row of element p = its linear offset in base (index[p] along dim)
    out = s if base is fresh zeros else base + s

Fires when:
    ``config.deterministic`` is on; for every accumulation, also outside any module (the embedding) and
    integer ones (exact in any order, but atomics still), except a ``scatter_add`` that adds at most once into
    each element (indices distinct along its dim): any order gives its bits, and a rewrite could change them
    (NOTE [one add into a live tensor] (moe_compile/passes/forms/accumulate.py)).

Skips when (reason tags): ``inplace`` (an in-place form: the joint graph is functional, so not expected),
``multi_index`` (``index_put`` with ``None`` holes, or a masked put with several index tensors), ``bool_index``,
``mask_not_rowwise`` (a masked put whose mask varies along ``D``), ``symbolic_rows`` (the target's row
count is not a compile-time int: it sizes the op's output), ``dtype`` (bool / 8- and 16-bit integer
targets), ``unsupported_form`` (``scatter_reduce`` other than a sum, ``index_reduce``, ``put``: the audit lists
them).

Stage:
    joint (ATen, functional), after ``deterministic_accumulate``: the only stage that sees backward
    formulas before the partitioner; the op is inserted as one node (on CUDA Inductor calls its kernel).

Seen in:
    every transformers causal LM (``nn.Embedding`` backward); models with scatter-add combines or
    per-expert gathers the other passes do not prove.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.fx as fx

import moe_compile.ops.segment_sum  # noqa: F401 - registers moe.segment_sum
from moe_compile.passes import NoMatch, PassContext
from moe_compile.passes._graph import arg, erase_dead, insert_traced, known_int, layer_name, op_name, tensor_val
from moe_compile.passes.forms import accumulate as acc

aten = torch.ops.aten

REPLACED_BY = "moe.segment_sum (stable sort + fixed-order segment sums, no atomics)"
# the target dtypes moe.segment_sum handles (floats accumulate in fp32/fp64, integers in int64)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int32, torch.int64)
_INPLACE = {aten.index_put_.default, aten.index_add_.default, aten.scatter_add_.default}


def run(graph: fx.Graph, ctx: PassContext) -> None:
    for name, matches, rewrite in REWRITES:
        for node in list(graph.nodes):
            if not matches(node):
                continue
            layer = layer_name(node)
            try:
                detail = rewrite(graph, node)
            except NoMatch as skip:
                ctx.skip(layer, skip.reason, skip.detail)
                continue
            ctx.rewrite(layer, f"{op_name(node)} ({name})", detail, moe=False)  # deterministic=True: anywhere


# NOTE [routed accumulations]: an accumulation at indices a routing decision chose (a ``topk`` / ``sort`` /
# ``argmax`` / ``nonzero`` among the index's producers: a MoE combine ``index_add_``, a capacity buffer's
# ``index_add_`` at expert slots, the backward of a gather of routed rows) is the dispatch moe_compile promises
# without atomics, whatever its spelling: ``run_routed`` (pass ``routed_accumulate``, on by default) gives it the
# same fixed-order ``moe.segment_sum`` that ``deterministic=True`` gives every accumulation. An index that comes
# from the inputs alone (token ids: the embedding's backward) or from positions is no routing, and left to
# ``deterministic=True``.
ROUTING_CHOICES = frozenset({"aten.topk", "aten.sort", "aten.argsort", "aten.argmax", "aten.argmin", "aten.max",
                             "aten.min", "aten.nonzero", "aten.kthvalue", "aten.multinomial"})
_ROUTED_SEARCH = 4000  # producers looked at per index


def routed(index: Any) -> bool:
    """True when a routing choice (:data:`ROUTING_CHOICES`) is among the producers of ``index`` (a node or a list
    of them)."""
    seen, todo = set(), list(index) if isinstance(index, (list, tuple)) else [index]
    while todo and len(seen) < _ROUTED_SEARCH:
        node = todo.pop()
        if not isinstance(node, fx.Node) or node in seen:
            continue
        seen.add(node)
        if op_name(node) in ROUTING_CHOICES:
            return True
        todo.extend(a for a in node.all_input_nodes)
    return False


def _index_of(node: fx.Node) -> Any:
    if node.target == aten._unsafe_masked_index_put_accumulate.default:
        indices = arg(node, 2, "indices")
    elif node.target in (aten.index_put.default, aten._unsafe_index_put.default):
        indices = arg(node, 1, "indices")
    elif node.target in (aten.index_add.default, aten.scatter_add.default, aten.scatter_reduce.two):
        return arg(node, 2, "index")
    else:
        return None
    return list(indices) if isinstance(indices, (list, tuple)) else indices


def run_routed(graph: fx.Graph, ctx: PassContext) -> None:
    """Pass ``routed_accumulate``: the accumulations at routed indices (NOTE [routed accumulations]) ->
    ``moe.segment_sum``, with or without ``deterministic=True``."""
    for node in list(graph.nodes):
        if not acc.order_dependent(node) or not routed(_index_of(node)):
            continue
        layer = layer_name(node)
        try:
            symbolic = [n.name for n in (node, *node.all_input_nodes) if (v := tensor_val(n)) is not None
                        and any(known_int(d) is None for d in v.shape)]
            # on by default: a graph of symbolic sizes is left as it is (Inductor then fails on the sym_size nodes
            # the rewrite leaves as outputs: fuzz seeds 51121 (input sizes) and 2124 (sizes read from the data))
            if symbolic:
                raise NoMatch("symbolic_rows", f"{op_name(node)}: symbolic sizes in {', '.join(symbolic)}")
            detail = rewrite_accumulation(graph, node)
        except NoMatch as skip:
            ctx.skip(layer, skip.reason, skip.detail)
            continue
        ctx.rewrite(layer, f"{op_name(node)} (routed accumulate)", detail)


# ===== accumulating scatters -> moe.segment_sum =====


def _segment_sum(src_ND: torch.Tensor, idx_N: torch.Tensor, rows: int, mask_N: torch.Tensor | None = None):
    return torch.ops.moe.segment_sum.default(src_ND, idx_N, rows, mask_N)


class Lowering(NamedTuple):
    """A fixed-order lowering of the row-wise accumulations: ``sum_fn(src_ND, idx_N, rows, mask_N or None, *args)
    -> [rows, D]``, what ``explain`` says replaced them, and graph nodes the lowering reads besides the
    accumulation's own operands (``args``: a table computed once for several accumulations)."""

    sum_fn: Callable[..., torch.Tensor]
    replaced_by: str
    args: tuple[fx.Node, ...] = ()


SORTED = Lowering(_segment_sum, REPLACED_BY)


def _rows(node: Any) -> int:
    value = tensor_val(node)
    rows = known_int(value.shape[0]) if value is not None and value.dim() >= 1 else None
    if rows is None:
        raise NoMatch("symbolic_rows", f"target rows {None if value is None else tuple(value.shape)} not static")
    return rows


def _check_dtype(node: fx.Node) -> None:
    out = tensor_val(node)
    if out is None or out.dtype not in _DTYPES:
        raise NoMatch("dtype", f"{op_name(node)} into {None if out is None else out.dtype}")


def _index_put_form(node: fx.Node) -> tuple[Any, list[fx.Node], Any, Any]:
    """``(base, index nodes, values, mask or None)`` of forms (a) and (b): one index tensor per leading dim of
    ``base`` (a masked put: one)."""
    masked = node.target == aten._unsafe_masked_index_put_accumulate.default
    base = node.args[0]
    indices = arg(node, 2, "indices") if masked else arg(node, 1, "indices")
    values = arg(node, 3, "values") if masked else arg(node, 2, "values")
    if not isinstance(indices, (list, tuple)) or not indices or not all(isinstance(i, fx.Node) for i in indices) \
            or (masked and len(indices) != 1):
        raise NoMatch("multi_index", f"{op_name(node)} with indices {indices}")
    for i in indices:
        idx = tensor_val(i)
        if idx is None or idx.dtype == torch.bool or idx.is_floating_point():
            raise NoMatch("bool_index", f"{op_name(node)} with a {None if idx is None else idx.dtype} index")
    return base, list(indices), values, (arg(node, 1, "mask") if masked else None)


def _rewrite_index_put(graph: fx.Graph, node: fx.Node, lowering: Lowering = SORTED) -> str:
    """Forms (a) and (b); ``k`` index tensors (Flaxformer's ``(group, expert, slot)``) index the ``[prod of the k
    leading dims]`` rows of ``base`` by one flat index, ``sum_i idx_i * stride_i``, each wrapped where negative."""
    base, indices, values, mask = _index_put_form(node)
    k = len(indices)
    base_v = tensor_val(base)
    lead = [known_int(d) for d in base_v.shape[:k]] if base_v is not None and base_v.dim() >= k else [None]
    if None in lead:
        raise NoMatch("symbolic_rows", f"target rows {None if base_v is None else tuple(base_v.shape)} not static")
    rows, zeros = math.prod(lead), acc.is_zeros(base)
    strides = [math.prod(lead[i + 1:]) for i in range(k)]
    rest = tuple(base_v.shape[k:])
    lead_dims = 0
    if mask is not None:
        mask_v, values_v = tensor_val(mask), tensor_val(values)
        lead_dims = mask_v.dim() - len(rest)
        if mask_v.dim() != values_v.dim() or any(known_int(s) != 1 for s in mask_v.shape[max(lead_dims, 0):]):
            raise NoMatch("mask_not_rowwise", f"mask {tuple(mask_v.shape)} varies along the rows' trailing dims")

    masks = 0 if mask is None else 1  # args after the indices: the mask, then the lowering's own

    def fn(base, values, *more):
        idxs, more = more[:k], more[k:]
        maybe_mask, extra = more[:masks], more[masks:]
        idxs = torch.broadcast_tensors(*idxs) if k > 1 else idxs
        idx = sum(torch.where(i < 0, i + size, i) * stride  # index_put wraps negative indices
                  for i, size, stride in zip(idxs, lead, strides))
        n = idx.numel()
        idx_N = idx.reshape(n)
        src_ND = values.expand(*idx.shape, *rest).reshape(n, math.prod(rest))
        mask_N = maybe_mask[0].reshape(maybe_mask[0].shape[:lead_dims]).expand(idx.shape).reshape(n) \
            if maybe_mask else None
        summed = lowering.sum_fn(src_ND, idx_N, rows, mask_N, *extra).reshape(base.shape)
        return summed if zeros else base + summed

    args = (base, values, *indices) + ((mask,) if mask is not None else ()) + lowering.args
    _replace(graph, node, fn, args)
    return lowering.replaced_by + ("" if mask is None else ", masked entries skipped") + \
        (f" ({k} index tensors as one flat index)" if k > 1 else "")


def _rewrite_embedding_backward(graph: fx.Graph, node: fx.Node) -> str:
    grad, indices = node.args[0], node.args[1]
    rows = known_int(arg(node, 2, "num_weights"))
    if rows is None:
        raise NoMatch("symbolic_rows", "embedding_dense_backward with a symbolic num_weights")
    padding_idx = arg(node, 3, "padding_idx", -1)
    scale = bool(arg(node, 4, "scale_grad_by_freq", False))
    if not isinstance(padding_idx, int):
        raise NoMatch("symbolic_rows", f"embedding_dense_backward with padding_idx {padding_idx}")

    def fn(grad, indices):
        n, d = indices.numel(), grad.shape[-1]
        idx_N, grad_ND = indices.reshape(n), grad.reshape(n, d)
        if scale:  # eager divides each entry by its row's count before summing; counts are exact
            count_R = _segment_sum(torch.ones_like(idx_N).unsqueeze(1), idx_N, rows)[:, 0]
            grad_ND = grad_ND / count_R.index_select(0, idx_N.clamp(0, max(rows - 1, 0))).unsqueeze(1).to(grad.dtype)
        mask_N = idx_N != padding_idx if padding_idx >= 0 else None
        return _segment_sum(grad_ND, idx_N, rows, mask_N)

    _replace(graph, node, fn, (grad, indices))
    return REPLACED_BY + (f", padding_idx {padding_idx} skipped" if padding_idx >= 0 else "") + \
        (", scaled by 1/count" if scale else "")


def _rewrite_index_add(graph: fx.Graph, node: fx.Node, lowering: Lowering = SORTED) -> str:
    base, index, src = node.args[0], arg(node, 2, "index"), arg(node, 3, "source")
    alpha = arg(node, 4, "alpha", 1)
    base_v = tensor_val(base)
    if base_v is None or base_v.dim() == 0:
        raise NoMatch("unsupported_form", "index_add into a 0-d tensor")
    dim = int(arg(node, 1, "dim")) % base_v.dim()
    rows = known_int(base_v.shape[dim])
    if rows is None:
        raise NoMatch("symbolic_rows", f"index_add along a symbolic dim {base_v.shape[dim]}")
    zeros = acc.is_zeros(base)

    def fn(base, index, src, *extra):
        moved = base.movedim(dim, 0)
        n = index.numel()
        src_ND = src.movedim(dim, 0).reshape(n, math.prod(moved.shape[1:]))
        if alpha != 1:
            src_ND = src_ND * alpha
        summed = lowering.sum_fn(src_ND, index.reshape(n), rows, None, *extra).reshape(moved.shape).movedim(0, dim)
        return summed if zeros else base + summed

    _replace(graph, node, fn, (base, index, src) + lowering.args)
    return lowering.replaced_by


def _rewrite_scatter_add(graph: fx.Graph, node: fx.Node) -> str:
    base, index, src = node.args[0], arg(node, 2, "index"), arg(node, 3, "src")
    base_v, index_v = tensor_val(base), tensor_val(index)
    if base_v is None or index_v is None or base_v.dim() == 0:
        raise NoMatch("unsupported_form", "scatter_add into a 0-d tensor")
    shape = [known_int(s) for s in base_v.shape]
    index_shape = [known_int(s) for s in index_v.shape]
    if None in shape or None in index_shape:
        raise NoMatch("symbolic_rows", f"scatter_add into {tuple(base_v.shape)} with index {tuple(index_v.shape)}")
    dim = int(arg(node, 1, "dim")) % base_v.dim()
    strides = [math.prod(shape[k + 1:]) for k in range(len(shape))]  # of the contiguous [numel] view
    zeros = acc.is_zeros(base)

    def fn(base, index, src):
        # element p of index goes to base's linear offset sum_k coord_k * stride_k, coord_dim = index[p]
        lin = index.to(torch.int64) * strides[dim]
        for k, size in enumerate(index_shape):
            if k != dim:
                view = [size if j == k else 1 for j in range(len(index_shape))]
                lin = lin + (torch.arange(size, device=index.device) * strides[k]).view(view)
        src = src[tuple(slice(0, s) for s in index_shape)]
        n = math.prod(index_shape)
        summed = _segment_sum(src.reshape(n, 1), lin.reshape(n), math.prod(shape)).reshape(shape)
        return summed if zeros else base + summed

    _replace(graph, node, fn, (base, index, src))
    return REPLACED_BY + " (elementwise: a [numel, 1] view)"


def _rewrite_scatter_reduce(graph: fx.Graph, node: fx.Node) -> str:
    """``scatter_reduce(base, dim, index, src, "sum")``: ``scatter_add`` where the sum includes the base or the base is
    zeros (a written element is then the sum of its sources either way); other reductions are not rewritten."""
    reduce, include_self = arg(node, 4, "reduce"), arg(node, 5, "include_self", True)
    if reduce != "sum" or not (include_self or acc.is_zeros(node.args[0])):
        raise NoMatch("unsupported_form", f"scatter_reduce({reduce!r}, include_self={include_self}) has no "
                                          "deterministic lowering here")
    return _rewrite_scatter_add(graph, node) + f" (scatter_reduce 'sum'{'' if include_self else ', into zeros'})"


_FORMS: dict[Any, Callable[[fx.Graph, fx.Node], str]] = {
    aten.index_put.default: _rewrite_index_put,
    aten._unsafe_index_put.default: _rewrite_index_put,
    aten._unsafe_masked_index_put_accumulate.default: _rewrite_index_put,
    aten.embedding_dense_backward.default: _rewrite_embedding_backward,
    aten.index_add.default: _rewrite_index_add,
    aten.scatter_add.default: _rewrite_scatter_add,
    aten.scatter_reduce.two: _rewrite_scatter_reduce,
}


def rewrite_accumulation(graph: fx.Graph, node: fx.Node, lowering: Lowering | None = None) -> str:
    """Replace the accumulation ``node`` by ``moe.segment_sum``; returns the rewrite's detail, raises NoMatch (with
    this pass's reason tags) where it cannot (``expert_choice`` asks this too). ``lowering``: another fixed-order
    lowering for the row-wise forms (``index_put``, ``index_add``), where the caller knows more about the index
    (``expert_choice``: each expert's tokens are distinct)."""
    if node.target in _INPLACE:
        raise NoMatch("inplace", f"{op_name(node)}: in-place accumulation in a functional graph")
    form = _FORMS.get(node.target)
    if form is None:
        raise NoMatch("unsupported_form", f"{op_name(node)} has no deterministic lowering here")
    _check_dtype(node)
    if lowering is not None and form in (_rewrite_index_put, _rewrite_index_add):
        return form(graph, node, lowering)
    return form(graph, node)


def _replace(graph: fx.Graph, old: fx.Node, fn: Callable[..., torch.Tensor], args: tuple[Any, ...]) -> None:
    with graph.inserting_before(old):
        new = insert_traced(graph, fn, args, meta_from=old)
    old.replace_all_uses_with(new)
    erase_dead(graph, [old])


# The rewrites of this pass, in order: (name, matches(node), rewrite(graph, node) -> detail, raising NoMatch
# to skip). A deterministic replacement of a library op of ``_accumulate.NONDETERMINISTIC_OPS`` (attention
# backward) is one more row.
REWRITES: tuple[tuple[str, Callable[[fx.Node], bool], Callable[[fx.Graph, fx.Node], str]], ...] = (
    ("accumulate", acc.order_dependent, rewrite_accumulation),
)

__all__ = ["REPLACED_BY", "REWRITES", "ROUTING_CHOICES", "Lowering", "rewrite_accumulation", "routed", "run",
           "run_routed"]
