"""The expert-loop swap of capacity-routed blocks whose experts are an ``nn.ModuleDict`` (``expert_0`` ...
``expert_{E-1}``): SwitchTransformers' ``SwitchTransformersSparseMLP``. Called by
:func:`moe_compile.experts.swap.swap_expert_loops`; the probe is NOTE [probe before swap] (moe_compile/experts/swap.py).

NOTE [capacity swap]: a capacity router drops a choice past its expert's capacity: the eager loop then never runs
that (token, expert) pair, so it adds nothing to the token's output and sends no gradient anywhere (a token with
every choice dropped gets an exactly zero output: transformers 5.24's Switch, unlike releases that passed the
token's input through, times its router prob). The swapped forward calls the block's own ``router`` module (its
capacity arithmetic, training-mode jitter, recorded router logits and any attribute it updates stay its own), then,
on the device, reads each token's expert from the returned dispatch mask (``[..., E]``, one non-zero at the kept
expert, none for a dropped token: ``argmax``; a dropped token lands on expert 0) and keeps
``kept = mask[t, id] != 0``; the router's tuple is read by its form (:func:`_router_form`): ``(mask, probs, logits)``
(transformers 5.24's Switch) or ``(probs, mask, probs)`` (5.17's: the kept expert's probability twice, the second
named ``router_logits``; its mask ``[.., 1, E]``). The experts run as grouped GEMMs over every token (``T`` rows: the
static bound of top-1, dropped ones included) with weight ``where(kept, prob, 0)``, and the output is
``where(kept, y, 0)``: a dropped token's output is exactly zero, and ``where``'s backward gives exactly zero to its
prob (so to the router) and to its expert row, whose rows then add exact zeros to the weight gradients. No
``nonzero``, no host read, no accumulating scatter.

What the probe adds for capacity: the comparison runs at the router's own ``expert_capacity`` and at capacity 1
(every probe sequence then drops tokens, so the drop semantics are compared, not assumed), each pair of forwards
from one random state (:func:`moe_compile.experts._probe.same_draws_run`: the router's jitter draws the same);
an exactly zero output row of the block's own must be exactly zero in the fused one. A router that drops no probe
token at capacity 1 (transformers 5.17's Switch counts capacity over the size-1 dim of its ``[.., 1, E]`` mask, so
it never drops at a capacity >= 1) must drop every one at capacity 0, where the block's own forward must return exact
zeros and send no gradient, as the fused one does (:func:`_probe_all_dropped`); capacity 1 and its own then compare
no drop. Left alone (``explain``'s tag): ``expert_dropout`` (a dropout inside the experts draws per expert in the
loop's order, which the fused path cannot reproduce), ``capacity_router_form`` (a router that returns neither
``(mask [.., E], probs [.., 1], logits [.., E])`` nor ``(probs [.., 1], mask [.., E], the same probs)``),
``capacity_topk_unknown`` (``[.., E]`` combine weights, several experts per token: the fused path needs a static
top-k), ``capacity_eager_mismatch`` (combine weights whose block does not compute
``sum_e combine[t, e] * expert_e(x[t])``: transformers 5.24's NLLB-MoE, ``tests/models/hf_families.py``),
``capacity_unknown`` (no integer ``router.expert_capacity`` to probe drops with, or a router that drops no probe
token at capacity 1 and keeps some at capacity 0), and the swap's own tags.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import types
from collections.abc import Callable
from itertools import chain
from typing import Any

import torch
from torch import Tensor, nn

from moe_compile.experts._probe import (
    NotSwappable,
    forward_in_both_modes,
    outputs,
    probe_input,
    row_mismatch,
    same_draws_run,
    verify,
)
from moe_compile.experts._swap_layout import (
    _act_of,
    _apply_then_regroup,
    _GroupedViews,
    _projection_names,
    per_expert_projections,
)
from moe_compile.experts.discovery import ExpertGroup, ExpertLinear
from moe_compile.experts.interface import SUPPORTED_DTYPES, Projection, fused_experts_forward

_EXPERT_KEY = re.compile(r"expert_(\d+)")


@dataclasses.dataclass
class _CapacityPlan:
    experts: list[nn.Module]  # expert_0 ... expert_{E-1}
    paths: tuple[str, ...]  # projection names, the last one is down
    gated: bool
    act: Callable[[Tensor], Tensor]
    flatten_first: bool = False  # the router runs on [T, H] (the block flattens first), else on the block's input
    # where the router's returned tuple holds the dispatch mask and the kept expert's probs (:func:`_router_form`)
    mask_at: int = 0
    probs_at: int = 1
    returns: str = "(mask, probs, logits)"


def module_dict_groups(model: nn.Module, claimed: list[ExpertGroup]) -> list[ExpertGroup]:
    """``nn.ModuleDict`` experts ``expert_0`` ... ``expert_{E-1}`` (``E >= 2``; other entries hold no tensor) of one
    class with the same ``nn.Linear`` children (paths, shapes, bias presence), as :class:`ExpertGroup` of kind
    ``"module_dict"`` (the swap's own: the FX passes and ``quantize_experts`` read no such layout)."""
    taken = [g.name for g in claimed]
    groups = []
    for name, module in model.named_modules():
        if (
            not isinstance(module, nn.ModuleDict)
            or "expert" not in name.rpartition(".")[2].lower()
            or any(name == t or name.startswith(t + ".") or t.startswith(name + ".") for t in taken)
        ):
            continue
        keys = [k for k in module.keys() if _EXPERT_KEY.fullmatch(k)]
        E = len(keys)
        others = [m for k, m in module.items() if k not in keys]  # NLLB-MoE's token dropout: no tensors allowed
        if (
            E < 2
            or sorted(keys) != sorted(f"expert_{i}" for i in range(E))
            or any(next(chain(m.parameters(), m.buffers()), None) is not None for m in others)
        ):
            continue
        experts = [module[f"expert_{i}"] for i in range(E)]
        specs = [
            tuple(
                (n, m.out_features, m.in_features, m.bias is not None)
                for n, m in e.named_modules()
                if isinstance(m, nn.Linear) and n
            )
            for e in experts
        ]
        if len({type(e) for e in experts}) != 1 or len(set(specs)) != 1 or not specs[0]:
            continue
        linears = tuple(ExpertLinear(n, E, out_f, in_f, False, bias) for n, out_f, in_f, bias in specs[0])
        groups.append(ExpertGroup(name, module, "module_dict", linears))
    return groups


# ===== the swapped forward =====


def _capacity_forward(
    block: nn.Module,
    plan: _CapacityPlan,
    projections: Callable[[], tuple[tuple[Projection, ...], Projection]],
    hidden: Tensor,
) -> Tensor:
    """The block's own router, then the kept (token, expert) pairs through the grouped GEMMs (NOTE [capacity swap])."""
    H, E = hidden.shape[-1], len(plan.experts)
    x = hidden.reshape(-1, H) if plan.flatten_first else hidden
    routed = block.router(x)
    mask, probs = routed[plan.mask_at], routed[plan.probs_at]
    # read after the router: one that jitters its input in place (Switch's, in fp32) feeds the experts that, as in eager
    x_TH = x.reshape(-1, H)
    mask_TE = mask.reshape(-1, E)
    ids_T1 = mask_TE.argmax(dim=-1, keepdim=True)
    kept_T1 = mask_TE.gather(1, ids_T1) != 0
    weights_T1 = torch.where(kept_T1, probs.reshape(-1, 1), 0)
    ups, down = projections()
    y_TH = fused_experts_forward(x_TH, ids_T1, weights_T1, ups, _middle(plan, len(ups)), down, num_experts=E)
    return torch.where(kept_T1, y_TH, 0).reshape(hidden.shape)


def _middle(plan: _CapacityPlan, n_ups: int) -> Callable[..., Tensor]:
    if not plan.gated:
        return plan.act
    if n_ups == 2:
        return lambda gate_MI, up_MI: plan.act(gate_MI) * up_MI
    return lambda gate_up_MN: plan.act(gate_up_MN.chunk(2, dim=-1)[0]) * gate_up_MN.chunk(2, dim=-1)[1]


def _swapped_capacity_forward(self: nn.Module, hidden_states: Tensor) -> Tensor:
    """The swapped forward; state lives on ``self`` so ``copy.deepcopy`` follows it."""
    return _capacity_forward(self, self._moe_compile_plan, self._moe_compile_views.projections, hidden_states)


# ===== recognising and probing =====


def _router_out(block: nn.Module, x: Tensor) -> Any:
    """``block.router`` on the probe's tokens ``[T, H]``, or on the probe ``x`` as given where the router takes only
    that (NLLB-MoE's unpacks ``batch_size, sequence_length, hidden_dim``): the form is read from what it returns,
    whichever it takes (the probe then picks the input the block passes, ``flatten_first``)."""
    try:
        return block.router(x.reshape(-1, x.shape[-1]).clone())
    except Exception:  # noqa: BLE001 - a router that takes the block's [B, S, H] input only
        if x.dim() == 2:
            raise
        return block.router(x.clone())


def _router_form(block: nn.Module, E: int, x: Tensor) -> tuple[str, int, int, str]:
    """``(form, mask_at, probs_at, returns)``: where the router's returned tuple holds the dispatch mask (``[T, E]`` of
    0/1) and the probs, and how it reads. ``"top1"``: one of

    - ``(mask [T, E], probs [T, 1], logits [T, E])`` with at most one non-zero per mask row (transformers 5.24's
      Switch);
    - ``(probs [T, 1], mask [T, E], probs [T, 1])``, the two probs equal, at most one non-zero per mask row
      (transformers 5.17's Switch: the kept expert's probability twice, the second under the name ``router_logits``,
      its mask ``[.., 1, E]``);

    ``"combine"``: ``(mask [T, E], combine weights [T, E], logits [T, E])``, or ``(mask [T, E], combine weights
    [T, E])`` (NLLB-MoE's top-2: its top-1 mask and the two kept experts' weights). Raises NotSwappable
    (``capacity_router_form``) for anything else."""
    out = _router_out(block, x)
    T = x.reshape(-1, x.shape[-1]).shape[0]
    if isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, Tensor) and t.numel() == T * E for t in out):
        out = (*out, out[1])  # (mask, combine weights): read as the triple without its logits
    if isinstance(out, tuple) and len(out) == 3 and all(isinstance(t, Tensor) for t in out):
        first, second, third = (t.reshape(T, -1) if t.numel() % T == 0 else t for t in out)

        def is_mask(t: Tensor) -> bool:
            return t.shape == (T, E) and bool(((t == 0) | (t == 1)).all())

        def top1(mask: Tensor) -> bool:
            return bool(((mask != 0).sum(-1) <= 1).all())

        if third.shape == (T, E) and second.is_floating_point() and is_mask(first):
            if second.shape == (T, 1) and top1(first):
                return "top1", 0, 1, "(mask, probs, logits)"
            if second.shape == (T, E):
                return "combine", 0, 1, "(mask, combine weights, logits)"
        if (
            first.shape == third.shape == (T, 1)
            and first.is_floating_point()
            and torch.equal(first, third)
            and is_mask(second)
            and top1(second)
        ):
            return "top1", 1, 0, "(probs, mask, probs)"
    raise NotSwappable(
        "capacity_router_form",
        "the router does not return (dispatch mask [.., E] of 0/1, probs [.., 1] or combine weights [.., E], "
        "logits [.., E]) nor (probs [.., 1], dispatch mask [.., E] of 0/1, the same probs)",
    )


def _refuse_combine(block: nn.Module, plan: _CapacityPlan, x: Tensor) -> None:
    """A router returning ``[T, E]`` combine weights (several experts per token, top-2 NLLB-MoE): the fused path has
    no static top-k to run it with, so it is left alone; the tag says whether the block's own forward even computes
    ``sum_e combine[t, e] * expert_e(x[t])`` (a dense reading, on the probe only)."""
    x_TH = x.reshape(-1, x.shape[-1])
    combine_TE = _router_out(block, x)[plan.probs_at].reshape(x_TH.shape[0], -1)
    dense = sum(combine_TE[:, e, None] * expert(x_TH) for e, expert in enumerate(plan.experts))
    err = row_mismatch(dense, outputs(block.forward(x.clone()))[0].reshape(dense.shape))
    if err <= 1:
        raise NotSwappable(
            "capacity_topk_unknown",
            "the router returns [T, E] combine weights (several experts per "
            "token) and no top-k: the fused path needs a static one",
        )
    raise NotSwappable(
        "capacity_eager_mismatch",
        "the block's own forward does not compute sum_e combine[t, e] * "
        "expert_e(x[t]) from the combine weights its router returns "
        f"(worst row {err:.3g}x of the probe's tolerance): it runs other "
        "experts than the router chose",
    )


def _check_block(block: nn.Module, group: ExpertGroup, experts: list[nn.Module]) -> None:
    """The structural checks: a ``router`` module, the block's forward taking the hidden states alone, no tensor
    outside the router and the experts, no active dropout inside the experts."""
    if not isinstance(getattr(block, "router", None), nn.Module):
        raise NotSwappable("no_router", "a ModuleDict of experts without a router module beside it")
    name = next(n for n, m in block.named_children() if m is group.module)
    other = [
        n for n, _ in (*block.named_parameters(), *block.named_buffers()) if not n.startswith(("router.", name + "."))
    ]
    if other:
        raise NotSwappable(
            "block_state_unused",
            f"the block holds {', '.join(other[:4])}, which the fused path (router, experts) does not read",
        )
    dropouts = [
        f"expert_{i}.{n} (p={m.p})"
        for i, e in enumerate(experts)
        for n, m in e.named_modules()
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0
    ]
    if dropouts:
        raise NotSwappable(
            "expert_dropout",
            f"{dropouts[0]}{' ...' if len(dropouts) > 1 else ''}: in training, a "
            "dropout inside the experts draws per expert in the loop's order, which "
            "the fused path cannot reproduce",
        )


def _probe(block: nn.Module, plan: _CapacityPlan, projections: Callable[..., Any], x: Tensor) -> None:
    """NOTE [capacity swap]'s probe: the router's input (the block's input or its flattened tokens) chosen in eval
    mode at capacity 1, where the router must drop probe tokens; then :func:`verify` (eval, training, backward) at
    capacity 1 and at the router's own."""
    router = block.router
    capacity = getattr(router, "expert_capacity", None)
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise NotSwappable(
            "capacity_unknown",
            f"router.expert_capacity is {capacity!r}, not an integer >= 1: the "
            "probe cannot make the router drop tokens",
        )

    def fused(t: Tensor) -> Tensor:
        return _capacity_forward(block, plan, projections, t)

    def error() -> float:
        want, got = same_draws_run(block.forward, fused, x)
        if not isinstance(want, Tensor) or got.shape != want.shape:
            return math.inf
        zero_rows = (want.reshape(-1, want.shape[-1]) == 0).all(-1)
        if not torch.equal(zero_rows, (got.reshape(zero_rows.shape[0], -1) == 0).all(-1)):
            return math.inf  # a dropped token's output is exactly zero, and only a dropped token's
        return row_mismatch(got, want)

    def kept() -> Tensor:
        """``[T]`` bool: the probe tokens the router keeps at its present capacity (eval mode)."""
        with torch.no_grad():
            return (router(x.clone())[plan.mask_at].reshape(-1, len(plan.experts)) != 0).any(-1)

    try:
        router.expert_capacity = 1
        block.eval()
        if bool(kept().all()):
            # transformers 5.17's Switch: its capacity count runs over a dim of size 1, so it never drops at 1
            router.expert_capacity = 0
            if bool(kept().any()):
                raise NotSwappable(
                    "capacity_unknown",
                    "the router dropped no probe token at capacity 1 and kept some at capacity 0: its drops could "
                    "not be compared",
                )
            _probe_all_dropped(block, fused, error, x)
            router.expert_capacity = 1
            block.eval()
        with torch.no_grad():
            errors = []
            for flatten_first in (False, True):
                plan.flatten_first = flatten_first
                errors.append((error(), flatten_first))
            err, plan.flatten_first = min(errors)
        if not err <= 1:
            raise NotSwappable(
                "probe_mismatch",
                "the capacity path does not match the block's own forward at "
                f"capacity 1 (worst row {err:.3g}x of the probe's tolerance)",
            )
        for cap in (1, capacity):
            router.expert_capacity = cap
            verify(block, error, fused, x, same_draws=True)
    finally:
        router.expert_capacity = capacity


def _probe_all_dropped(
    block: nn.Module, fused: Callable[[Tensor], Tensor], error: Callable[[], float], x: Tensor
) -> None:
    """NOTE [capacity swap]'s drops for a router that drops no probe token at capacity 1, at capacity 0, where it
    drops every one: the block's own forward must return exact zeros as the fused one does (``error``), in eval and
    in training mode, and neither may send a gradient (none, or exact zeros) to the probe or to any parameter."""
    forward_in_both_modes(block, error, lambda mode, err: (
        f"with every probe token dropped (capacity 0), the block's own forward in {mode} mode does not return the "
        f"fused path's exact zeros (worst row {err:.3g}x of the probe's tolerance)"))
    named = [(n, p) for n, p in block.named_parameters() if p.requires_grad]
    probe = x.detach().clone().requires_grad_(x.is_floating_point())
    gen = torch.Generator(device="cpu").manual_seed(1)
    with torch.enable_grad():
        for who, out in zip(("block's own", "fused"), same_draws_run(block.forward, fused, probe)):
            if not out.requires_grad:
                continue
            cot = torch.randn(out.shape, generator=gen).to(device=out.device, dtype=out.dtype)
            grads = torch.autograd.grad(out, (probe, *(p for _, p in named)), cot, allow_unused=True)
            sent = [n for n, g in zip(("input", *(n for n, _ in named)), grads) if g is not None and bool(g.any())]
            if sent:
                raise NotSwappable(
                    "probe_grad_mismatch",
                    f"with every probe token dropped (capacity 0), the {who} backward sends a gradient to "
                    f"{', '.join(sent[:4])}",
                )


def swap_capacity_block(block: nn.Module, group: ExpertGroup) -> str:
    """Swap ``block``'s forward to NOTE [capacity swap]'s fused path; returns a description.

    Raises:
        NotSwappable: the block is left unchanged; ``tag`` says why.
    """
    experts = [group.module[f"expert_{i}"] for i in range(group.linears[0].num_experts)]
    _check_block(block, group, experts)
    names, gated = _projection_names({lin.path for lin in group.linears})
    act = _act_of(experts[0])
    if act is None:
        raise NotSwappable("capacity_activation_unknown", "the experts name no act / act_fn / activation module")
    weight = next(experts[0].parameters())  # not the router's: Switch's casts its classifier to float32 on every call
    if weight.dtype not in SUPPORTED_DTYPES:
        raise NotSwappable("dtype", f"{weight.dtype} (supported: bf16, fp16, fp32)")
    plan = _CapacityPlan(experts, names, gated, act)
    hidden = next(lin.in_features for lin in group.linears if lin.path == names[0])
    was_training = [m.training for m in block.modules()]
    block.eval()
    try:
        x = probe_input(block, hidden, weight.dtype, weight.device)
        with torch.no_grad():
            form, plan.mask_at, plan.probs_at, plan.returns = _router_form(block, len(experts), x)
            if form == "combine":
                _refuse_combine(block, plan, x)
        extra = list(inspect.signature(block.forward).parameters)[1:]
        if extra:
            raise NotSwappable(
                "capacity_extra_inputs",
                f"the block's forward takes {extra} besides the hidden states, which the fused path would not read",
            )
        _probe(block, plan, lambda: per_expert_projections(plan.experts, plan.paths), x)
    finally:
        for m, t in zip(block.modules(), was_training):
            m.training = t
    block._moe_compile_original_forward = block.forward
    block._moe_compile_plan = plan
    block._moe_compile_views = _GroupedViews(experts, names, gated)
    block._apply = types.MethodType(_apply_then_regroup, block)
    block.forward = types.MethodType(_swapped_capacity_forward, block)
    routed = "its tokens [T, H]" if plan.flatten_first else "its input"
    return (
        f"module_dict experts ({len(experts)}, {'gated' if gated else 'plain'} {'/'.join(names)}), top-1 "
        f"capacity routing by the block's router on {routed} {plan.returns}, dropped choices exact "
        "zeros: permute_pad -> grouped GEMMs -> unpad_unpermute"
    )
