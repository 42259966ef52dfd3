"""One rank of ``test_ep.py::test_fsdp2_with_expert_parallel`` (gloo, CPU) and of
``test_ep_gpu.py::test_fsdp2_with_expert_parallel_over_nccl`` (NCCL, ``cuda:<rank>``, with ``cuda`` as the last
argument; a layer kind of ``EP_LAYERS`` after it, default ``titan``): :class:`TitanStyleEP` (the graph pass's) or
:class:`AutogradAllToAllEP` (the host-loop layer, swapped before Dynamo with the probe on FSDP2's unsharded
parameters) on a 2-D device mesh, FSDP2
(``fully_shard``) over the ``dp`` dimension and the experts' exchange over ``ep``, eager bf16 and
``moe_compile.compile`` bf16 against an fp64 reference built the same way; writes the verdict as JSON.

Each ``ep`` index holds its own experts (the same on both ``dp`` replicas), the router is replicated; every rank
routes its own tokens. Gradients are FSDP2's (reduce-scattered over ``dp``) gathered back to full tensors to judge.
"""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist

HIDDEN, INTER, EXPERTS, TOP_K, TOKENS = 32, 16, 8, 2, 24


def _full_step(model: torch.nn.Module, run, x: torch.Tensor, cot: torch.Tensor) -> dict[str, torch.Tensor]:
    """Output and gradients of one step, each gradient gathered from its FSDP2 shards (a collective: every rank)."""
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    out = run(x)
    (out.float() * cot).sum().backward()
    grads = {f"grad:{n}": p.grad.full_tensor() for n, p in model.named_parameters()}
    return {"out": out.detach(), "grad:x": x.grad, **grads}


def main(rank: int, world: int, store_path: str, result_path: str, device: str = "cpu", kind: str = "titan") -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import moe_compile
    from moe_compile import report
    from tests import _tolerance as tol
    from tests.models._ep_worker import record_host_reads_left, rewrite_names
    from tests.models.ep_layers import EP_LAYERS

    left_reads, stop_recording = record_host_reads_left()
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=world)
    try:
        mesh = init_device_mesh(device, (world // 2, 2), mesh_dim_names=("dp", "ep"))
        ep = mesh["ep"]
        torch.manual_seed(0)  # the router: the same on every rank
        layer = EP_LAYERS["titan"](hidden=HIDDEN, inter=INTER, experts=EXPERTS, top_k=TOP_K, group=ep.get_group())
        torch.manual_seed(100 + ep.get_local_rank())  # the experts: one set per ep index
        with torch.no_grad():
            for p in (layer.w_gate_up, layer.w_down):
                p.copy_(torch.randn_like(p) * p.shape[1] ** -0.5)
        layer.to(torch.bfloat16).float()  # bf16-rounded weights on every side
        state = copy.deepcopy(layer.state_dict())
        gen = torch.Generator().manual_seed(10 + rank)
        x = torch.randn(TOKENS, HIDDEN, generator=gen).bfloat16().to(device)
        cot = torch.randn(TOKENS, HIDDEN, generator=gen).to(device)

        def sharded(kind: str, dtype: torch.dtype) -> torch.nn.Module:
            model = EP_LAYERS[kind](hidden=HIDDEN, inter=INTER, experts=EXPERTS, top_k=TOP_K, group=ep.get_group())
            model.load_state_dict(state)
            model.to(device=device, dtype=dtype)
            fully_shard(model, mesh=mesh["dp"])
            return model

        # fp64: plain matmuls per expert (torch._grouped_mm has no fp64)
        ref_model = sharded("autograd_all_to_all", torch.float64)
        ref = _full_step(ref_model, ref_model, x.double(), cot.double())
        eager_model = sharded(kind, torch.bfloat16)
        eager = _full_step(eager_model, eager_model, x, cot)
        torch._dynamo.reset()
        model = sharded(kind, torch.bfloat16)
        with report.collecting() as rep:
            run = moe_compile.compile(model)
            got = _full_step(model, run, x, cot)
            again = _full_step(model, run, x, cot)
        ok, worst, unjudged = tol.within_eager_bound(got, eager, ref, dtype=torch.bfloat16,
                                                     always_judged=tuple(ref))
        result = {
            "ok": ok and not unjudged, "worst": list(worst), "unjudged": unjudged,
            "rewrites": rewrite_names(rep, model),
            "left": sorted({r.what for r in rep.left}),
            "graph_breaks": sum(torch._dynamo.utils.counters["graph_break"].values()),
            "host_reads_left": left_reads[:],
            "bitwise_repeat": all(torch.equal(got[k], again[k]) for k in got),
            "judged": sorted(ref),
        }
    finally:
        stop_recording()
        dist.destroy_process_group()
    with open(result_path, "w") as f:
        json.dump(result, f)


def check_result(result: dict, kind: str = "titan") -> None:
    """A rank's verdict as the tests require it: within the bound, the router's and experts' gradients judged,
    rewritten, no host read or graph break left, bitwise repeat."""
    assert result["ok"], result
    assert "grad:router.weight" in result["judged"] and "grad:w_gate_up" in result["judged"], result
    assert ("<graph>:expert_parallel" in result["rewrites"] if kind == "titan"
            else result["rewrites"] == ["<root>:swap_expert_loops"]), result
    assert result["host_reads_left"] and not any(result["host_reads_left"]), result
    assert not [w for w in result["left"] if "_local_scalar_dense" in w], result
    assert result["graph_breaks"] == 0, result
    assert result["bitwise_repeat"], result


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], *sys.argv[5:7])
