"""GPU: every layer style of ``tests/models`` that the passes rewrite is captured by strict ``reduce-overhead``.

Strict settings (compiler-mechanics note, 7.2): ``graph_partition=False`` and ``triton.cudagraph_or_error=True``:
any cudagraph skip raises instead of running eagerly. Each layer runs training steps on new tokens (routing, counts
and dropped choices change on replay); the last step's output and gradients must be within eager's own distance
from a float32 run (``tests/_tolerance.py``), and replaying the same tokens twice must give the same bits.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch._dynamo.utils import counters

import moe_compile
from moe_compile import report
from moe_compile.api import account_expert_layers
from tests import _tolerance as tol

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

STRICT = {"graph_partition": False, "triton.cudagraph_or_error": True}
T, H = 64, 64


def _composed(**forms: str) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        from tests.fuzz.emit import build as build_spec
        from tests.fuzz.grammar import Spec

        return build_spec(Spec(seed=1, hidden=H, inter=128, experts=8, top_k=2, align=16, dtype="bf16", **forms))
    return build


def _handwritten(name: str) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        from tests.models import handwritten

        return getattr(handwritten, name)(hidden=H, inter=128, experts=8, top_k=2)
    return build


def _capacity(style: str) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        from tests.models.capacity_layers import CapacityMoE

        return CapacityMoE(hidden=H, inter=128, num_experts=8, top_k=2, capacity_factor=1.0, style=style)
    return build


def _drop_and_pad() -> torch.nn.Module:
    from tests.models.capacity_layers import MegatronDropAndPadMoE

    return MegatronDropAndPadMoE(hidden=H, inter=128, num_experts=8, top_k=2, capacity_factor=1.0)


def _expert_choice() -> torch.nn.Module:
    from tests.models.expert_choice import ExpertChoiceMoE

    return ExpertChoiceMoE(hidden=H, ffn=128, experts=8).to(torch.bfloat16)


def _skip_loop() -> torch.nn.Module:
    from tests.models.skip_loops import SkipLoopMoE

    return SkipLoopMoE(hidden=H, inter=128, num_experts=8)


def _selection_loop() -> torch.nn.Module:
    from tests.models.expert_loops import SelectionLoopMoE

    return SelectionLoopMoE(hidden=H, inter=128, num_experts=8, top_k=2, experts="swiglu_list")


def _module_list_loop() -> torch.nn.Module:
    from tests.models.loop_models import make_loop_moe

    return make_loop_moe(hidden=H, inter=128, num_experts=8, top_k=2, dtype=torch.bfloat16)


# name -> (builder, entry, the pass whose rewrite makes the layer capturable, input shape)
LAYERS: dict[str, tuple[Callable[[], torch.nn.Module], str, str, tuple[int, ...]]] = {
    "sort_index_select_scatter_add": (_handwritten("SortIndexSelectScatterAdd"), "backend", "fuse_dispatch", (T, H)),
    "padded_index_put": (_handwritten("PaddedIndexPut"), "backend", "fuse_dispatch", (T, H)),
    "megatron_masked_select_split_scatter_add": (
        _composed(dispatch="masked", permute="masked_select", counts="eq_arange_sum", count_place="host",
                  combine="scatter_add", weight="rows_act"), "api", "strip_host_padding", (T, H)),
    "index_copy_unpermute_sum": (_composed(combine="index_copy_sum", weight="rows_fp32"), "backend", "fuse_dispatch",
                                 (T, H)),
    "capacity_gshard": (_capacity("gshard"), "backend", "capacity_dispatch", (T, H)),
    "capacity_deepspeed": (_capacity("deepspeed"), "backend", "capacity_dispatch", (T, H)),
    "megatron_drop_and_pad": (_drop_and_pad, "backend", "drop_and_pad", (T, H)),
    "expert_choice": (_expert_choice, "backend", "expert_choice", (2, T // 2, H)),
    "skip_loop": (_skip_loop, "api", "swap_expert_loops", (2, T // 2, H)),
    # a loop over experts selecting tokens with torch.where, unrolled by Dynamo (fuse_expert_loop), and the
    # nonzero-driven ModuleList loop of transformers 4.x (the swap)
    "selection_loop": (_selection_loop, "backend", "fuse_expert_loop", (T, H)),
    "module_list_loop": (_module_list_loop, "api", "swap_expert_loops", (2, T // 2, H)),
}


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name", list(LAYERS))
def test_rewritten_layer_training_step_is_captured(name):
    build, entry, pass_name, shape = LAYERS[name]
    model = build().cuda()
    eager_model, ref_model = copy.deepcopy(model), copy.deepcopy(model).float()
    if entry == "api":
        compiled = moe_compile.compile(model, mode="reduce-overhead")
    else:
        compiled = torch.compile(model, backend="moe_compile", mode="reduce-overhead", fullgraph=True)
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    with torch._inductor.config.patch({**STRICT, "force_disable_caches": True}), report.collecting() as rep:
        try:
            for _ in range(4):  # warm-up, record, replays on new tokens
                x = torch.randn(shape, device="cuda", generator=gen).to(torch.bfloat16)
                cot = torch.randn(shape, device="cuda", generator=gen)
                torch.compiler.cudagraph_mark_step_begin()
                got = tol.layer_step(compiled, model, x, cot)
            torch.compiler.cudagraph_mark_step_begin()
            again = tol.layer_step(compiled, model, x, cot)
        except Exception as exc:
            raise AssertionError(f"{type(exc).__name__}: {str(exc)[:600]}\n{rep.table()}") from exc
    account_expert_layers(model, rep)  # the swap's records (moe_compile.compile) live on the module
    assert any(r.pass_name == pass_name and r.kind == "rewrite" for r in rep.records), rep.table()
    assert counters["inductor"]["cudagraph_skips"] == 0
    different = [k for k in got if not torch.equal(got[k], again[k])]
    assert not different, f"the same tokens replayed gave other bits: {different}"
    eager = tol.layer_step(eager_model, eager_model, x, cot)
    ref = tol.layer_step(ref_model, ref_model, x, cot, torch.float32)
    ok, worst, unjudged = tol.within_eager_bound(got, eager, ref, always_judged=("out",))
    assert ok, (worst, tol.eager_bound_errors(got, eager, ref))
