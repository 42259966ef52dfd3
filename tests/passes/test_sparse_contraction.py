"""``sparse_contraction``: products with a routing tensor of few non-zeros per token become gathers and fixed-order
sums, whatever the routing tensor's spelling."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moe_compile.passes.sparse_contraction import Plan, sparse_contraction
from tests.passes._harness import check_rewrite, no_scatter_add


def _one_hot_scatter(idx, n):
    out = idx.new_zeros(idx.shape[:-1] + (n,))
    return out.scatter_(out.dim() - 1, idx, 1)


class MatmulCapacityMoE(nn.Module):
    """A GShard top-2 layer dispatched and combined by dense products (fairseq's ``MOELayer``): the routing tensor
    built from scattered one-hots and a ``bmm`` outer product (``spelling="mm"``) or from ``F.one_hot`` and an
    einsum over ``[T, E, C]`` (``"einsum"``)."""

    def __init__(self, hidden=16, ffn=8, experts=4, capacity_factor=1.0, spelling="mm", seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.E, self.spelling, self.capacity_factor = experts, spelling, capacity_factor
        self.wg = nn.Parameter(torch.randn(experts, hidden, generator=gen) / hidden ** 0.5)
        self.w1 = nn.Parameter(torch.randn(experts, hidden, ffn, generator=gen) / hidden ** 0.5)
        self.w2 = nn.Parameter(torch.randn(experts, ffn, hidden, generator=gen) / ffn ** 0.5)

    def _routing(self, x):
        T, E = x.shape[0], self.E
        C = math.ceil(self.capacity_factor * 2 * T / E)
        logits = F.linear(x, self.wg).float()
        gates = logits.softmax(-1)
        i1 = logits.argmax(-1, keepdim=True)
        m1 = _one_hot_scatter(i1, E)
        i2 = logits.masked_fill(m1.bool(), float("-inf")).argmax(-1, keepdim=True)
        m2 = _one_hot_scatter(i2, E)
        l1 = torch.cumsum(m1, 0) - 1
        l2 = torch.cumsum(m2, 0) - 1 + m1.sum(0, keepdim=True)
        m1, m2 = m1 * torch.lt(l1, C), m2 * torch.lt(l2, C)
        g1, g2 = (gates * m1).sum(1), (gates * m2).sum(1)
        p1, p2 = (l1 * m1).sum(1), (l2 * m2).sum(1)
        if self.spelling == "einsum":
            combine = torch.einsum("te,tc->tec", g1.unsqueeze(-1) * F.one_hot(i1.squeeze(-1), E),
                                   F.one_hot(p1, C).float()) + \
                torch.einsum("te,tc->tec", g2.unsqueeze(-1) * m2, F.one_hot(p2, C).float())
            return combine.to(x.dtype), combine > 0, C
        s1, s2 = _one_hot_scatter(p1.unsqueeze(-1), C), _one_hot_scatter(p2.unsqueeze(-1), C)
        combine = torch.bmm((g1.unsqueeze(-1) * m1).unsqueeze(-1), s1.float().unsqueeze(1)) + \
            torch.bmm((g2.unsqueeze(-1) * m2).unsqueeze(-1), s2.float().unsqueeze(1))
        return combine.to(x.dtype), combine.bool(), C

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        T, E = x.shape[0], self.E
        combine, dispatch, C = self._routing(x)
        if self.spelling == "einsum":
            xs = torch.einsum("tec,th->ech", dispatch.to(x.dtype), x)
        else:
            xs = torch.mm(dispatch.to(x.dtype).permute(1, 2, 0).reshape(E * C, T), x).view(E, C, -1)
        ys = torch.bmm(F.gelu(torch.bmm(xs, self.w1)), self.w2)
        if self.spelling == "einsum":
            return torch.einsum("tec,ech->th", combine, ys).reshape(shape)
        return combine.view(T, E * C).mm(ys.view(E * C, -1)).reshape(shape)


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.slow), torch.bfloat16])
@pytest.mark.parametrize("spelling", ["mm", "einsum"])
def test_capacity_products_rewritten_within_eager_bound(spelling, dtype):
    """Both products of a capacity layer (tokens dropped at capacity 0.75) are rewritten, whichever spelling built
    the routing tensor; no scatter-add is left forward or backward; output and every gradient within eager's bound.
    (``capacity_dispatch`` reads the ``F.one_hot`` einsum form itself when it can; here its ``> 0`` mask over a
    sum of einsums is no one-hot sum it reads, so this pass takes both.)"""
    seed = torch.seed() % 2**16
    model = MatmulCapacityMoE(capacity_factor=0.75, spelling=spelling, seed=seed).to(dtype)
    x = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    run = check_rewrite(model, [x], {"sparse_contraction": 2}, backend="moe_compile", code_checks=[no_scatter_add])
    assert not [r for r in run.report.records if r.what == "validation_failed"]


def _sparse(gen, shape, dim, nnz):
    """Small integers with at most ``nnz`` non-zeros per slice along ``dim``, some taken entries zero."""
    keys = torch.rand(shape, generator=gen)
    keep = keys.argsort(dim).argsort(dim) < nnz
    values = torch.randint(-3, 4, shape, generator=gen).float()
    return torch.where(keep, values, 0.0)


@pytest.mark.parametrize(("sparse", "along"), [("a", "k"), ("a", "mn"), ("b", "k"), ("b", "mn")])
def test_function_equals_the_product_exactly(sparse, along):
    """Small integers: every sum exact, so the gathers give the product bitwise in each of the four layouts. The
    sparse operand's gradient is the product's at its non-zeros; elsewhere 0 (structural zeros), except at the
    zero entries taken to fill a slice's places, at most ``R`` per slice in all."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    M, K, N, R = 12, 10, 5, 2
    if sparse == "a":
        dim = 1 if along == "k" else 0
        a = _sparse(gen, (M, K), dim, R)
        b = torch.randint(-3, 4, (K, N), generator=gen).float()
    else:
        dim = 0 if along == "k" else 1
        a = torch.randint(-3, 4, (M, K), generator=gen).float()
        b = _sparse(gen, (K, N), dim, R)
    plan = Plan((0, 1), (1, M, K), (0, 1), (1, K, N), (M, N), (0, 1), sparse, along, R)
    a.requires_grad_(), b.requires_grad_()
    got = sparse_contraction(a, b, tuple(vars(plan).values()))
    want = a @ b
    assert torch.equal(got, want)
    cot = torch.randint(-3, 4, (M, N), generator=gen).float()
    got_grads = torch.autograd.grad(got, (a, b), cot)
    want_grads = torch.autograd.grad(want, (a, b), cot)
    dense = 1 if sparse == "a" else 0
    assert torch.equal(got_grads[dense], want_grads[dense])
    s, g, w = (a, b)[1 - dense].detach(), got_grads[1 - dense], want_grads[1 - dense]
    assert torch.equal(g[s != 0], w[s != 0])
    assert bool(((g == 0) | (g == w)).all())
    assert int(((g != 0) | (s != 0)).sum(dim).max()) <= R


class GroupedExpertChoice(nn.Module):
    """The expert-choice paper's layer with GShard's group dim ``g``: each expert takes its top-``k`` tokens of a
    group, dispatch and combine as einsums over the one-hot ``[G, E, k, S]`` permutation (the combine a
    three-operand einsum, split into pairs by ``normalize``)."""

    def __init__(self, hidden=16, ffn=24, experts=4, capacity=3, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.k = capacity
        self.W_g = nn.Parameter(torch.randn(hidden, experts, generator=gen))
        self.W_1 = nn.Parameter(torch.randn(experts, hidden, ffn, generator=gen) / hidden ** 0.5)
        self.W_2 = nn.Parameter(torch.randn(experts, ffn, hidden, generator=gen) / ffn ** 0.5)

    def forward(self, X):
        S = torch.einsum("gsm,me->gse", X, self.W_g).softmax(dim=-1)
        G, I = torch.topk(S.transpose(1, 2), self.k, dim=-1)  # noqa: E741 - [G, E, k]
        P = F.one_hot(I, X.shape[1]).to(X.dtype)  # [G, E, k, S]
        X_in = torch.einsum("gsm,geks->gekm", X, P)
        H = F.gelu(torch.einsum("gekm,emh->gekh", X_in, self.W_1))
        X_e = torch.einsum("gekh,ehm->gekm", H, self.W_2)
        return torch.einsum("geks,gek,gekm->gsm", P, G, X_e)


def test_batched_and_three_operand_einsums():
    """Group dims (a batch index in both operands and the output) and a three-operand combine: the dispatch and the
    combine are both rewritten, the step within eager's bound, no scatter-add left."""
    seed = torch.seed() % 2**16
    model = GroupedExpertChoice(seed=seed)
    x = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(seed + 1), requires_grad=True)
    run = check_rewrite(model, [x], {"sparse_contraction": 2}, backend="moe_compile", code_checks=[no_scatter_add])
    assert run.report.count("normalize") >= 1


def test_dense_products_left_alone():
    """A product of dense operands (an MLP written with ``mm``) is no routing: not rewritten, no record."""

    def fn(x, w):
        return torch.mm(torch.relu(torch.mm(x, w)), w.t())

    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(16, 12, generator=gen), torch.randn(12, 12, generator=gen).requires_grad_()
    run = check_rewrite(fn, [x, w], {"sparse_contraction": 0})
    assert not [r for r in run.report.records if r.pass_name == "sparse_contraction"]
