"""Expert-loop blocks (``nonzero``-driven loops over ModuleList / stacked experts) swapped onto the fused path."""

from __future__ import annotations

import collections
import copy
import itertools
import unittest

import pytest
import torch
from torch import nn
from torch._inductor.utils import run_and_get_code

import moe_compile
from moe_compile import report
from moe_compile.api import prepare_expert_loops
from moe_compile.experts._grad_views import _grad_python_refs
from moe_compile.experts.swap import swap_expert_loops
from tests.models.loop_models import LogitsLoopMoE, LoopMoE, SigmoidRoutedLoopMoE, make_loop_moe
from tests.passes._harness import fresh_cache, no_scatter_add

H = 32
# |compiled - eager| <= TOL_ULPS * eps(dtype) * max|eager|: a few roundings of sums over <= max(H, I) terms
TOL_ULPS = {torch.float32: 256, torch.bfloat16: 8}
HOST_SYNCS = {"nonzero", "item", "tolist", "_local_scalar_dense", "index_add_", "index_add", "where"}


def _assert_close(test: unittest.TestCase, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    tol = TOL_ULPS[want.dtype] * torch.finfo(want.dtype).eps * max(want.abs().max().item(), 1.0)
    err = (got.float() - want.float()).abs().max().item()
    test.assertLessEqual(err, tol, f"{what}: max error {err:.3e} > {tol:.3e}")


def _run(block: torch.nn.Module, x: torch.Tensor, train: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = x.detach().clone().requires_grad_(train)
    y = block(x)
    if not train:
        return y.detach(), []
    y.float().square().mean().backward()
    return y.detach(), [x.grad] + [p.grad for p in block.parameters()]


def _assert_same_run(test: unittest.TestCase, got: tuple, want: tuple, what: str) -> None:
    """``_run`` results (output, gradients) of the swapped block against the loop's, elementwise."""
    (y, grads), (y_want, grads_want) = got, want
    _assert_close(test, y, y_want, f"{what} output")
    test.assertEqual(len(grads), len(grads_want))
    for i, (g, w) in enumerate(zip(grads, grads_want)):
        _assert_close(test, g, w, f"{what} grad {i}")


def _train_side_by_side(models: tuple, opts: list, steps: int, after_step=lambda step: None) -> None:
    """``steps`` optimizer steps of every model in ``models`` on the same fresh random inputs."""
    for step in range(steps):
        x = torch.randn(4, 3, H)
        for model, opt in zip(models, opts):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        after_step(step)


def _check_against_eager(test, kwargs, train, compiled: bool, dtype=torch.float32) -> moe_compile.Report | None:
    torch._dynamo.reset()
    block = make_loop_moe(seed=1, dtype=dtype, hidden=H, **kwargs)
    eager = copy.deepcopy(block)
    x = torch.randn(3, 7, H, dtype=dtype)
    want = _run(eager, x, train)
    if compiled:
        with fresh_cache():
            got = _run(moe_compile.compile(block, fullgraph=True), x, train)
    else:
        records = swap_expert_loops(block)
        test.assertEqual([r[1] for r in records], ["rewrite"], records)
        got = _run(block, x, train)
    _assert_same_run(test, got, want, str(kwargs))
    return block


CASES = [
    dict(layout=layout, mlp=mlp, weights_before=before, num_experts=E, top_k=K)
    for layout, mlp, before, (E, K) in itertools.product(
        ("module_list", "stacked"), ("swiglu", "gelu_bias"), (False, True), ((1, 1), (6, 2), (8, 1), (8, 2), (6, 6)))
]
# a default-size slice covering each layout, MLP, weight position, E in {1, 6, 8} and K in {1, 2, E}
FAST_CASES = [CASES[i] for i in (0, 6, 14, 22, 28, 37)]


class SwapNumericsTest(unittest.TestCase):
    def test_swapped_eager_matches_loop_training(self):
        for kwargs in FAST_CASES:
            with self.subTest(**kwargs):
                _check_against_eager(self, kwargs, train=True, compiled=False)

    def test_compiled_matches_loop_training_and_inference(self):
        for kwargs, train in ((FAST_CASES[1], True), (FAST_CASES[4], False)):
            with self.subTest(train=train, **kwargs):
                _check_against_eager(self, kwargs, train=train, compiled=True)

    @pytest.mark.slow
    def test_compiled_matches_loop_full_matrix(self):
        for kwargs, train in itertools.product(CASES, (False, True)):
            with self.subTest(train=train, **kwargs):
                _check_against_eager(self, kwargs, train=train, compiled=True)

    def test_bf16_probe_picks_the_weight_position(self):
        """In bf16 a wrong candidate (weights after the MLP) can be close to a weights-before block: the
        closest one must win."""
        kwargs = dict(layout="stacked", mlp="swiglu", weights_before=True, num_experts=8, top_k=2)
        _check_against_eager(self, kwargs, train=False, compiled=False, dtype=torch.bfloat16)

    @pytest.mark.slow
    def test_bf16_compiled_matches_loop(self):
        for kwargs in FAST_CASES:
            with self.subTest(**kwargs):
                _check_against_eager(self, kwargs, train=True, compiled=True, dtype=torch.bfloat16)


class SwapBiasLayoutTest(unittest.TestCase):
    def test_gated_experts_with_biases(self):
        """Gate and up share one grouped leaf when both or neither have a bias; a bias on only one of them keeps
        three leaves. Either way the swapped block trains like the loop (output and every gradient)."""
        for biased, fused in (({"w1", "w3", "w2"}, True), ({"w1", "w2"}, False), ({"w3"}, False)):
            with self.subTest(biased=sorted(biased)):
                block = make_loop_moe(seed=2, hidden=H, mlp="swiglu", num_experts=6, top_k=2)
                for expert in block.experts:
                    for name in biased:
                        lin = getattr(expert, name)
                        new = nn.Linear(lin.in_features, lin.out_features, bias=True)
                        with torch.no_grad():
                            new.weight.copy_(lin.weight)
                            new.bias.normal_()
                        setattr(expert, name, new)
                eager = copy.deepcopy(block)
                x = torch.randn(3, 7, H)
                want = _run(eager, x, train=True)
                records = swap_expert_loops(block)
                self.assertEqual([r[1] for r in records], ["rewrite"], records)
                self.assertEqual(block._moe_compile_views.fused, fused)
                _assert_same_run(self, _run(block, x, train=True), want, f"biases on {sorted(biased)}")


class SwapGraphTest(unittest.TestCase):
    def _graph(self, inference: bool = False, **kwargs) -> torch.fx.GraphModule:
        torch._dynamo.reset()
        block = make_loop_moe(hidden=H, **kwargs)
        prepare_expert_loops(block)
        graphs = []

        def capture(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        with torch.set_grad_enabled(not inference):
            torch.compile(block, backend=capture, fullgraph=True)(torch.randn(2, 5, H))
        self.assertEqual(len(graphs), 1)
        return graphs[0]

    def test_one_grouped_gemm_per_projection_no_host_sync(self):
        # a gated ModuleList MLP: gate and up share one grouped leaf, so two GEMMs (gate_up, down); SwiGLU without
        # biases in inference through moe.expert_gemm
        # (NOTE [expert MLP through expert_gemm] (moe_compile/experts/interface.py)), in training and a biased GELU MLP
        # through grouped_mm
        for kwargs, gemm in ((dict(mlp="swiglu", inference=True), "expert_gemm.default"),
                             (dict(mlp="swiglu"), "grouped_mm.default"),
                             (dict(mlp="gelu_bias", layout="stacked"), "grouped_mm.default")):
            with self.subTest(**kwargs):
                gm = self._graph(**kwargs)
                targets = collections.Counter(
                    getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes
                    if n.op in ("call_function", "call_method"))
                self.assertEqual(targets["grouped_mm.default"] + targets["expert_gemm.default"], 2, targets)
                self.assertEqual(targets[gemm], 2, targets)
                self.assertEqual(targets["permute_pad.default"], 1, targets)
                self.assertEqual(targets["unpad_unpermute.default"], 1, targets)
                self.assertFalse(HOST_SYNCS & {str(t).split(".")[-1] for t in targets}, targets)
                self.assertFalse([t for t in targets if "linear" in str(t) and targets[t] > 1], targets)

    def test_generated_code_has_no_atomics(self):
        torch._dynamo.reset()
        block = make_loop_moe(hidden=H, mlp="gelu_bias", num_experts=6, top_k=2)
        compiled = moe_compile.compile(block, fullgraph=True)
        x = torch.randn(2, 5, H, requires_grad=True)

        def step():
            compiled(x).square().sum().backward()

        with fresh_cache():
            _, codes = run_and_get_code(step)
        self.assertEqual(len(codes), 2)  # forward and backward
        for code in codes:
            no_scatter_add(code)


class SwapParametersTest(unittest.TestCase):
    def test_state_dict_and_parameters_unchanged(self):
        block = make_loop_moe(hidden=H, mlp="gelu_bias")
        before = {k: v.clone() for k, v in block.state_dict().items()}
        params = list(block.parameters())
        swap_expert_loops(block)
        after = block.state_dict()
        self.assertEqual(list(before), list(after))
        for k in before:
            self.assertTrue(torch.equal(before[k], after[k]), k)
        self.assertEqual([id(p) for p in params], [id(p) for p in block.parameters()])
        self.assertTrue(all(p.is_leaf for p in block.parameters()))

    def test_optimizer_built_before_swap_keeps_training(self):
        block = make_loop_moe(seed=2, hidden=H)
        eager = copy.deepcopy(block)
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (block, eager)]
        swap_expert_loops(block)
        _train_side_by_side((block, eager), opts, steps=3)
        for (name, p), q in zip(block.named_parameters(), eager.parameters()):
            _assert_close(self, p.detach(), q.detach(), name)
        x = torch.randn(4, 3, H)
        _assert_close(self, block(x).detach(), eager(x).detach(), "after optimizer steps")

    @pytest.mark.skipif(_grad_python_refs() is None, reason="this torch cannot swap storage data pointers")
    def test_compiled_training_recycles_gradient_views(self):
        """Under ``moe_compile.compile`` (no CUDA graphs) the per-expert gradients are the same view objects every
        step, their memory is freed by the first call after ``zero_grad``, and training matches the loop's."""
        torch._dynamo.reset()
        block = make_loop_moe(seed=6, hidden=H)
        eager = copy.deepcopy(block)
        compiled = moe_compile.compile(block)
        grad_views = block._moe_compile_views.grad_views
        self.assertTrue(grad_views and all(v.recycle for v in grad_views))
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (block, eager)]
        kept = []

        def same_views_every_step(step: int) -> None:
            if kept:
                self.assertTrue(all(v.views is k for v, k in zip(grad_views, kept)), step)
            kept[:] = [v.views for v in grad_views]
            self.assertTrue(all(len(k) > 0 for k in kept), step)

        with fresh_cache():
            _train_side_by_side((compiled, eager), opts, steps=3, after_step=same_views_every_step)
            opts[0].zero_grad()
            compiled(torch.randn(2, 3, H))
        self.assertTrue(all(v.carrier.untyped_storage().nbytes() == 0 for v in grad_views))
        for (name, p), q in zip(block.named_parameters(), eager.parameters()):
            _assert_close(self, p.detach(), q.detach(), name)

    def test_no_gradient_recycling_under_cuda_graphs(self):
        for kwargs in ({"mode": "reduce-overhead"}, {"options": {"triton.cudagraphs": True}}):
            block = make_loop_moe(hidden=H)
            moe_compile.compile(block, **kwargs)
            self.assertFalse(any(v.recycle for v in block._moe_compile_views.grad_views), kwargs)
            moe_compile.compile(block)  # the graphed compile may still be called: recycling stays off
            self.assertFalse(any(v.recycle for v in block._moe_compile_views.grad_views), kwargs)

    def test_dtype_move_after_swap_regroups(self):
        block = make_loop_moe(hidden=H)
        eager = copy.deepcopy(block).to(torch.bfloat16)
        swap_expert_loops(block)
        block.to(torch.bfloat16)
        x = torch.randn(2, 5, H, dtype=torch.bfloat16)
        _assert_close(self, block(x), eager(x), "after .to(bf16)")

    def test_deepcopy_after_swap_owns_its_weights(self):
        block = make_loop_moe(seed=5, hidden=H)
        swap_expert_loops(block)
        twin = copy.deepcopy(block)
        reference = make_loop_moe(seed=5, hidden=H)
        with torch.no_grad():
            for p, q in zip(twin.parameters(), reference.parameters()):
                p.mul_(0.5)
                q.mul_(0.5)
        x = torch.randn(2, 5, H)
        _assert_close(self, twin(x).detach(), reference(x).detach(), "deep copy")
        _assert_close(self, block(x).detach(), make_loop_moe(seed=5, hidden=H)(x).detach(), "original")

    def test_block_returning_router_logits(self):
        torch.manual_seed(0)
        block = LogitsLoopMoE(hidden=H)
        eager = copy.deepcopy(block)
        self.assertEqual([r[1] for r in swap_expert_loops(block)], ["rewrite"])
        x = torch.randn(2, 5, H)
        (y, logits), (y_ref, logits_ref) = block(x), eager(x)
        _assert_close(self, y.detach(), y_ref.detach(), "output")
        self.assertTrue(torch.equal(logits, logits_ref))

    def test_load_state_dict_reaches_the_grouped_weight(self):
        block, other = make_loop_moe(seed=3, hidden=H), make_loop_moe(seed=4, hidden=H)
        swap_expert_loops(block)
        block.load_state_dict(other.state_dict())
        x = torch.randn(2, 5, H)
        _assert_close(self, block(x).detach(), other(x).detach(), "after load_state_dict")


class _Gate3D(nn.Module):
    """A router written for ``[B, S, H]`` inputs only, returning ``(topk_idx, topk_weight)`` (DeepSeek-V2's ``MoEGate``
    unpacks ``bsz, seq_len, h = hidden_states.shape``)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, max_len: int | None = None) -> None:
        super().__init__()
        self.top_k, self.max_len = top_k, max_len
        self.weight = nn.Parameter(torch.randn(num_experts, hidden) * hidden**-0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, h = x.shape
        if self.training and self.max_len is not None and s > self.max_len:
            raise ValueError(f"sequence of {s} tokens, longer than the {self.max_len} this gate was trained for")
        scores = torch.softmax(nn.functional.linear(x.reshape(b * s, h), self.weight), dim=-1)
        weight, idx = torch.topk(scores, self.top_k, dim=-1)
        return idx, weight


class ThreeDRouterLoopMoE(LoopMoE):
    def __init__(self, max_len: int | None = None) -> None:
        super().__init__(hidden=H)
        self.gate = _Gate3D(H, self.num_experts, self.top_k, max_len)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        ids_TK, weights_TK = self.gate(hidden)
        x_TH = hidden.reshape(-1, hidden.shape[-1])
        out_TH = torch.zeros_like(x_TH)
        for e in torch.nonzero(torch.bincount(ids_TK.flatten(), minlength=self.num_experts)).flatten().tolist():
            tokens, k_pos = torch.where(ids_TK == e)
            out_TH.index_add_(0, tokens, self.experts[e](x_TH[tokens]) * weights_TK[tokens, k_pos, None])
        return out_TH.reshape(hidden.shape)


def test_router_taking_only_bsh_input_is_swapped():
    """A router that takes only ``[B, S, H]`` is called with the block's input as the block calls it
    (NOTE [recorded router call] (moe_compile/experts/_swap_router_call.py)): swapped, and the swapped block matches
    the original."""
    torch.manual_seed(torch.seed() % 2**31)
    block = ThreeDRouterLoopMoE()
    reference = copy.deepcopy(block)
    records = swap_expert_loops(block)
    assert [r[1:3] for r in records] == [("rewrite", "expert_loop_swapped")], records
    x = torch.randn(2, 7, H)
    torch.testing.assert_close(block(x), reference(x), rtol=1e-5, atol=1e-5)


def test_block_whose_code_raises_on_the_probe_is_left_alone():
    """A router that raises on the probe's ``[4, 64, H]`` in training (longer than it accepts) is the block's own code
    failing on a call it was not written for: the block is left as written (``probe_failed``, naming the error),
    and ``moe_compile.compile`` does not fail on it."""
    torch.manual_seed(torch.seed() % 2**31)
    block = ThreeDRouterLoopMoE(max_len=32)
    forward = block.forward
    records = swap_expert_loops(block)
    assert [r[1:3] for r in records] == [("skip", "probe_failed")], records
    assert "ValueError" in records[0][3] and block.forward == forward
    fresh = ThreeDRouterLoopMoE(max_len=32)
    moe_compile.compile(fresh)  # the swap runs here: it used to raise the router's ValueError
    assert fresh.forward == ThreeDRouterLoopMoE.forward.__get__(fresh)


class SwapExplainTest(unittest.TestCase):
    def test_explain_reports_swapped_and_left_alone(self):
        model = torch.nn.ModuleDict({"good": make_loop_moe(hidden=H), "odd": SigmoidRoutedLoopMoE(hidden=H)})
        model_fn = torch.nn.Module()
        model_fn.blocks = model
        model_fn.forward = lambda x: model["good"](x) + model["odd"](x)  # type: ignore[method-assign]
        records = prepare_expert_loops(model_fn)
        got = {(r.layer, r.kind, r.what) for r in records}
        self.assertEqual(got, {("blocks.good", "rewrite", "expert_loop_swapped"),
                               ("blocks.odd", "skip", "probe_mismatch")})
        self.assertEqual(report.module_records(model_fn), records)
        self.assertEqual(prepare_expert_loops(model_fn), [r for r in records if r.kind == "skip"])

    def test_explain_table_lists_the_swap(self):
        block = make_loop_moe(hidden=H)
        rep = moe_compile.explain(block, torch.randn(2, 5, H))
        swaps = [r for r in rep.records if r.pass_name == "swap_expert_loops"]
        self.assertEqual([(r.kind, r.what) for r in swaps], [("rewrite", "expert_loop_swapped")])
        self.assertIn("expert_loop_swapped", rep.table())


if __name__ == "__main__":
    unittest.main()


# mxfp8's swap in the slow run on CPU (nvfp4 takes the same route; test_fuse_expert_mlp fuses both)
@pytest.mark.parametrize("recipe", [pytest.param("mxfp8", marks=pytest.mark.slow), "nvfp4"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_quantised_module_list_loop_is_swapped(recipe, device):
    """``quantize_experts`` turns ModuleList experts into a ``GroupedExpertList`` (grouped quantised weights, the
    experts' linears views of them); its loop is swapped onto the grouped weights by their projection names
    (``w1``, not ``w1_weight``). Inference, compiled inference (no capture fallback) and training dX match the
    block's own quantised loop within the layer bound. Before, the swap skipped it (``unknown_expert_mlp``) and
    ``moe_compile.compile`` crashed tracing the loop."""
    import warnings

    pytest.importorskip("torchao")
    from moe_compile.experts.quantize import quantize_experts
    from tests._tolerance import assert_layer_close

    block = make_loop_moe(dtype=torch.bfloat16, hidden=64, inter=64).to(device)
    loop = quantize_experts(copy.deepcopy(block), recipe)
    swapped = copy.deepcopy(loop)
    records = swap_expert_loops(swapped)
    assert [r[1:3] for r in records] == [("rewrite", "expert_loop_swapped")], records
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16).to(device)
    k_dims = [64, 64]
    with torch.no_grad():
        want = loop(x)
        assert_layer_close(swapped(x), want, k_dims, what="inference")
        torch._dynamo.reset()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = moe_compile.compile(copy.deepcopy(loop))(x)
        assert not [w for w in caught if "moe_compile.compile" in str(w.message)]
        assert_layer_close(got, want, k_dims, what="compiled inference")
    grads = [_run(m, x, train=True)[1][0] for m in (loop, swapped)]
    assert_layer_close(grads[1], grads[0], k_dims, backward=True, rows=16, what="dX")
