"""Expert-parallel blocks whose experts Dynamo cannot capture, swapped to one static exchange.

An expert-parallel (EP) block holds ``L`` of the ``E = W * L`` experts on each of the ``W`` ranks of a process group;
its forward sends each routed row to the rank holding its expert and back. Written as the Megatron / DeepSpeed shape
(``tests/models/ep_layers.py``: ``AutogradAllToAllEP``), it reads the split sizes to the host and runs its local
experts as a host loop over the received chunks (``for size in counts.tolist(): if size: ...``): Dynamo breaks the
graph there, and every layer syncs the host. :func:`swap_ep_blocks` replaces such a block's ``forward`` (on the
instance) by one that routes, then calls :func:`ep_experts_forward`::

    before (eager, per rank):  route -> counts exchange -> .tolist() -> rows exchange at those splits
                               -> for each (source, expert) chunk: if size: MLP -> reverse exchange -> combine
    after:                     route -> permute_pad (rows by global expert) -> counts exchange (static)
                               -> gather_rows into [W*S, H] -> all_to_all at equal splits [S]*W
                               -> gather_rows regroup (local expert, source) -> grouped GEMMs at device offsets
                               -> gather_rows back -> all_to_all -> gather_rows unpack -> unpad_unpermute

the same static exchange the graph pass ``expert_parallel`` writes for a graph that Dynamo captures (its docstring
states the ops' contract). ``S`` is the bound ``T * min(K, L)``: no row is dropped. No host read, no atomics; every
data movement is a gather whose backward is the inverse gather, so forward and backward are bitwise reproducible.

What is recognised: a module holding a ``torch.distributed.ProcessGroup`` attribute of ``W > 1`` ranks, a linear
router (``router`` or ``gate``, ``H -> E`` with ``W`` dividing ``E``), a top-k (``top_k`` / ``num_experts_per_tok``),
and exactly two rank-3 parameters with ``L = E / W`` rows, the up (or gate-then-up) projection and the down one
(in that order, unless the first is named as a down one: ``down``, ``w2``, ``fc2``, ``wo``),
stored ``[L, N, H]`` or ``[L, H, N]`` (``x @ w``): their shapes tell which and whether the MLP is gated (``N = 2I``).
Nothing else may hold state (``block_state_unused``). NOTE [probe before swap] (moe_compile/experts/swap.py) decides
the rest (activation, gate or up first, routing weights before or after the MLP, the router's softmax form) on every
rank at once: the candidates' errors are reduced across the group (the largest counts), so each rank takes the same
candidate, and each rank runs every check of the probe before the verdicts are reduced, so the ranks call the same
collectives in the same order. A block refused on one rank is refused on all. A block whose forward Dynamo
captures whole (torchtitan's shape) is left to the graph pass, which proves its rewrite (:func:`_captured_whole`).

transformers' own expert parallelism (``DistributedConfig(ep_size=W)``: the ``ep_plan`` shards the experts'
weights and installs an ``EPImplementation`` that the experts module's forward calls) is the third shape: its
``AllToAllEP`` reads the split sizes to the host every layer. :func:`register_hf_expert_parallel` adds
``"moe_compile"`` to transformers' implementations (:func:`ep_experts_forward` on the experts' local shards), and
:func:`use_hf_expert_parallel` (``moe_compile.compile``) swaps it in for ``all_to_all`` / ``auto`` on a model as
loaded. With tensor parallelism (the ranks of a TP group share one batch) transformers' own stays.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn

from moe_compile.config import CAPTURE_FLAGS
from moe_compile.experts._probe import (
    TOKENS_FIRST,
    NotSwappable,
    first_verified,
    outputs,
    probe_input,
    ranked_candidates,
    row_mismatch,
    verification_failures,
)
from moe_compile.experts._swap_layout import ACT_CANDIDATES, GATE_WEIGHTS, _act_of, top_k_of_logits
from moe_compile.experts.interface import SUPPORTED_DTYPES, Projection, grouped_linear, hf_projection
from moe_compile.ops.expert_parallel import ep_capacity, ep_regroup_index, ep_send_index, gather_rows
from moe_compile.ops.permute_pad import permute_pad
from moe_compile.ops.unpad_unpermute import unpad_unpermute

_ROUTER_NAMES = ("router", "gate")
_TOP_K_NAMES = ("top_k", "num_experts_per_tok")
_DOWN_NAME = re.compile(r"down|w2|fc2|wo", re.IGNORECASE)  # the down projection, when registered first


def _exchange(rows: Tensor, world: int, capacity: int, group: dist.ProcessGroup) -> Tensor:
    splits = [capacity] * world
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(rows, splits, splits, group))


def ep_experts_forward(x_TH: Tensor, ids_TK: Tensor, weights_TK: Tensor, up: Projection,
                       middle: Callable[[Tensor], Tensor], down: Projection, *, num_experts: int,
                       group: dist.ProcessGroup, weights_before: bool = False,
                       capacity_factor: float | None = None) -> Tensor:
    """``sum_k w[t, k] * down(middle(up(x[t])))`` with global expert ``ids[t, k]``, whose weights live on rank
    ``ids[t, k] // L`` of ``group`` (``up`` / ``down``: this rank's ``L`` experts, ``[L, N, H]`` / ``[L, H, I]``),
    through the static exchange (module docstring). Every rank of ``group`` must call it with the same ``T``.

    ``capacity_factor``: ``S`` rows per destination (:func:`moe_compile.ops.expert_parallel.ep_capacity`); ``None``
    the bound ``T * min(K, L)`` (a token sends a rank at most ``min(K, L)`` rows: nothing dropped). A row past ``S``
    in its destination's block is dropped: its expert term is zero, and it sends no gradient."""
    world = dist.get_world_size(group)
    if num_experts % world or up.w_ENK.shape[0] != num_experts // world:
        raise ValueError(f"num_experts={num_experts} must be world size {world} x the {up.w_ENK.shape[0]} local "
                         "experts of up")
    L = num_experts // world
    T, K = ids_TK.shape
    S = ep_capacity(T * min(K, L), T * K, world, capacity_factor)
    out = permute_pad(x_TH, ids_TK, weights_TK if weights_before else None, num_experts=num_experts)
    rows_NH = out.rows_MH
    if weights_before:
        rows_NH = (rows_NH * out.probs_M.unsqueeze(-1)).to(x_TH.dtype)
    recv_counts = funcol.wait_tensor(funcol.all_to_all_single(out.counts_E, None, None, group))
    pack, slot = ep_send_index(out.counts_E.view(world, L).sum(1), T * K, S)
    regroup, inverse, offs_L = ep_regroup_index(recv_counts.view(world, L), S)
    received = _exchange(gather_rows(rows_NH, pack, slot), world, S, group)
    local = gather_rows(received, regroup, inverse)
    h = middle(grouped_linear(local, up, offs_L, None))
    y = grouped_linear(h.to(x_TH.dtype), down, offs_L, None)
    returned = gather_rows(_exchange(gather_rows(y, inverse, regroup), world, S, group), slot, pack)
    return unpad_unpermute(returned, out.row_map, None if weights_before else weights_TK).to(x_TH.dtype)


@dataclasses.dataclass
class _EPPlan:
    group: dist.ProcessGroup
    world: int
    num_experts: int
    top_k: int
    hidden: int
    router: str
    up: str  # parameter names on the block
    down: str
    up_transposed: bool  # stored [L, H, N] (x @ w)
    down_transposed: bool
    gated: bool
    gate_first: bool = True
    act_name: str = ""
    act: Callable[[Tensor], Tensor] | None = None
    weights_before: bool = False
    gate_weights: str = "softmax_topk"
    capacity_factor: float | None = None  # set after the probe (which compares at the bound)

    def take(self, candidate: dict[str, Any]) -> None:
        """Read the block as the probe's ``candidate`` (:func:`_candidates`) says."""
        for field, value in candidate.items():
            setattr(self, field, value)

    def projections(self, block: nn.Module) -> tuple[Projection, Projection]:
        up, down = block.get_parameter(self.up), block.get_parameter(self.down)
        return (Projection(up.transpose(1, 2) if self.up_transposed else up),
                Projection(down.transpose(1, 2) if self.down_transposed else down))

    def middle(self, h: Tensor) -> Tensor:
        if not self.gated:
            return self.act(h)
        a, b = h.chunk(2, dim=-1)
        gate, up = (a, b) if self.gate_first else (b, a)
        return self.act(gate) * up


def _ep_forward(block: nn.Module, plan: _EPPlan, x: Tensor) -> Tensor:
    x_TH = x.reshape(-1, plan.hidden)
    ids_TK, weights_TK = top_k_of_logits(getattr(block, plan.router)(x_TH), plan.top_k, plan.gate_weights)
    up, down = plan.projections(block)
    y = ep_experts_forward(x_TH, ids_TK, weights_TK.to(x.dtype), up, plan.middle, down,
                           num_experts=plan.num_experts, group=plan.group, weights_before=plan.weights_before,
                           capacity_factor=plan.capacity_factor)
    return y.view(x.shape)


def _swapped_ep_forward(self: nn.Module, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    return _ep_forward(self, self._moe_compile_ep_plan, hidden_states)


def process_group_of(block: nn.Module) -> dist.ProcessGroup | None:
    """The one ``ProcessGroup`` of more than one rank that ``block`` holds as an attribute, if any."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    groups = {id(v): v for v in vars(block).values() if isinstance(v, dist.ProcessGroup)}
    groups = [g for g in groups.values() if dist.get_world_size(g) > 1]
    return groups[0] if len(groups) == 1 else None


def _plan_ep_block(block: nn.Module, group: dist.ProcessGroup) -> _EPPlan:
    """What the block's attributes and shapes say (module docstring); raises :class:`NotSwappable`."""
    world = dist.get_world_size(group)
    routers = [n for n in _ROUTER_NAMES if isinstance(getattr(block, n, None), nn.Linear)]
    if not routers:
        raise NotSwappable("no_router", "an expert-parallel block without a linear router (router / gate)")
    router = routers[0]
    hidden, E = block.get_submodule(router).in_features, block.get_submodule(router).out_features
    top_k = next((getattr(block, n) for n in _TOP_K_NAMES if isinstance(getattr(block, n, None), int)), None)
    if E % world or top_k is None:
        raise NotSwappable("no_router", f"router {router}: {E} experts over {world} ranks, top-k {top_k}")
    L = E // world
    stacked = [(n, p) for n, p in block.named_parameters() if p.dim() == 3 and p.shape[0] == L]
    others = [n for n, p in block.named_parameters() if p.dim() != 3 and not n.startswith(router + ".")]
    if len(stacked) != 2 or others or any(True for _ in block.buffers()):
        raise NotSwappable("block_state_unused", f"expert-parallel block: expected two [L={L}, ., .] expert "
                                                 f"weights and the router only; found {[n for n, _ in stacked]}, "
                                                 f"other parameters {others}")
    (up_name, up), (down_name, down) = stacked
    if _DOWN_NAME.search(up_name.rpartition(".")[2]):
        (up_name, up), (down_name, down) = (down_name, down), (up_name, up)

    def orientation(shape: torch.Size, out_hidden: bool) -> bool | None:
        """Whether a ``[L, a, b]`` weight is stored ``x @ w`` (``[L, in, out]``); None when both sides are ``H``."""
        a, b = shape[1], shape[2]
        if a == b == hidden:
            return None
        if hidden not in (a, b):
            raise NotSwappable("unknown_expert_mlp", f"expert weight of shape {list(shape)} has no side of the "
                                                     f"hidden size {hidden}")
        return (b == hidden) == out_hidden

    # a square weight (H = N, or H = I) is read as stored like the other one; the probe checks the reading
    up_t, down_t = orientation(up.shape, False), orientation(down.shape, True)
    if up_t is None:
        up_t = bool(down_t)
    if down_t is None:
        down_t = up_t
    N = up.shape[2] if up_t else up.shape[1]
    inter = down.shape[1] if down_t else down.shape[2]
    if N not in (inter, 2 * inter):
        raise NotSwappable("unknown_expert_mlp", f"up weight {list(up.shape)} and down {list(down.shape)} are not "
                                                 "an MLP's (N = I or 2I)")
    return _EPPlan(group, world, E, top_k, hidden, router, up_name, down_name, up_t, down_t, gated=N == 2 * inter,
                   act=_act_of(block))


def _candidates(plan: _EPPlan) -> list[dict[str, Any]]:
    acts = {plan.act_name: plan.act} if plan.act is not None else ACT_CANDIDATES
    firsts = (True, False) if plan.gated else (True,)
    return [dict(weights_before=before, gate_weights=weights, act_name=name, act=act, gate_first=first)
            for before in (False, True) for weights in GATE_WEIGHTS for name, act in acts.items() for first in firsts]


def _reduce_max(values: list[float], plan: _EPPlan, device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=plan.group)
    return t.tolist()


def _captured_whole(block: nn.Module, x: Tensor) -> bool:
    """Whether Dynamo captures ``block.forward`` on ``x`` in one graph with moe_compile's flags: the graph pass
    ``expert_parallel`` then rewrites it, with its step-by-step proof, rather than the probe's evidence. A
    ``fullgraph`` trace raises at the first break before it runs anything, so every rank runs the same collectives
    (none, or the captured graph's). It traces a copy of the forward under another code name: Dynamo keys its cache
    and its shape history by code (a later compile of the forward itself would reuse this trace's entry, or take the
    probe's token count for a changing one and compile it dynamic)."""
    func = getattr(block.forward, "__func__", None)
    if not isinstance(func, types.FunctionType):  # a forward that is no method of its class: try the swap
        return False
    code = func.__code__.replace(co_name=f"{func.__code__.co_name}_moe_compile_capture_check")
    copy = types.FunctionType(code, func.__globals__, code.co_name, func.__defaults__, func.__closure__)
    traced = torch.compile(types.MethodType(copy, block), backend="eager", fullgraph=True)
    try:
        with torch._dynamo.config.patch(CAPTURE_FLAGS), torch.no_grad():
            traced(x)
    except Exception:  # noqa: BLE001 - a graph break, or anything Dynamo cannot trace
        return False
    return True


# probe tokens: 4x the single-GPU swap's. A router whose top-k picks among probabilities rounded to bf16 breaks ties
# by expert id, one that picks among fp32 ones does not: a probe tells the two apart only on the tokens whose k-th
# and (k+1)-th probabilities round alike (tests/models/test_ep.py's layer at H 32: 256 tokens had none on either rank)
_PROBE_REPEATS = 4


def _more_tokens(x: Tensor) -> Tensor:
    gen = torch.Generator(device="cpu").manual_seed(2)
    more = [torch.randn(x.shape, generator=gen).to(device=x.device, dtype=x.dtype) for _ in range(_PROBE_REPEATS - 1)]
    return torch.cat([x, *more], dim=0)


@contextlib.contextmanager
def _unsharded(owner: nn.Module | None) -> Iterator[None]:
    """FSDP2's unsharded parameters on ``owner`` (the ``fully_shard`` module whose parameters include the block's)
    while the probe runs the block's forward itself, past the hooks that unshard them in a step. ``unshard`` and
    ``reshard`` are collectives over the data-parallel group: every rank swaps the same blocks, in the same order."""
    if owner is None:
        yield
        return
    owner.unshard()
    try:
        yield
    finally:
        owner.reshard()


def swap_ep_block(block: nn.Module, group: dist.ProcessGroup, capacity_factor: float | None = None,
                  fsdp_owner: nn.Module | None = None) -> str | None:
    """Swap ``block``'s forward to :func:`ep_experts_forward` (module docstring) and describe it; ``None`` for a block
    Dynamo captures whole (left to the graph pass). Every rank of ``group`` must call it at once. The probe compares
    at the bound; the swapped forward then sends ``capacity_factor``'s rows (``ep_experts_forward``). Under FSDP2,
    ``fsdp_owner`` is the ``fully_shard`` module that holds the block's parameters (the block or an ancestor): the
    probe runs on its unsharded parameters. Raises :class:`NotSwappable` (on every rank) and leaves the block
    unchanged."""
    with _unsharded(fsdp_owner):
        return _swap_ep_block(block, group, capacity_factor)


def _swap_ep_block(block: nn.Module, group: dist.ProcessGroup, capacity_factor: float | None) -> str | None:
    plan = _plan_ep_block(block, group)
    weight = block.get_parameter(plan.up)
    if weight.dtype not in SUPPORTED_DTYPES:
        raise NotSwappable("dtype", f"{weight.dtype} (supported: bf16, fp16, fp32)")
    device = weight.device
    was_training = [m.training for m in block.modules()]
    block.eval()
    try:
        # tokens first, on the device (NOTE [probe shapes on a GPU] (moe_compile/experts/_probe.py)): collectives
        x = _more_tokens(probe_input(block, plan.hidden, weight.dtype, device, TOKENS_FIRST, cpu_first=False))
        if _captured_whole(block, x):
            return None
        with torch.no_grad():
            want = outputs(block.forward(x))[0]

        def error_of(candidate: dict[str, Any]) -> float:
            plan.take(candidate)
            with torch.no_grad():
                return row_mismatch(_ep_forward(block, plan, x), want)

        def failures_of(candidate: dict[str, Any]) -> list[NotSwappable]:
            block.eval()
            plan.take(candidate)
            return list(verification_failures(block, lambda: row_mismatch(
                _ep_forward(block, plan, x), outputs(block.forward(x))[0]), lambda t: _ep_forward(block, plan, t), x))

        # every rank ranks and verifies the same candidates, in the same order: each runs the same collectives.
        # A refusal raised before a candidate's collectives is the same on every rank: a mismatch, not a raise.
        ranked = ranked_candidates(_candidates(plan), error_of, refusals_propagate=False, where=" on every rank",
                                   agree=lambda errors: _reduce_max(errors, plan, device))
        first_verified(ranked, failures_of, agree=lambda failed: bool(_reduce_max([float(failed)], plan, device)[0]))
    finally:
        for m, t in zip(block.modules(), was_training):
            m.training = t
    block._moe_compile_original_forward = block.forward
    plan.capacity_factor = capacity_factor
    block._moe_compile_ep_plan = plan
    block.forward = types.MethodType(_swapped_ep_forward, block)
    L = plan.num_experts // plan.world
    return (f"expert-parallel over {plan.world} ranks ({L} of {plan.num_experts} experts here, "
            f"{'gated' if plan.gated else 'plain'} {plan.up}/{plan.down}, activation {plan.act_name or 'its own'}, "
            f"weights {'before' if plan.weights_before else 'after'} the MLP, {plan.gate_weights}): permute_pad -> "
            f"all_to_all of a static [W*S, H] buffer ({_capacity_words(capacity_factor)}) -> grouped GEMMs at "
            f"device offsets -> all_to_all back -> unpad_unpermute; no host read")


def _is_fsdp2(module: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - a torch without FSDP2
        return False
    return isinstance(module, FSDPModule)


def _capacity_words(factor: float | None) -> str:
    if factor is None:
        return "S = T * min(K, L), nothing dropped"
    return f"S = ceil({factor:g} * T * K / W), rows past S per destination dropped"


def swap_ep_blocks(model: nn.Module, capacity_factor: float | None = None) -> list[tuple[str, str, str, str]]:
    """Swap every expert-parallel block of ``model`` that :func:`swap_ep_block` accepts; explain records as
    :func:`moe_compile.experts.swap.swap_expert_loops` returns them. Every rank must call it on the same model."""
    records = []
    owners: dict[str, nn.Module | None] = {}  # module name -> the fully_shard module holding its parameters
    for name, block in model.named_modules():
        owners[name] = block if _is_fsdp2(block) else owners.get(name.rpartition(".")[0]) if name else None
        group = process_group_of(block)
        if group is None:
            continue
        if getattr(block, "_moe_compile_original_forward", None) is not None:
            if hasattr(block, "_moe_compile_ep_plan"):  # swapped by an earlier compile: its capacity is this one's
                block._moe_compile_ep_plan.capacity_factor = capacity_factor
            continue
        try:
            detail = swap_ep_block(block, group, capacity_factor, owners[name])
        except NotSwappable as why:
            records.append((name or "<root>", "skip", why.tag, why.detail))
            continue
        if detail is not None:
            records.append((name or "<root>", "rewrite", "expert_loop_swapped", detail))
    return records


# ===== transformers' expert parallelism =====

HF_EP_IMPLEMENTATION = "moe_compile"


def hf_ep_unsupported_reason(experts: nn.Module, tp_size: int) -> str | None:
    """Why transformers' expert-parallel ``experts`` module cannot run through :func:`ep_experts_forward`."""
    if tp_size > 1:
        return f"tensor parallelism: tp_size {tp_size} (the ranks of a TP group share a batch; only tp_size 1)"
    if not hasattr(experts, "has_gate") or not hasattr(experts, "down_proj"):
        return "not_hf_experts: no has_gate / down_proj attributes"
    if getattr(experts, "has_bias", False) or getattr(experts, "has_post_expert_norm", False):
        return "expert biases or a post-expert norm"
    return None


def _hf_ep_forward(experts: nn.Module, ep_mesh: Any, hidden_states: Tensor, top_k_index: Tensor,
                   top_k_weights: Tensor, capacity_factor: float | None) -> Tensor:
    """transformers' expert-parallel experts call (its ``EpDispatchExpertsParallel`` hands this rank's tokens, their
    global top-k ids and weights, with the experts' local shards as plain tensors) through the static exchange."""
    up = hf_projection(experts, "gate_up_proj" if experts.has_gate else "up_proj")
    middle = experts._apply_gate if experts.has_gate else experts.act_fn
    return ep_experts_forward(hidden_states, top_k_index, top_k_weights, up, middle,
                              hf_projection(experts, "down_proj"), num_experts=experts.num_experts * ep_mesh.size(),
                              group=ep_mesh.get_group(), capacity_factor=capacity_factor)


def register_hf_expert_parallel() -> bool:
    """Register ``"moe_compile"`` as transformers' expert-parallel implementation
    (``DistributedConfig(ep_size=W, ep_implementation="moe_compile")``): its experts modules then exchange their
    tokens through :func:`ep_experts_forward` (no split size read to the host, no atomics) instead of
    ``AllToAllEP`` (``.tolist()`` of the split sizes every layer, counts by ``scatter_add_``). Returns False where
    transformers has no ``EPImplementationInterface`` (before 5.21)."""
    try:
        from transformers.distributed.expert_parallel import EPImplementation, EPImplementationInterface
    except Exception:  # noqa: BLE001 - transformers is optional, and older releases have no EP interface
        return False
    if HF_EP_IMPLEMENTATION in EPImplementationInterface():
        return True

    class MoeCompileEP(EPImplementation):
        """:func:`ep_experts_forward` for transformers' experts modules; raises ``ValueError`` naming what it does
        not support (:func:`hf_ep_unsupported_reason`) when the plan is applied."""

        def __init__(self, experts: nn.Module, ep_mesh: Any, tp_mesh: Any):
            super().__init__(experts, ep_mesh, tp_mesh)
            reason = hf_ep_unsupported_reason(experts, tp_mesh.size())
            if reason is not None:
                raise ValueError(f"ep_implementation={HF_EP_IMPLEMENTATION!r}: {type(experts).__name__}: {reason}")
            self.experts = experts
            self.capacity_factor: float | None = None  # moe_compile.compile's ep_capacity_factor

        def __call__(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
            return _hf_ep_forward(self.experts, self.ep_mesh, hidden_states, top_k_index, top_k_weights,
                                  self.capacity_factor)

    EPImplementationInterface.register(HF_EP_IMPLEMENTATION, MoeCompileEP)
    return True


def _implementation_cell(experts: nn.Module) -> Any:
    """The closure cell holding the ``EPImplementation`` that transformers' installed forward of ``experts`` calls
    (``EpDispatchExpertsParallel.install_forward``), or None."""
    forward = experts.__dict__.get("forward")
    cells = dict(zip(getattr(getattr(forward, "__code__", None), "co_freevars", ()),
                     getattr(forward, "__closure__", None) or ()))
    return cells.get("implementation")


def hf_ep_implementation(experts: nn.Module) -> Any:
    """The ``EPImplementation`` transformers' expert-parallel ``experts`` module calls, or None."""
    cell = _implementation_cell(experts)
    return cell.cell_contents if cell is not None else None


def use_hf_expert_parallel(model: nn.Module, capacity_factor: float | None = None
                           ) -> list[tuple[str, str, str, str]]:
    """Point every experts module of ``model`` that transformers made expert-parallel with its ``all_to_all`` (or
    ``auto``) implementation to ``"moe_compile"`` (:func:`register_hf_expert_parallel`): the implementation object
    the installed forward calls is replaced, the plan (sharded weights, meshes) is kept. Returns explain records
    ``(module name, kind, tag, detail)``; a module left alone gets a skip with the reason."""
    records: list[tuple[str, str, str, str]] = []
    modules = [(n, m) for n, m in model.named_modules() if getattr(m, "_is_expert_parallel", False)]
    if not modules or not register_hf_expert_parallel():
        return records
    from transformers.distributed.expert_parallel import AllToAllEP, AutoEP, EPImplementationInterface

    ours = EPImplementationInterface()[HF_EP_IMPLEMENTATION]
    for name, module in modules:
        cell = _implementation_cell(module)
        if cell is None:  # not transformers' installed forward: the experts interface gives the reason
            continue
        implementation = cell.cell_contents
        module._moe_compile_ep_implementation = True  # recorded here: the experts interface leaves it alone
        if isinstance(implementation, ours):
            implementation.capacity_factor = capacity_factor
            continue
        if type(implementation) not in (AllToAllEP, AutoEP):
            records.append((name, "skip", "ep_implementation_unknown",
                            f"expert parallelism by {type(implementation).__name__}: left as it is"))
            continue
        reason = hf_ep_unsupported_reason(module, implementation.tp_mesh.size())
        if reason is None and getattr(implementation, "megamoe", None) is not None:
            reason = "DeepGEMM Mega MoE experts"
        if reason is not None:
            records.append((name, "skip", "ep_unsupported", f"{type(implementation).__name__} kept: {reason}"))
            continue
        cell.cell_contents = ours(module, implementation.ep_mesh, implementation.tp_mesh)
        cell.cell_contents.capacity_factor = capacity_factor
        records.append((name, "rewrite", f"ep_implementation={type(implementation).__name__}",
                        f"transformers expert parallelism over {implementation.ep_mesh.size()} ranks: "
                        f"permute_pad -> all_to_all of a static [W*S, H] buffer ({_capacity_words(capacity_factor)}) "
                        "-> grouped GEMMs at device offsets -> all_to_all back -> unpad_unpermute; no host read"))
    return records


__all__ = ["HF_EP_IMPLEMENTATION", "ep_experts_forward", "hf_ep_implementation", "hf_ep_unsupported_reason",
           "process_group_of",
           "register_hf_expert_parallel", "swap_ep_block", "swap_ep_blocks", "use_hf_expert_parallel"]
