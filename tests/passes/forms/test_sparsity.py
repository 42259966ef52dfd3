"""``forms.sparsity.nonzeros``: bounds on the non-zeros per slice, read from the ops of Dynamo's graph.

Each spelling below builds a routing tensor in the way some public MoE code does; the bound read from its graph must
hold on fresh random inputs (soundness, checked by counting) and be the small number the routing gives (precision).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_compile.passes._graph import op_name
from moe_compile.passes.forms.sparsity import nonzeros

T, E, C, K = 24, 6, 5, 2


def _one_hot_scatter(idx, n):
    out = idx.new_zeros(idx.shape[:-1] + (n,))
    return out.scatter_(out.dim() - 1, idx, 1)


def gshard_bmm(logits):
    """fairseq: one-hots scattered into zeros, a capacity mask, a ``bmm`` outer product, ``bool()`` of the sum."""
    gates = logits.softmax(-1)
    i1 = logits.argmax(-1, keepdim=True)
    m1 = _one_hot_scatter(i1, E)
    i2 = logits.masked_fill(m1.bool(), float("-inf")).argmax(-1, keepdim=True)
    m2 = _one_hot_scatter(i2, E)
    l1 = torch.cumsum(m1, 0) - 1
    l2 = torch.cumsum(m2, 0) - 1 + m1.sum(0, keepdim=True)
    m1, m2 = m1 * torch.lt(l1, C), m2 * torch.lt(l2, C)
    g1 = (gates * m1).sum(1).unsqueeze(-1) * m1.to(gates.dtype)
    g2 = (gates * m2).sum(1).unsqueeze(-1) * m2.to(gates.dtype)
    s1 = _one_hot_scatter(torch.sum(l1 * m1, 1).unsqueeze(-1), C)
    s2 = _one_hot_scatter(torch.sum(l2 * m2, 1).unsqueeze(-1), C)
    combine = torch.bmm(g1.unsqueeze(-1), s1.to(g1.dtype).unsqueeze(1)) + \
        torch.bmm(g2.unsqueeze(-1), s2.to(g2.dtype).unsqueeze(1))
    return combine.bool().permute(1, 2, 0).reshape(E * C, T)  # the dispatch mask [E*C, T]: 2 per token (axis 0)


def one_hot_einsum(logits):
    """GShard / T5X: ``einsum("tke,tkc->tec")`` of ``F.one_hot`` terms, weighted, then ``> 0`` as the mask."""
    w, ids = logits.softmax(-1).topk(K, -1)
    pos = (torch.cumsum(F.one_hot(ids.reshape(-1), E), 0) - 1).reshape(T, K, E).gather(-1, ids.unsqueeze(-1))
    terms = torch.einsum("tke,tkc->tkec", F.one_hot(ids, E) * w.unsqueeze(-1),
                         F.one_hot(pos.squeeze(-1).clamp(max=C - 1), C).float())
    return (terms.sum(1) > 0).float().reshape(T, E * C)  # [T, E*C]: 2 per token (axis 1)


def eq_arange(logits):
    """A one-hot as a comparison with an arange, masked by the top-k choice: ``[T, K, E]`` summed over ``k``."""
    w, ids = logits.topk(K, -1)
    hit = ids.unsqueeze(-1) == torch.arange(E).view(1, 1, E)
    return torch.where(hit, w.unsqueeze(-1), 0.0).sum(1)  # [T, E]: 2 per token (axis 1)


def scattered_probs(logits):
    """Routing probabilities kept at the top-k as a dense ``[T, E]`` table: ``zeros.scatter(1, ids, w)``, in place
    on a named buffer that is then read."""
    w, ids = logits.softmax(-1).topk(K, -1)
    table = torch.zeros(T, E)
    table.scatter_(1, ids, w)
    return table * 2.0  # [T, E]: 2 per token (axis 1)


SPELLINGS = [(gshard_bmm, [0], 2), (one_hot_einsum, [1], 2), (eq_arange, [1], 2), (scattered_probs, [1], 2)]


def _graph_output(fn):
    """The Dynamo graph of ``fn`` on random logits, and the node of its output."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(torch.randn(T, E))
    torch._dynamo.reset()
    (gm,) = graphs
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    return out.args[0][0] if isinstance(out.args[0], (tuple, list)) else out.args[0]


@pytest.mark.parametrize(("fn", "axes", "expected"), SPELLINGS, ids=[s[0].__name__ for s in SPELLINGS])
def test_bound_is_the_routing_and_holds(fn, axes, expected):
    node = _graph_output(fn)
    bound = nonzeros(node, axes)
    assert bound == expected, (fn.__name__, bound)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    for _ in range(20):
        value = fn(torch.randn(T, E, generator=gen) * 3)
        others = [d for d in range(value.dim()) if d not in axes]
        most = (value != 0).permute(*others, *axes).reshape(-1, *[value.shape[d] for d in axes]).flatten(1).sum(1)
        assert int(most.max()) <= bound


def test_in_place_writes_after_the_source_are_seen():
    """``z = zeros; z.scatter_(...); z.add_(dense)``: the scatter's bound no longer holds for what is read."""

    def fn(logits):
        z = torch.zeros(T, E)
        z.scatter_(1, logits.topk(K, -1).indices, 1.0)
        z.add_(logits)
        return z * 1.0

    assert nonzeros(_graph_output(fn), [1]) == E


def test_dense_tensors_get_the_trivial_bound():
    def fn(logits):
        return torch.cumsum(F.one_hot(logits.argmax(-1), E), 0) * logits

    node = _graph_output(fn)
    assert op_name(node) == "mul"
    assert nonzeros(node, [1]) == E and nonzeros(node, [0, 1]) == T * E
