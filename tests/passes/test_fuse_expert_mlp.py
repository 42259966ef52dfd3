"""fuse_expert_mlp: grouped GEMM + GLU of a rewritten layer -> moe.expert_gemm (the GLU in the epilogue).

The cross product of GLU spellings (chunk, slicing, split, ``x * sigmoid(x)``, modules, casts in between) and
GEMM spellings (``torch._grouped_mm`` on ``[E, K, N]`` weights, transformers' fallback on fp32 -> ``moe.grouped_mm``)
rewrites inference graphs and matches eager; middles that compute another function (interleaved, clamped,
tanh-GELU, up first) or whose intermediates are used elsewhere are left alone with their reason tags, and
training graphs are left alone (NOTE [expert MLP fusion in training] (moe_compile/passes/fuse_expert_mlp.py)) and still
match eager in forward and grads.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.passes._harness import check_rewrite, fresh_cache

E, K = 4, 2


def _halves(gu):
    return gu.chunk(2, dim=-1)


GLU_FORMS = {  # name -> (middle, recognised GLU or None)
    "silu_chunk": (lambda gu: F.silu(_halves(gu)[0]) * _halves(gu)[1], True),
    "silu_slices": (lambda gu: F.silu(gu[:, : gu.shape[1] // 2]) * gu[:, gu.shape[1] // 2:], True),
    "silu_split_module": (lambda gu: torch.nn.SiLU()(gu.split(gu.shape[-1] // 2, -1)[0]) * gu.split(
        gu.shape[-1] // 2, -1)[1], True),
    "sigmoid_written_out_fp32": (lambda gu: (lambda g, u: (g.float() * torch.sigmoid(g.float())).to(gu.dtype) * u)(
        *_halves(gu)), True),
    "gelu_chunk": (lambda gu: F.gelu(_halves(gu)[0]) * _halves(gu)[1], True),
    "interleaved": (lambda gu: F.silu(gu[:, ::2]) * gu[:, 1::2], False),
    "tanh_gelu": (lambda gu: F.gelu(_halves(gu)[0], approximate="tanh") * _halves(gu)[1], False),
    "clamped": (lambda gu: F.silu(_halves(gu)[0].clamp(max=7.0)) * _halves(gu)[1].clamp(-7.0, 7.0), False),
    "up_first": (lambda gu: _halves(gu)[0] * F.silu(_halves(gu)[1]), False),
}


def _moe(middle, gemm: str):
    """transformers' grouped_mm experts forward, reduced, with ``middle`` between the two grouped GEMMs."""

    def grouped(a, w_EKN, offs):
        if gemm == "fallback":
            return torch.ops.transformers.grouped_mm_fallback(a, w_EKN, offs=offs)
        return torch._grouped_mm(a, w_EKN, offs=offs)

    def moe(x_TH, ids_TK, w_TK, w13_E2IH, w2_EHI):
        ids_sorted, perm = torch.sort(ids_TK.reshape(-1))
        rows = x_TH[perm // K]
        counts = torch.histc(ids_sorted.float(), bins=E, min=0, max=E - 1)
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        h = middle(grouped(rows, w13_E2IH.transpose(-2, -1), offs))
        y = grouped(h, w2_EHI.transpose(-2, -1), offs)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.shape[0], device=perm.device)
        return (y[inv].view(x_TH.shape[0], K, -1) * w_TK.unsqueeze(-1)).sum(dim=1)

    return moe


def _inputs(dtype, T=7, H=16, I=8, seed=0):  # noqa: E741 - I: expert intermediate size
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype).requires_grad_(True)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g).to(dtype).requires_grad_(True)
    w13 = (0.3 * torch.randn(E, 2 * I, H, generator=g)).to(dtype).requires_grad_(True)
    w2 = (0.3 * torch.randn(E, H, I, generator=g)).to(dtype).requires_grad_(True)
    return x, ids, w, w13, w2


GEMMS = {"torch_grouped_mm": torch.bfloat16, "fallback": torch.float32}


@pytest.mark.parametrize("gemm", sorted(GEMMS))
@pytest.mark.parametrize("form", sorted(GLU_FORMS))
def test_glu_forms(form, gemm):
    if gemm == "fallback":
        pytest.importorskip("transformers.integrations.moe")
    elif not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch without _grouped_mm")
    middle, fused = GLU_FORMS[form]
    run = check_rewrite(_moe(middle, gemm), _inputs(GEMMS[gemm]),
                        {"fuse_dispatch": 1, "fuse_expert_mlp": int(fused)},
                        expected_skips={"fuse_expert_mlp": [] if fused else ["glu_not_recognised"]}, train=False)
    assert any(r.what.startswith("grouped_mm + ") for r in run.report.rewrites) == fused


@pytest.mark.parametrize("gemm", sorted(GEMMS))
def test_training_left_alone(gemm):
    if gemm == "fallback":
        pytest.importorskip("transformers.integrations.moe")
    elif not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch without _grouped_mm")
    check_rewrite(_moe(GLU_FORMS["silu_chunk"][0], gemm), _inputs(GEMMS[gemm]),
                  {"fuse_dispatch": 1, "fuse_expert_mlp": 0}, expected_skips={"fuse_expert_mlp": ["training"]})


def test_middle_used_elsewhere_left_alone():
    """The gate's activation also reaches the layer's output (row-wise, so the dispatch still rewrites): fusing
    would drop a value the graph needs."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch without _grouped_mm")

    def moe(x_TH, ids_TK, w_TK, w13_E2IH, w2_EHI):
        ids_sorted, perm = torch.sort(ids_TK.reshape(-1))
        rows = x_TH[perm // K]
        counts = torch.histc(ids_sorted.float(), bins=E, min=0, max=E - 1)
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        gate, up = _halves(torch._grouped_mm(rows, w13_E2IH.transpose(-2, -1), offs=offs))
        act = F.silu(gate)
        y = torch._grouped_mm(act * up, w2_EHI.transpose(-2, -1), offs=offs) + act[:, :1]
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.shape[0], device=perm.device)
        return (y[inv].view(x_TH.shape[0], K, -1) * w_TK.unsqueeze(-1)).sum(dim=1)

    check_rewrite(moe, _inputs(torch.bfloat16), {"fuse_dispatch": 1, "fuse_expert_mlp": 0},
                  expected_skips={"fuse_expert_mlp": ["middle_not_isolated"]}, train=False)


def test_dynamic_and_pass_off():
    """Dynamic shapes rewrite and match eager; with the pass off the first GEMM stays a grouped_mm and the GLU
    stays in the graph."""
    pytest.importorskip("transformers.integrations.moe")
    from moe_compile.config import MoECompileConfig
    from moe_compile.passes._graph import op_name
    from tests.passes._harness import compile_and_run

    fn = _moe(GLU_FORMS["silu_chunk"][0], "fallback")
    check_rewrite(fn, _inputs(torch.float32), {"fuse_expert_mlp": 1}, train=False)
    check_rewrite(fn, _inputs(torch.float32, T=9), {"fuse_expert_mlp": 1}, dynamic=True, train=False)
    ops = []

    def record(gm, example_inputs):
        ops.extend(op_name(n) for n in gm.graph.nodes)
        return gm.forward

    from moe_compile.passes import StagePass

    stage = StagePass("pre_grad", MoECompileConfig(passes=(("fuse_expert_mlp", False),)))

    def backend(gm, example_inputs):
        stage(gm.graph)
        gm.recompile()
        return record(gm, example_inputs)

    run = compile_and_run(fn, _inputs(torch.float32), backend=backend, train=False)
    assert run.report.count("fuse_expert_mlp") == 0
    assert "moe.expert_gemm" not in ops and ops.count("moe.grouped_mm") == 2 and "silu" in ops


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_inference_through_inductor():
    """bf16 on CUDA through the whole backend (Inductor): the GLU fused, the output within bf16 rounding of eager's
    (one GEMM and the GLU in fp32 before one cast, against eager's rounding after each op) and bitwise equal over
    two runs."""
    import moe_compile
    from moe_compile import report

    T, H, I = 256, 128, 64  # noqa: E741 - I: expert intermediate size
    args = [a.detach().cuda() if isinstance(a, torch.Tensor) else a for a in _inputs(torch.bfloat16, T=T, H=H, I=I)]
    fn = _moe(GLU_FORMS["silu_chunk"][0], "torch_grouped_mm")
    torch._dynamo.reset()
    with torch.no_grad():
        want = fn(*args)
        compiled = torch.compile(fn, backend="moe_compile")
        with fresh_cache(), report.collecting() as rep:
            got = compiled(*args)
        again = compiled(*args)
    assert rep.count("fuse_expert_mlp") == 1, rep.table()
    assert torch.equal(got, again)
    # h differs by a few bf16 roundings (eager rounds gu, silu(gate) and the product; the fused op rounds h once);
    # the down GEMM and the combine sum those differences over I and K terms: 16 ulps of the largest output leaves
    # headroom for that sum
    scale = want.float().abs().max()
    assert (got.float() - want.float()).abs().max() <= 16 * torch.finfo(torch.bfloat16).eps * scale
    moe_compile  # noqa: B018 - imported for the backend registration


_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("device,choice", [("cpu", ""), pytest.param("cuda", "", marks=[pytest.mark.gpu, _CUDA]),
                                           pytest.param("cuda", "triton", marks=[pytest.mark.gpu, _CUDA])])
def test_quantised_weights_fused(recipe, device, choice, monkeypatch):
    """transformers' Qwen3-MoE block with grouped quantised experts (``GroupedQuantWeight``), in inference: the pass
    fuses the GLU into the subclass's quantised ``moe.expert_gemm`` (no skip, no pass error or warning), and the
    output is within the layer bound of the same compile with the pass off (one GLU rounding instead of three). On
    CUDA through Inductor, with the shipped choice (the weight-only kernel plus the epilogue at these few rows) and
    the expert-GEMM family forced, bitwise over runs."""
    import copy
    import warnings

    pytest.importorskip("transformers")
    pytest.importorskip("torchao")
    from moe_compile import report
    from moe_compile.experts.quantize import quantize_experts
    from tests._tolerance import assert_layer_close, gemm_k_dims
    from tests.models.hf_models import block_output, build_sparse_moe_block

    monkeypatch.setenv("MOE_COMPILE_GROUPED_GEMM", choice)
    torch._dynamo.reset()
    block = build_sparse_moe_block("qwen3_moe", dtype=torch.bfloat16, device=device)
    block = quantize_experts(copy.deepcopy(block), recipe)
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16).to(device)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        off = {"moe.passes": {"fuse_expert_mlp": False}}
        want = block_output(torch.compile(block, backend="moe_compile", fullgraph=True, options=off)(x))
        torch._dynamo.reset()
        with fresh_cache(), report.collecting() as rep:  # a cached graph would not run the passes
            compiled = torch.compile(block, backend="moe_compile", fullgraph=True)
            got = block_output(compiled(x))
        again = block_output(compiled(x))
    assert torch.equal(got, again)
    assert not rep.errors, rep.table()
    assert not [w for w in caught if "moe_compile pass" in str(w.message)]
    assert rep.count("fuse_expert_mlp") == 1, rep.table()
    assert not [r for r in rep.skips if r.pass_name == "fuse_expert_mlp"], rep.table()
    experts = block.experts
    assert_layer_close(got, want, gemm_k_dims([experts.gate_up_proj, experts.down_proj]), torch.bfloat16)
