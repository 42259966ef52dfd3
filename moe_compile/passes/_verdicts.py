"""Validation verdicts kept per graph, so that a recompile or a warm cache pays nothing for validation.

A verdict is keyed by what decides it: the stage, the grad mode, the pass (its name, whether it claims
exactness), the version of every pass (a hash of moe_compile's sources), torch's version, and the two graphs
compared, the stage's baseline and the rewritten one, as code with their placeholders' shapes, strides, dtypes,
devices and ``requires_grad``. Kept in memory and in a directory beside Inductor's own caches
(``<inductor cache>/moe_compile_verdicts``), one small JSON file per key. Not kept or read when Inductor's caches
are off (``force_disable_caches``) or ``MOE_COMPILE_VERDICT_CACHE=0``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import tempfile

import torch
import torch.fx as fx

from moe_compile.config import env_setting
from moe_compile.passes._graph import val

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CachedVerdict:
    """A verdict as kept: whether the rewrite was accepted, and its worst comparison in words."""

    ok: bool
    worst: str


_MEMORY: dict[str, CachedVerdict] = {}


def enabled() -> bool:
    return bool(env_setting("verdict_cache")) and not torch._inductor.config.force_disable_caches


def _placeholder_text(node: fx.Node) -> str:
    meta = val(node)
    if isinstance(meta, torch.Tensor):
        return (f"{node.name}:{tuple(meta.shape)}:{tuple(meta.stride())}:{meta.dtype}:{meta.device.type}:"
                f"{meta.requires_grad}")
    return f"{node.name}:{type(meta).__name__}:{meta}"


def graph_text(graph: fx.Graph) -> str:
    """``graph`` as code, with what its placeholders hold."""
    placeholders = "\n".join(_placeholder_text(p) for p in graph.find_nodes(op="placeholder"))
    return placeholders + "\n" + graph.python_code("self").src


def key(*, stage: str, training: bool, pass_name: str, exact: bool, version: str, baseline: str,
        rewritten: str) -> str:
    digest = hashlib.sha256()
    for part in (stage, str(training), pass_name, str(exact), version, torch.__version__, baseline, rewritten):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def _directory() -> pathlib.Path:
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:  # pragma: no cover - older layouts
        from torch._inductor.utils import cache_dir
    return pathlib.Path(cache_dir()) / "moe_compile_verdicts"


def lookup(verdict_key: str) -> CachedVerdict | None:
    """The verdict kept under ``verdict_key``, from memory or disk, or None."""
    if not enabled():
        return None
    found = _MEMORY.get(verdict_key)
    if found is not None:
        return found
    path = _directory() / f"{verdict_key}.json"
    try:
        data = json.loads(path.read_text())
        found = CachedVerdict(bool(data["ok"]), str(data["worst"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    _MEMORY[verdict_key] = found
    return found


def store(verdict_key: str, verdict: CachedVerdict) -> None:
    """Keep ``verdict``; a directory that cannot be written keeps it in memory only."""
    if not enabled():
        return
    _MEMORY[verdict_key] = verdict
    directory = _directory()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=directory, suffix=".tmp", delete=False) as f:
            json.dump(dataclasses.asdict(verdict), f)
        os.replace(f.name, directory / f"{verdict_key}.json")
    except OSError as exc:
        log.debug("could not write a validation verdict to %s: %s", directory, exc)


def clear_memory() -> None:
    """Forget the verdicts kept in memory (the ones on disk stay)."""
    _MEMORY.clear()
