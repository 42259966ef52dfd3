"""Pre-grad pass ``router_metrics``: accumulate router statistics on the device in every MoE layer.

Stage: pre-grad, last (after the dispatch rewrites, so ``moe.permute_pad`` nodes anchor the routers).

Matches: a router's ``topk`` (see "Routers recognised" below). Runs only with ``metrics=True``.

Rewrites to: the same graph plus, right after the router's ``topk``::

    acc_S = self._moe_metrics_<i>                                 # get_attr: the layer's accumulator
    torch.ops.moe.router_metrics_(acc_S, logits, expert_idx, capacity_factor)

``acc_S`` is the process-wide accumulator of that layer (:mod:`moe_compile.metrics`), registered as a
buffer of the graph module: AOTAutograd lifts it to a static graph input, the op decomposes into ATen
ops under ``no_grad`` on detached logits, and the in-place add becomes an input mutation that Inductor
writes in place. Outputs and gradients are unchanged; no host sync, fixed shapes (CUDA-graph safe).

Routers recognised (Dynamo's Torch IR):

* anchored: the ``expert_idx`` input of a ``torch.ops.moe.permute_pad`` node, through views and casts,
  is ``topk(...)[1]``;
* argmax: one ``argmax`` per choice over the last dim of the scores (the second over the logits after ``masked_fill``,
  DeepSpeed-MoE's top-2), marked by ``capacity_dispatch`` as a capacity layer's router: stacked ``[T, K]``;
* raw: ``topk(s, k, dim=-1)[1]`` where ``s`` is, through casts and views, ``softmax(logits, -1)`` (Mixtral,
  Qwen, OLMoE) or ``logits`` itself (Granite: softmax over the k values afterwards), and ``logits`` come
  from ``linear(x, w[E, H])`` or a matmul with last dim ``E`` (``E <= MAX_EXPERTS``).

Several ``topk`` over the same logits (transformers' aux loss recomputes one) count once: the first in
graph order, or the anchored one, or the one a rewrite marked with its static capacity (``CAPACITY_META``).
Logits already fed to a ``router_metrics_`` node (from a hook of :func:`moe_compile.metrics.attach`, traced by
Dynamo) are left alone, except that such a node takes the capacity a rewrite marked on the same router.

Needs the pre-grad passes to run before AOTAutograd lifts the module's buffers: always so on torch
2.11; on 2.13 with ``pre_grad_pass_timing="early"`` (:func:`moe_compile.metrics.inductor_patches`).
"""

from __future__ import annotations

import dataclasses
import operator
import warnings

import torch
import torch.fx as fx

from moe_compile import metrics
from moe_compile.passes import PassContext
from moe_compile.passes._graph import CAPACITY_GROUP_META, CAPACITY_META, graph_call, layer_name, op_name
from moe_compile.passes._graph import val as _val
from moe_compile.passes.forms.counts import ids_base
from moe_compile.passes.forms.ops import CASTS, FLAT_VIEWS

# A topk over more "experts" than this is not taken for a router unless a dispatch op anchors it
# (it is most likely a vocabulary).
MAX_EXPERTS = 1024
ACC_ATTR_PREFIX = "_moe_metrics_"

_TOPK = {torch.topk}
_SOFTMAX = {torch.softmax, torch.nn.functional.softmax, torch.special.softmax}
_LINEAR = {torch.nn.functional.linear, torch._C._nn.linear}
_MATMUL = {torch.matmul, operator.matmul, torch.mm}
# ops that keep the routing rows and the expert axis (casts, reshapes, copies): the shared tables
_PASSTHROUGH = CASTS | FLAT_VIEWS


@dataclasses.dataclass
class Router:
    topk: fx.Node  # the router's topk (its last argmax for an argmax router)
    expert_idx: fx.Node | None  # None for an argmax router until its choices are stacked (_insert)
    # the linear/matmul that produces the router logits
    logits: fx.Node
    num_experts: int
    path: str
    anchored: bool
    choices: tuple[fx.Node, ...] = ()  # an argmax router's per-choice [T] ids, in order


def run(graph: fx.Graph, ctx: PassContext) -> None:
    gm = graph.owning_module
    if gm is None:
        ctx.skip("<graph>", "no_graph_module", "the pre-grad graph has no owning module to hold accumulators")
        return
    routers, skipped = find_routers(graph)
    for layer, reason, detail in skipped:
        ctx.skip(layer, reason, detail)
    for router in _routers_in_subgraphs(gm):
        ctx.skip(router.path or "<root>", "inside_subgraph",
                 "router inside a higher-order op body (e.g. torch.utils.checkpoint); use moe_compile.metrics.attach")
    if not routers:
        return
    if _late_pre_grad_timing():
        msg = ("moe_compile metrics need torch._inductor.config.pre_grad_pass_timing='early' on this torch "
               "(the backend sets it when metrics=True); no metrics inserted")
        warnings.warn(msg, stacklevel=2)
        for r in routers:
            ctx.skip(r.path, "late_pre_grad_timing", msg)
        return
    hooked = {_logits_root(n.args[1]): n for n in _metrics_nodes(graph)}
    instrumented = set(hooked)
    for r in routers:
        if r.logits in instrumented:
            ctx.skip(r.path, "already_instrumented", "a router_metrics_ op (attach hook) reads these logits")
            if r.logits in hooked and CAPACITY_META in r.topk.meta:  # the hook cannot know a rewrite's capacity
                _set_capacity(hooked[r.logits], r)
            continue
        _insert(graph, gm, r)
        instrumented.add(r.logits)
        ctx.rewrite(r.path, f"topk[{r.num_experts} experts]", "moe.router_metrics_")


# ------------------------------------------------------------------------------------------ match


def find_routers(graph: fx.Graph) -> tuple[list[Router], list[tuple[str, str, str]]]:
    """The routers of ``graph`` (one per logits tensor) and ``(layer, reason, detail)`` for topk
    nodes that looked like routers but were not taken."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    anchored = set()
    for node in graph.nodes:
        if _is_permute_pad(node):
            topk = _topk_of_indices(_arg(node, 1, "expert_idx_TK", "expert_idx"))
            if topk is not None:
                anchored.add(topk)
    routers: dict[fx.Node, Router] = {}
    skipped = []
    for node in graph.nodes:
        if not _is_topk(node):
            continue
        router, why = _match_router(node, node in anchored)
        path = router.path if router is not None else module_path(node)
        if router is None:
            if node in anchored or why in ("not_last_dim", "no_indices"):
                skipped.append((path or "<root>", why, f"topk node {node.name}"))
            continue
        prev = routers.get(router.logits)
        # the anchored one, else the one a rewrite marked with its capacity (an attach hook's topk comes first)
        if prev is None or (router.anchored and not prev.anchored) \
                or (CAPACITY_META in node.meta and CAPACITY_META not in prev.topk.meta and not prev.anchored):
            routers[router.logits] = router
    for router in _argmax_routers(graph):
        routers.setdefault(router.logits, router)
    return sorted(routers.values(), key=lambda r: order[r.topk]), skipped


def _argmax_routers(graph: fx.Graph) -> list[Router]:
    """Top-k by one ``argmax`` per choice (DeepSpeed-MoE's top-2: the second over the logits with the first masked
    out), recognised where ``capacity_dispatch`` marked the argmaxes (``CAPACITY_META``): one router per logits."""
    by_logits: dict[fx.Node, list[fx.Node]] = {}
    for node in graph.nodes:
        if op_name(node) != "argmax" or CAPACITY_META not in node.meta:
            continue
        scores = _arg(node, 0, "input")
        if isinstance(scores, fx.Node) and op_name(scores) == "masked_fill":
            scores = scores.args[0]
        logits = _logits_root(scores, allow_softmax=True)
        val = _val(scores)
        if logits is not None and isinstance(val, torch.Tensor) and _arg(node, 1, "dim") in (-1, val.dim() - 1):
            by_logits.setdefault(logits, []).append(node)
    routers = []
    for logits, choices in by_logits.items():
        E = _val(logits).shape[-1]
        if isinstance(E, int) and len(choices) < E:
            routers.append(Router(choices[-1], None, logits, E, module_path(logits), False, tuple(choices)))
    return routers


def _match_router(topk: fx.Node, anchored: bool) -> tuple[Router | None, str]:
    scores = _arg(topk, 0, "input")
    k = _arg(topk, 1, "k")
    dim = _arg(topk, 2, "dim", default=-1)
    largest = _arg(topk, 3, "largest", default=True)
    scores_val = _val(scores)
    if not isinstance(scores_val, torch.Tensor) or not isinstance(k, int) or largest is not True:
        return None, "not_a_router_topk"
    if dim not in (-1, scores_val.dim() - 1):
        return None, "not_last_dim"
    idx = next((u for u in topk.users if u.target is operator.getitem and u.args[1] == 1), None)
    if idx is None:
        return None, "no_indices"
    logits = _logits_root(scores, allow_softmax=True)
    if logits is None:
        return None, "no_router_logits"
    num_experts = scores_val.shape[-1]
    if not isinstance(num_experts, int) or not k < num_experts:
        return None, "dynamic_or_tiny_expert_axis"
    if not anchored and num_experts > MAX_EXPERTS:
        return None, "too_many_experts"
    # named after the module that computes the logits (the router: what metrics.attach hooks)
    return Router(topk, idx, logits, num_experts, module_path(logits), anchored), ""


def _logits_root(node: object, allow_softmax: bool = False) -> fx.Node | None:
    """Walk up from a router's scores through casts/views (and one softmax) to the logits linear."""
    seen_softmax = not allow_softmax
    while isinstance(node, fx.Node):
        if _is_linear(node):
            return node
        if not seen_softmax and _is_softmax(node):
            seen_softmax = True
            node = _arg(node, 0, "input")
            continue
        if _is_passthrough(node):
            node = node.args[0]
            continue
        return None
    return None


def _routers_in_subgraphs(gm: torch.nn.Module) -> list[Router]:
    """Routers in the bodies of higher-order ops (activation checkpointing, ``wrap``): not
    instrumented, a mutation cannot be added inside them here; hooks traced by Dynamo can."""
    found = []
    for _name, sub in gm.named_modules():
        if sub is gm or not isinstance(sub, fx.GraphModule):
            continue
        routers, _ = find_routers(sub.graph)
        instrumented = {_logits_root(n.args[1]) for n in _metrics_nodes(sub.graph)}
        found += [r for r in routers if r.logits not in instrumented]
    return found


def _topk_of_indices(node: object) -> fx.Node | None:
    """The ``topk`` whose indices ``node`` is, through what the dispatch recogniser peels off ids."""
    node = ids_base(node)
    if isinstance(node, fx.Node) and node.target is operator.getitem and node.args[1] == 1 and _is_topk(node.args[0]):
        return node.args[0]
    return None


def _is_topk(node: object) -> bool:
    return isinstance(node, fx.Node) and (
        (node.op == "call_function" and (node.target in _TOPK or node.target is torch.ops.aten.topk.default))
        or (node.op == "call_method" and node.target == "topk")
    )


def _is_softmax(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target in _SOFTMAX:
        pass
    elif node.op == "call_method" and node.target == "softmax":
        pass
    else:
        return False
    val = _val(node)
    dim = _arg(node, 1, "dim", default=None)
    return isinstance(val, torch.Tensor) and dim in (-1, val.dim() - 1)


def _is_linear(node: fx.Node) -> bool:
    val = _val(node)
    if not isinstance(val, torch.Tensor) or not val.is_floating_point():
        return False
    if node.op == "call_function" and node.target in _LINEAR:
        weight = _val(_arg(node, 1, "weight"))
        return isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[0] == val.shape[-1]
    if node.op == "call_function" and node.target in _MATMUL:
        return True
    if node.op == "call_method" and node.target in ("matmul", "mm", "__matmul__"):
        return True
    if node.op == "call_module":
        mod = node.graph.owning_module.get_submodule(node.target) if node.graph.owning_module else None
        return isinstance(mod, torch.nn.Linear)
    return False


def _is_passthrough(node: fx.Node) -> bool:
    if op_name(node) not in _PASSTHROUGH or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    out, inp = _val(node), _val(node.args[0])
    return (
        isinstance(out, torch.Tensor) and isinstance(inp, torch.Tensor) and out.dim() >= 1 and inp.dim() >= 1
        and out.shape[-1] == inp.shape[-1] and out.is_floating_point()
    )


def _is_permute_pad(node: fx.Node) -> bool:
    op = getattr(torch.ops.moe, "permute_pad", None)
    return op is not None and node.op == "call_function" and node.target in (op, op.default)


def _metrics_nodes(graph: fx.Graph) -> list[fx.Node]:
    op = torch.ops.moe.router_metrics_
    return [n for n in graph.nodes if n.op == "call_function" and n.target in (op, op.default)]


def _arg(node: fx.Node, pos: int, *names: str, default: object = None) -> object:
    if len(node.args) > pos:
        return node.args[pos]
    for name in names:
        if name in node.kwargs:
            return node.kwargs[name]
    return default


def module_path(node: fx.Node) -> str:
    """The innermost module path of ``node`` (``model.layers.0.mlp.gate``; ``""`` at the top level)."""
    name = layer_name(node, default="<graph>")
    return "" if name == "<graph>" else name


# ----------------------------------------------------------------------------------------- rewrite


def _insert(graph: fx.Graph, gm: torch.nn.Module, r: Router) -> None:
    if r.expert_idx is None:  # an argmax router: its choices side by side, [T, K]
        with graph.inserting_after(r.topk):
            r.expert_idx = graph_call(graph, torch.stack, list(r.choices), -1, meta_from=r.topk)
    logits_val = _val(r.logits)
    entry = metrics.accumulator(r.path or "router", r.num_experts, logits_val.device)
    capacity_factor, group = _capacity(r, entry)
    attr = _register_accumulator(gm, entry.acc_S)
    anchor = r.expert_idx
    with graph.inserting_after(anchor):
        acc_node = graph.get_attr(attr)
    with graph.inserting_after(acc_node):
        call = graph.call_function(
            torch.ops.moe.router_metrics_.default,
            (acc_node, r.logits, r.expert_idx, capacity_factor, group),
        )
    fake_mode = getattr(logits_val, "fake_mode", None)
    acc_val = fake_mode.from_tensor(entry.acc_S, static_shapes=True) if fake_mode is not None else entry.acc_S
    for node, val in ((acc_node, acc_val), (call, None)):
        node.meta["example_value"] = val
        node.meta["val"] = val
        for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
            if key in r.topk.meta:
                node.meta[key] = r.topk.meta[key]


def _capacity(r: Router, entry: metrics.LayerAccumulator) -> tuple[float, int]:
    """``(capacity_factor, capacity_group)`` of ``router_metrics_`` for ``r``: the user's factor, or where a rewrite
    marked the router's layer as dropping (capacity_dispatch, drop_and_pad; expert_parallel per destination rank) its
    choices past ``C`` per expert (per block of ``group`` experts), the factor at which over_capacity counts exactly
    those: ``ceil(factor * T*K / (E/group)) == C`` (the half keeps the ceil at ``C`` whatever the float rounding)."""
    dropping = r.topk.meta.get(CAPACITY_META)
    idx_val = _val(r.expert_idx)
    if isinstance(dropping, int) and idx_val is not None and isinstance(idx_val.numel(), int):
        group = r.topk.meta.get(CAPACITY_GROUP_META, 1)
        entry.drops = True
        return (dropping - 0.5) * (r.num_experts // group) / idx_val.numel(), group
    return float(entry.capacity_factor or 0.0), 1


def _set_capacity(call: fx.Node, r: Router) -> None:
    """Give an attach hook's ``router_metrics_`` node the capacity a rewrite marked on the same router."""
    entry = metrics.accumulator(r.path or "router", r.num_experts, _val(r.logits).device)
    capacity_factor, group = _capacity(r, entry)
    call.args = (*call.args[:3], capacity_factor, group)
    call.kwargs = {}


def _register_accumulator(gm: torch.nn.Module, acc_S: torch.Tensor) -> str:
    for name, buf in gm.named_buffers(recurse=False):
        if buf is acc_S:
            return name
    i = 0
    while hasattr(gm, f"{ACC_ATTR_PREFIX}{i}"):
        i += 1
    name = f"{ACC_ATTR_PREFIX}{i}"
    gm.register_buffer(name, acc_S, persistent=False)
    # AOTAutograd lifts the module's buffers to graph inputs and, for a Dynamo graph, asks where each
    # came from (for guards, dedup and static-input marking): a constant source, no guard.
    sources = getattr(gm, "_param_name_to_source", None)
    if sources is not None:
        from torch._dynamo.source import ConstantSource

        sources[name] = ConstantSource(f"moe_compile.metrics[{name}]")
    return name


def _late_pre_grad_timing() -> bool:
    """True when Inductor runs this pass after AOTAutograd has collected the module's buffers (torch
    2.13's "late" pre-grad timing): a buffer registered now would not become a graph input and the
    trace would fail. Outside Inductor (no pre-grad hook installed) the caller runs us before AOT."""
    if torch._inductor.config.pre_grad_custom_pass is None:
        return False
    try:
        from torch._inductor.codecache import resolve_pre_grad_pass_timing
    except ImportError:  # torch 2.11: pre-grad passes always run before AOTAutograd
        return False
    return resolve_pre_grad_pass_timing() == "late"
