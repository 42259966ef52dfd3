"""Registry entry type and a deterministic initialiser for the blind MoE corpus.

Every layer in this package is a single-process, CPU-runnable re-expression of a public MoE
implementation; the module that defines it names the public code it follows.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

import torch
from torch import nn

STYLES = (
    "sort",
    "device_padded",
    "host_loop",
    "capacity",
    "expert_choice",
    "modulelist_loop",
    "onehot_dense",
    "other",
)

# Small default sizes shared by the corpus (hidden, intermediate, experts, top-k, tokens).
HIDDEN = 64
FFN = 32
EXPERTS = 8
TOP_K = 2


@dataclasses.dataclass(frozen=True)
class CorpusLayer:
    """One blind-corpus layer: how to build it and what to feed it."""

    name: str
    origin: str
    style: str
    make: Callable[[torch.dtype, int], nn.Module]
    input_shape: tuple[int, ...]
    returns_tuple: bool = False

    def __post_init__(self) -> None:
        if self.style not in STYLES:
            raise ValueError(f"{self.name}: unknown style {self.style!r}")


_NORM_TYPES = (nn.LayerNorm, nn.GroupNorm)


def materialize(
    factory: Callable[[], nn.Module],
    dtype: torch.dtype,
    seed: int,
    *,
    scale: float = 0.15,
    bias_scale: float = 0.05,
    keep_fp32: Iterable[str] = (),
    train: bool = True,
) -> nn.Module:
    """Build ``factory()`` without touching the global RNG, then refill every parameter from a seeded generator.

    Weights get N(0, scale^2), anything named ``*bias*`` gets N(0, bias_scale^2); norm layers keep their defaults.
    The module is cast to ``dtype``; submodules named in ``keep_fp32`` (routers the original keeps in fp32) are
    cast back to float32 afterwards.
    """
    with torch.random.fork_rng(devices=[]):
        module = factory()
    skip = {id(p) for m in module.modules() if isinstance(m, _NORM_TYPES) for p in m.parameters(recurse=False)}
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if id(p) in skip:
                continue
            std = bias_scale if "bias" in name.rsplit(".", 1)[-1] else scale
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)
    module = module.to(dtype)
    for path in keep_fp32:
        module.get_submodule(path).float()
    return module.train(train)


def seeded_uniform_(t: torch.Tensor, seed: int, low: float, high: float) -> torch.Tensor:
    """Fill a (buffer) tensor deterministically, for buffers the originals initialise to zero."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        t.copy_(torch.rand(t.shape, generator=gen) * (high - low) + low)
    return t
