"""The expert layouts the module-level swap (:mod:`moe_compile.experts.swap`) reads: projection names, stacked and
flat (``[E*I, H]``) parameters as ``[E, N, K]`` projections, and the grouped views of ModuleList experts
(NOTE [grouped views] (moe_compile/experts/swap.py)); and the activations and linear-router weightings its probe
tries."""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe_compile.experts._grad_views import GradViews, per_expert_views
from moe_compile.experts._probe import NotSwappable
from moe_compile.experts.discovery import ExpertGroup, ExpertLinear
from moe_compile.experts.interface import Projection
from moe_compile.experts.quantize import GroupedExpertList

_GATED = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"), ("w1", "v1", "w2"))
_FUSED_GATED = (("gate_up_proj", "down_proj"),)  # one [E, 2I, H] gate-then-up weight (transformers' *Experts)
_PLAIN = (("fc1", "fc2"), ("up_proj", "down_proj"), ("w1", "w2"), ("wi", "wo"))  # wi/wo: SwitchTransformers
_ACT_NAMES = ("act_fn", "act", "activation", "activation_fn")
# activations the probe tries for experts that call one directly (``F.silu(self.w1(x))``: no module to read it from)
ACT_CANDIDATES: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu, "gelu": F.gelu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh"), "relu": F.relu}
# how a linear router's top-k weights are computed, in the order the probe tries them (``_Plan.gate_weights``);
# "softmax_topk_in_dtype": the softmax in the logits' own dtype (bf16 probabilities: a top-k that ties there picks
# the lower expert id, where the fp32 softmax picks the larger)
GATE_WEIGHTS = ("softmax_topk_renorm", "topk_softmax", "softmax_topk", "softmax_topk_in_dtype")


def top_k_of_logits(logits_TE: Tensor, top_k: int, gate_weights: str,
                    bias_E: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(ids_TK, fp32 weights_TK)`` of a linear router's logits, by ``gate_weights`` (one of
    :data:`GATE_WEIGHTS`, ``_Plan.gate_weights``); ``bias_E``: a selection bias added to the probabilities for the
    choice only (the weights stay the unbiased probabilities: ERNIE 4.5's ``moe_statics``)."""
    if bias_E is not None:
        probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
        ids_TK = torch.topk(probs_TE + bias_E.reshape(-1).float(), top_k, dim=-1).indices
        weights_TK = probs_TE.gather(1, ids_TK)
        if gate_weights == "softmax_topk_renorm":
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        return ids_TK, weights_TK
    if gate_weights == "topk_softmax":
        top_TK, ids_TK = torch.topk(logits_TE.float(), top_k, dim=-1)
        return ids_TK, top_TK.softmax(dim=-1)
    if gate_weights == "softmax_topk_in_dtype":
        weights_TK, ids_TK = torch.topk(torch.softmax(logits_TE, dim=-1), top_k, dim=-1)
        return ids_TK, weights_TK.float()
    probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
    weights_TK, ids_TK = torch.topk(probs_TE, top_k, dim=-1)
    if gate_weights == "softmax_topk_renorm":
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    return ids_TK, weights_TK


def _act_of(*owners: Any) -> Callable[[Tensor], Tensor] | None:
    """The experts' activation module (``act_fn``, ...), or None: the probe then tries :data:`ACT_CANDIDATES`."""
    for owner in owners:
        for name in _ACT_NAMES:
            act = getattr(owner, name, None)
            if callable(act):
                return act
    return None


def _projection_names(available: set[str]) -> tuple[tuple[str, ...], bool]:
    for names in (*_GATED, *_FUSED_GATED):
        if set(names) <= available:
            return names, True
    for names in _PLAIN:
        if set(names) <= available:
            return names, False
    raise NotSwappable("unknown_expert_mlp", f"projections {sorted(available)} are not w1/w3/w2, w1/v1/w2, "
                                             "gate/up/down, gate_up/down, fc1/fc2, up/down, w1/w2, wi/wo")


@dataclasses.dataclass(frozen=True)
class MLPReading:
    """One way to read an expert group's projections as an MLP: ``paths`` (ups, then down), gated or plain, and for
    stacked weights whether every one is stored ``[E, K, N]`` (``x @ w[e]``; ``None``: as the names and the module
    say); ``hidden`` is the ``H`` it implies. The probe decides between readings."""

    paths: tuple[str, ...]
    gated: bool
    transposed: bool | None
    hidden: int


def _shape_readings(shapes: dict[str, tuple[int, int]], transposed: bool | None) -> list[MLPReading]:
    """Readings of projections ``{path: (out, in)}`` by their shapes alone, whatever their names: two of ``(I, H)``
    and ``(H, I)`` (plain: up, down), ``(2I, H)`` and ``(H, I)`` (one gate-then-up weight), or three of which two are
    ``(I, H)`` and one ``(H, I)`` (gated, both orders of gate and up)."""
    readings = []
    items = list(shapes.items())
    if len(items) == 2:
        for (a, (a_out, a_in)), (b, (b_out, b_in)) in (items, items[::-1]):
            if a_in == b_out and a_out == b_in:
                readings.append(MLPReading((a, b), False, transposed, a_in))
            if a_in == b_out and a_out == 2 * b_in:
                readings.append(MLPReading((a, b), True, transposed, a_in))
    elif len(items) == 3:
        for d, (d_out, d_in) in items:
            ups = [(n, sh) for n, sh in items if n != d]
            if all(sh == (d_in, d_out) for _, sh in ups):
                (u1, _), (u2, _) = ups
                readings += [MLPReading((u1, u2, d), True, transposed, d_out),
                             MLPReading((u2, u1, d), True, transposed, d_out)]
    return readings


def mlp_readings(group: ExpertGroup) -> list[MLPReading]:
    """Every reading of ``group``'s projections as an expert MLP, the one its names give first (``w1/w3/w2``,
    ``gate_up_proj/down_proj``, ...), then those its shapes allow (any names: ``linear_fc1/linear_fc2``,
    ``dense_h_to_4h/dense_4h_to_h``, stacked ``[E, H, I]`` weights read as ``x @ w[e]``, ...).

    Raises NotSwappable (``unknown_expert_mlp``) when neither gives one."""
    readings = []
    available = {lin.path for lin in group.linears} if group.kind == "module_list" else _projection_keys(group)
    try:
        names, gated = _projection_names(available)
    except NotSwappable:
        names = None
    if names is not None:
        readings.append(MLPReading(names, gated, None, 0))
    if group.kind == "module_list":
        shapes = {lin.path: (lin.out_features, lin.in_features) for lin in group.linears}
        readings += _shape_readings(shapes, None)
    elif group.kind == "stacked" and not isinstance(group.module, GroupedExpertList):
        shapes = {lin.path: (lin.out_features, lin.in_features) for lin in group.linears}
        fixed = hasattr(group.module, "is_transposed") or any(lin.is_transposed for lin in group.linears)
        readings += _shape_readings(shapes, None if fixed else False)
        if not fixed:
            readings += _shape_readings({n: (k, m) for n, (m, k) in shapes.items()}, True)
    unique = list(dict.fromkeys(readings))
    if not unique:
        shown = ", ".join(f"{lin.path or 'linear'} ({lin.out_features}, {lin.in_features})" for lin in group.linears)
        raise NotSwappable("unknown_expert_mlp", f"projections {shown} read as no expert MLP: not w1/w3/w2, w1/v1/w2, "
                                                 "gate/up/down, gate_up/down, fc1/fc2, up/down, w1/w2, wi/wo by "
                                                 "name, nor (I, H) + (H, I), (2I, H) + (H, I) or 2x (I, H) + (H, I) "
                                                 "by shape")
    return unique


def _projection_keys(group: ExpertGroup) -> set[str]:
    """The projection names of a stacked or flat group (a flat group's by their parameter's own name, ``w1`` for
    ``mlp.w1``)."""
    if isinstance(group.module, GroupedExpertList):
        return set(group.module.paths)
    return {lin.path.rpartition(".")[2] for lin in group.linears}


def _gate_up_transposed(group: ExpertGroup) -> bool:
    """Whether a stacked ``gate_up_proj`` / ``down_proj`` pair is stored ``[E, H, 2I]`` / ``[E, I, H]`` (``x @ w``, as
    Llama4TextExperts' ``bmm``) on a module that does not say so (no ``is_transposed``): the shapes tell, since
    ``[E, 2I, H]`` / ``[E, H, I]`` and the transposed pair cannot both fit (that would need ``I = 0``)."""
    shapes = {lin.path: (lin.out_features, lin.in_features) for lin in group.linears}
    if hasattr(group.module, "is_transposed") or not {"gate_up_proj", "down_proj"} <= set(shapes):
        return False
    (a, b), (c, d) = shapes["gate_up_proj"], shapes["down_proj"]
    return not (b == c and a == 2 * d) and a == d and b == 2 * c


def _stacked_projections(group: ExpertGroup, down: str | None = None,
                         transposed: bool | None = None) -> dict[str, Projection]:
    """``{projection name: Projection}`` of stacked experts: rank-3 parameters on the experts module, or the grouped
    (quantised) weights of a ``GroupedExpertList`` (``quantize_experts`` of ModuleList experts), by their original
    projection names (``w1``, not the parameter's ``w1_weight``); or the ``[E, I, H]`` views of a flat group's
    ``[E*I, H]`` parameters (:func:`_flat_expert_groups`), the ``down`` one transposed (``h @ w2[e]``).

    Read from the live parameters on every call: a view keeps the parameter's identity, ``state_dict`` and
    gradient (NOTE [grouped views] (moe_compile/experts/swap.py) is about ModuleLists, whose per-expert parameters need
    one grouped tensor)."""
    module = group.module
    if isinstance(module, GroupedExpertList):
        return {p: Projection(module.grouped_weight(p), module.grouped_bias(p)) for p in module.paths}
    out = {}
    if group.kind == "flat":
        for lin in group.linears:
            key = lin.path.rpartition(".")[2]
            w = module.get_parameter(lin.path).view(lin.num_experts, lin.out_features, lin.in_features)
            out[key] = Projection(w.transpose(1, 2) if key == down else w)
        return out
    flip = _gate_up_transposed(group) if transposed is None else transposed
    for lin in group.linears:
        owner, name = module, lin.path
        if "." in name:  # a path into a child (sibling_stacked_groups' merged groups)
            child, _, name = name.rpartition(".")
            owner = module.get_submodule(child)
        w = getattr(owner, name)
        if w.shape[0] != lin.num_experts:  # rows of identity experts that no id reads (identity_expert_groups)
            w = w[:lin.num_experts]
        bias = getattr(owner, name + "_bias", None)
        out[lin.path] = Projection(w.transpose(1, 2) if lin.is_transposed or flip else w, bias)
    return out


_EXPERT_COUNT_NAMES = ("num_experts", "num_local_experts", "moe_num_experts")


def _flat_expert_groups(model: nn.Module, claimed: list[ExpertGroup]) -> list[ExpertGroup]:
    """Experts modules whose weights are 2-D ``[E*I, H]`` parameters, every expert's ``[I, H]`` rows one after the
    other (DBRX: ``experts.mlp.w1 / v1 / w2``, run as ``x @ w1[e].T``, ``x @ v1[e].T``, ``h @ w2[e]``): a module
    named like experts (class ``*Experts`` or attribute ``*expert*``) declaring its ``E`` (``num_experts``, ...) whose
    parameters, its submodules' included, are two or more of one 2-D shape with rows a multiple of ``E``. Returned as
    :class:`ExpertGroup` of kind ``"flat"`` (the swap's own: the FX passes and ``quantize_experts`` read no such
    layout), one linear per parameter, ``[E, I, H]`` by its path (``mlp.w1``)."""
    taken = [g.name for g in claimed]
    groups = []
    for name, module in model.named_modules():
        if not name or any(name == t or name.startswith(t + ".") or t.startswith(name + ".") for t in taken):
            continue
        attr = name.rpartition(".")[2]
        if not (type(module).__name__.endswith("Experts") or "expert" in attr.lower()):
            continue
        E = next((getattr(module, n) for n in _EXPERT_COUNT_NAMES if isinstance(getattr(module, n, None), int)), 0)
        params = dict(module.named_parameters())
        shapes = {tuple(p.shape) for p in params.values()}
        if E < 1 or len(params) < 2 or len(shapes) != 1:
            continue
        (shape,) = shapes
        if len(shape) != 2 or shape[0] % E or len({n.rpartition(".")[2] for n in params}) != len(params):
            continue
        linears = tuple(ExpertLinear(n, E, shape[0] // E, shape[1]) for n in params)
        groups.append(ExpertGroup(name, module, "flat", linears))
        taken.append(name)
    return groups


def sibling_stacked_groups(model: nn.Module, groups: list[ExpertGroup]) -> list[ExpertGroup]:
    """``groups`` with stacked groups of one projection each that are children of one module merged into one group
    there, its projections by their paths from it (Aria's ``experts.fc1.weight`` / ``experts.fc2.weight``, each a
    module of one rank-3 weight ``[E, K, N]``): one projection is no MLP, two siblings of one ``E`` may be one."""
    singles: dict[str, list[ExpertGroup]] = {}
    for g in groups:
        if g.kind == "stacked" and len(g.linears) == 1 and "." in g.name \
                and not isinstance(g.module, GroupedExpertList):
            singles.setdefault(g.name.rpartition(".")[0], []).append(g)
    merged, out = set(), []
    for g in groups:
        parent = g.name.rpartition(".")[0]
        siblings = singles.get(parent, [])
        if len(siblings) < 2 or len({s.linears[0].num_experts for s in siblings}) != 1:
            out.append(g)
            continue
        if parent not in merged:
            merged.add(parent)
            linears = tuple(dataclasses.replace(s.linears[0], path=f"{s.name.rpartition('.')[2]}.{s.linears[0].path}")
                            for s in siblings)
            out.append(ExpertGroup(parent, model.get_submodule(parent), "stacked", linears))
    return out


def identity_expert_groups(model: nn.Module) -> tuple[list[ExpertGroup], list[tuple[str, nn.Module]]]:
    """``(groups, unmatched)``: experts modules with ``Z = zero_expert_num > 0`` identity experts beside their MLP
    experts (LongCat-Flash's ``LongcatFlashExperts``: ids ``E .. E+Z-1`` return the token times its weight,
    NOTE [identity experts] (moe_compile/experts/interface.py)). A group: the module's own rank-3 parameters, the
    ``E`` MLP experts' ``[E, N, K]`` (``E`` the smallest leading size, the module's ``num_routed_experts`` where it
    has one), each holding ``E`` or ``E + Z`` experts (LongCat's ``gate_up_proj`` is ``[E + Z, 2I, H]``, whose last
    ``Z`` no id reads: :func:`_stacked_projections` reads its first ``E``), as a ``"stacked"`` group of ``E``;
    ``unmatched``: the ``(name, module)`` of any other such module (``zero_compute_experts``)."""
    groups, unmatched = [], []
    for name, module in model.named_modules():
        Z = getattr(module, "zero_expert_num", None)
        if isinstance(Z, bool) or not isinstance(Z, int) or Z < 1:
            continue
        params = dict(module.named_parameters(recurse=False))
        if not params:  # a block that declares the count and runs the identity experts itself (transformers 5.25)
            continue
        E = min((p.shape[0] for p in params.values()), default=0)
        declared = getattr(module, "num_routed_experts", E)
        if (E < 1 or declared != E or len(params) < 2 or any(p.dim() != 3 for p in params.values())
                or any(p.shape[0] not in (E, E + Z) for p in params.values())):
            unmatched.append((name, module))
            continue
        linears = tuple(ExpertLinear(n, E, p.shape[1], p.shape[2]) for n, p in params.items())
        groups.append(ExpertGroup(name, module, "stacked", linears))
    return groups, unmatched


class _GroupedViews:
    """One grouped ``[E, ...]`` leaf per projection of a ModuleList's linears.

    See NOTE [grouped views] (moe_compile/experts/swap.py).

    Gated MLPs keep gate and up in one ``[E, 2I, H]`` leaf (``gate_up``), so that the fused forward runs one
    grouped GEMM for both, as transformers' grouped experts do (unless only one of the two has a bias).
    """

    def __init__(self, experts: nn.ModuleList, paths: tuple[str, ...], gated: bool):
        # a gated MLP of one gate-then-up linear (Megatron's linear_fc1 [2I, H]) groups like a plain one
        gated = gated and len(paths) == 3
        self.experts, self.paths, self.gated = experts, paths, gated
        gate_up = paths[:2] if gated else ()
        self.fused = bool(gate_up) and len({experts[0].get_submodule(p).bias is None for p in gate_up}) == 1
        self.grouped: dict[str, Tensor] = {}
        self.grad_views: list[GradViews] = []
        self._recycle: bool | None = None  # None until a compile asks; False for good once one says no
        self.regroup()

    def __deepcopy__(self, memo: dict) -> "_GroupedViews":
        # a deep copy of the block copies every parameter on its own: regroup the copies (not recycled: the copy
        # has no compiled model yet to release their memory)
        return _GroupedViews(copy.deepcopy(self.experts, memo), self.paths, self.gated)

    def recycle_gradients(self, on: bool) -> None:
        """Turn NOTE [recycled gradient views] (moe_compile/experts/_grad_views.py) on, or off for good: a block
        compiled once with CUDA graphs may still run through that compiled model, whatever another compile of it asks
        for."""
        self._recycle = on and self._recycle is not False
        for views in self.grad_views:
            views.recycle = self._recycle

    def release_gradients(self) -> None:
        """Free recycled gradient memory that every ``p.grad`` let go of (before a forward)."""
        for views in self.grad_views:
            views.release()

    def _leaves(self) -> dict[str, tuple[str, ...]]:
        """``{leaf name: projection paths it holds}``: ``gate_up`` for a fused gated MLP, else one per path."""
        if self.fused:
            return {"gate_up": self.paths[:2], self.paths[2]: self.paths[2:]}
        return {path: (path,) for path in self.paths}

    def _groups(self) -> dict[str, tuple[list[nn.Parameter], bool]]:
        """``{key: (parameters, halves)}``: the parameters each grouped leaf holds, in view order."""
        groups = {}
        for leaf, paths in self._leaves().items():
            for attr in ("weight", "bias"):
                params = [getattr(e.get_submodule(path), attr) for path in paths for e in self.experts]
                if params[0] is not None:
                    groups[f"{leaf}.{attr}"] = (params, len(paths) == 2)
        return groups

    def regroup(self) -> None:
        """Copy the per-expert weights into fresh grouped leaves and make every parameter a view of them."""
        self.grouped, self.grad_views = {}, []
        for key, (params, halves) in self._groups().items():
            stacked = torch.stack([p.detach() for p in params])
            if halves:  # [2E, N, ...] (gate experts, then up experts) -> [E, 2N, ...]
                E = len(params) // 2
                stacked = torch.cat([stacked[:E], stacked[E:]], dim=1)
            grouped = stacked.requires_grad_(params[0].requires_grad)
            for p, view in zip(params, per_expert_views(grouped.detach(), halves)):
                p.data = view
            if grouped.requires_grad:
                self.grad_views.append(GradViews(grouped, params, halves, bool(self._recycle)))
            self.grouped[key] = grouped

    def projections(self) -> tuple[tuple[Projection, ...], Projection]:
        """``(ups, down)`` for :func:`_fused_block_forward`: ``(gate_up,)`` for a fused gated MLP, ``(gate, up)``
        for a gated one with a bias on one of the two, ``(up,)`` for a plain one."""
        def projection(name: str) -> Projection:
            return Projection(self.grouped[f"{name}.weight"], self.grouped.get(f"{name}.bias"))

        *ups, down = self._leaves()
        return tuple(projection(name) for name in ups), projection(down)

    def aliased(self) -> bool:
        """Whether every per-expert parameter is still a view of its grouped tensor."""
        for key, (params, halves) in self._groups().items():
            grouped = self.grouped.get(key)
            if grouped is None:
                return False
            for p, view in zip(params, per_expert_views(grouped.detach(), halves)):
                if p.data_ptr() != view.data_ptr() or p.shape != view.shape:
                    return False
        return True


def _apply_then_regroup(self: nn.Module, fn: Callable, *args: Any, **kwargs: Any) -> nn.Module:
    """``module.to()`` / ``.half()`` rebind every ``p.data``: regroup afterwards
    (NOTE [grouped views] (moe_compile/experts/swap.py))."""
    out = nn.Module._apply(self, fn, *args, **kwargs)
    if not self._moe_compile_views.aliased():
        self._moe_compile_views.regroup()
    return out


def per_expert_projections(experts: list[nn.Module],
                           paths: tuple[str, ...]) -> tuple[tuple[Projection, ...], Projection]:
    """The projections at ``paths`` of per-expert modules stacked per call (``[E, N, K]``; the last path is down), for
    the probe only: the swapped forward reads the grouped views."""
    out = []
    for path in paths:
        mods = [e.get_submodule(path) for e in experts]
        bias = torch.stack([m.bias for m in mods]) if mods[0].bias is not None else None
        out.append(Projection(torch.stack([m.weight for m in mods]), bias))
    return tuple(out[:-1]), out[-1]
