"""What the passes did: the record store behind ``moe_compile.explain`` (:func:`moe_compile.api.explain`).

Every pass reports through its :class:`~moe_compile.passes.PassContext`; each record lands here. This module
imports nothing of moe_compile: passes, the backend and ``explain`` all write to it or read from it.

Semantics of a :class:`Report`, per layer (module path from ``nn_module_stack``, e.g.
``model.layers.0.mlp.experts``; ``<graph>`` for code outside any module):

* ``rewrite``: ``what`` is the chain that matched, ``detail`` what replaced it. A rewrite that is no MoE rewrite
  (``moe=False``: a generic one, bitwise neutral against plain Inductor, or one ``deterministic=True`` asks for) is
  shown as ``non-MoE`` and counted apart (:attr:`Report.other_rewrites`).
* ``skip``: ``what`` is a reason tag (``weights_before_gather``, ``region_not_rowwise``, ...), ``detail``
  a sentence ("combine not matched: weights applied before gather ...").
* ``error``: a pass raised and the graph was restored (plain Inductor for that pass).
* a ``rewrite`` that translation validation accepted has ``validation`` ``"validated"``;
  ``unchecked``: a rewrite kept without translation validation (``what`` ``validation_unavailable``, ``detail``
  why: collectives in the graph, an op that does not run on real tensors here); a rewrite that failed validation
  is a ``skip`` with reason ``validation_failed`` (NOTE [translation validation] (moe_compile/passes/_validate.py)).
* ``left``: the audit (:mod:`moe_compile.passes.audit`) found an accumulating scatter, a non-deterministic library
  kernel or a host sync in a compiled graph; ``what`` is ``"<kind>: <op>"``, ``detail`` the model source
  line; :attr:`Report.clean`, :attr:`Report.deterministic`.
* ``module`` stage records (passes ``experts_impl``, ``swap_expert_loops``): expert loops that Dynamo cannot
  capture, routed through the fused ops before compiling (``rewrite``: swapped / interfaced, with what), or
  left alone (``skip`` with a reason tag: ``probe_mismatch``, ``no_router``, ``expert_parallel``, ...).
* ``explain`` also gives every experts layer of the model that no record accounts for a skip: ``not_in_graph``
  (no compiled graph contained it: e.g. an eager experts loop, which Dynamo never captures) or
  ``dispatch_form_unknown`` (in a graph, no pass recognised its dispatch); :attr:`Report.graph_layers` says
  which layers the graphs contained. A layer that a MoE rewrite names (at its path, inside it or around it:
  :func:`same_module`) gets no such skip, and :meth:`Report.moe_layers` counts it once.

The table ends with a legend of the results it shows (:data:`LEGEND`) and a summary that says "clean" only when
nothing is ``left`` (docs/passes.md, "Reading explain's table"). ``moe_compile.last_report()`` gives the same report
for the graphs of the model last given to ``moe_compile.compile`` (NOTE [reports of one compiled model]).

The same record can appear once per compiled graph (recompiles, forward and backward graphs);
:meth:`Report.table` and :meth:`Report.to_dict` show it once with a count, ``records`` keeps them all.
The table fits ``TABLE_WIDTH`` (120) columns: a rewrite's chain in short, each detail wrapped below its
row; :meth:`Report.to_dict` has every field in full.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import textwrap
import threading
import weakref
from collections.abc import Iterator
from typing import Any, Literal

import torch

# explain()'s table fits a terminal of this many columns
TABLE_WIDTH = 120


@dataclasses.dataclass(frozen=True)
class PassRecord:
    pass_name: str
    stage: str
    kind: Literal["rewrite", "skip", "error", "left", "unchecked"]
    layer: str
    # for a rewrite: the chain that matched; for a skip: the reason tag (e.g. "weights_before_gather")
    what: str
    # for a rewrite: what replaced it; for a skip or error: the human-readable detail
    detail: str
    # for a rewrite: False when it is no MoE rewrite (a scatter with distinct indices made a plain store, which
    # changes no bit against plain Inductor; what deterministic=True asks for, anywhere in the graph)
    moe: bool = True
    # for a rewrite: "validated" (translation validation ran, or its verdict for the same graph was kept), or ""
    # (validation off); a rewrite kept unvalidated has an ``unchecked`` record beside it, a refused one is a skip
    validation: str = ""
    # for a rewrite: the option it was made for ("deterministic", "metrics"), "" for the default passes
    option: str = ""
    # the Dynamo compile the record came from ("frame/attempt", e.g. "3/0"; forward and backward graphs of one
    # compile share it); not part of a record's identity, so one record seen in several graphs is counted
    graph: str = dataclasses.field(default="", compare=False)


@dataclasses.dataclass
class Report:
    records: list[PassRecord] = dataclasses.field(default_factory=list)
    graphs: int = 0
    # compiles that Inductor's caches served (AOTAutograd or FX graph cache hits): their joint and post-grad
    # passes (the audit among them) did not run, so their records are missing (NOTE [cached compiles])
    cached_graphs: int = 0
    # the module paths of the nodes of every graph the backend was given (explain: which layers a graph contained)
    graph_layers: set[str] = dataclasses.field(default_factory=set)
    # the same per Dynamo compile (``PassRecord.graph``: "frame/attempt"), to attribute a record made outside any
    # module (``<graph>``) to the one experts layer of its graph (:func:`moe_compile.api.account_expert_layers`)
    compile_layers: dict[str, set[str]] = dataclasses.field(default_factory=dict)
    # the model's experts layers (module paths), where the report knows the model (``explain``, ``last_report``):
    # the summary counts MoE layers by them; empty: counted from the records' layers
    expert_layers: list[str] = dataclasses.field(default_factory=list)

    def copy(self) -> Report:
        """A copy that later compiles do not change (taken under the store's lock)."""
        with _LOCK:
            return Report(list(self.records), self.graphs, self.cached_graphs, set(self.graph_layers),
                          {k: set(v) for k, v in self.compile_layers.items()}, list(self.expert_layers))

    @property
    def rewrites(self) -> list[PassRecord]:
        return [r for r in self.records if r.kind == "rewrite"]

    @property
    def moe_rewrites(self) -> list[PassRecord]:
        """The rewrites of MoE layers (expert dispatch, routing); :attr:`other_rewrites` are the rest."""
        return [r for r in self.rewrites if r.moe]

    @property
    def other_rewrites(self) -> list[PassRecord]:
        """Rewrites that are no MoE rewrite (:attr:`PassRecord.moe` False), shown apart by :meth:`table`."""
        return [r for r in self.rewrites if not r.moe]

    @property
    def skips(self) -> list[PassRecord]:
        return [r for r in self.records if r.kind == "skip"]

    @property
    def errors(self) -> list[PassRecord]:
        return [r for r in self.records if r.kind == "error"]

    @property
    def validated(self) -> list[PassRecord]:
        """Rewrites that translation validation accepted."""
        return [r for r in self.records if r.kind == "rewrite" and r.validation == "validated"]

    @property
    def refused(self) -> list[PassRecord]:
        """Rewrites that translation validation refused (skips ``validation_failed``)."""
        return [r for r in self.records if r.kind == "skip" and r.what == "validation_failed"]

    @property
    def unchecked(self) -> list[PassRecord]:
        """Rewrites kept without translation validation, with the reason."""
        return [r for r in self.records if r.kind == "unchecked"]

    @property
    def left(self) -> list[PassRecord]:
        """The audit's findings (:mod:`moe_compile.passes.audit`): accumulating scatters and host syncs left in the
        compiled graphs, forward and backward, with the model source line."""
        return [r for r in self.records if r.kind == "left"]

    @property
    def clean(self) -> bool:
        """No accumulating scatter or host sync is left in the compiled graphs outside the token embedding's
        backward (which lies outside any MoE layer; ``deterministic=True`` removes it too). Library kernels
        that are non-deterministic themselves are counted by :attr:`deterministic`, not here. Only the graphs
        audited count: see :attr:`cached_graphs`. ``left`` rows can remain when this is True (the embedding's
        backward, a non-deterministic kernel): the table's summary says "clean" only when there is no ``left`` row,
        else "MoE layers clean" and what is left outside them."""
        return not self._unclean()

    def _unclean(self) -> list[PassRecord]:
        return [r for r in self.left if "(embedding)" not in r.what and not r.what.startswith("nondeterministic:")]

    def moe_layers(self) -> list[str]:
        """The MoE layers rewritten, each once, in natural order.

        Where the model's experts layers are known (:attr:`expert_layers`: ``explain``, ``moe_compile.last_report()``),
        each experts layer that a MoE rewrite names (at its path, inside it or around it: a rewrite recorded at
        ``model.layers.0.mlp`` and the experts layer ``model.layers.0.mlp.experts`` are one MoE layer), then the
        rewritten layers of no experts layer; those, and all of them where the experts layers are unknown, count once
        per outermost path (``a.mlp`` and ``a.mlp.experts`` are one layer)."""
        paths = sorted({r.layer for r in self.moe_rewrites}, key=_natural_key)
        layers = [e for e in self.expert_layers if any(same_module(e, p) for p in paths)]
        rest = [p for p in paths if not any(same_module(e, p) for e in self.expert_layers)]
        merged: list[str] = []
        for p in sorted(rest, key=lambda p: (p.count("."), _natural_key(p))):  # outermost first
            if not any(same_module(q, p) for q in merged):
                merged.append(p)
        return sorted(layers + merged, key=_natural_key)

    @property
    def nondeterministic(self) -> list[PassRecord]:
        """The audit's run-to-run non-deterministic sources left, per layer: accumulating scatters (atomic
        adds on the GPU; the embedding's backward included) and non-deterministic library kernels."""
        return [r for r in self.left if r.what.startswith(("accumulate:", "nondeterministic:"))]

    @property
    def deterministic(self) -> bool:
        """No known source of run-to-run differences is left in the compiled graphs (see
        :attr:`nondeterministic`): what ``moe_compile.compile(model, deterministic=True)`` aims at."""
        return not self.nondeterministic

    def option_by_graph(self, option: str = "deterministic") -> dict[str, dict[str, list[str]]]:
        """Per compiled graph (``PassRecord.graph``): ``{"changed": [...], "left": [...]}``, what ``option`` rewrote
        (``"layer: matched -> replacement"``) and, for ``deterministic``, the non-deterministic sources the audit
        found left in that graph. Graphs where neither happened are not listed."""
        graphs: dict[str, dict[str, list[str]]] = {}
        left = self.nondeterministic if option == "deterministic" else []
        for r in self.records:
            if r.kind == "rewrite" and option in r.option.split(","):
                line = f"{r.layer}: {short_chain(r.what)} -> {r.detail}"
                key = "changed"
            elif r in left:
                line, key = f"{r.layer}: {r.what}", "left"
            else:
                continue
            entry = graphs.setdefault(r.graph or "?", {"changed": [], "left": []})
            if line not in entry[key]:
                entry[key].append(line)
        return dict(sorted(graphs.items(), key=lambda item: _natural_key(item[0])))

    def layers(self) -> list[str]:
        return sorted({r.layer for r in self.records})

    def count(self, pass_name: str, kind: str = "rewrite") -> int:
        return sum(1 for r in self.records if r.pass_name == pass_name and r.kind == kind)

    def grouped(self) -> dict[str, list[tuple[PassRecord, int]]]:
        """``{layer: [(record, times seen), ...]}``, layers in natural order, records in first-seen order."""
        by_layer: dict[str, dict[PassRecord, int]] = {}
        for r in self.records:
            seen = by_layer.setdefault(r.layer, {})
            seen[r] = seen.get(r, 0) + 1
        return {layer: list(by_layer[layer].items()) for layer in sorted(by_layer, key=_natural_key)}

    def to_dict(self) -> dict[str, Any]:
        """``{"graphs": n, "summary": {...}, "layers": {layer: [{pass, stage, kind, what, detail, count}]}}``."""
        layers = {
            layer: [
                {"pass": r.pass_name, "stage": r.stage, "kind": r.kind, "what": r.what, "detail": r.detail,
                 "count": n, **({"moe": r.moe, "validation": r.validation} if r.kind == "rewrite" else {})}
                for r, n in entries
            ]
            for layer, entries in self.grouped().items()
        }
        moe_layers = self.moe_layers()
        summary = {
            # MoE layers: the model's experts layers where known (explain), else the MoE layers rewritten
            "layers": len(self.expert_layers) if self.expert_layers else len(moe_layers),
            "rewrites": len(self.rewrites),
            "skips": len(self.skips),
            "errors": len(self.errors),
            "unchecked": len(self.unchecked),
            "validated": len(self.validated),
            "refused": len(self.refused),
            "left": len(self.left),
            "clean": self.clean,
            "deterministic": self.deterministic,
            "other_rewrites": len(self.other_rewrites),
            "rewritten_layers": moe_layers,
        }
        return {"graphs": self.graphs, "cached_graphs": self.cached_graphs, "summary": summary, "layers": layers,
                "deterministic_by_graph": self.option_by_graph("deterministic")}

    def table(self, width: int = TABLE_WIDTH) -> str:
        """A printable table, at most ``width`` columns, one block per layer.

        Each record is one row (layer, pass, result, ``what``: a skip's reason tag, or a rewrite's chain
        in short: the head of each matched part, see :func:`short_chain`; wrapped in its column), then its
        ``detail`` (what replaced the chain, or why it was skipped) wrapped on the lines below. The full matched chain
        is in :meth:`to_dict` (``what``).
        """
        if not self.records:
            if not self.graphs and not self.cached_graphs:
                return ("moe_compile: no graph compiled (yet): torch.compile compiles at the compiled model's first "
                        "call (the backward graph at the first backward); call it, then print the report. Called "
                        "already? Then Dynamo ran it all eagerly: TORCH_LOGS=graph_breaks says why")
            found = self._cache_note() if self.cached_graphs else ", no MoE dispatch found"
            return f"moe_compile: {self.graphs} graph(s) compiled{found}"
        headers = ("layer", "pass", "result", "what")
        rows, details = [], []
        for layer, entries in self.grouped().items():
            for i, (r, n) in enumerate(entries):
                kind = r.kind if r.kind != "rewrite" or r.moe else "non-MoE"  # a rewrite, counted apart
                result = kind if n == 1 else f"{kind} x{n}"
                what = short_chain(r.what) if r.kind == "rewrite" else r.what
                rows.append([layer if i == 0 else "", r.pass_name, result, what])
                details.append(r.detail)
        # fixed columns get at most a third of the width each; ``what`` takes the rest
        widths = [min(max(len(x[c]) for x in [headers, *rows]), width // 3) for c in range(3)]
        while sum(widths) + 2 * 3 + 16 > width and max(widths[:2]) > 8:  # narrow terminals: clip layer / pass
            widths[widths.index(max(widths[:2]))] -= 1
        widths.append(max(width - sum(widths) - 2 * 3, 16))
        indent = " " * (widths[0] + 2)
        line = lambda cells: "  ".join(_clip(str(c), w).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
        out = [line(headers), line("-" * w for w in widths)]
        for row, detail in zip(rows, details):
            what = textwrap.wrap(row[3], widths[3], subsequent_indent="  ", break_on_hyphens=False) or [""]
            out.append(line([*row[:3], what[0]]))
            out += [line(["", "", "", more]) for more in what[1:]]
            if detail:
                out += textwrap.wrap(detail, width, initial_indent=indent + "  ", subsequent_indent=indent + "    ",
                                     break_on_hyphens=False)
        out += self.legend(width)
        n_layers, others = len(self.moe_layers()), len(self.other_rewrites)
        of = f" (of {len(self.expert_layers)} in the model)" if self.expert_layers else ""
        summary = (f"{self.graphs} graph(s) compiled; {n_layers} MoE layer(s) rewritten{of}, "
                   + (f"{others} non-MoE rewrite(s), " if others else "")
                   + f"{len(self.skips)} skip(s), {len(self.errors)} error(s); "
                   + (f"validation: {len(self.validated)} rewrite(s) validated, {len(self.refused)} refused, "
                      f"{len(self.unchecked)} unchecked; " if self.validated or self.refused or self.unchecked
                      else "")
                   + self._audit_summary()
                   + ("; deterministic" if self.deterministic
                      else f"; {len(self.nondeterministic)} non-deterministic source(s) left")
                   + (self._cache_note() if self.cached_graphs else ""))
        out += textwrap.wrap(summary, width, subsequent_indent="  ")
        # with deterministic=True (a rewrite made for it): what it changed and left, graph by graph
        by_graph = self.option_by_graph("deterministic")
        if any(entry["changed"] for entry in by_graph.values()):
            out.append("deterministic=True, per compiled graph (kernels the option changed; non-deterministic left):")
            for graph, entry in by_graph.items():
                for key in ("changed", "left"):
                    for line in entry[key] or (["nothing"] if key == "left" else []):
                        out += textwrap.wrap(f"graph {graph} {key}: {line}", width, initial_indent="  ",
                                             subsequent_indent="      ", break_on_hyphens=False)
        return "\n".join(out)

    def legend(self, width: int = TABLE_WIDTH) -> list[str]:
        """The legend of the ``result`` values the table shows (:data:`LEGEND`), wrapped to ``width``."""
        kinds = {r.kind if r.kind != "rewrite" or r.moe else "non-MoE" for r in self.records}
        shown = [f"{kind} = {LEGEND[kind]}" for kind in LEGEND if kind in kinds]
        return textwrap.wrap("result: " + "; ".join(shown), width, subsequent_indent="  ") if shown else []

    def _audit_summary(self) -> str:
        """The summary's part on the ``left`` rows: "clean" only when the audit left nothing."""
        if not self.left:
            return "clean: nothing left (audit)"
        unclean = self._unclean()
        if unclean:
            return f"not clean: {len(unclean)} accumulating scatter(s) / host sync(s) left (audit, `left` rows)"
        embedding = sorted({r.layer for r in self.left if "(embedding)" in r.what}, key=_natural_key)
        kernels = [r for r in self.left if "(embedding)" not in r.what]  # non-deterministic library kernels
        parts = ([f"{len([r for r in self.left if '(embedding)' in r.what])} accumulate(s) in the embedding's backward "
                  f"({', '.join(embedding)})"] if embedding else []) + \
            ([f"{len(kernels)} non-deterministic kernel(s)"] if kernels else [])
        return "MoE layers clean; left outside them: " + ", ".join(parts)

    def _cache_note(self) -> str:
        return (f"; {self.cached_graphs} from Inductor's caches, where passes did not run: this report is incomplete "
                "(explain() bypasses the caches)")

    def __str__(self) -> str:
        return self.table()


# The ``result`` column's values, as the table's legend (:meth:`Report.legend`) and docs/passes.md#explains-table
# define them
LEGEND = {
    "rewrite": "a pass replaced the code (what: the chain matched)",
    "non-MoE": "a rewrite outside the expert dispatch",
    "skip": "a pass left it alone (what: the reason)",
    "error": "a pass failed; the graph compiled without it",
    "unchecked": "a rewrite kept without translation validation",
    "left": "still in the compiled graph after every pass (audit: an accumulating scatter, a non-deterministic "
            "kernel or a host sync)",
}


def _suffixes(name: str) -> list[str]:
    """``"a.b.c"`` -> ``["a.b.c", "b.c", "c"]``."""
    parts = name.split(".")
    return [".".join(parts[i:]) for i in range(len(parts))]


def same_module(name: str, layer: str) -> bool:
    """Whether record path ``layer`` is module ``name``, inside it or around it. Record paths are relative to
    the module whose ``forward`` Dynamo compiled as a frame: transformers' ``*ForCausalLM`` compiles
    ``model.model``'s forward on its own, so ``model.layers.0.mlp.experts`` is recorded as
    ``layers.0.mlp.experts``."""
    return any(
        path == layer or layer.startswith(path + ".") or path.startswith(layer + ".")
        for path in _suffixes(name)
    )


def inside(name: str, layer: str) -> bool:
    """Whether record path ``layer`` is module ``name`` or inside it (paths relative as in :func:`same_module`)."""
    return any(path == layer or layer.startswith(path + ".") for path in _suffixes(name))


def _natural_key(text: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _clip(text: str, width: int | None) -> str:
    return text if width is None or len(text) <= width else text[: max(width - 3, 0)] + "..."


_PART_HEAD = re.compile(r"(?:\d+ ?x )?[A-Za-z_][\w.\-]*")


def short_chain(what: str) -> str:
    """A rewrite's matched chain in short: the head of each ``" + "``-joined part, arguments dropped.

    ``"sort(ids) + gather(x[perm//K] x1)+weights[perm] + counts(histc)->cumsum offsets + 2x grouped_mm"``
    -> ``"sort + gather + counts + 2x grouped_mm"``. A single part is kept as it is.
    """
    parts = what.split(" + ")
    if len(parts) == 1:
        return what
    heads = [m.group(0) if (m := _PART_HEAD.match(p.strip())) else p.strip() for p in parts]
    return " + ".join(heads)


# Open ``collecting`` blocks, process-wide rather than per thread or context: on CUDA the autograd engine
# runs the backward, and so AOTAutograd's lazy compile of the backward graph, in its own device thread,
# whose records (the backward's audit among them) belong to the block that ran the step.
_ACTIVE: list[Report] = []
_LOCK = threading.Lock()
# Every compile's records since the process started, kept for debugging (``moe_compile.report.last_report()``; the
# backend reads its counts). ``moe_compile.last_report()`` is another thing: the report of the most recently
# ``moe_compile.compile``d model (NOTE [reports of one compiled model]).
_LAST = Report()


@contextlib.contextmanager
def collecting() -> Iterator[Report]:
    """Collect the records of every compile while the block is open (in any thread: see ``_ACTIVE``)."""
    report = Report()
    with _LOCK:
        _ACTIVE.append(report)
    try:
        yield report
    finally:
        with _LOCK:  # by identity: reports compare by value
            del _ACTIVE[next(i for i, r in enumerate(_ACTIVE) if r is report)]


def _compile_id() -> str:
    compile_id = torch._guards.CompileContext.current_compile_id()
    return str(compile_id) if compile_id is not None else ""


# NOTE [reports of one compiled model]: ``moe_compile.compile`` gives its backend a report of its own
# (``moe_compile.last_report()``). The backend routes each Dynamo compile it is given to that report by compile id
# (:func:`route_compile`); every record, graph count and layer set of that compile id, the backward graph's that
# AOTAutograd compiles later included (it runs under the same compile id), lands there as well as in ``_LAST`` and
# the open ``collecting`` blocks.
_ROUTES: "weakref.WeakValueDictionary[str, Report]" = weakref.WeakValueDictionary()


def route_compile(rep: Report) -> None:
    """Send what the current Dynamo compile records into ``rep`` too (NOTE [reports of one compiled model])."""
    compile_id = _compile_id()
    if compile_id:
        with _LOCK:
            _ROUTES[compile_id] = rep


def _targets(compile_id: str) -> tuple[Report, ...]:
    """``_LAST``, the open reports and the report the compile is routed to (once each); call under ``_LOCK``."""
    reports = (_LAST, *_ACTIVE)
    routed = _ROUTES.get(compile_id) if compile_id else None
    return reports if routed is None or any(r is routed for r in reports) else (*reports, routed)


def add(record: PassRecord) -> None:
    if not record.graph:
        record = dataclasses.replace(record, graph=_compile_id())
    with _LOCK:
        for report in _targets(record.graph):
            report.records.append(record)


def _count(field: str) -> None:
    compile_id = _compile_id()
    with _LOCK:
        for report in _targets(compile_id):
            setattr(report, field, getattr(report, field) + 1)


def graph_compiled() -> None:
    _count("graphs")


def saw_layers(layers: set[str]) -> None:
    """Note the module paths of a graph the backend was given (:attr:`Report.graph_layers`, per compile in
    :attr:`Report.compile_layers`)."""
    compile_id = _compile_id()
    with _LOCK:
        for report in _targets(compile_id):
            report.graph_layers |= layers
            report.compile_layers.setdefault(compile_id, set()).update(layers)


@dataclasses.dataclass(frozen=True)
class Mark:
    """Where each open report (and the last-compile one) stood: see :func:`mark`."""

    # (report, records, graphs, cached_graphs) of each report open at the mark
    sizes: tuple[tuple[Report, int, int, int], ...]


def mark() -> Mark:
    """The current length of every open report, so that the records of a compile attempt can be read
    (:func:`since`) or taken back (:func:`rollback`) when the backend compiles the graph again."""
    compile_id = _compile_id()
    with _LOCK:
        return Mark(tuple((r, len(r.records), r.graphs, r.cached_graphs) for r in _targets(compile_id)))


def since(at: Mark) -> list[PassRecord]:
    """The records added since ``at`` (read from the last-compile report)."""
    with _LOCK:
        return list(_LAST.records[at.sizes[0][1]:])


def rollback(at: Mark) -> None:
    """Take back every record and graph count added since ``at``: the compile attempt they describe was
    dropped (NOTE [fallback after a failed compile] (moe_compile/backend.py)). Records another thread added
    meanwhile go too."""
    with _LOCK:
        for r, n, graphs, cached in at.sizes:
            del r.records[n:]
            r.graphs, r.cached_graphs = graphs, cached


# NOTE [cached compiles]: on an AOTAutograd or FX graph cache hit some of the passes do not run (the cached code
# has their rewrites already; the cache key includes the passes), so their records, the audit's among them, are
# missing: on torch 2.13 an AOTAutograd hit runs no pass at all, on torch 2.11 the pre-grad passes still run.
# The backend counts the hits per compile, and a report says it is incomplete rather than clean.
_CACHE_HIT_COUNTERS = (("aot_autograd", "autograd_cache_hit"), ("inductor", "fxgraph_cache_hit"))


def cache_hits() -> int:
    """Inductor's cache hits so far in this process (AOTAutograd and FX graph caches)."""
    from torch._dynamo.utils import counters

    return sum(counters[group][name] for group, name in _CACHE_HIT_COUNTERS)


def graph_from_cache() -> None:
    _count("cached_graphs")


# Records of module-level rewrites (moe_compile.compile's expert-loop swaps), per model, for explain.
_MODULE_RECORDS: "weakref.WeakKeyDictionary[torch.nn.Module, list[PassRecord]]" = weakref.WeakKeyDictionary()


def add_module_records(model: torch.nn.Module, records: list[PassRecord]) -> None:
    """Keep ``records`` (swapped / left-alone expert loops) for ``explain(model)``; new ones first-seen only."""
    kept = _MODULE_RECORDS.setdefault(model, [])
    for r in records:
        if r not in kept:
            kept.append(r)


def module_records(model: Any) -> list[PassRecord]:
    """The module-level records ``moe_compile.compile`` kept for ``model`` (empty for a function)."""
    try:
        return list(_MODULE_RECORDS.get(model, []))
    except TypeError:
        return []


def last_report() -> Report:
    """Every compile's records in this process (the backend's counters); for the report of one compiled model see
    ``moe_compile.last_report()``."""
    return _LAST
