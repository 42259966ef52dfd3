"""``normalize``: row moves onto one spelling before the recognisers (``moe_compile/passes/normalize.py``).

Each rule on a Dynamo graph of its own, run through the pass alone: the graph after it has the normal form and gives
the original's values on fresh random inputs (bitwise for the gathers; for the reordered combine, on integer-valued
rows, whose sums are exact in any order). Then a layer written as transformers' ``grouped_mm`` implementation spells
it by hand (two composed gathers, a combine through ``argsort(perm)``), which ``fuse_dispatch`` now rewrites."""

from __future__ import annotations

import collections
import copy

import torch
import torch.nn.functional as F
from torch import nn

from moe_compile import report
from moe_compile.config import MoECompileConfig
from moe_compile.passes import PassContext, normalize
from moe_compile.passes._graph import op_name
from tests import _tolerance as tol

T, K, E, H = 12, 2, 4, 8


def _normalized(fn, *args):
    """``(graph module before, after)`` of ``fn`` as Dynamo captures it, the pass run on a copy."""
    seen = {}

    def backend(gm, example_inputs):
        seen["before"] = copy.deepcopy(gm)
        ctx = PassContext(MoECompileConfig(), "pre_grad", "normalize", is_training=False)
        normalize.run(gm.graph, ctx)
        gm.graph.lint()
        gm.recompile()
        seen["after"], seen["records"] = gm, ctx.records
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    torch._dynamo.reset()
    return seen["before"], seen["after"], seen["records"]


def _call(gm, **inputs: torch.Tensor) -> torch.Tensor:
    """``gm`` on ``inputs`` by name (Dynamo orders a graph's placeholders its own way: ``l_<name>_``)."""
    names = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    return gm(*(inputs[name[2:-1]] for name in names))[0]


def _ops(gm) -> collections.Counter:
    return collections.Counter(op_name(n) for n in gm.graph.nodes if n.op in ("call_function", "call_method"))


def _routing(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(T, H, generator=gen)
    ids = torch.randint(0, E, (T, K), generator=gen)
    return x, ids


def composed(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    token_idx = torch.arange(x.shape[0]).unsqueeze(1).expand(-1, ids.shape[1]).reshape(-1)
    perm = torch.argsort(ids.reshape(-1), stable=True)
    return x[token_idx][perm]


def repeated(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    perm = torch.sort(ids.reshape(-1))[1]
    return x[torch.arange(x.shape[0]).repeat_interleave(ids.shape[1])][perm]


def combine_through_inverse(y: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    token_idx = torch.arange(ids.shape[0]).unsqueeze(1).expand(-1, ids.shape[1]).reshape(-1)
    perm = torch.argsort(ids.reshape(-1), stable=True)
    out = torch.zeros(ids.shape[0], y.shape[1])
    return out.index_add_(0, token_idx, y[torch.argsort(perm)])


def test_composed_gathers_become_one_gather_at_perm_floordiv_k():
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    for fn in (composed, repeated):
        before, after, records = _normalized(fn, *_routing(gen))
        assert _ops(after)["getitem"] == _ops(before)["getitem"] - 1 and _ops(after)["floordiv"] == 1, after.code
        assert [r.what for r in records] == ["x[a][b] -> x[a[b]]"]
        for _ in range(3):
            x, ids = _routing(gen)
            assert torch.equal(_call(after, x=x, ids=ids), _call(before, x=x, ids=ids))


def test_combine_through_the_inverse_becomes_a_combine_at_perm_floordiv_k():
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    y = torch.randint(-8, 8, (T * K, H), generator=gen).float()  # integer rows: sums exact in any order
    before, after, records = _normalized(combine_through_inverse, y, _routing(gen)[1])
    assert _ops(after)["argsort"] == 1 and _ops(after)["floordiv"] == 1, after.code
    assert records[0].what.startswith("index_add_(idx, y[argsort(p)])")
    for _ in range(3):
        ids = _routing(gen)[1]
        y = torch.randint(-8, 8, (T * K, H), generator=gen).float()
        assert torch.equal(_call(after, y=y, ids=ids), _call(before, y=y, ids=ids))


def test_truncated_division_of_an_order_is_its_floor():
    """JetMoE's ``index_sorted_experts.div(K, rounding_mode="trunc")``: an order is non-negative, so the truncation
    is the floor (``perm // K``, the form the recognisers read); a truncation of signed values is left alone."""

    def trunc(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        perm = ids.reshape(-1).sort(0)[1]
        signed = ids.reshape(-1) - 2
        k = ids.shape[1]
        return x[perm.div(k, rounding_mode="trunc")] + signed.div(k, rounding_mode="trunc")[:, None]

    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    before, after, records = _normalized(trunc, *_routing(gen))
    assert [r.what for r in records] == ["div(p, K, trunc) -> p // K"] and _ops(after)["div"] == 1, after.code
    for _ in range(3):
        x, ids = _routing(gen)
        assert torch.equal(_call(after, x=x, ids=ids), _call(before, x=x, ids=ids))


def test_argsort_of_no_permutation_is_left_alone():
    """``argsort(q)`` of ids with repeats is a permutation, but ``q`` is not: the combine through it is no combine
    through an inverse, and rule 3 must not fire."""

    def not_inverse(y: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        token_idx = torch.arange(ids.shape[0]).repeat_interleave(ids.shape[1])
        out = torch.zeros(ids.shape[0], y.shape[1])
        return out.index_add_(0, token_idx, y[torch.argsort(torch.argsort(ids.reshape(-1)) % 3)])

    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    _, after, records = _normalized(not_inverse, torch.randn(T * K, H, generator=gen), _routing(gen)[1])
    assert not records and _ops(after)["argsort"] == 2


def test_bincount_of_top_k_ids_gets_a_size_known_at_trace_time():
    """MaxText's ``bincount(flat_ids, minlength=E)`` (ScatterMoE's of the sorted ids): under the capture flags its
    length is an unbacked size (a host sync); ids a router's top-k over ``E`` scores are below ``E``, so the counts
    are ``(ids[:, None] == arange(E)).sum(0)``, equal on fresh routings. Ids with no such bound (``% (E + 1)``) keep
    their ``bincount``."""

    def counts(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids = scores.topk(K, dim=-1).indices.reshape(-1)
        return (torch.bincount(ids, minlength=E), torch.bincount(ids.sort().values.int(), minlength=E),
                torch.bincount((ids * 3) % (E + 1), minlength=E))

    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    before, after, records = _normalized(counts, torch.randn(T, E, generator=gen))
    assert [r.what for r in records] == ["bincount(ids, minlength=E) -> (ids[:, None] == arange(E)).sum(0) x2"]
    assert _ops(after)["bincount"] == 1 and _ops(after)["eq"] == 2, after.code
    for _ in range(3):
        scores = torch.randn(T, E, generator=gen)
        got, want = after(scores), before(scores)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), (got, want)


def _routing_map(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids = scores.topk(K, dim=-1).indices
    return ids, torch.zeros_like(scores).int().scatter(1, ids, 1).bool()


def test_masked_select_by_a_top_k_routing_map_gets_a_static_length():
    """Megatron's ``permute``: ``token_indices.masked_select(map.T)`` and ``probs.T.masked_select(map.T)``, and the
    untransposed ``x.masked_select(map)``: a top-k map selects exactly ``K`` per token, so the selections become
    gathers at the ``T*K`` pairs (``perm // K`` for the token indices), bitwise equal on fresh routings. A map that is
    no top-k (``scores > 0``) keeps its ``masked_select``, and so does a map through ``permute(0, 1)``, which is not
    read as a transpose."""

    def select(scores: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        _, routing_map = _routing_map(scores)
        by_expert = routing_map.T.contiguous()
        tokens = torch.arange(scores.shape[0]).unsqueeze(0).expand(scores.shape[1], -1)
        return (tokens.masked_select(by_expert), probs.T.contiguous().masked_select(by_expert),
                probs.masked_select(routing_map), probs.masked_select(routing_map.permute(0, 1)),
                probs.masked_select(scores > 0))

    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    before, after, records = _normalized(select, torch.randn(T, E, generator=gen), torch.rand(T, E, generator=gen))
    assert [r.what for r in records] == ["X.masked_select(routing map) -> X[rows, cols] of the top-k pairs x3"]
    assert _ops(after)["masked_select"] == 2 and _ops(after)["floordiv"] >= 2, after.code
    for _ in range(3):
        scores, probs = torch.randn(T, E, generator=gen), torch.rand(T, E, generator=gen)
        got, want = after(scores, probs), before(scores, probs)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), (got, want)


class HandWrittenGroupedMM(nn.Module):
    """transformers' ``grouped_mm`` experts implementation written out by hand (the blind corpus's
    ``hf_grouped_mm_experts``): ``x[token_idx][perm]``, counts by ``histc`` of the sorted ids, the weight on the sorted
    rows, and ``index_add_(0, token_idx, y[argsort(perm)])``."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.gate = nn.Parameter(torch.randn(E, H, generator=gen) * 0.3)
        self.w_gate_up = nn.Parameter(torch.randn(E, 2 * 8, H, generator=gen) * 0.3)
        self.w_down = nn.Parameter(torch.randn(E, H, 8, generator=gen) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, ids = torch.topk(F.softmax(F.linear(x, self.gate).float(), dim=-1), K, dim=-1)
        token_idx = torch.arange(x.shape[0]).unsqueeze(1).expand(-1, K).reshape(-1)
        perm = torch.argsort(ids.reshape(-1), stable=True)
        rows = x[token_idx][perm]
        offs = torch.cumsum(torch.histc(ids.reshape(-1)[perm].float(), bins=E, min=0, max=E - 1), 0, dtype=torch.int32)
        gate, up = torch._grouped_mm(rows, self.w_gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, self.w_down.transpose(-2, -1), offs=offs)
        y = y * w.reshape(-1)[perm].unsqueeze(-1).to(y.dtype)
        return torch.zeros_like(x).index_add_(0, token_idx, y[torch.argsort(perm)])


def test_hand_written_grouped_mm_is_rewritten_within_eager_bound():
    """Normalised, the layer is ``fuse_dispatch``'s form: rewritten, clean (no accumulating scatter left, forward or
    backward), every tensor of a bf16 training step within eager's distance from a float32 run."""
    seed = torch.seed() % 2**31
    model = HandWrittenGroupedMM(seed).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    x, cot = torch.randn(T, H, generator=gen).bfloat16(), torch.randn(T, H, generator=gen)
    ref_model = copy.deepcopy(model).float()
    eager = tol.layer_step(model, model, x, cot)
    ref = tol.layer_step(ref_model, ref_model, x.float(), cot, torch.float32)
    torch._dynamo.reset()
    with report.collecting() as rep, torch._inductor.config.patch(force_disable_caches=True):
        got = tol.layer_step(torch.compile(model, backend="moe_compile", fullgraph=True), model, x, cot)
    torch._dynamo.reset()
    assert rep.count("normalize") >= 1 and rep.count("fuse_dispatch") == 1 and rep.clean, rep.table()
    ok, worst, unjudged = tol.within_eager_bound(got, eager, ref, always_judged=tuple(ref))
    assert ok and not unjudged, (worst, unjudged)
