"""One unrolled per-expert loop -> grouped GEMMs: the rewrite both loop forms share.

A :class:`Loop` holds E copies of one expert MLP (the bodies) over E row chunks. :func:`signatures` proves the
copies identical node by node and finds the per-expert weights (:class:`Slot`); :func:`rewrite_loop` stacks them
and replaces the copies by one body whose GEMMs are grouped GEMMs over all rows with device offsets. The
host-split loop (:mod:`.rewrite`) and the selection loop (:mod:`.selection_loop`) each build a :class:`Loop`
and call these two.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx

from moe_compile.passes import NoMatch
from moe_compile.passes._graph import (
    arg,
    erase_dead,
    graph_call,
    op_name,
    ops_available,
    refresh_example_values,
    tensor_val,
    topo_index,
    transitive_users,
)
from moe_compile.passes._host_sync import host_reads, sym_expr
from moe_compile.passes.forms.rowwise import EXPERT_LOOP, RowwiseProof

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
        base = tensor_val(node.args[0])
        if base is not None and base.dim() == 3:
            return WeightRef(node.args[0], node.args[1], False)
        return None
    value = tensor_val(node)
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


def signatures(loop: Loop) -> tuple[list[tuple], list[Slot]]:
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
        if tensor_val(refs[0].base).shape[0] != len(refs):
            return None
        return "base", refs[0].base, refs[0].transposed
    shapes = {tuple(tensor_val(r.base).shape) for r in refs}
    if len(shapes) != 1 or len({r.base for r in refs}) != len(refs):
        return None
    return "stack", [r.base for r in refs], refs[0].transposed


# ---------------------------------------------------------------------------------------------------
# rewrite
# ---------------------------------------------------------------------------------------------------


def _offsets_plan(graph: fx.Graph, loop: Loop) -> list[int] | fx.Node:
    """Static end offsets, or the device tensor whose elements are the split sizes (validated)."""
    sizes = loop.split.args[1] if len(loop.split.args) > 1 else arg(loop.split, "split_size_or_sections")
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
    counts = tensor_val(tensor)
    if counts is None or counts.dim() != 1 or counts.shape[0] != len(sizes) or counts.dtype.is_floating_point:
        raise NoMatch("sizes_not_device_counts", f"{tensor.name} is not an int [E] tensor")
    return tensor


def _grouped_mm_kind(x: torch.Tensor, n: int, k: int) -> str:
    """``torch._grouped_mm`` for bf16 with 16-byte strides (sync-free CUTLASS on sm90+), else ours."""
    aligned = (n * x.element_size()) % 16 == 0 and (k * x.element_size()) % 16 == 0
    if x.dtype == torch.bfloat16 and aligned:
        return "aten"
    if x.dtype in (torch.bfloat16, torch.float16, torch.float32) and ops_available("grouped_mm"):
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
    x = tensor_val(loop.x_NH)
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
                raise NoMatch("per_expert_op_unsupported",
                              f"{n.name}: per-expert input {slot.nodes[0].name} used by {name}")
            if name == "linear" and _linear_bias(n) is not None and not biases:
                raise NoMatch("per_expert_op_unsupported", f"{n.name}: linear with a per-expert bias")
        if is_bias:
            shapes = {tuple(tensor_val(b).shape) for b in slot.nodes}
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
    proof = RowwiseProof(EXPERT_LOOP, dict.fromkeys([loop.chunks[0], *body0], "rows"))
    for n in body0:
        name = op_name(n)
        if name in GEMMS:
            slot = next((j for j in weights if _gemm_weight(n) is slots[j].nodes[0]), None)
            if slot is None:
                continue  # a weight shared by all experts stays a plain GEMM
            how, what, transposed = weights[slot]
            as_linear = (name == "linear") != transposed
            w = tensor_val(what if how == "base" else what[0])
            rows, cols = w.shape[-2], w.shape[-1]
            n_out, k_in = (rows, cols) if as_linear else (cols, rows)
            gemms[n] = _GemmPlan(slot, as_linear, _grouped_mm_kind(x, n_out, k_in))
            continue
        proof.check(n)
    if not gemms:
        raise NoMatch("per_expert_op_unsupported", "no per-expert GEMM: not an expert loop")
    return weights, gemms


def rewrite_loop(graph: fx.Graph, loop: Loop, slots: list[Slot], offs: fx.Node | None = None,
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
            offs = graph_call(graph, torch.Tensor.to, graph_call(graph, torch.cumsum, offs_plan, 0, meta_from=meta),
                        torch.int32, meta_from=meta)
        else:
            device = tensor_val(loop.x_NH).device
            offs = graph_call(graph, torch.tensor, offs_plan, dtype=torch.int32, device=device, meta_from=meta)
        stacked = {
            j: what if how == "base" else graph_call(graph, torch.stack, list(what), meta_from=meta)
            for j, (how, what, _) in weights.items()
        }
        env: dict[fx.Node, fx.Node] = {loop.chunks[0]: loop.x_NH, **(row_inputs or {})}
        for n in body0:
            plan = gemms.get(n)
            if plan is not None:
                W = stacked[plan.slot]
                # linear(h, W_e) = h @ W_e^T and matmul(h, B_e) = h @ B_e; W_ENK is [E, N, K].
                W_ENK = W if plan.as_linear else graph_call(graph, torch.transpose, W, -2, -1, meta_from=meta)
                h = env.get(n.args[0], n.args[0])
                if plan.kind == "aten":
                    mat2 = graph_call(graph, torch.transpose, W_ENK, -2, -1, meta_from=meta)
                    env[n] = graph_call(graph, torch._grouped_mm, h, mat2, offs=offs, meta_from=n)
                else:
                    env[n] = graph_call(graph, torch.ops.moe.grouped_mm.default, h, W_ENK, offs, meta_from=n)
                bias = _linear_bias(n) if op_name(n) == "linear" else None
                if bias is not None:
                    bias_slot = next((j for j in weights if slots[j].nodes[0] is bias), None)
                    rows_bias = graph_call(graph, operator.getitem, stacked[bias_slot], row_expert, meta_from=n) \
                        if bias_slot is not None else bias
                    env[n] = graph_call(graph, torch.add, env[n], rows_bias, meta_from=n)
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


