"""The judge of translation validation: a rewritten graph's outputs against the baseline's, each float tensor
within the baseline's own distance from a wider reference run; also the pass tests' oracle
(tests/passes/_harness.py). The bounds: NOTE [translation validation] (moe_compile/passes/_validate.py)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)
# The baseline's own distance from the reference is multiplied by this (the family matrix's bound).
EAGER_ERROR_FACTOR = 4.0
# Below this many elements a tensor's error is too few samples to estimate the baseline's (the NOTE).
SMALL_TENSOR = 64
# A 16-bit tensor's root-mean-square error from the reference may be this multiple of the baseline's, plus
# RMS_ROUNDING roundings of its rms (the NOTE).
RMS_ERROR_FACTOR = 3.0
RMS_ROUNDING = 0.5
_U_FP32 = torch.finfo(torch.float32).eps / 2


@dataclasses.dataclass
class Outputs:
    """A run's outputs by name: forward outputs and, in a training graph, input gradients."""

    tensors: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Compared:
    """One output tensor judged: its name, the error measured and the bound it had."""

    name: str
    error: float
    bound: float
    how: str

    @property
    def ratio(self) -> float:
        if self.error == 0:
            return 0.0
        return math.inf if self.bound == 0 else self.error / self.bound

    def __str__(self) -> str:
        return f"{self.name}: {self.how} error {self.error:.3g} > bound {self.bound:.3g}" if self.ratio > 1 \
            else f"{self.name}: {self.how} error {self.error:.3g} <= bound {self.bound:.3g}"


@dataclasses.dataclass(frozen=True)
class Verdict:
    ok: bool
    worst: Compared | None

    def __str__(self) -> str:
        return str(self.worst) if self.worst is not None else "no output to compare"



def judge(got: dict[str, Any], base: dict[str, Any], reference: Callable[[], Outputs | None] | None, *,
          exact: bool = False, labels: dict[str, str] | None = None) -> Verdict:
    """Compare a rewritten graph's outputs ``got`` with the baseline's; ``labels`` names outputs in messages.
    The bounds: NOTE [translation validation] (moe_compile/passes/_validate.py)."""
    if got.keys() != base.keys():
        return Verdict(False, Compared(f"outputs differ: {sorted(set(got) ^ set(base))}", math.inf, 0.0, "names"))
    worst: Compared | None = None
    ref_outputs: Outputs | None = None
    u_low = max((torch.finfo(b.dtype).eps / 2 for b in base.values()
                 if isinstance(b, torch.Tensor) and b.is_floating_point()), default=0.0)
    noise: float | None = None
    for key, b in base.items():
        g, name = got[key], (labels or {}).get(key, key)
        if not isinstance(b, torch.Tensor):
            c = Compared(name, 0.0 if g == b else math.inf, 0.0, "value")
        elif not isinstance(g, torch.Tensor) or g.shape != b.shape or g.dtype != b.dtype:
            c = Compared(f"{name} (shape/dtype {getattr(g, 'shape', None)} {getattr(g, 'dtype', None)} vs "
                         f"{tuple(b.shape)} {b.dtype})", math.inf, 0.0, "layout")
        elif exact or not b.is_floating_point():
            c = Compared(name, 0.0 if torch.equal(g, b) else math.inf, 0.0, "bitwise")
        else:
            if ref_outputs is None and reference is not None:
                ref_outputs = reference()
            ref = ref_outputs.tensors.get(key) if ref_outputs is not None else None
            if noise is None:
                noise = relative_noise(base, ref_outputs.tensors if ref_outputs is not None else {})
            c = _judge_float(name, g, b, ref, u_low, noise)
        if worst is None or c.ratio > worst.ratio:
            worst = c
    return Verdict(worst is None or worst.ratio <= 1.0, worst)


def relative_noise(base: dict[str, Any], refs: dict[str, Any]) -> float:
    """The baseline's largest relative distance from the reference over its float tensors of at least
    ``SMALL_TENSOR`` elements (``max|base - ref| / max|ref|``): the graph's own noise, estimated where the
    estimate is stable."""
    noise = 0.0
    for key, b in base.items():
        r = refs.get(key)
        if (not isinstance(b, torch.Tensor) or not b.is_floating_point() or b.numel() < SMALL_TENSOR
                or not isinstance(r, torch.Tensor) or r.shape != b.shape):
            continue
        finite = b.isfinite() & r.isfinite()
        if not bool(finite.any()):
            continue
        scale = float(r[finite].double().abs().max())
        if scale > 0:
            noise = max(noise, float((b[finite].double() - r[finite].double()).abs().max()) / scale)
    return noise


def _judge_float(name: str, got: torch.Tensor, base: torch.Tensor, ref: torch.Tensor | None,
                 u_low: float = 0.0, noise: float = 0.0) -> Compared:
    finite = base.isfinite()
    if not torch.equal(finite, got.isfinite()) or not torch.equal(base.isnan(), got.isnan()):
        return Compared(name, math.inf, 0.0, "non-finite pattern")
    if not bool((base != 0).any()) and bool((got != 0).any()):
        return Compared(f"{name} (exactly zero before the rewrite)", float(got.abs().max()), 0.0, "zero")
    u = torch.finfo(base.dtype).eps / 2
    g, b = got[finite].double(), base[finite].double()
    if g.numel() == 0:
        return Compared(name, 0.0, 0.0, "max")
    r = ref[finite].double() if ref is not None and ref.shape == base.shape else None
    if r is not None and bool(r.isfinite().all()):  # a reference that overflowed judges nothing
        scale = float(r.abs().max())
        base_error = float((b - r).abs().max())
        rounding = u
        if b.numel() < SMALL_TENSOR:  # too few samples of the baseline's error: the graph's noise stands in
            base_error, rounding = max(base_error, noise * scale), max(u, u_low)
        elif u_low <= _U_FP32:  # a float32 graph: short sums, its baseline can be luckily exact (the NOTE)
            base_error = max(base_error, noise * scale)
        bound = EAGER_ERROR_FACTOR * base_error + rounding * scale
        worst = Compared(name, float((g - r).abs().max()), bound, "max (vs the reference)")
        if base.dtype in LOW_PRECISION and b.numel() >= SMALL_TENSOR:
            # a systematic error (one top-k slot's weight off by a few percent) stays under the max bound, which
            # the largest rounding sets; over every element it stands out of the rounding noise
            rms = _rms(g - r), _rms(b - r), _rms(r)
            rms_bound = RMS_ERROR_FACTOR * rms[1] + RMS_ROUNDING * u * rms[2]
            by_rms = Compared(name, rms[0], rms_bound, "rms (vs the reference)")
            if by_rms.ratio > worst.ratio:
                worst = by_rms
        return worst
    return Compared(name, float((g - b).abs().max()), math.sqrt(u) * float(b.abs().max()), "max (vs the baseline)")


def _rms(t: torch.Tensor) -> float:
    return float(t.square().mean().sqrt())



__all__ = ["Compared", "EAGER_ERROR_FACTOR", "LOW_PRECISION", "Outputs", "SMALL_TENSOR", "Verdict", "judge",
           "relative_noise"]
