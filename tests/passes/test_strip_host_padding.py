"""strip_host_padding: host-padded MoE layers become static-shape and CUDA-graph safe (CPU checks).

Compiled cases check numerics against eager (forward and grads) and that the forward and backward
post-grad graphs have no CUDA-graph blocker (``get_first_incompatible_cudagraph_node``, unbacked
bindings, SymInt placeholders); a negative control with the pass off shows the check can fail.
Fast cases run the pass on Dynamo's graph directly and execute the rewritten graph eagerly.
"""

from __future__ import annotations

import itertools
import operator
import unittest
import unittest.mock

import sympy
import torch
import torch.fx as fx

from moe_compile.passes import strip_host_padding
from moe_compile.passes._host_sync import (
    ceil_align,
    erase_dead_host_reads,
    erase_if_dead,
    host_reads,
    int_vector,
    same_on_samples,
)
from tests import _tolerance as tol
from tests.models.host_padded import make_layer
from tests.passes._host_padding_checks import (
    H,
    assert_matches_eager,
    check_pass_off_keeps_host_syncs,
    cudagraph_blockers,
    dynamo_graph,
    layer_input,
    op_counts,
    run_layer,
    run_pass,
    run_pass_on_layer,
)


class CompiledLayerTest(unittest.TestCase):
    """Full pipeline (Dynamo -> our passes -> AOTAutograd -> Inductor CPU)."""

    def check(self, kind: str, *, path: str, train: bool, **layer_kwargs) -> None:
        model = make_layer(kind, **layer_kwargs)
        got, want = run_layer(model, layer_input(hash((kind, path, train)) % 1000), path=path, train=train)
        assert_matches_eager(self, got, want)
        self.assertEqual(len(got.graphs), 2 if train else 1)
        for gm in got.graphs:
            self.assertEqual(cudagraph_blockers(gm), [], gm.print_readable(print_output=False))
            self.assertEqual(op_counts(gm)["aten._local_scalar_dense.default"], 0)
        self.assertEqual(got.records.count("strip_host_padding"), 1, got.records.table())
        self.assertEqual(got.records.errors, [])
        fwd = op_counts(got.graphs[0])
        self.assertEqual(fwd["moe.permute_pad.default"], 1)
        self.assertEqual(fwd["moe.unpad_unpermute.default"], 1)
        return got

    def test_split_pad_training_through_api(self):
        self.check("split_pad", path="api", train=True)

    def test_split_pad_inference_fullgraph_backend(self):
        self.check("split_pad", path="backend", train=False, align=16)

    def test_masked_select_training_fullgraph_backend(self):
        self.check("masked_select", path="backend", train=True)

    def test_masked_select_inference_through_api(self):
        self.check("masked_select", path="api", train=False)

    def test_sort_histc_pad_scatter_unpermute_training_fullgraph_backend(self):
        self.check("sort_histc_pad", path="backend", train=True, align=16)

    def test_sort_histc_pad_gather_unpermute_inference_through_api(self):
        self.check("sort_histc_pad", path="api", train=False, combine="gather")

    def test_negative_control_pass_off_keeps_host_syncs(self):
        model = make_layer("split_pad", num_experts=2, top_k=1)
        gm = check_pass_off_keeps_host_syncs(self, model, layer_input(7), "strip_host_padding")
        self.assertGreater(op_counts(gm)["aten._local_scalar_dense.default"], 0)

    def test_pad_after_permute_pad_is_not_padded_twice(self):
        got, want = run_layer(make_layer("pre_padded"), layer_input(3), path="api", train=True)
        assert_matches_eager(self, got, want)
        for gm in got.graphs:
            self.assertEqual(cudagraph_blockers(gm), [])
        fwd = op_counts(got.graphs[0])
        self.assertEqual(fwd["moe.permute_pad.default"], 1)
        self.assertEqual(fwd["aten.constant_pad_nd.default"], 0)
        self.assertIn("already_aligned", [r.what for r in got.records.skips])


class FastRewriteTest(unittest.TestCase):
    """The pass on Dynamo's graph, executed eagerly (no Inductor)."""

    def rewrite(self, model: torch.nn.Module, x: torch.Tensor):
        return run_pass_on_layer(strip_host_padding.run, model, x)

    def assert_static(self, gm: fx.GraphModule) -> None:
        names = [str(n.target) for n in gm.graph.nodes]
        for banned in ("item", "aten._assert_scalar.default", "split", "masked_select"):
            self.assertNotIn(banned, names)
        for n in gm.graph.nodes:
            value = n.meta.get("example_value")
            if isinstance(value, torch.Tensor):
                self.assertTrue(all(isinstance(d, int) for d in value.shape), f"{n.name}: {value.shape}")

    def test_rewrites_match_eager_across_shapes(self):
        cases = [
            ("split_pad", dict(align=8), 10),
            ("split_pad", dict(align=32, num_experts=8, top_k=3), 7),
            ("split_pad", dict(align=1), 5),
            ("masked_select", dict(align=16), 9),
            ("masked_select", dict(align=8, num_experts=3, top_k=1), 4),
            ("pre_padded_ceil", dict(align=16), 6),
        ]
        for kind, kwargs, tokens in cases:
            with self.subTest(kind=kind, **kwargs):
                model = make_layer(kind, **kwargs)
                x = layer_input(tokens, tokens=tokens)
                gm, inputs, ctx = self.rewrite(model, x)
                self.assertEqual(len(ctx.kinds("rewrite")), 1, ctx.records)
                self.assert_static(gm)
                with torch.no_grad():
                    k_dims = tol.gemm_k_dims(list(model.parameters()))
                    tol.assert_layer_close(gm(*inputs)[0], model(x), k_dims)

    def test_size_checks_on_unpadded_chunks_are_not_escapes(self):
        # torch 2.11's Dynamo follows each `c[:n]` (n unbacked) with `sym_size.int(piece, 0)` and
        # `_assert_scalar(0 <= size)`; torch 2.13 does not: add them to 2.13's graph by hand
        for combine in ("scatter", "gather"):
            with self.subTest(combine=combine):
                model = make_layer("sort_histc_pad", align=16, combine=combine)
                x = layer_input(11)
                gm, inputs = dynamo_graph(model, x)
                pieces = [n for n in gm.graph.nodes if n.target is operator.getitem and isinstance(n.args[1], slice)]
                self.assertEqual(len(pieces), model.num_experts)
                for piece in pieces:
                    with gm.graph.inserting_after(piece):
                        size = gm.graph.call_function(torch.ops.aten.sym_size.int, (piece, 0))
                        size.meta["example_value"] = piece.meta["example_value"].shape[0]
                    with gm.graph.inserting_after(size):
                        ge = gm.graph.call_function(operator.ge, (size, 0))
                        ge.meta["example_value"] = size.meta["example_value"] >= 0
                    with gm.graph.inserting_after(ge):
                        gm.graph.call_function(torch.ops.aten._assert_scalar.default, (ge, "size >= 0"))
                ctx = run_pass(strip_host_padding.run, gm)
                self.assertEqual(len(ctx.kinds("rewrite")), 1, ctx.records)
                self.assert_static(gm)
                with torch.no_grad():
                    torch.testing.assert_close(gm(*inputs)[0].float(), model(x).float(), atol=3e-2, rtol=3e-2)

    def test_already_aligned_pad_is_reported(self):
        _, _, ctx = self.rewrite(make_layer("split_pad", align=1), layer_input(0))
        self.assertIn("already_aligned", ctx.kinds("skip"))
        _, _, ctx = self.rewrite(make_layer("pre_padded_ceil", align=8), layer_input(1))
        self.assertIn("already_aligned", ctx.kinds("skip"))

    def test_does_not_fire_on_unproven_regions(self):
        expected = {
            "descending": "permute_not_matched",
            "bad_pad": "pad_not_matched",
            "unpermuted_probs": "probs_not_matched",
            "row_mixing": "region_not_rowwise",
            "wrong_counts": "counts_not_histogram",
            "escape": "expert_region_escapes",
        }
        for variant, reason in expected.items():
            with self.subTest(variant=variant):
                model = make_layer("split_pad", variant=variant)
                x = layer_input(5)
                gm, inputs, ctx = self.rewrite(model, x)
                self.assertEqual(ctx.kinds("rewrite"), [])
                self.assertIn(reason, ctx.kinds("skip"))
                self.assertIn("host_read_kept", ctx.kinds("skip"))
                names = {str(n.target) for n in gm.graph.nodes}
                self.assertFalse(any("moe." in name for name in names))
                with torch.no_grad():  # the graph is left as it was
                    torch.testing.assert_close(gm(*inputs)[0], model(x))

    def test_trained_weight_shared_by_all_rows_is_refused_in_training_only(self):
        model = make_layer("split_pad", variant="shared_scale")
        gm, _ = dynamo_graph(model, layer_input(6), grad=True)
        ctx = run_pass(strip_host_padding.run, gm)
        self.assertEqual(ctx.kinds("rewrite"), [])
        self.assertIn("shared_param_in_expert_region", ctx.kinds("skip"))
        gm, inputs, ctx = self.rewrite(model, layer_input(6))  # inference: the tail rows are never read
        self.assertEqual(len(ctx.kinds("rewrite")), 1, ctx.records)
        with torch.no_grad():
            k_dims = tol.gemm_k_dims(list(model.parameters()))
            tol.assert_layer_close(gm(*inputs)[0], model(layer_input(6)), k_dims)

    def test_graph_without_host_sizes_is_left_alone(self):
        def layer(x_TH: torch.Tensor, w_HH: torch.Tensor) -> torch.Tensor:
            idx = (x_TH @ w_HH).argmax(-1) % x_TH.shape[0]
            return torch.zeros_like(x_TH).index_add_(0, idx, x_TH)

        gm, _ = dynamo_graph(layer, layer_input(0, dtype=torch.float32), torch.randn(H, H))
        before = gm.print_readable(print_output=False)
        ctx = run_pass(strip_host_padding.run, gm)
        self.assertEqual(ctx.records, [])
        self.assertEqual(gm.print_readable(print_output=False), before)


class HostSyncHelpersTest(unittest.TestCase):
    def test_same_on_samples_separates_alignments(self):
        n = sympy.Symbol("n", integer=True, nonnegative=True)
        from torch.utils._sympy.functions import FloorDiv

        self.assertTrue(same_on_samples([(ceil_align(n, 16), -16 * FloorDiv(-n, 16))], [n]))
        self.assertFalse(same_on_samples([(ceil_align(n, 16), ceil_align(n, 8))], [n]))
        self.assertFalse(same_on_samples([(n + 1, ceil_align(n, 1))], [n]))

    def test_int_vector_reads_host_offsets_and_device_cumsum(self):
        def fn(counts_E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            sizes = counts_E.tolist()
            padded = [(s + 7) // 8 * 8 for s in sizes]
            host = torch.tensor(list(itertools.accumulate(padded)), dtype=torch.int32)
            device = ((counts_E + 7) // 8 * 8).cumsum(0).to(torch.int32)
            return host, device

        with unittest.mock.patch.object(torch._dynamo.config, "capture_scalar_outputs", True):
            gm, _ = dynamo_graph(fn, torch.tensor([3, 0, 9]))
        reads = host_reads(gm.graph)
        self.assertEqual(len(reads), 3)
        out = gm.graph.output_node().args[0]
        host, device = (int_vector(node, reads) for node in out)
        self.assertIsNotNone(host)
        self.assertTrue(same_on_samples(list(zip(host, device)), set().union(*(e.free_symbols for e in host))))

    def test_dead_host_reads_and_their_asserts_are_erased(self):
        def fn(x: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            n0, n1 = counts.tolist()
            return torch.cat([x[:n0], x[:n1]]), x * 2

        with unittest.mock.patch.object(torch._dynamo.config, "capture_scalar_outputs", True):
            gm, _ = dynamo_graph(fn, torch.randn(6), torch.tensor([2, 3]))
        graph = gm.graph
        self.assertTrue(any("_assert_scalar" in str(n.target) for n in graph.nodes))
        self.assertEqual(len(erase_dead_host_reads(graph)), 2)  # still sizing the slices
        out = graph.output_node()
        cat, doubled = out.args[0]
        out.args = ((doubled, doubled),)  # what a rewrite does: the host-sized value is no longer used
        erase_if_dead([cat])
        self.assertEqual(erase_dead_host_reads(graph), [])
        self.assertFalse(any("_assert_scalar" in str(n.target) for n in graph.nodes))
        graph.lint()


if __name__ == "__main__":
    unittest.main()
