"""Module-level swap of MoE blocks whose forward loops over experts (``nonzero`` / ``torch.where`` trip counts).

Dynamo cannot capture such a loop (its trip count is data dependent), so no FX pass sees it. ``swap_expert_loops``
replaces the block's ``forward`` (on the instance) by one that routes, then runs the experts through
:func:`moe_compile.experts.interface.fused_experts_forward` (one grouped GEMM per projection, no host sync).

What is recognised (``E`` experts, ``H`` hidden):

* experts: an ``nn.ModuleList`` of identical MLPs (``experts.py``'s ``module_list`` layout) or stacked ``[E, N, K]``
  parameters on an experts module (also a ``GroupedExpertList``: ModuleList experts after ``quantize_experts``, read
  through its grouped weights), with projections named ``w1/w3/w2`` or ``gate_proj/up_proj/down_proj`` (gated:
  ``down(act(gate(x)) * up(x))``), or ``fc1/fc2``, ``up_proj/down_proj``, ``w1/w2`` (``down(act(up(x)))``); the
  activation is the expert's (or experts module's) ``act_fn`` / ``act`` / ``activation``, or, for experts that call
  one directly (``F.silu(self.w1(x))``), the one of silu / gelu / gelu-tanh / relu that the probe finds;
* routing: the block's ``route(x_TH) -> (ids_TK, weights_TK)`` if it has one, else ``gate`` (``nn.Linear`` H -> E)
  + ``top_k`` / ``num_experts_per_tok``: ``softmax`` in fp32 -> ``topk`` (renormalised or not), else a ``gate``
  module that routes itself, returning ``(weights_TK, ids_TK)`` in either order (DeepSeek-V3's reference ``Gate``);
* weights applied before or after the MLP; shared experts (``shared_experts`` / ``shared_expert`` / ``shared_mlp``,
  Qwen2-MoE's ``shared_expert_gate`` sigmoid gate) added or not.

Whatever the loop does around the experts is not read: it is replaced whole. This is how a loop with data-dependent
control flow is captured (``counts = bincount(ids).tolist()``, ``if counts[i] == 0: continue``, the reference
inference code of open releases, ``tests/models/skip_loops.py``): skipping an expert without tokens changes nothing,
and the fused path reads no count on the host.

NOTE [probe before swap]: nothing above is proven from the code. Each candidate (weights before / after the MLP,
renormalised or not) runs once on a random probe of 256 tokens (``[4, 64, H]``, or ``[256, H]`` for a block that
takes tokens only) in ``eval`` mode next to the block's own forward; the closest candidate is taken if every token's
output is within ``PROBE_ULPS`` ulps of its own largest value (errors computed in fp32). It must then match in
training mode too (a training-only output or noise), and its backward must match the block's own: gradients of
the probe and of every parameter that requires one, with a random cotangent (a custom autograd function in the
router or on the expert outputs shows only there). Otherwise the block is left alone, and ``explain`` says why
(``probe_mismatch``, ``probe_grad_mismatch``, ``probe_failed``, ``no_router``, ...). A probe cannot prove that a
block computes what the fused path computes; it finds the differences the fuzzer found (``tests/fuzz``): a custom
backward, an output only in training, a selection bias that changes some tokens' experts. A block routed by ``gate``
that holds any other tensor (a selection bias, a counter) is not probed at all (``block_state_unused``): a probe can
miss the few tokens such a tensor moves.

NOTE [grouped views]: ``nn.ModuleList`` experts keep their per-expert ``nn.Parameter`` objects (same identity, so
optimizers and their state stay valid; same ``state_dict`` keys and values). Each projection's weights are copied
once into one grouped ``[E, N, K]`` leaf tensor ``G`` (gate and up of a gated MLP into one ``[E, 2I, H]`` leaf, so
that one grouped GEMM serves both) and every per-expert parameter's ``.data`` becomes the view ``G[e]`` (``G[e, :I]``,
``G[e, I:]``): in-place updates (optimizer steps, ``load_state_dict``) write into ``G``. The fused forward uses ``G``;
hooks on ``G`` keep every ``p.grad`` a view of one gradient buffer (``_grad_views.GradViews``: accumulation
over micro-batches adds into that buffer in place; ``zero_grad`` works either way; under ``moe_compile.compile``
the view objects are recycled from step to step, NOTE [recycled gradient views] (moe_compile/experts/_grad_views.py)).
Trade-offs: ``torch.nn.utils.parametrize`` would rename the ``state_dict`` keys; a grouped ``nn.Parameter``
(``quantize_experts``) replaces the per-expert parameters, which breaks optimizers built before the swap;
``torch.stack`` per step copies every weight on every step. With views, anything that rebinds ``p.data`` out of
place breaks the aliasing: ``module.to()`` / ``.half()`` are handled (the block regroups after ``_apply``),
``copy.deepcopy`` regroups the copy; a direct ``p.data = ...`` is not handled.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe_compile.experts._grad_views import GradViews, per_expert_views
from moe_compile.experts._probe import PROBE_ULPS, NotSwappable, outputs, probe_input, row_mismatch, verify
from moe_compile.experts.discovery import ExpertGroup, ExpertLinear, find_expert_weights
from moe_compile.experts.interface import SUPPORTED_DTYPES, Projection, fused_experts_forward, glu_of, is_hf_experts
from moe_compile.experts.quantize import GroupedExpertList

_GATED = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))
_PLAIN = (("fc1", "fc2"), ("up_proj", "down_proj"), ("w1", "w2"))
_ACT_NAMES = ("act_fn", "act", "activation", "activation_fn")


@dataclasses.dataclass
class _Plan:
    paths: tuple[str, ...]  # projection names, the last one is down
    gated: bool
    act: Callable[[Tensor], Tensor] | None  # None until a candidate is chosen (no act module to read it from)
    num_experts: int
    top_k: int | None
    router: str = "gate_linear"  # route: block.route(x) | gate_linear: softmax top-k of gate(x) | gate_call
    weights_before: bool = False
    renormalize: bool = False
    returns_logits: bool = False
    glu: str | None = None  # the gated middle is this fused GLU (experts.interface.glu_of)
    shared: str | None = None  # a shared-experts module whose output is added (and its sigmoid gate module)
    shared_gate: str | None = None
    act_name: str = ""  # the candidate activation the probe chose ("" when the experts name theirs)


# activations the probe tries for experts that call one directly (``F.silu(self.w1(x))``: no module to read it from)
_ACT_CANDIDATES: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu, "gelu": F.gelu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh"), "relu": F.relu}
# shared experts added to the routed experts' output (DeepSeek, Qwen2-MoE), with Qwen2-MoE's sigmoid gate
_SHARED_NAMES = ("shared_experts", "shared_expert", "shared_mlp")
_SHARED_GATE_NAMES = ("shared_expert_gate",)


# ===== expert layout =====


def _act_of(*owners: Any) -> Callable[[Tensor], Tensor] | None:
    """The experts' activation module (``act_fn``, ...), or None: the probe then tries :data:`_ACT_CANDIDATES`."""
    for owner in owners:
        for name in _ACT_NAMES:
            act = getattr(owner, name, None)
            if callable(act):
                return act
    return None


def _projection_names(available: set[str]) -> tuple[tuple[str, ...], bool]:
    for names in _GATED:
        if set(names) <= available:
            return names, True
    for names in _PLAIN:
        if set(names) <= available:
            return names, False
    raise NotSwappable("unknown_expert_mlp", f"projections {sorted(available)} are not w1/w3/w2, gate/up/down, fc1/fc2")


def _stacked_projections(group: ExpertGroup) -> dict[str, Projection]:
    """``{projection name: Projection}`` of stacked experts: rank-3 parameters on the experts module, or the grouped
    (quantised) weights of a ``GroupedExpertList`` (``quantize_experts`` of ModuleList experts), by their original
    projection names (``w1``, not the parameter's ``w1_weight``)."""
    module = group.module
    if isinstance(module, GroupedExpertList):
        return {p: Projection(module.grouped_weight(p), module.grouped_bias(p)) for p in module.paths}
    out = {}
    for lin in group.linears:
        w = getattr(module, lin.path)
        bias = getattr(module, lin.path + "_bias", None)
        out[lin.path] = Projection(w.transpose(1, 2) if lin.is_transposed else w, bias)
    return out


class _GroupedViews:
    """One grouped ``[E, ...]`` leaf per projection of a ModuleList's linears; see NOTE [grouped views].

    Gated MLPs keep gate and up in one ``[E, 2I, H]`` leaf (``gate_up``), so that the fused forward runs one
    grouped GEMM for both, as transformers' grouped experts do (unless only one of the two has a bias).
    """

    def __init__(self, experts: nn.ModuleList, paths: tuple[str, ...], gated: bool):
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


# ===== routing and the swapped forward =====


def _route(block: nn.Module, plan: _Plan, x_TH: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    if plan.router == "route":
        ids_TK, weights_TK = block.route(x_TH)
        return ids_TK, weights_TK, None
    if plan.router == "gate_call":
        ids_TK, weights_TK = _gate_call(block.gate(x_TH))
        return ids_TK, weights_TK, None
    logits_TE = block.gate(x_TH)
    probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
    weights_TK, ids_TK = torch.topk(probs_TE, plan.top_k, dim=-1)
    if plan.renormalize:
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    return ids_TK, weights_TK.to(x_TH.dtype), logits_TE


def _gate_call(out: Any) -> tuple[Tensor, Tensor]:
    """``(ids_TK, weights_TK)`` from a gate module's output: a pair of ``[T, K]`` tensors, one integer and one
    floating, in either order (DeepSeek-V3's reference ``Gate`` returns ``weights, indices``)."""
    if isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, Tensor) for t in out):
        ints = [t for t in out if not t.is_floating_point()]
        floats = [t for t in out if t.is_floating_point()]
        if len(ints) == 1 and len(floats) == 1 and ints[0].shape == floats[0].shape and ints[0].dim() == 2:
            return ints[0], floats[0]
    raise NotSwappable("no_router", "the gate module does not return (weights [T, K], expert ids [T, K])")


def _gated_middle(act: Callable[[Tensor], Tensor], n_ups: int) -> Callable[..., Tensor]:
    """``act(gate) * up``, from two projections' outputs or from one ``gate_up`` output (gate first)."""
    if n_ups == 2:
        return lambda gate_MI, up_MI: act(gate_MI) * up_MI

    def middle(gate_up_MN: Tensor) -> Tensor:
        gate_MI, up_MI = gate_up_MN.chunk(2, dim=-1)
        return act(gate_MI) * up_MI
    return middle


def _fused_block_forward(block: nn.Module, plan: _Plan, projections: Callable[[], tuple[tuple[Projection, ...],
                         Projection]], hidden: Tensor) -> Any:
    """The swapped forward: route, then ``fused_experts_forward`` over ``projections() = (ups, down)``."""
    x_TH = hidden.reshape(-1, hidden.shape[-1])
    ids_TK, weights_TK, logits_TE = _route(block, plan, x_TH)
    ups, down = projections()
    middle = _gated_middle(plan.act, len(ups)) if plan.gated else plan.act
    y_TH = fused_experts_forward(x_TH, ids_TK, weights_TK, ups, middle, down, num_experts=plan.num_experts,
                                 weights_before=plan.weights_before, glu=plan.glu)
    if plan.shared is not None:
        shared_TH = getattr(block, plan.shared)(x_TH)
        if plan.shared_gate is not None:
            shared_TH = torch.sigmoid(getattr(block, plan.shared_gate)(x_TH)) * shared_TH
        y_TH = y_TH + shared_TH
    y = y_TH.reshape(hidden.shape)
    return (y, logits_TE) if plan.returns_logits else y


def _plan_block(block: nn.Module, group: ExpertGroup) -> _Plan:
    E = group.linears[0].num_experts
    available = {lin.path for lin in group.linears} if group.kind == "module_list" else set(_stacked_projections(group))
    names, gated = _projection_names(available)
    # the activation lives on each expert of a list (also a GroupedExpertList, which is stacked), else on the module
    owner = group.module[0] if isinstance(group.module, nn.ModuleList) and len(group.module) else group.module
    act = _act_of(owner, block)
    top_k = getattr(block, "top_k", None) or getattr(block, "num_experts_per_tok", None)
    gate = getattr(block, "gate", None)
    if callable(getattr(block, "route", None)):
        router = "route"
    elif isinstance(gate, nn.Linear) and gate.out_features == E and isinstance(top_k, int):
        router = "gate_linear"
    elif isinstance(gate, nn.Module) and not isinstance(gate, nn.Linear):
        router = "gate_call"  # a gate module that routes itself: (weights, ids) = gate(x)
    else:
        raise NotSwappable("no_router", "no route(x) method, no gate Linear(H, E) with top_k and no gate module "
                                        "returning (weights, ids)")
    if router != "route":
        _check_no_other_state(block, group)
    return _Plan(names, gated, act, E, top_k if router == "gate_linear" else None, router=router)


def _shared_modules(block: nn.Module) -> tuple[str | None, str | None]:
    """The names of the block's shared-experts module and of its gate module (None where it has none)."""
    shared = next((n for n in _SHARED_NAMES if isinstance(getattr(block, n, None), nn.Module)), None)
    gate = next((n for n in _SHARED_GATE_NAMES if isinstance(getattr(block, n, None), nn.Module)), None)
    return shared, gate if shared is not None else None


def _check_no_other_state(block: nn.Module, group: ExpertGroup) -> None:
    """A block routed by ``gate`` must hold no tensor besides the gate's, the experts' and the shared experts': the
    fused path reads no other, so any other (a selection bias, a load counter the forward updates) is routing or a
    side effect it would drop, whether or not a probe happens to show it (fuzzer finding: a selection bias of 0.1
    that changed no probe token's expert and one token of eight in the model). A gate module that routes itself
    reads its own tensors (DeepSeek-V3's selection bias lives on its ``Gate``)."""
    experts = next((name for name, m in block.named_modules() if m is group.module), None)
    owners = ("gate.", *(n + "." for n in _shared_modules(block) if n)) + ((experts + ".",) if experts else ())
    other = [n for n, _ in (*block.named_parameters(), *block.named_buffers()) if not n.startswith(owners)]
    if other:
        raise NotSwappable("block_state_unused", f"the block holds {', '.join(other[:4])}"
                                                 f"{' ...' if len(other) > 4 else ''}, which the fused path (gate, "
                                                 "top-k, experts, shared experts) does not read")


def _probe_error(block: nn.Module, plan: _Plan, projections: Callable[[], list[Projection]], x: Tensor) -> float:
    """The fused candidate against the block's own forward on the probe ``x`` (:func:`row_mismatch`: ``<= 1`` is a
    match). Sets ``plan.returns_logits`` from the block's output: a ``(y, router_logits)`` pair is matched whole."""
    want = block.forward(x)
    plan.returns_logits = isinstance(want, tuple)
    if plan.returns_logits and (plan.top_k is None or len(want) != 2):
        return math.inf
    got = _fused_block_forward(block, plan, projections, x)
    return max(row_mismatch(g, w) for g, w in zip(outputs(got), outputs(want)))


def _candidates(block: nn.Module, plan: _Plan) -> list[dict[str, Any]]:
    """Every reading of the block the probe tries: weights before or after the MLP, renormalised or not (a
    ``gate_linear`` router), the activation (when no module names it), the shared experts added or not."""
    acts = {plan.act_name: plan.act} if plan.act is not None else _ACT_CANDIDATES
    shared, shared_gate = _shared_modules(block)
    shareds = [(None, None)] + ([(shared, None)] if shared else []) + ([(shared, shared_gate)] if shared_gate else [])
    renorms = (True, False) if plan.router == "gate_linear" else (False,)
    return [dict(weights_before=before, renormalize=renorm, act_name=name, act=act, shared=sh, shared_gate=sg)
            for before in (False, True) for renorm in renorms for name, act in acts.items() for sh, sg in shareds]


def _choose(block: nn.Module, plan: _Plan, projections: Callable[[], list[Projection]], x: Tensor) -> None:
    """Set ``plan`` to the candidate closest to the block's own forward on the probe ``x``, if it is within
    tolerance (in bf16 a wrong candidate can come close); raises :class:`NotSwappable` otherwise."""
    errors = []
    for i, candidate in enumerate(_candidates(block, plan)):
        for field, value in candidate.items():
            setattr(plan, field, value)
        plan.glu = glu_of(_gated_middle(plan.act, 1)) if plan.gated else None
        try:
            errors.append((_probe_error(block, plan, projections, x), i, candidate))
        except NotSwappable:
            raise
        except Exception:  # noqa: BLE001 - a candidate the block's shapes or dtypes do not admit
            errors.append((math.inf, i, candidate))
    err, _, best = min(errors, key=lambda e: e[:2])
    if not err <= 1:
        raise NotSwappable("probe_mismatch", f"no fused candidate matched the block's own forward on a probe "
                                             f"(closest: worst row {err:.3g}x of {PROBE_ULPS} ulps)")
    for field, value in best.items():
        setattr(plan, field, value)
    plan.glu = glu_of(_gated_middle(plan.act, 1)) if plan.gated else None
    _probe_error(block, plan, projections, x)  # sets returns_logits


def swap_block(block: nn.Module, group: ExpertGroup) -> str:
    """Swap ``block``'s forward to the fused path (see the module docstring); returns a description.

    Raises:
        NotSwappable: the block is left unchanged; ``tag`` says why.
    """
    plan = _plan_block(block, group)
    weight = next(block.parameters())
    if weight.dtype not in SUPPORTED_DTYPES:
        raise NotSwappable("dtype", f"{weight.dtype} (supported: bf16, fp16, fp32)")
    if group.kind == "module_list":
        def stacked() -> tuple[tuple[Projection, ...], Projection]:  # the probe only: the forward uses the views
            out = []
            for path in plan.paths:
                mods = [e.get_submodule(path) for e in group.module]
                bias = torch.stack([m.bias for m in mods]) if mods[0].bias is not None else None
                out.append(Projection(torch.stack([m.weight for m in mods]), bias))
            return tuple(out[:-1]), out[-1]
        probe_projections = stacked
    else:
        def probe_projections() -> tuple[tuple[Projection, ...], Projection]:
            projs = _stacked_projections(group)
            return tuple(projs[p] for p in plan.paths[:-1]), projs[plan.paths[-1]]
    hidden = _hidden_size(group, plan)
    was_training = [m.training for m in block.modules()]
    block.eval()
    try:
        x = probe_input(block, hidden, weight.dtype, weight.device)
        with torch.no_grad():
            _choose(block, plan, probe_projections, x)
        returns_logits = plan.returns_logits

        def forward_error() -> float:
            err = _probe_error(block, plan, probe_projections, x)
            return err if plan.returns_logits == returns_logits else math.inf

        verify(block, forward_error, lambda t: _fused_block_forward(block, plan, probe_projections, t), x)
    finally:
        for m, t in zip(block.modules(), was_training):
            m.training = t
    block._moe_compile_original_forward = block.forward
    block._moe_compile_plan = plan
    if group.kind == "module_list":
        block._moe_compile_views = _GroupedViews(group.module, plan.paths, plan.gated)
        block._apply = types.MethodType(_apply_then_regroup, block)
        block.forward = types.MethodType(_swapped_module_list_forward, block)
    else:
        block._moe_compile_experts = group
        block.forward = types.MethodType(_swapped_stacked_forward, block)
    extras = "".join([f", activation {plan.act_name}" if plan.act_name else "",
                      f", routed by {plan.router}" if plan.router != "gate_linear" else "",
                      f", + {plan.shared}" if plan.shared else "",
                      f" (gated by {plan.shared_gate})" if plan.shared_gate else ""])
    return (f"{group.kind} experts ({plan.num_experts}, {'gated' if plan.gated else 'plain'} "
            f"{'/'.join(plan.paths)}), weights {'before' if plan.weights_before else 'after'} the MLP{extras}: "
            "permute_pad -> grouped GEMMs -> unpad_unpermute")


def _hidden_size(group: ExpertGroup, plan: _Plan) -> int:
    if group.kind != "module_list":
        return _stacked_projections(group)[plan.paths[0]].w_ENK.shape[-1]
    first = next(lin for lin in group.linears if lin.path == plan.paths[0])
    return first.in_features


def _swapped_module_list_forward(self: nn.Module, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Any:
    """The swapped forward of a ModuleList block; state lives on ``self`` so ``copy.deepcopy`` follows it."""
    return _fused_block_forward(self, self._moe_compile_plan, self._moe_compile_views.projections, hidden_states)


def _swapped_stacked_forward(self: nn.Module, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Any:
    plan, group = self._moe_compile_plan, self._moe_compile_experts
    stacked = _stacked_projections(group)
    return _fused_block_forward(self, plan, lambda: (tuple(stacked[p] for p in plan.paths[:-1]),
                                                     stacked[plan.paths[-1]]), hidden_states)


def _apply_then_regroup(self: nn.Module, fn: Callable, *args: Any, **kwargs: Any) -> nn.Module:
    """``module.to()`` / ``.half()`` rebind every ``p.data``: regroup afterwards (NOTE [grouped views])."""
    out = nn.Module._apply(self, fn, *args, **kwargs)
    if not self._moe_compile_views.aliased():
        self._moe_compile_views.regroup()
    return out


def _single_expert_lists(model: nn.Module) -> list[ExpertGroup]:
    """``experts`` ModuleLists of one expert (``experts.py`` wants ``E >= 2``: one expert is no group to it)."""
    groups = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == 1 and name.rpartition(".")[2] == "experts":
            linears = {n: m for n, m in module[0].named_modules() if isinstance(m, nn.Linear) and n}
            specs = tuple(ExpertLinear(n, 1, m.out_features, m.in_features, False, m.bias is not None)
                          for n, m in linears.items())
            if specs:
                groups.append(ExpertGroup(name, module, "module_list", specs))
    return groups


def swap_expert_loops(model: nn.Module) -> list[tuple[str, str, str, str]]:
    """Swap every recognised expert-loop block of ``model`` (in place); returns explain records.

    transformers ``*Experts`` modules (interface-decorated) are skipped here:
    the experts interface (``experts/interface.py``) covers them.
    Records are ``(block name, "rewrite" | "skip", tag, detail)``.
    """
    records = []
    modules = dict(model.named_modules())
    for group in [*find_expert_weights(model), *_single_expert_lists(model)]:
        if is_hf_experts(group.module) or getattr(group.module, "_moe_compile_swapped", False):
            continue
        block_name = group.name.rpartition(".")[0]
        block = modules.get(block_name)
        if block is None or getattr(block, "_moe_compile_original_forward", None) is not None:
            continue
        try:
            detail = swap_block(block, group)
        except NotSwappable as why:
            records.append((block_name or "<root>", "skip", why.tag, why.detail))
            continue
        records.append((block_name or "<root>", "rewrite", "expert_loop_swapped", detail))
    return records
