"""One rank of the expert-parallel tests (``test_ep.py``): eager in bf16 and ``moe_compile.compile`` in bf16 against an
fp64 reference, on the same tokens and weights; writes the verdict and what the passes did as JSON."""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist


def _step(layer, x, run=None):
    """Output and gradients of ``(run or layer)(x)`` (``run``: the compiled layer), keyed by ``layer``'s names."""
    x = x.detach().clone().requires_grad_()
    out = (run if run is not None else layer)(x)
    out.square().sum().backward()
    grads = {f"grad {n}": p.grad for n, p in layer.named_parameters()}
    return {"out": out.detach(), "grad x": x.grad, **grads}


def main(kind: str, rank: int, world: int, store_path: str, result_path: str) -> None:
    import moe_compile
    from moe_compile import report
    from tests import _tolerance as tol
    from tests.models.ep_layers import EP_LAYERS

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
            compiled = _step(compiled_layer, x.bfloat16(), moe_compile.compile(compiled_layer))
        ok, worst, unjudged = tol.within_eager_bound(compiled, eager, ref, dtype=torch.bfloat16,
                                                     always_judged=tuple(ref))
        breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
        result = {"ok": ok and not unjudged, "worst": list(worst), "unjudged": unjudged,
                  "rewrites": sorted({f"{r.layer}:{r.pass_name}" for r in rep.rewrites}),
                  "skips": sorted({f"{r.pass_name}:{r.what}" for r in rep.skips}),
                  "left": sorted({r.what for r in rep.left}), "graph_breaks": breaks, "graphs": rep.graphs,
                  "no_grad": [f"{side}:{k}" for side, d in (("eager", eager), ("compiled", compiled))
                              for k, v in d.items() if v is None]}
    finally:
        dist.destroy_process_group()
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
