"""The audit: accumulating scatters and host syncs left in the compiled graphs, per layer, with the model
source line; ``Report.clean``. Compiled through ``moe_compile.explain`` (caches off: the passes run)."""

from __future__ import annotations

import torch
from torch import nn

import moe_compile
from moe_compile import report
from moe_compile.passes import audit
from tests.models import handwritten as hw
from tests.models.host_padded import make_layer


class EmbedThenMoE(nn.Module):
    """A token embedding (its backward accumulates, outside any MoE layer) feeding one MoE layer."""

    def __init__(self, moe: nn.Module, vocab: int = 40, hidden: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden, dtype=torch.bfloat16)
        self.moe = moe

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.moe(self.embed(ids))


def _left(rep, layer: str) -> list[str]:
    return sorted(r.what for r in rep.left if r.layer == layer)


def test_rewritten_layer_is_clean_and_embedding_backward_is_reported_not_counted():
    model = EmbedThenMoE(hw.SortIndexSelectScatterAdd(hidden=32))
    rep = moe_compile.explain(model, torch.randint(0, 40, (12,)))
    assert rep.count("fuse_dispatch") >= 1
    assert _left(rep, "moe") == []
    assert [w for w in _left(rep, "embed")] and all("(embedding)" in w for w in _left(rep, "embed"))
    assert rep.clean, rep.table()


def test_layer_left_alone_keeps_its_accumulate_with_the_source_line():
    """A layer no pass rewrites (routed_accumulate, which would take its routed combine, turned off) keeps its
    accumulation, reported with the user's source line."""
    model = EmbedThenMoE(hw.WeightsBeforeGather(hidden=32))
    rep = moe_compile.explain(model, torch.randint(0, 40, (12,)),
                              compile_options={"passes": {"routed_accumulate": False}})
    left = [r for r in rep.left if r.layer == "moe"]
    assert left and all(r.what.startswith("accumulate: ") for r in left), rep.table()
    assert any("handwritten.py" in r.detail for r in left), [r.detail for r in left]
    assert not rep.clean


def test_host_padded_layer_host_syncs_are_reported_until_rewritten():
    layer = make_layer("split_pad", hidden=16, num_experts=4)
    x = torch.randn(10, 16, dtype=torch.bfloat16)
    torch._dynamo.reset()
    with report.collecting() as off, torch._inductor.config.patch(force_disable_caches=True):
        moe_compile.compile(layer, passes={"strip_host_padding": False})(x)
    torch._dynamo.reset()
    syncs = [r for r in off.left if r.what.startswith("host_sync: ")]
    assert syncs and not off.clean
    assert any("_local_scalar_dense" in r.what for r in syncs)
    on = moe_compile.explain(layer, x)
    assert on.count("strip_host_padding") >= 1
    assert [r for r in on.left if r.what.startswith("host_sync: ")] == [], on.table()


def test_find_reads_ops_not_code():
    """``audit.find`` on a hand-built ATen graph: one record per accumulating / host-sync node."""
    g = torch.fx.Graph()
    x, i = g.placeholder("x"), g.placeholder("i")
    z = g.call_function(torch.ops.aten.full.default, ([4, 3], 0))
    g.call_function(torch.ops.aten.index_put.default, (z, [i], x, True))
    g.call_function(torch.ops.aten.index_put.default, (z, [i], x, False))
    g.call_function(torch.ops.aten._local_scalar_dense.default, (i,))
    kinds = sorted(f.kind for f in audit.find(g))
    assert kinds == ["accumulate", "host_sync"]
