"""Configuration of the moe_compile backend: one table of every setting, :data:`SETTINGS`.

A setting is either a compile option or an environment variable:

* Compile options reach the backend in two ways: ``torch.compile(model, backend="moe_compile",
  options={...})``, where keys that start with ``"moe."`` configure moe_compile and every other key is an
  Inductor config patch (as with the Inductor backend), or ``moe_compile.compile(model, <name>=...)``.
  Unknown ``"moe."`` keys raise; :func:`make_config` checks the values' types from the table.
* Environment variables (``MOE_COMPILE_<NAME>``) are read through :func:`env_setting`, each at the moment
  its row says: at import (set them before ``import moe_compile``), per call, or at first use. A boolean
  variable is on for ``1``, off for ``0``, and at its default for anything else.

The table below is generated from :data:`SETTINGS` (``docs/options.md`` lists the same).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping
from typing import Any, Literal

OPTION_PREFIX = "moe."
# Dynamo flags under which moe_compile.compile traces host reads (.item(), .tolist(), nonzero) into the graph.
# Without them Dynamo graph-breaks there and on ops with data-dependent output shapes (fullgraph=True turns them on
# implicitly); host-sized padding regions are only visible to the pre-grad passes when they are captured.
CAPTURE_FLAGS = {"capture_scalar_outputs": True, "capture_dynamic_output_shape_ops": True}

Kind = Literal["option", "env"]
# When a value is read: options once per compile (moe_compile.compile, or each graph for options=); environment
# variables at import of the module that uses them, on every call of the op that uses them, or at first use
ReadAt = Literal["per compile", "at import", "per call", "at first use"]


@dataclasses.dataclass(frozen=True)
class Setting:
    """One row of :data:`SETTINGS`."""

    name: str
    kind: Kind
    # bool, or dict for a mapping of names to bools (``passes``), float (a positive number or None), or str
    # (environment variables)
    type: type
    default: Any
    read: ReadAt
    doc: str
    # the variable's name, for kind "env"
    env: str | None = None

    def check(self, value: Any) -> None:
        """Raise TypeError, naming this setting, if ``value`` has not the table's type."""
        if self.type is bool and not isinstance(value, bool):
            raise TypeError(f"{self.name} must be a bool, got {value!r}")
        if self.type is dict and value is not None:
            if not isinstance(value, Mapping):
                raise TypeError(f"{self.name} must be a mapping of name to bool, got {type(value).__name__}")
            bad = {k: v for k, v in value.items() if not isinstance(v, bool)}
            if bad:
                raise TypeError(f"{self.name}= values must be bools, got {bad!r}")
        if self.type is float and value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{self.name} must be a float or None, got {value!r}")
            if not value > 0:
                raise ValueError(f"{self.name} must be positive, got {value!r}")

    def default_text(self) -> str:
        """The default as the user writes it: a Python value for an option, the variable's value for an env."""
        if self.kind == "option":
            return repr(self.default)
        if self.type is bool:
            return "1" if self.default else "0"
        return "unset" if self.default is None else str(self.default)


def _option(name: str, type_: type, default: Any, doc: str) -> Setting:
    return Setting(name, "option", type_, default, "per compile", doc)


def _env(name: str, type_: type, default: Any, read: ReadAt, doc: str) -> Setting:
    return Setting(name, "env", type_, default, read, doc, env=f"MOE_COMPILE_{name.upper()}")


_TABLE: tuple[Setting, ...] = (
    _option("passes", dict, {},
            "{pass_name: bool} turns single passes on or off (names in moe_compile.passes.PASSES); a pass that "
            "needs an option (metrics, deterministic) runs only with it on, whatever passes says"),
    _option("metrics", bool, False,
            "insert on-device router metrics; read them with moe_compile.metrics.collect()"),
    _option("debug", bool, False,
            "device-side asserts in the dispatch kernels (expert ids in range)"),
    _option("strict", bool, False,
            "a pass that raises, or a rewrite Inductor cannot compile, fails the compile instead of falling back to "
            "plain Inductor"),
    _option("deterministic", bool, False,
            "no atomic accumulation in the generated code anywhere in the graph"),
    _option("validate", bool, True,
            "translation validation: each pass's rewrites of a graph are kept only if the graph after them gives "
            "the outputs and gradients of the graph before them on real-shaped inputs (passes/_validate.py); a "
            "verdict is cached per graph and pass versions, so a recompile or a warm cache pays nothing; False opts "
            "out (benchmarks/results/validation_cost_*.json: its share of the first compiled step)"),
    _option("ep_capacity_factor", float, None,
            "expert parallelism (the expert_parallel pass): rows each rank sends to one rank, as a multiple of an even "
            "share N/W of its N routed rows; None: the worst case, no row dropped; a float f: ceil(f*N/W) rows, the "
            "rows past it in each destination's block dropped (their expert outputs are zero)"),
    _env("validate_all", bool, False, "per compile",
         "1 turns translation validation on for every compile, validate=False included (the test suite and the "
         "family matrix set it)"),
    _env("verdict_cache", bool, True, "per compile",
         "translation validation's verdicts kept per graph, in memory and beside Inductor's caches "
         "(passes/_verdicts.py); 0 validates every compile again (the test suite sets it)"),
    _env("cached_launch", bool, True, "at import",
         "eager launches of moe_compile's Triton kernels through a per-kernel cache of compiled launchers "
         "(ops/_eager_launch.py); 0 takes Triton's own launch path every time"),
    _env("grouped_gemm", str, None, "per call",
         "triton or cutlass (quantised weights: the weight-only kernels) forces the expert GEMMs' implementation, "
         "quack the QuACK expert MLP where it can run (ops/quack_gemm.py; triton / cutlass turn it off); "
         "unset (or any other value): the measured tables in ops/_expert_gemm_tuning.py"),
    _env("tma", bool, True, "per call",
         "TMA loads in the Triton expert GEMMs for plain 16-bit weights on sm90+; 0 turns them off"),
    _env("hw_fp4", bool, False, "per call",
         "1 routes NVFP4 grouped GEMMs through torchao's hardware kernels on sm100+ (untested, needs MSLK)"),
    _env("storage_shim", bool, True, "at first use",
         "build the C++ storage swap shim on a torch without UntypedStorage._swap_data_ptr_ (recycled gradient "
         "views); 0 turns the shim off"),
    _env("cache_dir", str, None, "at first use",
         "where the storage swap shim is built; unset: $XDG_CACHE_HOME/moe_compile or ~/.cache/moe_compile"),
)

# Every setting by name, in the table's order.
SETTINGS: dict[str, Setting] = {s.name: s for s in _TABLE}
OPTIONS: tuple[str, ...] = tuple(s.name for s in _TABLE if s.kind == "option")
ENV_SETTINGS: tuple[str, ...] = tuple(s.name for s in _TABLE if s.kind == "env")

_BOOL_TEXT = {"1": True, "0": False}


def env_setting(name: str) -> Any:
    """The value of environment setting ``name`` (``SETTINGS[name].env``) now: for a bool ``1`` / ``0`` / the
    default otherwise; for a str the variable's value, or the default when it is unset or empty."""
    setting = SETTINGS[name]
    if setting.env is None:
        raise KeyError(f"{name!r} is a compile option, not an environment setting")
    raw = os.environ.get(setting.env, "")
    if setting.type is bool:
        return _BOOL_TEXT.get(raw, setting.default)
    return raw or setting.default


@dataclasses.dataclass(frozen=True)
class MoECompileConfig:
    """The compile options of :data:`SETTINGS` (build one with :func:`make_config`, which checks them)."""

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
    # On by default: every user's rewrites are checked; a verdict is cached per graph (passes/_validate.py).
    validate: bool = True
    # None: the worst case (no row dropped); a float: ceil(f * N / W) rows per destination rank.
    ep_capacity_factor: float | None = None

    def pass_enabled(self, name: str, default: bool) -> bool:
        """Whether ``passes`` turns pass ``name`` on (``default`` when it does not name it). A pass that
        ``requires`` an option also needs that option on (``moe_compile.passes.PassEntry.enabled``)."""
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
    """Build a config from keyword options, checked against :data:`SETTINGS`: unknown names raise ValueError,
    values of the wrong type TypeError. Pass names are checked by ``moe_compile.passes.check_pass_names``,
    which ``moe_compile.compile`` and the backend call."""
    unknown = sorted(set(kwargs) - set(OPTIONS))
    if unknown:
        close = difflib.get_close_matches(unknown[0], OPTIONS, n=1, cutoff=0.75)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"unknown moe_compile option(s) {unknown}{hint}; known: {sorted(OPTIONS)} "
            f"(as options={{'moe.<name>': ...}} or moe_compile.compile(model, <name>=...))"
        )
    for name, value in kwargs.items():
        SETTINGS[name].check(value)
    passes = kwargs.pop("passes", None) or {}
    return MoECompileConfig(passes=tuple(sorted(passes.items())), **kwargs)


def _settings_doc() -> str:
    """The table of :data:`SETTINGS` as reStructuredText, for this module's docstring."""
    lines = []
    for s in _TABLE:
        key = f"moe.{s.name}" if s.kind == "option" else s.env
        lines += [f"``{key}`` ({s.type.__name__}, default ``{s.default_text()}``, read {s.read})", f"    {s.doc}"]
    return "\n\n" + "\n".join(lines) + "\n"


if __doc__ is not None:  # python -OO drops docstrings
    __doc__ += _settings_doc()
