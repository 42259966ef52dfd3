"""Shared checks for the host-padding tests: compile a layer, keep its post-grad graphs, compare with eager.

``run_layer(model, x, path=..., train=...)`` compiles through ``moe_compile.compile`` (``path="api"``:
no ``fullgraph``, the capture-flags path) or ``torch.compile(backend="moe_compile", fullgraph=True)``
(``path="backend"``), with fresh caches (on an FX-graph-cache hit our passes would not run), runs one
step, and returns the output, the grads, the pass records and every post-grad graph (forward, plus
backward in training; see the compiler-mechanics note, section 7.2).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
from typing import Any

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.utils import get_first_incompatible_cudagraph_node

import moe_compile
from moe_compile import report
from moe_compile.passes import normalize
from tests import _tolerance as tol

T, H = 10, 16  # default tokens and hidden size of the test layers' inputs


def layer_input(seed: int, tokens: int = T, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A seeded random ``[tokens, H]`` layer input."""
    return torch.randn(tokens, H, generator=torch.Generator().manual_seed(seed)).to(dtype)


class KeepGraphs(CustomGraphPass):
    """A post-grad pass that only keeps the graph modules it sees (they are final once compiled)."""

    def __init__(self) -> None:
        self.graphs: list[fx.GraphModule] = []

    def __call__(self, graph: fx.Graph) -> None:
        self.graphs.append(graph.owning_module)

    def uuid(self) -> None:
        return None


@dataclasses.dataclass
class Result:
    out: torch.Tensor
    grads: dict[str, torch.Tensor]
    graphs: list[fx.GraphModule]
    records: report.Report
    # the layer's GEMM reduction lengths (the derived bound of tests/_tolerance.py::layer_rel)
    k_dims: list[int] = dataclasses.field(default_factory=list)


def fresh_caches():
    """Inductor and AOT caches off, so every compile runs our passes."""
    return _Stack(
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    )


class _Stack:
    def __init__(self, *cms: Any) -> None:
        self.cms = cms

    def __enter__(self) -> None:
        for cm in self.cms:
            cm.__enter__()

    def __exit__(self, *exc: Any) -> None:
        for cm in reversed(self.cms):
            cm.__exit__(*exc)


def compile_layer(model: Any, path: str, keep: KeepGraphs, passes: dict[str, bool] | None = None) -> Any:
    options = {"post_grad_custom_pre_pass": keep}
    if path == "api":
        return moe_compile.compile(model, passes=passes, options=options)
    if path == "backend":
        if passes:
            options["moe.passes"] = passes
        return torch.compile(model, backend="moe_compile", fullgraph=True, options=options)
    raise ValueError(f"path must be 'api' or 'backend', got {path!r}")


def _step(fn: Any, x: torch.Tensor, train: bool, params: Any = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = params
    if not train:
        with torch.no_grad():
            return fn(x), {}
    x = x.detach().clone().requires_grad_(True)
    out = fn(x)
    # a fixed random cotangent: a non-expanded grad (grouped GEMM backward rejects expanded ones)
    gen = torch.Generator().manual_seed(1)
    cot = torch.randn(out.shape, generator=gen).to(out.dtype)
    (out.float() * cot.float()).sum().backward()
    grads = {"x": x.grad}
    if model is not None:
        grads.update({name: p.grad for name, p in model.named_parameters() if p.grad is not None})
    return out.detach(), grads


def run_layer(
    model: torch.nn.Module, x: torch.Tensor, *, path: str, train: bool, passes: dict[str, bool] | None = None
) -> tuple[Result, Result]:
    """Compile a copy of ``model`` and run one step; returns (compiled result, eager result).

    The dispatch ops stay one node each (``decompose_custom_triton_ops`` off, torch.export's setting), so the
    kept post-grad graphs show the rewrite; by default they trace into CPU graphs as their references
    (NOTE [device-decomposed triton ops] (moe_compile/ops/_common.py)), which the other compiled tests run."""
    eager_model = copy.deepcopy(model)
    torch._dynamo.reset()
    keep = KeepGraphs()
    with fresh_caches(), report.collecting() as records, \
            torch._functorch.config.patch(decompose_custom_triton_ops=False):
        compiled = compile_layer(model, path, keep, passes)
        out, grads = _step(compiled, x, train, params=model)
    eager_out, eager_grads = _step(eager_model, x, train, params=eager_model)
    torch._dynamo.reset()
    k_dims = tol.gemm_k_dims(list(eager_model.parameters()))
    return (Result(out, grads, keep.graphs, records, k_dims),
            Result(eager_out, eager_grads, [], report.Report(), k_dims))


def assert_matches_eager(test: Any, got: Result, want: Result) -> None:
    """Output and grads within the layer's derived bound (``tests/_tolerance.py::layer_rel``)."""
    k_dims = want.k_dims or [want.out.shape[-1]]
    tol.assert_layer_close(got.out, want.out, k_dims, what="output")
    test.assertEqual(sorted(got.grads), sorted(want.grads))
    rows = want.grads["x"].shape[0] if "x" in want.grads else 1
    for name, grad in want.grads.items():
        tol.assert_layer_close(got.grads[name], grad, k_dims, backward=True, rows=rows, what=name)


def check_pass_off_keeps_host_syncs(
    test: Any, model: torch.nn.Module, x: torch.Tensor, pass_name: str
) -> fx.GraphModule:
    """Negative control: with ``pass_name`` off, inference through the API matches eager, but its one
    post-grad graph is not CUDA-graph safe (the blocker check can fail); returns that graph."""
    got, want = run_layer(model, x, path="api", train=False, passes={pass_name: False})
    assert_matches_eager(test, got, want)
    (gm,) = got.graphs
    test.assertNotEqual(cudagraph_blockers(gm), [])
    return gm


def cudagraph_blockers(gm: fx.GraphModule) -> list[str]:
    """Why ``gm`` could not be captured in a CUDA graph (empty list: capturable)."""
    reasons = []
    node = get_first_incompatible_cudagraph_node(gm)
    if node is not None:
        reasons.append(f"incompatible node {node.name} ({node.target})")
    unbacked = [n.name for n in gm.graph.nodes if n.meta.get("unbacked_bindings")]
    if unbacked:
        reasons.append(f"unbacked bindings {unbacked[:4]}")
    sym_inputs = [
        n.name for n in gm.graph.find_nodes(op="placeholder") if isinstance(n.meta.get("val"), torch.SymInt)
    ]
    if sym_inputs:
        reasons.append(f"SymInt placeholders {sym_inputs[:4]}")
    return reasons


def op_counts(gm: fx.GraphModule) -> collections.Counter:
    return collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def dynamo_graph(model: Any, *args: Any, grad: bool = False) -> tuple[fx.GraphModule, list[Any]]:
    """The Dynamo graph of ``model(*args)`` (``fullgraph=True``) before any backend pass, and its inputs.

    Traced under ``no_grad`` (an inference graph) unless ``grad``.
    """
    graphs: list[tuple[fx.GraphModule, list[Any]]] = []

    def backend(gm: fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    with torch.set_grad_enabled(grad):
        torch.compile(model, backend=backend, fullgraph=True)(*args)
    torch._dynamo.reset()
    assert len(graphs) == 1, f"expected one graph, got {len(graphs)}"
    return graphs[0]


class RecordingContext:
    """A stand-in for ``PassContext`` that keeps the records (for running a pass on a graph directly)."""

    def __init__(self, training: bool = False) -> None:
        self.records: list[tuple[str, str, str, str]] = []
        self.is_training = training

    def rewrite(self, layer: str, matched: str, replaced_by: str, moe: bool = True) -> None:
        self.records.append(("rewrite", layer, matched, replaced_by))

    def skip(self, layer: str, reason: str, detail: str = "") -> None:
        self.records.append(("skip", layer, reason, detail))

    def kinds(self, kind: str) -> list[str]:
        return [r[2] for r in self.records if r[0] == kind]


def run_pass(pass_run: Any, gm: fx.GraphModule) -> RecordingContext:
    """Run one pass (``module.run``) on a Dynamo graph in place, lint and recompile it."""
    ctx = RecordingContext()
    pass_run(gm.graph, ctx)
    gm.graph.lint()
    gm.recompile()
    return ctx


def run_pass_on_layer(
    pass_run: Any, model: Any, x: torch.Tensor
) -> tuple[fx.GraphModule, list[Any], RecordingContext]:
    """Dynamo's inference graph of ``model(x)`` in normal form (``normalize``, the first pre-grad pass, as the
    backend runs it) with one pass run on it: (graph, its inputs, that pass's records)."""
    gm, inputs = dynamo_graph(model, x)
    run_pass(normalize.run, gm)
    return gm, inputs, run_pass(pass_run, gm)
