"""transformers' ``"moe_compile"`` experts implementation: every decorator variant, and MoE blocks set to eager."""

from __future__ import annotations

import copy
import importlib
import itertools
import pathlib
import re
import unittest

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from transformers.integrations.moe import (  # noqa: E402
    ALL_EXPERTS_FUNCTIONS,
    batched_mm_experts_forward,
    use_experts_implementation,
)

import moe_compile  # noqa: E402
from moe_compile.api import prepare_expert_loops  # noqa: E402
from moe_compile.experts.interface import glu_of, hf_experts_forward, register_hf_experts  # noqa: E402
from tests.models.hf_models import FAMILIES, block_output, build_sparse_moe_block  # noqa: E402
from tests.passes._harness import fresh_cache, no_scatter_add  # noqa: E402

T, H, I, E, K = 10, 16, 24, 6, 2  # noqa: E741 - I: expert intermediate size
# |got - want| <= ULPS * eps * max|want| (fp32: sums over <= max(H, 2I) products, different order)
ULPS = 256


def _close(test: unittest.TestCase, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    tol = ULPS * torch.finfo(want.dtype).eps * max(want.abs().max().item(), 1.0)
    err = (got.float() - want.float()).abs().max().item()
    test.assertLessEqual(err, tol, f"{what}: {err:.3e} > {tol:.3e}")


class _Config:
    _experts_implementation = "eager"


def _experts_class(has_gate: bool, has_bias: bool, is_transposed: bool, post_norm: bool, clamp: bool):
    """A decorated experts class of one variant (what transformers' model files declare)."""

    @use_experts_implementation(is_transposed=is_transposed, has_bias=has_bias, has_gate=has_gate,
                                has_post_expert_norm=post_norm)
    class Experts(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts = E
            up_out = 2 * I if has_gate else I
            shape = lambda n, k: (E, k, n) if is_transposed else (E, n, k)  # noqa: E731
            name = "gate_up_proj" if has_gate else "up_proj"
            setattr(self, name, nn.Parameter(torch.randn(*shape(up_out, H)) / H**0.5))
            self.down_proj = nn.Parameter(torch.randn(*shape(H, I)) / I**0.5)
            if has_bias:
                setattr(self, name + "_bias", nn.Parameter(torch.randn(E, up_out) * 0.1))
                self.down_proj_bias = nn.Parameter(torch.randn(E, H) * 0.1)
            if post_norm:
                self.post_expert_norm = nn.LayerNorm(H)
            self.act_fn = nn.SiLU()

        if clamp:  # a GPT-OSS-like clamped, interleaved GLU
            def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
                gate, up = gate_up[..., ::2].clamp(max=7.0), gate_up[..., 1::2].clamp(-7.0, 7.0)
                return (up + 1) * gate * torch.sigmoid(gate * 1.702)

    return Experts


class InterfaceVariantsTest(unittest.TestCase):
    def test_registered(self):
        self.assertTrue(register_hf_experts())
        self.assertIs(ALL_EXPERTS_FUNCTIONS["moe_compile"], hf_experts_forward)

    def test_every_variant_matches_batched_mm_forward_and_backward(self):
        for has_gate, has_bias, is_transposed, post_norm in itertools.product((True, False), repeat=4):
            for clamp in ((False, True) if has_gate else (False,)):
                with self.subTest(gate=has_gate, bias=has_bias, transposed=is_transposed, post_norm=post_norm,
                                  clamp=clamp):
                    torch.manual_seed(0)
                    module = _experts_class(has_gate, has_bias, is_transposed, post_norm, clamp)(_Config())
                    x = torch.randn(T, H, requires_grad=True)
                    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
                    w = torch.rand(T, K, requires_grad=True)
                    # the concatenated SiLU GLU is recognised
                    # (NOTE [expert MLP through expert_gemm] (moe_compile/experts/interface.py)); the clamped
                    # interleaved one is not
                    glu = glu_of(module._apply_gate) if has_gate else None
                    self.assertEqual(glu, "swiglu" if has_gate and not clamp else None)
                    outs, grads = [], []
                    for fn in (batched_mm_experts_forward, hf_experts_forward):
                        module._moe_compile_glu = glu  # training: the grouped GEMMs all the same
                        module.zero_grad(set_to_none=True)
                        x.grad = w.grad = None
                        y = fn(module, x, ids, w)
                        y.square().sum().backward()
                        outs.append(y.detach())
                        grads.append([x.grad, w.grad] + [p.grad for p in module.parameters()])
                    _close(self, outs[1], outs[0], "output")
                    for i, (g, r) in enumerate(zip(grads[1], grads[0])):
                        _close(self, g, r, f"grad {i}")
                    with torch.no_grad():  # inference: through moe.expert_gemm where glu is set
                        _close(self, hf_experts_forward(module, x, ids, w), outs[0], "output (inference)")

    def test_glu_recognised_by_what_it_computes(self):
        """SiLU / erf-GELU GLUs over a gate-first ``gate_up`` however written; other functions and layouts not."""
        F = torch.nn.functional
        halves = lambda z: z.chunk(2, dim=-1)  # noqa: E731
        cases = {
            "swiglu": [lambda z: F.silu(halves(z)[0]) * halves(z)[1], lambda z: nn.SiLU()(z[:, :32]) * z[:, 32:],
                       lambda z: halves(z)[0] * torch.sigmoid(halves(z)[0]) * halves(z)[1]],
            "geglu": [lambda z: F.gelu(halves(z)[0]) * halves(z)[1], lambda z: nn.GELU()(z[:, :32]) * z[:, 32:]],
            None: [lambda z: F.gelu(halves(z)[0], approximate="tanh") * halves(z)[1],
                   # a SwiGLU clamped at 30 (Step3p7Experts._apply_gate with a swiglu limit): the fused GLU has no
                   # clamp, and values of a few units never reach it
                   lambda z: F.silu(halves(z)[0]).clamp(max=30) * halves(z)[1].clamp(-30, 30),
                   lambda z: F.silu(z[:, ::2]) * z[:, 1::2], lambda z: halves(z)[1] * F.silu(halves(z)[1]),
                   lambda z: F.silu(halves(z)[0]) + halves(z)[1], lambda z: z.tolist()],
        }
        for want, middles in cases.items():
            for i, middle in enumerate(middles):
                self.assertEqual(glu_of(middle), want, f"{want} #{i}")

    def test_expert_parallel_falls_back_with_a_reason(self):
        module = _experts_class(True, False, False, False, False)(_Config())
        module._is_expert_parallel = True
        records = prepare_expert_loops(module)
        self.assertEqual([(r.kind, r.what) for r in records], [("skip", "expert_parallel")])
        self.assertEqual(module.config._experts_implementation, "eager")


def _block(family: str, dtype=torch.float32) -> nn.Module:
    block = build_sparse_moe_block(family, dtype=dtype)
    for m in block.modules():
        if hasattr(m, "config"):
            m.config._experts_implementation = "eager"
    return block


def _check_block(test: unittest.TestCase, family: str, train: bool) -> None:
    torch._dynamo.reset()
    block = _block(family)
    eager = copy.deepcopy(block)
    x = torch.randn(2, 7, block_output(eager(torch.zeros(1, 1, 64))).shape[-1])
    compiled = moe_compile.compile(block, fullgraph=True)
    records = [r for r in moe_compile.report.module_records(block) if r.pass_name == "experts_impl"]
    test.assertEqual([(r.kind, r.what) for r in records], [("rewrite", "experts_implementation=eager")])
    results = []
    for fn in (eager, compiled):
        xi = x.clone().requires_grad_(train)

        def step():
            y = block_output(fn(xi))
            if train:
                y.square().mean().backward()
            return y.detach()

        if fn is compiled:
            from torch._inductor.utils import run_and_get_code

            with fresh_cache():
                y, codes = run_and_get_code(step)
            for code in codes:
                no_scatter_add(code)
        else:
            y = step()
        results.append((y, [xi.grad] if train else []))
    _close(test, results[1][0], results[0][0], f"{family} output")
    for g, r in zip(results[1][1], results[0][1]):
        _close(test, g, r, f"{family} input grad")
    for (name, p), q in zip(block.named_parameters(), eager.parameters()):
        if train and q.grad is not None:
            _close(test, p.grad, q.grad, f"{family} {name}.grad")


class EagerExpertsBlocksTest(unittest.TestCase):
    def test_mixtral_block_training(self):
        _check_block(self, "mixtral", train=True)

    @pytest.mark.slow
    def test_every_family_training_and_inference(self):
        for family, train in itertools.product(FAMILIES, (True, False)):
            with self.subTest(family=family, train=train):
                _check_block(self, family, train)


def decorated_experts_classes() -> list[tuple[str, str]]:
    """``(model module, experts class)`` for every ``@use_experts_implementation`` class installed."""
    root = pathlib.Path(transformers.__file__).parent / "models"
    found = []
    for path in sorted(root.glob("*/modeling_*.py")):
        text = path.read_text()
        for match in re.finditer(r"@use_experts_implementation[^\n]*\n(?:@[^\n]*\n)*class (\w+)", text):
            found.append((f"transformers.models.{path.parent.name}.{path.stem}", match.group(1)))
    return found


class InstalledFamiliesTest(unittest.TestCase):
    def test_installed_transformers_has_decorated_experts(self):
        classes = decorated_experts_classes()
        self.assertGreaterEqual(len(classes), len(FAMILIES))
        names = {c for _, c in classes}
        for family_class in ("MixtralExperts", "Qwen3MoeExperts", "OlmoeExperts"):
            self.assertIn(family_class, names)

    @pytest.mark.slow
    def test_every_installed_experts_class_matches_its_eager_loop(self):
        for module_name, class_name in decorated_experts_classes():
            with self.subTest(cls=class_name):
                module = importlib.import_module(module_name)
                cls = getattr(module, class_name)
                config_cls = _config_class(module, cls)
                try:
                    config = config_cls(hidden_size=H, intermediate_size=I, moe_intermediate_size=I,
                                        num_local_experts=E, num_experts=E, num_experts_per_tok=K)
                    config._experts_implementation = "eager"
                    torch.manual_seed(0)
                    experts = cls(config)
                except Exception as err:  # noqa: BLE001 - some experts need extra config fields
                    self.skipTest(f"{class_name}: cannot build from a tiny {config_cls.__name__} ({err})")
                for p in experts.parameters():
                    nn.init.normal_(p, std=0.1)
                n = experts.num_experts
                x = torch.randn(T, config.hidden_size)
                for k in (K, 1):  # transformers 5.25's ErgoExpertProjections takes one route per row (its caller
                    ids = torch.stack([torch.randperm(n)[:k] for _ in range(T)])  # repeats the tokens K times)
                    w = torch.rand(T, k)
                    try:
                        want = experts(x, ids, w)
                        break
                    except (IndexError, RuntimeError):
                        if k == 1:
                            raise
                if torch.equal(experts(x, ids, 2 * w), want):
                    # its own forward ignores the weights (ErgoExpertProjections: "a single route with unit weight";
                    # its caller passes ones), as the interface's backends do not: compared where they agree
                    w = torch.ones_like(w)
                    want = experts(x, ids, w)
                records = prepare_expert_loops(experts)
                got = experts(x, ids, w)
                if records and records[0].kind == "rewrite":
                    _close(self, got, want, class_name)


def _config_class(module, cls: type) -> type:
    """The config class the experts read: a ``*TextConfig`` for multimodal models, else the model's config."""
    from transformers import PretrainedConfig

    configs = {name: getattr(module, name) for name in dir(module) if name.endswith("Config")}
    configs = {n: c for n, c in configs.items() if isinstance(c, type) and issubclass(c, PretrainedConfig)}
    prefix = cls.__name__.removesuffix("Experts")
    for name in (f"{prefix}Config", *(n for n in configs if n.endswith("TextConfig")), *configs):
        if name in configs and "Audio" not in name and "Vision" not in name:
            return configs[name]
    return PretrainedConfig


if __name__ == "__main__":
    unittest.main()


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_quantised_experts_take_the_fused_path(recipe, device):
    """transformers' Qwen3-MoE block set to eager, its experts quantised (``GroupedQuantWeight``, which runs the
    experts' GEMMs itself: ``handles_expert_gemm``): the experts interface takes it (a rewrite record, no
    ``weight_subclass`` skip), and inference (the GLU fused into the quantised ``moe.expert_gemm``), training (the
    grouped GEMMs; straight-through weight gradients) and ``moe_compile.compile`` match the class's eager loop on the
    same quantised weights within the layer bound. Before, the eager loop ran, and compiling it crashed in Dynamo."""
    pytest.importorskip("torchao")
    from moe_compile.experts.interface import use_fused_hf_experts
    from moe_compile.experts.quantize import quantize_experts
    from tests._tolerance import assert_layer_close, gemm_k_dims

    block = build_sparse_moe_block("qwen3_moe", dtype=torch.bfloat16, device=device)
    block.experts.config._experts_implementation = "eager"
    eager = quantize_experts(copy.deepcopy(block), recipe)
    fused = copy.deepcopy(eager)
    records = use_fused_hf_experts(fused)
    assert [r[1] for r in records] == ["rewrite"], records
    k_dims = gemm_k_dims([fused.experts.gate_up_proj, fused.experts.down_proj])
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16).to(device)
    with torch.no_grad():
        want = block_output(eager(x))
        assert_layer_close(block_output(fused(x)), want, k_dims, what="inference")
        torch._dynamo.reset()
        assert_layer_close(block_output(moe_compile.compile(fused)(x)), want, k_dims, what="compiled inference")
    grads = []
    for model in (eager, fused):
        xg = x.clone().requires_grad_()
        block_output(model(xg)).float().square().sum().backward()
        grads.append(xg.grad)
    assert_layer_close(grads[1], grads[0], k_dims, backward=True, rows=x.shape[0] * x.shape[1], what="dX")
