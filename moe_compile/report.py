"""What the passes did: rewrite and skip records, and ``moe_compile.explain``.

Every pass reports through its :class:`~moe_compile.passes.PassContext`; each record lands here.
``explain(model, *args)`` compiles ``model`` with the backend and returns the records of that compile.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any, Literal

import torch


@dataclasses.dataclass(frozen=True)
class PassRecord:
    pass_name: str
    stage: str
    kind: Literal["rewrite", "skip", "error"]
    layer: str
    # for a rewrite: the chain that matched; for a skip: the reason tag (e.g. "weights_before_gather")
    what: str
    # for a rewrite: what replaced it; for a skip or error: the human-readable detail
    detail: str


@dataclasses.dataclass
class Report:
    records: list[PassRecord] = dataclasses.field(default_factory=list)
    graphs: int = 0

    @property
    def rewrites(self) -> list[PassRecord]:
        return [r for r in self.records if r.kind == "rewrite"]

    @property
    def skips(self) -> list[PassRecord]:
        return [r for r in self.records if r.kind == "skip"]

    @property
    def errors(self) -> list[PassRecord]:
        return [r for r in self.records if r.kind == "error"]

    def layers(self) -> list[str]:
        return sorted({r.layer for r in self.records})

    def count(self, pass_name: str, kind: str = "rewrite") -> int:
        return sum(1 for r in self.records if r.pass_name == pass_name and r.kind == kind)

    def to_dict(self) -> dict[str, Any]:
        by_layer: dict[str, list[dict[str, str]]] = {}
        for r in self.records:
            by_layer.setdefault(r.layer, []).append(
                {"pass": r.pass_name, "stage": r.stage, "kind": r.kind, "what": r.what, "detail": r.detail}
            )
        return {"graphs": self.graphs, "layers": by_layer}

    def table(self) -> str:
        headers = ("layer", "pass", "stage", "result", "what", "detail")
        rows = [(r.layer, r.pass_name, r.stage, r.kind, r.what, r.detail) for r in self.records]
        if not rows:
            return f"moe_compile: {self.graphs} graph(s) compiled, no MoE dispatch found"
        widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
        line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
        out = [line(headers), line("-" * w for w in widths)]
        out += [line(r) for r in rows]
        return "\n".join(out)

    def __str__(self) -> str:
        return self.table()


_ACTIVE: contextvars.ContextVar[list[Report]] = contextvars.ContextVar("moe_compile_reports", default=[])
# The report of the most recent compile, kept for debugging (``moe_compile.report.last_report()``).
_LAST = Report()


@contextlib.contextmanager
def collecting() -> Iterator[Report]:
    """Collect the records of every compile inside the block."""
    report = Report()
    token = _ACTIVE.set([*_ACTIVE.get(), report])
    try:
        yield report
    finally:
        _ACTIVE.reset(token)


def add(record: PassRecord) -> None:
    _LAST.records.append(record)
    for report in _ACTIVE.get():
        report.records.append(record)


def graph_compiled() -> None:
    _LAST.graphs += 1
    for report in _ACTIVE.get():
        report.graphs += 1


def last_report() -> Report:
    return _LAST


def explain(model: Any, *args: Any, backward: bool | None = None, **kwargs: Any) -> Report:
    """Compile ``model`` with moe_compile, run it on ``args``/``kwargs``, and report what each pass did.

    Runs one forward (and one backward if the output requires grad, unless ``backward=False``) so that
    both the forward and the joint graph are compiled. ``model`` is not modified.
    Returns a :class:`Report`: ``print(report)`` shows a table, ``report.to_dict()`` a dict.
    """
    from moe_compile.api import compile as moe_compile_fn

    params = list(model.parameters()) if isinstance(model, torch.nn.Module) else []
    saved_grads = [p.grad for p in params]
    torch._dynamo.reset()
    compiled = moe_compile_fn(model)
    with collecting() as report:
        out = compiled(*args, **kwargs)
        tensors = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        grads = [t for t in tensors if t.requires_grad and t.is_floating_point()]
        if grads and backward is not False:
            sum(t.float().square().mean() for t in grads).backward()
    for p, g in zip(params, saved_grads):
        p.grad = g
    torch._dynamo.reset()
    return report
