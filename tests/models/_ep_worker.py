"""One rank of the expert-parallel tests (``test_ep.py``): eager in bf16 and ``moe_compile.compile`` in bf16 against an
fp64 reference, on the same tokens and weights; writes the verdict and what the passes did as JSON.

With a capacity factor (``argv[6]``), also ``moe_compile.compile(..., ep_capacity_factor=f)`` against eager and fp64
layers that drop the same rows (:class:`_Drops`: rows past ``S`` in each destination's block, the pass's contract).
"""

from __future__ import annotations

import copy
import json
import math
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist


def _step(layer, x, run=None):
    """Output and gradients of ``(run or layer)(x)`` (``run``: the compiled layer), keyed by ``layer``'s names."""
    x = x.detach().clone().requires_grad_()
    out = (run if run is not None else layer)(x)
    out.square().sum().backward()
    grads = {f"grad {n}": p.grad for n, p in layer.named_parameters()}
    return {"out": out.detach(), "grad x": x.grad, **grads}


def keep_mask(counts: torch.Tensor, world: int, local: int, capacity: int) -> torch.Tensor:
    """Rows (sorted by expert) that fit in their destination's first ``capacity`` rows."""
    send = counts.view(world, local).sum(1)
    dest = torch.repeat_interleave(torch.arange(world), send)
    return torch.arange(dest.numel()) - (send.cumsum(0) - send)[dest] < capacity


class _Drops:
    """An expert-parallel layer whose rows past ``capacity`` per destination are dropped: sent as zeros (the experts
    are bias-free: zero out) and their returned rows zeroed, so they add nothing to outputs or gradients."""

    capacity: int

    def route(self, x):
        weights, order, counts, rows = super().route(x)
        self._keep = keep_mask(counts, self.world, self.local, self.capacity)[:, None]
        return weights, order, counts, rows * self._keep.to(rows.dtype)

    def combine(self, returned, order, weights):
        return super().combine(returned * self._keep.to(returned.dtype), order, weights)


def _dropping(cls, capacity):
    return type(f"Dropping{cls.__name__}", (_Drops, cls), {"capacity": capacity})


def record_host_reads_left() -> tuple[list[list[str]], Callable[[], None]]:
    """Wrap the ``expert_parallel`` pass so that it appends, per graph it runs on, the host reads the graph keeps
    after it; returns that list and the function that puts the pass back."""
    from moe_compile.passes import expert_parallel
    from moe_compile.passes._host_sync import host_reads

    left: list[list[str]] = []
    run_pass = expert_parallel.run

    def recording_run(graph, ctx):
        run_pass(graph, ctx)
        left.append(sorted(r.item.name for r in host_reads(graph).values()))

    expert_parallel.run = recording_run

    def stop() -> None:
        expert_parallel.run = run_pass
    return left, stop


def module_swaps(model) -> list:
    """``moe_compile.compile``'s module-level swaps of ``model`` (explain's module stage, recorded on the model)."""
    from moe_compile import report

    return [r for r in report.module_records(model) if r.kind == "rewrite"]


def rewrite_names(rep, model) -> list[str]:
    """``layer:pass`` of the graph passes' rewrites (``rep``) and of the module swaps of ``model``."""
    return sorted({f"{r.layer}:{r.pass_name}" for r in (*rep.rewrites, *module_swaps(model))})


def main(kind: str, rank: int, world: int, store_path: str, result_path: str, factor: float | None = None) -> None:
    import moe_compile
    from moe_compile import report
    from tests import _tolerance as tol
    from tests.models.ep_layers import EP_LAYERS

    left_reads, stop_recording = record_host_reads_left()
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)  # the router is replicated: the same on every rank
        layer = EP_LAYERS[kind](hidden=32, inter=16, experts=8, top_k=2)
        torch.manual_seed(100 + rank)  # each rank's own experts
        with torch.no_grad():
            for p in (layer.w_gate_up, layer.w_down):
                p.copy_(torch.randn_like(p) * p.shape[1] ** -0.5)
        x = torch.randn(24, 32, generator=torch.Generator().manual_seed(10 + rank))

        def fresh(cls=EP_LAYERS[kind]):  # a copy of the layer (its process group cannot be deep-copied)
            other = cls(hidden=32, inter=16, experts=8, top_k=2)
            other.load_state_dict(copy.deepcopy(layer.state_dict()))
            return other

        # the reference in fp64: the same function written with plain matmuls (torch._grouped_mm has no fp64)
        # bf16 (torch._grouped_mm's fake kernel takes nothing else), on bf16-rounded weights and tokens on every side
        layer.to(torch.bfloat16).float()
        x = x.bfloat16().float()
        ref = _step(fresh(EP_LAYERS["autograd_all_to_all"]).double(), x.double())
        eager = _step(fresh().to(torch.bfloat16), x.bfloat16())
        torch._dynamo.reset()
        compiled_layer = fresh().to(torch.bfloat16)
        with report.collecting() as rep:
            run = moe_compile.compile(compiled_layer, metrics=True)
            compiled = _step(compiled_layer, x.bfloat16(), run)
            compiled_layer.zero_grad(set_to_none=True)
            again = _step(compiled_layer, x.bfloat16(), run)
        swaps = module_swaps(compiled_layer)
        own = moe_compile.metrics.collect(reset=False, per_layer=True)  # this rank's calls
        across = moe_compile.metrics.collect(per_layer=True, group=dist.group.WORLD)  # every rank's
        dropped_at_bound = own.get("moe/dropped_fraction")
        ok, worst, unjudged = tol.within_eager_bound(compiled, eager, ref, dtype=torch.bfloat16,
                                                     always_judged=tuple(ref))
        breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
        result = {"ok": ok and not unjudged, "worst": list(worst), "unjudged": unjudged,
                  "rewrites": rewrite_names(rep, compiled_layer),
                  "rewrite_details": [r.detail for r in rep.rewrites if r.pass_name == "expert_parallel"],
                  "swap_details": [r.detail for r in swaps],
                  "skips": sorted({f"{r.pass_name}:{r.what}" for r in rep.skips}),
                  "left": sorted({r.what for r in rep.left}), "graph_breaks": breaks, "graphs": rep.graphs,
                  "host_reads_left": left_reads[:], "dropped_fraction_at_bound": dropped_at_bound,
                  "bitwise_repeat": all(torch.equal(compiled[k], again[k]) for k in compiled),
                  "no_grad": [f"{side}:{k}" for side, d in (("eager", eager), ("compiled", compiled))
                              for k, v in d.items() if v is None]}
        result["metrics_across_ranks"] = _across_ranks(own, across, world)
        if factor is not None:
            result["drops"] = _check_drops(kind, layer, x, factor, fresh, left_reads)
    finally:
        dist.destroy_process_group()
        stop_recording()
    with open(result_path, "w") as f:
        json.dump(result, f)


def _across_ranks(own: dict[str, float], across: dict[str, float], world: int) -> dict:
    """``collect(group=...)`` against the mean of every rank's own ``collect``: the tokens per expert (integer counts
    summed in fp64: exact), the routed tokens, and ``moe/ranks``."""
    keys = sorted(k for k in own if "/tokens_per_expert/" in k or k == "moe/tokens")
    mine = torch.tensor([own[k] for k in keys], dtype=torch.float64)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    mean = (torch.stack(everyone).sum(0) / world).tolist()
    return {"keys": len(keys), "ranks": across.get("moe/ranks"),
            "equal": all(across.get(k) == m for k, m in zip(keys, mean)),
            "total_routed": sum(across[k] for k in keys if "/tokens_per_expert/" in k) * world}


def _check_drops(kind, layer, x, factor, fresh, left_reads) -> dict:
    """``ep_capacity_factor=factor`` against eager and fp64 layers that drop the same rows."""
    import moe_compile
    from moe_compile import report
    from tests import _tolerance as tol
    from tests.models.ep_layers import EP_LAYERS

    N = x.shape[0] * layer.top_k
    S = max(1, math.ceil(factor * N / layer.world))
    ref = _step(fresh(_dropping(EP_LAYERS["autograd_all_to_all"], S)).double(), x.double())
    eager_layer = fresh(_dropping(EP_LAYERS[kind], S)).to(torch.bfloat16)
    eager = _step(eager_layer, x.bfloat16())
    dropped = int((~eager_layer._keep).sum())
    torch._dynamo.reset()
    compiled_layer = fresh().to(torch.bfloat16)
    left_reads.clear()
    with report.collecting() as rep:
        run = moe_compile.compile(compiled_layer, ep_capacity_factor=factor, metrics=True)
        compiled = _step(compiled_layer, x.bfloat16(), run)
    reported = moe_compile.metrics.collect().get("moe/dropped_fraction")
    ok, worst, unjudged = tol.within_eager_bound(compiled, eager, ref, dtype=torch.bfloat16, always_judged=tuple(ref))
    return {"ok": ok and not unjudged, "worst": list(worst), "unjudged": unjudged, "capacity": S, "dropped": dropped,
            "routed": N, "dropped_fraction": reported,
            "rewrite_details": [r.detail for r in rep.rewrites if r.pass_name == "expert_parallel"],
            "swap_details": [r.detail for r in module_swaps(compiled_layer)],
            "host_reads_left": left_reads[:]}


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5],
         float(sys.argv[6]) if len(sys.argv) > 6 else None)
