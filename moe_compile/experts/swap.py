"""Module-level swap of MoE blocks whose forward loops over experts (``nonzero`` / ``torch.where`` trip counts).

Dynamo cannot capture such a loop (its trip count is data dependent), so no FX pass sees it. ``swap_expert_loops``
replaces the block's ``forward`` (on the instance) by one that routes, then runs the experts through
:func:`moe_compile.experts.interface.fused_experts_forward` (one grouped GEMM per projection, no host sync).

What is recognised (``E`` experts, ``H`` hidden, ``I`` intermediate):

* experts: an ``nn.ModuleList`` of identical MLPs (``experts.py``'s ``module_list`` layout) or stacked ``[E, N, K]``
  parameters on an experts module (also a ``GroupedExpertList``: ModuleList experts after ``quantize_experts``, read
  through its grouped weights), with projections named ``w1/w3/w2``, ``w1/v1/w2`` (DBRX) or
  ``gate_proj/up_proj/down_proj`` (gated: ``down(act(gate(x)) * up(x))``), ``gate_up_proj/down_proj`` (one gate-then-up
  weight, ``[E, 2I, H]`` / ``[E, H, I]``, or ``[E, H, 2I]`` / ``[E, I, H]`` as Llama4TextExperts' ``bmm`` reads it: the
  shapes tell which; the middle is the experts' own ``_apply_gate`` where they have one, Step3p7's clamped SwiGLU), or
  ``fc1/fc2``, ``up_proj/down_proj``, ``w1/w2`` (``down(act(up(x)))``); or ``flat``: 2-D ``[E*I, H]`` parameters of
  one shape on an experts module declaring ``E`` (DBRX's ``experts.mlp.w1 / v1 / w2``), read as ``[E, I, H]`` views
  of the parameters on every call (the down one transposed: ``h @ w2[e]``), so the parameters, their ``state_dict``
  and gradients stay the model's own; the activation is the expert's (or experts module's, or the module holding a
  flat group's weights) ``act_fn`` / ``act`` / ``activation`` / ``activation_fn``, or, for experts that call one
  directly (``F.silu(self.w1(x))``), the one of silu / gelu / gelu-tanh / relu that the probe finds;
* projections of any other names, read by their shapes (``_swap_layout.mlp_readings``): ``(I, H)`` + ``(H, I)``
  (plain), ``(2I, H)`` + ``(H, I)`` (one gate-then-up weight), two ``(I, H)`` + ``(H, I)`` (gated, gate and up in
  either order), stacked weights as ``[E, N, K]`` or ``[E, K, N]`` (``x @ w[e]``), including rank-3 parameters on
  the block itself; every reading that fits is a probe candidate, and the probe keeps the one the block computes;
* routing: the block's ``route(x_TH) -> (ids_TK, weights_TK)`` if it has one, else ``gate`` (``nn.Linear`` H -> E)
  + ``top_k`` / ``num_experts_per_tok``, or the block's one ``nn.Linear(H, E)`` child of any name (``wg``,
  ``router``, ``classifier``) with that top-k or, where the block names none, each int attribute of the block or
  that Linear in ``[1, E)`` as a probe candidate, else the ``k`` of each ``topk`` over ``E`` that the block's forward
  runs on a probe, wherever it runs it (``_swap_routing.observed_top_ks``): ``softmax`` in fp32 -> ``topk``
  (renormalised or not), ``topk`` of the logits -> ``softmax``, or ``softmax`` in the logits' dtype -> ``topk``
  (``GATE_WEIGHTS``), else a ``gate`` or
  ``router`` module that routes itself, returning ``(weights_TK, ids_TK)`` in either order (DeepSeek-V3's reference
  ``Gate``), ``(logits_TE, weights_TK, ids_TK)`` (transformers' top-k routers: Step3p7) or dense ``(scores_TE,
  logits_TE)`` (Llama4Router, below), else ``block.route_tokens_to_experts(block.router(x))`` (DBRX's softmax,
  top-k and p-norm);
* dense experts: a block that runs every token through every expert, its input scaled by a score that is exactly 0
  outside the token's top-k, and sums them (Llama4TextMoe) is routed to each token's top-k alone, weights before the
  MLP; exact for bias-free experts (NOTE [dense experts]);
* weights applied before or after the MLP; shared experts (``shared_experts`` / ``shared_expert`` / ``shared_mlp``,
  Qwen2-MoE's ``shared_expert_gate`` sigmoid gate) added or not; the routed output times the block's
  ``routed_scaling_factor`` or not; the output ``[T, H]`` where the block flattens its tokens (Llama4TextMoe, which
  also returns its router logits).

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
router or on the expert outputs shows only there), each in ulps of the lowest precision on its autograd path
(NOTE [gradient precision] (moe_compile/experts/_probe.py)). Otherwise the block is left alone, and ``explain``
says why (``probe_mismatch``, ``probe_grad_mismatch``, ``probe_failed``, ``no_router``, ``dense_experts_biased``,
``dense_scores_not_topk``, ...). A probe cannot prove that a block computes what the fused path computes; it
finds the differences the fuzzer found (``tests/fuzz``): a custom backward, an output only in training, a selection
bias that changes some tokens' experts. A block routed by ``gate`` that holds any other tensor (a counter, two
biases) is not probed at all (``block_state_unused``): a probe can miss the few tokens such a tensor moves. One other
``[E]`` float tensor is read as a selection bias on the probabilities (ERNIE 4.5's ``moe_statics``), and the probe
runs with it set to random values of the probabilities' scale (then put back), so that a zero bias, as initialised,
cannot pass a reading that is not the block's. A routing module the block passes such a tensor to (torchtitan's
expert bias), or whose counts the block adds to it, is called as the block calls it
(NOTE [recorded router call] (moe_compile/experts/_swap_router_call.py)).

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

import contextlib
import dataclasses
import math
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from moe_compile.experts._probe import (
    NotSwappable,
    first_verified,
    outputs,
    probe_input,
    ranked_candidates,
    row_mismatch,
    verification_failures,
)
from moe_compile.experts._swap_capacity import module_dict_groups, swap_capacity_block
from moe_compile.experts._swap_layout import (
    _FUSED_GATED,
    ACT_CANDIDATES,
    GATE_WEIGHTS,
    MLPReading,
    _act_of,
    _apply_then_regroup,
    _flat_expert_groups,
    _GroupedViews,
    _stacked_projections,
    identity_expert_groups,
    mlp_readings,
    per_expert_projections,
    sibling_stacked_groups,
    top_k_of_logits,
)
from moe_compile.experts._swap_router_call import RouterCall, call_router, kept_buffers, record_router_call
from moe_compile.experts._swap_routing import (
    _router_linear,
    _routing_ancestor,
    _routing_form,
    _routing_of,
    _top_k_candidates,
)
from moe_compile.experts.discovery import ExpertGroup, ExpertLinear, find_expert_weights, unnamed_stacked_groups
from moe_compile.experts.expert_parallel import swap_ep_blocks
from moe_compile.experts.interface import SUPPORTED_DTYPES, Projection, fused_experts_forward, glu_of, is_hf_experts


@dataclasses.dataclass
class _Plan:
    paths: tuple[str, ...]  # projection names, the last one is down
    gated: bool
    act: Callable[[Tensor], Tensor] | None  # None until a candidate is chosen (no act module to read it from)
    num_experts: int
    top_k: int | None
    # route: block.route(x) | gate_linear: softmax top-k of gate(x) | gate_call: gate(x) routes | router_call:
    # router(x) routes | router_route: block.route_tokens_to_experts(router(x))
    router: str = "gate_linear"
    routing_form: str = ""  # what a routing module returns (_routing_form): pair | triple | dense
    # how the block calls a gate_call / router_call module:
    # NOTE [recorded router call] (moe_compile/experts/_swap_router_call.py)
    call: RouterCall = dataclasses.field(default_factory=RouterCall)
    weights_before: bool = False
    # a gate_linear router's weights: softmax -> topk ("softmax_topk"), then renormalised ("softmax_topk_renorm"),
    # or topk of the logits -> softmax over those K ("topk_softmax": equal to the renormalised form in exact
    # arithmetic, not in floating point: at K = 1 its router gradient is exactly zero, the other's is residue)
    gate_weights: str = "softmax_topk"
    returns_logits: bool = False
    glu: str | None = None  # the gated middle is this fused GLU (experts.interface.glu_of)
    shared: str | None = None  # a shared-experts module whose output is added (and its sigmoid gate module)
    shared_gate: str | None = None
    act_name: str = ""  # the candidate activation the probe chose ("" when the experts name theirs)
    gate_fn: Callable[[Tensor], Tensor] | None = None  # the experts' own GLU over one gate_up output (_apply_gate)
    scale: float = 1.0  # the routed experts' output times this (the block's routed_scaling_factor)
    flat_out: bool = False  # the block returns [T, H] for a [B, S, H] input (Llama4TextMoe)
    # Z identity experts, ids E .. E+Z-1 (LongCat-Flash): NOTE [identity experts] (moe_compile/experts/interface.py)
    identity_experts: int = 0
    # stacked weights all read [E, K, N] (x @ w[e]) or not; None: as the names and the module say (MLPReading)
    transposed: bool | None = None
    # a gate_linear router: the block's Linear(H, E) child (``gate``, or any name: found by its shape)
    gate_name: str = "gate"
    # the readings and top-k values the probe tries (beyond the plan's own)
    readings: tuple[MLPReading, ...] = ()
    top_ks: tuple[int, ...] = ()
    # a gate_linear router's selection bias: the block's one other ``[E]`` float tensor (a path from the block),
    # added to the probabilities for the choice only; the probe runs with it perturbed (swap_block)
    selection_bias: str | None = None

    @property
    def router_module(self) -> str:
        """The block's attribute that routes (``gate`` or ``router``; ``""`` for ``route``)."""
        return {"route": "", "router_call": "router", "router_route": "router",
                "gate_linear": self.gate_name}.get(self.router, "gate")


# shared experts added to the routed experts' output (DeepSeek, Qwen2-MoE), with Qwen2-MoE's sigmoid gate
_SHARED_NAMES = ("shared_experts", "shared_expert", "shared_mlp")
_SHARED_GATE_NAMES = ("shared_expert_gate",)


# ===== routing and the swapped forward =====


def _route(block: nn.Module, plan: _Plan, x_TH: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(ids_TK, weights_TK, logits_TE or None)`` by the block's router (``plan.router``) on its tokens ``x_TH``
    (or its input ``hidden`` as given, where the block passes its routing module that)."""
    if plan.router == "route":
        ids_TK, weights_TK = block.route(x_TH)
        return ids_TK, weights_TK, None
    if plan.router in ("gate_call", "router_call"):
        return _routing_of(call_router(block, plan.router_module, plan.call, x_TH, hidden), plan)
    if plan.router == "router_route":
        logits_TE = block.router(x_TH)
        ids_TK, weights_TK, _ = _routing_of(block.route_tokens_to_experts(logits_TE), plan)
        return ids_TK, weights_TK, logits_TE
    gate = getattr(block, plan.gate_name)
    logits_TE = gate(x_TH.to(gate.weight.dtype))  # a router kept in float32 routes in float32
    bias_E = _tensor_at(block, plan.selection_bias) if plan.selection_bias else None
    ids_TK, weights_TK = top_k_of_logits(logits_TE, plan.top_k, plan.gate_weights, bias_E)
    return ids_TK, weights_TK.to(x_TH.dtype), logits_TE






def _middle(plan: _Plan, n_ups: int) -> Callable[..., Tensor]:
    """The row-wise map between the projections: the experts' own ``_apply_gate`` over one ``gate_up`` output where
    they have one (Step3p7's clamped SwiGLU), else :func:`_gated_middle`, or the activation of a plain MLP."""
    if not plan.gated:
        return plan.act
    if n_ups == 1 and plan.gate_fn is not None:
        return plan.gate_fn
    return _gated_middle(plan.act, n_ups)


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
    ids_TK, weights_TK, logits_TE = _route(block, plan, x_TH, hidden)
    ups, down = projections()
    y_TH = fused_experts_forward(x_TH, ids_TK, weights_TK, ups, _middle(plan, len(ups)), down,
                                 num_experts=plan.num_experts, weights_before=plan.weights_before, glu=plan.glu,
                                 identity_experts=plan.identity_experts)
    if plan.scale != 1.0:
        y_TH = y_TH * plan.scale
    if plan.shared is not None:
        shared_TH = getattr(block, plan.shared)(x_TH)
        if plan.shared_gate is not None:
            shared_TH = torch.sigmoid(getattr(block, plan.shared_gate)(x_TH)) * shared_TH
        y_TH = y_TH + shared_TH
    y = y_TH if plan.flat_out else y_TH.reshape(hidden.shape)
    return (y, logits_TE) if plan.returns_logits else y






def _plan_block(block: nn.Module, group: ExpertGroup, identity_experts: int) -> _Plan:
    E = group.linears[0].num_experts
    readings = mlp_readings(group)
    linear = _router_linear(block, group, E + identity_experts)
    hidden_of = {r: r.hidden or _hidden_size(group, _Plan(r.paths, r.gated, None, E, None, transposed=r.transposed))
                 for r in readings}
    if linear is not None:  # the router's input width is H: readings that imply another H come last
        readings.sort(key=lambda r: hidden_of[r] != getattr(block, linear).in_features)
    names, gated = readings[0].paths, readings[0].gated
    # the activation lives on each expert of a list (also a GroupedExpertList, which is stacked), else on the module,
    # or on a flat group's submodule holding the weights (DBRX's experts.mlp)
    owner = group.module[0] if isinstance(group.module, nn.ModuleList) and len(group.module) else group.module
    holders = [group.module.get_submodule(lin.path.rpartition(".")[0]) for lin in group.linears] \
        if group.kind == "flat" else []
    act = _act_of(owner, *holders, block)
    gate_fn = getattr(group.module, "_apply_gate", None) if names in _FUSED_GATED else None
    top_k = getattr(block, "top_k", None) or getattr(block, "num_experts_per_tok", None)
    gate, router_module = getattr(block, "gate", None), getattr(block, "router", None)
    gate_name, top_ks = "gate", ()
    if linear is not None and not isinstance(top_k, int):
        top_ks = _top_k_candidates(block, getattr(block, linear), E)
    if callable(getattr(block, "route", None)):
        router = "route"
    elif isinstance(gate, nn.Linear) and gate.out_features == E + identity_experts and isinstance(top_k, int):
        router = "gate_linear"
    elif linear is not None and (isinstance(top_k, int) or top_ks) and not (
            isinstance(gate, nn.Module) and not isinstance(gate, nn.Linear)):
        # a Linear router by its shape, whatever its name or whether the block names its top-k (the probe picks K)
        router, gate_name = "gate_linear", linear
        top_k = top_k if isinstance(top_k, int) else top_ks[0]
    elif isinstance(gate, nn.Module) and not isinstance(gate, nn.Linear):
        router = "gate_call"  # a gate module that routes itself: (weights, ids) = gate(x)
    elif isinstance(router_module, nn.Module) and callable(getattr(block, "route_tokens_to_experts", None)):
        router = "router_route"  # DBRX: route_tokens_to_experts(router(x)) -> (weights, ids)
    elif isinstance(router_module, nn.Module):
        router = "router_call"  # a router module that routes itself (Llama4Router: dense scores; Megatron: a map)
        top_k = top_k if isinstance(top_k, int) else getattr(router_module, "top_k", None)
        if not isinstance(top_k, int):
            top_ks = _top_k_candidates(block, router_module, E)
            top_k = top_ks[0] if top_ks else None
    else:
        raise NotSwappable("no_router", "no route(x) method, no gate Linear(H, E) with top_k, no gate or router "
                                        "module returning (weights, ids), (logits, weights, ids) or (scores, logits)")
    plan = _Plan(names, gated, act, E, top_k if router in ("gate_linear", "router_call") else None, router=router,
                 gate_fn=gate_fn if callable(gate_fn) else None, identity_experts=identity_experts,
                 transposed=readings[0].transposed, gate_name=gate_name, top_ks=top_ks)
    plan.readings = tuple(r for r in readings[1:] if hidden_of[r] == hidden_of[readings[0]])
    if router not in ("route", "gate_call", "router_call"):  # those two: once their call is read (swap_block)
        other = _other_state(block, group, plan.router_module)
        bias = _tensor_at(block, other[0]) if router == "gate_linear" and len(other) == 1 else None
        if bias is not None and bias.numel() == E + identity_experts and bias.is_floating_point():
            plan.selection_bias = other[0]  # read for the choice; the perturbed probe says whether it is that
        else:
            _check_no_other_state(block, group, plan.router_module)
    return plan


def _shared_modules(block: nn.Module) -> tuple[str | None, str | None]:
    """The names of the block's shared-experts module and of its gate module (None where it has none)."""
    shared = next((n for n in _SHARED_NAMES if isinstance(getattr(block, n, None), nn.Module)), None)
    gate = next((n for n in _SHARED_GATE_NAMES if isinstance(getattr(block, n, None), nn.Module)), None)
    return shared, gate if shared is not None else None


def _other_state(block: nn.Module, group: ExpertGroup, router: str, read: tuple[str, ...] = ()) -> list[str]:
    """The block's tensors outside its router, shared experts and experts, and not in ``read``
    (:func:`_check_no_other_state`)."""
    experts = next((name for name, m in block.named_modules() if m is group.module), None)
    owners = (router + ".", *(n + "." for n in _shared_modules(block) if n)) + ((experts + ".",) if experts else ())
    # stacked weights on the block itself (its own rank-3 parameters) are the experts'
    own = {lin.path for lin in group.linears} if group.module is block else set()
    return [n for n, _ in (*block.named_parameters(), *block.named_buffers())
            if not n.startswith(owners) and n not in own and n not in read]


def _tensor_at(block: nn.Module, path: str) -> Tensor:
    """The block's parameter or buffer at ``path`` (``moe_statics.e_score_correction_bias``)."""
    owner, _, name = path.rpartition(".")
    return getattr(block.get_submodule(owner) if owner else block, name)


def _check_no_other_state(block: nn.Module, group: ExpertGroup, router: str, read: tuple[str, ...] = ()) -> None:
    """A block routed by ``gate`` must hold no tensor besides the gate's, the experts' and the shared experts': the
    fused path reads no other, so any other (a selection bias, a load counter the forward updates) is routing or a
    side effect it would drop, whether or not a probe happens to show it (fuzzer finding: a selection bias of 0.1
    that changed no probe token's expert and one token of eight in the model). A gate module that routes itself
    reads its own tensors (DeepSeek-V3's selection bias lives on its ``Gate``, Step3p7's on its router); ``router``
    is the routing module's name (``gate`` or ``router``); ``read``: the block's tensors the fused path reads or
    writes as the block does (passed to its routing module, counters:
    NOTE [recorded router call] (moe_compile/experts/_swap_router_call.py))."""
    other = _other_state(block, group, router, read)
    if other:
        raise NotSwappable("block_state_unused", f"the block holds {', '.join(other[:4])}"
                                                 f"{' ...' if len(other) > 4 else ''}, which the fused path (gate, "
                                                 "top-k, experts, shared experts) does not read")


def _probe_error(block: nn.Module, plan: _Plan, projections: Callable[[], list[Projection]], x: Tensor) -> float:
    """The fused candidate against the block's own forward on the probe ``x`` (:func:`row_mismatch`: ``<= 1`` is a
    match). Sets ``plan.returns_logits`` from the block's output: a ``(y, router_logits)`` pair is matched whole."""
    want = block.forward(x)
    plan.returns_logits = isinstance(want, tuple)
    if plan.returns_logits and len(want) != 2:  # (a router without logits gives None: no match)
        return math.inf
    # Llama4TextMoe returns its [T, H] tokens for a [B, S, H] input
    plan.flat_out = x.dim() > 2 and isinstance(outputs(want)[0], Tensor) and outputs(want)[0].dim() == 2
    got = _fused_block_forward(block, plan, projections, x)
    return max(row_mismatch(g, w) for g, w in zip(outputs(got), outputs(want)))


def _candidates(block: nn.Module, plan: _Plan) -> list[dict[str, Any]]:
    """Every reading of the block the probe tries: weights before or after the MLP, renormalised or not (a
    ``gate_linear`` router), the activation (when no module names it), the shared experts added or not, the routed
    output scaled by the block's ``routed_scaling_factor`` or not (Step3p7: after the experts, before the shared
    experts are added)."""
    acts = {plan.act_name: plan.act} if plan.act is not None else ACT_CANDIDATES
    shared, shared_gate = _shared_modules(block)
    shareds = [(None, None)] + ([(shared, None)] if shared else []) + ([(shared, shared_gate)] if shared_gate else [])
    gate_weights = GATE_WEIGHTS if plan.router == "gate_linear" else ("softmax_topk",)
    if plan.selection_bias:  # the bias moves the choice among probabilities: softmax first
        gate_weights = ("softmax_topk_renorm", "softmax_topk")
    factor = getattr(block, "routed_scaling_factor", None)
    scales = (1.0,) + ((float(factor),) if isinstance(factor, (int, float)) and not isinstance(factor, bool)
                       and math.isfinite(factor) and factor != 1 else ())
    # every candidate names its reading and top-k whole: trying one must not leave its fields to the next
    own = dict(paths=plan.paths, gated=plan.gated, transposed=plan.transposed)
    readings = [own] + [dict(paths=r.paths, gated=r.gated, transposed=r.transposed) for r in plan.readings]
    top_ks = [dict(top_k=plan.top_k)] + [dict(top_k=k) for k in plan.top_ks if k != plan.top_k]
    return [dict(weights_before=before, gate_weights=weights, act_name=name, act=act, shared=sh, shared_gate=sg,
                 scale=scale, **reading, **k)
            for reading in readings for k in top_ks
            for before in (False, True) for weights in gate_weights for name, act in acts.items() for sh, sg in shareds
            for scale in scales]


def _ranked_candidates(block: nn.Module, plan: _Plan, projections: Callable[[], list[Projection]],
                       x: Tensor) -> list[dict[str, Any]]:
    """:func:`ranked_candidates` of the plan's :func:`_candidates` on the probe ``x``."""
    def error_of(candidate: dict[str, Any]) -> float:
        _set_candidate(plan, candidate)
        return _probe_error(block, plan, projections, x)

    return ranked_candidates(_candidates(block, plan), error_of)


def _set_candidate(plan: _Plan, candidate: dict[str, Any]) -> None:
    for field, value in candidate.items():
        setattr(plan, field, value)
    plan.glu = glu_of(_middle(plan, 1)) if plan.gated else None



def _set_routing_form(block: nn.Module, plan: _Plan, x: Tensor) -> None:
    """``plan.routing_form`` from what the block's routing module returns on the probe ``x`` (a copy: DBRX's router
    scales its input in place when it jitters)."""
    x_TH = x.reshape(-1, x.shape[-1])
    if plan.router in ("gate_call", "router_call"):
        out = call_router(block, plan.router_module, plan.call, x_TH.clone(), x.clone())
    elif plan.router == "router_route":
        out = block.route_tokens_to_experts(block.router(x_TH.clone()))
    else:
        return
    plan.routing_form = _routing_form(out, plan.num_experts + plan.identity_experts, plan.top_k)


def _check_dense(block: nn.Module, plan: _Plan, projections: Callable[[], tuple[tuple[Projection, ...], Projection]],
                 x: Tensor) -> None:
    """What NOTE [dense experts] needs beyond the probe: no expert bias, and every score outside the top-k exactly 0.

    NOTE [dense experts]: Llama4TextMoe runs every token through every expert, its input scaled by the expert's
    score (``bmm`` over ``[E, T, H]``), and sums the ``E`` outputs. Its router's score is ``sigmoid(-inf) = 0``
    exactly outside the token's top-k (the top-k logits are scattered into a ``-inf`` tensor). An expert's input is
    then ``x * 0 = 0``; with no bias, ``gate_up = 0 @ W = 0``, ``act(0) * 0 = 0`` (``act(0)`` finite) and
    ``0 @ W_down = 0``: the expert adds exactly zero, so routing each token to its top-k alone (weights before the
    MLP) computes the same sum. Backward too: the zero input gives zero weight gradients (``0^T @ dY``, and the
    GLU output ``h = 0`` for ``down``), the input gradient is scaled by the zero score, and the score's own
    gradient reaches the router only through the scatter of the top-k values (a ``-inf`` fill has none). A bias
    (a zero input's output is the bias) or a score that is not exactly zero (a softmax over all experts) breaks
    it; the probe cannot prove either absent on every input, so both are checked here: the biases on the module,
    the zeros on the probe's tokens (a router whose zeros depend on the input is refused by the probe's
    comparison with the block's own forward)."""
    ups, down = projections()
    if any(p.bias_EN is not None for p in (*ups, down)):
        raise NotSwappable("dense_experts_biased", "the block runs every expert on every token, scaled by its score: "
                                                   "a biased expert adds its bias where its score is 0, so dropping "
                                                   "it is not exact")
    out = call_router(block, plan.router_module, plan.call, x.reshape(-1, x.shape[-1]).clone(), x.clone())
    ids_TK, _, _ = _routing_of(out, plan)
    rest = out[0].reshape(ids_TK.shape[0], -1).scatter(1, ids_TK, 0)
    if bool((rest != 0).any()):
        raise NotSwappable("dense_scores_not_topk", f"the router's scores are not exactly 0 outside the top-"
                                                    f"{plan.top_k} of its logits on a probe "
                                                    f"({int((rest != 0).sum())} of {rest.numel()} are not)")


def swap_block(block: nn.Module, group: ExpertGroup, identity_experts: int = 0) -> str:
    """Swap ``block``'s forward to the fused path (see the module docstring); returns a description.
    ``identity_experts``: the ``Z`` identity experts past the group's ``E`` (:func:`identity_expert_groups`).

    Raises:
        NotSwappable: the block is left unchanged; ``tag`` says why.
    """
    plan = _plan_block(block, group, identity_experts)
    weight = next(group.module.parameters())  # the tokens meet the experts in their dtype (a router may be fp32)
    if weight.dtype not in SUPPORTED_DTYPES:
        raise NotSwappable("dtype", f"{weight.dtype} (supported: bf16, fp16, fp32)")
    if group.kind == "module_list":
        def probe_projections() -> tuple[tuple[Projection, ...], Projection]:
            return per_expert_projections(list(group.module), plan.paths)
    else:
        def probe_projections() -> tuple[tuple[Projection, ...], Projection]:
            projs = _stacked_projections(group, plan.paths[-1], plan.transposed)
            return tuple(projs[p] for p in plan.paths[:-1]), projs[plan.paths[-1]]
    hidden = _hidden_size(group, plan)
    was_training = [m.training for m in block.modules()]
    with kept_buffers(block), _perturbed(block, plan.selection_bias):  # counters put back; a bias made to matter
        block.eval()
        try:
            x = probe_input(block, hidden, weight.dtype, weight.device)
            if plan.router in ("gate_call", "router_call"):
                plan.call = record_router_call(block, plan.router_module, x)
                _check_no_other_state(block, group, plan.router_module, plan.call.state)
            with torch.no_grad():
                _set_routing_form(block, plan, x)
                if plan.routing_form == "dense":
                    _check_dense(block, plan, probe_projections, x)
                candidates = _ranked_candidates(block, plan, probe_projections, x)
            _verify_first(block, plan, probe_projections, x, candidates)
        finally:
            for m, t in zip(block.modules(), was_training):
                m.training = t
    # grouped first: nothing on the block changes unless the swap completes
    views = _GroupedViews(group.module, plan.paths, plan.gated) if group.kind == "module_list" else None
    block._moe_compile_original_forward = block.forward
    block._moe_compile_plan = plan
    if group.kind == "module_list":
        block._moe_compile_views = views
        block._apply = types.MethodType(_apply_then_regroup, block)
        block.forward = types.MethodType(_swapped_module_list_forward, block)
    else:
        block._moe_compile_experts = group
        block.forward = types.MethodType(_swapped_stacked_forward, block)
    extras = "".join([f", activation {plan.act_name}" if plan.act_name else "",
                      f", routed by {plan.router}" if plan.router != "gate_linear" else "",
                      f" ({plan.routing_form})" if plan.routing_form else "",
                      f", called as {plan.router_module}{plan.call.describe()}" if plan.call != RouterCall() else "",
                      f", routed output x{plan.scale:g}" if plan.scale != 1.0 else "",
                      f", + {plan.identity_experts} identity experts" if plan.identity_experts else "",
                      f", + {plan.shared}" if plan.shared else "",
                      f" (gated by {plan.shared_gate})" if plan.shared_gate else ""])
    return (f"{group.kind} experts ({plan.num_experts}, {'gated' if plan.gated else 'plain'} "
            f"{'/'.join(plan.paths)}), weights {'before' if plan.weights_before else 'after'} the MLP{extras}: "
            "permute_pad -> grouped GEMMs -> unpad_unpermute")


@contextlib.contextmanager
def _perturbed(block: nn.Module, path: str | None) -> Iterator[None]:
    """While the probe runs, the selection bias at ``path`` holds random values of the probabilities' scale (a bias
    of zeros, as initialised, would let any reading of it pass); its own values are put back after."""
    if path is None:
        yield
        return
    bias = _tensor_at(block, path)
    saved = bias.detach().clone()
    gen = torch.Generator(device=bias.device).manual_seed(0)
    with torch.no_grad():
        bias.copy_((torch.rand(bias.shape, generator=gen, device=bias.device) - 0.5) * (2.0 / bias.numel()))
    try:
        yield
    finally:
        with torch.no_grad():
            bias.copy_(saved)


def _verify_first(block: nn.Module, plan: _Plan, projections: Callable[[], list[Projection]], x: Tensor,
                  candidates: list[dict[str, Any]]) -> None:
    """Set ``plan`` to the first of ``candidates`` that :func:`verify` accepts (:func:`first_verified`). The block
    must be in eval mode; ``verify`` leaves it in training."""
    def failures_of(candidate: dict[str, Any]) -> list[NotSwappable]:
        block.eval()
        _set_candidate(plan, candidate)
        with torch.no_grad():
            _probe_error(block, plan, projections, x)  # sets returns_logits
        returns_logits = plan.returns_logits

        def forward_error() -> float:
            err = _probe_error(block, plan, projections, x)
            return err if plan.returns_logits == returns_logits else math.inf

        first = next(verification_failures(
            block, forward_error, lambda t: _fused_block_forward(block, plan, projections, t), x), None)
        return [first] if first is not None else []

    first_verified(candidates, failures_of)


def _hidden_size(group: ExpertGroup, plan: _Plan) -> int:
    if group.kind != "module_list":
        return _stacked_projections(group, plan.paths[-1], plan.transposed)[plan.paths[0]].w_ENK.shape[-1]
    first = next(lin for lin in group.linears if lin.path == plan.paths[0])
    return first.in_features


def _swapped_module_list_forward(self: nn.Module, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Any:
    """The swapped forward of a ModuleList block; state lives on ``self`` so ``copy.deepcopy`` follows it."""
    return _fused_block_forward(self, self._moe_compile_plan, self._moe_compile_views.projections, hidden_states)


def _swapped_stacked_forward(self: nn.Module, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Any:
    plan, group = self._moe_compile_plan, self._moe_compile_experts
    stacked = _stacked_projections(group, plan.paths[-1], plan.transposed)
    return _fused_block_forward(self, plan, lambda: (tuple(stacked[p] for p in plan.paths[:-1]),
                                                     stacked[plan.paths[-1]]), hidden_states)


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


def swap_expert_loops(model: nn.Module, ep_capacity_factor: float | None = None) -> list[tuple[str, str, str, str]]:
    """Swap every recognised expert-loop block of ``model`` (in place); returns explain records.

    transformers ``*Experts`` modules (interface-decorated) are skipped here:
    the experts interface (``experts/interface.py``) covers them. Expert-parallel blocks (a process group, local
    experts) are swapped first, by :func:`moe_compile.experts.expert_parallel.swap_ep_blocks`: every rank of their
    group must call this at once; ``ep_capacity_factor`` is theirs (``moe_compile.compile``'s).
    Records are ``(block name, "rewrite" | "skip", tag, detail)``.
    """
    # first: their local experts would read as a group of E / W experts
    records = swap_ep_blocks(model, ep_capacity_factor)
    identity, unmatched = identity_expert_groups(model)
    records += [_zero_compute_skip(name, m, "its weights are not rank-3 [E or E + Z, N, K] parameters of E MLP "
                                  "experts") for name, m in unmatched]
    zero_compute = {id(m) for _, m in unmatched} | {id(g.module) for g in identity}
    modules = dict(model.named_modules())
    groups = [g for g in (*find_expert_weights(model), *_single_expert_lists(model))
              if id(g.module) not in zero_compute]
    groups += _flat_expert_groups(model, [*groups, *identity])
    named = {id(g) for g in groups}
    merged = sibling_stacked_groups(model, groups + unnamed_stacked_groups(model, [*groups, *identity]))
    # by shape alone: a module of two or more projections, or one-projection siblings merged (one alone is no MLP)
    unnamed = {id(g) for g in merged if id(g) not in named and len(g.linears) >= 2}
    groups = [g for g in merged if id(g) in named or id(g) in unnamed]
    for group in [*groups, *identity, *module_dict_groups(model, [*groups, *identity])]:
        if is_hf_experts(group.module) or getattr(group.module, "_moe_compile_swapped", False):
            continue
        block_name = _routing_ancestor(modules, group)
        block = modules.get(block_name)
        if block is None or getattr(block, "_moe_compile_original_forward", None) is not None:
            continue
        Z = group.module.zero_expert_num if id(group.module) in zero_compute else 0
        try:
            try:
                detail = swap_capacity_block(block, group) if group.kind == "module_dict" else \
                    swap_block(block, group, Z)
            except NotSwappable:
                extra = _ids_past_experts(block, group) if group.kind == "stacked" and not Z else 0
                if not extra:
                    raise
                detail = swap_block(block, group, extra)  # the probe decides whether they are identity experts
        except NotSwappable as why:
            if why.tag == "no_router" and id(group) in unnamed:
                continue  # rank-3 parameters no name calls experts, and nothing routes them: not a MoE layer
            if Z:  # the form the fused path cannot match keeps the family's tag, the probe's reason in its detail
                records.append(_zero_compute_skip(group.name, group.module, f"{why.tag}: {why.detail}"))
            else:
                records.append((block_name or "<root>", "skip", why.tag, why.detail))
            continue
        except Exception as exc:  # noqa: BLE001 - the block's own code raised on the probe's call: leave it as written
            records.append((block_name or "<root>", "skip", "probe_failed",
                            f"raised while probing the block's code ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0][:160] if str(exc) else ''}); left as written"))
            continue
        records.append((block_name or "<root>", "rewrite", "expert_loop_swapped", detail))
    return records




def _ids_past_experts(block: nn.Module, group: ExpertGroup) -> int:
    """``Z > 0`` where the block routes over ``E + Z`` ids for ``E`` stacked experts: its one router-shaped
    ``Linear(H, E + Z)`` outside the experts (LongCat-Flash's ``classifier`` over 8 MLP experts and 4 more ids, whatever
    the experts module calls them), else 0. Whether the ids past ``E`` are identity experts is the probe's to say."""
    E = group.linears[0].num_experts
    hidden = {lin.in_features for lin in group.linears} | {lin.out_features for lin in group.linears}
    experts = {id(m) for m in group.module.modules()}
    widths = {m.out_features - E for m in block.modules() if isinstance(m, nn.Linear) and id(m) not in experts
              and m.in_features in hidden and E < m.out_features <= 2 * E}
    return widths.pop() if len(widths) == 1 else 0


def _zero_compute_skip(name: str, module: nn.Module, why: str) -> tuple[str, str, str, str]:
    """The skip record of an experts module with zero-compute (identity) experts beside its MLP experts
    (LongCat-Flash) that the swap leaves alone (``zero_compute_experts``), rather than ``not_in_graph``."""
    return (name.rpartition(".")[0] or "<root>", "skip", "zero_compute_experts",
            f"{type(module).__name__}: {module.zero_expert_num} identity experts beside the MLP experts, left alone: "
            f"{why}")
