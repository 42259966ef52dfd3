"""``moe_compile.compile``: the capture flags reach Dynamo (first call and recompiles, modules and functions)."""

from __future__ import annotations

import inspect
import unittest
import warnings

import torch
from torch._dynamo.utils import counters

import moe_compile
from moe_compile import config, report
from tests.passes._host_padding_checks import fresh_caches


def scale_groups(x_N: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """A host-sized region: ``tolist`` + ``split`` by the counts (a graph break without the flags)."""
    sizes = counts_E.tolist()
    return torch.cat([chunk * (e + 1) for e, chunk in enumerate(torch.split(x_N, sizes))])


class KeepRouted(torch.nn.Module):
    """``.item()`` plus an op with a data-dependent output shape (``nonzero``)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, x_N: torch.Tensor) -> torch.Tensor:
        kept = torch.nonzero(x_N > 0).squeeze(1)
        total = (x_N > 0).sum().item()
        return x_N[kept].sum() * self.scale + total


def _counts(n: int) -> torch.Tensor:
    return torch.tensor([n // 2, 0, n - n // 2])


class CompileApiTest(unittest.TestCase):
    def setUp(self) -> None:
        torch._dynamo.reset()
        counters.clear()

    def tearDown(self) -> None:
        torch._dynamo.reset()

    def run_twice(self, compiled, make_args, reference) -> report.Report:
        """Call with one shape, then another (a recompile); return the records of both compiles."""
        with fresh_caches(), report.collecting() as records:
            for n in (6, 9):
                args = make_args(n)
                torch.testing.assert_close(compiled(*args), reference(*args))
        return records

    def test_function_is_captured_without_fullgraph_and_on_recompile(self):
        compiled = moe_compile.compile(scale_groups)
        records = self.run_twice(compiled, lambda n: (torch.randn(n), _counts(n)), scale_groups)
        self.assertEqual(dict(counters["graph_break"]), {})
        self.assertEqual(records.graphs, 2)  # one graph per compile: nothing left to eager
        self.assertFalse(torch._dynamo.config.capture_scalar_outputs)  # patched only during calls
        self.assertFalse(torch._dynamo.config.capture_dynamic_output_shape_ops)

    def test_module_is_captured_without_fullgraph_and_on_recompile(self):
        model = KeepRouted()
        compiled = moe_compile.compile(model)
        self.assertIsInstance(compiled, torch.nn.Module)
        records = self.run_twice(compiled, lambda n: (torch.randn(n),), model)
        self.assertEqual(dict(counters["graph_break"]), {})
        self.assertEqual(records.graphs, 2)
        self.assertIs(compiled._orig_mod, model)

    def test_without_capture_flags_dynamo_breaks_the_graph(self):
        compiled = moe_compile.compile(scale_groups, capture_host_syncs=False)
        with fresh_caches():
            x = torch.randn(6)
            torch.testing.assert_close(compiled(x, _counts(6)), scale_groups(x, _counts(6)))
        self.assertGreater(sum(counters["graph_break"].values()), 0)

    def test_uncapturable_loop_falls_back_to_graph_breaks(self):
        """NOTE [capture fallback] (moe_compile/api.py): a loop over ``nonzero(...).tolist()`` that nothing swapped
        fails to trace with the host reads captured (a data-dependent guard); the call warns once and runs with Dynamo's
        default flags (graph breaks, as plain torch.compile), and later calls stay on them."""

        def loop(x_N: torch.Tensor) -> torch.Tensor:
            out = torch.zeros_like(x_N)
            for i in torch.nonzero(x_N > 0).flatten().tolist():
                out[i] = x_N[i] * (i + 1)
            return out

        compiled = moe_compile.compile(loop)
        x = torch.randn(8)
        with fresh_caches():
            with self.assertWarnsRegex(UserWarning, "default flags"):
                torch.testing.assert_close(compiled(x), loop(x))
            self.assertGreater(sum(counters["graph_break"].values()), 0)
            y = torch.randn(8)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.testing.assert_close(compiled(y), loop(y))
            self.assertFalse([w for w in caught if "moe_compile.compile" in str(w.message)])
        self.assertFalse(torch._dynamo.config.capture_scalar_outputs)

    def test_host_read_size_inside_the_backend_falls_back_to_graph_breaks(self):
        """DeepSpeed's ``top1gating`` (the blind corpus's spelling): a capacity read on the host sizes ``topk`` and
        ``one_hot``. Traced with the host reads captured, the capacity is an unbacked size that AOTAutograd cannot
        specialise, raised inside the backend (``BackendCompilerFailed``, not Dynamo's own guard error): the same
        fallback applies (a warning naming the guard, then Dynamo's default flags) instead of an exception, and the
        output equals eager's to within the float32 rounding of its GEMMs over H = 64."""
        from tests.models.blind_corpus import LAYERS

        entry = next(e for e in LAYERS if e.name == "deepspeed_top1gating")
        layer = entry.make(torch.float32, 0)
        x = torch.randn(entry.input_shape, generator=torch.Generator().manual_seed(torch.seed() % 2**31))
        compiled = moe_compile.compile(layer)
        with fresh_caches(), torch.no_grad():
            with self.assertWarnsRegex(UserWarning, "data-dependent"):
                got = compiled(x)[0]
            torch.testing.assert_close(got, layer(x)[0], rtol=64 * 2**-23, atol=64 * 2**-23)

    def test_keywords_are_the_settings_tables_options(self):
        """The explicit compile options of ``moe_compile.compile`` are ``config.OPTIONS`` with their defaults (None
        for ``passes``: no overrides), and each one's Args entry begins with the table's doc."""
        params = inspect.signature(moe_compile.compile).parameters
        options = [name for name in params if name in config.SETTINGS]
        self.assertEqual(set(options), set(config.OPTIONS))
        own = {"model", "capture_host_syncs", "swap_expert_loops", "torch_compile_kwargs"}
        self.assertEqual(set(params) - set(options), own)
        doc = " ".join(inspect.getdoc(moe_compile.compile).replace("`", "").split())
        for name in config.OPTIONS:
            setting = config.SETTINGS[name]
            default = params[name].default
            self.assertEqual({} if default is None and setting.type is dict else default, setting.default, name)
            self.assertIn(f" {name}: {setting.doc}", doc, name)

    def test_rejects_backend_and_unknown_options(self):
        with self.assertRaisesRegex(ValueError, "backend"):
            moe_compile.compile(scale_groups, backend="inductor")
        with self.assertRaisesRegex(ValueError, "unknown pass"):
            moe_compile.compile(scale_groups, passes={"no_such_pass": False})


if __name__ == "__main__":
    unittest.main()
