"""How the expert-loop swap (:mod:`moe_compile.experts.swap`) reads a block's routing: what its routing module
returns (pair, triple, dense scores, a routing map), the plain ``Linear(H, E)`` router found by its shape, the top-k
candidates, and which ancestor of the experts routes them."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from moe_compile.experts._probe import NotSwappable, probe_input
from moe_compile.experts.discovery import ExpertGroup


def _routing_form(out: Any, num_experts: int, top_k: int | None) -> str:
    """What a routing module (or ``route_tokens_to_experts``) returns, by its tensors' shapes and dtypes:

    * ``pair``: ``(weights_TK, ids_TK)`` in either order (DeepSeek-V3's reference ``Gate``, DBRX's
      ``route_tokens_to_experts``);
    * ``triple``: ``(logits_TE, weights_TK, ids_TK)`` (transformers' top-k routers: Step3p7TopKRouter);
    * ``dense``: ``(scores_TE, logits_TE)``, every expert's score, zero outside the top-k (Llama4Router: a sigmoid
      of the top-k logits scattered into ``-inf``), with ``K`` the block's ``top_k``;
    * ``map``: ``(probs_TE, routing_map_TE)``, a bool map of each token's ``K`` experts (Megatron's ``TopKRouter``);
    * ``table``: ``(scores_TE, ids_TK)`` in either order, the weights each token's scores at its ids (GPT-OSS's
      ``zeros_like(logits).scatter_(1, ids, softmax(top))``, or dense scores: the probe tells).

    ``None`` entries and tensors of fewer than 2 dims (DeepSeek-V2's ``aux_loss=None``, torchtitan's per-expert
    counts) are not read (:func:`_core`), and ``[B, S, N]`` outputs are read as ``[T, N]``.

    Raises NotSwappable (``no_router``) for anything else."""
    out = _core(out)
    tensors = isinstance(out, tuple) and all(isinstance(t, Tensor) and t.dim() == 2 for t in out)
    if tensors and len(out) == 2:
        ints = [t for t in out if not t.is_floating_point() and t.dtype != torch.bool]
        floats = [t for t in out if t.is_floating_point()]
        if len(ints) == 1 and len(floats) == 1 and ints[0].shape == floats[0].shape:
            return "pair"
        if len(ints) == 1 and len(floats) == 1 and floats[0].shape[1] == num_experts \
                and ints[0].shape[0] == floats[0].shape[0]:
            return "table"
        if len(floats) == 2 and out[0].shape == out[1].shape and out[0].shape[1] == num_experts \
                and isinstance(top_k, int) and 0 < top_k <= num_experts:
            return "dense"
        maps = [t for t in out if t.dtype == torch.bool]
        if len(maps) == 1 and len(floats) == 1 and maps[0].shape == floats[0].shape \
                and maps[0].shape[1] == num_experts and isinstance(top_k, int) and 0 < top_k <= num_experts:
            return "map"
    if tensors and len(out) == 3:
        logits, weights, ids = out
        if logits.is_floating_point() and weights.is_floating_point() and not ids.is_floating_point() \
                and logits.shape[1] == num_experts and weights.shape == ids.shape:
            return "triple"
    raise NotSwappable("no_router", "the routing module returns neither (weights [T, K], expert ids [T, K]), nor "
                                    "(logits [T, E], weights [T, K], ids [T, K]), nor (scores [T, E], logits [T, E]), "
                                    "nor (probs [T, E], routing map [T, E] bool), nor (scores [T, E], ids [T, K])")


def _core(out: Any) -> Any:
    """A routing module's returned tuple as its routing tensors: ``None`` and tensors of fewer than 2 dims left
    out (an aux loss, per-expert counts), the rest read as ``[T, N]``; anything else as it is."""
    if not isinstance(out, tuple):
        return out
    return tuple(t.reshape(-1, t.shape[-1]) for t in out if isinstance(t, Tensor) and t.dim() >= 2)


def _routing_of(out: Any, plan: Any) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(ids_TK, weights_TK, logits_TE or None)`` from a routing module's output of form ``plan.routing_form``.

    A ``dense`` router's experts are its logits' top-k (``topk`` of the tensor the router took its own top-k of, so
    the same experts, ties included) and their weights its scores there;
    NOTE [dense experts] (moe_compile/experts/swap.py) says why dropping the other experts is exact."""
    out = _core(out)
    if plan.routing_form == "pair":
        ints = [t for t in out if not t.is_floating_point() and t.dtype != torch.bool]
        floats = [t for t in out if t.is_floating_point()]
        return ints[0], floats[0], None
    if plan.routing_form == "table":
        ids_TK = next(t for t in out if not t.is_floating_point())
        scores_TE = next(t for t in out if t.is_floating_point())
        return ids_TK, scores_TE.gather(1, ids_TK), None
    if plan.routing_form == "triple":
        logits_TE, weights_TK, ids_TK = out
        return ids_TK, weights_TK, logits_TE
    if plan.routing_form == "map":
        # Megatron's (probs [T, E], routing_map [T, E]): each token's K mapped experts, in any order (the combine sums
        # in ascending expert order whatever the order of a token's choices); their weights the probs there
        probs_TE, map_TE = out if out[1].dtype == torch.bool else out[::-1]
        ids_TK = torch.topk(map_TE.to(probs_TE.dtype), plan.top_k, dim=-1).indices
        return ids_TK, probs_TE.gather(1, ids_TK), None
    scores_TE, logits_TE = out
    ids_TK = torch.topk(logits_TE, plan.top_k, dim=-1).indices
    return ids_TK, scores_TE.gather(1, ids_TK), logits_TE


def _router_linear(block: nn.Module, group: ExpertGroup, width: int) -> str | None:
    """The block's child ``nn.Linear`` with ``width`` outputs (its experts' count) outside the experts: the router,
    found by its shape whatever its name (``gate``, ``router``, ``wg``, ``classifier``, ...); None if there is not
    exactly one."""
    found = [name for name, m in block.named_children()  # a Linear subclass that routes itself is router_call's
             if isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward and m.out_features == width
             and m is not group.module]
    return found[0] if len(found) == 1 else None


def _top_k_candidates(block: nn.Module, router: nn.Module | None, num_experts: int) -> tuple[int, ...]:
    """The block's top-k: ``top_k`` / ``num_experts_per_tok`` where it says so, else every int attribute of the block
    and its router in ``[1, E)`` (``k``, ``num_selected``, ...), for the probe to choose from."""
    for owner in (block, router):
        for name in ("top_k", "num_experts_per_tok"):
            k = getattr(owner, name, None)
            if isinstance(k, int) and not isinstance(k, bool) and 0 < k <= num_experts:
                return (k,)
    found = []
    for owner in (block, router):
        for value in vars(owner).values() if owner is not None else ():
            if isinstance(value, int) and not isinstance(value, bool) and 0 < value < num_experts:
                found.append(value)
    return tuple(dict.fromkeys(found)) or observed_top_ks(block, router, num_experts)


class _TopKSeen(torch.overrides.TorchFunctionMode):
    """Records the ``k`` of every ``topk`` over ``E`` entries that runs under it."""

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.num_experts, self.ks = num_experts, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.topk, Tensor.topk) and args and isinstance(args[0], Tensor) and args[0].dim():
            k = args[1] if len(args) > 1 else kwargs.get("k")
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            if isinstance(k, int) and isinstance(dim, int) and args[0].shape[dim] == self.num_experts:
                self.ks.append(k)
        return func(*args, **kwargs)


def observed_top_ks(block: nn.Module, router: nn.Module | None, num_experts: int) -> tuple[int, ...]:
    """The ``k`` of each ``topk`` over the ``E`` experts that the block's own forward runs on a probe, wherever it
    runs it (the experts module of vLLM's ``FusedMoE`` takes the router's logits and picks the top-k itself): what
    the block computes, not an attribute's name. The probe then checks the candidate like any other."""
    weight = getattr(router, "weight", None)
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        return ()
    seen = _TopKSeen(num_experts)
    try:
        with torch.no_grad(), seen:
            probe_input(block, weight.shape[1], weight.dtype, weight.device)
    except NotSwappable:
        return ()
    return tuple(dict.fromkeys(k for k in seen.ks if 0 < k < num_experts))


def _routing_ancestor(modules: dict[str, nn.Module], group: ExpertGroup) -> str:
    """The name of the block that routes ``group``'s experts: their container's parent, or, where that holds no router
    (Megatron's ``SequentialMLP`` holds only ``local_experts`` and takes tokens already permuted), the nearest
    ancestor that does (a ``route`` method, a ``gate`` / ``router`` module, or a ``Linear(H, E)`` child); the
    container itself where it is the block (experts as parameters of the block that routes them)."""
    parent = group.name.rpartition(".")[0]
    E = group.linears[0].num_experts
    name = group.name if group.kind == "stacked" and _router_linear(group.module, group, E) is not None else parent
    while True:
        block = modules.get(name)
        if block is not None and (callable(getattr(block, "route", None)) or any(
                isinstance(getattr(block, n, None), nn.Module) for n in ("gate", "router"))
                or _router_linear(block, group, E) is not None):
            return name
        if not name:
            return parent
        name = name.rpartition(".")[0]
