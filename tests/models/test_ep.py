"""Expert-parallel layers (``ep_layers.py``) over 2 gloo ranks on CPU: ``moe_compile.compile`` matches eager.

Each rank runs eager and the compiled layer in bf16 on its own tokens, and an fp64 reference; output and every
gradient (input, router, its experts) within eager's own distance from fp64
(NOTE [derived tolerances] (tests/_tolerance.py)). What the passes did with the exchange is printed (``-s``). The
host-loop layer is swapped to the same static exchange before Dynamo (``moe_compile/experts/expert_parallel.py``):
one graph, no host read. The titan layer is rewritten by ``expert_parallel``: no host read is left in its graph, two
runs are bitwise equal, and with a small ``ep_capacity_factor`` the compiled layer matches eager and fp64 layers
that drop the same rows (the pass's contract: rows past ``S`` in a destination's block), and ``metrics=True``
reports the rows each rank dropped (``moe/dropped_fraction``; exactly 0 at the bound). With FSDP2 on a 2-D mesh
(4 ranks: ``dp`` 2 x ``ep`` 2, ``_ep_fsdp_worker.py``) the same holds.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests._subprocess import REPO_ROOT
from tests.models._ep_fsdp_worker import check_result

WORLD = 2


def _run_ranks(kind: str | None, tmp_path, *extra: str, world: int = WORLD,
               worker: str = "tests.models._ep_worker") -> list[dict]:
    store = tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, "-m", worker, *([kind] if kind else []), str(rank), str(world),
                               str(store), str(tmp_path / f"rank{rank}.json"), *extra], cwd=REPO_ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(world)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-6000:]
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(world)]


# titan_211: the same layer with torch 2.11's spelling of all_to_all_single_autograd (an autograd function that waits)
# autograd_grouped: the exchange an autograd.Function around dist.all_to_all_single (Megatron's), experts grouped
# autograd_all_to_all: that exchange, experts as a host loop over the received chunks (`if size:`): swapped
# default suite: titan and autograd_grouped (the two exchange forms); the host-loop variant (~110 s) with -m slow
@pytest.mark.parametrize("kind", ["titan", pytest.param("titan_211", marks=pytest.mark.slow), "autograd_grouped",
                                  pytest.param("autograd_all_to_all", marks=pytest.mark.slow)])
def test_expert_parallel_layer_matches_eager(kind, tmp_path):
    # the capacity factor's drops once per path: the graph pass on torch 2.13's spelling (the others reach the same
    # rewrite), and the host-loop layer's swap
    results = _run_ranks(kind, tmp_path, *(("0.25",) if kind in ("titan", "autograd_all_to_all") else ()))
    for rank, result in enumerate(results):
        print(f"rank {rank}: {result}")
        assert result["ok"], result
        assert result["bitwise_repeat"], result
    if kind == "autograd_all_to_all":
        _check_swapped(results)
        _check_drops([result["drops"] for result in results], swapped=True)
        return
    for result in results:
        assert "<graph>:expert_parallel" in result["rewrites"], result
        assert result["host_reads_left"] and not any(result["host_reads_left"]), result
        assert not [w for w in result["left"] if "_local_scalar_dense" in w], result
        (detail,) = result["rewrite_details"]
        assert "equal splits [48]*2" in detail and "no row dropped" in detail, detail
        assert result["dropped_fraction_at_bound"] == 0.0, result  # metrics=True: nothing dropped at the bound
        # collect(group=...): every rank's accumulators summed, tokens per expert the mean over the ranks' calls
        across = result["metrics_across_ranks"]
        assert across["equal"] and across["keys"] > 8 and across["ranks"] == WORLD, across
        assert across["total_routed"] == WORLD * 24 * 2, across  # tokens x top-k on every rank
    if kind == "titan":
        _check_drops([result["drops"] for result in results])


def _check_swapped(per_rank: list[dict]) -> None:
    """The host-loop layer (NOTE in moe_compile/experts/expert_parallel.py): swapped on every rank before Dynamo, one
    graph, no host read left in it, and the graph pass has no exchange left to rewrite."""
    for result in per_rank:
        assert "<root>:swap_expert_loops" in result["rewrites"], result
        assert not any(r.endswith(":expert_parallel") for r in result["rewrites"]), result
        (detail,) = result["swap_details"]
        assert "expert-parallel over 2 ranks" in detail and "no host read" in detail, detail
        # the layer's router takes its top-k of bf16 probabilities (softmax in the logits' dtype)
        assert "softmax_topk_in_dtype" in detail, detail
        assert result["graph_breaks"] == 0, result
        assert result["host_reads_left"] and not any(result["host_reads_left"]), result
        assert not [w for w in result["left"] if "_local_scalar_dense" in w], result
        assert result["dropped_fraction_at_bound"] == 0.0, result  # metrics=True: the exchange's S is marked


def _check_drops(per_rank: list[dict], swapped: bool = False) -> None:
    """``ep_capacity_factor=0.25``: against eager layers dropping the same rows, and the reported fraction."""
    for drops in per_rank:
        assert drops["ok"], drops
        if swapped:
            assert drops["capacity"] == 6 and "S = ceil(0.25 * T * K / W)" in drops["swap_details"][0], drops
        else:
            assert drops["capacity"] == 6 and "S=6" in drops["rewrite_details"][0], drops
        assert drops["host_reads_left"] and not any(drops["host_reads_left"]), drops
        # metrics=True: the rows this rank sent past S, counted on the device, as a fraction of its routed rows
        # (one fp32 division: within its rounding)
        assert drops["dropped_fraction"] is not None, drops
        assert math.isclose(drops["dropped_fraction"], drops["dropped"] / drops["routed"], rel_tol=2**-23,
                            abs_tol=0.0), drops
    assert sum(d["dropped"] for d in per_rank) > 0, "the small capacity factor dropped nothing: the test tests nothing"


def test_transformers_expert_parallel(tmp_path):
    """transformers' own expert parallelism (``_hf_ep_worker.py``: its ``all_to_all`` implementation reads the split
    sizes to the host every layer): under ``moe_compile.compile`` its implementation is swapped to ours, one graph, no
    host read left, bitwise repeat, within eager's bound from fp64; ``ep_implementation="moe_compile"`` too, eager."""
    pytest.importorskip("transformers.distributed.expert_parallel")
    _check_transformers_ep(_run_ranks(None, tmp_path, worker="tests.models._hf_ep_worker"), ["experts"])


@pytest.mark.slow
def test_transformers_expert_parallel_causal_lm(tmp_path):
    """The same on a 2-layer Qwen3-MoE CausalLM (the ``ep_plan`` on both layers' experts): loss and gradients."""
    pytest.importorskip("transformers.distributed.expert_parallel")
    results = _run_ranks(None, tmp_path, "causal_lm", worker="tests.models._hf_ep_worker")
    _check_transformers_ep(results, [f"model.layers.{i}.mlp.experts" for i in range(2)])


def _check_transformers_ep(results: list[dict], experts: list[str]) -> None:
    for result in results:
        print(f"rank {result['rank']}: {result}")
        assert result["module_records"] == [[e, "rewrite", "ep_implementation=AllToAllEP"] for e in experts], result
        assert result["graphs"] == 1 and result["graph_breaks"] == 0, result
        assert not [w for w in result["left"] if w.startswith("host_sync")], result
        assert result["bitwise_repeat"], result
        assert result["compiled"]["ok"] and result["implementation"]["ok"], result


@pytest.mark.parametrize("kind", ["titan", pytest.param("autograd_all_to_all", marks=pytest.mark.slow)])
def test_fsdp2_with_expert_parallel(kind, tmp_path):
    """4 gloo ranks, a 2-D mesh: FSDP2 shards over ``dp`` (2), the experts' exchange runs over ``ep`` (2). The
    host-loop layer is swapped with its probe on FSDP2's unsharded parameters (slow run: ~50 s more)."""
    results = _run_ranks(None, tmp_path, "cpu", kind, world=4, worker="tests.models._ep_fsdp_worker")
    for rank, result in enumerate(results):
        print(f"rank {rank}: {result}")
        check_result(result, kind)
