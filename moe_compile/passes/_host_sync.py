"""Host reads for the host-sync passes (``strip_host_padding``, ``fuse_expert_loop``), on Dynamo's Torch IR.

The general FX helpers these passes use (arguments, example values, inserting nodes) are
:mod:`moe_compile.passes._graph`'s.

* Host reads: :func:`host_reads` finds ``C[i].item()`` (what ``C.tolist()`` becomes) and maps each unbacked
  symbol to the device tensor element it came from.
* Symbolic values: :func:`int_vector` evaluates small int tensors (counts, offsets) as lists of sympy
  expressions in per-element leaf symbols, so that "the host offsets equal cumsum(ceil(counts/a)*a)" or
  "this pad length is 0" are checked by evaluating both sides on sample values (:func:`same_on_samples`).
* Clean-up: :func:`erase_dead_host_reads` erases host reads whose values no longer reach a tensor op,
  together with their ``_assert_scalar`` checks (side-effecting, so plain DCE keeps them).
"""

from __future__ import annotations

import dataclasses
import operator
import random
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.utils._sympy.functions import FloorDiv

from moe_compile.passes._graph import arg, is_call, op_name, tensor_val, val

ASSERT_TARGETS = {
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
    torch._check,
    torch._check_is_size,
}


# ---------------------------------------------------------------------------------------------------
# host reads and symbolic integers
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HostRead:
    """``tensor[index].item()`` (``index`` None for a 0-d ``tensor.item()``), producing ``symbol``."""

    item: fx.Node
    tensor: fx.Node
    index: int | None
    symbol: sympy.Symbol


def host_reads(graph: fx.Graph) -> dict[sympy.Symbol, HostRead]:
    reads: dict[sympy.Symbol, HostRead] = {}
    for node in graph.nodes:
        if op_name(node) not in ("item", "aten._local_scalar_dense"):
            continue
        value = val(node)
        if not isinstance(value, torch.SymInt) or not isinstance(value.node.expr, sympy.Symbol):
            continue
        source = node.args[0]
        tensor, index = source, None
        if is_call(source, "getitem") and isinstance(source.args[1], int):
            tensor, index = source.args[0], source.args[1]
        reads[value.node.expr] = HostRead(node, tensor, index, value.node.expr)
    return reads


def sym_expr(value: Any) -> sympy.Expr | None:
    """The sympy expression of an int, a SymInt, or a node whose example value is one."""
    value = val(value)
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return sympy.Integer(value)
    if isinstance(value, torch.SymInt):
        return value.node.expr
    return None


def same_on_samples(
    pairs: Sequence[tuple[sympy.Expr, sympy.Expr]],
    symbols: Iterable[sympy.Symbol],
    num_samples: int = 24,
    high: int = 600,
) -> bool:
    """True if every ``lhs == rhs`` holds on edge-case and random non-negative values of ``symbols``.

    The expressions are piecewise-linear in counts (floor division by an alignment <= 256), so values
    around 0, 1 and a few periods plus random draws exercise every branch that matters.
    """
    symbols = sorted(set(symbols), key=str)
    rng = random.Random(0)
    edge = (0, 1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 127, 128, 129, 255, 256, 257)
    samples = [dict.fromkeys(symbols, v) for v in edge]
    samples += [{s: rng.randrange(high) for s in symbols} for _ in range(num_samples)]
    for sample in samples:
        subs = {s: sympy.Integer(v) for s, v in sample.items()}
        for lhs, rhs in pairs:
            a, b = sympy.sympify(lhs).xreplace(subs), sympy.sympify(rhs).xreplace(subs)
            if not (a.is_number and b.is_number) or a != b:
                return False
    return True


def ceil_align(n: sympy.Expr, align: int) -> sympy.Expr:
    return align * FloorDiv(n + (align - 1), align)


def leaf_vector(node: fx.Node, length: int) -> list[sympy.Expr]:
    return [sympy.Symbol(f"{node.name}__{i}", integer=True, nonnegative=True) for i in range(length)]


def int_vector(
    node: Any, reads: dict[sympy.Symbol, HostRead], leaves: Callable[[fx.Node], list[sympy.Expr] | None] | None = None
) -> list[sympy.Expr] | None:
    """Evaluate a small 1-D int tensor as sympy expressions, or None if it is not understood.

    Understood: ``torch.tensor(list of SymInts/ints)``, ``cumsum(0)``, dtype/device casts, elementwise
    ``+ - * //`` with ints, ``diff`` (with ``prepend``), ``cat`` and ``leaves(node)`` for tensors the caller
    knows (e.g. counts). Any other 1-D tensor becomes a vector of leaf symbols.
    Host reads of a tensor are replaced by the symbols of that tensor's elements.
    """
    return IntVectorEval(reads, leaves).eval(node)


class IntVectorEval:
    def __init__(self, reads: dict[sympy.Symbol, HostRead], leaves: Callable | None) -> None:
        self.reads = reads
        self.leaves = leaves
        self.cache: dict[fx.Node, list[sympy.Expr] | None] = {}

    def scalar(self, value: Any) -> sympy.Expr | None:
        expr = sym_expr(value)
        if expr is None:
            return None
        subs = {}
        for sym in expr.free_symbols:
            read = self.reads.get(sym)
            if read is None or read.index is None:
                return None
            vec = self.eval(read.tensor)
            if vec is None or read.index >= len(vec):
                return None
            subs[sym] = vec[read.index]
        return expr.xreplace(subs)

    def eval(self, node: Any) -> list[sympy.Expr] | None:
        if not isinstance(node, fx.Node):
            return None
        if node not in self.cache:
            self.cache[node] = None  # cycles are impossible in a DAG, but keep recursion bounded
            self.cache[node] = self._eval(node)
        return self.cache[node]

    def _eval(self, node: fx.Node) -> list[sympy.Expr] | None:
        if self.leaves is not None:
            known = self.leaves(node)
            if known is not None:
                return known
        value = tensor_val(node)
        name = op_name(node)
        if name == "tensor":
            items = node.args[0]
            if not isinstance(items, (list, tuple)):
                return None
            out = [self.scalar(x) for x in items]
            return None if any(x is None for x in out) else out
        if value is None or value.dim() != 1 or not isinstance(value.shape[0], int):
            return None
        if value.dtype.is_floating_point or value.dtype == torch.bool:
            return None
        if name in ("to", "int", "long", "type", "contiguous", "clone", "detach", "cuda", "cpu"):
            return self.eval(node.args[0])
        if name == "cumsum":
            base = self.eval(node.args[0])
            dim = arg(node, "dim")
            if base is None or dim not in (0, -1):
                return None
            return [sympy.Add(*base[: i + 1]) for i in range(len(base))]
        if name in ("add", "sub", "mul", "floordiv", "__add__", "__sub__", "__mul__", "__floordiv__"):
            a, b = node.args[0], node.args[1]
            va = self.eval(a) if isinstance(a, fx.Node) and tensor_val(a) is not None else None
            vb = self.eval(b) if isinstance(b, fx.Node) and tensor_val(b) is not None else None
            if va is None and (tensor_val(a) is not None):
                return None
            if vb is None and (tensor_val(b) is not None):
                return None
            n = len(va if va is not None else vb)
            xa = va if va is not None else [sympy.Integer(a)] * n if isinstance(a, int) else None
            xb = vb if vb is not None else [sympy.Integer(b)] * n if isinstance(b, int) else None
            if xa is None or xb is None or len(xa) != len(xb):
                return None
            fn = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "floordiv": FloorDiv}
            return [fn[name.strip("_")](p, q) for p, q in zip(xa, xb)]
        if name == "diff":
            base = self.eval(node.args[0])
            prepend = arg(node, "prepend")
            if base is None or arg(node, "n", default=1) != 1 or arg(node, "append") is not None:
                return None
            if prepend is not None:
                pre = self.eval(prepend)
                if pre is None:
                    return None
                base = pre + base
            return [base[i + 1] - base[i] for i in range(len(base) - 1)]
        if name in ("cat", "concat", "concatenate"):
            parts = [self.eval(p) for p in node.args[0]]
            return None if any(p is None for p in parts) else [x for p in parts for x in p]
        if name in ("new_zeros", "zeros_like", "new_full", "zeros"):
            if name in ("new_zeros", "zeros", "zeros_like"):
                return [sympy.Integer(0)] * value.shape[0]
        return leaf_vector(node, value.shape[0])


# ---------------------------------------------------------------------------------------------------
# clean-up
# ---------------------------------------------------------------------------------------------------


def _is_scalar_node(node: fx.Node) -> bool:
    if node.op != "call_function" and node.op != "call_method":
        return False
    if node.target in ASSERT_TARGETS:
        return True
    value = val(node)
    return isinstance(value, (torch.SymInt, torch.SymBool, torch.SymFloat, int, bool, float)) and not isinstance(
        value, torch.Tensor
    )


def _is_pure(node: fx.Node) -> bool:
    if node.op == "call_method":
        name = str(node.target)
        return not (name.endswith("_") and not name.endswith("__"))
    if node.op == "call_function":
        if node.target in ASSERT_TARGETS:
            return False
        return not node.is_impure()
    return False


def erase_if_dead(nodes: Iterable[fx.Node]) -> int:
    """Erase pure nodes without users among ``nodes``, then their inputs, transitively. Returns the count."""
    work = list(nodes)
    erased = 0
    seen: set[fx.Node] = set()
    while work:
        node = work.pop()
        if node in seen or node.graph is None or node.users or not _is_pure(node):
            continue
        if node.op == "placeholder" or node.op == "output":
            continue
        seen.add(node)
        inputs = list(node.all_input_nodes)
        node.graph.erase_node(node)
        erased += 1
        work.extend(inputs)
    return erased


def erase_dead_host_reads(graph: fx.Graph) -> list[fx.Node]:
    """Erase host reads (``item``, ``sym_size`` of unbacked tensors) whose values reach no tensor op.

    An ``_assert_scalar`` (or ``torch._check``) is kept only if every host read it depends on stays;
    it does not keep a read alive by itself. Repeats until nothing changes (erasing a ``sym_size`` can
    free the tensor it read, whose size expression kept other reads alive). Returns the ``item`` nodes
    that remain.
    """
    while _erase_dead_host_reads_once(graph):
        pass
    return [n for n in graph.nodes if op_name(n) in ("item", "aten._local_scalar_dense")]


def _erase_dead_host_reads_once(graph: fx.Graph) -> int:
    scalar = [n for n in graph.nodes if _is_scalar_node(n)]
    scalar_set = set(scalar)
    live: set[fx.Node] = set()

    def mark(node: fx.Node) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            if n not in live and n in scalar_set:
                live.add(n)
                stack.extend(n.all_input_nodes)

    def roots(node: fx.Node) -> set[fx.Node]:
        out: set[fx.Node] = set()
        stack, seen = [node], set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            parents = [a for a in n.all_input_nodes if a in scalar_set]
            if not parents and n is not node:
                out.add(n)
            stack.extend(parents)
        return out

    for node in scalar:
        if node.target not in ASSERT_TARGETS and any(u not in scalar_set for u in node.users):
            mark(node)
    for node in scalar:
        if node.target in ASSERT_TARGETS and roots(node) <= live:
            live.add(node)
            for inp in node.all_input_nodes:
                mark(inp)
    inputs: list[fx.Node] = []
    erased = 0
    for node in reversed(scalar):
        if node in live or node.users:
            continue
        inputs.extend(i for i in node.all_input_nodes if i not in scalar_set)
        graph.erase_node(node)
        erased += 1
    return erased + erase_if_dead(inputs)
