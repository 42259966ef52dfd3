"""``deterministic_accumulate``: backward scatter-adds next to MoE layers become plain scatters or one-hot
GEMMs (no atomic adds in the generated code), with the same gradients as eager.

Each layer is one router or expert form that real models use (DeepSeek-V3's group-limited router with
``scores.gather(-1, topk_idx)``, GPT-OSS-style per-expert biases gathered by sorted expert ids, a
weight gathered by a sort permutation), plus the forms the pass must leave alone.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.passes._harness import accumulates, check_rewrite, no_accumulation, no_scatter_add


class GroupLimitedRouter(nn.Module):
    """DeepSeek-V3 style: sigmoid scores, selection bias, group-limited top-k, weights gathered."""

    def __init__(self, hidden: int = 16, num_experts: int = 8, groups: int = 4, topk_groups: int = 2, k: int = 2):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(num_experts, hidden) * hidden**-0.5)
        self.register_buffer("bias", torch.randn(num_experts) * 0.1)
        self.groups, self.topk_groups, self.k = groups, topk_groups, k

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        T, E = x_TH.shape[0], self.weight.shape[0]
        scores_TE = (x_TH.float() @ self.weight.float().T).sigmoid()
        choice_TE = scores_TE + self.bias
        group_TG = choice_TE.view(T, self.groups, -1).topk(2, dim=-1)[0].sum(-1)
        group_idx = torch.topk(group_TG, self.topk_groups, dim=-1, sorted=False)[1]
        mask_TG = torch.zeros_like(group_TG).scatter_(1, group_idx, 1)
        mask_TE = mask_TG.unsqueeze(-1).expand(-1, -1, E // self.groups).reshape(T, E)
        idx_TK = torch.topk(choice_TE.masked_fill(~mask_TE.bool(), float("-inf")), self.k, dim=-1, sorted=False)[1]
        w_TK = scores_TE.gather(1, idx_TK)
        # (no renormalisation: with weights summing to 1 this toy loss would barely depend on the router,
        # and its gradient would be rounding noise)
        return (w_TK.unsqueeze(-1) * x_TH.float().unsqueeze(1)).sum()


class ExpertBias(nn.Module):
    """Per-expert bias gathered by expert ids (sorted, as transformers' grouped_mm path; or unsorted),
    and the routing weight gathered by the sort permutation."""

    def __init__(self, num_experts: int = 8, n: int = 12, sort: bool = True):
        super().__init__()
        self.bias_EN = nn.Parameter(torch.randn(num_experts, n))
        self.router = nn.Linear(n, num_experts, bias=False)
        self.sort = sort

    def forward(self, x_TN: torch.Tensor) -> torch.Tensor:
        probs_TK, idx_TK = self.router(x_TN).softmax(-1).topk(2, dim=-1)
        ids_S, w_S = idx_TK.reshape(-1), probs_TK.reshape(-1)
        if self.sort:
            ids_S, perm_S = torch.sort(ids_S)
            w_S = w_S[perm_S]
        rows_SN = x_TN.repeat_interleave(2, dim=0) + self.bias_EN[ids_S]
        return (rows_SN * w_S.unsqueeze(-1)).pow(2).sum()


class Negatives(nn.Module):
    """Forms that must keep their accumulation: a large table gathered by ids (an embedding-like
    gather past the one-hot limit) and an in-place scatter-add into a live tensor."""

    def __init__(self, rows: int = 300, n: int = 8):
        super().__init__()
        self.table = nn.Parameter(torch.randn(rows, n))

    def forward(self, x_TN: torch.Tensor, ids_T: torch.Tensor) -> torch.Tensor:
        looked_up = self.table[ids_T]
        base = x_TN * 2
        live = base.scatter_add(0, ids_T.remainder(x_TN.shape[0]).unsqueeze(1).expand_as(x_TN), x_TN)
        return (looked_up * live).sum()


class _MaxGateGrad(torch.autograd.Function):
    """PhiMoE's sparsemixer shape: the backward scatter-adds into a live tensor at the argmax."""

    @staticmethod
    def forward(ctx, scores_TE: torch.Tensor, idx_T1: torch.Tensor) -> torch.Tensor:
        gate_TE = scores_TE.softmax(-1)
        ctx.save_for_backward(gate_TE, idx_T1)
        return gate_TE.gather(1, idx_T1)

    @staticmethod
    def backward(ctx, grad_T1: torch.Tensor):
        gate_TE, idx_T1 = ctx.saved_tensors
        picked_T1 = gate_TE.gather(1, idx_T1)
        grad_TE = gate_TE * (grad_T1 * picked_T1).mul(-1)
        grad_TE.scatter_add_(dim=-1, index=idx_T1, src=grad_T1 * picked_T1)
        return grad_TE, None


class MaxRouter(nn.Module):
    def __init__(self, hidden: int = 16, num_experts: int = 8):
        super().__init__()
        self.gate = nn.Linear(hidden, num_experts, bias=False)

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        scores_TE = self.gate(x_TH)
        idx_T1 = scores_TE.max(dim=-1, keepdim=True)[1]
        return (_MaxGateGrad.apply(scores_TE, idx_T1) * x_TH).pow(2).sum()


class InLayer(nn.Module):
    """Puts a module one level down, so its nodes belong to a named layer (``inner``)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.inner(*args)


@pytest.mark.parametrize("T", [5, 16])
def test_group_limited_router_gather_becomes_scatter(T):
    torch.manual_seed(T)
    x = torch.randn(T, 16, requires_grad=True)
    run = check_rewrite(GroupLimitedRouter(), (x,), {}, backend="moe_compile", code_checks=[no_accumulation])
    rewrites = [r for r in run.report.rewrites if r.pass_name == "deterministic_accumulate"]
    # the gather of the weights, and the two topk-value selections' backward are plain scatters already
    assert [r.detail for r in rewrites] == ["scatter (distinct indices, no accumulation)"], run.report.table()


@pytest.mark.parametrize("sort", [True, False])
def test_expert_bias_gradient_is_one_hot_gemm(sort):
    torch.manual_seed(int(sort))
    x = torch.randn(10, 12, requires_grad=True)
    run = check_rewrite(ExpertBias(sort=sort), (x,), {}, backend="moe_compile",
                        code_checks=[no_scatter_add, no_accumulation])
    details = sorted(r.detail for r in run.report.rewrites if r.pass_name == "deterministic_accumulate")
    expected = ["one-hot GEMM over 8 rows (fixed-order sum, no atomics)"]
    if sort:
        expected.append("index_put (distinct indices, no accumulation)")
    assert details == sorted(expected), run.report.table()


def test_accumulations_left_alone_with_reasons():
    torch.manual_seed(2)
    x = torch.randn(6, 8, requires_grad=True)
    ids = torch.randint(0, 300, (6,))
    run = check_rewrite(InLayer(Negatives()), (x, ids), {}, backend="moe_compile", code_checks=[lambda c: None],
                        expected_skips={"deterministic_accumulate": ["base_not_zeros", "too_many_rows"]})
    assert not [r for r in run.report.rewrites if r.pass_name == "deterministic_accumulate"]
    assert any(accumulates(c) for c in run.code)


def test_pass_off_keeps_atomics():
    """Negative control: with the pass off, the same router's backward accumulates (the check can fail)."""
    from moe_compile.config import MoECompileConfig
    from tests.passes._harness import compile_and_run

    torch.manual_seed(3)
    x = torch.randn(8, 16, requires_grad=True)
    config = MoECompileConfig(passes={"deterministic_accumulate": False})
    from moe_compile.backend import ConfiguredBackend

    run = compile_and_run(GroupLimitedRouter(), (x,), backend=ConfiguredBackend(config), train=True, get_code=True)
    assert any(accumulates(c) for c in run.code)


def test_custom_router_backward_scatter_add_into_live_tensor_is_left_as_is():
    """PhiMoE's router backward adds once into each element of a live tensor: no rewrite, and nothing for the
    audit to report (NOTE [one add into a live tensor] (moe_compile/passes/forms/accumulate.py))."""
    torch.manual_seed(4)
    x = torch.randn(9, 16, requires_grad=True)
    run = check_rewrite(InLayer(MaxRouter()), (x,), {}, backend="moe_compile")
    assert [r for r in run.report.rewrites if r.pass_name == "deterministic_accumulate"] == [], run.report.table()
    assert [r for r in run.report.left if r.layer.startswith("inner")] == [], run.report.table()


class UserTable(nn.Module):
    """No MoE layer: a 5-row table gathered by the user's own indices, and an ``index_add_`` into a 5-row table by
    them. The gather's backward is an ``index_put(accumulate=True)`` into zeros, as an embedding's."""

    def __init__(self, gen: torch.Generator, rows: int = 5, n: int = 16):
        super().__init__()
        self.table = nn.Parameter(torch.randn(rows, n, generator=gen))
        self.proj = nn.Linear(n, n)

    def forward(self, x_TN: torch.Tensor, idx_T: torch.Tensor) -> torch.Tensor:
        h_TN = self.proj(x_TN) + self.table[idx_T]
        return torch.zeros(self.table.shape, dtype=h_TN.dtype).index_add_(0, idx_T, h_TN)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view({4: torch.int32, 2: torch.int16}[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_user_table_outside_moe_layers_is_bitwise_plain_inductor(dtype):
    """The one-hot GEMM rule once fired on this model (its indices bound by the gather) and changed the bits of the
    output and of the table's gradient against plain Inductor, while ``explain`` listed MoE rewrites (issue 35). Now
    moe_compile gives plain Inductor's bits, and ``explain`` lists no MoE rewrite. One thread: CPU Inductor adds an
    accumulating scatter atomically from several threads, so its own bits vary from run to run otherwise."""
    import moe_compile
    from tests.passes._harness import fresh_cache

    seed = torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed)
    model = UserTable(gen).to(dtype)
    x, idx = torch.randn(64, 16, generator=gen).to(dtype), torch.randint(0, 5, (64,), generator=gen)

    def step(backend):
        torch._dynamo.reset()
        model.zero_grad(set_to_none=True)
        with fresh_cache():
            out = torch.compile(model, backend=backend)(x, idx)
            out.float().pow(2).sum().backward()
        torch._dynamo.reset()
        return [out, *(p.grad for p in model.parameters())]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ours, plain = step("moe_compile"), step("inductor")
        rep = moe_compile.explain(model, x, idx)
    finally:
        torch.set_num_threads(threads)
    for i, (a, b) in enumerate(zip(ours, plain, strict=True)):
        assert torch.equal(_bits(a), _bits(b)), f"seed {seed}: tensor {i} differs by {(a - b).abs().max().item():.3g}"
    assert rep.moe_rewrites == [] and rep.to_dict()["summary"]["rewritten_layers"] == [], rep.table()
    assert "0 MoE layer(s) rewritten" in rep.table(), rep.table()
