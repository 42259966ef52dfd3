"""``fuse_expert_loop``'s entry point, :func:`run`: the pass as the package docstring states it."""

from __future__ import annotations

import torch.fx as fx

from moe_compile.passes import NoMatch, PassContext
from moe_compile.passes._graph import (
    arg,
    is_call,
    layer_name,
    op_name,
    outside_users,
    topo_index,
    transitive_users,
)
from moe_compile.passes._host_sync import erase_dead_host_reads
from moe_compile.passes.fuse_expert_loop.loop import (
    GEMMS,
    Loop,
    rewrite_loop,
    signatures,
)
from moe_compile.passes.fuse_expert_loop.selection_loop import (
    canonicalize,
    find_selection_loops,
)


def run(graph: fx.Graph, ctx: PassContext) -> None:
    """Fuse every provable per-expert loop of ``graph`` (see the module docstring)."""
    splits = [n for n in graph.nodes if op_name(n) in ("split", "split_with_sizes") and _host_sized(n)]
    fused = False
    for split in splits:
        if split.graph is not graph:
            continue
        layer = layer_name(split)
        try:
            loop = _match_loop(split)
        except NoMatch as skip:
            if skip.reason != "loop_not_matched" or _has_gemm_per_chunk(split):
                ctx.skip(layer, skip.reason, skip.detail)
            continue
        if not any(op_name(n) in GEMMS for n in loop.bodies[0]):
            continue  # e.g. a per-group pad: not an expert loop (strip_host_padding's business)
        try:
            _, slots = signatures(loop)
            replaced_by = rewrite_loop(graph, loop, slots)
        except NoMatch as skip:
            ctx.skip(layer, skip.reason, skip.detail)
            continue
        ctx.rewrite(layer, f"split -> {len(loop.chunks)} expert copies -> cat", replaced_by)
        fused = True
    for out, selections in find_selection_loops(graph):
        layer = layer_name(selections[0].acc)
        try:
            replaced_by = canonicalize(graph, out, selections)
        except NoMatch as skip:
            ctx.skip(layer, skip.reason, skip.detail)
            continue
        ctx.rewrite(layer, f"{len(selections)} x (where(expert mask) -> expert copy -> index_add_)", replaced_by)
    if fused:
        erase_dead_host_reads(graph)


def _chunks(split: fx.Node) -> list[fx.Node] | None:
    sizes = split.args[1] if len(split.args) > 1 else arg(split, "split_size_or_sections")
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if not isinstance(sizes, (list, tuple)) or len(sizes) < 2 or dim != 0:
        return None
    chunks: dict[int, fx.Node] = {}
    for u in split.users:
        if not (is_call(u, "getitem") and isinstance(u.args[1], int)) or u.args[1] in chunks:
            return None
        chunks[u.args[1]] = u
    if sorted(chunks) != list(range(len(sizes))):
        return None
    return [chunks[i] for i in range(len(sizes))]


def _match_loop(split: fx.Node) -> Loop:
    chunks = _chunks(split)
    if chunks is None:
        raise NoMatch("loop_not_matched", f"{split.name}: not a split into indexed chunks")
    reach = transitive_users(chunks[0])
    cats = [n for n in reach if is_call(n, "cat") and arg(n, "dim", default=0) == 0]
    order = topo_index(split.graph)
    if not cats:
        raise NoMatch("loop_not_matched", f"{split.name}: the chunks do not meet in a cat")
    cat = min(cats, key=order.__getitem__)
    outputs = list(cat.args[0])
    if len(outputs) != len(chunks) or not all(isinstance(o, fx.Node) for o in outputs):
        raise NoMatch("loop_not_matched", f"{cat.name}: {len(outputs)} pieces for {len(chunks)} chunks")
    bodies = []
    for e, (chunk, out) in enumerate(zip(chunks, outputs)):
        forward = transitive_users(chunk) | {chunk}
        if out not in forward:
            raise NoMatch("loop_not_matched", f"{cat.name}: piece {e} is not computed from chunk {e}")
        body, stack = set(), [out]
        while stack:
            n = stack.pop()
            if n in body or n is chunk:
                continue
            body.add(n)
            stack.extend(a for a in n.all_input_nodes if a in forward)
        for other, other_chunk in enumerate(chunks):
            if other != e and other_chunk in body:
                raise NoMatch("loop_not_matched", f"expert {e}'s output depends on chunk {other}")
        ordered = sorted(body, key=order.__getitem__)
        for n in ordered + [chunk]:
            allowed = body | ({cat} if n is out else set())
            bad = outside_users([n], allowed)
            if bad:
                raise NoMatch("expert_region_escapes", f"{n.name} (expert {e}) is also used by {bad[0].name}")
        bodies.append(ordered)
    return Loop(split, split.args[0], cat, bodies, chunks, outputs)


def _host_sized(split: fx.Node) -> bool:
    sizes = split.args[1] if len(split.args) > 1 else arg(split, "split_size_or_sections")
    return isinstance(sizes, (list, tuple)) and any(isinstance(s, fx.Node) for s in sizes)


def _has_gemm_per_chunk(split: fx.Node) -> bool:
    """True when the chunks of ``split`` feed GEMMs (an expert loop we could not match): worth a record."""
    chunks = _chunks(split) or []
    return bool(chunks) and all(any(op_name(n) in GEMMS for n in transitive_users(c)) for c in chunks[:2])
