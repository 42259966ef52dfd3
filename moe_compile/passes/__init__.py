"""The ordered registry of moe_compile's graph passes, and how one stage runs them.

The invariants every pass keeps, the layout of this package and a table of passes, modules and reason tags
are in ``moe_compile/passes/README.md``.

A pass is a function ``run(graph: torch.fx.Graph, ctx: PassContext) -> None``. If it raises, the
stage restores the graph as it was before that pass, logs a warning and goes on (plain Inductor for
that pass), unless the config says ``strict``. A pass that rewrote something is validated
(NOTE [translation validation] (moe_compile/passes/_validate.py)): a mismatch restores the graph too, with a
``validation_failed`` skip for each layer the pass rewrote.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import pathlib
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Literal

import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from moe_compile import report
from moe_compile.config import MoECompileConfig, env_setting
from moe_compile.passes import _verdicts
from moe_compile.passes._validate import StageValidator, Unavailable

log = logging.getLogger(__name__)

Stage = Literal["pre_grad", "joint", "post_grad"]


@dataclasses.dataclass(frozen=True)
class PassEntry:
    """One registered pass. ``requires`` names bool compile options (``moe_compile.config.OPTIONS``) without
    which the pass cannot act: with one of them off the pass is neither listed as enabled nor run, even when
    ``passes={name: True}`` names it (which then does nothing, as the pass itself used to return early)."""

    name: str
    stage: Stage
    # "module:function", imported lazily so that a broken pass module cannot break `import moe_compile`
    target: str
    default: bool = True
    doc: str = ""
    requires: tuple[str, ...] = ()
    # the rewrite claims bitwise equal outputs (validation compares floats bitwise too)
    exact: bool = False

    def load(self) -> Callable[[fx.Graph, PassContext], None]:
        module, fn = self.target.split(":")
        return getattr(importlib.import_module(module), fn)

    def enabled(self, config: MoECompileConfig) -> bool:
        """Whether this pass runs under ``config``: on (``passes=`` or its default) and every required option on."""
        return config.pass_enabled(self.name, self.default) and all(getattr(config, r) for r in self.requires)


# Run order within each stage is the order of this tuple.
PASSES: tuple[PassEntry, ...] = (
    PassEntry("normalize", "pre_grad", "moe_compile.passes.normalize:run", default=True,
              doc="row moves onto one spelling before any recogniser: the token of each row -> arange(S) // K, "
                  "composed gathers x[a][b] -> x[a[b]], a combine through argsort(p) -> one at idx[p]"),
    PassEntry("fuse_expert_loop", "pre_grad", "moe_compile.passes.fuse_expert_loop:run", default=True,
              doc="Python loop over split chunks through per-expert MLPs -> one grouped GEMM per layer"),
    PassEntry("strip_host_padding", "pre_grad", "moe_compile.passes.strip_host_padding:run", default=True,
              doc="host-sized split/pad/unpad (tolist counts) -> moe.permute_pad + offs_E + moe.unpad_unpermute"),
    PassEntry("fuse_dispatch", "pre_grad", "moe_compile.passes.fuse_dispatch:run", default=True,
              doc="sort-based MoE dispatch -> moe.permute_pad + grouped GEMM + moe.unpad_unpermute"),
    PassEntry("expert_parallel", "pre_grad", "moe_compile.passes.expert_parallel:run", default=True,
              doc="expert parallelism: all-to-all at host-read split sizes around a regrouped grouped-GEMM region -> "
                  "a static padded all-to-all (moe.ep_capacity_factor) and device-index gathers, no host read"),
    PassEntry("capacity_dispatch", "pre_grad", "moe_compile.passes.capacity_dispatch:run", default=True,
              doc="capacity-factor dispatch: einsums over a one-hot [T, E, C] dispatch tensor -> gathers of the "
                  "routed rows (linear in tokens)"),
    PassEntry("sparse_contraction", "pre_grad", "moe_compile.passes.sparse_contraction:run", default=True,
              doc="a contraction with a routing tensor of at most R non-zeros per token (any spelling: one-hots, "
                  "scatters into zeros, masks and their products) -> topk of the non-zeros + gathers and fixed-order "
                  "sums (linear in tokens)"),
    PassEntry("drop_and_pad", "pre_grad", "moe_compile.passes.drop_and_pad:run", default=True,
              doc="Megatron's drop-and-pad dispatch: gathers and a scatter_add_ combine at argsort slots -> "
                  "moe.gather_segment_sum gathers and a moe.segment_sum combine (fixed order, no atomics)"),
    PassEntry("replace_grouped_mm_fallback", "pre_grad", "moe_compile.passes.replace_grouped_mm_fallback:run",
              default=True, doc="transformers.grouped_mm_fallback (tolist host sync) -> moe.grouped_mm"),
    PassEntry("fuse_expert_mlp", "pre_grad", "moe_compile.passes.fuse_expert_mlp:run", default=True,
              doc="grouped GEMM + GLU (any spelling, checked on a probe) of a rewritten layer -> moe.expert_gemm "
                  "with the GLU in its epilogue"),
    PassEntry("router_metrics", "pre_grad", "moe_compile.passes.router_metrics:run", default=True,
              requires=("metrics",), exact=True,
              doc="with metrics=True: on-device router statistics per MoE layer (moe_compile.metrics)"),
    PassEntry("causal_mask", "pre_grad", "moe_compile.passes.causal_mask:run", default=True,
              requires=("deterministic",),
              doc="with deterministic=True: a constant causal attn_mask -> is_causal=True (flash attention)"),
    PassEntry("pad_attention_value", "pre_grad", "moe_compile.passes.pad_attention_value:run", default=True,
              requires=("deterministic",),
              doc="with deterministic=True: SDPA with a value head dim below the query's (MLA) -> value "
                  "zero-padded, output sliced (flash attention)"),
    PassEntry("masked_attention", "pre_grad", "moe_compile.passes.masked_attention:run", default=True,
              requires=("deterministic",),
              doc="with deterministic=True: SDPA with an attn_mask left -> moe.masked_attention (dQ and dK/dV in "
                  "separate kernels, no atomics)"),
    PassEntry("expert_choice", "joint", "moe_compile.passes.expert_choice:run", default=True,
              doc="expert-choice routing: accumulations into the tokens' rows at topk-over-tokens indices (combine, "
                  "the token gather's backward) -> moe.segment_sum (fixed order, no atomics)"),
    PassEntry("deterministic_accumulate", "joint", "moe_compile.passes.deterministic_accumulate:run", default=True,
              doc="scatter-adds into zeros: plain scatters for distinct (top-k/sort) indices, one-hot GEMMs "
                  "for per-expert gathers' backward (no atomics)"),
    PassEntry("routed_accumulate", "joint", "moe_compile.passes.deterministic_scatter:run_routed", default=True,
              doc="accumulating scatters at indices a routing choice made (topk / sort / argmax / nonzero among "
                  "their producers: combines, capacity buffers, gathers' backward) -> moe.segment_sum (fixed order, "
                  "no atomics), without deterministic=True"),
    PassEntry("deterministic_scatter", "joint", "moe_compile.passes.deterministic_scatter:run", default=True,
              requires=("deterministic",),
              doc="with deterministic=True: every accumulating scatter left (embedding backward included) -> "
                  "moe.segment_sum (stable sort + fixed-order segment sums, no atomics)"),
    PassEntry("deterministic_attention", "joint", "moe_compile.passes.deterministic_attention:run", default=True,
              requires=("deterministic",),
              doc="with deterministic=True: flash / memory-efficient attention backward called with torch's "
                  "deterministic flag on (fixed-order dQ)"),
    PassEntry("audit", "post_grad", "moe_compile.passes.audit:run", default=True,
              doc="read-only: records accumulating scatters, non-deterministic library ops and host syncs left in "
                  "the final graphs (explain)"),
)


# a skip's sentence, or a function that writes it: matchers raise many NoMatch that nobody reports (a sort
# that is no dispatch at all), so a detail that is costly to format can wait until it is read
Detail = str | Callable[[], str]


class NoMatch(Exception):
    """A candidate region a pass cannot rewrite: ``reason`` is a tag (see the pass's docstring), ``detail``
    a sentence; a pass records both with :meth:`PassContext.skip`.

    ``detail`` may be given as a zero-argument function returning the sentence; it is called once, the first
    time :attr:`detail` or ``str(exc)`` is read.
    """

    def __init__(self, reason: str, detail: Detail = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self._detail = detail

    @property
    def detail(self) -> str:
        if callable(self._detail):
            self._detail = self._detail()
        return self._detail

    def __str__(self) -> str:
        detail = self.detail
        return f"{self.reason}: {detail}" if detail else self.reason


@dataclasses.dataclass
class PassContext:
    """What a pass gets besides the graph: config, stage, and the records it writes: to the report directly, or,
    when ``held`` (as :class:`StagePass` runs a pass), kept in ``records`` until the rewrites are validated."""

    config: MoECompileConfig
    stage: Stage
    pass_name: str
    # True for a joint forward+backward graph (training); False for forward-only graphs.
    is_training: bool
    held: bool = False
    records: list[report.PassRecord] = dataclasses.field(default_factory=list)
    # the option the pass runs for (PassEntry.requires, joined): recorded with each rewrite (report.PassRecord.option)
    option: str = ""

    def _record(self, record: report.PassRecord) -> None:
        self.records.append(record)
        if not self.held:
            report.add(record)

    def rewrite(self, layer: str, matched: str, replaced_by: str, moe: bool = True) -> None:
        """Record a rewrite; ``moe=False`` for one that is no MoE rewrite (``report.PassRecord.moe``)."""
        log.info("[%s] %s: rewrote %s -> %s", self.pass_name, layer, matched, replaced_by)
        self._record(report.PassRecord(self.pass_name, self.stage, "rewrite", layer, matched, replaced_by, moe,
                                       option=self.option))

    def skip(self, layer: str, reason: str, detail: Detail = "") -> None:
        """Record that ``layer`` was left alone, and why; a callable ``detail`` is formatted here."""
        if callable(detail):
            detail = detail()
        log.info("[%s] %s: skipped (%s) %s", self.pass_name, layer, reason, detail)
        self._record(report.PassRecord(self.pass_name, self.stage, "skip", layer, reason, detail))

    @property
    def rewritten_layers(self) -> list[str]:
        return list(dict.fromkeys(r.layer for r in self.records if r.kind == "rewrite"))


def _copy_into(dst: fx.Graph, src: fx.Graph, placeholders: dict[fx.Node, fx.Node]) -> None:
    value, src_output = dst.graph_copy(src, dict(placeholders), return_output_node=True)
    out = dst.output(value, type_expr=src_output.type)
    out.meta = dict(src_output.meta)


def _snapshot(graph: fx.Graph) -> fx.Graph:
    copy = fx.Graph(owning_module=graph.owning_module, tracer_cls=graph._tracer_cls)
    _copy_into(copy, graph, {})
    return copy


def _restore(graph: fx.Graph, snapshot: fx.Graph) -> None:
    """Put ``snapshot``'s nodes back into ``graph``, keeping ``graph``'s own placeholder nodes: Dynamo and
    AOTAutograd keep attributes on them (``_dynamo_source``) that a copy would lose."""
    own = list(graph.find_nodes(op="placeholder"))
    for node in reversed(list(graph.nodes)):
        if node.op != "placeholder":
            node.users.clear()
            for inp in node.all_input_nodes:  # a failed pass may have left the graph out of order
                inp.users.setdefault(node, None)
            graph.erase_node(node)
    for node in own:
        node.users.clear()
    _copy_into(graph, snapshot, dict(zip(snapshot.find_nodes(op="placeholder"), own)))


def _is_training_graph(graph: fx.Graph) -> bool:
    return any(n.name.startswith("tangents") for n in graph.find_nodes(op="placeholder"))


@functools.cache
def _source_hash() -> str:
    root = pathlib.Path(__file__).resolve().parents[1]
    files = sorted(str(p) for p in root.rglob("*.py"))
    return get_hash_for_files(tuple(files)).hex()


class StagePass(CustomGraphPass):
    """One Inductor custom pass that runs every enabled moe_compile pass of one stage, in order."""

    def __init__(self, stage: Stage, config: MoECompileConfig) -> None:
        self.stage = stage
        self.config = config
        self.entries = tuple(e for e in PASSES if e.stage == stage and e.enabled(config))

    def __call__(self, graph: fx.Graph) -> None:
        if self.stage == "pre_grad":
            report.graph_compiled()
        training = _is_training_graph(graph)
        validate = self.config.validate or env_setting("validate_all")
        validator = StageValidator(self.stage, training) if validate else None
        baseline: fx.Graph | None = None
        changed = False
        for entry in self.entries:
            ctx = PassContext(self.config, self.stage, entry.name, training, held=True, option=",".join(entry.requires))
            before = _snapshot(graph)
            start = time.perf_counter()
            try:
                entry.load()(graph, ctx)
                graph.lint()
            except Exception as exc:  # noqa: BLE001 - any failure falls back to plain Inductor
                if self.config.strict:
                    raise
                _restore(graph, before)
                msg = f"moe_compile pass {entry.name!r} failed ({type(exc).__name__}: {exc}); " \
                      "continuing without it for this graph"
                warnings.warn(msg, stacklevel=2)
                log.debug(msg, exc_info=True)
                _commit(r for r in ctx.records if r.kind != "rewrite")
                report.add(report.PassRecord(entry.name, self.stage, "error", "<graph>", type(exc).__name__, str(exc)))
                continue
            log.debug("[%s] ran in %.1f ms", entry.name, 1e3 * (time.perf_counter() - start))
            if validator is not None and ctx.rewritten_layers:
                baseline = baseline or before
                if not self._validated(validator, baseline, graph, before, entry, ctx):
                    continue
                unchecked = {r.layer for r in ctx.records if r.kind == "unchecked"}
                ctx.records[:] = [dataclasses.replace(r, validation="validated")
                                  if r.kind == "rewrite" and r.layer not in unchecked else r for r in ctx.records]
            _commit(ctx.records)
            changed = True
        if changed and self.stage == "joint":
            # A replacement can leave the joint graph unsorted, and Inductor's constant folding that
            # runs right after this hook needs topological order.
            from torch._inductor.pattern_matcher import stable_topological_sort

            stable_topological_sort(graph)
        if changed and graph.owning_module is not None:
            graph.owning_module.recompile()

    def _validated(self, validator: StageValidator, baseline: fx.Graph, graph: fx.Graph, before: fx.Graph,
                   entry: PassEntry, ctx: PassContext) -> bool:
        """Validate ``entry``'s rewrites of ``graph``; on a mismatch put ``before`` back and record why."""
        start = time.perf_counter()
        rewritten = _snapshot(graph)
        verdict_key = None
        if _verdicts.enabled():
            verdict_key = _verdicts.key(stage=self.stage, training=validator.training, pass_name=entry.name,
                                        exact=entry.exact, version=_source_hash(),
                                        baseline=_verdicts.graph_text(baseline),
                                        rewritten=_verdicts.graph_text(rewritten))
        verdict = _verdicts.lookup(verdict_key) if verdict_key is not None else None
        if verdict is not None:
            log.debug("[%s] verdict cached (%s): %s", entry.name, "accepted" if verdict.ok else "refused",
                      verdict.worst)
        else:
            try:
                checked = validator.check(baseline, rewritten, exact=entry.exact)
            except Unavailable as exc:
                for layer in ctx.rewritten_layers:
                    ctx.records.append(report.PassRecord(entry.name, self.stage, "unchecked", layer,
                                                         "validation_unavailable", str(exc)))
                return True
            finally:
                log.debug("[%s] validated in %.1f ms", entry.name, 1e3 * (time.perf_counter() - start))
            log.debug("[%s] validated: %s", entry.name, checked)
            verdict = _verdicts.CachedVerdict(checked.ok, str(checked))
            if verdict_key is not None:
                _verdicts.store(verdict_key, verdict)
        if verdict.ok:
            return True
        if self.config.strict:
            raise AssertionError(f"moe_compile pass {entry.name!r}: rewrite failed validation: {verdict.worst}")
        _restore(graph, before)
        for layer in ctx.rewritten_layers:
            detail = f"the rewrite changed the results; worst: {verdict.worst}; kept the original graph"
            if (entry.name, layer) not in _WARNED_VALIDATION:
                _WARNED_VALIDATION.add((entry.name, layer))
                warnings.warn(f"moe_compile pass {entry.name!r} at {layer}: {detail}", stacklevel=3)
            log.debug("[%s] %s: validation_failed: %s", entry.name, layer, detail)
            report.add(report.PassRecord(entry.name, self.stage, "skip", layer, "validation_failed", detail))
        _commit(r for r in ctx.records if r.kind != "rewrite")
        return False

    def uuid(self) -> str:
        return f"moe_compile:{self.stage}:{_source_hash()}:{self.config.cache_key()}"


# (pass, layer) pairs already warned about in this process: a refused rewrite warns once
_WARNED_VALIDATION: set[tuple[str, str]] = set()


def _commit(records: Iterable[report.PassRecord]) -> None:
    for r in records:
        report.add(r)


def stage_passes(config: MoECompileConfig) -> dict[str, StagePass]:
    """Inductor config patches that install one composite pass per stage."""
    return {
        "pre_grad_custom_pass": StagePass("pre_grad", config),
        "joint_custom_pre_pass": StagePass("joint", config),
        "post_grad_custom_post_pass": StagePass("post_grad", config),
    }


def enabled_passes(config: MoECompileConfig) -> list[str]:
    """The names of the passes that run under ``config``, in run order within each stage."""
    return [e.name for e in PASSES if e.enabled(config)]


def check_pass_names(names: Iterable[str]) -> None:
    """Raise ValueError, naming the ``passes=`` argument, for names that are not in :data:`PASSES`."""
    known = {e.name for e in PASSES}
    bad = sorted(set(names) - known)
    if bad:
        raise ValueError(f"unknown pass name(s) {bad} in passes=; known: {sorted(known)}")


__all__ = ["PASSES", "NoMatch", "PassContext", "PassEntry", "StagePass", "check_pass_names", "enabled_passes",
           "stage_passes"]
