"""One rank of ``test_ep.py::test_transformers_expert_parallel`` (gloo, CPU): transformers' own expert parallelism
(``apply_expert_parallelism`` with the Qwen3-MoE block's ``ep_plan``: experts sharded ``Shard(0)`` over an ``ep``
mesh of every rank, ``tp`` of 1) on a Qwen3-MoE sparse block (or, with ``causal_lm`` as the last argument, a
2-layer Qwen3-MoE CausalLM: loss and gradients), each rank routing its own tokens. Its
``all_to_all`` implementation in fp64 is the reference; in bf16 eager is the yardstick; judged: the same block under
``moe_compile.compile`` (the implementation swapped to ``"moe_compile"``) and, eager, the block built with
``ep_implementation="moe_compile"``. Writes the verdict as JSON.
"""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist

HIDDEN, INTER, EXPERTS, TOP_K = 32, 16, 8, 2
PLAN = {"experts.gate_up_proj": "grouped_gemm", "experts.down_proj": "grouped_gemm", "experts": "ep_dispatch_experts"}


def _step(block: torch.nn.Module, run, x: torch.Tensor, cot: torch.Tensor) -> dict[str, torch.Tensor]:
    """Output and gradients (this rank's shards of the experts') of ``(out * cot).sum()``; for a CausalLM (``x`` its
    token ids), the loss and gradients."""
    block.zero_grad(set_to_none=True)
    if x.is_floating_point():
        x = x.detach().clone().requires_grad_()
        out = run(x)
        out = out[0] if isinstance(out, tuple) else out
        (out.float() * cot).sum().backward()
        step = {"out": out.detach(), "grad:x": x.grad}
    else:
        loss = run(input_ids=x, labels=x).loss
        loss.backward()
        step = {"loss": loss.detach()}
    grads = {f"grad:{n}": getattr(p.grad, "_local_tensor", p.grad) for n, p in block.named_parameters()}
    return {**step, **grads}


def main(rank: int, world: int, store_path: str, result_path: str, model: str = "block") -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.distributed.expert_parallel import apply_expert_parallelism
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    import moe_compile
    from moe_compile import report
    from tests import _tolerance as tol

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("ep", "tp"))
        config = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS,
                                num_experts_per_tok=TOP_K, norm_topk_prob=True, vocab_size=64, intermediate_size=64,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
        cls = Qwen3MoeSparseMoeBlock if model == "block" else Qwen3MoeForCausalLM
        init = torch.Generator().manual_seed(0)  # the same full weights on every rank; each keeps its shard
        weights = {n: torch.randn(p.shape, generator=init) * p.shape[-1] ** -0.5
                   for n, p in cls(config).named_parameters()}

        def block(dtype: torch.dtype, implementation: str) -> torch.nn.Module:
            own = copy.deepcopy(config)
            if dtype == torch.float64:  # a CausalLM's experts default to torch._grouped_mm, which has no fp64
                own._experts_implementation = "eager"
            b = cls(own)
            with torch.no_grad():
                for n, p in b.named_parameters():
                    p.copy_(weights[n].to(torch.bfloat16))  # bf16-rounded on every side
            b.to(dtype)
            owners = [""] if model == "block" else [n for n, m in b.named_modules()
                                                    if n.endswith(".mlp") and hasattr(m, "experts")]
            plan = {f"{owner}.{key}".lstrip("."): style for owner in owners for key, style in PLAN.items()}
            return apply_expert_parallelism(b, mesh["ep"], mesh["tp"], plan, ep_implementation=implementation)

        gen = torch.Generator().manual_seed(10 + rank)  # each rank its own tokens
        if model == "block":
            x = torch.randn(2, 12, HIDDEN, generator=gen).bfloat16()
            cot = torch.randn(2, 12, HIDDEN, generator=gen)
        else:
            x, cot = torch.randint(0, config.vocab_size, (2, 16), generator=gen), None
        ref_block = block(torch.float64, "all_to_all")
        ref = _step(ref_block, ref_block, x.double() if x.is_floating_point() else x,
                    cot.double() if cot is not None else None)
        eager_block = block(torch.bfloat16, "all_to_all")
        eager = _step(eager_block, eager_block, x, cot)
        opt_in_block = block(torch.bfloat16, "moe_compile")
        opt_in = _step(opt_in_block, opt_in_block, x, cot)
        torch._dynamo.reset()
        compiled_block = block(torch.bfloat16, "all_to_all")
        with report.collecting() as rep:
            run = moe_compile.compile(compiled_block)
            compiled = _step(compiled_block, run, x, cot)
            again = _step(compiled_block, run, x, cot)
        result = {"rank": rank, "module_records": [(r.layer, r.kind, r.what) for r in
                                                   report.module_records(compiled_block)],
                  "graphs": rep.graphs, "graph_breaks": sum(torch._dynamo.utils.counters["graph_break"].values()),
                  "left": sorted({r.what for r in rep.left}),
                  "bitwise_repeat": all(torch.equal(compiled[k], again[k]) for k in compiled)}
        for name, got in (("compiled", compiled), ("implementation", opt_in)):
            ok, worst, unjudged = tol.within_eager_bound(got, eager, ref, dtype=torch.bfloat16,
                                                         always_judged=tuple(ref))
            result[name] = {"ok": ok and not unjudged, "worst": list(worst), "unjudged": unjudged}
    finally:
        dist.destroy_process_group()
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], *sys.argv[5:])
