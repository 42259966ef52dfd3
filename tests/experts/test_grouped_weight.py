"""``GroupedQuantWeight``: layouts, torchao parity, GEMM interception, views, copies, updates, errors."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moe_compile.experts import grouped_weight as gw
from moe_compile.experts.grouped_weight import GroupedQuantWeight

RECIPES = ("mxfp8", "nvfp4")


def _weight(E=3, N=16, K=64, dtype=torch.bfloat16, seed=0):
    return torch.randn(E, N, K, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def _offs(counts):
    return torch.cumsum(torch.tensor(counts), 0).to(torch.int32)


def _u8(t):
    return t.view(torch.uint8)


@pytest.mark.parametrize("recipe", RECIPES)
def test_layout_and_torchao_parity(recipe):
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    w = _weight()
    q = GroupedQuantWeight.from_hp(w, recipe)
    assert q.shape == (3, 16, 64) and q.dtype == torch.bfloat16 and not q.is_transposed
    if recipe == "mxfp8":
        ref = MXTensor.to_mx(w, torch.float8_e4m3fn, 32)
        assert q.qdata.dtype == torch.float8_e4m3fn and q.qdata.shape == (3, 16, 64)
        assert q.scale.dtype == torch.uint8 and q.scale.shape == (3, 16, 2)
        assert torch.equal(_u8(q.qdata), _u8(ref.qdata)) and torch.equal(q.scale, _u8(ref.scale))
    else:
        scale = per_tensor_amax_to_scale(w.abs().amax(dim=(1, 2)).float())
        # torchao per expert (its 3-D call with an [E, 1, 1] scale needs torchao 0.18)
        refs = [NVFP4Tensor.to_nvfp4(w[e], 16, per_tensor_scale=scale[e]) for e in range(3)]
        assert q.qdata.dtype == torch.uint8 and q.qdata.shape == (3, 16, 32)
        assert q.scale.dtype == torch.float8_e4m3fn and q.scale.shape == (3, 16, 4)
        assert torch.equal(q.qdata, torch.stack([r.qdata for r in refs]))
        assert torch.equal(_u8(q.scale), _u8(torch.stack([r.scale for r in refs])))
        assert torch.equal(q.expert_scale, scale)
        assert torch.equal(q.dequantize(), torch.stack([r.dequantize(torch.bfloat16) for r in refs]))
        return
    assert torch.equal(q.dequantize(), ref.dequantize(torch.bfloat16))


@pytest.mark.parametrize("recipe", RECIPES)
def test_one_expert_quantizes_as_its_slice_of_all(recipe):
    """``[N, K]`` alone gives the bits of its expert in ``[E, N, K]`` (NVFP4: torchao 0.18 takes a 0-dim scale for a
    2-D tensor, and before 0.18 cannot broadcast the per-expert scale over 3-D: quantised one expert at a time)."""
    w = _weight(E=4, seed=1) * torch.rand(4, 1, 1, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    every = gw.quantize_stored(w, recipe)
    one = gw.quantize_stored(w[2], recipe)
    for a, b in zip(one, every):
        if a is None:
            assert b is None
            continue
        assert torch.equal(_u8(a.contiguous()) if a.dtype != torch.float32 else a, _u8(b[2].contiguous())
                           if b.dtype != torch.float32 else b[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_other_dtypes_keep_logical_dtype(dtype):
    q = GroupedQuantWeight.from_hp(_weight(dtype=dtype), "mxfp8")
    assert q.dtype == dtype and q.dequantize().dtype == dtype


@pytest.mark.parametrize("recipe", RECIPES)
def test_transposed_storage_quantizes_along_k(recipe):
    """An HF ``is_transposed`` weight ``[E, K, N]`` is stored ``[E, N, K]``: blocks run along K."""
    w_EKN = _weight(N=64, K=32)
    q = GroupedQuantWeight.from_hp(w_EKN, recipe, is_transposed=True)
    assert q.shape == w_EKN.shape and q.is_transposed and q.stride() == (64 * 32, 1, 64)
    stored = GroupedQuantWeight.from_hp(w_EKN.transpose(1, 2).contiguous(), recipe)
    assert torch.equal(q.dequantize(), stored.dequantize().transpose(1, 2))
    x, offs = torch.randn(5, 64, dtype=torch.bfloat16), _offs([2, 0, 3])
    assert torch.equal(torch._grouped_mm(x, q, offs=offs), torch._grouped_mm(x, q.dequantize(), offs=offs))


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("api", ["torch._grouped_mm", "F.grouped_mm", "moe.grouped_mm"])
def test_grouped_mm_interception_equals_dequantized(recipe, api):
    q = GroupedQuantWeight.from_hp(_weight(), recipe)
    deq = q.dequantize()
    x, offs = torch.randn(9, 64, dtype=torch.bfloat16), _offs([4, 0, 3])
    calls = {
        "torch._grouped_mm": lambda w: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs),
        "F.grouped_mm": lambda w: F.grouped_mm(x, w.transpose(-2, -1), offs=offs),
        "moe.grouped_mm": lambda w: torch.ops.moe.grouped_mm(x, w, offs),
    }
    call = calls[api] if api != "F.grouped_mm" or hasattr(F, "grouped_mm") else calls["torch._grouped_mm"]
    assert torch.equal(call(q)[:7], call(deq)[:7])


@pytest.mark.parametrize("recipe", RECIPES)
def test_expert_gemm_runs_the_quantised_op(recipe, monkeypatch):
    """``moe.expert_gemm`` on a quantised weight (what ``fuse_expert_mlp`` emits) runs the recipe's quantised op
    (gather, GLU and row weight fused; no dequantised copy of the weight) and equals the op on the dequantised
    weight bitwise; a transposed view (the backward's dX operand) runs dequantised."""
    from moe_compile.ops.expert_gemm import expert_gemm

    g = torch.Generator().manual_seed(1)
    q = GroupedQuantWeight.from_hp(_weight(N=32, seed=2), recipe)
    deq = q.dequantize()
    T, K_top, offs = 5, 2, _offs([4, 0, 6])
    M = 12  # 10 routed rows + 2 tail rows
    row_map = torch.cat([torch.randperm(10, generator=g)[: T * K_top].view(T, K_top).int(),
                         torch.zeros(T, K_top, dtype=torch.int32)], 1)
    x, rw = torch.randn(T, 64, dtype=torch.bfloat16, generator=g), torch.rand(M, generator=g)
    kwargs = dict(row_map=row_map, row_weight_M=rw, activation="swiglu", num_rows=M)
    want = expert_gemm(x, deq, offs, **kwargs)[0]
    quantised_ops = []
    op_name = f"expert_gemm_{recipe}"
    real = getattr(torch.ops.moe, op_name)
    monkeypatch.setattr(gw.torch.ops.moe, op_name, lambda *a: quantised_ops.append(a) or real(*a), raising=False)
    monkeypatch.setattr(GroupedQuantWeight, "dequantize_stored", lambda *a: pytest.fail("dequantised the weight"))
    got = expert_gemm(x, q, offs, **kwargs)[0]
    assert len(quantised_ops) == 1 and torch.equal(got, want)
    monkeypatch.undo()
    xt = torch.randn(M, 32, dtype=torch.bfloat16, generator=g)
    want_t = expert_gemm(xt, deq.transpose(1, 2).contiguous(), offs, num_rows=M)[0]
    assert torch.equal(expert_gemm(xt, q.transpose(1, 2), offs, num_rows=M)[0], want_t)


def test_runs_on_weight():
    """The fused expert GEMM runs on plain and quantised weights; another wrapper subclass keeps its own GEMM."""
    from torch.testing._internal.two_tensor import TwoTensor

    from moe_compile.ops.expert_gemm import runs_on_weight

    w = _weight()
    assert runs_on_weight(w) and runs_on_weight(nn.Parameter(w))
    assert runs_on_weight(GroupedQuantWeight.from_hp(w, "mxfp8"))
    assert not runs_on_weight(TwoTensor(w, w.clone()))


@pytest.mark.parametrize("recipe", RECIPES)
def test_views_stay_quantized(recipe):
    q = GroupedQuantWeight.from_hp(_weight(), recipe)
    deq = q.dequantize()
    t = q.transpose(-2, -1)
    assert isinstance(t, GroupedQuantWeight) and t.shape == (3, 64, 16) and t.is_transposed
    assert not t.transpose(1, 2).is_transposed
    e1 = q[1]
    assert isinstance(e1, GroupedQuantWeight) and e1.shape == (16, 64) and torch.equal(e1.dequantize(), deq[1])
    assert isinstance(e1.t(), GroupedQuantWeight) and torch.equal(e1.t().dequantize(), deq[1].t())
    part = q[1:3]
    assert isinstance(part, GroupedQuantWeight) and torch.equal(part.dequantize(), deq[1:3])
    x, b = torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(16, dtype=torch.bfloat16)
    assert torch.equal(F.linear(x, e1, b), F.linear(x, deq[1], b))
    assert torch.equal(F.linear(x, e1), F.linear(x, deq[1]))


@pytest.mark.parametrize("recipe", RECIPES)
def test_fallback_ops_run_dequantized(recipe):
    q = GroupedQuantWeight.from_hp(_weight(), recipe)
    deq = q.dequantize()
    assert torch.equal(q.sum(), deq.sum())
    assert torch.equal(q * 2, deq * 2)
    z = torch.zeros_like(q)
    assert type(z) is torch.Tensor and z.shape == q.shape and not z.any()


def test_copy_between_quantized_copies_bytes(monkeypatch):
    src = GroupedQuantWeight.from_hp(_weight(seed=1), "nvfp4")
    dst = GroupedQuantWeight.from_hp(_weight(seed=2), "nvfp4")

    def no_requant(*args, **kwargs):
        raise AssertionError("copy_ between quantised tensors must not re-quantise")

    monkeypatch.setattr(gw, "quantize_stored", no_requant)
    dst.copy_(src)
    assert torch.equal(dst.qdata, src.qdata) and torch.equal(_u8(dst.scale), _u8(src.scale))
    assert torch.equal(dst.expert_scale, src.expert_scale)


@pytest.mark.parametrize("recipe", RECIPES)
def test_copy_plain_in_and_out(recipe):
    w = _weight(seed=3)
    dst = GroupedQuantWeight.from_hp(_weight(seed=4), recipe)
    dst.copy_(w)
    assert torch.equal(dst.dequantize(), GroupedQuantWeight.from_hp(w, recipe).dequantize())
    plain = torch.empty_like(w)
    plain.copy_(dst)
    assert torch.equal(plain, dst.dequantize())
    with_master = GroupedQuantWeight.from_hp(w, recipe, keep_master=True)
    plain.copy_(with_master)
    assert torch.equal(plain, w)  # the bf16 master, not the dequantised values


def test_to_dtype_clone_detach():
    q = GroupedQuantWeight.from_hp(_weight(), "mxfp8", keep_master=True)
    q32 = q.to(torch.float32)
    assert isinstance(q32, GroupedQuantWeight) and q32.dtype == torch.float32 and q32.master.dtype == torch.float32
    assert torch.equal(q32.dequantize(), q.dequantize(torch.float32))
    c = q.clone()
    c.add_(1.0)
    assert not torch.equal(_u8(c.qdata), _u8(q.qdata))
    d = q.detach()
    assert isinstance(d, GroupedQuantWeight) and d.qdata.data_ptr() == q.qdata.data_ptr()


@pytest.mark.parametrize("recipe", RECIPES)
def test_inplace_update_quantized_primary(recipe):
    """NOTE [training with quantised weights] (moe_compile/experts/grouped_weight.py): update the dequantised value,
    re-quantise in place."""
    q = GroupedQuantWeight.from_hp(_weight(), recipe)
    delta = 0.5 * _weight(seed=9)
    expected = GroupedQuantWeight.from_hp(q.dequantize() + delta, recipe)
    alias = q[0]  # an expert view shares the buffers and sees the update
    q.add_(delta)
    assert torch.equal(q.dequantize(), expected.dequantize())
    assert torch.equal(alias.dequantize(), expected.dequantize()[0])


@pytest.mark.parametrize("recipe", RECIPES)
def test_inplace_update_master(recipe):
    w = _weight()
    q = GroupedQuantWeight.from_hp(w, recipe, keep_master=True)
    delta = 1e-3 * _weight(seed=9)
    q.add_(delta)
    q.mul_(0.99)
    assert torch.equal(q.master, (w + delta) * 0.99)
    assert torch.equal(q.dequantize(), GroupedQuantWeight.from_hp(q.master, recipe).dequantize())


@pytest.mark.parametrize("master", [False, True])
def test_foreach_optimizer_matches_single_tensor(master):
    """``_foreach_*_`` updates on a list of params re-quantise every quantised entry (none is lost)."""
    results = []
    for foreach in (False, True):
        w = nn.Parameter(GroupedQuantWeight.from_hp(_weight(), "mxfp8", keep_master=master))
        b = nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
        opt = torch.optim.AdamW([w, b], lr=0.05, foreach=foreach)
        for step in range(2):
            w.grad, b.grad = _weight(seed=20 + step), torch.full((3,), 0.5, dtype=torch.bfloat16)
            opt.step()
        results.append((w.dequantize(), b.detach().clone()))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert not torch.equal(results[0][0], GroupedQuantWeight.from_hp(_weight(), "mxfp8").dequantize())


@pytest.mark.parametrize("recipe", RECIPES)
def test_save_load_weights_only(recipe):
    q = GroupedQuantWeight.from_hp(_weight(), recipe, keep_master=True)
    buf = io.BytesIO()
    torch.save({"w": q}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)["w"]
    assert isinstance(loaded, GroupedQuantWeight) and loaded.recipe == recipe
    assert torch.equal(_u8(loaded.qdata), _u8(q.qdata)) and torch.equal(loaded.master, q.master)


def test_stack_single_experts():
    q = GroupedQuantWeight.from_hp(_weight(), "nvfp4", keep_master=True)
    stacked = GroupedQuantWeight.stack([q[e] for e in range(3)])
    assert stacked.shape == q.shape and torch.equal(stacked.dequantize(), q.dequantize())
    assert torch.equal(stacked.master, q.master)


@pytest.mark.parametrize(
    "w,recipe,exc,match",
    [
        (_weight(K=48), "mxfp8", ValueError, "K=48 .* multiple of the mxfp8 block size 32"),
        (_weight(K=24), "nvfp4", ValueError, "K=24 .* multiple of the nvfp4 block size 16"),
        (torch.ones(3, 16, 64, dtype=torch.int32), "mxfp8", TypeError, "w.dtype=torch.int32"),
        (torch.ones(64, dtype=torch.bfloat16), "mxfp8", ValueError, "w must be 3-D"),
        (torch.ones(2, 3, 16, 64, dtype=torch.bfloat16), "nvfp4", ValueError, "w must be 3-D"),
        (_weight(), "fp8", ValueError, "recipe='fp8'"),
    ],
)
def test_bad_input(w, recipe, exc, match):
    with pytest.raises(exc, match=match):
        GroupedQuantWeight.from_hp(w, recipe)


class _Experts(nn.Module):
    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.w = nn.Parameter(w)

    def forward(self, x, offs):
        return torch._grouped_mm(x, self.w.transpose(-2, -1), offs=offs)


@pytest.mark.parametrize("recipe,master", [("mxfp8", False)])
def test_compile_inductor_forward_backward(recipe, master):
    """CPU Inductor compiles the subclass (uint8 e8m0 scales), fullgraph; outputs and grads bitwise.
    (nvfp4 with masters is compiled through the moe_compile backend in test_quantize.)"""
    torch._dynamo.reset()
    model = _Experts(GroupedQuantWeight.from_hp(_weight(), recipe, keep_master=master))
    x, offs = torch.randn(9, 64, dtype=torch.bfloat16, requires_grad=True), _offs([4, 0, 5])
    eager = model(x, offs)
    eager.float().pow(2).sum().backward()
    grads = (x.grad.clone(), model.w.grad.clone())
    x.grad = model.w.grad = None
    compiled = torch.compile(model, backend="inductor", fullgraph=True)(x, offs)
    compiled.float().pow(2).sum().backward()
    assert torch.equal(compiled, eager)
    assert torch.equal(x.grad, grads[0]) and torch.equal(model.w.grad, grads[1])
    assert type(model.w.grad) is torch.Tensor
