"""On-device router metrics: per-layer accumulators, and the one place that reads them back.

Two ways fill the accumulators, both through ``torch.ops.moe.router_metrics_`` (see
:mod:`moe_compile.ops.router_metrics` for what it adds per call):

* **Compiled graphs** (``moe_compile.compile(model, metrics=True)`` or
  ``options={"moe.metrics": True}``): the ``router_metrics`` pre-grad pass finds every router in each
  graph (a ``topk`` over router logits from an ``[E, H]`` linear, or the ``topk`` feeding a
  ``moe.permute_pad``) and inserts the op, with the layer's accumulator as a buffer of the graph
  module. No host sync, fixed-size in-place updates: CUDA graphs (``mode="reduce-overhead"``) stay
  possible.
* **Forward hooks** from :func:`attach` on every router module. They run in eager code, including
  frames where Dynamo falls back to eager, and Dynamo traces them into compiled graphs too; the pass
  then sees the op already there and adds nothing, so attaching and compiling never count twice.

Use :func:`attach` (with or without compiling) when

* part of the model may run eagerly (graph breaks, eager fallback, no compile at all);
* blocks are compiled one by one (``block.compile()`` per layer, as with FSDP2): such a graph is
  shared by all blocks and sees module paths relative to the block, so the pass alone pools every
  layer under one name (``moe/layer_gate``); hooks keep the layers apart;
* blocks run under ``torch.utils.checkpoint``: Dynamo puts them in a higher-order-op body the pass does
  not instrument (it reports ``inside_subgraph``); hooks are traced into the body. In eager mode the
  hooks skip the recomputation in the backward pass.

:func:`collect` reads everything with one device-to-host copy per device (normally one sync), averages
over the calls since the last :func:`reset` (steps, e.g. microbatches) and over layers, and returns plain
floats under ``moe/...`` keys (``per_layer=True`` adds ``moe/layer_{i}/...``). :func:`reset` zeroes the
accumulators in place, so compiled graphs and captured CUDA graphs keep writing to the same memory.

Layers are named by the router's module path (``model.layers.3.mlp.gate``); the layer id in keys is the
last integer in that path (``3``), or the path with non-word characters turned into ``_`` when there is
none or when two reporting paths share an integer. Accumulators are process-global and keyed by path:
two models with the same module paths share them (:func:`forget` drops them all).

Where a layer has an expert capacity (``attach(..., capacity_factor=)`` or
:func:`set_capacity_factor` before compiling), ``moe/over_capacity`` is the fraction of assignments
beyond ``ceil(capacity_factor * T*K / E)`` per expert; without any capacity the key is absent.

The load-balancing loss follows transformers' ``load_balancing_loss_func`` on one layer
(``E * sum_e (count_e / T) * P_e``, so ``K`` when perfectly balanced; divide by ``K`` for the Switch
form with ``f_e`` the fraction of assignments). transformers pools all layers' logits before the
product; ``moe/lb_loss`` is the mean of the per-layer losses (equal when layers agree). Padding tokens
are counted (there is no attention mask at the router).
"""

from __future__ import annotations

import dataclasses
import re
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from moe_compile.ops.router_metrics import NUM_STATS, STATS, new_accumulator, router_metrics_

__all__ = ["accumulator", "attach", "collect", "detach", "forget", "inductor_patches", "layers", "reset",
           "set_capacity_factor"]

PREFIX = "moe/"
# Per-step averages reported for every layer (``steps`` and ``over_capacity`` are handled apart).
_AVERAGED = ("tokens", "lb_loss", "z_loss", "entropy", "max_over_mean_load", "invalid_ids")
_STEPS, _OVER_CAPACITY = STATS.index("steps"), STATS.index("over_capacity")


@dataclasses.dataclass
class LayerAccumulator:
    """One router's accumulator on one device."""

    name: str
    num_experts: int
    capacity_factor: float | None
    acc_S: torch.Tensor
    drops: bool = False  # a capacity layer that drops its choices past the capacity (over_capacity counts them)


_LOCK = threading.Lock()
_REGISTRY: dict[tuple[str, str], LayerAccumulator] = {}
_CAPACITY: dict[str | None, float] = {}


def _device_key(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type != "cpu" and device.index is None:
        device = torch.device(device.type, torch.accelerator.current_device_index())
    return str(device)


def accumulator(
    name: str, num_experts: int, device: torch.device | str, capacity_factor: float | None = None
) -> LayerAccumulator:
    """The accumulator of router ``name`` on ``device``, created (zeroed) on first use.

    The same tensor is returned for every graph and hook of that router, so recompiles keep adding
    into it; its address never changes (CUDA-graph safe).
    """
    key = (name, _device_key(device))
    with _LOCK:
        entry = _REGISTRY.get(key)
        if entry is not None and entry.num_experts != num_experts:
            raise ValueError(
                f"router {name!r} was registered with {entry.num_experts} experts, now {num_experts}; "
                "call moe_compile.metrics.forget() between unrelated models with the same module paths"
            )
        if entry is None:
            acc_S = new_accumulator(num_experts, key[1])
            # Cudagraph trees treat the tensor as static (fixed address), so in-place updates are allowed.
            torch._dynamo.mark_static_address(acc_S, guard=False)
            entry = LayerAccumulator(name, num_experts, None, acc_S)
            _REGISTRY[key] = entry
        if capacity_factor is None:
            capacity_factor = capacity_factor_for(name)
        if capacity_factor is not None:
            entry.capacity_factor = float(capacity_factor)
        return entry


def set_capacity_factor(capacity_factor: float | None, layer: str | None = None) -> None:
    """Declare an expert capacity (as a multiple of the balanced load ``T*K/E``) for metrics.

    ``layer=None`` sets the default for every router; otherwise the router's module path. Compiled
    graphs read it when they are compiled (recompile after changing it). ``None`` removes it.
    """
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be > 0 or None, got {capacity_factor!r}")
    if capacity_factor is None:
        _CAPACITY.pop(layer, None)
    else:
        _CAPACITY[layer] = float(capacity_factor)


def capacity_factor_for(name: str) -> float | None:
    return _CAPACITY.get(name, _CAPACITY.get(None))


def layers() -> list[str]:
    """Module paths of the routers that have an accumulator, sorted."""
    return sorted({name for name, _ in _REGISTRY})


def reset() -> None:
    """Zero every accumulator in place (no host sync; safe between CUDA-graph replays)."""
    _zero_all()


def _zero_all() -> None:
    with torch.no_grad():
        for entry in list(_REGISTRY.values()):
            entry.acc_S.zero_()


def forget() -> None:
    """Drop every accumulator and capacity setting (graphs compiled before keep their own tensors)."""
    with _LOCK:
        _REGISTRY.clear()
        _CAPACITY.clear()


# ----------------------------------------------------------------------------------------- collect


def collect(reset: bool = True, per_layer: bool = False, group: Any = None) -> dict[str, float]:
    """Read every accumulator back and return averaged metrics as plain floats.

    Values are averaged over the calls (steps) of each layer since the last reset, then over layers. With a
    ``torch.distributed`` process ``group`` (expert or data parallelism) every rank of it must call ``collect`` at
    the same point: the accumulators are summed over the group's ranks first (one ``all_reduce`` per device), so
    each value is averaged over every rank's calls, ``tokens_per_expert/{e}`` included (per rank and call: times
    the group's size, the load of expert ``e`` across the ranks) and ``moe/ranks`` gives the size:

    ``moe/lb_loss``            load-balancing loss ``E * sum_e f_e P_e`` (transformers' convention,
                               ``f_e = count_e / T``; equals ``K`` when perfectly balanced)
    ``moe/z_loss``             router z-loss, mean squared logsumexp of the logits
    ``moe/entropy``            mean routing entropy in nats (``log E`` at most)
    ``moe/max_over_mean_load`` max over mean tokens per expert (1 when balanced)
    ``moe/over_capacity``      fraction of assignments over capacity (only with a capacity)
    ``moe/dropped_fraction``   fraction of the routed choices a capacity layer dropped (layers whose one-hot
                               capacity dispatch ``capacity_dispatch`` rewrote; the choices past ``C`` per expert)
    ``moe/tokens``             tokens routed per layer per step
    ``moe/invalid_ids``        assignments per step whose expert id is outside ``[0, E)`` (0 unless the router
                               produced bad ids: ``moe.permute_pad`` poisons those tokens with NaN on CUDA)
    ``moe/tokens_per_expert_min`` / ``_max``  extreme per-expert loads, per step
    ``moe/steps``              calls per layer since the reset; ``moe/layers``: layers that reported

    ``per_layer=True`` adds the same per layer as ``moe/layer_{i}/<name>``, plus
    ``moe/layer_{i}/tokens_per_expert/{e}``. Layers without a call since the reset are left out; an
    empty dict means no router ran. This is the only host sync of the metrics (one copy per device).
    """
    entries = list(_REGISTRY.values())
    if not entries:
        return {}
    by_device: dict[torch.device, list[LayerAccumulator]] = {}
    for entry in entries:
        by_device.setdefault(entry.acc_S.device, []).append(entry)
    rows: dict[str, list[float]] = {}
    for on_device in by_device.values():
        on_device.sort(key=lambda e: e.name)  # the same order on every rank of a group
        flat_S = torch.cat([e.acc_S for e in on_device])
        if group is not None:
            torch.distributed.all_reduce(flat_S, group=group)
        flat = flat_S.tolist()  # the sync
        start = 0
        for e in on_device:
            row = flat[start : start + e.acc_S.numel()]
            start += e.acc_S.numel()
            if e.name in rows:  # the same router on two devices
                row = [a + b for a, b in zip(rows[e.name], row)]
            rows[e.name] = row
    if reset:
        _zero_all()
    capacity = {e.name: e.capacity_factor for e in entries}
    out = _summarise(rows, capacity, per_layer, frozenset(e.name for e in entries if e.drops))
    if group is not None and out:
        out[PREFIX + "ranks"] = float(torch.distributed.get_world_size(group))
    return out


def _summarise(rows: dict[str, list[float]], capacity: dict[str, float | None], per_layer: bool,
               dropping: frozenset[str] = frozenset()) -> dict[str, float]:
    per: dict[str, dict[str, Any]] = {}
    for name, row in rows.items():
        steps = row[_STEPS]
        if steps <= 0:
            continue
        stats = {key: row[STATS.index(key)] / steps for key in _AVERAGED}
        counts = [c / steps for c in row[NUM_STATS:]]
        stats["tokens_per_expert_min"] = min(counts)
        stats["tokens_per_expert_max"] = max(counts)
        if capacity.get(name) is not None or name in dropping:
            stats["over_capacity"] = row[_OVER_CAPACITY] / steps
        if name in dropping:
            stats["dropped_fraction"] = row[_OVER_CAPACITY] / steps
        stats["steps"] = steps
        per[name] = {"stats": stats, "counts": counts}
    if not per:
        return {}
    ids = _layer_ids(per)  # among the layers that report
    out: dict[str, float] = {}
    keys = [*_AVERAGED, "tokens_per_expert_min", "tokens_per_expert_max", "over_capacity", "dropped_fraction",
            "steps"]
    for key in keys:
        values = [p["stats"][key] for p in per.values() if key in p["stats"]]
        if values:
            out[PREFIX + key] = float(sum(values) / len(values))
    out[PREFIX + "layers"] = float(len(per))
    if per_layer:
        for name in sorted(per, key=lambda n: _sort_key(ids[n])):
            base = f"{PREFIX}layer_{ids[name]}/"
            for key, value in per[name]["stats"].items():
                out[base + key] = float(value)
            for e, count in enumerate(per[name]["counts"]):
                out[f"{base}tokens_per_expert/{e}"] = float(count)
    return out


_INDEX = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")


def _layer_ids(names: Iterable[str]) -> dict[str, str]:
    """``model.layers.3.mlp.gate`` -> ``"3"``; paths without an integer, or sharing one, keep their name."""
    names = sorted(names)
    index = {n: (m[-1] if (m := _INDEX.findall(n)) else None) for n in names}
    taken: dict[str, int] = {}
    for i in index.values():
        if i is not None:
            taken[i] = taken.get(i, 0) + 1
    return {n: i if i is not None and taken[i] == 1 else re.sub(r"\W", "_", n) or "root" for n, i in index.items()}


def _sort_key(layer_id: str) -> tuple[int, int, str]:
    return (0, int(layer_id), "") if layer_id.isdigit() else (1, 0, layer_id)


# ------------------------------------------------------------------------------------------ attach

_HOOKS: "weakref.WeakKeyDictionary[nn.Module, Any]" = weakref.WeakKeyDictionary()
_TOP_K_ATTRS = ("top_k", "num_experts_per_tok", "topk", "k")


def attach(
    model: nn.Module, *, capacity_factor: float | None = None, top_k: int | None = None
) -> list[str]:
    """Accumulate router metrics of ``model`` in eager mode (and in any frame Dynamo runs eagerly).

    Puts a forward hook on every router module: a module with a 2-D ``weight`` ``[E, H]`` that is the
    ``gate``/``router`` child of a module with an ``experts`` child or a ``top_k`` /
    ``num_experts_per_tok`` attribute, or whose class name ends in ``Router``. A router returning
    ``(logits, weights, expert_idx)`` (transformers' MoE routers) is used as is; one returning only logits (an
    ``nn.Linear`` gate) gets ``topk(logits, k)`` with ``k`` from ``top_k`` or the parent's ``top_k`` /
    ``num_experts_per_tok``. Idempotent. Returns the instrumented module paths.
    """
    if capacity_factor is not None:
        for name in _find_routers(model):
            set_capacity_factor(capacity_factor, name)
    names = []
    for name, (router, parent) in _find_routers(model).items():
        k = top_k if top_k is not None else _top_k_of(router, parent)
        if router in _HOOKS:
            _HOOKS[router].remove()
        hook = _RouterHook(name, router.weight.shape[0], k, router.weight.device)
        _HOOKS[router] = router.register_forward_hook(hook)
        names.append(name)
    return names


def detach(model: nn.Module) -> None:
    """Remove the hooks that :func:`attach` put on ``model`` (accumulated values stay)."""
    for module in model.modules():
        handle = _HOOKS.pop(module, None)
        if handle is not None:
            handle.remove()


def _find_routers(model: nn.Module) -> dict[str, tuple[nn.Module, nn.Module | None]]:
    found: dict[str, tuple[nn.Module, nn.Module | None]] = {}
    for parent_name, parent in model.named_modules():
        for child_name, child in parent.named_children():
            path = f"{parent_name}.{child_name}" if parent_name else child_name
            weight = getattr(child, "weight", None)
            if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
                continue
            routed_parent = hasattr(parent, "experts") or _top_k_of(child, parent) is not None
            is_gate = child_name in ("gate", "router") and routed_parent
            if is_gate or type(child).__name__.endswith("Router"):
                found[path] = (child, parent)
    if isinstance(model, nn.Module) and type(model).__name__.endswith("Router") and not found:
        found[""] = (model, None)
    return found


def _top_k_of(router: nn.Module, parent: nn.Module | None) -> int | None:
    for obj in (router, parent, getattr(parent, "config", None)):
        for attr in _TOP_K_ATTRS:
            value = getattr(obj, attr, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


class _RouterHook:
    """Forward hook of one router. The accumulator is looked up at attach time (and again only when
    the model moved to another device), so that Dynamo traces the hook without a graph break."""

    def __init__(self, name: str, num_experts: int, top_k: int | None, device: torch.device) -> None:
        self.name, self.num_experts, self.top_k = name, num_experts, top_k
        self.entry = None if device.type == "meta" else accumulator(name, num_experts, device)

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        # NOTE [activation checkpointing]: torch.utils.checkpoint re-runs the forward (and this hook)
        # inside the backward pass; count each token once. Compiled graphs never recompute the
        # accumulator update (AOTAutograd keeps mutations in the forward graph).
        if not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1:
            return
        logits, expert_idx = _logits_and_idx(output, self.num_experts)
        if logits is None:
            return
        if expert_idx is None:
            k = self.top_k
            if k is None:
                raise ValueError(
                    f"router {self.name!r} returns only logits; pass attach(model, top_k=...) so metrics "
                    "can count its choices"
                )
            expert_idx = torch.topk(logits.detach(), k, dim=-1).indices
        if self.entry is None or self.entry.acc_S.device != logits.device:
            self.entry = accumulator(self.name, self.num_experts, logits.device)
        entry = self.entry
        router_metrics_(entry.acc_S, logits, expert_idx, entry.capacity_factor or 0.0)


def _logits_and_idx(output: Any, num_experts: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if isinstance(output, torch.Tensor):
        return (output, None) if output.shape[-1] == num_experts else (None, None)
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        logits = output[0]
        if logits.shape[-1] != num_experts:
            return None, None
        for t in output[1:]:
            if isinstance(t, torch.Tensor) and not t.is_floating_point() and t.dim() >= 1:
                if t.shape[:-1].numel() == logits.shape[:-1].numel():
                    return logits, t
        return logits, None
    return None, None


def inductor_patches(metrics_enabled: bool) -> dict[str, Any]:
    """Inductor config the backend must add when metrics are on.

    torch 2.13 runs pre-grad passes after AOTAutograd has listed the module's buffers ("late" timing,
    the default for passes with a ``uuid``); the accumulators the ``router_metrics`` pass registers
    would then never become graph inputs. "early" runs them first, as torch 2.11 always does.
    """
    if metrics_enabled and hasattr(torch._inductor.config, "pre_grad_pass_timing"):
        return {"pre_grad_pass_timing": "early"}
    return {}
