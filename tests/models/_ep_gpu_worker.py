"""One rank of ``test_ep_gpu.py``: :class:`TitanStyleEP` (or ``--kind``'s layer) in bf16 on ``cuda:<rank>`` over
NCCL, compiled by ``moe_compile.compile``, against eager bf16 and an fp64 reference on the same tokens and weights.

Phases, each recorded in the result JSON (written after each phase, so a later phase that hangs or dies leaves the
earlier verdicts readable):

* ``compiled``: what the passes did (``expert_parallel`` rewrite, host reads left in each graph after the pass,
  ``_local_scalar_dense`` left), output and every gradient within eager's bound from fp64, two runs bitwise equal,
  and a third run under CUDA's sync debug mode set to ``error`` (any host synchronisation raises). If the default
  compile is not bitwise reproducible, the same with ``deterministic=True`` (``deterministic``), to say what differs.
* ``capture``: ``moe_compile.compile(..., mode="reduce-overhead")`` under strict CUDA graphs (``graph_partition=False``,
  ``triton.cudagraph_or_error=True``): training steps on new tokens (warm-up, record, replays), the same tokens
  replayed twice bitwise equal, no cudagraph skip, the last step within eager's bound from fp64; an exception is
  recorded with its type, message and traceback tail.

``python -m tests.models._ep_gpu_worker RANK WORLD STORE RESULT [--backend gloo --device cpu]``: the CPU form runs the
``compiled`` phase over gloo (a check of this script where no GPU is; capture needs CUDA).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

from tests.models._ep_worker import record_host_reads_left, rewrite_names

HIDDEN, INTER, EXPERTS, TOP_K, TOKENS = 128, 64, 8, 2, 96
STRICT = {"graph_partition": False, "triton.cudagraph_or_error": True}


def _grad_names(step: dict) -> dict:
    return {k: v for k, v in step.items() if v is not None}


def _error(exc: BaseException) -> dict:
    return {"error": f"{type(exc).__name__}: {str(exc)[:3000]}",
            "traceback": "".join(traceback.format_exception(exc))[-6000:]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("rank", type=int)
    parser.add_argument("world", type=int)
    parser.add_argument("store")
    parser.add_argument("result")
    parser.add_argument("--backend", default="nccl")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--kind", default="titan", help="the layer of ep_layers.EP_LAYERS (titan: the graph pass's; "
                                                        "autograd_all_to_all: the host-loop layer the swap takes)")
    args = parser.parse_args(argv)

    from tests import _tolerance as tol
    from tests.models.ep_layers import EP_LAYERS

    rank, world = args.rank, args.world
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    left_reads, stop_recording = record_host_reads_left()
    result: dict = {"rank": rank, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "torch": torch.__version__}

    def save() -> None:
        with open(args.result, "w") as f:
            json.dump(result, f)

    kwargs = {"device_id": device} if device.type == "cuda" else {}
    # a rank whose peer died stops waiting after this (the test's own timeout is longer)
    timeout = datetime.timedelta(seconds=150)
    dist.init_process_group(args.backend, init_method=f"file://{args.store}", rank=rank, world_size=world,
                            timeout=timeout, **kwargs)
    try:
        torch.manual_seed(0)  # the router is replicated: the same on every rank
        layer = EP_LAYERS["titan"](hidden=HIDDEN, inter=INTER, experts=EXPERTS, top_k=TOP_K)
        torch.manual_seed(100 + rank)  # each rank's own experts
        with torch.no_grad():
            for p in (layer.w_gate_up, layer.w_down):
                p.copy_(torch.randn_like(p) * p.shape[1] ** -0.5)
        layer.to(torch.bfloat16).float()  # bf16-rounded weights on every side

        def fresh(kind: str = args.kind, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
            # a copy of the layer (its process group cannot be deep-copied)
            other = EP_LAYERS[kind](hidden=HIDDEN, inter=INTER, experts=EXPERTS, top_k=TOP_K)
            other.load_state_dict(copy.deepcopy(layer.state_dict()))
            return other.to(device=device, dtype=dtype)

        gen = torch.Generator().manual_seed(10 + rank)

        def tokens() -> tuple[torch.Tensor, torch.Tensor]:
            x = torch.randn(TOKENS, HIDDEN, generator=gen).to(torch.bfloat16)
            cot = torch.randn(TOKENS, HIDDEN, generator=gen)
            return x.to(device), cot.to(device)

        # the fp64 reference: the same function with plain matmuls per expert (torch._grouped_mm has no fp64)
        ref_model = fresh("autograd_all_to_all", torch.float64)
        eager_model = fresh()

        def references(x, cot):
            ref = tol.layer_step(ref_model, ref_model, x, cot, torch.float64)
            eager = tol.layer_step(eager_model, eager_model, x, cot)
            return ref, eager

        x, cot = tokens()
        ref, eager = references(x, cot)
        result["compiled"] = _compiled_phase(fresh, x, cot, ref, eager, left_reads, device)
        save()
        if device.type == "cuda":
            result["capture"] = _capture_phase(fresh, tokens, references, left_reads)
            save()
    except Exception as exc:  # noqa: BLE001 - recorded for the test to report
        result["fatal"] = _error(exc)
        save()
        raise
    finally:
        stop_recording()
        if device.type == "cuda":
            # NCCL's teardown hangs (both ranks, 170 s on 2 H200s, torch 2.11) while the captured CUDA graphs that
            # hold its collectives are alive: the verdicts are saved, so end here
            save()
            sys.stdout.flush()
            os._exit(1 if "fatal" in result else 0)
        dist.destroy_process_group()
    save()


def _judge(got: dict, eager: dict, ref: dict) -> dict:
    from tests import _tolerance as tol

    ok, worst, unjudged = tol.within_eager_bound(got, eager, ref, dtype=torch.bfloat16, always_judged=tuple(ref))
    return {"ok": ok and not unjudged, "worst": list(worst), "unjudged": unjudged,
            "no_grad": sorted(set(ref) - set(_grad_names(got)))}


def _compiled_phase(fresh, x, cot, ref, eager, left_reads, device) -> dict:
    import moe_compile
    from moe_compile import report
    from tests import _tolerance as tol

    out: dict = {}
    try:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        left_reads.clear()
        model = fresh()
        with report.collecting() as rep:
            run = moe_compile.compile(model)
            got = tol.layer_step(run, model, x, cot)
            again = tol.layer_step(run, model, x, cot)
        out.update(_judge(got, eager, ref))
        out.update(
            rewrites=rewrite_names(rep, model),
            rewrite_details=[r.detail for r in rep.rewrites if r.pass_name == "expert_parallel"],
            skips=sorted({f"{r.pass_name}:{r.what}" for r in rep.skips}),
            skip_details=_ep_skips(rep),
            errors=sorted({f"{r.pass_name}: {r.what}: {r.detail}"[:600] for r in rep.records if r.kind == "error"}),
            left=sorted({r.what for r in rep.left}),
            graph_breaks=sum(torch._dynamo.utils.counters["graph_break"].values()),
            host_reads_left=left_reads[:],
            bitwise_repeat=all(torch.equal(got[k], again[k]) for k in got),
            differing=sorted(k for k in got if not torch.equal(got[k], again[k])),
        )
        if device.type == "cuda":  # a third step with every host synchronisation raising
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                third = tol.layer_step(run, model, x, cot)
                torch.cuda.set_sync_debug_mode("default")
                out["sync_free"], out["sync_error"] = True, None
                out["bitwise_third"] = all(torch.equal(got[k], third[k]) for k in got)
            except Exception as exc:  # noqa: BLE001 - the host sync, recorded
                torch.cuda.set_sync_debug_mode("default")
                out["sync_free"], out["sync_error"] = False, _error(exc)
        if not out["bitwise_repeat"]:
            out["deterministic"] = _deterministic(fresh, x, cot, ref, eager)
    except Exception as exc:  # noqa: BLE001 - recorded for the test to report
        out.update(_error(exc))
    return out


def _deterministic(fresh, x, cot, ref, eager) -> dict:
    """The default compile differed between two runs: the same with ``deterministic=True``."""
    import moe_compile
    from moe_compile import report
    from tests import _tolerance as tol

    torch._dynamo.reset()
    model = fresh()
    with report.collecting() as rep:
        run = moe_compile.compile(model, deterministic=True)
        got = tol.layer_step(run, model, x, cot)
        again = tol.layer_step(run, model, x, cot)
    return {**_judge(got, eager, ref), "left": sorted({r.what for r in rep.left}),
            "bitwise_repeat": all(torch.equal(got[k], again[k]) for k in got),
            "differing": sorted(k for k in got if not torch.equal(got[k], again[k]))}


def _ep_skips(rep) -> list[str]:
    """Why ``expert_parallel`` left an exchange alone (reason tag and detail)."""
    return sorted({f"{r.pass_name}:{r.what}: {r.detail}" for r in rep.skips if r.pass_name == "expert_parallel"})


def _capture_phase(fresh, tokens, references, left_reads) -> dict:
    import moe_compile
    from moe_compile import report
    from tests import _tolerance as tol

    counters = torch._dynamo.utils.counters
    out: dict = {}
    torch._dynamo.reset()
    counters.clear()
    left_reads.clear()
    model = fresh()
    steps = 0
    compiled = moe_compile.compile(model, mode="reduce-overhead")
    with torch._inductor.config.patch({**STRICT, "force_disable_caches": True}), report.collecting() as rep:
        try:
            for _ in range(4):  # warm-up, record, replays on new tokens (new routing, new counts)
                x, cot = tokens()
                torch.compiler.cudagraph_mark_step_begin()
                got = tol.layer_step(compiled, model, x, cot)
                steps += 1
            torch.compiler.cudagraph_mark_step_begin()
            again = tol.layer_step(compiled, model, x, cot)
            steps += 1
        except Exception as exc:  # noqa: BLE001 - why capture failed, recorded
            out.update(captured=False, steps_done=steps, skip_details=_ep_skips(rep), **_error(exc))
            return out
    out.update(rewrites=rewrite_names(rep, model), skip_details=_ep_skips(rep),
               host_reads_left=left_reads[:], cudagraph_skips=counters["inductor"]["cudagraph_skips"],
               bitwise_replay=all(torch.equal(got[k], again[k]) for k in got),
               differing=sorted(k for k in got if not torch.equal(got[k], again[k])))
    ref, eager = references(x, cot)
    out.update(_judge(got, eager, ref))
    out["captured"] = True
    return out


if __name__ == "__main__":
    main()
