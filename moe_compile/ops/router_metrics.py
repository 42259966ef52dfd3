"""``torch.ops.moe.router_metrics_``: accumulate one router's load-balancing statistics on the device.

One call per MoE layer per forward adds a fixed-size row of statistics into a preallocated accumulator
``acc_S`` (float64, ``S = NUM_STATS + E``): no host sync, no allocation that outlives the call, no
data-dependent shape, so it is safe inside CUDA graphs. The statistics are computed on detached,
fp32 copies of the router logits and never touch the model's outputs or gradients.

Accumulator layout (indices into ``acc_S``; :data:`STATS` names the first ``NUM_STATS``):

=====  ======================  ================================================================
slot   name                    added per call (``T`` tokens, ``K`` top-k, ``E`` experts)
=====  ======================  ================================================================
0      ``steps``               1
1      ``tokens``              ``T``
2      ``lb_loss``             ``E * sum_e f_e * P_e`` with ``f_e = count_e / T`` and
                               ``P_e = mean_t softmax(logits_t)_e`` (transformers'
                               ``load_balancing_loss_func`` on one layer; ``K`` when balanced)
3      ``z_loss``              ``mean_t logsumexp(logits_t)^2`` (ST-MoE router z-loss)
4      ``entropy``             ``mean_t H(softmax(logits_t))`` in nats
5      ``max_over_mean_load``  ``max_e count_e / mean_e count_e`` (1 when perfectly balanced)
6      ``over_capacity``       fraction of the ``T*K`` assignments beyond each expert's capacity
                               ``ceil(capacity_factor * T*K / E)`` (0 without a capacity); with
                               ``capacity_group = g``, beyond the capacity ``ceil(capacity_factor * T*K
                               / (E/g))`` of each block of ``g`` consecutive experts (an expert-parallel
                               destination rank's experts, whose rows share one static buffer)
7      ``invalid_ids``         assignments whose expert id is outside ``[0, E)``: ``T*K - sum_e count_e``
                               (``moe.permute_pad`` drops them and poisons their tokens with NaN,
                               NOTE [dropped entries] (moe_compile/ops/permute_pad.py); this is the
                               count, per layer, without a host sync)
8...   ``tokens_per_expert``   ``count_e``: assignments of expert ``e`` (ids outside ``[0, E)``,
                               e.g. non-local experts under expert parallelism, are not counted)
=====  ======================  ================================================================

The op is ``CompositeImplicitAutograd``: eager runs the PyTorch body below, and under
``torch.compile`` AOTAutograd decomposes it into ATen ops that Inductor fuses (Triton on CUDA, C++ on
CPU); the in-place add into ``acc_S`` becomes a mutation of a graph input that Inductor writes in place.
"""

from __future__ import annotations

import torch

STATS = ("steps", "tokens", "lb_loss", "z_loss", "entropy", "max_over_mean_load", "over_capacity", "invalid_ids")
NUM_STATS = len(STATS)
ACC_DTYPE = torch.float64

_LIB = torch.library.Library("moe", "FRAGMENT")
_LIB.define(
    "router_metrics_(Tensor(a!) acc_S, Tensor logits, Tensor expert_idx, float capacity_factor=0.0, "
    "int capacity_group=1) -> ()"
)


def router_stats(
    logits: torch.Tensor, expert_idx: torch.Tensor, capacity_factor: float = 0.0, capacity_group: int = 1
) -> torch.Tensor:
    """The row that one call adds to the accumulator: float32 ``[NUM_STATS + E]`` (see the module doc).

    Args:
        logits: router logits ``[..., E]``, any float dtype (cast to fp32, detached).
        expert_idx: chosen experts ``[..., K]`` of the same leading size, integer dtype.
        capacity_factor: expert capacity as a multiple of the balanced load ``T*K/E``; ``<= 0`` for none.
        capacity_group: experts per capacity block (``E`` divisible by it): the capacity bounds each block's
            summed count, ``capacity_factor`` a multiple of the block's balanced load ``T*K / (E/g)``.
    """
    E = logits.shape[-1]
    with torch.no_grad():
        logits_TE = logits.detach().reshape(-1, E).float()
        idx_N = expert_idx.detach().reshape(-1)
        T, N = logits_TE.shape[0], idx_N.shape[0]
        tokens = logits_TE.new_full((), T)
        assignments = logits_TE.new_full((), N)
        lse_T = torch.logsumexp(logits_TE, dim=-1)
        probs_TE = torch.softmax(logits_TE, dim=-1)
        # clamp: an empty batch adds zeros instead of NaNs
        per_token = 1.0 / tokens.clamp_min(1.0)
        z_loss = lse_T.square().sum() * per_token
        entropy = torch.special.entr(probs_TE).sum() * per_token
        prob_E = probs_TE.sum(dim=0) * per_token
        counts_E = _count_experts(idx_N, E)
        lb_loss = E * (counts_E * prob_E).sum() * per_token
        routed = counts_E.sum()
        max_over_mean = counts_E.max() * E / routed.clamp_min(1.0)
        if capacity_factor > 0:
            blocks = E // capacity_group
            capacity = torch.ceil(assignments * (capacity_factor / blocks))
            per_block = counts_E.view(blocks, capacity_group).sum(1)
            over = (per_block - capacity).clamp_min(0.0).sum() / assignments.clamp_min(1.0)
        else:
            over = torch.zeros_like(routed)
        invalid = assignments - routed
        head = torch.stack([torch.ones_like(tokens), tokens, lb_loss, z_loss, entropy, max_over_mean, over, invalid])
        return torch.cat([head, counts_E])


def _count_experts(idx_N: torch.Tensor, E: int) -> torch.Tensor:
    """fp32 ``[E]`` assignment counts; ids outside ``[0, E)`` are ignored. Sync-free and deterministic:
    ``histc`` with fixed bounds (int input on CUDA, where float input is non-deterministic; float on
    CPU, which only supports float), like transformers' aux loss."""
    valid = (idx_N >= 0) & (idx_N < E)
    on_cpu = idx_N.device.type in ("cpu", "mps")
    ids = torch.where(valid, idx_N, -1).to(torch.float32 if on_cpu else torch.int32)
    return torch.histc(ids, bins=E, min=0, max=E).float()


def _router_metrics_(
    acc_S: torch.Tensor,
    logits: torch.Tensor,
    expert_idx: torch.Tensor,
    capacity_factor: float = 0.0,
    capacity_group: int = 1,
) -> None:
    stats = router_stats(logits, expert_idx, capacity_factor, capacity_group)
    with torch.no_grad():
        acc_S.add_(stats.to(acc_S.dtype))


_LIB.impl("router_metrics_", _router_metrics_, "CompositeImplicitAutograd")


def new_accumulator(num_experts: int, device: torch.device | str) -> torch.Tensor:
    """A zeroed accumulator for one layer (float64 ``[NUM_STATS + num_experts]``)."""
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    return torch.zeros(NUM_STATS + num_experts, dtype=ACC_DTYPE, device=device)


def router_metrics_(
    acc_S: torch.Tensor,
    logits: torch.Tensor,
    expert_idx: torch.Tensor,
    capacity_factor: float = 0.0,
    capacity_group: int = 1,
) -> None:
    """Add one router call's statistics into ``acc_S`` in place (``torch.ops.moe.router_metrics_``).

    Expert ids outside ``[0, E)`` are not an error: they are counted as ``invalid_ids`` (and in no expert).
    """
    for name, t in (("acc_S", acc_S), ("logits", logits), ("expert_idx", expert_idx)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if logits.dim() < 1 or not logits.is_floating_point():
        raise ValueError(f"logits must be a float tensor [..., E], got {logits.dtype} {tuple(logits.shape)}")
    E = logits.shape[-1]
    if acc_S.dim() != 1 or acc_S.shape[0] != NUM_STATS + E:
        raise ValueError(f"acc_S must have shape [{NUM_STATS + E}] for E={E} experts, got {tuple(acc_S.shape)}")
    if not acc_S.is_floating_point():
        raise ValueError(f"acc_S must have a float dtype (float64 from new_accumulator), got {acc_S.dtype}")
    if expert_idx.is_floating_point() or expert_idx.is_complex() or expert_idx.dtype == torch.bool:
        raise TypeError(f"expert_idx must be an integer tensor, got {expert_idx.dtype}")
    if expert_idx.dim() < 1 or expert_idx.shape[:-1].numel() != logits.shape[:-1].numel():
        raise ValueError(f"expert_idx must be [..., K] with one row per token of logits: "
                         f"expert_idx.shape={tuple(expert_idx.shape)}, logits.shape={tuple(logits.shape)}")
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) \
            or capacity_factor != capacity_factor:
        raise ValueError(f"capacity_factor must be a number (<= 0 for none), got {capacity_factor!r}")
    if isinstance(capacity_group, bool) or not isinstance(capacity_group, int) or capacity_group < 1 \
            or E % capacity_group:
        raise ValueError(f"capacity_group must be a positive int dividing E={E}, got {capacity_group!r}")
    devices = {t.device for t in (acc_S, logits, expert_idx)}
    if len(devices) > 1:
        raise ValueError(f"acc_S, logits and expert_idx must be on one device, got {sorted(map(str, devices))}")
    torch.ops.moe.router_metrics_(acc_S, logits, expert_idx, float(capacity_factor), capacity_group)
