"""Failures the fuzzer knows and refuses to count, each with a reason tag and its classification.

A :class:`Known` entry says which failing layers it explains (``applies(result)``) and why they are not a bug that
this commit must fix: ``inductor`` (plain Inductor is wrong on it too: moe_compile is not the cause), ``torch``
(Dynamo or eager PyTorch cannot run it), or ``moe_compile`` with an open description (a fix that belongs in a file
another change owns). Every entry names its finding in ``tests/fuzz/FINDINGS.md``. A failure no entry explains
fails the fuzz tests and is printed as a standalone script.
"""

from __future__ import annotations

import dataclasses
import re
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
    Known("one_hot_sum_unbacked_rows", "moe_compile",
          "deterministic_accumulate's one-hot GEMM (rule (b)) on the backward of x[tok] with tok from a per-expert "
          "torch.where: its traced src.reshape(M, -1) makes the tracer assume the unbacked row count M != 0, and "
          "Inductor's runtime assert Ne(uN, 0) fires when an expert gets no token (plain Inductor runs). Open: the "
          "fix belongs in deterministic_accumulate.py (owned by another change): reshape to an explicit width, "
          "src.reshape(M, prod(base.shape[1:])) computed outside the traced function "
          "(tests/fuzz/findings/one_hot_sum_unbacked_rows.py)",
          lambda r: r.kind == "crash" and "deterministic_accumulate" in r.rewrites
          and re.search(r"Ne\(u\d+, 0\)", r.detail) is not None),
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
