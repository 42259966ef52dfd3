"""Find expert weights in a model: stacked 3-D parameters and ModuleLists of per-expert linears.

Two layouts are recognised (``E`` experts, ``N`` output features, ``K`` input features):

* **stacked**: a module holding rank-3 parameters that share ``E = shape[0]``, e.g. Hugging Face
  ``*Experts`` (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``; ``[E, K, N]`` when the module has
  ``is_transposed = True``) or torchtitan ``GroupedExperts`` (``w1/w3 [E, I, H]``, ``w2 [E, H, I]``).
  The module must look like an experts container: its class name or attribute name contains
  "expert", or it has a ``num_experts`` / ``num_local_experts`` attribute equal to ``E``.
* **module_list**: an ``nn.ModuleList`` whose attribute name contains "expert" and whose ``E >= 2``
  items are all ``nn.Linear`` of one shape, or modules of one class with the same ``nn.Linear``
  children (same paths, shapes and bias presence), e.g. ``experts[e].w1 / w2 / w3``.

:func:`find_expert_layers` also finds the experts modules in other layouts (a ``*Experts`` class, a ``ModuleDict``
of experts, experts as rows of embedding tables), which nothing rewrites but ``explain`` must account for.

Nothing here imports torchao or changes the model; passes and ``quantize_experts`` share it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Literal

import torch
from torch import nn

_EXPERT_NAME = re.compile("expert", re.IGNORECASE)
_NOT_EXPERT_CONTAINERS = (nn.modules.conv._ConvNd, nn.Linear, nn.Embedding, nn.MultiheadAttention)


@dataclass(frozen=True)
class ExpertLinear:
    """One projection of every expert: a stacked parameter or the same linear path in each expert.

    Attributes:
        path: stacked: the parameter name on the module (``"gate_up_proj"``); module_list: the linear's
            path inside one expert (``"w1"``, ``"mlp.up_proj"``, or ``""`` when experts are linears).
        num_experts: ``E``.
        out_features: ``N``.
        in_features: ``K`` (the reduction dim).
        is_transposed: stored as ``[E, K, N]`` instead of ``[E, N, K]`` (stacked only).
        has_bias: per-expert bias (module_list: ``Linear.bias``; stacked: a ``<path>_bias`` parameter).
    """

    path: str
    num_experts: int
    out_features: int
    in_features: int
    is_transposed: bool = False
    has_bias: bool = False


@dataclass(frozen=True)
class ExpertGroup:
    """A module owning the weights of ``E`` experts.

    Attributes:
        name: qualified module name in the model (``"layers.0.mlp.experts"``).
        module: the module (stacked) or the ``nn.ModuleList`` (module_list).
        kind: ``"stacked"`` or ``"module_list"``; ``"flat"``: 2-D ``[E*N, K]`` parameters (DBRX), which only the
            expert-loop swap finds and reads (``experts/swap.py``: ``_flat_expert_groups``), not
            :func:`find_expert_weights`.
        linears: the projections, in parameter order.
    """

    name: str
    module: nn.Module
    kind: Literal["stacked", "module_list", "flat"]
    linears: tuple[ExpertLinear, ...]


def find_expert_weights(
    model: nn.Module, filter_fn: Callable[[str, nn.Module], bool] | None = None
) -> list[ExpertGroup]:
    """Return every expert group in ``model``, outermost first; nested groups are not searched again.

    Args:
        model: any ``nn.Module``.
        filter_fn: optional ``(qualified_name, module) -> bool``; groups for which it returns False are
            skipped.

    Returns:
        One ``ExpertGroup`` per experts module, in ``named_modules`` order.
    """
    groups: list[ExpertGroup] = []
    claimed: list[str] = []
    for name, module in model.named_modules():
        if any(name == c or name.startswith(c + ".") for c in claimed):
            continue
        attr = name.rsplit(".", 1)[-1]
        group = _as_module_list(name, attr, module) or _as_stacked(name, attr, module)
        if group is None or (filter_fn is not None and not filter_fn(name, module)):
            continue
        groups.append(group)
        claimed.append(name)
    return groups


@dataclass(frozen=True)
class ExpertLayer:
    """A module that holds the experts of one MoE layer, in whatever layout (what ``explain`` accounts for).

    Attributes:
        name: qualified module name in the model.
        module: the module.
        seen: what it looks like, in a few words (its class and weights), for a reason's detail.
    """

    name: str
    module: nn.Module
    seen: str


def find_expert_layers(model: nn.Module) -> list[ExpertLayer]:
    """Every module that holds experts, outermost first: the groups of :func:`find_expert_weights`, and the
    experts containers in layouts it does not read: a class named ``*Experts`` (transformers' naming: DBRX's 2-D
    ``[E*I, H]`` weights), or an ``nn.ModuleDict`` / ``nn.ModuleList`` whose attribute name contains "expert" and
    holds two or more modules of one class (SwitchTransformers' ``experts["expert_0"]``), or a module whose experts are
    rows of ``nn.Embedding`` tables (Doge)."""
    groups = {g.name: g for g in find_expert_weights(model)}
    found: list[ExpertLayer] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(f.name + ".") for f in found):
            continue
        group = groups.get(name)
        if group is not None:
            what = ", ".join(f"{lin.path or 'linear'} [{lin.num_experts}, {lin.out_features}, {lin.in_features}]"
                             for lin in group.linears)
            found.append(ExpertLayer(name, module, f"{type(module).__name__} ({group.kind}: {what})"))
        elif type(module).__name__.endswith("Experts") or _is_expert_container(name, module) \
                or _is_expert_table(module):
            found.append(ExpertLayer(name, module, _describe(module)))
    return found


def _is_expert_table(module: nn.Module) -> bool:
    """Experts as rows of lookup tables: a module declaring ``num_experts`` ``E >= 2`` with an ``nn.Embedding`` child
    of ``E`` rows (Doge's retrieval experts: ``down_embed`` / ``up_embed [E, H]`` read by expert id)."""
    num_experts = getattr(module, "num_experts", None)
    return isinstance(num_experts, int) and num_experts >= 2 and any(
        isinstance(c, nn.Embedding) and c.num_embeddings == num_experts for c in module.children())


def _is_expert_container(name: str, module: nn.Module) -> bool:
    if not isinstance(module, (nn.ModuleDict, nn.ModuleList)) or not _EXPERT_NAME.search(name.rsplit(".", 1)[-1]):
        return False
    children = list(module.children())
    return len(children) >= 2 and len({type(c) for c in children}) == 1


def _describe(module: nn.Module) -> str:
    """``"SwitchTransformersExperts (ModuleDict of 4 SwitchTransformersDenseActDense: wi [64, 32], ...)"``."""
    children = list(module.children())
    if isinstance(module, (nn.ModuleDict, nn.ModuleList)) and children:
        container = "ModuleDict" if isinstance(module, nn.ModuleDict) else "ModuleList"
        return (f"{type(module).__name__} ({container} of {len(children)} {type(children[0]).__name__}: "
                f"{_shapes(children[0])})")
    return f"{type(module).__name__} ({_shapes(module)})"


def _shapes(module: nn.Module, limit: int = 3) -> str:
    params = [(n, tuple(p.shape)) for n, p in module.named_parameters()]
    shown = ", ".join(f"{n} {list(shape)}" for n, shape in params[:limit])
    return (shown + (f", ... ({len(params)} parameters)" if len(params) > limit else "")) or "no parameters"


def _as_stacked(name: str, attr: str, module: nn.Module, by_shape: bool = False) -> ExpertGroup | None:
    """``by_shape``: without the experts-like name or count, rank-3 parameters of one ``E >= 2``
    (:func:`unnamed_stacked_groups`)."""
    if isinstance(module, _NOT_EXPERT_CONTAINERS):
        return None
    # (a ModuleList only has rank-3 parameters once quantize_experts regrouped it: GroupedExpertList)
    params = {n: p for n, p in module.named_parameters(recurse=False) if p.dim() == 3}
    if not params:
        return None
    num_experts = {p.shape[0] for p in params.values()}
    if len(num_experts) != 1:
        return None
    (E,) = num_experts
    declared = getattr(module, "num_experts", None) or getattr(module, "num_local_experts", None)
    looks_like_experts = _EXPERT_NAME.search(type(module).__name__) or _EXPERT_NAME.search(attr) or declared == E
    if by_shape:
        looks_like_experts = E >= 2
    if not looks_like_experts or E < 1:
        return None
    is_transposed = bool(getattr(module, "is_transposed", False))
    linears = []
    for pname, p in params.items():
        n, k = (p.shape[2], p.shape[1]) if is_transposed else (p.shape[1], p.shape[2])
        bias = getattr(module, pname + "_bias", None)
        linears.append(ExpertLinear(pname, E, n, k, is_transposed, isinstance(bias, torch.Tensor)))
    return ExpertGroup(name, module, "stacked", tuple(linears))


def unnamed_stacked_groups(model: nn.Module, claimed: list[ExpertGroup]) -> list[ExpertGroup]:
    """Stacked experts that no name announces: a module (the MoE block itself included) holding rank-3 parameters of
    one leading size ``E >= 2`` (vLLM's reference ``torch_moe``: ``w1 [E, 2I, H]``, ``w2 [E, H, I]`` on the block; a
    module of one such weight counts only merged with its siblings, ``sibling_stacked_groups``), outside the
    ``claimed`` groups. Only the expert-loop swap reads them: its probe, which runs the block's own forward against
    the fused path, decides whether they are experts at all."""
    taken = [g.name for g in claimed]
    groups: list[ExpertGroup] = []
    for name, module in model.named_modules():
        if any(name == t or not t or name.startswith(t + ".") for t in taken):  # inside a group found already
            continue
        group = _as_stacked(name, name.rpartition(".")[2], module, by_shape=True)
        if group is not None:
            groups.append(group)
            taken.append(name)
    return groups


def _linears_of(expert: nn.Module) -> dict[str, nn.Linear]:
    if isinstance(expert, nn.Linear):
        return {"": expert}
    return {n: m for n, m in expert.named_modules() if isinstance(m, nn.Linear)}


def _as_module_list(name: str, attr: str, module: nn.Module) -> ExpertGroup | None:
    if not isinstance(module, nn.ModuleList) or len(module) < 2 or not _EXPERT_NAME.search(attr):
        return None
    experts = list(module)
    if len({type(e) for e in experts}) != 1:
        return None
    per_expert = [_linears_of(e) for e in experts]
    first = per_expert[0]
    if not first:
        return None

    def signature(linears: dict[str, nn.Linear]) -> list[tuple]:
        return [(p, tuple(m.weight.shape), m.bias is not None) for p, m in linears.items()]

    if any(signature(lin) != signature(first) for lin in per_expert[1:]):
        return None
    E = len(experts)
    linears = tuple(
        ExpertLinear(p, E, m.out_features, m.in_features, False, m.bias is not None) for p, m in first.items()
    )
    return ExpertGroup(name, module, "module_list", linears)
