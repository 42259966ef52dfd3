"""``Report.table()``: what ``moe_compile.explain`` prints fits a 120-column terminal; ``to_dict`` keeps it all."""

from __future__ import annotations

from expecttest import assert_expected_inline

from moe_compile.report import TABLE_WIDTH, PassRecord, Report, short_chain

# records as the passes write them (taken from explain on a tiny Mixtral and on tests/models/handwritten.py)
CHAIN = ("sort(ids) + gather(x[perm//K] x1)+weights[perm] + counts(histc)->cumsum offsets + 2x grouped_mm + row-wise "
         "region (11 ops) + combine(inverse_perm_sum) + weight multiply folded into the combine")
RECORDS = [
    PassRecord("audit", "post_grad", "left", "embed_tokens",
               "accumulate: _unsafe_masked_index_put_accumulate.default [backward of embedding] (embedding)",
               "mixtral/modeling_mixtral.py:436: inputs_embeds = self.embed_tokens(input_ids)"),
    PassRecord("fuse_dispatch", "pre_grad", "rewrite", "model.layers.0.mlp.experts", CHAIN,
               "moe.permute_pad(E=8, align=1) + 2x grouped_mm(offs_E) + moe.unpad_unpermute(probs: weight folded, "
               "fp32 accumulate)"),
    *[PassRecord("replace_grouped_mm_fallback", "pre_grad", "rewrite", "model.layers.0.mlp.experts",
                 "transformers.grouped_mm_fallback (offs.tolist() host sync)", "moe.grouped_mm (sync-free)")] * 2,
    PassRecord("deterministic_accumulate", "joint", "rewrite", "model.layers.0.mlp.gate",
               "scatter_add(accumulate) [aten.topk]", "scatter (distinct indices, no accumulation)", moe=False),
    PassRecord("fuse_dispatch", "pre_grad", "skip", "bad", "weights_before_gather",
               "combine not matched: weights applied before gather (rows_1 gathers already-weighted [T*K, H] rows by "
               "perm)"),
]


def test_table_fits_120_columns():
    table = Report(list(RECORDS), graphs=2).table()
    assert max(len(line) for line in table.splitlines()) <= TABLE_WIDTH
    assert_expected_inline(table, """\
layer                       pass                         result      what
--------------------------  ---------------------------  ----------  ---------------------------------------------------
bad                         fuse_dispatch                skip        weights_before_gather
                              combine not matched: weights applied before gather (rows_1 gathers already-weighted [T*K,
                                H] rows by perm)
embed_tokens                audit                        left        accumulate:
                                                                       _unsafe_masked_index_put_accumulate.default
                                                                       [backward of embedding] (embedding)
                              mixtral/modeling_mixtral.py:436: inputs_embeds = self.embed_tokens(input_ids)
model.layers.0.mlp.experts  fuse_dispatch                rewrite     sort + gather + counts + 2x grouped_mm + row-wise +
                                                                       combine + weight
                              moe.permute_pad(E=8, align=1) + 2x grouped_mm(offs_E) + moe.unpad_unpermute(probs: weight
                                folded, fp32 accumulate)
                            replace_grouped_mm_fallback  rewrite x2  transformers.grouped_mm_fallback (offs.tolist()
                                                                       host sync)
                              moe.grouped_mm (sync-free)
model.layers.0.mlp.gate     deterministic_accumulate     non-MoE     scatter_add(accumulate) [aten.topk]
                              scatter (distinct indices, no accumulation)
result: rewrite = a pass replaced the code (what: the chain matched); non-MoE = a rewrite outside the expert dispatch;
  skip = a pass left it alone (what: the reason); left = still in the compiled graph after every pass (audit: an
  accumulating scatter, a non-deterministic kernel or a host sync)
2 graph(s) compiled; 1 MoE layer(s) rewritten, 1 non-MoE rewrite(s), 1 skip(s), 0 error(s); MoE layers clean; left
  outside them: 1 accumulate(s) in the embedding's backward (embed_tokens); 1 non-deterministic source(s) left""")


def test_rewrites_that_are_not_moe_are_counted_apart():
    """A rewrite that is no MoE rewrite (``moe=False``: a distinct-index scatter made a plain store) is marked in the
    table, counted apart in the summary, and not among the rewritten (MoE) layers of ``to_dict``."""
    rep = Report(list(RECORDS), graphs=2)
    assert [r.pass_name for r in rep.other_rewrites] == ["deterministic_accumulate"]
    assert "1 MoE layer(s) rewritten, 1 non-MoE rewrite(s)," in " ".join(rep.table().split())
    summary = rep.to_dict()["summary"]
    assert summary["rewritten_layers"] == ["model.layers.0.mlp.experts"] and summary["other_rewrites"] == 1


def test_narrow_table_still_fits():
    table = Report(list(RECORDS), graphs=1).table(width=80)
    assert max(len(line) for line in table.splitlines()) <= 80


def test_to_dict_keeps_the_full_chain():
    d = Report(list(RECORDS), graphs=2).to_dict()
    [rewrite, fallback] = d["layers"]["model.layers.0.mlp.experts"]
    assert rewrite["what"] == CHAIN and fallback["count"] == 2


def test_short_chain():
    assert short_chain(CHAIN) == "sort + gather + counts + 2x grouped_mm + row-wise + combine + weight"
    assert short_chain("weights_before_gather") == "weights_before_gather"
    assert short_chain("split -> 4 expert copies -> cat") == "split -> 4 expert copies -> cat"


def test_records_from_another_thread_reach_the_open_report():
    """On CUDA the autograd engine compiles the backward graph in its own thread: its records count."""
    import threading

    from moe_compile import report

    record = PassRecord("audit", "post_grad", "left", "model.layers.0.self_attn", "nondeterministic: x", "")
    with report.collecting() as outer:
        with report.collecting() as inner:
            worker = threading.Thread(target=report.add, args=(record,))
            worker.start()
            worker.join()
        report.add(record)
    report.add(record)
    assert inner.records == [record] and outer.records == [record, record]


def test_a_compile_served_from_inductors_caches_says_its_report_is_incomplete():
    """NOTE [cached compiles] (moe_compile/report.py): on a cache hit the joint and post-grad passes do not run; the
    report says so."""
    import torch
    from torch._inductor.utils import fresh_cache

    import moe_compile
    from moe_compile import report
    from tests.models.handwritten import SortIndexSelectScatterAdd

    layer = SortIndexSelectScatterAdd()
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(0)).bfloat16()
    reports = []
    with fresh_cache(), torch._inductor.config.patch(fx_graph_cache=True), \
            torch._functorch.config.patch(enable_autograd_cache=True):
        for _ in range(2):
            torch._dynamo.reset()
            with report.collecting() as rep:
                moe_compile.compile(layer, fullgraph=True)(x).sum().backward()
            reports.append(rep)
    torch._dynamo.reset()
    first, second = reports
    assert first.graphs == second.graphs == 1
    assert first.cached_graphs == 0 and second.cached_graphs == 1
    # the passes that ran on the hit (torch 2.11: pre-grad; 2.13: none) recorded what they did the first time
    assert first.rewrites and set(second.records) <= set(first.records), (first.records, second.records)
    assert "this report is incomplete" in second.table() and "incomplete" not in first.table()
    assert second.to_dict()["cached_graphs"] == 1


def test_deterministic_option_is_listed_per_graph():
    """With ``deterministic=True``: each compiled graph's kernels the option changed and what it left (here the
    embedding's scatter, with ``deterministic_scatter`` turned off), graph by graph across a graph break."""
    import torch
    from torch import nn

    from moe_compile.backend import ConfiguredBackend
    from moe_compile.config import make_config
    from tests.passes._harness import compile_and_run
    from tests.passes.test_causal_mask import Attention

    class TwoGraphs(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.first, self.second = nn.Embedding(20, 32), Attention("bool"), Attention("bool")

        def forward(self, ids, keep):
            x = self.first(self.embed(ids), keep)
            torch._dynamo.graph_break()
            return self.second(x, keep)

    torch.manual_seed(0)
    keep = torch.ones(2, 12, dtype=torch.bool)
    keep[1, :3] = False
    config = make_config(deterministic=True, passes={"deterministic_scatter": False})
    run = compile_and_run(TwoGraphs(), (torch.randint(0, 20, (2, 12)), keep), train=True,
                          backend=ConfiguredBackend(config))
    by_graph = run.report.option_by_graph("deterministic")
    assert len(by_graph) == 2, by_graph
    first, second = by_graph.values()
    assert any("moe.masked_attention" in line for line in first["changed"]), first
    assert any("moe.masked_attention" in line for line in second["changed"]), second
    assert any("embedding" in line for line in first["left"]) and not second["left"], by_graph
    table = run.report.table()
    assert "deterministic=True, per compiled graph" in table and table.count("left: nothing") == 1, table
    assert run.report.to_dict()["deterministic_by_graph"] == by_graph
