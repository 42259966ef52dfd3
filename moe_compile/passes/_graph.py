"""FX helpers shared by moe_compile's passes (mostly for Dynamo's Torch IR, the pre-grad stage).

Dynamo's graphs are neither functional nor normalized: one op can show up as ``call_function``
(``torch.sort``, ``operator.getitem``) or ``call_method`` (``"sort"``), with positional or keyword
arguments. :func:`op_name` and :func:`arg` give one view over these spellings, :func:`graph_call`
inserts a node with a valid ``example_value``, :func:`layer_name` turns ``nn_module_stack`` into a
module path (``model.layers.0.mlp.experts``), and :func:`erase_dead` removes what a rewrite left
unused without touching unrelated nodes (``Graph.eliminate_dead_code`` drops in-place method calls).
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

# operator.* functions Dynamo emits, by the name we match on
_OPERATOR_NAMES = {
    operator.getitem: "getitem",
    operator.setitem: "setitem",
    operator.floordiv: "floordiv",
    operator.add: "add",
    operator.iadd: "add_",
    operator.sub: "sub",
    operator.isub: "sub_",
    operator.mul: "mul",
    operator.imul: "mul_",
    operator.truediv: "truediv",
    operator.itruediv: "truediv_",
    operator.neg: "neg",
    operator.eq: "eq",
    operator.ne: "ne",
    operator.lt: "lt",
    operator.le: "le",
    operator.gt: "gt",
    operator.ge: "ge",
    operator.pow: "pow",
    operator.mod: "mod",
    operator.and_: "and",
    operator.or_: "or",
}


def op_name(node: fx.Node) -> str | None:
    """A spelling-independent name for a ``call_function`` / ``call_method`` node, else None.

    ``torch.sort``, ``torch.Tensor.sort`` and ``x.sort()`` are all ``"sort"``; ``torch.nn.functional.silu``
    is ``"silu"``; ``operator.getitem`` is ``"getitem"``; ``torch.ops.aten.sort.default`` is ``"aten.sort"``;
    other OpOverloads / packets are ``"<namespace>.<name>"`` (``"transformers.grouped_mm_fallback"``).
    """
    if node.op == "call_method":
        return str(node.target)
    if node.op != "call_function":
        return None
    target = node.target
    if target in _OPERATOR_NAMES:
        return _OPERATOR_NAMES[target]
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        packet = target.overloadpacket if isinstance(target, torch._ops.OpOverload) else target
        return f"{packet._qualified_op_name.replace('::', '.')}"
    name = getattr(target, "__name__", None)
    if name is None:
        return None
    if name == "one_hot":  # torch._C._nn.one_hot and F.one_hot
        return "one_hot"
    return name


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``index`` (positional, counting ``self`` of a method as 0) or keyword ``name``."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def val(node: Any) -> Any:
    """The example value of a node (``example_value`` in Dynamo graphs, ``val`` after AOT), or the
    object itself when it is not a node."""
    if not isinstance(node, fx.Node):
        return node
    if "example_value" in node.meta:
        return node.meta["example_value"]
    return node.meta.get("val")


def tensor_val(node: Any) -> torch.Tensor | None:
    v = val(node)
    return v if isinstance(v, torch.Tensor) else None


def same_int(a: Any, b: Any) -> bool:
    """``a == b`` for ints / SymInts / nodes holding them, True only when provably equal."""
    a, b = val(a), val(b)
    if isinstance(a, bool) or isinstance(b, bool):
        return False
    if not isinstance(a, (int, torch.SymInt)) or not isinstance(b, (int, torch.SymInt)):
        return False
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return statically_known_true(a == b)


def same_shape(a: Iterable[Any], b: Iterable[Any]) -> bool:
    a, b = tuple(a), tuple(b)
    return len(a) == len(b) and all(same_int(x, y) for x, y in zip(a, b))


def known_int(x: Any) -> int | None:
    """A plain int for ``x`` (node, SymInt or int) when it is a compile-time constant."""
    x = val(x)
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return x
    if isinstance(x, torch.SymInt):
        try:
            return int(x.node.maybe_as_int()) if x.node.maybe_as_int() is not None else None
        except Exception:  # noqa: BLE001 - symbolic, no constant value
            return None
    return None


def _fake_mode(values: Iterable[Any]):
    """The fake mode that owns the example values (not the ambient one: AOTAutograd may run the
    pre-grad passes under a different mode than the one Dynamo traced with)."""
    from torch._guards import detect_fake_mode

    values = list(values)
    owner = _owning_fake_mode(values)
    return owner if owner is not None else detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])


def _owning_fake_mode(values: Iterable[Any]):
    """The mode of the first FakeTensor among ``values``, looking inside tensor subclasses (a quantised weight is
    no FakeTensor, its inner tensors are); None without one."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    for v in values:
        if isinstance(v, FakeTensor):
            return v.fake_mode
        if is_traceable_wrapper_subclass(v):
            inner = _owning_fake_mode(getattr(v, name) for name in v.__tensor_flatten__()[0])
            if inner is not None:
                return inner
    return None


def fake_eval(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``target`` on the example values of ``args``/``kwargs`` under their fake mode."""
    args_v = fx.node.map_arg(args, val)
    kwargs_v = fx.node.map_arg(kwargs, val)
    flat = torch.utils._pytree.tree_leaves((args_v, kwargs_v))
    mode = _fake_mode(flat)
    if mode is None:
        raise RuntimeError(f"graph_call({target}): no fake mode found in the example values of its inputs")
    with mode:
        return target(*args_v, **kwargs_v)


def graph_call(graph: fx.Graph, target: Any, *args: Any, meta_from: fx.Node | None = None,
               name: str | None = None, **kwargs: Any) -> fx.Node:
    """Insert ``call_function(target, args, kwargs)`` at the graph's insertion point.

    The new node's ``example_value`` (and ``val``, when ``meta_from`` uses ``val``) comes from running
    ``target`` on fake values (``name``, if given, is the new node's name, made unique); ``nn_module_stack``, ``stack_trace`` and ``source_fn_stack`` are copied
    from ``meta_from`` so the node belongs to the same layer.
    """
    node = graph.create_node("call_function", target, tuple(args), dict(kwargs), name=name)
    value = fake_eval(target, tuple(args), dict(kwargs))
    key = "val" if meta_from is not None and "val" in meta_from.meta and "example_value" not in meta_from.meta \
        else "example_value"
    node.meta[key] = value
    if meta_from is not None:
        for k in ("nn_module_stack", "stack_trace", "source_fn_stack", "seq_nr"):
            if k in meta_from.meta:
                node.meta[k] = meta_from.meta[k]
    return node


_INDEX_RE = re.compile(r"\[(\d+)\]")
_MODULES_RE = re.compile(r"\._modules\[['\"]([^'\"]+)['\"]\]")


def module_path(dynamo_path: str) -> str:
    """``"L['self'].model.layers[0].mlp.experts"`` -> ``"model.layers.0.mlp.experts"``."""
    path = _MODULES_RE.sub(r".\1", dynamo_path)
    path = re.sub(r"^(L|G)\[['\"][^'\"]+['\"]\]\.?", "", path)
    path = _INDEX_RE.sub(r".\1", path)
    return path.strip(".") or "<root>"


def layer_name(node: fx.Node, default: str | None = None) -> str:
    """The innermost module path of ``node`` from ``nn_module_stack`` (``model.layers.0.mlp.experts``).

    Backward nodes of joint graphs use the module stack of the forward node they differentiate
    (``fwd_nn_module_stack``). Falls back to ``default`` or ``"<graph>"`` when the node carries no module
    stack (a function).
    """
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if stack:
        path = list(stack.values())[-1]
        path = path[0] if isinstance(path, tuple) else str(path)
        return module_path(path)
    return default or "<graph>"


SIZE_QUERIES = frozenset({"aten.sym_size", "aten.sym_numel", "aten.sym_stride", "sym_size", "size", "dim", "numel"})


def outside_users(nodes: Iterable[fx.Node], allowed: Iterable[fx.Node]) -> list[fx.Node]:
    """Users of ``nodes`` not in ``allowed`` that read more than a size.

    Size queries (``sym_size.int`` and friends, which Dynamo adds with their ``_assert_scalar`` checks
    after slicing by an unbacked length) do not make a value escape a region: once the region is
    rewritten, :func:`~moe_compile.passes._host_sync.erase_dead_host_reads` erases the ones whose values
    feed no tensor op, and any other keeps the old value alive, still correct.
    """
    allowed = set(allowed)
    return [u for n in nodes for u in n.users if u not in allowed and op_name(u) not in SIZE_QUERIES]


def is_inplace(node: fx.Node) -> bool:
    """True for in-place calls (``x.add_(y)``, ``operator.setitem``, ``x += y``)."""
    name = op_name(node)
    if name is None:
        return False
    return name == "setitem" or (name.endswith("_") and not name.endswith("__"))


def erase_dead(graph: fx.Graph, candidates: Iterable[fx.Node]) -> int:
    """Erase ``candidates`` (and their producers, transitively) once nothing uses them.

    Only ``call_function`` / ``call_method`` nodes are erased. An in-place call (``setitem``,
    ``index_add_``) is erased only if it was given explicitly and every other user of the tensor it
    mutates is gone or is itself an explicit in-place call. Impure producers are kept. Returns the count.
    """
    explicit = set(candidates)
    erased = 0
    changed = True
    while changed:
        changed = False
        work = list(explicit)
        while work:
            node = work.pop()
            if getattr(node, "_erased", False) or node.graph is not graph:
                continue
            if node.op not in ("call_function", "call_method") or node.users:
                continue
            if is_inplace(node):
                if node not in explicit:
                    continue
                target = node.args[0] if node.args else None
                if isinstance(target, fx.Node) and any(
                    u is not node and not (u in explicit and is_inplace(u)) for u in target.users
                ):
                    continue
            elif node.is_impure():
                continue
            inputs = list(node.all_input_nodes)
            graph.erase_node(node)
            erased += 1
            changed = True
            work.extend(inputs)
    return erased


def topo_index(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


__all__ = [
    "arg",
    "erase_dead",
    "fake_eval",
    "graph_call",
    "insert_traced",
    "is_inplace",
    "known_int",
    "layer_name",
    "module_path",
    "op_name",
    "same_int",
    "same_shape",
    "tensor_val",
    "topo_index",
    "val",
]


def insert_traced(graph: fx.Graph, fn: Any, args: tuple[fx.Node, ...], meta_from: fx.Node | None = None) -> Any:
    """Trace ``fn(*args)`` to ATen with Inductor's decompositions (what joint and post-grad graphs hold)
    on the args' fake values and copy it in at the graph's insertion point; returns the output node(s).

    Use it where inserted nodes must already be in Inductor's decomposed form (the joint stage).
    """
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    values = [val(a) for a in args]
    mode = _fake_mode(values)
    with mode:
        traced = make_fx(fn, decomposition_table=select_decomp_table())(*values)
    env = dict(zip(traced.graph.find_nodes(op="placeholder"), args))
    out = graph.graph_copy(traced.graph, env)
    if meta_from is not None:
        for new in env.values():
            if new in args:
                continue
            for k in ("nn_module_stack", "stack_trace", "source_fn_stack", "seq_nr"):
                if k in meta_from.meta:
                    new.meta.setdefault(k, meta_from.meta[k])
    return out
