"""A host pad right after ``moe.permute_pad``: the rows are already aligned, so the pad and its host sizes go.

Matches (Dynamo Torch IR), for a model that pads on the host after the fused permute (sizes from the op's
``offs_E`` or from ``ceil_div(counts, a) * a``)::

    rows_MH, _, offs_E, row_map, counts_E = moe.permute_pad(x_TH, idx_TK, probs, E, a)
    R = rows_MH[:used] | rows_MH.narrow(0, 0, used)           used == sum of the padded segments
    X = cat([F.pad(c_e, (0, 0, 0, q_e)) for c_e in split(R, sizes)])   (optional; q_e == 0 proven)
    Y = experts(X) with offs = host offsets                    row-wise, offsets == cumsum of the segments
    y = moe.unpad_unpermute(F.pad(Y, (0, 0, 0, M - used)), row_map, probs)

Rewrites to::

    Y = experts(rows_MH) with offs=offs_E
    y = moe.unpad_unpermute(Y, row_map, probs)

Sizes, pads and offsets are proven by evaluating their symbolic expressions on sample counts, as in
``strip_host_padding`` (which runs this after its own rewrites). Skips with ``pad_not_matched``,
``alignment_unsupported`` (the host pads to a larger alignment than the op's) or ``offsets_not_matched``;
a removed host pad is recorded as ``already_aligned``.
"""

from __future__ import annotations

import operator
from typing import Any

import sympy
import torch
import torch.fx as fx

from moe_compile.passes import NoMatch, PassContext
from moe_compile.passes._graph import (
    arg,
    erase_dead,
    graph_call,
    is_call,
    layer_name,
    op_name,
    refresh_example_values,
    tensor_val,
    transitive_users,
)
from moe_compile.passes._host_sync import (
    HostRead,
    IntVectorEval,
    ceil_align,
    host_reads,
    int_vector,
    leaf_vector,
    same_on_samples,
)
from moe_compile.passes.forms.rowwise import rowwise_region
from moe_compile.passes.strip_host_padding.padding import match_pad


def _permute_pad_leaves(pp: fx.Node) -> tuple[Any, list[sympy.Expr], int]:
    """Symbolic ``offs_E`` / ``counts_E`` of a ``moe.permute_pad`` node in its per-expert counts ``n_e``."""
    E, align = pp.args[3], pp.args[4]
    counts = leaf_vector(pp, E)
    padded = [ceil_align(n, align) for n in counts]
    offs = [sympy.Add(*padded[: i + 1]) for i in range(E)]

    def leaves(node: fx.Node) -> list[sympy.Expr] | None:
        if is_call(node, "getitem") and node.args[0] is pp:
            return {2: offs, 4: counts}.get(node.args[1])
        return None

    return leaves, counts, align


def _match_pad_after_permute_pad(pp: fx.Node, reads: dict[sympy.Symbol, HostRead]) -> tuple[str, dict] | None:
    """Match ``rows_MH[:used]`` -> host split + pad -> experts -> ``F.pad(y, (0, 0, 0, M - used))``."""
    outs = {u.args[1]: u for u in pp.users if is_call(u, "getitem")}
    rows, row_map = outs.get(0), outs.get(3)
    if rows is None or row_map is None:
        return None
    narrowed = [
        u for u in rows.users
        if (is_call(u, "getitem") and isinstance(u.args[1], slice) and u.args[1].start in (None, 0)
            and u.args[1].step in (None, 1) and isinstance(u.args[1].stop, fx.Node))
        or (is_call(u, "narrow") and arg(u, "dim") == 0 and arg(u, "start") == 0)
    ]
    if len(narrowed) != 1:
        return None
    R = narrowed[0]
    used = R.args[1].stop if is_call(R, "getitem") else arg(R, "length")
    pad = match_pad(R)
    X = pad.cat if pad is not None else R
    pad_back = [
        n for n in transitive_users(X)
        if is_call(n, "pad") and any(is_call(u, "moe.unpad_unpermute") and u.args[1] is row_map for u in n.users)
    ]
    if len(pad_back) != 1:
        raise NoMatch("pad_not_matched", f"{R.name}: the expert output is not padded back to the rows of {pp.name}")
    back = pad_back[0]
    Y = back.args[0]
    spec = arg(back, "pad")
    if not (isinstance(spec, (list, tuple)) and len(spec) == 4 and list(spec[:3]) == [0, 0, 0]):
        raise NoMatch("pad_not_matched", f"{back.name} is not a row pad")
    E = pp.args[3]
    middle, offs_uses, offs_nodes = rowwise_region(X, Y, E, {back})
    leaves, counts, align = _permute_pad_leaves(pp)
    ev = IntVectorEval(reads, leaves)

    def scalar(v: Any) -> sympy.Expr:
        expr = ev.scalar(v)
        if expr is None:
            raise NoMatch("pad_not_matched", f"size {v} is not an expression of {pp.name}'s outputs")
        return expr

    segments = [ceil_align(n, align) for n in counts]
    pairs = [(scalar(used), sympy.Add(*segments))]
    M = tensor_val(rows).shape[0]
    pairs.append((scalar(spec[3]) + scalar(used), sympy.Integer(M)))
    padded = segments
    if pad is not None:
        if len(pad.sizes) != E:
            raise NoMatch("pad_not_matched", f"{len(pad.sizes)} host groups for {E} experts")
        pairs += [(scalar(s), seg) for s, seg in zip(pad.sizes, segments)]
        if not same_on_samples(pairs, counts):
            raise NoMatch("pad_not_matched", f"host groups are not the segments of {pp.name}")
        if not same_on_samples([(scalar(q), sympy.Integer(0)) for q in pad.pads], counts):
            raise NoMatch(
                "alignment_unsupported", f"the host pads rows of {pp.name}(align={align}) to a larger alignment"
            )
    elif not same_on_samples(pairs, counts):
        raise NoMatch("pad_not_matched", f"{R.name} does not keep exactly the used rows of {pp.name}")
    for offs in offs_nodes:
        vec = int_vector(offs, reads, leaves)
        if vec is None or len(vec) != E or tensor_val(offs).dtype != torch.int32:
            raise NoMatch("offsets_not_matched", f"{offs.name} is not an int32 [E] expression of {pp.name}")
        expected = [sympy.Add(*padded[: i + 1]) for i in range(E)]
        if not same_on_samples(list(zip(vec, expected)), counts):
            raise NoMatch("offsets_not_matched", f"{offs.name} is not the offsets of {pp.name}")
    return "ok", dict(rows=rows, offs=outs.get(2), R=R, X=X, Y=Y, back=back, middle=middle, pad=pad,
                      offs_uses=offs_uses, offs_nodes=offs_nodes, align=align)


def strip_pad_after_permute_pad(graph: fx.Graph, ctx: PassContext) -> list[str]:
    """Remove a host pad (and the host slicing around it) that follows ``moe.permute_pad``."""
    touched = []
    for pp in [n for n in graph.nodes if op_name(n) == "moe.permute_pad"]:
        layer = layer_name(pp)
        try:
            found = _match_pad_after_permute_pad(pp, host_reads(graph))
        except NoMatch as skip:
            ctx.skip(layer, skip.reason, skip.detail)
            touched.append(layer)
            continue
        if found is None:
            continue
        m = found[1]
        offs = m["offs"]
        if offs is None:
            with graph.inserting_after(m["rows"]):
                offs = graph_call(graph, operator.getitem, pp, 2, meta_from=pp)
        for node in m["middle"]:
            node.replace_input_with(m["X"], m["rows"])
        for node in m["offs_uses"]:
            if len(node.args) > 2:
                node.update_arg(2, offs)
            else:
                node.update_kwarg("offs", offs)
        refresh_example_values(m["middle"])
        m["back"].replace_all_uses_with(m["Y"])
        graph.erase_node(m["back"])
        erase_dead(graph, [m["X"], m["R"], *m["offs_nodes"]])
        from torch._inductor.pattern_matcher import stable_topological_sort

        stable_topological_sort(graph)
        if m["pad"] is not None:
            ctx.skip(layer, "already_aligned",
                     f"rows of moe.permute_pad(align={m['align']}) are already aligned: host pad removed, "
                     "not padded again")
        ctx.rewrite(layer, "moe.permute_pad rows[:host used] + host split/pad + host offsets + pad back",
                    "rows_MH + offs_E of moe.permute_pad")
        touched.append(layer)
    return touched
