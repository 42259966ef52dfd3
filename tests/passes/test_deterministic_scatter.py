"""``deterministic_scatter`` (``deterministic=True``): every accumulating scatter left in the joint graph, the
token embedding's backward included, becomes ``moe.segment_sum``: no atomic add in the generated code,
results as eager within the derived layer bound; with the option off nothing changes. Also the audit's
``nondeterministic`` table and ``Report.deterministic``.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch import nn

from moe_compile import report
from moe_compile.backend import ConfiguredBackend
from moe_compile.config import make_config
from moe_compile.passes import PassContext, StagePass, deterministic_scatter
from tests.passes._harness import accumulates, check_rewrite, compile_and_run, no_accumulation

DETERMINISTIC = make_config(deterministic=True, strict=True)


class Embed(nn.Module):
    def __init__(self, padding_idx: int | None = None, scale_grad_by_freq: bool = False):
        super().__init__()
        self.embed = nn.Embedding(40, 8, padding_idx=padding_idx, scale_grad_by_freq=scale_grad_by_freq)
        self.proj = nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.embed(ids))


class Layer(nn.Module):
    """Wraps forms that keep an accumulation after ``deterministic_accumulate`` (named layer ``inner``)."""

    def __init__(self, form: str):
        super().__init__()
        self.inner = _Forms(form)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(x, ids)


class _Forms(nn.Module):
    def __init__(self, form: str, rows: int = 300):
        super().__init__()
        self.form = form
        self.table = nn.Parameter(torch.randn(rows, 6))

    def forward(self, x_TH: torch.Tensor, ids_T: torch.Tensor) -> torch.Tensor:
        R = 5
        if self.form == "gather_2d":  # backward: index_put(zeros[300, 6], [ids_2d], grad, True), past one-hot
            return self.table[ids_T.view(2, -1)].sum(0) * x_TH[: ids_T.numel() // 2]
        if self.form == "scatter_add":  # forward: repeated rows into zeros
            index = ids_T.remainder(R).unsqueeze(1).expand_as(x_TH)
            return torch.zeros(R, x_TH.shape[1]).scatter_add(0, index, x_TH * 2)
        if self.form == "scatter_add_dim1":  # elementwise indices along dim 1, into a live tensor
            index = ids_T.remainder(3).unsqueeze(0).expand(x_TH.shape[0], -1)[:, :4]
            return (x_TH[:, :3] + 1).scatter_add(1, index, x_TH[:, :4])
        if self.form == "index_put_two_indices":  # (row, slot) into a [R, 3, H] buffer (Flaxformer's scatter router)
            buf = torch.zeros(R, 3, x_TH.shape[1])
            return buf.index_put((ids_T.remainder(R), ids_T.remainder(3) - 3), x_TH * 2, accumulate=True)
        if self.form == "scatter_reduce_sum":  # a sum that leaves the zero base out (DeepSpeed FastGen's combine)
            index = ids_T.remainder(R).unsqueeze(1).expand_as(x_TH)
            return torch.zeros(R, x_TH.shape[1]).scatter_reduce(0, index, x_TH * 2, "sum", include_self=False)
        if self.form == "index_add_alpha":  # live base, alpha
            return (x_TH[:R] * 3).index_add(0, ids_T.remainder(R), x_TH, alpha=0.5)
        raise ValueError(self.form)


def _rewrites(run) -> list[str]:
    return [r.what for r in run.report.rewrites if r.pass_name == "deterministic_scatter"]


@pytest.mark.parametrize("padding_idx,scale", [(None, False), (3, False), (3, True), (None, True)])
def test_embedding_backward_becomes_segment_sum(padding_idx, scale):
    torch.manual_seed(0)
    ids = torch.randint(0, 40, (3, 7))
    ids[0, :4] = 3  # repeated rows, and the padding row
    run = check_rewrite(Embed(padding_idx, scale), (ids,), {}, backend=ConfiguredBackend(DETERMINISTIC),
                        code_checks=[no_accumulation])
    # scale_grad_by_freq: the per-row counts (an integer accumulation) too
    assert len(_rewrites(run)) == (2 if scale else 1), run.report.table()
    assert run.report.deterministic, run.report.table()
    # moe.segment_sum inlined (its CPU body: a stable sort and segment_reduce), not called back into Python
    assert any("segment_reduce" in c for c in run.code) and not any("ops.moe.segment_sum" in c for c in run.code)


@pytest.mark.parametrize("form", ["gather_2d", "scatter_add", "scatter_add_dim1", "index_add_alpha",
                                  "scatter_reduce_sum", "index_put_two_indices"])
def test_accumulations_left_by_deterministic_accumulate(form):
    torch.manual_seed(1)
    x = torch.randn(8, 6, requires_grad=True)
    ids = torch.randint(0, 300, (8,))
    run = check_rewrite(Layer(form), (x, ids), {}, backend=ConfiguredBackend(DETERMINISTIC),
                        code_checks=[no_accumulation])
    assert _rewrites(run), run.report.table()
    assert {r.layer for r in run.report.rewrites if r.pass_name == "deterministic_scatter"} == {"inner"}
    assert run.report.deterministic, run.report.table()


def test_option_off_keeps_atomics_and_reports_them():
    """Negative control: the same embedding without the option accumulates (the code check can fail)."""
    torch.manual_seed(2)
    ids = torch.randint(0, 40, (3, 7))
    run = compile_and_run(Embed(), (ids,), backend=ConfiguredBackend(make_config()), train=True, get_code=True)
    assert any(accumulates(c) for c in run.code)
    assert not _rewrites(run)
    assert not run.report.deterministic and run.report.clean, run.report.table()
    [left] = {r.what for r in run.report.nondeterministic}
    assert left.startswith("accumulate:") and "(embedding)" in left


def _traced(fn, *args) -> fx.GraphModule:
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, tracing_mode="fake")(*args)


def _ctx(config) -> PassContext:
    return PassContext(config, "joint", "deterministic_scatter", is_training=True)


@pytest.mark.parametrize("padding_idx,scale", [(-1, False), (2, False), (2, True)])
def test_raw_embedding_dense_backward(padding_idx, scale):
    """Form (c), as a graph holds it when nothing decomposed the op; the rewrite gives eager's values."""
    torch.manual_seed(3)
    grad, ids = torch.randn(4, 5, 8), torch.randint(0, 12, (4, 5))
    ids[0] = 2

    def fn(grad, ids):
        return torch.ops.aten.embedding_dense_backward(grad, ids, 12, padding_idx, scale)

    gm = _traced(fn, grad, ids)
    with report.collecting() as rep:
        deterministic_scatter.run(gm.graph, _ctx(DETERMINISTIC))
    gm.recompile()
    targets = {str(n.target) for n in gm.graph.nodes}
    # moe.segment_sum inlined as its CPU body (a stable sort of the rows, segment_reduce over the offsets)
    assert {"aten.sort.stable", "aten.segment_reduce.default"} <= targets, targets
    assert "aten.embedding_dense_backward.default" not in targets
    assert len(rep.rewrites) == 1
    torch.testing.assert_close(gm(grad, ids), fn(grad, ids), rtol=0, atol=8 * torch.finfo(torch.float32).eps * 5)


def test_option_off_leaves_the_graph_unchanged():
    """Without ``deterministic=True`` the joint stage does not run the pass (its ``requires``), even when
    ``passes=`` turns it on."""
    grad, ids = torch.randn(4, 8), torch.randint(0, 12, (4,))
    gm = _traced(lambda g, i: torch.ops.aten.embedding_dense_backward(g, i, 12, -1, False), grad, ids)
    before = str(gm.graph)
    stage = StagePass("joint", make_config(passes={"deterministic_scatter": True, "deterministic_accumulate": False,
                                                   "expert_choice": False, "routed_accumulate": False}))
    assert not stage.entries
    with report.collecting() as rep:
        stage(gm.graph)
    assert str(gm.graph) == before and not rep.records


def test_unsupported_forms_are_skipped_with_a_reason():
    base, ids, src = torch.randn(6, 3), torch.randint(0, 6, (5,)), torch.randn(5, 3)
    gm = _traced(lambda b, i, s: b.index_reduce(0, i, s, "mean").scatter_reduce(0, i.unsqueeze(1).expand(-1, 3), s,
                                                                                 "amax"), base, ids, src)
    with report.collecting() as rep:
        deterministic_scatter.run(gm.graph, _ctx(DETERMINISTIC))
    assert [r.what for r in rep.skips] == ["unsupported_form", "unsupported_form"]


def _graph_with(target, value: torch.Tensor) -> fx.Graph:
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = value
    node = graph.call_function(target, (x, x, x))
    graph.output(node)
    return graph


def test_audit_names_nondeterministic_library_ops():
    from moe_compile.passes import audit

    attn_bwd = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default
    on_meta = audit.find(_graph_with(attn_bwd, torch.empty(2, device="meta")))  # device unknown: reported
    assert [(f.kind, f.what.split(" ")[0]) for f in on_meta] == [("nondeterministic", "_scaled_dot_product_"
                                                                  "efficient_attention_backward.default")]
    assert "atomic adds" in on_meta[0].what
    assert audit.find(_graph_with(attn_bwd, torch.empty(2))) == []  # a CUDA-only entry, on CPU


def test_report_deterministic_and_explain_with_the_option():
    import moe_compile

    ids = torch.randint(0, 40, (2, 5))
    off = moe_compile.explain(Embed(), ids)
    on = moe_compile.explain(Embed(), ids, compile_options={"deterministic": True})
    assert not off.deterministic and off.nondeterministic
    assert on.deterministic and not on.nondeterministic, on.table()
    assert on.to_dict()["summary"]["deterministic"] is True
    on_text, off_text = (" ".join(r.table().split()) for r in (on, off))
    assert "; deterministic" in on_text and "1 non-deterministic source(s) left" in off_text


class SlotBufferMoE(nn.Module):
    """Tutel's fast dispatch written with ``index_add_``: each (token, choice) row added into a ``[E*C + 1, H]`` buffer
    at slot ``e*C + position`` (the spare last row takes the choices past capacity), experts on the slots, the
    tokens gathered back from them and summed: no pass reads this dispatch, but every index is a routing choice."""

    def __init__(self, hidden=8, experts=4, capacity=5, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.E, self.C = experts, capacity
        self.router = nn.Parameter(torch.randn(hidden, experts, generator=gen))
        self.w = nn.Parameter(torch.randn(experts, hidden, hidden, generator=gen) / hidden ** 0.5)

    def forward(self, x):
        E, C = self.E, self.C
        probs, ids = (x @ self.router).softmax(-1).topk(2, -1)
        one_hot = torch.zeros(x.shape[0], 2, E).scatter_(2, ids.unsqueeze(-1), 1.0).reshape(-1, E)
        position = ((one_hot.cumsum(0) - 1) * one_hot).sum(-1).long()
        slot = torch.where(position < C, ids.reshape(-1) * C + position, E * C)
        rows = x.repeat_interleave(2, 0)
        buffer = torch.zeros(E * C + 1, x.shape[1]).index_add_(0, slot, rows)
        expert_out = torch.bmm(buffer[:-1].view(E, C, -1), self.w).reshape(E * C, -1)
        expert_out = torch.cat([expert_out, expert_out.new_zeros(1, expert_out.shape[1])])
        return (expert_out[slot].view(-1, 2, x.shape[1]) * probs.unsqueeze(-1)).sum(1)


def test_routed_accumulations_lose_their_atomics_by_default():
    """Pass ``routed_accumulate``, without ``deterministic=True``: the slot buffer's ``index_add_`` and the backward of
    the gather from it become ``moe.segment_sum`` (MoE rewrites), the code keeps no accumulation, and the step matches
    eager; an embedding's backward is no routing and stays
    (NOTE [routed accumulations] (moe_compile/passes/deterministic_scatter.py))."""
    seed = torch.seed() % 2**16
    torch.manual_seed(seed)
    x = torch.randn(12, 8, requires_grad=True)
    run = check_rewrite(SlotBufferMoE(seed=seed), (x,), {}, backend=ConfiguredBackend(make_config()),
                        code_checks=[no_accumulation])
    routed = [r for r in run.report.rewrites if r.pass_name == "routed_accumulate"]
    assert len(routed) >= 2 and all(r.moe for r in routed), run.report.table()
    assert run.report.clean and run.report.deterministic, run.report.table()
    ids = torch.randint(0, 40, (3, 7))
    plain = compile_and_run(Embed(), (ids,), backend=ConfiguredBackend(make_config()), train=True)
    assert not [r for r in plain.report.rewrites if r.pass_name == "routed_accumulate"]
