"""``quantize_experts``: one grouped (optionally MXFP8 / NVFP4) parameter per expert projection.

* **Stacked** experts (HF ``gate_up_proj [E, 2I, H]``, torchtitan ``w1 [E, I, H]``, ...): each rank-3
  parameter is replaced in place by a ``GroupedQuantWeight`` parameter of the same logical shape, so
  the model's own ``torch._grouped_mm(x, w.transpose(-2, -1), offs)`` (or eager per-expert loop) runs
  unchanged and is intercepted by the subclass. State-dict keys do not change.
* **ModuleList** experts (``experts[e].w1 / w2 / w3`` as ``nn.Linear``): the list is replaced by a
  ``GroupedExpertList`` holding one grouped parameter per linear path (``w1_weight [E, N, K]``, ...).
  Every expert keeps its class and forward; its ``nn.Linear`` children become ``GroupedLinear`` views
  that compute ``F.linear(x, W[e], b[e])`` on the grouped weight (on CUDA, a weight-only kernel
  call; see ``grouped_weight``), so the parent's routing loop runs unchanged. For a grouped forward,
  ``GroupedExpertList.grouped_weight(path)`` is the ``[E, N, K]`` operand of ``torch.ops.moe.grouped_mm``.

NOTE [checkpoint layout]: a ``GroupedExpertList`` saves **per-expert keys** (``experts.3.w1.weight``), the layout of the
original model, so its state dict loads into the unconverted model; quantised values are saved as 2-D
``GroupedQuantWeight`` slices and dequantised (or their bf16 master copied) by ``copy_`` when loaded into a plain model.
It loads per-expert keys (plain or quantised) and grouped keys: quantised inputs of the same recipe are copied byte for
byte, plain inputs are quantised. Stacked groups keep their keys; ``param.copy_`` does the same conversions.

Recipes: ``"bf16"`` regroups into plain bf16 parameters (casting if needed), ``"mxfp8"`` and
``"nvfp4"`` quantise with torchao. ``master_weights=True`` keeps a bf16 master inside each quantised
parameter (NOTE [training with quantised weights] (moe_compile/experts/grouped_weight.py)). torchao is imported only
when a quantised recipe is used.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from moe_compile.experts.discovery import ExpertGroup, ExpertLinear, find_expert_weights

log = logging.getLogger(__name__)
RECIPES = ("bf16", "mxfp8", "nvfp4")


def quantize_experts(
    model: nn.Module,
    recipe: str = "mxfp8",
    *,
    master_weights: bool = False,
    filter_fn: Callable[[str, nn.Module], bool] | None = None,
) -> nn.Module:
    """Replace every expert weight of ``model`` (in place) with one grouped parameter per projection.

    Args:
        model: the model; expert groups are found by ``moe_compile.experts.find_expert_weights``.
        recipe: ``"bf16"`` (regroup only), ``"mxfp8"`` or ``"nvfp4"``.
        master_weights: keep a bf16 master inside each quantised parameter for training; otherwise the
            parameter is stored quantised (quantised primary weights). Ignored for ``"bf16"``.
        filter_fn: optional ``(qualified_name, module) -> bool`` to skip expert groups.

    Returns:
        ``model``.

    Raises:
        ValueError: unknown recipe, no expert weights found, or K not a multiple of the block size
            (32 for mxfp8, 16 for nvfp4); the message names the parameter.
    """
    if recipe not in RECIPES:
        raise ValueError(f"recipe={recipe!r} is not supported; use one of {RECIPES}")
    groups = find_expert_weights(model, filter_fn)
    if not groups:
        raise ValueError(f"no expert weights found in {type(model).__name__} (see moe_compile.experts.discovery)")
    for group in groups:
        if group.kind == "stacked":
            _convert_stacked(group, recipe, master_weights)
        else:
            parent_name, _, attr = group.name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, attr, GroupedExpertList(group.module, group.linears, recipe, master_weights, group.name))
        num_experts = group.linears[0].num_experts
        log.info("quantize_experts: %s (%s, %d experts) -> %s", group.name, group.kind, num_experts, recipe)
    return model


def make_grouped_weight(
    w: torch.Tensor, recipe: str, master_weights: bool, is_transposed: bool = False, name: str = "w"
) -> torch.Tensor:
    """``[E, N, K]`` (``[E, K, N]`` if transposed) -> plain bf16 or a ``GroupedQuantWeight``."""
    if w.dim() != 3:
        raise ValueError(f"{name} must be 3-D [E, N, K], got shape {tuple(w.shape)}")
    if type(w).__name__ == "GroupedQuantWeight":  # re-quantising: start from the best copy we have
        if w.master is None:
            w = w.dequantize()
        else:
            w = w.master.transpose(-2, -1) if w.is_transposed else w.master
    if recipe == "bf16":
        return w.detach().to(torch.bfloat16).clone()
    from moe_compile.experts.grouped_weight import GroupedQuantWeight

    try:
        return GroupedQuantWeight.from_hp(w.detach(), recipe, keep_master=master_weights, is_transposed=is_transposed)
    except (ValueError, TypeError) as err:
        raise type(err)(f"{name}: {err}") from None


def _convert_stacked(group: ExpertGroup, recipe: str, master_weights: bool) -> None:
    for spec in group.linears:
        old = getattr(group.module, spec.path)
        new = make_grouped_weight(old, recipe, master_weights, spec.is_transposed, f"{group.name}.{spec.path}")
        setattr(group.module, spec.path, nn.Parameter(new, requires_grad=old.requires_grad))


# ===== ModuleList experts =====


def _param_names(path: str) -> tuple[str, str]:
    stem = path.replace(".", "_")
    return (f"{stem}_weight", f"{stem}_bias") if stem else ("weight", "bias")


def _expert_key(prefix: str, e: int, path: str, kind: str) -> str:
    return f"{prefix}{e}.{path}.{kind}" if path else f"{prefix}{e}.{kind}"


class GroupedLinear(nn.Module):
    """Expert ``index``'s view of a ``GroupedExpertList`` projection; holds no parameters."""

    def __init__(self, owner: GroupedExpertList, path: str, index: int, in_features: int, out_features: int):
        super().__init__()
        self.__dict__["_owner"] = owner  # a back reference, not a submodule
        self.weight_name, self.bias_name = _param_names(path)
        self.index = index
        self.in_features, self.out_features = in_features, out_features

    @property
    def weight(self) -> torch.Tensor:
        return getattr(self._owner, self.weight_name)[self.index]

    @property
    def bias(self) -> torch.Tensor | None:
        bias = getattr(self._owner, self.bias_name, None)
        return None if bias is None else bias[self.index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        return F.linear(x.to(w.dtype), w, b).to(x.dtype)

    def extra_repr(self) -> str:
        return f"expert={self.index}, in_features={self.in_features}, out_features={self.out_features}"


class GroupedExpertList(nn.ModuleList):
    """The experts of an ``nn.ModuleList``, their linears regrouped into ``[E, N, K]`` parameters.

    Args:
        experts: the original list (its linears are replaced; the experts themselves are reused).
        linears: the projections found by ``find_expert_weights``.
        recipe: ``"bf16"``, ``"mxfp8"`` or ``"nvfp4"``.
        master_weights: see ``quantize_experts``.
        name: qualified name, for error messages.
    """

    def __init__(
        self,
        experts: nn.ModuleList,
        linears: tuple[ExpertLinear, ...],
        recipe: str,
        master_weights: bool,
        name: str = "",
    ):
        super().__init__()
        self.paths = tuple(spec.path for spec in linears)
        for spec in linears:
            mods = [experts[e].get_submodule(spec.path) if spec.path else experts[e] for e in range(len(experts))]
            w_name, b_name = _param_names(spec.path)
            weight = torch.stack([m.weight.detach() for m in mods])
            grouped = make_grouped_weight(weight, recipe, master_weights, name=f"{name}.{spec.path or 'weight'}")
            self.register_parameter(w_name, nn.Parameter(grouped, requires_grad=mods[0].weight.requires_grad))
            if spec.has_bias:
                bias = torch.stack([m.bias.detach() for m in mods]).to(grouped.dtype)
                self.register_parameter(b_name, nn.Parameter(bias, requires_grad=mods[0].bias.requires_grad))
        for e, expert in enumerate(experts):
            for spec in linears:
                view = GroupedLinear(self, spec.path, e, spec.in_features, spec.out_features)
                if not spec.path:
                    expert = view
                else:
                    parent_path, _, attr = spec.path.rpartition(".")
                    setattr(expert.get_submodule(parent_path) if parent_path else expert, attr, view)
            self.append(expert)
        self.register_state_dict_post_hook(_to_per_expert_keys)
        self._register_load_state_dict_pre_hook(_from_per_expert_keys, with_module=True)

    def grouped_weight(self, path: str) -> torch.Tensor:
        """The ``[E, N, K]`` weight of projection ``path`` (e.g. ``"w1"``; ``""`` when experts are linears)."""
        return getattr(self, _param_names(path)[0])

    def grouped_bias(self, path: str) -> torch.Tensor | None:
        """The ``[E, N]`` bias of projection ``path``, or None."""
        return getattr(self, _param_names(path)[1], None)


def _to_per_expert_keys(module: GroupedExpertList, state_dict: dict, prefix: str, local_metadata) -> None:
    """Grouped keys -> the original per-expert keys (NOTE [checkpoint layout])."""
    for path in module.paths:
        for kind, pname in zip(("weight", "bias"), _param_names(path)):
            grouped = state_dict.pop(prefix + pname, None)
            if grouped is None:
                continue
            for e in range(grouped.shape[0]):
                state_dict[_expert_key(prefix, e, path, kind)] = grouped[e]


def _from_per_expert_keys(
    module: GroupedExpertList, state_dict: dict, prefix: str, local_metadata, strict, missing, unexpected, errors
) -> None:
    """Per-expert keys (all ``E`` of them) -> one stacked grouped entry (NOTE [checkpoint layout])."""
    num_experts = len(module)
    for path in module.paths:
        for kind, pname in zip(("weight", "bias"), _param_names(path)):
            keys = [_expert_key(prefix, e, path, kind) for e in range(num_experts)]
            if not all(k in state_dict for k in keys):
                continue
            parts = [state_dict.pop(k) for k in keys]
            state_dict[prefix + pname] = _stack(parts)


def _stack(parts: list[torch.Tensor]) -> torch.Tensor:
    quantized = [p for p in parts if type(p).__name__ == "GroupedQuantWeight"]
    if len(quantized) == len(parts) and len({(p.recipe, p.is_transposed) for p in quantized}) == 1:
        return type(parts[0]).stack(parts)
    return torch.stack([p.dequantize() if type(p).__name__ == "GroupedQuantWeight" else p for p in parts])
