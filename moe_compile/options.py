"""Options checked where they are given, before anything compiles, with the argument named and a "did you mean".

Three places take options:

* ``moe_compile.compile(model, <option>=..., **torch_compile_kwargs)``: :func:`check_compile_keywords` (keywords
  that are neither moe_compile options nor ``torch.compile``'s raise TypeError) and :func:`check_options` on its
  ``options=`` / ``mode=``, before the model is touched;
* ``explain(..., compile_options={...})``: the same, naming ``compile_options``;
* ``torch.compile(model, backend="moe_compile", options={...})``: torch hands ``options`` to no one before the first
  call (``torch._TorchCompileWrapper`` keeps them for the backend), so the backend checks them first thing, before any
  compile work, and raises :class:`OptionError`. Dynamo re-raises it as it is (it is a ``ShortenTraceback``, which
  Dynamo lets through) instead of wrapping it in ``BackendCompilerFailed``.

Keys of ``options=`` that start with ``"moe."`` are moe_compile options; every other key must be an Inductor config
(``torch._inductor.config``), as with the Inductor backend. ``{"metrics": True}`` is neither and asks
"did you mean 'moe.metrics'".
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch._dynamo import exc as dynamo_exc

from moe_compile.config import OPTION_PREFIX, OPTIONS, SETTINGS, make_config
from moe_compile.passes import PASSES

# Dynamo re-raises a ShortenTraceback raised by a backend as it is (2.11 and 2.13: OutputGraph.call_user_compiler)
_Passthrough: type[Exception] | None = getattr(dynamo_exc, "ShortenTraceback", None)
_BASES: tuple[type, ...] = (_Passthrough,) if _Passthrough is not None else ()


class _NoDynamoFooter:
    """Keeps torch's "Set TORCHDYNAMO_VERBOSE=1 ... if you're reporting a bug to PyTorch" footer and a "from user
    code" stack off an option error raised in the backend: Dynamo adds both to any exception that has a
    ``real_stack`` (torch._dynamo.exc.augment_exc_message), and its tracing context attaches one to every exception
    that passes it. A bad option is the caller's argument, neither a bug nor a place in the traced code."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name != "real_stack":
            super().__setattr__(name, value)


class OptionError(_NoDynamoFooter, *_BASES, ValueError):  # type: ignore[misc]
    """An unknown option name or a bad value, raised where the option was given. Raised inside the backend (the
    first call of ``torch.compile(..., backend="moe_compile", options=...)``) it reaches the caller as it is:
    Dynamo passes its ``ShortenTraceback`` through unwrapped, and adds no footer (:class:`_NoDynamoFooter`)."""

    def __init__(self, message: str) -> None:
        Exception.__init__(self, message)
        self.first_useful_frame = None  # ShortenTraceback: keep the whole traceback


class OptionTypeError(_NoDynamoFooter, *_BASES, TypeError):  # type: ignore[misc]
    """An option value of the wrong type (see :class:`OptionError`)."""

    def __init__(self, message: str) -> None:
        Exception.__init__(self, message)
        self.first_useful_frame = None


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` (or ``'x' or 'y'``) for the close matches of ``name`` among ``known``; ``""`` if
    none is close."""
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.75)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


@functools.cache
def inductor_config_names() -> frozenset[str]:
    """The names ``torch._inductor.config.patch`` accepts (``"max_autotune"``, ``"triton.cudagraphs"``, ...)."""
    config = torch._inductor.config
    names = set(getattr(config, "_config", {}))
    if hasattr(config, "get_config_copy"):
        names |= set(config.get_config_copy())
    return frozenset(names)


def check_options(options: Mapping[str, Any] | None, mode: str | None = None, *, where: str,
                  moe_keys: bool = True) -> None:
    """Check ``options=`` and ``mode=`` as the backend reads them; raise :class:`OptionError` or
    :class:`OptionTypeError` naming ``where`` (the call, ``"torch.compile(..., backend='moe_compile')"``) and the key.

    ``moe_keys=False``: ``"moe."`` keys are refused (``moe_compile.compile`` takes its options as keywords)."""
    if mode not in (None, "default"):
        modes = list(torch._inductor.list_mode_options())
        if mode not in modes:
            raise OptionError(f"{where}: unknown mode={mode!r}{did_you_mean(mode, modes)} (modes: {', '.join(modes)})")
    if options is None:
        return
    if not isinstance(options, Mapping):
        raise OptionTypeError(f"{where}: options= must be a dict of option name to value, got "
                              f"{type(options).__name__}")
    ours = {key[len(OPTION_PREFIX):]: value for key, value in options.items()
            if isinstance(key, str) and key.startswith(OPTION_PREFIX)}
    if ours and not moe_keys:
        for name in ours:
            if name not in OPTIONS:  # not an option by any spelling: suggest the keyword it may have meant
                raise OptionError(
                    f"{where}: options= key {OPTION_PREFIX + name!r} is no moe_compile option"
                    f"{did_you_mean(name, OPTIONS)} (moe_compile options are keywords of moe_compile.compile: "
                    f"{', '.join(OPTIONS)})"
                )
        keys = ", ".join(repr(OPTION_PREFIX + k) for k in ours)
        raise OptionError(f"{where}: options= key(s) {keys} are moe_compile options: pass them as keywords of "
                          f"moe_compile.compile ({', '.join(f'{k}=...' for k in ours)})")
    _check_ours(ours, where)
    inductor = inductor_config_names()
    for key in options:
        if not isinstance(key, str):
            raise OptionTypeError(f"{where}: options= keys are option names (str), got {key!r}")
        if key.startswith(OPTION_PREFIX) or key in inductor:
            continue
        if key in OPTIONS:
            hint = (f"; did you mean {OPTION_PREFIX + key!r}?" if moe_keys else
                    f"; did you mean moe_compile.compile(model, {key}=...)?")
        else:
            hint = did_you_mean(key, [OPTION_PREFIX + o for o in OPTIONS] + sorted(inductor))
        raise OptionError(
            f"{where}: options= key {key!r} is neither an Inductor config (torch._inductor.config) nor a "
            f"moe_compile option{hint} (moe_compile's options: {', '.join(OPTION_PREFIX + o for o in OPTIONS)})"
        )


def _check_ours(ours: Mapping[str, Any], where: str) -> None:
    """Names, types and pass names of the ``"moe."`` options (prefix stripped)."""
    for name in ours:
        if name not in SETTINGS or name not in OPTIONS:
            raise OptionError(
                f"{where}: options= key {OPTION_PREFIX + name!r} is no moe_compile option"
                f"{did_you_mean(OPTION_PREFIX + name, [OPTION_PREFIX + o for o in OPTIONS])} "
                f"(known: {', '.join(OPTION_PREFIX + o for o in OPTIONS)})"
            )
    try:
        config = make_config(**ours)
    except TypeError as exc:
        raise OptionTypeError(f"{where}: {exc}") from None
    except ValueError as exc:
        raise OptionError(f"{where}: {exc}") from None
    check_pass_names(dict(config.passes), where)


def check_pass_names(names: Iterable[str], where: str) -> None:
    """Raise :class:`OptionError` naming ``passes=`` and the closest pass names for names not in ``PASSES``."""
    known = [e.name for e in PASSES]
    for name in names:
        if name not in known:
            raise OptionError(f"{where}: unknown pass name {name!r} in passes={did_you_mean(name, known)} "
                              f"(known: {', '.join(sorted(known))})")


def torch_compile_keywords() -> set[str]:
    """The keyword arguments of this torch's ``torch.compile`` (``fullgraph``, ``dynamic``, ``mode``, ...)."""
    return {name for name, p in inspect.signature(torch.compile).parameters.items()
            if p.kind is not inspect.Parameter.POSITIONAL_ONLY} - {"model"}


def check_compile_keywords(kwargs: Mapping[str, Any], known: Iterable[str], *, where: str) -> None:
    """Raise TypeError naming ``where`` for keywords of ``kwargs`` that are not in ``known`` (moe_compile.compile's
    own) nor ``torch.compile``'s, with the closest names and the lists of both."""
    ours = sorted(known)
    theirs = sorted(torch_compile_keywords() - {"backend"})
    for name in kwargs:
        if name in ours or name in theirs:
            continue
        raise TypeError(
            f"{where}: unknown keyword {name!r}{did_you_mean(name, ours + theirs)} "
            f"(moe_compile.compile's keywords: {', '.join(ours)}; and torch.compile's: {', '.join(theirs)})"
        )


def check_compile_call(kwargs: Mapping[str, Any], own: Iterable[str], *, where: str) -> None:
    """Check the keywords of a ``moe_compile.compile`` call (``kwargs``: its options and ``torch.compile``'s keywords,
    ``own``: its keyword names) before anything is built: names, option values, pass names, ``options=`` and
    ``mode=``; every error names ``where``."""
    check_compile_keywords(kwargs, own, where=where)
    ours = {name: value for name, value in kwargs.items() if name in OPTIONS}
    try:
        config = make_config(**{**ours, "passes": ours.get("passes") or {}})
    except TypeError as exc:
        raise TypeError(f"{where}: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    check_pass_names(dict(config.passes), where)
    check_options(kwargs.get("options"), kwargs.get("mode"), where=where, moe_keys=False)
