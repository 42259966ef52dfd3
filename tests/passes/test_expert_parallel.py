"""``expert_parallel`` on Dynamo's graphs of expert-parallel layers, in one process over a fake process group: what it
rewrites (no host read left) and what it refuses, with which tag. The graphs are captured, passed and never run
(a fake group moves no data); ``tests/models/test_ep.py`` runs the rewrite on 2 gloo ranks against eager."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from moe_compile.config import make_config
from moe_compile.passes import PassContext, expert_parallel
from moe_compile.passes._graph import op_name
from moe_compile.passes._host_sync import host_reads
from moe_compile.passes._validate import _is_collective
from tests.models.ep_layers import TitanStyleEP


class _Variant(TitanStyleEP):
    """torchtitan's layer with one step swapped for a wrong one (``mistake``)."""

    mistake = ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, order, counts, rows = self.route(x)
        counts_recv = funcol.wait_tensor(funcol.all_to_all_single(counts, None, None, self.group))
        by_src = counts_recv.view(self.world, self.local)
        input_splits = counts.view(self.world, self.local).sum(1).tolist()
        output_splits = by_src.sum(1).tolist()
        recv = self.exchange(rows, output_splits, input_splits, self.group)
        seg_counts = by_src.t().flatten()
        seg_starts = (by_src.flatten().cumsum(0) - by_src.flatten()).view(self.world, self.local).t().flatten()
        total = sum(output_splits)
        seg = torch.repeat_interleave(torch.arange(seg_counts.numel()), seg_counts, output_size=total)
        within = torch.arange(total) - (seg_counts.cumsum(0) - seg_counts)[seg]
        perm = seg_starts[seg] + within
        if self.mistake == "no_regroup":
            perm = torch.arange(total)
        offs = (by_src[0] if self.mistake == "offsets" else by_src.sum(0)).cumsum(0).to(torch.int32)
        hidden = recv[perm]
        if self.mistake == "mixes_rows":
            hidden = hidden - hidden.mean(0)
        elif self.mistake == "host_size":
            hidden = hidden.view(total, -1)
        gate, up = torch._grouped_mm(hidden, self.w_gate_up, offs=offs).chunk(2, dim=-1)
        out = torch._grouped_mm(F.silu(gate) * up, self.w_down, offs=offs)
        if self.mistake == "inverse":
            back = out[perm.argsort()]
        elif self.mistake == "setitem":  # no mistake: the other spelling of the un-regroup
            back = torch.zeros_like(out)
            back[perm] = out
        else:
            back = torch.zeros_like(out).index_copy(0, perm, out)
        returned = self.exchange(back, input_splits, output_splits, self.group)
        return self.combine(returned, order, weights)


def _pass(layer: torch.nn.Module, factor: float | None = None, out_shape: tuple[int, ...] = (24, 32),
          ) -> tuple[PassContext, torch.fx.Graph]:
    """Capture ``layer``'s graph, run ``expert_parallel`` on it; the compiled function returns zeros."""
    seen = {}

    def backend(gm, example_inputs):
        ctx = PassContext(make_config(ep_capacity_factor=factor), "pre_grad", "expert_parallel", is_training=True)
        expert_parallel.run(gm.graph, ctx)
        gm.graph.lint()
        seen.update(ctx=ctx, graph=gm.graph)
        return lambda *args: (torch.zeros(out_shape, dtype=torch.bfloat16),)

    torch._dynamo.reset()
    x = torch.randn(24, 32, dtype=torch.bfloat16, requires_grad=True)
    torch.compile(layer, backend=backend, fullgraph=True)(x)
    return seen["ctx"], seen["graph"]


def _layer(mistake: str = "", experts: int = 8, top_k: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    layer = _Variant(hidden=32, inter=16, experts=experts, top_k=top_k)
    layer.mistake = mistake
    return layer.to(torch.bfloat16)


def _records(ctx: PassContext) -> list[tuple[str, str]]:
    return [(r.kind, r.what if r.kind == "skip" else "") for r in ctx.records]


@pytest.mark.parametrize("spelling", ["", "setitem"])
def test_titan_layer_is_rewritten_without_host_reads(fake_group, spelling):
    ctx, graph = _pass(_layer(spelling))
    assert _records(ctx) == [("rewrite", "")]
    assert not host_reads(graph), [r.item.name for r in host_reads(graph).values()]
    names = [op_name(n) for n in graph.nodes]
    assert names.count("_c10d_functional.all_to_all_single") == 3  # counts + the padded pair
    # validation sees them (Dynamo records funcol calls as OpOverloadPackets) and does not run the graph
    collectives = [op_name(n) for n in graph.nodes if _is_collective(n)]
    assert collectives.count("_c10d_functional.all_to_all_single") == 3 and len(collectives) >= 6  # and waits
    assert "bincount" not in names and "searchsorted" in names  # counts of static length
    assert names.count("moe.gather_rows") == 4
    assert "repeat_interleave" not in names and "setitem" not in names
    assert names.count("index_copy") == 1  # the combine's un-sort stays
    assert "equal splits [48]*2" in ctx.records[0].detail and "6144 bytes" in ctx.records[0].detail


@pytest.mark.parametrize("factor,S", [(0.25, 6), (1.0, 24), (10.0, 48), (0.001, 1)])
def test_capacity_factor(fake_group, factor, S):
    ctx, _ = _pass(_layer(), factor)
    assert f"(S={S}," in ctx.records[0].detail and ("no row dropped" in ctx.records[0].detail) == (S == 48)


def test_bound_from_distinct_top_k(fake_group):
    """8 experts on 2 ranks (L=4), top-6: a token sends at most 4 rows to one rank, so S = 24 * 4 < N = 144."""
    ctx, _ = _pass(_layer(top_k=6))
    assert "(S=96," in ctx.records[0].detail and "T*min(K, L)=96" in ctx.records[0].detail


@pytest.mark.parametrize("mistake,tag", [
    ("mixes_rows", "region_not_rowwise"),
    ("host_size", "region_not_rowwise"),
    ("no_regroup", "regroup_not_matched"),
    ("offsets", "offsets_not_matched"),
    ("inverse", "inverse_not_matched"),
])
def test_refusals(fake_group, mistake, tag):
    ctx, graph = _pass(_layer(mistake))
    assert _records(ctx) == [("skip", tag)], [(r.what, r.detail) for r in ctx.records]
    assert host_reads(graph)  # left alone


def test_two_layers_in_one_graph(fake_group):
    """Each exchange pair is proven and rewritten on its own; no host read is left. (Stacked, the layers do not
    capture: the first one's output has a data-dependent width, from ``view(T, K, -1)`` of the returned rows.)"""

    class Both(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = _layer(), _layer()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.first(x).sum() + self.second(x).sum()

    ctx, graph = _pass(Both(), out_shape=())
    assert _records(ctx) == [("rewrite", ""), ("rewrite", "")]
    assert not host_reads(graph)
    assert [op_name(n) for n in graph.nodes].count("moe.gather_rows") == 8


class _Exchange(torch.autograd.Function):
    """Megatron's ``_AllToAll`` (``dist.all_to_all_single`` into a host-sized buffer), or a wrong one (``mistake``)."""

    @staticmethod
    def forward(ctx, rows, output_splits, input_splits, mistake):
        ctx.splits, ctx.mistake = (output_splits, input_splits), mistake
        out = rows.new_empty(sum(output_splits), rows.shape[1])
        dist.all_to_all_single(out, rows.contiguous(), output_splits, input_splits)
        return out * 2 if mistake == "scaled_forward" else out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        if ctx.mistake == "backward_not_reversed":  # the forward's splits again: the wrong rows come back
            back = grad.new_empty(sum(output_splits), grad.shape[1])
            dist.all_to_all_single(back, grad.contiguous(), output_splits, input_splits)
        else:
            back = grad.new_empty(sum(input_splits), grad.shape[1])
            dist.all_to_all_single(back, grad.contiguous(), input_splits, output_splits)
        return back, None, None, None


class _AutogradExchange(_Variant):
    """The titan layer with its exchanges an ``autograd.Function`` (``exchange_mistake`` applies to both)."""

    exchange_mistake = ""

    def exchange(self, rows, output_splits, input_splits, group):
        return _Exchange.apply(rows, output_splits, input_splits, self.exchange_mistake)


@pytest.mark.parametrize("mistake", ["", "scaled_forward", "backward_not_reversed"])
def test_autograd_function_exchange(fake_group, mistake):
    """Megatron's spelling is made the functional autograd collective and rewritten; a function whose forward does
    more than the exchange, or whose backward does not reverse it, is left alone (``autograd_exchange_unproven``)."""
    torch.manual_seed(0)
    layer = _AutogradExchange(hidden=32, inter=16, experts=8, top_k=2).to(torch.bfloat16)
    layer.exchange_mistake = mistake
    ctx, graph = _pass(layer)
    if not mistake:
        assert _records(ctx) == [("rewrite", "")], [(r.what, r.detail) for r in ctx.records]
        assert not host_reads(graph)
        assert "autograd_function_apply" not in [op_name(n) for n in graph.nodes]
        return
    assert ("skip", "autograd_exchange_unproven") in _records(ctx), [(r.what, r.detail) for r in ctx.records]
    assert ("rewrite", "") not in _records(ctx)
    assert host_reads(graph)  # left alone
