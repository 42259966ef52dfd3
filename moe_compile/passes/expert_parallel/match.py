"""The proof of one expert-parallel exchange (:func:`match_exchange`), step by step; the graph is not touched.

    1. splits     the rows exchange A's split sizes are ``.item()`` reads of device int vectors ``[W]``
    2. regroup    A's output has one reader, a row gather by a device permutation ``perm``
    3. region     from that gather, every op is row-wise (``forms.rowwise``, fuse_dispatch's policy) up to one
                  inverse ``zeros.index_copy(0, perm, y)`` (or ``zeros[perm] = y``), with grouped GEMMs
    4. return     the inverse is the input of the return exchange B, whose split sizes are A's swapped
    5. counts     the output split sizes, ``perm`` and every grouped GEMM's ``offs`` are functions of the received
                  per-expert counts ``C [W*L]`` (a counts all-to-all of static size), checked on sample counts:
                  ``C.view(W, L).sum(1)``, the (source, expert) -> (expert, source) regroup (each group's rows,
                  in any order), ``cumsum(C.view(W, L).sum(0))``
    6. bound      rows one rank sends one rank: ``N``, or ``T * min(K, L)`` when the send counts are a
                  histogram of a top-k's ids (distinct per token)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

from moe_compile.passes import NoMatch
from moe_compile.passes._graph import (
    SIZE_QUERIES,
    arg,
    known_int,
    layer_name,
    op_name,
    same_int,
    tensor_val,
)
from moe_compile.passes._host_sync import HostRead, sym_expr
from moe_compile.passes.expert_parallel.autograd_exchange import function_bodies
from moe_compile.passes.forms.counts import expert_counts, ids_base
from moe_compile.passes.forms.ops import GROUPED_MM, is_zeros
from moe_compile.passes.forms.rowwise import DISPATCH, RowwiseProof
from moe_compile.passes.fuse_dispatch.region import gather_parts

ALL_TO_ALL = frozenset({"_c10d_functional.all_to_all_single", "_c10d_functional_autograd.all_to_all_single"})
WAIT = "_c10d_functional.wait_tensor"
_FRESH = frozenset({"zeros_like", "new_zeros", "zeros"})
_SAMPLES = 16


@dataclasses.dataclass(frozen=True)
class Exchange:
    """One proven exchange: rows out by A, through a row-wise expert region, back by B."""

    layer: str
    send: fx.Node  # A: all_to_all_single(rows, out_splits, in_splits, group)
    send_waits: tuple[fx.Node, ...]  # its wait_tensor chain
    ret: fx.Node  # B
    ret_waits: tuple[fx.Node, ...]
    rows: fx.Node  # A's input [N, ...], grouped by destination rank
    num_rows: int  # N
    world: int  # W
    local: int  # L experts per rank
    send_counts: fx.Node  # [W] device vector A's input split sizes were read from
    counts: fx.Node  # C [W*L]: received counts per (source rank, local expert)
    gather: fx.Node  # recv[perm]
    perm: fx.Node
    grouped_mms: tuple[fx.Node, ...]
    offs: tuple[fx.Node, ...]  # the user's offsets, one per grouped GEMM
    region: tuple[fx.Node, ...]  # the row-wise nodes, in graph order
    inverse: fx.Node  # the node whose value is the un-regrouped rows (index_copy, or the written buffer)
    inverse_nodes: tuple[fx.Node, ...]  # the inverse and its zeros buffer (erased)
    source: fx.Node  # the region node the inverse un-regroups
    back: fx.Node  # B's input
    bound: int  # rows one rank can send one rank
    bound_why: str
    bincount: fx.Node | None  # bincount(ids, minlength=E) of the counts exchange, ids proven in [0, E)
    matched: str
    topk_ids: fx.Node | None = None  # the router top-k's ids the exchanged counts count (any count form)


def split_reads(sizes: Any, reads: dict[Any, HostRead]) -> fx.Node | None:
    """The device vector ``v [W]`` when ``sizes`` is ``[v[0].item(), ..., v[W-1].item()]``, else None."""
    if not isinstance(sizes, (list, tuple)) or not sizes:
        return None
    source = None
    for w, s in enumerate(sizes):
        read = reads.get(sym_expr(s)) if isinstance(s, fx.Node) else None
        if read is None or read.index != w or (source is not None and read.tensor is not source):
            return None
        source = read.tensor
    v = tensor_val(source)
    if v is None or v.dim() != 1 or known_int(v.shape[0]) != len(sizes) or v.is_floating_point():
        return None
    return source


def has_host_splits(node: fx.Node) -> bool:
    """An all-to-all whose split sizes are not all compile-time constants."""
    if op_name(node) not in ALL_TO_ALL:
        return False
    sizes = [arg(node, 1, "output_split_sizes"), arg(node, 2, "input_split_sizes")]
    return any(isinstance(s, (list, tuple)) and any(known_int(x) is None for x in s) for s in sizes)


def waits(node: fx.Node) -> tuple[fx.Node, ...]:
    """The chain of nodes that waits on a collective's result, the waited tensor last: ``wait_tensor`` calls (Dynamo
    may record two; ``wait_with_grad``: an autograd-function exchange made canonical), or torch 2.11's
    ``all_to_all_single_autograd``, whose autograd function waits (:func:`_wait_on_use`: the
    ``autograd_function_apply`` and its ``getitem``)."""
    chain: list[fx.Node] = []
    while len(node.users) == 1 and op_name(next(iter(node.users))) in (WAIT, "wait_with_grad"):
        node = next(iter(node.users))
        chain.append(node)
    if not chain and len(node.users) == 1:
        hop = next(iter(node.users))
        got = _wait_on_use(hop, node)
        if got is not None:
            chain += [hop, got]
    return tuple(chain)


def _wait_on_use(hop: fx.Node, tensor: fx.Node) -> fx.Node | None:
    """``getitem(hop, 0)`` when ``hop`` is an ``autograd_function_apply`` whose forward only waits on ``tensor``
    (besides grad-mode switches) and whose backward hands the gradient back unchanged (torch 2.11's
    ``_FromTorchTensor``), else None."""
    parts = function_bodies(hop)
    if parts is None:
        return None
    item, fwd, bwd, inputs = parts
    if inputs.count(tensor) != 1:
        return None
    at = inputs.index(tensor)
    fwd_in = list(fwd.graph.find_nodes(op="placeholder"))
    calls = [n for n in fwd.graph.nodes if n.op == "call_function" and n.target is not torch._C._set_grad_enabled]
    if len(fwd_in) != len(inputs) or len(calls) != 1 or op_name(calls[0]) != WAIT or calls[0].args[0] is not fwd_in[at]:
        return None
    out = fwd.graph.output_node().args[0]
    if not (isinstance(out, tuple) and out and isinstance(out[0], tuple) and out[0] == (calls[0],)):
        return None
    grad = next(iter(bwd.graph.find_nodes(op="placeholder")), None)
    bwd_out = bwd.graph.output_node().args[0]
    if grad is None or not isinstance(bwd_out, tuple) or len(bwd_out) != len(inputs) or bwd_out[at] is not grad:
        return None
    return item


def _readers(node: fx.Node) -> list[fx.Node]:
    return [u for u in node.users if op_name(u) not in SIZE_QUERIES]


def match_exchange(send: fx.Node, order: dict[fx.Node, int], reads: dict[Any, HostRead]) -> Exchange:
    """Steps 1-6 (module docstring) from the rows exchange ``send``, else raise :class:`NoMatch`."""
    out_sizes, in_sizes = arg(send, 1, "output_split_sizes"), arg(send, 2, "input_split_sizes")
    recv_sizes = split_reads(out_sizes, reads)
    send_counts = split_reads(in_sizes, reads)
    if all(isinstance(s, fx.Node) and s.op == "placeholder" for s in (*out_sizes, *in_sizes)):
        raise NoMatch("splits_are_graph_inputs", f"{send.name}'s split sizes are inputs of this graph (the body of "
                      "an autograd.Function: its call is matched in the caller's graph)")
    if recv_sizes is None or send_counts is None or len(out_sizes) != len(in_sizes):
        raise NoMatch("splits_not_host_reads", f"{send.name}'s split sizes are not .item() reads of a device "
                      "vector [W] each (counts.tolist())")
    W = len(in_sizes)
    rows = send.args[0]
    rv = tensor_val(rows)
    N = known_int(rv.shape[0]) if rv is not None and rv.dim() >= 1 else None
    if N is None:
        raise NoMatch("symbolic_rows", f"{send.name} sends {rows.name}, whose row count is not static")
    send_waits = waits(send)
    if not send_waits:
        raise NoMatch("regroup_not_matched", f"{send.name}'s result is not waited on once")
    recv = send_waits[-1]
    readers = _readers(recv)
    parts = gather_parts(readers[0]) if len(readers) == 1 and len(recv.users) == 1 else None
    if parts is None or parts[0] is not recv or not isinstance(parts[1], fx.Node):
        raise NoMatch("regroup_not_matched", f"the rows {send.name} receives are not read once, by a gather")
    gather, perm = readers[0], parts[1]
    region, grouped_mms, inverse, source, inverse_nodes = _prove_region(gather, perm, order)
    back, ret = _return_exchange(inverse, inverse_nodes, send)
    ret_waits = waits(ret)
    if not ret_waits:
        raise NoMatch("exchanges_not_paired", f"{ret.name}'s result is not waited on")
    offs = tuple(arg(mm, "offs") for mm in grouped_mms)
    if any(not isinstance(o, fx.Node) for o in offs):
        raise NoMatch("offsets_not_matched", "a grouped GEMM of the region has no device offsets")
    counts = _counts_exchange(recv_sizes, send)
    E = known_int(tensor_val(counts).numel())
    if E is None or E % W:
        raise NoMatch("counts_not_exchanged", f"{counts.name} has {E} counts, not W={W} blocks of L")
    _check_on_samples(counts, W, E // W, recv_sizes, perm, offs)
    bound, why, bincount, topk_ids = _send_bound(send_counts, counts, N, W, E // W)
    matched = (f"all_to_all_single x2 at host-read splits (W={W}, L={E // W}, N={N}) + gather by a device "
               f"permutation + row-wise region ({len(region)} ops, {len(grouped_mms)}x grouped_mm) + "
               f"{op_name(inverse_nodes[0])} by the same permutation")
    return Exchange(layer=layer_name(send), send=send, send_waits=send_waits, ret=ret, ret_waits=ret_waits, rows=rows,
                    num_rows=N, world=W, local=E // W, send_counts=send_counts, counts=counts, gather=gather,
                    perm=perm, grouped_mms=grouped_mms, offs=offs, region=region, inverse=inverse,
                    inverse_nodes=inverse_nodes, source=source, back=back, bound=bound, bound_why=why,
                    bincount=bincount, matched=matched, topk_ids=topk_ids)


# -- step 3: the region ---------------------------------------------------------------------------------------------
def _inverse_of(u: fx.Node, y: fx.Node, perm: fx.Node) -> tuple[fx.Node, tuple[fx.Node, ...]] | None:
    """``(value, nodes)`` when ``u`` un-regroups ``y`` by ``perm`` into a fresh zeros buffer of ``y``'s shape:
    ``zeros.index_copy(0, perm, y)`` (value: ``u``), ``buf[perm] = y`` / ``buf.index_put_((perm,), y)`` (value:
    the buffer)."""
    name = op_name(u)
    if name in ("index_copy", "index_copy_"):
        buf = u.args[0]
        if known_int(arg(u, 1, "dim")) == 0 and arg(u, 2, "index") is perm and arg(u, 3, "source") is y \
                and is_zeros(buf) and len(buf.users) == 1 and _same_shape(buf, y):
            return u, (u, buf)
    if name in ("setitem", "index_put_") and u.args[0] is not y:
        buf = u.args[0]
        index = u.args[1] if name == "setitem" else arg(u, 1, "indices")
        value = u.args[2] if name == "setitem" else arg(u, 2, "values")
        if name == "index_put_" and (arg(u, 3, "accumulate", False) or not isinstance(index, (list, tuple))
                                     or len(index) != 1):
            return None
        index = index[0] if isinstance(index, (list, tuple)) else index
        if index is perm and value is y and is_zeros(buf) and _same_shape(buf, y) \
                and all(w is u or order_after(w, u) for w in buf.users):
            return buf, (u, buf)
    return None


def order_after(a: fx.Node, b: fx.Node) -> bool:
    """``a`` comes after ``b`` in the graph."""
    node = b.next
    while node.op != "root":
        if node is a:
            return True
        node = node.next
    return False


def _same_shape(a: fx.Node, b: fx.Node) -> bool:
    av, bv = tensor_val(a), tensor_val(b)
    return av is not None and bv is not None and av.dim() == bv.dim() and all(
        same_int(x, y) for x, y in zip(av.shape, bv.shape))


def _prove_region(gather: fx.Node, perm: fx.Node, order: dict[fx.Node, int]) -> tuple[
        tuple[fx.Node, ...], tuple[fx.Node, ...], fx.Node, fx.Node, tuple[fx.Node, ...]]:
    """Step 3: ``(region, grouped_mms, inverse value, its source, inverse nodes)``."""
    reach: set[fx.Node] = set()
    found: list[tuple[fx.Node, fx.Node, tuple[fx.Node, ...]]] = []
    skip: set[fx.Node] = set()
    work = [gather]
    while work:
        node = work.pop()
        for u in list(node.users):
            if u in reach or u in skip:
                continue
            if u.op == "output":
                raise NoMatch("rows_escape_region", f"the regrouped rows {node.name} are a graph output")
            if op_name(u) in ALL_TO_ALL:
                raise NoMatch("inverse_not_matched", f"{node.name} reaches the all-to-all {u.name} without an "
                              "un-regroup by the same permutation (zeros.index_copy(0, perm, y) or zeros[perm] = y)")
            if op_name(u) in SIZE_QUERIES:
                raise NoMatch("region_not_rowwise", f"{u.name} reads the size of the regrouped rows {node.name}")
            inv = _inverse_of(u, node, perm)
            if inv is None and op_name(u) in _FRESH:  # zeros_like(y): the buffer of y's un-regroup
                inv = next((i for w in u.users if (i := _inverse_of(w, node, perm)) is not None), None)
            if inv is not None:
                found.append((inv[0], node, inv[1]))
                skip.update(inv[1])
                continue
            reach.add(u)
            work.append(u)
    spaces: dict[fx.Node, str] = {gather: "S"}
    prover = RowwiseProof(DISPATCH, spaces, row_independent=lambda _: False)
    region = sorted(reach, key=order.__getitem__)
    for u in region:
        sizes = [a for a in u.all_input_nodes if tensor_val(a) is None and sym_expr(a) is not None
                 and known_int(a) is None]
        if sizes:  # a size the rewrite changes (the received rows': static W*S after it)
            raise NoMatch("region_not_rowwise", f"{u.name} uses the data-dependent size {sizes[0].name}")
        spaces[u] = prover.check(u).space
    if len(found) != 1:
        raise NoMatch("inverse_not_matched", f"{len(found)} un-regroups (zeros.index_copy(0, perm, y) or "
                      "zeros[perm] = y) of the expert rows; one expected")
    grouped_mms = tuple(u for u in region if op_name(u) in GROUPED_MM)
    if not grouped_mms:
        raise NoMatch("no_grouped_gemm", "no grouped GEMM between the regroup and its inverse")
    value, source, nodes = found[0]
    return (gather, *region), grouped_mms, value, source, nodes


# -- step 4: the return exchange ------------------------------------------------------------------------------------
def _return_exchange(inverse: fx.Node, nodes: tuple[fx.Node, ...], send: fx.Node) -> tuple[fx.Node, fx.Node]:
    """``(B's input, B)``: ``inverse`` (or its ``contiguous()``) is exchanged back at A's swapped split sizes."""
    back = inverse
    readers = [u for u in _readers(back) if u not in nodes]
    if len(readers) == 1 and op_name(readers[0]) == "contiguous":
        back = readers[0]
        readers = _readers(back)
    if len(readers) != 1 or op_name(readers[0]) not in ALL_TO_ALL or readers[0].args[0] is not back:
        raise NoMatch("exchanges_not_paired", f"the un-regrouped rows {inverse.name} are not sent back by one "
                      "all-to-all")
    ret = readers[0]
    swapped = all(
        isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b)
        and all(same_int(x, y) for x, y in zip(a, b))
        for a, b in ((arg(ret, 1, "output_split_sizes"), arg(send, 2, "input_split_sizes")),
                     (arg(ret, 2, "input_split_sizes"), arg(send, 1, "output_split_sizes"))))
    if not swapped or arg(ret, 3, "group_name") != arg(send, 3, "group_name"):
        raise NoMatch("exchanges_not_paired", f"{ret.name} does not return {send.name}'s rows (split sizes not "
                      "swapped, or another group)")
    return back, ret


# -- step 5: the counts and the checks on samples ------------------------------------------------------------------
def _static_exchange(node: fx.Node) -> fx.Node | None:
    """The all-to-all of static, equal split sizes (or none) whose waited result ``node`` is."""
    base = node
    while op_name(base) == WAIT:
        base = base.args[0]
    if op_name(base) not in ALL_TO_ALL:
        return None
    for sizes in (arg(base, 1, "output_split_sizes"), arg(base, 2, "input_split_sizes")):
        static = [known_int(s) for s in sizes] if sizes is not None else []
        if None in static or len(set(static)) > 1:
            return None
    return base


def _ancestors(targets: list[fx.Node], leaf: fx.Node) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    work = list(targets)
    while work:
        n = work.pop()
        if n in seen or n is leaf:
            continue
        seen.add(n)
        work.extend(n.all_input_nodes)
    return seen


def _counts_exchange(recv_sizes: fx.Node, send: fx.Node) -> fx.Node:
    """The waited result of the counts all-to-all that ``recv_sizes`` derives from (same group as ``send``)."""
    work, seen = [recv_sizes], set()
    while work:
        n = work.pop()
        if n in seen:
            continue
        seen.add(n)
        base = _static_exchange(n)
        if base is not None and (len(n.users) != 1 or op_name(next(iter(n.users))) != WAIT):
            if arg(base, 3, "group_name") != arg(send, 3, "group_name"):
                break
            v = tensor_val(n)
            if v is not None and v.dim() == 1 and not v.is_floating_point():
                return n
            break
        work.extend(n.all_input_nodes)
    raise NoMatch("counts_not_exchanged", f"{recv_sizes.name} (the output split sizes) does not come from a counts "
                  "all-to-all of static size in the same group")


def _subgraph(targets: list[fx.Node], leaf: fx.Node) -> fx.GraphModule:
    """``targets`` as a function of ``leaf`` alone, on the CPU; raise NoMatch if they read anything else."""
    nodes = _ancestors(targets, leaf)
    g = fx.Graph()
    env = {leaf: g.placeholder("counts")}
    for n in leaf.graph.nodes:
        if n not in nodes:
            continue
        if n.op not in ("call_function", "call_method") or n.target in (torch.ops._c10d_functional.wait_tensor,) \
                or op_name(n) in ALL_TO_ALL:
            raise NoMatch("counts_not_exchanged", f"the split sizes, permutation or offsets read {n.name} "
                          "besides the received counts")
        kwargs = {k: (torch.device("cpu") if k == "device" else v) for k, v in n.kwargs.items()}
        env[n] = g.create_node(n.op, n.target, fx.node.map_arg(n.args, env.__getitem__),
                               fx.node.map_arg(kwargs, env.__getitem__))
    g.output(tuple(env[t] for t in targets))
    return fx.GraphModule(torch.nn.Module(), g)


def sample_counts(W: int, L: int) -> list[torch.Tensor]:
    """Received counts ``[W*L]`` to check the regroup on: zeros, ones, empty sources and experts, random."""
    gen = torch.Generator().manual_seed(0)
    out = [torch.zeros(W, L), torch.ones(W, L), torch.arange(W * L).view(W, L) % 3]
    skew = torch.zeros(W, L)
    skew[0, -1] = 5
    out.append(skew)
    out += [torch.randint(0, 6, (W, L), generator=gen) * (torch.rand(W, L, generator=gen) > 0.3)
            for _ in range(_SAMPLES - len(out))]
    return [c.long().flatten() for c in out]


def _check_on_samples(counts: fx.Node, W: int, L: int, recv_sizes: fx.Node, perm: fx.Node,
                      offs: tuple[fx.Node, ...]) -> None:
    targets = [recv_sizes, perm, *dict.fromkeys(offs)]
    module = _subgraph(targets, counts)
    dtype = tensor_val(counts).dtype
    for c in sample_counts(W, L):
        by_src = c.view(W, L)
        try:
            got_sizes, got_perm, *got_offs = (t.long() for t in module(c.to(dtype)))
        except Exception as exc:  # noqa: BLE001 - a function we cannot run on these counts is not proven
            raise NoMatch("regroup_not_matched", f"the permutation does not evaluate on sample counts: {exc}") \
                from None
        if not torch.equal(got_sizes, by_src.sum(1)):
            raise NoMatch("counts_not_exchanged", f"{recv_sizes.name} is not the received counts' per-source sums")
        ends = by_src.sum(0).cumsum(0)
        for o in got_offs:
            if not torch.equal(o, ends):
                raise NoMatch("offsets_not_matched", "the grouped GEMMs' offs are not the cumulative rows per local "
                              f"expert, cumsum(counts.view({W}, {L}).sum(0))")
        # the received rows of (local expert l, source s), l-major: they start at block[s] + before[s, l]
        block = by_src.sum(1).cumsum(0) - by_src.sum(1)
        before = by_src.cumsum(1) - by_src
        lengths = by_src.t().flatten()
        starts = (block[:, None] + before).t().flatten()
        total = int(ends[-1]) if L else 0
        if got_perm.shape != (total,) or (total and not (got_perm.min() >= 0 and got_perm.max() < total)):
            raise NoMatch("regroup_not_matched", f"{perm.name} does not index every received row once")
        want = torch.repeat_interleave(starts - (lengths.cumsum(0) - lengths), lengths) + torch.arange(total)
        # each group's rows in any order: sort by (group, row)
        key = torch.searchsorted(ends, torch.arange(total), right=True) * (total + 1)
        if not torch.equal((key + got_perm).sort().values, (key + want).sort().values):
            raise NoMatch("regroup_not_matched", f"{perm.name} is not the (source rank, local expert) -> "
                          "(local expert, source rank) regroup of the received rows")


# -- step 6: the bound ----------------------------------------------------------------------------------------------
def _send_bound(send_counts: fx.Node, counts: fx.Node, N: int, W: int,
                L: int) -> tuple[int, str, fx.Node | None, fx.Node | None]:
    """``(bound, why, bincount, topk_ids)``: rows one rank sends one rank, at most: ``T * min(K, L)`` when
    ``send_counts`` are the per-rank sums of a top-k's histogram (each token picks an expert once), else ``N``; the
    histogram when it is a ``bincount(ids, minlength=E)`` of ids proven in ``[0, E)`` (a top-k over ``E`` scores),
    whose data-dependent length the rewrite makes static; and those top-k ids (whatever form counts them: the rewrite
    marks its capacity on their router)."""
    worst = (N, f"N={N}", None, None)
    base = counts
    while op_name(base) == WAIT:
        base = base.args[0]
    hist = base.args[0] if op_name(base) in ALL_TO_ALL else None
    if not isinstance(hist, fx.Node):
        return worst
    ids: list[fx.Node] = []

    def is_topk_ids(n: Any) -> bool:
        b = ids_base(n)
        ok = op_name(b) == "getitem" and b.args[1] == 1 and op_name(b.args[0]) == "topk"
        if ok:
            ids.append(b)
        return ok

    found = expert_counts(hist, is_topk_ids)
    if found is None or found[0] != W * L or not ids:
        return worst
    iv, topk = tensor_val(ids[-1]), ids[-1].args[0]
    if iv is None or iv.dim() != 2 or known_int(iv.shape[0]) is None or known_int(iv.shape[1]) is None:
        return worst
    T, K = known_int(iv.shape[0]), known_int(iv.shape[1])
    scores = tensor_val(topk.args[0])
    over_E = scores is not None and scores.dim() >= 1 and known_int(scores.shape[-1]) == W * L \
        and arg(topk, 2, "dim", -1) in (-1, scores.dim() - 1)
    try:
        module = _subgraph([send_counts], hist)
        ok = all(torch.equal(module(c.to(tensor_val(hist).dtype))[0].long(), c.view(W, L).sum(1))
                 for c in sample_counts(W, L))
    except Exception:  # noqa: BLE001 - not proven: the worst case
        ok = False
    if not ok or T * K != N or not over_E:
        return worst
    flat = tensor_val(hist.args[0])
    bincount = hist if op_name(hist) == "bincount" and flat is not None and flat.dim() == 1 else None
    return min(N, T * min(K, L)), f"top-{K} of {T} tokens: T*min(K, L)={T * min(K, L)}", bincount, ids[-1]
