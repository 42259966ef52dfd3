"""``moe_compile.explain`` tells the truth (issue 54): a layer a pass rewrote gets no contradicting skip and is named by
its module path, the MoE layers are counted once each, the model is left as it was, and ``moe_compile.last_report()``
gives the report of an actual compile without a second one."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

import moe_compile
from moe_compile import report
from moe_compile.backend import ConfiguredBackend
from moe_compile.experts.discovery import find_expert_layers
from tests.models.expert_loops import SelectionLoopMoE


def _seed() -> int:
    return random.SystemRandom().randrange(2**31)


class Layer(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.mlp = SelectionLoopMoE(hidden=16, inter=32, experts="swiglu_list", dtype=torch.float32, seed=seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class Model(nn.Module):
    """Embedding + 2 MoE layers whose expert loop the pre-grad passes rewrite (``fuse_expert_loop``,
    ``fuse_dispatch``) with the swap off, or that ``moe_compile.compile`` swaps (with it on)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.layers = nn.ModuleList([Layer(seed), Layer(seed + 1)])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return x


def _no_contradiction(rep: report.Report, expert_layers: list[str]) -> None:
    for name in expert_layers:
        mine = [r for r in rep.records if report.same_module(name, r.layer)]
        assert any(r.kind == "rewrite" and r.moe for r in mine), rep.table()
        assert not [r for r in mine if r.what in ("dispatch_form_unknown", "not_in_graph")], rep.table()


def test_block_compiled_as_the_model_is_named_and_not_contradicted():
    """The user's report: the MoE block itself given to explain, its loop rewritten by ``fuse_expert_loop`` and
    ``fuse_dispatch``. Its own code carries no module path (it is Dynamo's frame): the rewrites used to be named
    ``<graph>`` and its experts layer got ``dispatch_form_unknown`` beside them."""
    seed = _seed()
    block = SelectionLoopMoE(hidden=16, inter=32, experts="swiglu_list", dtype=torch.float32, seed=seed % 1000)
    x = torch.randn(int(torch.randint(6, 20, ())), 16, generator=torch.Generator().manual_seed(seed))
    rep = moe_compile.explain(block, x, compile_options={"swap_expert_loops": False})
    assert rep.expert_layers == ["experts"], (seed, rep.table())
    assert {r.pass_name for r in rep.moe_rewrites} >= {"fuse_expert_loop", "fuse_dispatch"}, rep.table()
    assert {r.layer for r in rep.moe_rewrites} == {"experts"}, rep.table()
    _no_contradiction(rep, ["experts"])
    assert rep.moe_layers() == ["experts"] and rep.to_dict()["summary"]["layers"] == 1, rep.table()
    assert "1 MoE layer(s) rewritten (of 1 in the model)" in " ".join(rep.table().split()), rep.table()


def test_layers_named_by_module_path_and_counted_once():
    seed = _seed()
    torch.manual_seed(seed)
    model = Model(seed % 1000)
    ids = torch.randint(0, 50, (int(torch.randint(6, 20, ())),))
    rep = moe_compile.explain(model, ids, compile_options={"swap_expert_loops": False})
    names = ["layers.0.mlp.experts", "layers.1.mlp.experts"]
    assert rep.expert_layers == names, rep.table()
    assert "<graph>" not in {r.layer for r in rep.moe_rewrites}, rep.table()
    assert {r.layer for r in rep.moe_rewrites} <= {"layers.0.mlp", "layers.1.mlp", *names}, rep.table()
    _no_contradiction(rep, names)
    assert rep.moe_layers() == names and rep.to_dict()["summary"]["layers"] == 2, rep.table()
    table = " ".join(rep.table().split())
    assert "2 MoE layer(s) rewritten (of 2 in the model)" in table and "result: rewrite = " in table, rep.table()


def test_explain_leaves_the_model_untouched():
    """``moe_compile.compile`` swaps these blocks' expert loops in place (``swap_expert_loops``); explain works on a
    copy: the model's forward, modules and state_dict (bitwise) and .grad are what they were."""
    seed = _seed()
    torch.manual_seed(seed)
    model = Model(seed % 1000)
    model.embed.weight.grad = torch.randn_like(model.embed.weight)
    modules = dict(model.named_modules())
    types = {name: type(m) for name, m in modules.items()}
    own = {name: dict(vars(m)) for name, m in modules.items()}  # instance attributes: a swapped forward lands here
    state = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    grad = model.embed.weight.grad.clone()
    forward = model.forward
    rep = moe_compile.explain(model, torch.randint(0, 50, (12,)))
    assert any(r.pass_name == "swap_expert_loops" and r.kind == "rewrite" for r in rep.records), rep.table()
    assert model.forward == forward and model.forward.__func__ is Model.forward
    after = dict(model.named_modules())
    assert after.keys() == modules.keys() and all(after[n] is m for n, m in modules.items())
    assert {name: type(m) for name, m in after.items()} == types
    for name, m in after.items():
        assert "forward" not in vars(m), name
        assert vars(m).keys() == own[name].keys(), (name, set(vars(m)) ^ set(own[name]))
    assert all(p is params[n] for n, p in model.named_parameters())
    now = model.state_dict()
    assert now.keys() == state.keys()
    for k, v in state.items():
        assert now[k].dtype == v.dtype and torch.equal(now[k], v), k
    assert torch.equal(model.embed.weight.grad, grad)
    assert all(p.grad is None for n, p in model.named_parameters() if n != "embed.weight")


def _before_the_first_call(rep: report.Report) -> None:
    """Nothing compiled yet: no records (no ``not_in_graph`` skip per experts layer, which would point at a graph
    break), and the table says to call the model first."""
    assert rep.graphs == 0 and rep.records == [], rep.table()
    assert "no graph compiled (yet)" in rep.table() and "first call" in rep.table(), rep.table()


def test_last_report_before_the_first_call_says_to_call_the_model():
    """``last_report()`` between ``moe_compile.compile(model)`` and the model's first call (no compile: cheap)."""
    model = Model(_seed() % 1000)
    moe_compile.compile(model, swap_expert_loops=False)
    assert len(find_expert_layers(model)) == 2  # experts layers that an accounting would call not_in_graph
    _before_the_first_call(moe_compile.last_report())


@pytest.mark.filterwarnings("ignore:dynamo_pgo force disabled")  # the caches are off on purpose: every pass runs
def test_last_report_gives_one_compile_without_a_second(monkeypatch):
    """``moe_compile.last_report()`` after one compiled step: the rewrites of both MoE layers, with no second compile
    (the backend is called once per Dynamo graph, and the report counts one graph)."""
    seed = _seed()
    torch.manual_seed(seed)
    model = Model(seed % 1000)
    calls = []
    real = ConfiguredBackend.__call__

    def counting(self, gm, example_inputs, *args, **kwargs):
        calls.append(len(gm.graph.nodes))
        return real(self, gm, example_inputs, *args, **kwargs)

    monkeypatch.setattr(ConfiguredBackend, "__call__", counting)
    torch._dynamo.reset()
    try:
        with torch._inductor.config.patch(force_disable_caches=True):
            compiled = moe_compile.compile(model, swap_expert_loops=False)
            _before_the_first_call(moe_compile.last_report())
            compiled(torch.randint(0, 50, (int(torch.randint(6, 20, ())),))).square().mean().backward()
        rep = moe_compile.last_report()
    finally:
        torch._dynamo.reset()
    assert len(calls) == 1 and rep.graphs == 1, (calls, rep.table())
    names = ["layers.0.mlp.experts", "layers.1.mlp.experts"]
    assert rep.moe_layers() == names, rep.table()
    _no_contradiction(rep, names)
    assert {r.pass_name for r in rep.moe_rewrites} >= {"fuse_expert_loop", "fuse_dispatch"}, rep.table()
    # the backward graph's audit (compiled at the backward call) reached it too: the embedding's accumulate
    assert [r.layer for r in rep.left if "(embedding)" in r.what] == ["embed"], rep.table()
    # explain does not take last_report over
    before = moe_compile.last_report().records
    moe_compile.explain(SelectionLoopMoE(hidden=16, inter=32, dtype=torch.float32), torch.randn(8, 16),
                        backward=False)
    assert moe_compile.last_report().records == before


@pytest.mark.parametrize("left, text", [
    ([], "clean: nothing left (audit)"),
    (["accumulate: index_put [backward of embedding] (embedding)"], "MoE layers clean; left outside them: 1 "
     "accumulate(s) in the embedding's backward (embed)"),
    (["accumulate: scatter_add"], "not clean: 1 accumulating scatter(s) / host sync(s) left"),
])
def test_summary_says_clean_only_when_nothing_is_left(left, text):
    records = [report.PassRecord("fuse_dispatch", "pre_grad", "rewrite", "moe", "sort + gather", "moe.permute_pad")]
    records += [report.PassRecord("audit", "post_grad", "left", "embed" if "embedding" in w else "moe", w, "")
                for w in left]
    table = " ".join(report.Report(records, graphs=1).table().split())
    assert text in table, table
    assert ("; left = still in the compiled graph" in table) == bool(left), table
