"""What a compiled graph still does that is non-deterministic or not CUDA-graph safe, per layer.

Matches (each finding becomes a ``left`` record of the :class:`~moe_compile.report.Report`):

* ``accumulate``: an accumulating scatter (``index_put(accumulate=True)``, ``scatter_add``,
  ``index_add``, ``scatter_reduce``, ``embedding_dense_backward``; the table is
  :func:`moe_compile.passes.forms.accumulate.is_accumulating`): Inductor lowers it to atomic adds on the GPU,
  so results can differ run to run; one that adds at most once per element is not reported
  (:func:`moe_compile.passes.forms.accumulate.order_dependent`);
* ``nondeterministic``: a library kernel that is not reproducible run to run on its device (attention
  backward on CUDA, ...; the table is :data:`moe_compile.passes.forms.accumulate.NONDETERMINISTIC_OPS`);
* ``host_sync``: a value read to the host or a data-dependent shape (``_local_scalar_dense``,
  ``nonzero``, a node with unbacked symbols): a device sync, and CUDA graphs cannot capture it.

``what`` names the op (``scatter_add [backward of gather]``), ``detail`` the model source line from the
node's stack trace. The token embedding's backward is tagged ``embedding``: it lies outside any MoE
layer and :attr:`Report.clean <moe_compile.report.Report.clean>` does not count it.

Rewrites to:
    nothing: the pass only reads the graph.

Stage:
    post_grad, last: the forward and the backward graph after every rewrite (ATen; device-independent,
    it reads ops, not generated code).
"""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.fx as fx

from moe_compile import report
from moe_compile.passes import PassContext
from moe_compile.passes._graph import layer_name
from moe_compile.passes.forms.accumulate import nondeterministic_reason, order_dependent

aten = torch.ops.aten

HOST_SYNC_OPS = {
    aten._local_scalar_dense.default: "value read to the host",
    aten.nonzero.default: "data-dependent row count",
    aten.masked_select.default: "data-dependent row count",
    aten.unique_consecutive.default: "data-dependent size",
    aten._unique2.default: "data-dependent size",
}


@dataclasses.dataclass(frozen=True)
class Finding:
    layer: str
    kind: str  # "accumulate" | "nondeterministic" | "host_sync"
    what: str
    source: str


def run(graph: fx.Graph, ctx: PassContext) -> None:
    """The post-grad audit pass: records what is left; never changes the graph."""
    seen = set()
    for f in find(graph):
        if f in seen:
            continue
        seen.add(f)
        report.add(report.PassRecord("audit", ctx.stage, "left", f.layer, f"{f.kind}: {f.what}", f.source))


def _source_line(node: fx.Node) -> str:
    """``file:line: code`` of the innermost user frame of the node's stack trace."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*([^\n]*)', trace)
    if not frames:
        return "(no stack trace)"
    path, line, code = frames[-1]
    return f"{path.rsplit('/', 2)[-2] + '/' if '/' in path else ''}{path.rsplit('/', 1)[-1]}:{line}: {code.strip()}"


def _forward_op(node: fx.Node) -> str | None:
    stack = node.meta.get("fwd_source_fn_stack") or node.meta.get("source_fn_stack") or []
    return str(stack[-1][0]) if stack else None


def find(graph: fx.Graph) -> list[Finding]:
    """Every accumulating scatter, non-deterministic library op and host sync of ``graph`` (see the module
    docstring)."""
    found = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        layer = layer_name(node)
        op = getattr(node.target, "__name__", str(node.target))
        fwd = _forward_op(node)
        backward = node.meta.get("partitioner_tag") == "is_backward" or "fwd_nn_module_stack" in node.meta
        if order_dependent(node):
            tag = "embedding" if fwd is not None and "embedding" in fwd else None
            what = op + (f" [backward of {fwd}]" if backward and fwd else "") + (f" ({tag})" if tag else "")
            found.append(Finding(layer, "accumulate", what, _source_line(node)))
        elif (why := nondeterministic_reason(node)) is not None:
            found.append(Finding(layer, "nondeterministic", f"{op} ({why})", _source_line(node)))
        elif node.target in HOST_SYNC_OPS:
            found.append(Finding(layer, "host_sync", f"{op} ({HOST_SYNC_OPS[node.target]})", _source_line(node)))
        elif node.meta.get("unbacked_bindings"):
            found.append(Finding(layer, "host_sync", f"{op} (unbacked size)", _source_line(node)))
    return found


__all__ = ["HOST_SYNC_OPS", "Finding", "find", "run"]
