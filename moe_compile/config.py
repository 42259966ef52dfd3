"""Configuration of the moe_compile backend.

Options reach the backend in two ways:

* ``torch.compile(model, backend="moe_compile", options={...})``: keys that start with ``"moe."``
  configure moe_compile, every other key is an Inductor config patch (as with the Inductor backend).
* ``moe_compile.compile(model, metrics=True, passes={...}, **torch_compile_kwargs)``.

Recognised ``"moe."`` keys (unknown ones raise):

============================ ===========================================================
``moe.passes``               ``{pass_name: bool}``: turn single passes on or off
``moe.metrics``              insert on-device router metrics (see :mod:`moe_compile.metrics`)
``moe.debug``                device-side asserts in the dispatch kernels (expert ids in range)
``moe.strict``               a pass that raises fails the compile instead of falling back
``moe.deterministic``        no atomic accumulation anywhere in the graph: every accumulating
                             scatter left (the token embedding's backward included) becomes
                             ``moe.segment_sum`` (see :mod:`moe_compile.passes.deterministic_scatter`)
============================ ===========================================================
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

OPTION_PREFIX = "moe."


@dataclasses.dataclass(frozen=True)
class MoECompileConfig:
    # name -> enabled, overriding each pass's default (see moe_compile.passes.PASSES).
    passes: tuple[tuple[str, bool], ...] = ()
    # Off by default: the metrics op adds a few small kernels per MoE layer.
    metrics: bool = False
    # Off by default: device-side asserts cost a little bandwidth and abort the process on failure.
    debug: bool = False
    # Off by default: a failing pass warns and leaves the graph as plain Inductor would see it.
    strict: bool = False
    # Off by default: the sort + segment sum costs a sort of the indices per accumulation where Inductor's
    # atomic adds cost none; the MoE layers are deterministic without it.
    deterministic: bool = False

    def pass_enabled(self, name: str, default: bool) -> bool:
        return dict(self.passes).get(name, default)

    def cache_key(self) -> str:
        return repr(dataclasses.astuple(self))


def split_options(options: Mapping[str, Any] | None) -> tuple[MoECompileConfig, dict[str, Any]]:
    """Split ``options`` into our config and the remaining Inductor config patches."""
    ours: dict[str, Any] = {}
    inductor: dict[str, Any] = {}
    for key, value in (options or {}).items():
        if key.startswith(OPTION_PREFIX):
            ours[key[len(OPTION_PREFIX):]] = value
        else:
            inductor[key] = value
    return make_config(**ours), inductor


def make_config(**kwargs: Any) -> MoECompileConfig:
    """Build a config from keyword options, with a clear error for unknown names."""
    from moe_compile.passes import PASSES

    fields = {f.name for f in dataclasses.fields(MoECompileConfig)}
    unknown = sorted(set(kwargs) - fields)
    if unknown:
        raise ValueError(
            f"unknown moe_compile option(s) {unknown}; known: {sorted(fields)} "
            f"(as options={{'moe.<name>': ...}} or moe_compile.compile(model, <name>=...))"
        )
    passes = kwargs.pop("passes", None) or {}
    if not isinstance(passes, Mapping):
        raise TypeError(f"passes must be a mapping of pass name to bool, got {type(passes).__name__}")
    known_passes = {p.name for p in PASSES}
    bad = sorted(set(passes) - known_passes)
    if bad:
        raise ValueError(f"unknown pass name(s) {bad} in passes=; known: {sorted(known_passes)}")
    for key in ("metrics", "debug", "strict", "deterministic"):
        if key in kwargs and not isinstance(kwargs[key], bool):
            raise TypeError(f"{key} must be a bool, got {kwargs[key]!r}")
    return MoECompileConfig(passes=tuple(sorted((k, bool(v)) for k, v in passes.items())), **kwargs)
