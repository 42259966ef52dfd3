"""Failures the fuzzer knows and refuses to count, each with a reason tag and its classification.

A :class:`Known` entry says which failing layers it explains (``applies(result)``) and why they are not a bug that
this commit must fix: ``inductor`` (plain Inductor is wrong on it too: moe_compile is not the cause), ``torch``
(Dynamo or eager PyTorch cannot run it), or ``moe_compile`` with an open description (a fix that belongs in a file
another change owns). Every entry names its finding in ``tests/fuzz/FINDINGS.md``. A failure no entry explains
fails the fuzz tests and is printed as a standalone script.
"""

from __future__ import annotations

import dataclasses
import math
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
    most twice plain Inductor's, or both are garbage (not finite, or as large as the tensor itself: an Inductor
    miscompile both hand over, FINDINGS B3): the compile's doing, which no rewrite changes."""
    if result.kind != "numerics" or not result.plain_fails_too:
        return False

    def garbage(error: float, scale: float) -> bool:
        return not math.isfinite(error) or error >= scale

    past = [row for row in result.rows if not row.ratio <= 1]
    return bool(past) and all(
        row.inductor is not None and (row.compiled <= 2 * row.inductor
                                      or (garbage(row.inductor, row.scale) and garbage(row.compiled, row.scale)))
        for row in past)


# A residue this far below the step's largest reference value is rounding, not a routing change (a wrong expert
# or weight moves a router gradient by its own magnitude).
RESIDUE_FRACTION = 2.0**-16


def _router_gradient(name: str) -> bool:
    from tests.fuzz.harness import _ROUTER_PARAMS

    param = re.sub(r"^(call\d+:)?grad:(blocks\.\d+\.)?", "", name)
    return name.split(":")[-2:-1] == ["grad"] and param.startswith(_ROUTER_PARAMS)


def _top1_renormalised_router_residue(result: Result) -> bool:
    """Top-1 routing renormalised (``w / w.sum() == 1``): the router's gradient is zero in exact arithmetic, and in
    floating point it is the residue of ``div``'s backward (``g / s`` against ``g * ((w / s) / s)``), exactly zero
    only where those two round alike for the bits ``g`` happens to have (FINDINGS A10, B2). Applies when every
    tensor past the bound is a router gradient whose error is at most ``RESIDUE_FRACTION`` of the step's largest
    reference value."""
    spec = result.spec
    if result.kind != "numerics" or spec.top_k != 1 or spec.renorm == "none":
        return False
    past = [row for row in result.rows if not row.ratio <= 1]
    scale = max((row.scale for row in result.rows if row.scale == row.scale), default=0.0)
    return bool(past) and all(_router_gradient(row.name) and row.compiled <= RESIDUE_FRACTION * scale
                              for row in past)


def _top1_renormalised_zero_kept(result: Result) -> bool:
    """Translation validation refused a rewrite only because a gradient exactly zero before it was rounding residue
    after it, in a top-1 renormalised layer (the zero of ``_top1_renormalised_router_residue``, FINDINGS A15): the
    original graph is kept, so the user's step keeps eager's zero; the layer passed the judge. Applies when the
    residue is at most ``RESIDUE_FRACTION`` of the step's largest reference value."""
    spec = result.spec
    if result.kind != "validation_refused" or spec.top_k != 1 or spec.renorm == "none":
        return False
    worst = re.findall(r"worst: ([^;]*)", result.detail)
    if not worst or not all("(exactly zero before the rewrite): zero error" in w for w in worst):
        return False
    # rounding residue, not a routing change: at most RESIDUE_FRACTION of the step's largest reference value
    scale = max((row.scale for row in result.rows if row.scale == row.scale), default=0.0)
    errors = [float(m) for w in worst for m in re.findall(r"zero error ([0-9.e+-]+)", w)]
    return bool(errors) and all(e <= RESIDUE_FRACTION * scale for e in errors)


KNOWN: tuple[Known, ...] = (
    Known("inductor_also", "inductor",
          "plain Inductor is as far off as moe_compile: most often a gradient that cancels to exactly zero in eager "
          "(top-1 routing renormalised, w / w.sum() == 1: the router's gradient) and to rounding residue in "
          "Inductor's fused kernels (tests/fuzz/findings/inductor_zero_residue.py)",
          _no_worse_than_plain_inductor),
    Known("top1_renormalised_residue", "torch",
          "top-1 routing renormalised: the router gradient is zero in exact arithmetic and rounding residue in "
          "floating point; eager's exact zeros there are the luck of div's backward (FINDINGS A10, B2)",
          _top1_renormalised_router_residue),
    Known("top1_renormalised_zero_kept", "torch",
          "top-1 routing renormalised: validation refused a rewrite that leaves rounding residue where the router "
          "gradient was exactly zero; the original graph, and the zero, are kept (FINDINGS A15)",
          _top1_renormalised_zero_kept),
)


def explain_failure(result: Result) -> str | None:
    """The tag of the first :data:`KNOWN` entry that explains ``result``'s failure, if any."""
    for known in KNOWN:
        if known.applies(result):
            return known.tag
    return None
