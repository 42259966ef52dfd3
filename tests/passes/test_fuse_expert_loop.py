"""fuse_expert_loop: an unrolled loop over split chunks through per-expert MLPs becomes grouped GEMMs."""

from __future__ import annotations

import collections
import unittest
import unittest.mock

import torch
import torch.fx as fx

from moe_compile.passes import fuse_expert_loop, strip_host_padding
from moe_compile.passes._graph import op_name
from tests import _tolerance as tol
from tests.models.host_padded import make_layer
from tests.passes._host_padding_checks import (
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


def _targets(gm: fx.GraphModule) -> collections.Counter:
    """Op names (``_graph.op_name``), with every grouped GEMM spelling counted as ``"grouped_mm"``."""
    names = (op_name(n) for n in gm.graph.nodes if n.op in ("call_function", "call_method"))
    return collections.Counter("grouped_mm" if "grouped_mm" in name else name for name in names)


class CompiledLoopTest(unittest.TestCase):
    def test_module_list_loop_training_through_api(self):
        got, want = run_layer(make_layer("loop"), layer_input(0), path="api", train=True)
        assert_matches_eager(self, got, want)
        self.assertEqual(got.records.count("fuse_expert_loop"), 1, got.records.table())
        self.assertEqual(got.records.errors, [])
        self.assertEqual(len(got.graphs), 2)
        for gm in got.graphs:
            self.assertEqual(cudagraph_blockers(gm), [])
        self.assertEqual(op_counts(got.graphs[0])["aten._grouped_mm.default"], 3)

    def test_stacked_loop_after_masked_select_inference_fullgraph(self):
        model = make_layer("loop_stacked", permute="masked_select")
        got, want = run_layer(model, layer_input(1), path="backend", train=False)
        assert_matches_eager(self, got, want)
        self.assertEqual(got.records.count("fuse_expert_loop"), 1, got.records.table())
        self.assertEqual(got.records.count("strip_host_padding"), 1, got.records.table())
        (gm,) = got.graphs
        self.assertEqual(cudagraph_blockers(gm), [])
        self.assertEqual(op_counts(gm)["moe.permute_pad.default"], 1)

    def test_regrouped_module_list_uses_the_grouped_weight_without_copies(self):
        """After ``quantize_experts(model, "bf16")`` the loop's weights are slices ``W[e]`` of one parameter:
        the grouped GEMMs take ``W`` as it is (the plain ModuleList needs a stacked copy per step)."""
        import moe_compile

        for regroup, copies in ((False, 3), (True, 0)):
            model = make_layer("loop")
            if regroup:
                moe_compile.quantize_experts(model, "bf16")
            got, want = run_layer(model, layer_input(3), path="backend", train=True)
            assert_matches_eager(self, got, want)
            self.assertEqual(got.records.count("fuse_expert_loop"), 1, got.records.table())
            forward = op_counts(got.graphs[0])
            self.assertEqual(forward["aten._grouped_mm.default"], 3)
            self.assertEqual(forward["aten.cat.default"] + forward["aten.stack.default"], copies, regroup)

    def test_two_stacked_host_loop_layers_training_fullgraph(self):
        """Two host-sized loops in one graph: rewriting the first refreshes the example values downstream, the
        second layer's ``.tolist()`` reads among them; they once got fresh unbacked symbols that no node bound,
        and AOTAutograd failed with ``PendingUnbackedSymbolNotFound`` (issue 35)."""
        model = torch.nn.Sequential(make_layer("loop", seed=0), make_layer("loop", seed=1))
        got, want = run_layer(model, layer_input(5), path="backend", train=True)
        assert_matches_eager(self, got, want)
        self.assertEqual(got.records.errors, [])
        rewritten = sorted({r.layer for r in got.records.rewrites if r.pass_name == "fuse_expert_loop"})
        self.assertEqual(rewritten, ["0", "1"], got.records.table())
        self.assertEqual(op_counts(got.graphs[0])["aten._grouped_mm.default"], 6)

    def test_negative_control_pass_off_keeps_host_syncs(self):
        model = make_layer("loop", num_experts=2, top_k=1)
        check_pass_off_keeps_host_syncs(self, model, layer_input(2), "fuse_expert_loop")


class FastLoopTest(unittest.TestCase):
    def test_fuses_module_list_and_stacked_slices(self):
        cases = [
            ("loop", torch.bfloat16, 3),  # gate, up, down per expert
            ("loop_stacked", torch.bfloat16, 2),  # w13[e], w2[e]
            ("loop", torch.float32, 3),  # torch.ops.moe.grouped_mm (torch._grouped_mm is bf16 only)
        ]
        for kind, dtype, gemms in cases:
            with self.subTest(kind=kind, dtype=str(dtype)):  # xdist sends subtest parameters: plain values
                model = make_layer(kind, dtype=dtype)
                x = layer_input(3, dtype=dtype)
                gm, inputs, ctx = run_pass_on_layer(fuse_expert_loop.run, model, x)
                self.assertEqual(len(ctx.kinds("rewrite")), 1, ctx.records)
                counts = _targets(gm)
                self.assertEqual(counts["grouped_mm"], gemms)
                for gone in ("item", "split", "matmul", "cat", "_assert_scalar", "aten._assert_scalar"):
                    self.assertEqual(counts[gone], 0, gone)
                self.assertEqual(counts["linear"], 1)  # the router
                if dtype == torch.float32:
                    names = {str(n.target) for n in gm.graph.nodes}
                    self.assertIn("moe.grouped_mm.default", names)
                with torch.no_grad():
                    k_dims = tol.gemm_k_dims(list(model.parameters()))
                    tol.assert_layer_close(gm(*inputs)[0], model(x), k_dims)

    def test_does_not_fuse_experts_that_differ(self):
        for variant, reason in (("mixed_act", "experts_not_identical"), ("bias", "per_expert_op_unsupported")):
            with self.subTest(variant=variant):
                model = make_layer("loop", variant=variant)
                x = layer_input(4)
                gm, inputs, ctx = run_pass_on_layer(fuse_expert_loop.run, model, x)
                self.assertEqual(ctx.kinds("rewrite"), [])
                self.assertIn(reason, ctx.kinds("skip"))
                self.assertEqual(_targets(gm)["grouped_mm"], 0)
                with torch.no_grad():
                    torch.testing.assert_close(gm(*inputs)[0], model(x))
                # strip_host_padding cannot fix an unfused loop either: it says why, and keeps the reads
                ctx = run_pass(strip_host_padding.run, gm)
                self.assertIn("host_read_kept", ctx.kinds("skip"))

    def test_split_without_expert_gemms_is_not_a_loop(self):
        def per_group_scale(x_NH: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
            chunks = torch.split(x_NH, counts_E.tolist())
            return torch.cat([c * (e + 1) for e, c in enumerate(chunks)])

        with unittest.mock.patch.object(torch._dynamo.config, "capture_scalar_outputs", True):
            gm, _ = dynamo_graph(per_group_scale, torch.randn(6, 4), torch.tensor([2, 1, 3]))
        ctx = run_pass(fuse_expert_loop.run, gm)
        self.assertEqual(ctx.records, [])


if __name__ == "__main__":
    unittest.main()
