"""Fuse a Python loop over per-expert chunks into grouped GEMMs over all rows.

Shape suffixes: ``N`` routed rows (expert-major), ``n_e`` rows of expert ``e``, ``H`` hidden, ``I``
intermediate, ``E`` experts.

Matches (Dynamo Torch IR; the loop is unrolled, one copy of the expert MLP per chunk)::

    c_0, ..., c_{E-1} = torch.split(x_NH, sizes)          sizes = C.tolist() (host) or static ints
    y_e = MLP_e(c_e)       for every e: the same ops, node by node, with expert e's weights
                           (``experts[e]`` of a ModuleList -> F.linear(c, W_e); or ``c @ w[e].T`` slices)
    y_NH = torch.cat([y_0, ..., y_{E-1}])

Rewrites to::

    offs_E = cumsum(C, 0).to(int32)          (on the device; a constant tensor for static sizes)
    W_ENK = torch.stack([W_0, ..., W_{E-1}])  (or the stacked parameter ``w`` itself for ``w[e]`` slices)
    y_NH = MLP(x_NH) with each per-expert GEMM -> torch._grouped_mm(h, W_ENK.mT, offs=offs_E) (bf16)
                                              or torch.ops.moe.grouped_mm(h, W_ENK, offs_E) (fp32/fp16)

The split, the E copies and the cat are erased, and so are the host reads that only sized the split
(with their ``_assert_scalar`` checks). A later pass (``strip_host_padding`` or ``fuse_dispatch``)
then sees a grouped-GEMM dispatch with device offsets.

Fires when: the E per-chunk subgraphs are identical node by node (same targets, same constants, same
wiring), every input that differs between experts is a weight of the same shape consumed as the
weight of ``linear`` / ``matmul``, and the sizes are the elements of one device tensor in order.

Skips when (reason tags): ``loop_not_matched`` (chunks do not meet in one cat in order),
``experts_not_identical`` (structure differs between experts), ``per_expert_op_unsupported`` (a
per-expert input used by another op than a GEMM, or a per-expert bias), ``weights_not_stackable``,
``expert_region_escapes`` (a per-chunk value is used outside its copy), ``sizes_not_device_counts``,
``no_grouped_mm_for_dtype`` (fp32/fp16 without ``torch.ops.moe.grouped_mm``, or strides not 16-byte
aligned).

Stage: pre-grad, before ``strip_host_padding``: the unrolled loop only exists in Dynamo's graph, and
AOTAutograd then differentiates the grouped GEMMs (the weight stack becomes a copy per step).

Seen in: Megatron-LM ``SequentialMLP``, DeepSeek-V3 reference ``MoE.forward``, torchtitan's
``_run_experts_for_loop``, older Hugging Face MoE blocks rewritten with ``split`` (``tests/models/host_padded.py``).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx

from moe_compile.passes import NoMatch, PassContext
from moe_compile.passes._graph import erase_dead, layer_name, op_name, outside_users, topo_index
from moe_compile.passes._host_sync import (
    call,
    erase_dead_host_reads,
    host_reads,
    is_call,
    kwarg,
    refresh_example_values,
    sym_expr,
    tensor_value,
    transitive_users,
)
from moe_compile.passes._selection_loop import canonicalize, find_selection_loops
from moe_compile.passes._op_tables import LAST_DIM_SPLITS
from moe_compile.passes._rowwise_region import BINARY_ROWWISE, UNARY_ROWWISE


GEMMS = {"linear", "matmul", "__matmul__"}


@dataclasses.dataclass(frozen=True)
class WeightRef:
    """``base[index]`` (``index`` None: ``base`` itself), transposed on its last two dims if ``transposed``."""

    base: fx.Node
    index: int | None
    transposed: bool


def _weight_ref(node: Any) -> WeightRef | None:
    if not isinstance(node, fx.Node):
        return None
    name = op_name(node)
    if (name == "getattr" and node.args[1] in ("T", "mT")) or name == "t" or (
        name == "transpose" and {*node.args[1:3]} in ({0, 1}, {-1, -2})
    ):
        inner = _weight_ref(node.args[0])
        return dataclasses.replace(inner, transposed=not inner.transposed) if inner is not None else None
    if name == "getitem" and isinstance(node.args[1], int):
        base = tensor_value(node.args[0])
        if base is not None and base.dim() == 3:
            return WeightRef(node.args[0], node.args[1], False)
        return None
    value = tensor_value(node)
    if value is None or value.dim() != 2:
        return None
    return WeightRef(node, None, False)


@dataclasses.dataclass
class Loop:
    split: fx.Node
    x_NH: fx.Node
    cat: fx.Node
    bodies: list[list[fx.Node]]  # per expert, in graph order
    chunks: list[fx.Node]
    outputs: list[fx.Node]


def _chunks(split: fx.Node) -> list[fx.Node] | None:
    sizes = split.args[1] if len(split.args) > 1 else kwarg(split, "split_size_or_sections")
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
    cats = [n for n in reach if is_call(n, "cat") and kwarg(n, "dim", 0) == 0]
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


# ---------------------------------------------------------------------------------------------------
# structural comparison
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Slot:
    """An input of the expert body from outside it: the same node for all experts, or one per expert."""

    nodes: list[fx.Node]

    @property
    def shared(self) -> bool:
        return all(n is self.nodes[0] for n in self.nodes)


def _signatures(loop: Loop) -> tuple[list[tuple], list[Slot]]:
    """Per-node signatures of expert 0's body, checked equal for every expert, and the outside slots."""
    E = len(loop.bodies)
    sigs_by_expert = []
    slots_by_expert: list[list[fx.Node]] = []
    for e in range(E):
        local = {n: i for i, n in enumerate(loop.bodies[e])}
        ext: list[fx.Node] = []

        def enc(a: Any) -> Any:
            if isinstance(a, fx.Node):
                if a is loop.chunks[e]:
                    return ("chunk",)
                if a in local:
                    return ("local", local[a])
                if a not in ext:
                    ext.append(a)
                return ("ext", ext.index(a))
            if isinstance(a, (list, tuple)):
                return (type(a).__name__, tuple(enc(x) for x in a))
            if isinstance(a, dict):
                return ("dict", tuple(sorted((k, enc(v)) for k, v in a.items())))
            if isinstance(a, slice):
                return ("slice", enc(a.start), enc(a.stop), enc(a.step))
            return ("const", repr(a))

        sigs = []
        for n in loop.bodies[e]:
            sigs.append((n.op, n.target if n.op == "call_method" else op_name(n) or repr(n.target),
                         n.target if n.op == "call_function" else None, enc(n.args), enc(n.kwargs)))
        sigs_by_expert.append(sigs)
        slots_by_expert.append(ext)
    for e in range(1, E):
        if len(sigs_by_expert[e]) != len(sigs_by_expert[0]) or any(
            a[:4] != b[:4] or a[4] != b[4] for a, b in zip(sigs_by_expert[e], sigs_by_expert[0])
        ):
            raise NoMatch("experts_not_identical", f"expert {e}'s body differs from expert 0's")
        if len(slots_by_expert[e]) != len(slots_by_expert[0]):
            raise NoMatch("experts_not_identical", f"expert {e} has a different number of inputs")
    slots = [Slot([slots_by_expert[e][j] for e in range(E)]) for j in range(len(slots_by_expert[0]))]
    return sigs_by_expert[0], slots


def _stack_plan(slot: Slot) -> tuple[str, Any, bool] | None:
    """How to get ``[E, ...]`` weights for a per-expert slot: ("base", W, transposed) or ("stack", [..], t)."""
    refs = [_weight_ref(n) for n in slot.nodes]
    if any(r is None for r in refs):
        return None
    if len({(r.index is None, r.transposed) for r in refs}) != 1:
        return None
    if refs[0].index is not None:
        if any(r.base is not refs[0].base or r.index != e for e, r in enumerate(refs)):
            return None
        if tensor_value(refs[0].base).shape[0] != len(refs):
            return None
        return "base", refs[0].base, refs[0].transposed
    shapes = {tuple(tensor_value(r.base).shape) for r in refs}
    if len(shapes) != 1 or len({r.base for r in refs}) != len(refs):
        return None
    return "stack", [r.base for r in refs], refs[0].transposed


# ---------------------------------------------------------------------------------------------------
# rewrite
# ---------------------------------------------------------------------------------------------------


def _offsets_plan(graph: fx.Graph, loop: Loop) -> list[int] | fx.Node:
    """Static end offsets, or the device tensor whose elements are the split sizes (validated)."""
    sizes = loop.split.args[1] if len(loop.split.args) > 1 else kwarg(loop.split, "split_size_or_sections")
    if all(isinstance(s, int) for s in sizes):
        return [sum(sizes[: i + 1]) for i in range(len(sizes))]
    reads = host_reads(graph)
    tensor = None
    for i, s in enumerate(sizes):
        expr = sym_expr(s)
        read = reads.get(expr) if expr is not None else None
        if read is None or read.index != i or (tensor is not None and read.tensor is not tensor):
            raise NoMatch("sizes_not_device_counts", f"split size {i} is not element {i} of one device tensor")
        tensor = read.tensor
    counts = tensor_value(tensor)
    if counts is None or counts.dim() != 1 or counts.shape[0] != len(sizes) or counts.dtype.is_floating_point:
        raise NoMatch("sizes_not_device_counts", f"{tensor.name} is not an int [E] tensor")
    return tensor


def _moe_grouped_mm_available() -> bool:
    try:
        import moe_compile.ops.grouped_mm  # noqa: F401 - registers torch.ops.moe.grouped_mm
    except Exception:  # noqa: BLE001 - a broken ops module must not break compilation
        return False
    return hasattr(torch.ops.moe, "grouped_mm")


def _grouped_mm_kind(x: torch.Tensor, n: int, k: int) -> str:
    """``torch._grouped_mm`` for bf16 with 16-byte strides (sync-free CUTLASS on sm90+), else ours."""
    aligned = (n * x.element_size()) % 16 == 0 and (k * x.element_size()) % 16 == 0
    if x.dtype == torch.bfloat16 and aligned:
        return "aten"
    if x.dtype in (torch.bfloat16, torch.float16, torch.float32) and _moe_grouped_mm_available():
        return "moe"
    raise NoMatch("no_grouped_mm_for_dtype", f"{x.dtype} with N={n}, K={k}: no sync-free grouped GEMM")


def _gemm_weight(n: fx.Node) -> Any:
    return n.args[1] if len(n.args) > 1 else n.kwargs.get("weight")


@dataclasses.dataclass
class _GemmPlan:
    slot: int
    as_linear: bool  # W_ENK is the slot's stacked weight itself (else its transpose)
    kind: str  # "aten" (torch._grouped_mm) or "moe" (torch.ops.moe.grouped_mm)


def _linear_bias(n: fx.Node) -> Any:
    return n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")


def _plan(loop: Loop, slots: list[Slot], row_inputs: dict[fx.Node, fx.Node] | None = None,
          biases: bool = False) -> tuple[dict[int, tuple[str, Any, bool]], dict[fx.Node, _GemmPlan]]:
    """Check the body (expert 0's copy) can run over all rows; returns the weight and GEMM plans.
    ``row_inputs``: per-expert inputs of expert 0's body that are its rows of an all-rows tensor;
    ``biases``: per-expert ``linear`` biases are allowed (the caller knows each row's expert)."""
    body0 = loop.bodies[0]
    x = tensor_value(loop.x_NH)
    if x is None or x.dim() != 2:
        raise NoMatch("loop_not_matched", f"{loop.x_NH.name} is not [N, H]")
    weights: dict[int, tuple[str, Any, bool]] = {}
    for j, slot in enumerate(slots):
        if slot.nodes[0] in (row_inputs or {}):
            continue
        # with one expert every input looks shared: its GEMM weights and biases are still the experts'
        single = len(slot.nodes) == 1 and any(
            op_name(n) in GEMMS and (_gemm_weight(n) is slot.nodes[0] or (biases and _linear_bias(n) is slot.nodes[0]))
            for n in body0)
        if slot.shared and not single:
            continue
        is_bias = False
        for n in body0:
            if slot.nodes[0] not in n.all_input_nodes:
                continue
            name = op_name(n)
            if biases and name == "linear" and _linear_bias(n) is slot.nodes[0] and n.args[0] is not slot.nodes[0] \
                    and _gemm_weight(n) is not slot.nodes[0]:
                is_bias = True
                continue
            if name not in GEMMS or n.args[0] is slot.nodes[0] or _gemm_weight(n) is not slot.nodes[0]:
                raise NoMatch("per_expert_op_unsupported", f"{n.name}: per-expert input {slot.nodes[0].name} used by {name}")
            if name == "linear" and _linear_bias(n) is not None and not biases:
                raise NoMatch("per_expert_op_unsupported", f"{n.name}: linear with a per-expert bias")
        if is_bias:
            shapes = {tuple(tensor_value(b).shape) for b in slot.nodes}
            if len(shapes) != 1 or len(next(iter(shapes))) != 1:
                raise NoMatch("weights_not_stackable", f"per-expert biases {slot.nodes[0].name}... differ in shape")
            weights[j] = ("stack", list(slot.nodes), False)
            continue
        plan = _stack_plan(slot)
        if plan is None:
            names = [n.name for n in slot.nodes[:3]]
            raise NoMatch("weights_not_stackable", f"per-expert inputs {names}... are not same-shape weights")
        weights[j] = plan
    gemms: dict[fx.Node, _GemmPlan] = {}
    for n in body0:
        name = op_name(n)
        if name in GEMMS:
            slot = next((j for j in weights if _gemm_weight(n) is slots[j].nodes[0]), None)
            if slot is None:
                continue  # a weight shared by all experts stays a plain GEMM
            how, what, transposed = weights[slot]
            as_linear = (name == "linear") != transposed
            w = tensor_value(what if how == "base" else what[0])
            rows, cols = w.shape[-2], w.shape[-1]
            n_out, k_in = (rows, cols) if as_linear else (cols, rows)
            gemms[n] = _GemmPlan(slot, as_linear, _grouped_mm_kind(x, n_out, k_in))
            continue
        if name not in UNARY_ROWWISE | BINARY_ROWWISE | LAST_DIM_SPLITS | {"getitem"}:
            raise NoMatch("per_expert_op_unsupported", f"{n.name}: {name} is not row-wise")
        if name in LAST_DIM_SPLITS:
            src = tensor_value(n.args[0])
            dim = n.args[2] if name == "chunk" and len(n.args) > 2 else kwarg(n, "dim", 0)
            if name == "narrow":
                dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
            if src is None or not isinstance(dim, int) or dim % src.dim() == 0:
                raise NoMatch("per_expert_op_unsupported", f"{n.name}: {name} over rows")
        if name == "getitem" and isinstance(tensor_value(n.args[0]), torch.Tensor):
            raise NoMatch("per_expert_op_unsupported", f"{n.name}: indexing inside the expert")
    if not gemms:
        raise NoMatch("per_expert_op_unsupported", "no per-expert GEMM: not an expert loop")
    return weights, gemms


def _rewrite(graph: fx.Graph, loop: Loop, slots: list[Slot], offs: fx.Node | None = None,
             row_inputs: dict[fx.Node, fx.Node] | None = None, row_expert: fx.Node | None = None) -> str:
    """Build one copy of the body over all rows; returns a description. Raises NoMatch before any edit.

    ``offs`` (int32 end offsets on the device) replaces the offsets derived from the split sizes;
    ``row_inputs`` maps per-expert inputs of expert 0's body to their all-rows tensors; ``row_expert``
    (the expert of each row, ascending) lets per-expert ``linear`` biases through as ``bias_EN[row_expert]``."""
    E = len(loop.chunks)
    body0 = loop.bodies[0]
    weights, gemms = _plan(loop, slots, row_inputs, biases=row_expert is not None)
    offs_plan = offs if offs is not None else _offsets_plan(graph, loop)

    meta = loop.cat
    order = topo_index(graph)
    anchors = [loop.x_NH, loop.split] + [n for j in weights for n in slots[j].nodes] + list((row_inputs or {}).values())
    if isinstance(offs_plan, fx.Node):
        anchors.append(offs_plan)
    with graph.inserting_after(max(anchors, key=order.__getitem__)):
        if offs is not None:
            pass
        elif isinstance(offs_plan, fx.Node):
            offs = call(graph, torch.Tensor.to, call(graph, torch.cumsum, offs_plan, 0, meta_from=meta),
                        torch.int32, meta_from=meta)
        else:
            device = tensor_value(loop.x_NH).device
            offs = call(graph, torch.tensor, offs_plan, dtype=torch.int32, device=device, meta_from=meta)
        stacked = {
            j: what if how == "base" else call(graph, torch.stack, list(what), meta_from=meta)
            for j, (how, what, _) in weights.items()
        }
        env: dict[fx.Node, fx.Node] = {loop.chunks[0]: loop.x_NH, **(row_inputs or {})}
        for n in body0:
            plan = gemms.get(n)
            if plan is not None:
                W = stacked[plan.slot]
                # linear(h, W_e) = h @ W_e^T and matmul(h, B_e) = h @ B_e; W_ENK is [E, N, K].
                W_ENK = W if plan.as_linear else call(graph, torch.transpose, W, -2, -1, meta_from=meta)
                h = env.get(n.args[0], n.args[0])
                if plan.kind == "aten":
                    mat2 = call(graph, torch.transpose, W_ENK, -2, -1, meta_from=meta)
                    env[n] = call(graph, torch._grouped_mm, h, mat2, offs=offs, meta_from=n)
                else:
                    env[n] = call(graph, torch.ops.moe.grouped_mm.default, h, W_ENK, offs, meta_from=n)
                bias = _linear_bias(n) if op_name(n) == "linear" else None
                if bias is not None:
                    bias_slot = next((j for j in weights if slots[j].nodes[0] is bias), None)
                    rows_bias = call(graph, operator.getitem, stacked[bias_slot], row_expert, meta_from=n) \
                        if bias_slot is not None else bias
                    env[n] = call(graph, torch.add, env[n], rows_bias, meta_from=n)
                continue
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: env.get(a, a))
            new = graph.create_node(n.op, n.target, args, kwargs, name=n.name + "_all")
            new.meta.update({k: v for k, v in n.meta.items() if k not in ("example_value", "val")})
            refresh_example_values([new])
            env[n] = new
    fused_out = env[loop.outputs[0]]
    loop.cat.replace_all_uses_with(fused_out)
    graph.erase_node(loop.cat)
    downstream = transitive_users(fused_out)
    refresh_example_values([n for n in graph.nodes if n in downstream])  # row count is static now
    erase_dead(graph, list(loop.outputs) + [n for body in loop.bodies for n in body] + list(loop.chunks))
    from torch._inductor.pattern_matcher import stable_topological_sort

    stable_topological_sort(graph)
    kinds = {p.kind for p in gemms.values()}
    gemm = "torch._grouped_mm" if kinds == {"aten"} else "moe.grouped_mm" if kinds == {"moe"} else "grouped GEMMs"
    return f"{len(gemms)} x {gemm} over all rows with device offs_E (E={E})"


def _host_sized(split: fx.Node) -> bool:
    sizes = split.args[1] if len(split.args) > 1 else kwarg(split, "split_size_or_sections")
    return isinstance(sizes, (list, tuple)) and any(isinstance(s, fx.Node) for s in sizes)


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
            _, slots = _signatures(loop)
            replaced_by = _rewrite(graph, loop, slots)
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


def _has_gemm_per_chunk(split: fx.Node) -> bool:
    """True when the chunks of ``split`` feed GEMMs (an expert loop we could not match): worth a record."""
    chunks = _chunks(split) or []
    return bool(chunks) and all(any(op_name(n) in GEMMS for n in transitive_users(c)) for c in chunks[:2])

