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


def _no_worse_than_plain_inductor(result: Result) -> bool:
    """Plain Inductor is past the same bound on this layer, and on every tensor past it moe_compile's error is at
    most twice plain Inductor's: the compile's doing, which no rewrite changes."""
    if result.kind != "numerics" or not result.plain_fails_too:
        return False
    past = [row for row in result.rows if not row.ratio <= 1]
    return bool(past) and all(row.inductor is not None and row.compiled <= 2 * row.inductor for row in past)


KNOWN: tuple[Known, ...] = (
    Known("inductor_also", "inductor",
          "plain Inductor is as far off as moe_compile: most often a gradient that cancels to exactly zero in eager "
          "(top-1 routing renormalised, w / w.sum() == 1: the router's gradient) and to rounding residue in "
          "Inductor's fused kernels (tests/fuzz/findings/inductor_zero_residue.py)",
          _no_worse_than_plain_inductor),
)


def explain_failure(result: Result) -> str | None:
    """The tag of the first :data:`KNOWN` entry that explains ``result``'s failure, if any."""
    for known in KNOWN:
        if known.applies(result):
            return known.tag
    return None
