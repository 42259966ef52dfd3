"""moe_compile's logs under torch's logging system (``TORCH_LOGS``), and the graph dumps around each stage of passes.

* ``TORCH_LOGS="moe_compile"``: INFO, one line per compiled graph (which passes rewrote how many layers, seconds in
  the passes) and one per rewrite or skip; ``TORCH_LOGS="+moe_compile"``: DEBUG, everything, graphs included.
* Artifact ``moe_graphs``: each stage's graph before and after moe_compile's passes, to the artifact log
  (``TORCH_LOGS="moe_compile,moe_graphs"``) and to ``TORCH_TRACE`` for tlparse (``trace_structured`` artifacts
  ``moe_compile_<stage>_before`` / ``_after``). torch reads ``TORCH_LOGS`` when it is imported, before moe_compile
  can register ``moe_graphs``: name ``moe_compile`` first (torch then imports it, which registers the artifact).

``torch._logging.set_logs(modules={"moe_compile": logging.DEBUG})`` does what ``+moe_compile`` does.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Sequence

import torch._logging
import torch.fx as fx
from torch._logging import _internal as torch_logs

from moe_compile import report
from moe_compile.passes import StagePass

LOG_NAME = "moe_compile"
GRAPHS_ARTIFACT = "moe_graphs"


def register() -> None:
    """Register the ``moe_compile`` log and the ``moe_graphs`` artifact with ``torch._logging`` (idempotent)."""
    registry = torch_logs.log_registry
    if hasattr(torch_logs, "register_log") and not registry.is_log(LOG_NAME):
        torch_logs.register_log(LOG_NAME, LOG_NAME)
    if hasattr(torch_logs, "register_artifact") and not registry.is_artifact(GRAPHS_ARTIFACT):
        torch_logs.register_artifact(
            GRAPHS_ARTIFACT, "moe_compile: each stage's graph before and after moe_compile's passes",
        )


register()
log = logging.getLogger(__name__)
graphs_log = torch._logging.getArtifactLogger(__name__, GRAPHS_ARTIFACT)

# Seconds spent in moe_compile's stage passes in this process (see pass_seconds)
_SECONDS = [0.0]
_LOCK = threading.Lock()


def pass_seconds() -> float:
    """Seconds spent in moe_compile's stage passes so far in this process; a difference times one compile."""
    with _LOCK:
        return _SECONDS[0]


def _graph_text(graph: fx.Graph) -> str:
    module = graph.owning_module
    if isinstance(module, fx.GraphModule):
        return module.print_readable(print_output=False, include_stride=True, include_device=True)
    return str(graph)


def dump_graph(stage: str, when: str, graph: fx.Graph) -> None:
    """Log ``graph`` as artifact ``moe_graphs`` and as a ``trace_structured`` artifact for tlparse (each only when
    on: the text is made only then)."""
    name = f"moe_compile_{stage}_{when}"
    torch._logging.trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": "string"},
        payload_fn=lambda: _graph_text(graph),
    )
    if graphs_log.isEnabledFor(logging.DEBUG):
        graphs_log.debug("%s:\n%s", name, _graph_text(graph))


class ObservedStagePass(StagePass):
    """A :class:`~moe_compile.passes.StagePass` that dumps its graph before and after (``moe_graphs``) and adds its
    time to :func:`pass_seconds`. Same ``uuid``: Inductor's caches see the same pass."""

    def __call__(self, graph: fx.Graph) -> None:
        dump_graph(self.stage, "before", graph)
        start = time.perf_counter()
        try:
            super().__call__(graph)
        finally:
            with _LOCK:
                _SECONDS[0] += time.perf_counter() - start
        dump_graph(self.stage, "after", graph)


def observed(passes: dict[str, StagePass]) -> dict[str, StagePass]:
    """``moe_compile.passes.stage_passes``' hooks with each stage pass observed (:class:`ObservedStagePass`)."""
    return {hook: ObservedStagePass(p.stage, p.config) for hook, p in passes.items()}


def graph_summary(records: Sequence[report.PassRecord], seconds: float, nodes: int, cached: bool) -> str:
    """One line for a compiled graph: which passes rewrote how many layers, skips and errors, seconds in the
    passes; ``cached``: Inductor's cache served the code (NOTE [cached compiles] (moe_compile/report.py))."""
    layers: dict[str, set[str]] = collections.defaultdict(set)
    for r in records:
        if r.kind == "rewrite":
            layers[r.pass_name].add(r.layer)
    rewrote = ", ".join(f"{name} {len(found)} layer{'s' if len(found) != 1 else ''}"
                        for name, found in layers.items()) or "no rewrite"
    counts = collections.Counter(r.kind for r in records if r.kind in ("skip", "error"))
    extra = "".join(f", {n} {kind}{'s' if n != 1 else ''}" for kind, n in sorted(counts.items()))
    cache = "; Inductor's cache served the compiled code (the passes after the hit did not run)" if cached else ""
    return f"compiled a graph of {nodes} nodes: {rewrote}{extra}; {seconds:.3f} s in the passes{cache}"
