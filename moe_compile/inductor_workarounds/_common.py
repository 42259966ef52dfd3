"""What every Inductor workaround shares: the pass name its records carry, and the version check that retires it."""

from __future__ import annotations

import dataclasses
import logging

import torch

from moe_compile import report

PASS_NAME = "inductor_workaround"
STAGE = "inductor"


@dataclasses.dataclass(frozen=True)
class Found:
    """A graph that shows a workaround's pattern: the layers where it does, and whether the user's options keep
    the workaround off."""

    layers: tuple[str, ...]
    overridden: bool = False


def needed(fixed_in: tuple[int, int] | None, version: str = torch.__version__) -> bool:
    """Whether a torch of ``version`` still needs a workaround whose bug is fixed in ``fixed_in`` (None: in no
    version we know of)."""
    if fixed_in is None:
        return True
    major, minor = (int(p) for p in version.split("+")[0].split(".")[:2])
    return (major, minor) < fixed_in


def record_rewrite(name: str, found: Found, detail: str, log: logging.Logger) -> None:
    """Log that workaround ``name`` applies to ``found``'s layers and record a non-MoE ``rewrite`` per layer
    (``explain``)."""
    log.info("moe_compile: %s: %s (layers %s)", name, detail, ", ".join(found.layers))
    for layer in found.layers:
        report.add(report.PassRecord(PASS_NAME, STAGE, "rewrite", layer, name, detail, moe=False))
