"""fuse_dispatch: sort-based MoE dispatch becomes moe.permute_pad + grouped GEMM + moe.unpad_unpermute.

* Inline graphs (torch 2.13) of a small HF-style MoE function before and after the rewrite; op counters
  on every torch version.
* Every hand-written layer of ``tests/models/handwritten.py`` rewrites (or skips with its reason tag) and
  matches eager in forward and grads; two run through Inductor and their generated forward and backward
  code holds no atomic add and no scatter-add (the plain-Inductor control does).
* ``dynamic=True``, inference under ``no_grad``, unrelated sorts that must not fire, and the pass failing
  safely when the region is not row-wise.
"""

from __future__ import annotations

import collections
import unittest

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moe_compile import report
from moe_compile.config import MoECompileConfig
from moe_compile.ops import static_row_bound
from moe_compile.passes import PASSES, StagePass
from moe_compile.passes._graph import op_name
from tests.models import handwritten as hw
from tests.passes._harness import (
    check_rewrite,
    compile_and_run,
    fresh_cache,
    no_scatter_add,
)

TORCH_2_13 = torch.__version__.startswith("2.13")
ONLY_FUSE = MoECompileConfig(passes=tuple((p.name, p.name == "fuse_dispatch") for p in PASSES if p.stage == "pre_grad"))


def small_moe(x_TH, ids_TK, w_TK, w1_EIH, w2_EHI):
    """transformers' grouped_mm experts forward, reduced: E=4, K=2, weight after the MLP."""
    ids_S = ids_TK.reshape(-1)
    ids_sorted, perm = torch.sort(ids_S)
    rows = x_TH[perm // 2]
    w_g = w_TK.reshape(-1)[perm]
    counts = torch.histc(ids_sorted.float(), bins=4, min=0, max=3)
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    h = F.silu(torch._grouped_mm(rows, w1_EIH.transpose(-2, -1), offs=offs))
    y = torch._grouped_mm(h, w2_EHI.transpose(-2, -1), offs=offs) * w_g.unsqueeze(-1)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.shape[0])
    return y[inv].view(x_TH.shape[0], 2, x_TH.shape[1]).sum(dim=1)


def small_inputs(T=6, H=16, I=8, E=4, K=2, seed=0, requires_grad=False):  # noqa: E741 - I: expert intermediate size
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).bfloat16().requires_grad_(requires_grad)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g).bfloat16().requires_grad_(requires_grad)
    w1 = (0.3 * torch.randn(E, I, H, generator=g)).bfloat16().requires_grad_(requires_grad)
    w2 = (0.3 * torch.randn(E, H, I, generator=g)).bfloat16().requires_grad_(requires_grad)
    return x, ids, w, w1, w2


def pre_grad_graphs(fn, args):
    """(before, after) normalized pre-grad graphs of ``fn`` with only fuse_dispatch enabled."""
    from torch._dynamo.testing import normalize_gm

    graphs = {}
    stage = StagePass("pre_grad", ONLY_FUSE)

    def backend(gm, example_inputs):
        text = lambda: normalize_gm(gm.print_readable(print_output=False, include_stride=False,  # noqa: E731
                                                      include_device=False))
        graphs["before"] = text()
        stage(gm.graph)
        gm.recompile()
        graphs["after"] = text()
        graphs["ops"] = collections.Counter(op_name(n) for n in gm.graph.nodes if n.op.startswith("call"))
        return gm.forward

    torch._dynamo.reset()
    with report.collecting() as rep:
        torch.compile(fn, backend=backend)(*args)
    torch._dynamo.reset()
    return graphs, rep


class TestInlineGraphs(unittest.TestCase):
    maxDiff = None

    def test_small_moe_before_and_after(self):
        from expecttest import assert_expected_inline

        graphs, rep = pre_grad_graphs(small_moe, small_inputs())
        self.assertEqual(rep.count("fuse_dispatch"), 1, rep.table())
        ops = graphs["ops"]
        self.assertEqual(ops["moe.permute_pad"], 1)
        self.assertEqual(ops["moe.unpad_unpermute"], 1)
        self.assertEqual(ops["_grouped_mm"], 2)
        for gone in ("sort", "histc", "cumsum", "setitem", "floordiv", "sum"):
            self.assertEqual(ops[gone], 0, gone)
        if not TORCH_2_13:
            self.skipTest("inline graphs are pinned to torch 2.13")
        assert_expected_inline(graphs["before"], """\
class GraphModule(torch.nn.Module):
    def forward(self, L_ids_TK_: "i64[6, 2]", L_x_TH_: "bf16[6, 16]", L_w_TK_: "bf16[6, 2]", L_w1_EIH_: "bf16[4, 8, 16]", L_w2_EHI_: "bf16[4, 16, 8]"):
        l_ids_tk_ = L_ids_TK_
        l_x_th_ = L_x_TH_
        l_w_tk_ = L_w_TK_
        l_w1_eih_ = L_w1_EIH_
        l_w2_ehi_ = L_w2_EHI_

        ids_S: "i64[12]" = l_ids_tk_.reshape(-1);  l_ids_tk_ = None

        sort = torch.sort(ids_S);  ids_S = None
        ids_sorted: "i64[12]" = sort[0]
        perm: "i64[12]" = sort[1];  sort = None

        floordiv: "i64[12]" = perm // 2
        rows: "bf16[12, 16]" = l_x_th_[floordiv];  l_x_th_ = floordiv = None

        reshape_1: "bf16[12]" = l_w_tk_.reshape(-1);  l_w_tk_ = None
        w_g: "bf16[12]" = reshape_1[perm];  reshape_1 = None

        float_1: "f32[12]" = ids_sorted.float();  ids_sorted = None
        counts: "f32[4]" = torch.histc(float_1, bins = 4, min = 0, max = 3);  float_1 = None

        offs: "i32[4]" = torch.cumsum(counts, dim = 0, dtype = torch.int32);  counts = None

        transpose: "bf16[4, 16, 8]" = l_w1_eih_.transpose(-2, -1);  l_w1_eih_ = None
        _grouped_mm: "bf16[12, 8]" = torch._grouped_mm(rows, transpose, offs = offs);  rows = transpose = None
        h: "bf16[12, 8]" = torch.nn.functional.silu(_grouped_mm);  _grouped_mm = None

        transpose_1: "bf16[4, 8, 16]" = l_w2_ehi_.transpose(-2, -1);  l_w2_ehi_ = None
        _grouped_mm_1: "bf16[12, 16]" = torch._grouped_mm(h, transpose_1, offs = offs);  h = transpose_1 = offs = None
        unsqueeze: "bf16[12, 1]" = w_g.unsqueeze(-1);  w_g = None
        y: "bf16[12, 16]" = _grouped_mm_1 * unsqueeze;  _grouped_mm_1 = unsqueeze = None

        inv: "i64[12]" = torch.empty_like(perm)

        arange: "i64[12]" = torch.arange(12)
        inv[perm] = arange;  setitem = inv;  perm = arange = setitem = None

        getitem_4: "bf16[12, 16]" = y[inv];  y = inv = None
        view: "bf16[6, 2, 16]" = getitem_4.view(6, 2, 16);  getitem_4 = None
        sum_1: "bf16[6, 16]" = view.sum(dim = 1);  view = None
        return (sum_1,)
""")
        assert_expected_inline(graphs["after"], """\
class GraphModule(torch.nn.Module):
    def forward(self, L_ids_TK_: "i64[6, 2]", L_x_TH_: "bf16[6, 16]", L_w_TK_: "bf16[6, 2]", L_w1_EIH_: "bf16[4, 8, 16]", L_w2_EHI_: "bf16[4, 16, 8]"):
        l_ids_tk_ = L_ids_TK_
        l_x_th_ = L_x_TH_
        l_w_tk_ = L_w_TK_

        permute_pad = torch.ops.moe.permute_pad.default(l_x_th_, l_ids_tk_, None, 4, 1);  l_x_th_ = l_ids_tk_ = None
        rows_MH: "bf16[12, 16]" = permute_pad[0]
        offs_E: "i32[4]" = permute_pad[2]
        row_map: "i32[6, 4]" = permute_pad[3];  permute_pad = None
        l_w1_eih_ = L_w1_EIH_
        l_w2_ehi_ = L_w2_EHI_

        transpose: "bf16[4, 16, 8]" = l_w1_eih_.transpose(-2, -1);  l_w1_eih_ = None
        _grouped_mm: "bf16[12, 8]" = torch._grouped_mm(rows_MH, transpose, offs = offs_E);  rows_MH = transpose = None
        h: "bf16[12, 8]" = torch.nn.functional.silu(_grouped_mm);  _grouped_mm = None

        transpose_1: "bf16[4, 8, 16]" = l_w2_ehi_.transpose(-2, -1);  l_w2_ehi_ = None
        _grouped_mm_1: "bf16[12, 16]" = torch._grouped_mm(h, transpose_1, offs = offs_E);  h = transpose_1 = offs_E = None

        combined: "bf16[6, 16]" = torch.ops.moe.unpad_unpermute.default(_grouped_mm_1, row_map, l_w_tk_);  _grouped_mm_1 = row_map = l_w_tk_ = None
        return (combined,)
""")


# ----------------------------------------------------------------------------------------------
# hand-written layers


def _layer_inputs(cls, T=10, H=32, requires_grad=True, seed=0):
    layer = cls(hidden=H)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(seed)).bfloat16().requires_grad_(requires_grad)
    return layer, x


@pytest.mark.parametrize("cls", hw.REWRITTEN, ids=lambda c: c.__name__)
def test_handwritten_layer_rewrites_and_matches_eager(cls):
    layer, x = _layer_inputs(cls)
    run = check_rewrite(layer, (x,), {"fuse_dispatch": 1}, expected_skips={"fuse_dispatch": []})
    (rec,) = [r for r in run.report.rewrites if r.pass_name == "fuse_dispatch"]
    assert "moe.permute_pad" in rec.detail and "moe.unpad_unpermute" in rec.detail
    if cls in (hw.PaddedIndexPut, hw.PaddedSentinelRow):
        assert "align=16" in rec.detail and "pad(" in rec.what


@pytest.mark.parametrize("cls,reason", list(hw.NOT_REWRITTEN.items()), ids=lambda c: getattr(c, "__name__", c))
def test_handwritten_layer_must_not_fire(cls, reason):
    layer, x = _layer_inputs(cls)
    run = check_rewrite(layer, (x,), {"fuse_dispatch": 0}, expected_skips={"fuse_dispatch": [reason]})
    assert run.report.skips[0].layer == "<graph>"


def test_weights_before_gather_reason_text():
    layer, x = _layer_inputs(hw.WeightsBeforeGather, requires_grad=False)
    run = compile_and_run(layer, (x,))
    (skip,) = run.report.skips
    assert skip.detail.startswith("combine not matched: weights applied before gather")


@pytest.mark.parametrize("cls", [
    hw.SortIndexSelectScatterAdd,
    pytest.param(hw.PaddedIndexPut, marks=pytest.mark.slow),
    pytest.param(hw.ArgsortGatherIndexAdd, marks=pytest.mark.slow),
], ids=lambda c: c.__name__)
def test_generated_code_has_no_scatter_add(cls):
    """Through Inductor: forward and backward code (on CPU the dispatch ops' gather-only references traced into
    it) hold no atomic / scatter add."""
    layer, x = _layer_inputs(cls)
    run = check_rewrite(layer, (x,), {"fuse_dispatch": 1}, backend="moe_compile", code_checks=[no_scatter_add])
    assert len(run.code) == 2  # forward and backward


def test_plain_inductor_control_has_atomic_adds():
    """The check above can fail: plain Inductor's backward of the same layer scatters with atomics."""
    from torch._inductor.utils import run_and_get_code

    layer, x = _layer_inputs(hw.SortIndexSelectScatterAdd)
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="inductor")
    with fresh_cache():
        _, code = run_and_get_code(lambda: compiled(x).float().pow(2).mean().backward())
    torch._dynamo.reset()
    assert any("atomic_add" in c for c in code)


def test_dynamic_shapes_padded_layer():
    layer, x = _layer_inputs(hw.PaddedIndexPut)
    check_rewrite(layer, (x,), {"fuse_dispatch": 1}, dynamic=True)


def test_dynamic_shapes_small_moe_function():
    args = small_inputs(T=7, requires_grad=True)
    check_rewrite(small_moe, args, {"fuse_dispatch": 1}, dynamic=True)


def test_inference_no_grad():
    layer, x = _layer_inputs(hw.WeightBetweenGemms, requires_grad=False)
    check_rewrite(layer, (x,), {"fuse_dispatch": 1}, train=False)


def test_empty_experts_and_one_hot_expert():
    """T*K < E (most experts empty) and every token on the same experts."""
    args = list(small_inputs(T=1, requires_grad=True))
    check_rewrite(small_moe, args, {"fuse_dispatch": 1})
    ids = torch.tensor([[1, 3]] * 5)
    args = list(small_inputs(T=5, requires_grad=True))
    args[1] = ids
    check_rewrite(small_moe, args, {"fuse_dispatch": 1})


# ----------------------------------------------------------------------------------------------
# must not fire / fail safe


def test_unrelated_sort_is_ignored():
    """Top-p style sort of float probs and an argsort of ints not used to gather rows: no record."""

    def fn(logits, ids):
        probs, order = torch.sort(logits.softmax(-1), descending=True)
        rank = torch.argsort(ids)
        return probs.cumsum(-1) * 2, order, rank

    run = compile_and_run(fn, (torch.randn(4, 10), torch.randint(0, 5, (7,))), train=False)
    assert run.report.records == []


def test_rows_returned_from_region_skip():
    def fn(x_TH, ids_TK, w_TK, w1_EIH, w2_EHI):
        ids_sorted, perm = torch.sort(ids_TK.reshape(-1))
        rows = x_TH[perm // 2]
        offs = torch.cumsum(torch.histc(ids_sorted.float(), bins=4, min=0, max=3), 0, dtype=torch.int32)
        h = torch._grouped_mm(rows, w1_EIH.transpose(-2, -1), offs=offs)
        y = torch._grouped_mm(F.silu(h), w2_EHI.transpose(-2, -1), offs=offs)
        out = torch.zeros_like(x_TH).index_add_(0, perm // 2, y)
        return out, h

    run = compile_and_run(fn, small_inputs(), train=False)
    assert [r.what for r in run.report.skips] == ["rows_escape_region"]


def test_offsets_not_from_counts_skip():
    def fn(x_TH, ids_TK, w_TK, w1_EIH, w2_EHI, offs):
        ids_sorted, perm = torch.sort(ids_TK.reshape(-1))
        rows = x_TH[perm // 2]
        h = torch._grouped_mm(rows, w1_EIH.transpose(-2, -1), offs=offs)
        y = torch._grouped_mm(F.silu(h), w2_EHI.transpose(-2, -1), offs=offs)
        return torch.zeros_like(x_TH).index_add_(0, perm // 2, y)

    args = small_inputs()
    offs = torch.cumsum(torch.bincount(args[1].reshape(-1), minlength=4), 0).to(torch.int32)
    run = compile_and_run(fn, (*args, offs), train=False)
    assert [r.what for r in run.report.skips] == ["offsets_not_matched"]


def test_pass_can_be_turned_off():
    from moe_compile.config import make_config

    layer, x = _layer_inputs(hw.SortIndexSelectScatterAdd, requires_grad=False)
    run = compile_and_run(layer, (x,), config=make_config(passes={"fuse_dispatch": False}))
    assert run.report.records == []


def bincount_moe(x_TH, ids_TK, w_TK, w1_EIH, w2_EHI):
    """Counts by ``bincount(minlength=E)`` (data-dependent size: needs capture_dynamic_output_shape_ops)."""
    ids_S = ids_TK.reshape(-1)
    perm = torch.argsort(ids_S, stable=True)
    rows = x_TH.index_select(0, perm // 2)
    offs = torch.cumsum(torch.bincount(ids_S, minlength=4), 0).to(torch.int32)
    y = torch._grouped_mm(F.silu(torch._grouped_mm(rows, w1_EIH.transpose(-2, -1), offs=offs)),
                          w2_EHI.transpose(-2, -1), offs=offs)
    y = y * w_TK.reshape(-1)[perm].unsqueeze(-1)
    return torch.zeros_like(x_TH).index_add_(0, perm // 2, y)


def test_bincount_counts_with_capture_flags():
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True, capture_scalar_outputs=True):
        run = check_rewrite(bincount_moe, small_inputs(requires_grad=True), {"fuse_dispatch": 1})
    assert "counts(bincount)" in run.report.rewrites[0].what



class _SharedBiasPadded(hw.PaddedIndexPut):
    """``PaddedIndexPut`` with a trained bias shared by all rows between the grouped GEMMs (the weight of
    NOTE [tail rows] (moe_compile/passes/forms/rowwise.py)); with ``empty``, the padded buffer is ``new_empty`` (its
    pad rows uninitialised) instead of ``new_zeros``."""

    def __init__(self, *args, empty: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        inter = self.w_down.shape[-1]
        self.shared_bias = nn.Parameter(0.5 * torch.randn(inter, generator=torch.Generator().manual_seed(7))
                                        .to(self.w_down.dtype))
        self.empty = empty

    def mlp(self, rows, offs):
        h = torch._grouped_mm(rows, self.w_gate_up.transpose(-2, -1), offs=offs)
        gate, up = h.chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate + self.shared_bias) * up, self.w_down.transpose(-2, -1), offs=offs)

    def forward(self, x_TH):
        T, H = x_TH.shape
        S = T * self.top_k
        M = static_row_bound(S, self.num_experts, self.align)
        weights_TK, ids_TK = self.route(x_TH)
        perm_S, dest_S, offs_E = self.padded_layout(ids_TK.reshape(-1), S)
        token_S = perm_S // self.top_k
        rows_MH = x_TH.new_empty(M, H) if self.empty else x_TH.new_zeros(M, H)
        rows_MH[dest_S] = x_TH[token_S]
        y_S = self.mlp(rows_MH, offs_E)[dest_S].float() * weights_TK.reshape(-1)[perm_S].unsqueeze(-1)
        return torch.zeros(T, H, device=x_TH.device).index_add_(0, token_S, y_S).to(x_TH.dtype)


def test_shared_trained_weight_between_the_gemms_and_tail_rows():
    """The tail-rows question (issue 52), settled: a weight shared by all rows between the grouped GEMMs is refused in
    training (``shared_param_in_expert_region``, as strip_host_padding does). The static row bound's tail, past
    the last offset, is left unwritten by the grouped GEMM; its gradient is 0, and a shared weight sums 0 * whatever
    is there: a NaN in it made translation validation refuse this rewrite. Without gradients the rewrite stands and
    matches eager; an uninitialised buffer (``new_empty``) is not rewritten at all."""
    seed = torch.seed() % 2**16
    x = torch.randn(10, 32, generator=torch.Generator().manual_seed(seed + 1)).bfloat16().requires_grad_()
    # the layer itself reads the unwritten tail into its bias gradient (eager's and plain Inductor's values there
    # are whatever memory held): the refusal is checked by its record, not against eager
    run = compile_and_run(_SharedBiasPadded(hidden=32, seed=seed), (x,), train=True)
    assert run.report.count("fuse_dispatch") == 0
    assert [r.what for r in run.report.skips if r.pass_name == "fuse_dispatch"] == ["shared_param_in_expert_region"]
    assert not [r for r in run.report.records if r.what == "validation_failed"]
    check_rewrite(_SharedBiasPadded(hidden=32, seed=seed), (x.detach(),), {"fuse_dispatch": 1},
                  expected_skips={"fuse_dispatch": []}, train=False)
    run = compile_and_run(_SharedBiasPadded(hidden=32, seed=seed, empty=True), (x.detach(),))
    assert run.report.count("fuse_dispatch") == 0 and [r for r in run.report.skips if r.pass_name == "fuse_dispatch"]
