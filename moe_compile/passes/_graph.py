"""FX helpers shared by moe_compile's passes (mostly for Dynamo's Torch IR, the pre-grad stage).

Dynamo's graphs are neither functional nor normalized: one op can show up as ``call_function``
(``torch.sort``, ``operator.getitem``) or ``call_method`` (``"sort"``), with positional or keyword
arguments. :func:`op_name` and :func:`arg` give one view over these spellings, :func:`graph_call`
inserts a node with a valid ``example_value``, :func:`layer_name` turns ``nn_module_stack`` into a
module path (``model.layers.0.mlp.experts``), and :func:`erase_dead` removes what a rewrite left
unused without touching unrelated nodes (``Graph.eliminate_dead_code`` drops in-place method calls).
:func:`refresh_example_values` recomputes what a rewrite made stale, and :func:`ops_available` says whether
moe_compile's own ops (``torch.ops.moe.*``) can be inserted.
"""

from __future__ import annotations

import contextlib
import operator
import re
from collections.abc import Iterable, Iterator
from typing import Any, overload

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.symbolic_shapes import (
    free_unbacked_symbols,
    statically_known_true,
)
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

import moe_compile.ops  # noqa: F401 - registers torch.ops.moe.*, which the passes insert

# The meta key on a router's ``topk`` node that carries its layer's static expert capacity (set by
# capacity_dispatch, read by router_metrics to report the choices dropped: ``moe/dropped_fraction``).
CAPACITY_META = "moe_capacity"
# With it, optionally: the capacity bounds blocks of this many consecutive experts (expert_parallel: a destination
# rank's local experts share its ``S`` rows of the static buffer); 1 when absent.
CAPACITY_GROUP_META = "moe_capacity_group"

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
        target = str(node.target)
        if target.startswith("__") and target.endswith("__"):
            # torch 2.11's Dynamo records ``a == b`` on tensors as the method ``__eq__`` (2.13: operator.eq)
            dunder = getattr(operator, target, None)
            if dunder in _OPERATOR_NAMES:
                return _OPERATOR_NAMES[dunder]
        return target
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


# Positional parameters of the ops whose arguments ``arg(node, "name")`` reads by name (``self`` of a method
# is position 0). An op not listed here is read by keyword only.
ARG_NAMES: dict[str, tuple[str, ...]] = {
    "split": ("self", "split_size_or_sections", "dim"),
    "split_with_sizes": ("self", "split_sizes", "dim"),
    "chunk": ("self", "chunks", "dim"),
    "cat": ("tensors", "dim"),
    "pad": ("input", "pad", "mode", "value"),
    "narrow": ("self", "dim", "start", "length"),
    "index_select": ("self", "dim", "index"),
    "masked_select": ("self", "mask"),
    "index_add_": ("self", "dim", "index", "source", "alpha"),
    "index_add": ("self", "dim", "index", "source", "alpha"),
    "scatter_add_": ("self", "dim", "index", "src"),
    "scatter_add": ("self", "dim", "index", "src"),
    "scatter": ("self", "dim", "index", "src", "value"),
    "scatter_": ("self", "dim", "index", "src", "value"),
    "argsort": ("self", "dim", "descending", "stable"),
    "sort": ("self", "dim", "descending", "stable"),
    "cumsum": ("self", "dim", "dtype"),
    "_grouped_mm": ("self", "mat2", "offs", "bias", "out_dtype"),
    "grouped_mm": ("self", "mat2", "offs", "bias", "out_dtype"),
    "moe.grouped_mm": ("self", "mat2", "offs"),
    "one_hot": ("self", "num_classes"),
    "sum": ("self", "dim", "keepdim", "dtype"),
    "transpose": ("self", "dim0", "dim1"),
    "expand": ("self",),
    "unsqueeze": ("self", "dim"),
    "new_zeros": ("self", "size"),
    "linear": ("input", "weight", "bias"),
    "gather": ("self", "dim", "index"),
    "diff": ("self", "n", "dim", "prepend", "append"),
    "histc": ("self", "bins", "min", "max"),
}


@overload
def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any: ...
@overload
def arg(node: fx.Node, index: str, *, default: Any = None) -> Any: ...


def arg(node: fx.Node, index: int | str, name: str | None = None, default: Any = None) -> Any:
    """An argument of ``node``, passed by position or by keyword, else ``default``.

    ``arg(n, 1, "dim")`` reads position 1 (``self`` of a method counts as 0) or keyword ``dim``;
    ``arg(n, "dim", default=0)`` takes the position of ``dim`` from :data:`ARG_NAMES` (keyword only for an
    op not in that table).
    """
    if isinstance(index, str):
        if name is not None:
            raise TypeError("arg(node, name, default=...): pass the default by keyword")
        name = index
        params = ARG_NAMES.get(op_name(node) or "", ())
        index = params.index(name) if name in params else None
    if index is not None and len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def is_call(node: Any, *names: str) -> bool:
    """True for a node whose :func:`op_name` is one of ``names``."""
    return isinstance(node, fx.Node) and op_name(node) in names


def val(node: Any) -> Any:
    """The example value of a node (``example_value`` in Dynamo graphs, ``val`` after AOT), or the
    object itself when it is not a node."""
    if not isinstance(node, fx.Node):
        return node
    if "example_value" in node.meta:
        return node.meta["example_value"]
    return node.meta.get("val")


def tensor_val(node: Any) -> torch.Tensor | None:
    """The example value of ``node`` when it is a tensor, else None."""
    v = val(node)
    return v if isinstance(v, torch.Tensor) else None


def has_unbacked_shape(node: Any) -> bool:
    """True when the example value of ``node`` (or a tensor in it) has a data-dependent (unbacked) size."""
    value = val(node)
    if isinstance(value, (list, tuple)):
        return any(has_unbacked_shape(v) for v in value)
    if isinstance(value, torch.Tensor):
        return bool(free_unbacked_symbols(value.shape))
    return False


def dim_index(dim: Any, ndim: int) -> int | None:
    """``dim`` as a non-negative index into ``ndim`` dims, or None when it is not a plain int."""
    return dim % ndim if isinstance(dim, int) and ndim > 0 else None


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


def static_shape(node: Any) -> tuple[int, ...] | None:
    """The shape of a node's tensor value as plain ints, or None (no tensor, or a symbolic size)."""
    t = tensor_val(node)
    if t is None:
        return None
    dims = tuple(known_int(s) for s in t.shape)
    return None if any(d is None for d in dims) else dims  # type: ignore[return-value]


def einsum_terms(node: fx.Node) -> tuple[list[str], str, list[fx.Node]] | None:
    """``(input terms, output term, operands)`` of ``einsum("ab,bc->ac", x, y)`` as Dynamo records it (an explicit
    output, no ellipsis, no repeated index within a term, every operand a node), else None."""
    if op_name(node) != "einsum" or node.kwargs or len(node.args) < 2 or not isinstance(node.args[0], str):
        return None
    eq = node.args[0].replace(" ", "")
    operands = list(node.args[1:])
    if "->" not in eq or "." in eq or not all(isinstance(o, fx.Node) for o in operands):
        return None
    lhs, out = eq.split("->")
    terms = lhs.split(",")
    if len(terms) != len(operands) or any(len(set(t)) != len(t) for t in (*terms, out)):
        return None
    return terms, out, operands


def fake_mode_of(values: Iterable[Any]) -> Any:
    """The fake mode to run on ``values`` (pytrees of example values), or None when they hold no tensor.

    The mode that owns the first FakeTensor among them, looking inside tensor subclasses (a quantised weight is
    no FakeTensor, its inner tensors are). Not the ambient one: AOTAutograd may run the pre-grad passes under a
    different mode than the one Dynamo traced with. Without a FakeTensor, the ambient or tracing context's mode
    when there are tensors; with no tensor at all (ints, SymInts), None.
    """
    leaves = torch.utils._pytree.tree_leaves(list(values))
    owner = _owning_fake_mode(leaves)
    if owner is not None:
        return owner
    tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
    if not tensors:
        return None
    mode = detect_fake_mode(tensors)
    if mode is None:
        raise RuntimeError("no fake mode found for the example values (real tensors outside any fake mode)")
    return mode


def _owning_fake_mode(values: Iterable[Any]) -> Any:
    """The mode of the first FakeTensor among ``values``, looking inside tensor subclasses; None without one."""
    for v in values:
        if isinstance(v, FakeTensor):
            return v.fake_mode
        if is_traceable_wrapper_subclass(v):
            inner = _owning_fake_mode(getattr(v, name) for name in v.__tensor_flatten__()[0])
            if inner is not None:
                return inner
    return None


def fake_eval(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], method: bool = False) -> Any:
    """Run ``target`` (a callable, or a method name of ``args[0]`` when ``method``) on the example values of
    ``args``/``kwargs`` under their fake mode (:func:`fake_mode_of`; with no tensor among them, as is)."""
    args_v = fx.node.map_arg(args, val)
    kwargs_v = fx.node.map_arg(kwargs, val)
    mode = fake_mode_of([args_v, kwargs_v])
    with mode if mode is not None else contextlib.nullcontext():
        if method:
            return getattr(args_v[0], target)(*args_v[1:], **kwargs_v)
        return target(*args_v, **kwargs_v)


_LAYER_META = ("nn_module_stack", "stack_trace", "source_fn_stack", "seq_nr")


def graph_call(graph: fx.Graph, target: Any, *args: Any, meta_from: fx.Node | None = None,
               name: str | None = None, **kwargs: Any) -> fx.Node:
    """Insert ``call_function(target, args, kwargs)`` at the graph's insertion point.

    The new node's ``example_value`` (``val`` instead when ``meta_from`` holds ``val`` and no ``example_value``,
    as after AOTAutograd) comes from :func:`fake_eval`; ``name``, if given, is the new node's name, made
    unique; ``nn_module_stack``, ``stack_trace``, ``source_fn_stack`` and ``seq_nr`` are copied from
    ``meta_from`` so the node belongs to the same layer.
    """
    node = graph.create_node("call_function", target, tuple(args), dict(kwargs), name=name)
    value = fake_eval(target, tuple(args), dict(kwargs))
    key = "val" if meta_from is not None and "val" in meta_from.meta and "example_value" not in meta_from.meta \
        else "example_value"
    node.meta[key] = value
    if meta_from is not None:
        for k in _LAYER_META:
            if k in meta_from.meta:
                node.meta[k] = meta_from.meta[k]
    return node


def refresh_example_values(nodes: Iterable[fx.Node]) -> None:
    """Recompute ``meta["example_value"]`` of ``nodes`` (given in graph order) from their inputs (Dynamo IR);
    a node whose value cannot be recomputed keeps its old one, and so does a node that binds an unbacked
    symbol (NOTE [refresh keeps unbacked bindings])."""
    for node in nodes:
        if node.op not in ("call_function", "call_method") or node.meta.get("unbacked_bindings"):
            continue
        try:
            with _no_fresh_unbacked_symbols(node) as fresh:
                value = fake_eval(node.target, node.args, node.kwargs, method=node.op == "call_method")
        except Exception:  # noqa: BLE001 - stale metadata is tolerable; AOTAutograd re-traces anyway
            continue
        if fresh:
            continue
        node.meta["example_value"] = value
        node.meta.pop("val", None)


# NOTE [refresh keeps unbacked bindings]: a node that makes a data-dependent value (``C[i].item()`` of a
# ``.tolist()``, ``nonzero``) binds a fresh unbacked symbol (``u0``), recorded in its ``unbacked_bindings`` meta,
# and every later node's value is written in that symbol. Evaluating such a node again allocates another symbol
# (``u8``) that no node binds: the fake mode's shape env keeps it as pending, and AOTAutograd's trace of the
# graph then fails with ``PendingUnbackedSymbolNotFound`` (JetMoE, two host-sized loops: the rewrite of the first
# refreshed everything downstream, the second loop's ``.tolist()`` reads included, issue 35). The old value stays
# right: a rewrite changes how a value is computed, never which data it depends on. So such a node keeps its
# value, and a refresh that would allocate a fresh unbacked symbol anyway is undone and keeps the old one.


@contextlib.contextmanager
def _no_fresh_unbacked_symbols(node: fx.Node) -> Iterator[list[Any]]:
    """Yield a list that holds, after the block, the unbacked symbols the block allocated; they are taken off the
    shape env's pending list (no node binds them)."""
    mode = fake_mode_of(fx.node.map_arg((node.args, node.kwargs), val))
    pending = getattr(getattr(mode, "shape_env", None), "pending_fresh_unbacked_symbols", None)
    before = len(pending) if pending is not None else 0
    fresh: list[Any] = []
    try:
        yield fresh
    finally:
        if pending is not None and len(pending) > before:
            fresh.extend(pending[before:])
            del pending[before:]


def ops_available(*names: str) -> bool:
    """True when every ``torch.ops.moe.<name>`` is registered (what a pass inserts must exist)."""
    return all(hasattr(torch.ops.moe, n) for n in names)


_INDEX_RE = re.compile(r"\[(\d+)\]")
_MODULES_RE = re.compile(r"\._modules\[['\"]([^'\"]+)['\"]\]")


def module_path(dynamo_path: str) -> str:
    """``"L['self'].model.layers[0].mlp.experts"`` -> ``"model.layers.0.mlp.experts"``; a module reached through a
    bound method (``layers[0].self_attn.forward.__self__.q_proj``, a forward wrapped or swapped on the instance) is
    named by its module path (``layers.0.self_attn.q_proj``)."""
    path = _MODULES_RE.sub(r".\1", dynamo_path)
    path = re.sub(r"^(L|G)\[['\"][^'\"]+['\"]\]\.?", "", path)
    path = _INDEX_RE.sub(r".\1", path)
    path = re.sub(r"\.\w+\.__self__(?=\.|$)", "", "." + path)
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


# methods and functions whose result may share its first argument's storage (Torch IR)
VIEW_METHODS = frozenset({
    "view", "reshape", "view_as", "reshape_as", "expand", "expand_as", "unsqueeze", "squeeze", "flatten",
    "unflatten", "transpose", "permute", "t", "narrow", "select", "split", "chunk", "unbind", "movedim",
    "swapaxes", "as_strided", "contiguous", "to", "type_as", "detach", "alias", "__getitem__", "diagonal",
})


def aliased_inputs(node: fx.Node) -> list[fx.Node]:
    """The nodes whose storage ``node``'s output may share (a view's base), for walking a mutation back (ATen ops by
    their schema's alias annotations, Torch IR by :data:`VIEW_METHODS`)."""
    target = node.target
    schema = getattr(target, "_schema", None)
    if schema is not None:
        return [a for a, s in zip(node.args, schema.arguments) if isinstance(a, fx.Node)
                and s.alias_info is not None]
    name = target if node.op == "call_method" else getattr(target, "__name__", "")
    if name in VIEW_METHODS or target is operator.getitem:
        return [a for a in node.args[:1] if isinstance(a, fx.Node)]
    return []


def written_args(node: fx.Node) -> list[Any]:
    """The arguments ``node`` writes to (ATen ops by their schema, Torch IR: ``x.op_(...)``, ``setitem``, ``out=``)."""
    target = node.target
    schema = getattr(target, "_schema", None)
    if schema is not None:
        written = []
        for i, s in enumerate(schema.arguments):
            if s.alias_info is not None and s.alias_info.is_write:
                written.append(node.args[i] if i < len(node.args) else node.kwargs.get(s.name))
        return written
    if target is operator.setitem:
        return [node.args[0]]
    name = target if node.op == "call_method" else getattr(target, "__name__", "")
    written = [node.kwargs["out"]] if "out" in node.kwargs else []
    if isinstance(name, str) and name.endswith("_") and not name.startswith("_") and node.args:
        written.append(node.args[0])
    return written


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
    """Each node's position in graph order."""
    return {n: i for i, n in enumerate(graph.nodes)}


def transitive_users(start: fx.Node) -> set[fx.Node]:
    """Every node that uses ``start``, directly or through other nodes (``start`` itself not included)."""
    seen: set[fx.Node] = set()
    stack = [start]
    while stack:
        for u in stack.pop().users:
            if u not in seen:
                seen.add(u)
                stack.append(u)
    return seen


def replace_uses_after(old: fx.Node, new: fx.Node, after: fx.Node) -> None:
    """Point the uses of ``old`` that come after ``after`` in graph order at ``new``."""
    order = topo_index(old.graph)
    for user in list(old.users):
        if order[user] > order[after] and user is not new:
            user.replace_input_with(old, new)


__all__ = [
    "ARG_NAMES",
    "arg",
    "dim_index",
    "erase_dead",
    "fake_eval",
    "fake_mode_of",
    "graph_call",
    "has_unbacked_shape",
    "insert_traced",
    "is_call",
    "is_inplace",
    "known_int",
    "layer_name",
    "module_path",
    "op_name",
    "ops_available",
    "outside_users",
    "refresh_example_values",
    "replace_uses_after",
    "same_int",
    "same_shape",
    "tensor_val",
    "topo_index",
    "transitive_users",
    "val",
]


def _functional(fn: Any) -> Any:
    """``fn`` run on functional tensors under ``FunctionalTensorMode`` (AOTAutograd's functionalization)."""
    from torch._functorch._aot_autograd.functional_utils import from_fun, to_fun
    from torch._subclasses.functional_tensor import FunctionalTensorMode
    from torch.utils._pytree import tree_map

    def run(*args: Any) -> Any:
        with FunctionalTensorMode():
            out = fn(*tree_map(to_fun, args))
        return tree_map(from_fun, out)
    return run


def insert_traced(graph: fx.Graph, fn: Any, args: tuple[fx.Node, ...], meta_from: fx.Node | None = None) -> Any:
    """Trace ``fn(*args)`` to ATen with Inductor's decompositions (what joint and post-grad graphs hold)
    on the args' fake values and copy it in at the graph's insertion point; returns the output node(s).

    Use it where inserted nodes must already be in Inductor's decomposed form (the joint stage). Traced under
    functionalization, as AOTAutograd traces: our Triton ops then decompose into their kernels
    (NOTE [device-decomposed triton ops] (moe_compile/ops/_common.py)), which Inductor launches from its own code,
    instead of staying custom-op nodes that Inductor calls back into Python for (host time per call).
    """
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    values = [val(a) for a in args]
    mode = fake_mode_of(values)
    with mode:
        traced = make_fx(_functional(fn), decomposition_table=select_decomp_table())(*values)
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
