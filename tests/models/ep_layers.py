"""Expert-parallel MoE layers written the way public code writes them (issue: expert parallelism without host syncs).

Each rank holds ``E / world`` experts; every layer sends each routed row to the rank that holds its expert and back.

* :class:`TitanStyleEP`: torchtitan's ``ExpertParallel`` shape. Counts per expert exchanged with the functional
  ``all_to_all_single`` (a Dynamo-traceable collective), split sizes read to the host (``.tolist()``), rows exchanged
  with ``all_to_all_single_autograd`` at those splits, regrouped from (source rank, local expert) to (local expert,
  source rank) order, stacked local experts by ``torch._grouped_mm``, and the inverse on the way back.
* :class:`AutogradAllToAllEP`: the Megatron / DeepSpeed shape. ``dist.all_to_all_single`` into a buffer the host
  sized, inside an ``autograd.Function`` whose backward is the reverse exchange; experts as a host loop over
  ``torch.split`` chunks, combine by ``index_add_``.
* :class:`AutogradExchangeGroupedEP`: that exchange with the experts as ``torch._grouped_mm`` (Megatron's
  ``GroupedMLP``): Dynamo traces the function (an ``autograd_function_apply``), no graph break.

Both take ``x [T, H]`` and return ``[T, H]``; softmax top-k routing, weights applied at the combine. Sizes divisible
by 4 (``torch._grouped_mm`` on CPU wants 16-byte strides in fp32).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn


class _ExpertParallelBase(nn.Module):
    def __init__(self, hidden: int, inter: int, experts: int, top_k: int, group: dist.ProcessGroup | None = None):
        super().__init__()
        self.group = group if group is not None else dist.group.WORLD
        self.world = dist.get_world_size(self.group)
        if experts % self.world:
            raise ValueError(f"experts={experts} must be divisible by the world size {self.world}")
        self.experts, self.local, self.top_k = experts, experts // self.world, top_k
        self.router = nn.Linear(hidden, experts, bias=False)
        self.w_gate_up = nn.Parameter(torch.randn(self.local, hidden, 2 * inter) * hidden**-0.5)
        self.w_down = nn.Parameter(torch.randn(self.local, inter, hidden) * inter**-0.5)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(weights [T, K], order [T*K], counts [E], rows [T*K, H])``: rows sorted by global expert, so grouped by
        destination rank, then local expert."""
        weights, ids = self.router(x).softmax(-1).topk(self.top_k, dim=-1)
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.experts)
        return weights, order, counts, x[order // self.top_k]

    def combine(self, returned: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Rows back in (token, choice) order, weighted and summed over the choices."""
        T, K = weights.shape
        unsorted = torch.zeros_like(returned).index_copy(0, order, returned)
        return (unsorted.view(T, K, -1) * weights[..., None].to(returned.dtype)).sum(1)


class TitanStyleEP(_ExpertParallelBase):
    exchange = staticmethod(funcol.all_to_all_single_autograd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, order, counts, rows = self.route(x)
        counts_recv = funcol.all_to_all_single(counts, None, None, self.group)
        counts_recv = funcol.wait_tensor(counts_recv)
        by_src = counts_recv.view(self.world, self.local)  # [source rank, local expert]
        input_splits = counts.view(self.world, self.local).sum(1).tolist()
        output_splits = by_src.sum(1).tolist()
        recv = self.exchange(rows, output_splits, input_splits, self.group)
        # regroup: received segments are (source, expert)-major; the experts want (expert, source)-major
        seg_counts = by_src.t().flatten()
        seg_starts = (by_src.flatten().cumsum(0) - by_src.flatten()).view(self.world, self.local).t().flatten()
        total = sum(output_splits)
        seg = torch.repeat_interleave(torch.arange(seg_counts.numel(), device=x.device), seg_counts, output_size=total)
        within = torch.arange(total, device=x.device) - (seg_counts.cumsum(0) - seg_counts)[seg]
        perm = seg_starts[seg] + within
        offs = by_src.sum(0).cumsum(0).to(torch.int32)
        gate, up = torch._grouped_mm(recv[perm], self.w_gate_up, offs=offs).chunk(2, dim=-1)
        out = torch._grouped_mm(F.silu(gate) * up, self.w_down, offs=offs)
        back = torch.zeros_like(out).index_copy(0, perm, out)
        returned = self.exchange(back, input_splits, output_splits, self.group)
        return self.combine(returned, order, weights)


class _WaitOnUse(torch.autograd.Function):
    """torch <= 2.11's ``_FromTorchTensor``: the collective's result waited on when traced, gradient unchanged."""

    @staticmethod
    def forward(ctx, tensor):
        return funcol.wait_tensor(tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad


def all_to_all_single_autograd_211(rows, output_splits, input_splits, group):
    """``funcol.all_to_all_single_autograd`` as torch 2.11 writes it (the device machines' torch): the autograd
    collective op, then an autograd function that waits; torch 2.13's is the plain op (autograd built in) + a wait."""
    group_name = funcol._resolve_group_name(group)
    out = torch.ops._c10d_functional_autograd.all_to_all_single(rows, output_splits, input_splits, group_name)
    return _WaitOnUse.apply(out)


class TitanStyleEP211(TitanStyleEP):
    """:class:`TitanStyleEP` with torch 2.11's spelling of the autograd all-to-all (whatever torch runs the test)."""

    exchange = staticmethod(all_to_all_single_autograd_211)


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` into a buffer of ``sum(output_splits)`` rows; backward: the reverse exchange."""

    @staticmethod
    def forward(ctx, rows, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = rows.new_empty(sum(output_splits), rows.shape[1])
        dist.all_to_all_single(out, rows.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        back = grad.new_empty(sum(input_splits), grad.shape[1])
        dist.all_to_all_single(back, grad.contiguous(), input_splits, output_splits, group=ctx.group)
        return back, None, None, None


class AutogradAllToAllEP(_ExpertParallelBase):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, order, counts, rows = self.route(x)
        counts_recv = torch.empty_like(counts)
        dist.all_to_all_single(counts_recv, counts, group=self.group)
        by_src = counts_recv.view(self.world, self.local)
        input_splits = counts.view(self.world, self.local).sum(1).tolist()
        output_splits = by_src.sum(1).tolist()
        recv = _AllToAll.apply(rows, output_splits, input_splits, self.group)
        # experts over host-sized chunks: each (source, expert) segment of the received rows
        out = torch.zeros_like(recv)
        start = 0
        for size, expert in zip(by_src.flatten().tolist(), list(range(self.local)) * self.world):
            if size:
                chunk = recv[start:start + size]
                gate, up = (chunk @ self.w_gate_up[expert]).chunk(2, dim=-1)
                idx = torch.arange(start, start + size, device=x.device)
                out = out.index_add(0, idx, (F.silu(gate) * up) @ self.w_down[expert])
            start += size
        returned = _AllToAll.apply(out, input_splits, output_splits, self.group)
        return self.combine(returned, order, weights)


def _autograd_exchange(rows, output_splits, input_splits, group):
    return _AllToAll.apply(rows, output_splits, input_splits, group)


class AutogradExchangeGroupedEP(TitanStyleEP):
    """Megatron's shape with grouped experts: the rows exchanged by the ``autograd.Function`` around
    ``dist.all_to_all_single`` (Megatron's ``_AllToAll``), the experts by ``torch._grouped_mm`` (its ``GroupedMLP``)."""

    exchange = staticmethod(_autograd_exchange)


EP_LAYERS = {"titan": TitanStyleEP, "titan_211": TitanStyleEP211, "autograd_all_to_all": AutogradAllToAllEP,
             "autograd_grouped": AutogradExchangeGroupedEP}
