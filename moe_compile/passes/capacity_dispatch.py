"""Capacity-factor dispatch: einsums over a one-hot ``[T, E, C]`` dispatch tensor -> gathers of ``K`` rows per token.

GShard, Switch Transformer, DeepSpeed-MoE, fairseq and T5X give each expert a static capacity ``C`` and build a
dispatch tensor whose entry ``(t, e, c)`` is 1 where token ``t`` takes slot ``c`` of expert ``e`` (a running count by
``cumsum``; choices past ``C`` dropped). The einsums over it cost ``T*E*C*H`` multiply-adds each: quadratic in
tokens, since ``C ~ T*K/E``.

Matches (Dynamo's Torch IR; ``L`` leading dims, ``[K, T]`` or ``[T]``)::

    D_TEC = sum over the leading dims but t of terms   one_hot(P_LE, C) * f_LE1 * ...    (casts of 0/1 values)
            where one factor is one_hot(I_L, E) (the expert of each entry), the others weigh it
    x_ECH = einsum("tec,th->ech", D_TEC, x_TH)         (dispatch)
    y_TH  = einsum("tec,ech->th", G_TEC, y_ECH)         (combine: G built the same way, weighted by the gates)

Rewrites to (each term's entries ``l``: expert ``I[l]``, slot ``P[l, I[l]]``, weight ``prod f[l, I[l]]``)::

    key_N = I * C + P[.., I]; w_N = prod f[.., I]; tok_N = t of each entry           (N = prod L entries)
    x_ECH = gather_segment_sum(x_TH, tok_N, key_N, E*C, w_N).view(E, C, H)           (slot e*C+c: sum of w_n x[tok_n])
    y_TH  = gather_segment_sum(y_ECH.view(E*C, H), key_N, tok_N, T, w_N)             (token t: sum of w_n y[key_n])

Both are linear in tokens, and the result is the einsum's for any such ``D``: entries that share a slot are summed as
the einsum sums them (a slot holds one token where the positions come from a running count, which the rewrite does
not need to know). A cast of the float tensor to a narrower dtype (the combine weights to bf16) rounds each entry's
weight instead: the same where a slot holds one entry, within a rounding of the sum where several share one. A
``bool()`` of the whole sum (DeepSpeed's and fairseq's ``dispatch_mask = combine_weights.bool()``) gives each slot
weight 1 at its first entry when its entries' weights sum to non-zero, 0 otherwise: ``bool()`` of the sum exactly (a
token's ``M`` entries compared pairwise, ``T*M*M`` work for ``M`` entries per token). A slot
position outside ``[0, C)`` weighs nothing, as ``one_hot`` by comparison gives (eager
``one_hot`` would raise). No atomics, forward or backward: both are ``moe.gather_segment_sum`` (each output row the
fixed-order sum of its entries' gathered, weighted rows, accumulated in fp32 for 16-bit rows, the rows never
materialised), whose backward is the same op from the other side; the combine's entries come in token order (no
sort); entries of weight 0 (dropped choices) are skipped. Bitwise reproducible without ``deterministic=True``, and
with no host sync.

Metrics: the dispatch rewrite records ``C`` on the router's ``topk`` whose indices its expert ids come from
(``CAPACITY_META``); with ``metrics=True`` the ``router_metrics`` pass then reports the choices dropped past ``C``
(``moe/dropped_fraction``); DeepSpeed's top-2 by two ``argmax`` is marked on each, and counted as one router.

Skips when (reason tags, for einsums of the dispatch or combine shape only): ``not_one_hot`` (the ``[T, E, C]``
operand is not such a sum of one-hot terms: another op, a product of two one-hots along ``c``, an entry with no
``one_hot(I, E)`` factor, a ``bool()`` of part of the sum), ``symbolic_shape`` (``E``, ``C`` or the
leading dims not numbers).

Stage: pre-grad (the einsums and one-hots only exist in Dynamo's graph; AOTAutograd differentiates the gathers).

Seen in: ``tests/models/capacity_layers.py`` (GShard-style top-k with a capacity factor), the fuzzer's ``capacity``
dispatch (``tests/fuzz/emit_dispatch.py``).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any

import torch
import torch.fx as fx

from moe_compile.ops.segment_sum import gather_segment_sum
from moe_compile.passes import NoMatch, PassContext
from moe_compile.passes._graph import (
    einsum_terms,
    erase_dead,
    graph_call,
    layer_name,
    op_name,
    static_shape,
    tensor_val,
)
from moe_compile.passes.forms.counts import mark_capacity

_CASTS = ("to", "float", "double", "half", "bfloat16", "type_as", "type", "long", "int")
_MULS = ("mul", "mul_", operator.mul.__name__)


def run(graph: fx.Graph, ctx: PassContext) -> None:
    for node in list(graph.nodes):
        if node.op not in ("call_function", "call_method"):
            continue
        form = _equation(node)
        if form is None:
            continue
        kind, d, other = form
        try:
            shape = static_shape(d)
            if shape is None or static_shape(other) is None:
                raise NoMatch("symbolic_shape", f"{d.name}: {getattr(tensor_val(d), 'shape', None)}")
            T, E, C = shape
            terms = [_with_ids(t, E) for t in _terms(d, E, C)]
            for t in terms:
                if len(t.visible) != 1 or t.lead[t.visible[0]] != T:
                    raise NoMatch("not_one_hot", f"a term over leading dims {t.lead} does not sum to [T={T}]")
            if len({t.boolean for t in terms}) > 1:
                raise NoMatch("not_one_hot", "a sum of one-hot terms of which only some are under bool()")
        except NoMatch as skip:
            ctx.skip(layer_name(node), skip.reason, skip.detail)
            continue
        layer = layer_name(node)
        packed = [(t.ids, t.pos, t.factors, t.lead, t.visible[0], t.cast, t.boolean) for t in terms]
        with graph.inserting_before(node):
            if kind == "dispatch":
                new = graph_call(graph, capacity_dispatch, other, packed, E, C, meta_from=node)
            else:
                new = graph_call(graph, capacity_combine, other, packed, E, C, T, meta_from=node)
        if kind == "dispatch":
            for t in terms:
                mark_capacity(t.ids, C)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        erase_dead(graph, [d])
        what = "einsum('tec,th->ech')" if kind == "dispatch" else "einsum('tec,ech->th')"
        ctx.rewrite(layer, f"{what} over a one-hot [T={T}, E={E}, C={C}] {kind} tensor "
                                      f"({len(terms)} term(s) of {math.prod(terms[0].lead)} entries)",
                    f"moe_compile.passes.capacity_dispatch.capacity_{kind}: gathers, linear in T")


@dataclasses.dataclass
class _Term:
    """``D[v..., e, c] = sum over the leading dims not in visible of [I == e] * [P == c] * prod factors``."""

    ids: fx.Node  # [*L] expert of each entry
    pos: fx.Node  # broadcastable to [*L, E]: the slot along c; [*L]: one slot per entry whatever e (DeepSpeed)
    factors: list[tuple[fx.Node, bool]]  # (node, its trailing size-1 c dim still to squeeze), each [*L, E]-broadcast
    lead: tuple[int, ...]  # L
    visible: tuple[int, ...]  # the dims of L not summed away
    cast: torch.dtype | None = None  # a narrowing cast of the float tensor: each entry's weight rounded to it
    boolean: bool = False  # under a bool() of the whole sum: each slot 1 where its entries' weights sum to non-zero


def _exact_cast(node: fx.Node, src: fx.Node) -> bool:
    """A cast that keeps every value: from bool / integer values (0/1 products and small sums), or to a float of at
    least the source's precision."""
    a, b = tensor_val(src), tensor_val(node)
    if a is None or b is None:
        return False
    if not a.is_floating_point():
        return True
    return b.is_floating_point() and torch.finfo(b.dtype).bits >= torch.finfo(a.dtype).bits and \
        torch.finfo(b.dtype).eps <= torch.finfo(a.dtype).eps


def _cast_source(node: fx.Node) -> fx.Node | None:
    if op_name(node) in _CASTS and node.args and isinstance(node.args[0], fx.Node):
        return node.args[0]
    return None


def _one_hot(node: Any) -> tuple[fx.Node, int] | None:
    """``(indices, num_classes)`` of ``one_hot(indices, num_classes)``."""
    if not isinstance(node, fx.Node) or op_name(node) != "one_hot" or not isinstance(node.args[0], fx.Node):
        return None
    n = node.args[1] if len(node.args) > 1 else node.kwargs.get("num_classes")
    return (node.args[0], n) if isinstance(n, int) and n > 0 else None


def _flat_factors(node: fx.Node, squeeze: bool) -> list[tuple[fx.Node, bool]]:
    """The leaves of a product (``mul`` trees and exact casts) whose value is ``node``'s."""
    if op_name(node) in _MULS and len(node.args) == 2 and all(isinstance(a, fx.Node) for a in node.args):
        return [f for a in node.args for f in _flat_factors(a, squeeze)]
    src = _cast_source(node)
    if src is not None and _exact_cast(node, src):
        return _flat_factors(src, squeeze)
    return [(node, squeeze)]


def _plain_factor(node: fx.Node, rank: int) -> list[tuple[fx.Node, bool]]:
    """A factor of a one-hot term with no ``c`` dim of its own: ``f.unsqueeze(-1)`` or any ``[..., 1]`` tensor of
    the term's rank; its leaves, each flagged when its trailing size-1 dim must be squeezed."""
    shape = static_shape(node)
    if shape is None or len(shape) != rank or shape[-1] != 1:
        raise NoMatch("not_one_hot", f"{node.name}: a factor with a c dim of its own ({shape})")
    if op_name(node) == "unsqueeze" and node.args[1:2] in ((-1,), (rank - 1,)):
        return _flat_factors(node.args[0], squeeze=False)
    return _flat_factors(node, squeeze=True)


def _terms(node: fx.Node, E: int, C: int) -> list[_Term]:
    """``node`` (shape ``[*visible, E, C]``) as a sum of one-hot terms, or NoMatch."""
    name = op_name(node)
    src = _cast_source(node)
    value = tensor_val(node)
    to_bool = name == "bool" or (src is not None and value is not None and value.dtype == torch.bool) or \
        (name == "ne" and len(node.args) == 2 and isinstance(node.args[1], (int, float)) and node.args[1] == 0)
    if to_bool and isinstance(node.args[0], fx.Node):
        terms = _terms(node.args[0], E, C)
        if any(t.boolean for t in terms):
            raise NoMatch("not_one_hot", f"{node.name}: bool() of a sum that holds a bool() already")
        return [dataclasses.replace(t, boolean=True) for t in terms]
    if src is not None:
        terms = _terms(src, E, C)
        if _exact_cast(node, src):
            return terms
        dtype = tensor_val(node).dtype
        if not dtype.is_floating_point:
            raise NoMatch("not_one_hot", f"{node.name}: a cast of float weights to {dtype}")
        # round(sum of entries) is the rounded weight of the entry where a slot holds one entry (a running count),
        # and within a rounding of the sum where entries share one
        return [dataclasses.replace(t, cast=dtype) for t in terms]
    if name == "one_hot":
        found = _one_hot(node)
        if found is None:  # a dynamic-shape compile: C = ceil(factor * T * K / E) is a symbol
            raise NoMatch("symbolic_shape", f"{node.name}: one_hot's num_classes is not a static int")
        pos, n = found
        shape = static_shape(node)
        if n != C or shape is None or len(shape) < 3 or shape[-2] != E:
            raise NoMatch("not_one_hot", f"{node.name}: one_hot over {n} classes, shape {shape}")
        lead = shape[:-2]
        return [_Term(ids=None, pos=pos, factors=[], lead=lead, visible=tuple(range(len(lead))))]  # type: ignore
    if name == "unsqueeze" and (_one_hot(node.args[0]) or (None, None))[1] == C:
        shape = static_shape(node)
        if shape is None or len(shape) < 3 or shape[-2] != 1 or node.args[1] not in (-2, len(shape) - 2):
            raise NoMatch("not_one_hot", f"{node.name}: one_hot(P, C) unsqueezed elsewhere than before c")
        lead = shape[:-2]
        return [_Term(ids=None, pos=node.args[0].args[0], factors=[], lead=lead,  # type: ignore[arg-type]
                      visible=tuple(range(len(lead))))]
    if name in _MULS and len(node.args) == 2 and all(isinstance(a, fx.Node) for a in node.args):
        rank = len(static_shape(node) or ())
        for c_side, other in (node.args, node.args[::-1]):
            try:
                terms = _terms(c_side, E, C)
            except NoMatch:
                continue
            extra = _plain_factor(other, rank)
            return [dataclasses.replace(t, factors=t.factors + extra) for t in terms]
        raise NoMatch("not_one_hot", f"{node.name}: a product with no one-hot along c")
    if name == "add" and len(node.args) == 2 and all(isinstance(a, fx.Node) for a in node.args) \
            and node.kwargs.get("alpha", 1) == 1:
        return _terms(node.args[0], E, C) + _terms(node.args[1], E, C)
    if name == "sum" and len(node.args) >= 2 and not node.kwargs.get("keepdim", False) \
            and (len(node.args) < 3 or node.args[2] is False) and node.kwargs.get("dtype") is None:
        dims = node.args[1] if isinstance(node.args[1], (tuple, list)) else (node.args[1],)
        if not dims:
            raise NoMatch("not_one_hot", f"{node.name}: a sum over every dim")
        terms = _terms(node.args[0], E, C)
        out = []
        for t in terms:
            nvis = len(t.visible)
            if not all(isinstance(d, int) and -nvis - 2 <= d < nvis for d in dims) or \
                    any(d % (nvis + 2) >= nvis for d in dims):
                raise NoMatch("not_one_hot", f"{node.name}: a sum over e or c")
            drop = {d % (nvis + 2) for d in dims}
            out.append(dataclasses.replace(t, visible=tuple(v for i, v in enumerate(t.visible) if i not in drop)))
        return out
    raise NoMatch("not_one_hot", f"{node.name} ({name}) is not a sum of one-hot products")


def _with_ids(term: _Term, E: int) -> _Term:
    """The term with its ``one_hot(I, E)`` factor taken out as ``ids``."""
    for i, (f, squeeze) in enumerate(term.factors):
        oh = _one_hot(f if not squeeze else None)
        if oh is not None and oh[1] == E and static_shape(oh[0]) == term.lead:
            return dataclasses.replace(term, ids=oh[0], factors=term.factors[:i] + term.factors[i + 1:])
    raise NoMatch("not_one_hot", "an entry with no one_hot(ids, E) factor (its expert is not one per entry)")


def _entries(ids: torch.Tensor, pos: torch.Tensor, factors: list[tuple[torch.Tensor, bool]], lead: tuple[int, ...],
             E: int, C: int, cast: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(key_L, w_L)``: each entry's flat slot ``e*C + c`` and its weight (0 where the slot is outside ``[0, C)``);
    ``pos`` is ``[*L]`` (one slot per entry) or broadcastable to ``[*L, E]``."""
    idx = ids.unsqueeze(-1)
    p = pos.expand(lead) if pos.dim() == len(lead) else pos.expand(*lead, E).gather(-1, idx).squeeze(-1)
    w: torch.Tensor | None = None
    for f, squeeze in factors:
        f = f.squeeze(-1) if squeeze else f
        v = f.expand(*lead, E).gather(-1, idx).squeeze(-1)
        w = v if w is None else w * v
    valid = (p >= 0) & (p < C)
    w = valid if w is None else w * valid
    return ids * C + p.clamp(0, C - 1), (w if cast is None else w.to(cast))


def slots(terms: list[tuple[Any, ...]], E: int, C: int, T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(key_TM, w_TM, tok_TM)``: every term's entries as ``M`` entries per token (the term's leading dims other than
    ``t`` flattened, terms side by side). Terms under ``bool()`` (all or none of them) get 0/1 weights: 1 at the first
    entry of each slot whose entries' weights sum to non-zero, as ``bool()`` of the summed tensor gives."""
    keys, weights = [], []
    boolean = {t[-1] for t in terms}
    for ids, pos, factors, lead, t_dim, cast, _ in terms:
        key, w = _entries(ids, pos, factors, lead, E, C, cast)
        keys.append(key.movedim(t_dim, 0).reshape(T, -1))
        weights.append(w.movedim(t_dim, 0).reshape(T, -1))
    key_TM = torch.cat(keys, 1)
    w_TM = torch.cat([w.to(torch.promote_types(w.dtype, torch.float32)) for w in weights], 1)  # exact widening
    if boolean == {True}:
        same_TMM = key_TM.unsqueeze(2) == key_TM.unsqueeze(1)
        total_TM = (same_TMM * w_TM.unsqueeze(1)).sum(-1)
        M = key_TM.shape[1]
        earlier_MM = torch.ones(M, M, dtype=torch.bool, device=key_TM.device).tril(-1)
        first_TM = ~(same_TMM & earlier_MM).any(-1)
        w_TM = (total_TM != 0) & first_TM
    tok_TM = torch.arange(T, device=key_TM.device).unsqueeze(1).expand_as(key_TM)
    return key_TM, w_TM, tok_TM


def capacity_dispatch(x_TH: torch.Tensor, terms: list[tuple[Any, ...]], E: int, C: int) -> torch.Tensor:
    """``einsum("tec,th->ech", D, x)`` for ``D`` the sum of one-hot ``terms`` (see the module docstring): each slot
    the fixed-order sum of its entries' weighted token rows (``moe.gather_segment_sum``; its backward the same op
    from slots to tokens)."""
    key_TM, w_TM, tok_TM = slots(terms, E, C, x_TH.shape[0])
    w_N = w_TM.reshape(-1)
    out = gather_segment_sum(x_TH, tok_TM.reshape(-1), key_TM.reshape(-1), E * C, _entry_weight(w_N, x_TH), w_N != 0,
                             src_idx_sorted=True)
    return out.view(E, C, -1)


def capacity_combine(y_ECH: torch.Tensor, terms: list[tuple[Any, ...]], E: int, C: int, T: int) -> torch.Tensor:
    """``einsum("tec,ech->th", G, y)`` for ``G`` the sum of one-hot ``terms``: each token the fixed-order sum of its
    entries' weighted slot rows (``moe.gather_segment_sum`` over entries in token order: no sort; its backward the
    same op from tokens to slots)."""
    key_TM, w_TM, tok_TM = slots(terms, E, C, T)
    w_N = w_TM.reshape(-1)
    return gather_segment_sum(y_ECH.reshape(E * C, -1), key_TM.reshape(-1), tok_TM.reshape(-1), T,
                              _entry_weight(w_N, y_ECH), w_N != 0, idx_sorted=True)


def _entry_weight(w_N: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The entries' weights as the op multiplies them: fp32 for 16-bit rows (the einsum's accumulator), bool as 0/1."""
    acc = torch.float64 if rows.dtype == torch.float64 else torch.float32
    return w_N.to(acc)


def _equation(node: fx.Node) -> tuple[str, fx.Node, fx.Node] | None:
    """``("dispatch" | "combine", D, other)`` for an einsum of those shapes, else None."""
    spec = einsum_terms(node)
    if spec is None or len(spec[0]) != 2:
        return None
    ins, out, _ = spec
    for i in (0, 1):
        d, o = ins[i], ins[1 - i]
        if len(d) != 3 or len(set(d)) != 3:
            continue
        t, e, c = d
        if len(o) == 2 and o[0] == t and o[1] not in d and out == e + c + o[1]:
            return "dispatch", node.args[1 + i], node.args[2 - i]
        if len(o) == 3 and o[:2] == e + c and o[2] not in d and out == t + o[2]:
            return "combine", node.args[1 + i], node.args[2 - i]
    return None


__all__ = ["capacity_combine", "capacity_dispatch", "run", "slots"]
