"""Loud fallbacks: an MoE layer that plain ``torch.compile(..., backend="moe_compile")`` leaves to eager is said so.

NOTE [loud fallbacks]: without the capture flags (``moe_compile.config.CAPTURE_FLAGS``; ``moe_compile.compile`` and
``fullgraph=True`` turn them on) Dynamo graph-breaks at host reads (``nonzero``, ``.item()``, ``.tolist()``, ops with
data-dependent output shapes). In an expert loop that either cuts the layer into pieces with eager code between
them, or, when the break is inside a ``for`` loop, makes Dynamo skip the whole frame: the layer runs eagerly and
no graph ever reaches the backend. Both used to be silent. Two signals, each for the plain backend only (the one
``torch.compile(backend="moe_compile")`` names, not ``moe_compile.compile``'s) and with the flags off:

* pieces: the graph Dynamo hands the backend carries ``compile_subgraph_reason``; a graph break whose reason is a
  host read, in a frame whose module holds experts (:func:`moe_compile.experts.discovery.find_expert_layers`; for
  a function, a graph that routes with ``topk``), warns (:func:`check_graph`);
* skipped frames: Dynamo's compile-end callback sees the ``Unsupported`` that made it skip the frame
  (``sys.exc_info()``); the traced frame's module and the backend are read from Dynamo's root tracer in that
  exception's traceback (:func:`_on_compile_end`). ``torch._dynamo.reset()`` clears Dynamo's callbacks: the next
  call of the backend, ``moe_compile.compile`` or ``explain`` installs ours again (:func:`install`).

One :class:`FallbackWarning` per experts module (else per module, else per break site) and process, naming the host
read, where it is, and the fix. Anything unexpected in Dynamo's objects makes no warning, never an error.
"""

from __future__ import annotations

import re
import sys
import traceback
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from moe_compile.config import CAPTURE_FLAGS
from moe_compile.experts.discovery import find_expert_layers


class FallbackWarning(UserWarning):
    """An MoE layer runs eagerly (in part or whole) under ``torch.compile(..., backend="moe_compile")``."""


# What Dynamo's graph-break reasons say at a host read (torch 2.11 and 2.13 spellings; the hint names the flags)
_HOST_READ = re.compile(r"nonzero|_local_scalar_dense|\.item\(|\.tolist\(|data[- ]dependent|dynamic shape operator|"
                        r"capture_scalar_outputs|capture_dynamic_output_shape_ops", re.IGNORECASE)
_OP = re.compile(r"aten\.(\w+)")
_HOST_OPS = {"_local_scalar_dense": ".item() / .tolist()"}
FIX = ("use moe_compile.compile(model), which traces host reads into the graph and swaps expert loops Dynamo "
       "cannot trace, or torch.compile(model, backend='moe_compile', fullgraph=True)")

_WARNED_MODULES: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_WARNED_SITES: set[tuple[str, int]] = set()
# the backend function of plain torch.compile(backend="moe_compile") (moe_compile.backend.moe_backend)
_PLAIN_BACKENDS: list[Callable[..., Any]] = []


def install(backend: Callable[..., Any] | None = None) -> None:
    """Install the compile-end callback (idempotent; ``backend``: the plain backend to watch for)."""
    if backend is not None and backend not in _PLAIN_BACKENDS:
        _PLAIN_BACKENDS.append(backend)
    handler = getattr(torch._dynamo, "callback_handler", None)
    if handler is None or not hasattr(handler, "register_end_callback") or not hasattr(handler, "end_callbacks"):
        return
    if _on_compile_end not in handler.end_callbacks:
        handler.register_end_callback(_on_compile_end)


def reset() -> None:
    """Forget which layers were warned about (tests)."""
    _WARNED_MODULES.clear()
    _WARNED_SITES.clear()


def _capturing() -> bool:
    return all(getattr(torch._dynamo.config, name, False) for name in CAPTURE_FLAGS)


def check_graph(gm: torch.fx.GraphModule) -> None:
    """Warn once if Dynamo cut ``gm`` at a host read in an MoE frame (plain backend, capture flags off)."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if _capturing() or reason is None or not getattr(reason, "graph_break", False):
        return
    text = str(getattr(reason, "reason", ""))
    if not _HOST_READ.search(text):
        return
    _warn(_frame_module(_current_tracer()), _routes(gm.graph), text, getattr(reason, "user_stack", None) or [],
          skipped=False)


def _on_compile_end(*args: Any) -> None:
    """Dynamo's compile-end callback: a frame that failed to compile with an ``Unsupported`` at a host read runs
    eagerly; warn once if it is an MoE module's, under the plain backend, with the capture flags off."""
    exc = sys.exc_info()[1]
    if exc is None or not _PLAIN_BACKENDS or _capturing():
        return
    try:
        unsupported = getattr(torch._dynamo.exc, "Unsupported", ())
        if not isinstance(exc, unsupported):
            return
        text = "\n".join(str(e) for e in _chain(exc))
        if not _HOST_READ.search(text):
            return
        tracer = _tracer_in(exc.__traceback__)
        if tracer is None or not _is_plain(getattr(getattr(tracer, "output", None), "compiler_fn", None)):
            return
        graph = getattr(getattr(tracer, "output", None), "graph", None)
        _warn(_frame_module(tracer), graph is not None and _routes(graph), text,
              getattr(exc, "real_stack", None) or [], skipped=True)
    except Exception:  # noqa: BLE001 - a diagnostic never breaks a compile
        return


def _routes(graph: torch.fx.Graph) -> bool:
    """Whether ``graph`` (Dynamo's graph so far) picks experts: a ``topk``."""
    return any(n.op in ("call_function", "call_method") and "topk" in str(n.target) for n in graph.nodes)


def _warn(module: nn.Module | None, routes: bool, reason: str, stack: Sequence[traceback.FrameSummary],
          skipped: bool) -> None:
    """Warn once for ``module``'s experts (or ``module``, or the break site) if the frame looks like MoE: its module
    holds experts, or its graph routes."""
    experts = find_expert_layers(module) if module is not None else []
    if not experts and not routes:
        return
    site = stack[-1] if stack else None
    keys = [layer.module for layer in experts] or ([module] if module is not None else [])
    if keys:
        if all(key in _WARNED_MODULES for key in keys):
            return
        _WARNED_MODULES.update(keys)
    else:
        key = (site.filename, site.lineno or 0) if site is not None else ("?", 0)
        if key in _WARNED_SITES:
            return
        _WARNED_SITES.add(key)
    op = _OP.search(reason)
    read = _HOST_OPS.get(op.group(1), op.group(1)) if op else "a host read"
    code = f" ({site.line.strip()})" if site is not None and (site.line or "").strip() else ""
    where = f" at {site.filename}:{site.lineno}{code}" if site is not None else ""
    owner = type(module).__name__ if module is not None else "the compiled function"
    names = ", ".join(layer.name or "<root>" for layer in experts)
    layers = f" (experts: {names})" if names else ""
    if skipped:
        what = (f"Dynamo skipped the frame of {owner}{layers}: it graph-breaks at {read}{where}, where Dynamo cannot "
                "resume (inside a loop), so it runs eagerly and no compiled graph holds its experts")
    else:
        what = (f"Dynamo broke the graph of {owner}{layers} at {read}{where}: the code after it runs eagerly or in "
                "other graphs, and moe_compile's passes do not see the expert dispatch whole")
    message = f"moe_compile: {what}; {FIX}"
    if site is not None and site.filename and site.lineno:
        # shown at the host read, as Python shows a warning raised there (its file, line and code), not at this line
        warnings.warn_explicit(message, FallbackWarning, site.filename, site.lineno)
    else:
        warnings.warn(message, FallbackWarning, stacklevel=2)


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    while exc is not None and all(exc is not e for e in seen) and len(seen) < 8:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def _current_tracer() -> Any:
    """Dynamo's root tracer (``InstructionTranslator``) of the frame being compiled, or None."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        return InstructionTranslator.current_tx()
    except Exception:  # noqa: BLE001 - not inside Dynamo, or another torch
        return None


def _tracer_in(tb: Any) -> Any:
    """The root ``InstructionTranslator`` among the finished frames of a traceback (Dynamo's ``run`` frames)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    found = None
    while tb is not None:
        candidate = tb.tb_frame.f_locals.get("self") if tb.tb_frame.f_code.co_name == "run" else None
        if isinstance(candidate, InstructionTranslator):
            found = candidate
        tb = tb.tb_next
    return found


def _frame_module(tracer: Any) -> nn.Module | None:
    """The ``self`` of the frame ``tracer`` traces when it is a module (a ``forward``), else None: from the frame's
    locals while tracing, from the tracer's symbolic locals once Dynamo has dropped those (a failed frame)."""
    code = getattr(tracer, "f_code", None)
    if code is None or code.co_argcount < 1:
        return None
    name = code.co_varnames[0]
    local = getattr(tracer, "f_locals", None)
    candidate = local.get(name) if isinstance(local, dict) else None
    if candidate is None:
        symbolic = getattr(tracer, "symbolic_locals", None)
        candidate = _peek(symbolic.get(name)) if isinstance(symbolic, dict) else None
    return candidate if isinstance(candidate, nn.Module) else None


def _peek(vt: Any) -> Any:
    """The Python value behind a Dynamo ``VariableTracker`` (a lazy one, realized or not), read from its fields
    only: ``getattr`` on a lazy tracker would realize it."""
    fields = getattr(vt, "__dict__", {})
    cache = fields.get("_cache")
    if cache is not None:  # LazyVariableTracker: the value until realized, then the realized tracker
        cached = getattr(cache, "__dict__", {})
        if "value" in cached:
            return cached["value"]
        fields = getattr(cached.get("vt"), "__dict__", {})
    return fields.get("value")


def _is_plain(fn: Any) -> bool:
    """Whether Dynamo's backend object ``fn`` wraps the plain moe_compile backend (WrapBackendDebug ->
    torch._TorchCompileWrapper -> moe_backend)."""
    for _ in range(8):
        if fn is None:
            return False
        if any(fn is b for b in _PLAIN_BACKENDS):
            return True
        fn = getattr(fn, "_torchdynamo_orig_backend", None) or getattr(fn, "compiler_fn", None)
    return False
