"""Failures the fuzzer knows and refuses to count, each with a reason tag and its classification.

A :class:`Known` entry says which failing layers it explains (``applies(result)``) and why they are not a bug that
this commit must fix: ``inductor`` (plain Inductor is wrong on it too: moe_compile is not the cause), ``torch``
(Dynamo or eager PyTorch cannot run it), or ``moe_compile`` with an open description (a fix that belongs in a file
another change owns). Every entry names its finding in ``tests/fuzz/FINDINGS.md``. A failure no entry explains
fails the fuzz tests and is printed as a standalone script.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.fuzz.harness import Result


@dataclasses.dataclass(frozen=True)
class Known:
    tag: str
    classification: str  # inductor | torch | moe_compile
    summary: str
    applies: Callable[[Result], bool]


KNOWN: tuple[Known, ...] = (
    Known("host_loops_pending_unbacked", "moe_compile",
          "two or more host-sized expert loops in one graph (stacked split loops, transformers JetMoE): "
          "fuse_expert_loop rewrites them, then Inductor fails with PendingUnbackedSymbolNotFound and no fallback "
          "runs (issue 35, items 5; fixed by that change in fuse_expert_loop and the backend's fallback)",
          lambda r: r.kind == "crash" and "PendingUnbackedSymbolNotFound" in r.detail
          and "fuse_expert_loop" in r.rewrites),
)


def explain_failure(result: Result) -> str | None:
    """The tag of the first :data:`KNOWN` entry that explains ``result``'s failure, if any."""
    for known in KNOWN:
        if known.applies(result):
            return known.tag
    return None
