"""Library kernels called with torch's deterministic flag on, for that one call: ``moe::deterministic_<op>``.

Some library kernels have a deterministic mode that they pick at call time from torch's global flag
(``torch.use_deterministic_algorithms(True)``, not ``warn_only``): FlashAttention-2's backward then sums dQ
over the key blocks in a fixed order instead of with atomic adds, and so does the memory-efficient
attention backward. Turning the flag on for a whole step changes every other op too (some raise, some
pick slower kernels; a Qwen3-MoE training step took almost twice as long, as SDPA then traced to the math
backend: benchmarks/results/train_determinism_qwen3_moe.json and its siblings, ``inductor_det`` against
``inductor``). Each op here has the schema of the aten op it wraps, so a pass swaps a node's target and keeps its
arguments (:mod:`moe_compile.passes.deterministic_scatter`).

The ops are defined when this module is imported (compiled code from Inductor's cache calls them by
name), for the wrapped ops this torch has.
"""

from __future__ import annotations

import contextlib

import torch

# aten ops (overload ``default``) whose kernel reads torch's deterministic flag at call time
FLAG_SELECTED: tuple[str, ...] = (
    "_scaled_dot_product_flash_attention_backward",
    "_flash_attention_backward",
    "_scaled_dot_product_efficient_attention_backward",
    "_efficient_attention_backward",
)
PREFIX = "deterministic_"

_lib = torch.library.Library("moe", "FRAGMENT")
# aten overload -> the moe op that calls it with the flag on
WRAPPED: dict[torch._ops.OpOverload, torch._ops.OpOverload] = {}


def _with_flag(aten_op: torch._ops.OpOverload):
    def call(*args, **kwargs):
        enabled = torch.are_deterministic_algorithms_enabled()
        warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            return aten_op(*args, **kwargs)
        finally:
            torch.use_deterministic_algorithms(enabled, warn_only=warn_only)

    return call


def _define(name: str) -> None:
    packet = getattr(torch.ops.aten, name, None)
    if packet is None or "default" not in packet.overloads():
        return
    aten_op = packet.default
    schema = str(aten_op._schema)
    assert schema.startswith(f"aten::{name}("), schema
    ours = PREFIX + name
    _lib.define(ours + schema[len(f"aten::{name}"):])
    # one implementation for every backend, Meta included (fake tensors then run the aten op's meta)
    _lib.impl(ours, _with_flag(aten_op), "CompositeExplicitAutograd")
    WRAPPED[aten_op] = getattr(torch.ops.moe, ours).default


# SDPA backends whose backward is deterministic (flash and memory-efficient with the flag, math: matmuls).
# cuDNN's has no deterministic mode, and torch 2.11 prefers it on sm90; with it disabled SDPA traces to
# flash. Only the trace matters: the backend is chosen when AOTAutograd decomposes SDPA.
DETERMINISTIC_SDPA_BACKENDS: tuple[str, ...] = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


def deterministic_sdpa() -> contextlib.AbstractContextManager:
    """A context in which ``scaled_dot_product_attention`` only picks :data:`DETERMINISTIC_SDPA_BACKENDS`."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, name) for name in DETERMINISTIC_SDPA_BACKENDS])


for _name in FLAG_SELECTED:
    _define(_name)
