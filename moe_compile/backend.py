"""The ``"moe_compile"`` torch.compile backend: Inductor plus moe_compile's graph passes.

Pipeline (one composite :class:`~moe_compile.passes.StagePass` per Inductor hook; the passes of each
stage run in the order of :data:`moe_compile.passes.PASSES`):

1. ``pre_grad_custom_pass`` (Dynamo's Torch IR, before AOTAutograd): the dispatch rewrites (expert loops,
   host-sized padding, sort-based dispatch), the expert GLU fusion, router metrics and the causal mask. Our ops'
   registered autograd then gives the backward its rewritten form too.
2. ``joint_custom_pre_pass`` (the joint forward+backward ATen graph in training, the forward graph in
   inference): what only the backward shows, accumulating scatters (``deterministic_*``).
3. ``post_grad_custom_post_pass``: the read-only audit (what is left, for ``explain``).

Besides the passes, a graph that would hit a known Inductor miscompile is compiled with the patch that avoids it (a
config patch, or a patched reindexing), and only such graphs (:mod:`moe_compile.inductor_workarounds`).

``moe_compile/passes/README.md`` has the table of passes by stage.

``mode=`` and ``options=`` behave as with the Inductor backend; option keys starting with ``"moe."``
configure moe_compile (see :mod:`moe_compile.config`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch._dynamo.backends.registry import _BACKENDS, _COMPILER_FNS, register_backend
from torch._guards import detect_fake_mode
from torch._inductor import async_compile
from torch._inductor.compile_fx import compile_fx, compile_fx_inner
from torch._inductor.cudagraph_trees import reset_cudagraph_trees

from moe_compile import fallbacks, inductor_workarounds, logs, metrics, report
from moe_compile.config import MoECompileConfig, split_options
from moe_compile.ops.deterministic_flag import deterministic_sdpa
from moe_compile.options import check_options
from moe_compile.passes import PASSES, _restore, _snapshot, check_pass_names, enabled_passes, stage_passes
from moe_compile.passes._graph import layer_name
from moe_compile.passes._validate import compiling

log = logging.getLogger(__name__)

BACKEND_NAME = "moe_compile"

# Inductor defaults we change (a user's options= still win). The dispatch ops are user-defined Triton
# kernels (``triton_op``); Inductor launches those through Triton's Python launcher unless told to use its
# static C launcher, as it does for its own kernels: about ten microseconds of host time per launch, as much
# as a decode-size kernel (benchmarks/results/host_cost.json).
# Kernels the static launcher cannot take fall back to Triton's launcher by themselves.
INDUCTOR_DEFAULTS: dict[str, Any] = {"static_launch_user_defined_triton_kernels": True}

# NOTE [static launch in compile workers]: the config patch above reaches kernels compiled in this process
# only. With compile_threads > 1 (any machine with a few cores) Inductor compiles Triton kernels in worker
# processes, and a worker decides there whether a kernel gets the static launcher, from its own config: Inductor
# forwards ``use_static_triton_launcher`` to it and nothing else. So every dispatch kernel took Triton's Python
# launcher in a parallel compile (3 of the 6 launches of a sort + scatter_add_ layer's call at T1, probed at
# commit 921c375).
# A worker reads this option from the environment when it starts, so we set the variable on import (unless the
# user did), before the pool starts; a pool that started before moe_compile was imported lacks it and is shut
# down once, at our first compile, so that Inductor starts a new one. Workers compile for every backend, so user
# Triton kernels compiled there by plain Inductor get the static launcher too; it falls back to Triton's
# launcher for any kernel it cannot take.
STATIC_LAUNCH_ENV = "TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS"


def _compile_workers_started() -> bool:
    return bool(getattr(async_compile, "_pool_set", ()))


_restart_compile_workers = STATIC_LAUNCH_ENV not in os.environ and _compile_workers_started()
os.environ.setdefault(STATIC_LAUNCH_ENV, "1")


def _restart_workers_without_static_launch() -> None:
    """Shut down a compile-worker pool started without :data:`STATIC_LAUNCH_ENV` (once per process)."""
    global _restart_compile_workers
    if not _restart_compile_workers:
        return
    _restart_compile_workers = False
    log.info("restarting Inductor's compile workers: they started before moe_compile set %s", STATIC_LAUNCH_ENV)
    async_compile.shutdown_compile_workers()


def inductor_patches(
    config: MoECompileConfig, mode: str | None, inductor_options: dict[str, Any]
) -> dict[str, Any]:
    patches: dict[str, Any] = {k: v for k, v in INDUCTOR_DEFAULTS.items() if hasattr(torch._inductor.config, k)}
    if mode not in (None, "default"):
        patches.update(torch._inductor.list_mode_options(mode))
    patches.update(inductor_options)
    clashing = sorted(set(patches) & set(stage_passes(config)))
    if clashing:
        raise ValueError(f"options {clashing} are set by moe_compile itself; turn passes off with 'moe.passes'")
    patches.update(logs.observed(stage_passes(config)))
    patches.update(metrics.inductor_patches(config.metrics))
    return patches


def compile_with_config(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    config: MoECompileConfig,
    mode: str | None = None,
    inductor_options: dict[str, Any] | None = None,
) -> Any:
    """``compile_fx`` with moe_compile's passes; a graph that Inductor cannot compile after our rewrites is
    compiled again without the pass that broke it, unless ``config.strict``
    (NOTE [fallback after a failed compile]). Logs one line per graph at INFO (:func:`moe_compile.logs.graph_summary`).
    """
    start, seconds, hits, nodes = report.mark(), logs.pass_seconds(), report.cache_hits(), len(gm.graph.nodes)
    compiled = _compile_with_fallback(gm, example_inputs, config, mode, inductor_options)
    if log.isEnabledFor(logging.INFO):
        log.info("%s", logs.graph_summary(report.since(start), logs.pass_seconds() - seconds, nodes,
                                         report.cache_hits() > hits))
    return compiled


def _compile_with_fallback(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    config: MoECompileConfig,
    mode: str | None,
    inductor_options: dict[str, Any] | None,
) -> Any:
    report.saw_layers({layer_name(n) for n in gm.graph.nodes if n.op not in ("placeholder", "output")})
    if config.strict:
        return _compile(gm, example_inputs, config, mode, inductor_options)
    # the pre-grad passes rewrite gm.graph in place (a graph without an output node has nothing to restore)
    original = _snapshot(gm.graph) if gm.graph.find_nodes(op="output") else None
    shape_env = getattr(detect_fake_mode(example_inputs), "shape_env", None)
    pending = _pending_unbacked(shape_env)
    start = report.mark()
    try:
        return _compile(gm, example_inputs, config, mode, inductor_options)
    except _NOT_FAILURES:
        raise
    except Exception as exc:  # noqa: BLE001 - any compile failure after a rewrite falls back
        failure = exc
    records = [r for r in report.since(start) if r.kind == "rewrite"]
    rewrote = _passes_that_rewrote(records)
    if not rewrote or original is None:
        raise failure
    layers = {name: sorted({r.layer for r in records if r.pass_name == name}) for name in rewrote}
    tries = [rewrote] if len(rewrote) == 1 else [[name] for name in reversed(rewrote)] + [rewrote]
    for off in tries:
        _restore_graph(gm, original, shape_env, pending)
        report.rollback(start)
        retry = dataclasses.replace(config, passes=tuple(sorted({**dict(config.passes), **dict.fromkeys(off, False)}
                                                                   .items())))
        try:
            compiled = _compile(gm, example_inputs, retry, mode, inductor_options)
        except _NOT_FAILURES:
            raise
        except Exception:  # noqa: BLE001 - not this pass alone: try the next
            log.debug("compiling again without %s failed too", off, exc_info=True)
            continue
        _record_fallback(off, layers, failure)
        return compiled
    _restore_graph(gm, original, shape_env, pending)
    report.rollback(start)
    note = f"moe_compile: compiling again without the passes that rewrote this graph ({', '.join(rewrote)}) failed too"
    log.debug(note)
    if hasattr(failure, "add_note"):  # Python 3.11+
        failure.add_note(note)
    raise failure


def _compile(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    config: MoECompileConfig,
    mode: str | None,
    inductor_options: dict[str, Any] | None,
) -> Any:
    patches = inductor_patches(config, mode, dict(inductor_options or {}))
    _restart_workers_without_static_launch()
    log.debug("compiling a graph of %d nodes, passes %s", len(gm.graph.nodes), enabled_passes(config))
    # known Inductor miscompiles this graph would hit (moe_compile/inductor_workarounds/): found on Dynamo's graph,
    # before the pre-grad passes rewrite it; each fix wraps the inner compile of the graph's forward or backward
    inner = inductor_workarounds.wrap_inner_compile(gm, inductor_options, compile_fx_inner)
    # compile_fx's own inner compile unless a workaround patches it (a caller's compile_fx may bring its own)
    extra = {"inner_compile": inner} if inner is not compile_fx_inner else {}
    # SDPA is decomposed (its kernel chosen) while compile_fx traces
    hits, graphs = report.cache_hits(), report.last_report().graphs
    with deterministic_sdpa() if config.deterministic else contextlib.nullcontext(), compiling(example_inputs):
        compiled = compile_fx(gm, example_inputs, config_patches=patches, **extra)
    if report.cache_hits() > hits:  # NOTE [cached compiles] (moe_compile/report.py)
        if report.last_report().graphs == graphs:  # not counted by the pre-grad passes: they did not run
            report.graph_compiled()
        report.graph_from_cache()
    return compiled


# NOTE [fallback after a failed compile]: a pass that raises is rolled back by its stage (StagePass), but a pass
# can also return a graph that Inductor then fails to compile (issue 35: JetMoE's second host loop got unbacked
# symbols that no node bound, and AOTAutograd's trace raised). Plain Inductor compiles the user's graph, so
# moe_compile must too. When compile_fx raises and passes recorded rewrites in this attempt, the backend
# restores the graph as Dynamo gave it (the pre-grad passes rewrote it in place; unbacked symbols the attempt left
# pending in the shape env are dropped), takes back the attempt's records, and compiles again with passes turned
# off: with one pass that rewrote, without it; with several, without each alone, the last in run order first (a
# later pass acts on what the earlier ones produced, and the joint stage comes last), and then without all of them.
# The first attempt that compiles is kept, with a warning and an ``error`` record per pass turned off (explain
# shows them); the other passes' rewrites stay. If no pass rewrote the graph, or every attempt fails, the first
# failure is raised as it is: it is not ours to hide. ``strict`` raises at once. Only compile_fx's own call is
# covered: a backward that AOTAutograd compiles lazily, at the first backward call, is not retried.
# Dynamo's control-flow exceptions pass through untouched.
_NOT_FAILURES = (torch._dynamo.exc.RestartAnalysis, torch._dynamo.exc.SkipFrame)


def _passes_that_rewrote(records: Sequence[report.PassRecord]) -> list[str]:
    """The graph passes (run order) with a rewrite among ``records``."""
    names = {r.pass_name for r in records if r.kind == "rewrite"}
    return [e.name for e in PASSES if e.name in names]


def _pending_unbacked(shape_env: Any) -> tuple[list[Any], list[Any]] | None:
    if shape_env is None:
        return None
    return list(shape_env.pending_fresh_unbacked_symbols), list(shape_env.ignorable_fresh_unbacked_symbols)


def _restore_graph(gm: torch.fx.GraphModule, original: torch.fx.Graph, shape_env: Any,
                   pending: tuple[list[Any], list[Any]] | None) -> None:
    """Put Dynamo's graph back into ``gm`` and the shape env's pending unbacked symbols as they were."""
    _restore(gm.graph, original)
    gm.recompile()
    if shape_env is not None and pending is not None:
        shape_env.pending_fresh_unbacked_symbols[:] = pending[0]
        shape_env.ignorable_fresh_unbacked_symbols[:] = pending[1]


def _record_fallback(off: Sequence[str], layers: dict[str, list[str]], failure: Exception) -> None:
    stages = {e.name: e.stage for e in PASSES}
    first_line = (str(failure).strip().splitlines() or [""])[0][:300]
    for name in off:
        where = "layers " + ", ".join(layers[name]) if layers[name] else "<graph>"
        msg = (f"moe_compile: Inductor could not compile the graph after pass {name!r} rewrote it ({where}): "
               f"{type(failure).__name__}: {first_line}; compiled it again without {name!r}")
        warnings.warn(msg, stacklevel=3)  # the user's one message; the log repeats it at DEBUG only
        log.debug(msg)
        detail = f"Inductor could not compile the graph this pass rewrote ({where}): {first_line}; compiled again " \
                 "without it"
        report.add(report.PassRecord(name, stages[name], "error", "<graph>", type(failure).__name__, detail))


def moe_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    mode: str | None = None,
    options: dict[str, Any] | None = None,
) -> Any:
    """``torch.compile`` backend: Inductor with moe_compile's passes installed.

    ``options`` are checked first, before any compile work (torch hands them to no one before the first call):
    an unknown key raises :class:`~moe_compile.options.OptionError`, which Dynamo passes through unwrapped."""
    check_options(options, mode, where=_WHERE)
    # again after torch._dynamo.reset() clears Dynamo's callbacks (NOTE [loud fallbacks] (moe_compile/fallbacks.py))
    fallbacks.install(moe_backend)
    fallbacks.check_graph(gm)
    config, inductor_options = split_options(options)
    return compile_with_config(gm, example_inputs, config, mode, inductor_options)


_WHERE = f"torch.compile(..., backend={BACKEND_NAME!r})"


class ConfiguredBackend:
    """A backend bound to a config (what :func:`moe_compile.compile` hands to ``torch.compile``)."""

    def __init__(self, config: MoECompileConfig, compiled_report: report.Report | None = None) -> None:
        check_pass_names(dict(config.passes))
        self.config = config
        # every compile this backend is given records here too (``moe_compile.last_report()``;
        # NOTE [reports of one compiled model] (moe_compile/report.py))
        self.compiled_report = compiled_report

    def __call__(
        self,
        gm: torch.fx.GraphModule,
        example_inputs: Sequence[Any],
        mode: str | None = None,
        options: dict[str, Any] | None = None,
    ) -> Any:
        check_options(options, mode, where="moe_compile.compile()", moe_keys=False)
        _, inductor_options = split_options(options)
        if self.compiled_report is not None:
            report.route_compile(self.compiled_report)
        return compile_with_config(gm, example_inputs, self.config, mode, inductor_options)

    def reset(self) -> None:
        _reset()


def _reset() -> None:
    reset_cudagraph_trees()


moe_backend.reset = _reset  # type: ignore[attr-defined]


def register() -> None:
    """Register ``"moe_compile"`` with Dynamo (idempotent; the entry point does the same lazily)."""
    fallbacks.install(moe_backend)  # NOTE [loud fallbacks] (moe_compile/fallbacks.py)
    # When Dynamo found our entry point first, it registers the backend itself after importing us.
    if BACKEND_NAME in _COMPILER_FNS or _BACKENDS.get(BACKEND_NAME) is not None:
        return
    register_backend(moe_backend, name=BACKEND_NAME)
