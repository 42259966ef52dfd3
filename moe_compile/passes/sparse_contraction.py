"""Contractions with a routing tensor of few non-zeros per token -> gathers and fixed-order sums, linear in tokens.

A capacity dispatch or combine written as a dense product over a routing tensor (GShard's and fairseq's
``mm(dispatch_mask.view(E*C, S), x)`` and ``combine.view(S, E*C).mm(y)``, ``einsum("sec,sm->ecm")``, a one-hot
``[T, E]`` matmul) costs ``T*E*C*H`` multiply-adds, quadratic in tokens, of which all but ``K*T*H`` multiply zeros.
Whatever its spelling, such a routing tensor has at most ``M`` non-zeros per token: :func:`forms.sparsity.nonzeros`
proves the bound from the ops that build it (one-hots, comparisons with an arange, scatters into zeros, their
products, sums and views), never from values.

The products read: ``mm``, ``bmm``, ``matmul`` of two 2-D or 3-D operands, ``einsum`` of two operands, batch indices
included (GShard's ``"gsec,gsm->egcm"``; ``normalize`` splits an einsum of more operands into pairs).

Matches (Dynamo's Torch IR)::

    out_MN = A_MK @ B_KN           where A (or B) has at most R non-zeros in every row or every column, R <= size / 4
                                   (per batch: [Bt, M, K] @ [Bt, K, N])

Rewrites to (``A`` row-sparse; the column-sparse and ``B`` cases are the same with the roles turned)::

    cols_MR = topk(where(A != 0, 2K - k, K - k), R).indices     (each row's non-zeros first, in column order; no ties)
    out_MN  = gather_segment_sum(B, cols_MR, rows_MR, M, A.gather(1, cols_MR))   (each row the fixed-order sum of
                                                                                   its R weighted rows of B)

Equal to the product for any values of ``A`` whose rows hold at most ``R`` non-zeros, up to the order of the adds
(fp32 accumulation, one rounding). Gradients: ``B``'s is the same op from the other side; ``A``'s is its gathered
entries' (a scatter at distinct ``topk`` positions, made a plain write by ``deterministic_accumulate``), and 0 at the
entries not taken. Those are structural zeros (NOTE in ``forms/sparsity.py``), whose gradient eager also never
passes on; a taken entry of value 0 (a gate underflowed to 0) keeps its gradient only while its row has a free
place. No atomics, no host sync.

Leaves alone, with no record (most products are no routing): a symbolic size (a dynamic-shape compile), an einsum
with a batch index, an operand with more non-zeros than ``MAX_FILL`` of its slices.

Stage: pre-grad, after ``capacity_dispatch`` (whose one-hot terms it reads without materialising the routing tensor,
where it can).

Seen in: ``tests/models/capacity_layers.py``, and fairseq's ``MOELayer`` (``mm`` over ``combine_weights.bool()``,
its one-hots scattered into zeros, the ``sec`` tensor a ``bmm`` outer product).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.fx as fx

from moe_compile.ops.segment_sum import gather_segment_sum
from moe_compile.passes import PassContext
from moe_compile.passes._graph import einsum_terms, erase_dead, graph_call, layer_name, op_name, tensor_val
from moe_compile.passes._graph import static_shape as shape_of
from moe_compile.passes.forms.sparsity import nonzeros

# the largest share of a slice its non-zeros may fill for the rewrite to pay
MAX_FILL = 0.25


@dataclasses.dataclass(frozen=True)
class Plan:
    """``out = A @ B`` as batched matrices ``[Bt, M, K] @ [Bt, K, N]``: each operand's permute (batch axes first) and
    3-D shape, the output's shape before its permute, which operand is sparse, and along which of its axes it holds
    at most ``nnz`` per slice."""

    a_perm: tuple[int, ...]
    a_3d: tuple[int, int, int]
    b_perm: tuple[int, ...]
    b_3d: tuple[int, int, int]
    out_shape: tuple[int, ...]
    out_perm: tuple[int, ...]
    sparse: str  # "a" | "b"
    along: str  # "k": at most nnz per row of A (per column of B) over K; "mn": per column of A / per row of B
    nnz: int


def run(graph: fx.Graph, ctx: PassContext) -> None:
    memo: dict = {}
    for node in list(graph.nodes):
        name = op_name(node)
        if name not in ("mm", "matmul", "einsum", "__matmul__", "bmm"):
            continue
        found = _contraction(node, name)
        plan = None if found is None else _plan(*found, memo)
        if plan is None:
            continue
        a, b = found[:2]
        with graph.inserting_before(node):
            new = graph_call(graph, sparse_contraction, a, b, dataclasses.astuple(plan), meta_from=node)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        erase_dead(graph, [a, b])
        batch, M, K = plan.a_3d
        N = plan.b_3d[2]
        side = "rows" if (plan.sparse, plan.along) in (("a", "k"), ("b", "mn")) else "columns"
        shapes = f"[{M}, {K}] @ [{K}, {N}]" + (f" x{batch}" if batch > 1 else "")
        ctx.rewrite(layer_name(new), f"{name} {shapes} with at most {plan.nnz} non-zeros in each of "
                                     f"{'A' if plan.sparse == 'a' else 'B'}'s {side}",
                    "moe_compile.passes.sparse_contraction.sparse_contraction: topk of the non-zeros, "
                    "moe.gather_segment_sum (linear in tokens)")


def _contraction(node: fx.Node, name: str) -> tuple[Any, ...] | None:
    """``(A, B, batch axes of A, of B, A's contracted axes, A's kept axes, B's contracted axes, B's kept axes,
    output order)`` with the output order a list of ``("a" | "b", axis)`` (batch axes as A's); None when this is no
    two-operand contraction we read."""
    if name == "einsum":
        spec = einsum_terms(node)
        if spec is None or len(spec[0]) != 2:
            return None
        (ta, tb), out, (a, b) = spec
        shared = set(ta) & set(tb)
        batch = [ch for ch in ta if ch in shared and ch in out]
        contracted = [ch for ch in ta if ch in shared and ch not in out]
        if not contracted or any(ch not in out and ch not in shared for ch in ta + tb):
            return None  # an outer product, or an index summed within one operand
        out_letters = [("a", ta.index(ch)) if ch in ta else ("b", tb.index(ch)) for ch in out]
        return (a, b, [ta.index(ch) for ch in batch], [tb.index(ch) for ch in batch],
                [ta.index(ch) for ch in contracted], [i for i, ch in enumerate(ta) if ch not in shared],
                [tb.index(ch) for ch in contracted], [i for i, ch in enumerate(tb) if ch not in shared], out_letters)
    if len(node.args) != 2 or node.kwargs or not all(isinstance(x, fx.Node) for x in node.args):
        return None
    a, b = node.args
    sa, sb = shape_of(a), shape_of(b)
    if sa is None or sb is None:
        return None
    if len(sa) == len(sb) == 2:
        return a, b, [], [], [1], [0], [0], [1], [("a", 0), ("b", 1)]
    if len(sa) == len(sb) == 3 and name in ("bmm", "matmul", "__matmul__"):
        return a, b, [0], [0], [2], [1], [1], [2], [("a", 0), ("a", 1), ("b", 2)]
    return None


def _plan(a: fx.Node, b: fx.Node, a_bt: list[int], b_bt: list[int], a_k: list[int], a_m: list[int],
          b_k: list[int], b_n: list[int], out_letters: list[tuple[str, int]], memo: dict) -> Plan | None:
    sa, sb = shape_of(a), shape_of(b)
    if sa is None or sb is None or not all(v is not None and v.is_floating_point()
                                           for v in (tensor_val(a), tensor_val(b))):
        return None  # a symbolic size (a dynamic-shape compile), or integer operands
    if any(sa[i] != sb[j] for i, j in zip(a_k + a_bt, b_k + b_bt)):
        return None  # broadcasting along a contracted or batch index
    Bt, K = math.prod(sa[i] for i in a_bt), math.prod(sa[i] for i in a_k)
    M, N = math.prod(sa[i] for i in a_m), math.prod(sb[i] for i in b_n)
    choices = []
    for side, node, k_axes, kept, kept_size in (("a", a, a_k, a_m, M), ("b", b, b_k, b_n, N)):
        for along, axes, size in (("k", k_axes, K), ("mn", kept, kept_size)):
            if size < 8:
                continue
            bound = nonzeros(node, axes, memo)
            if bound is not None and 0 < bound <= MAX_FILL * size:
                choices.append((bound / size, side, along, bound))
    if not choices:
        return None
    _, side, along, bound = min(choices)
    order = [("a", i) for i in a_bt] + [("a", i) for i in a_m] + [("b", j) for j in b_n]
    out_shape = tuple(sa[i] for i in a_bt) + tuple(sa[i] for i in a_m) + tuple(sb[j] for j in b_n)
    return Plan(tuple(a_bt + a_m + a_k), (Bt, M, K), tuple(b_bt + b_k + b_n), (Bt, K, N), out_shape,
                tuple(order.index(x) for x in out_letters), side, along, bound)


def sparse_contraction(a: torch.Tensor, b: torch.Tensor, fields: tuple[Any, ...]) -> torch.Tensor:
    """``A @ B`` (laid out as the :class:`Plan` of ``fields`` says) through the sparse operand's at most ``nnz``
    non-zeros per slice: a ``topk`` picks them (in index order, no ties), ``moe.gather_segment_sum`` sums the rows
    they weigh in a fixed order."""
    plan = Plan(*fields)
    A = a.permute(plan.a_perm).reshape(plan.a_3d)
    B = b.permute(plan.b_perm).reshape(plan.b_3d)
    if plan.sparse == "b":  # out^T = B^T A^T: B^T the sparse left operand, its rows B's columns
        out = _sparse_left(B.transpose(1, 2), A.transpose(1, 2), plan.nnz, plan.along).transpose(1, 2)
    else:
        out = _sparse_left(A, B, plan.nnz, plan.along)
    # contiguous, as a product's result is: the user may .view() it
    return out.reshape(plan.out_shape).permute(plan.out_perm).contiguous()


def _sparse_left(S: torch.Tensor, X: torch.Tensor, nnz: int, along: str) -> torch.Tensor:
    """``S @ X`` for ``S [Bt, M, K]`` with at most ``nnz`` non-zeros per row (``along="k"``) or per column
    (``"mn"``), ``X [Bt, K, N]``: one fixed-order gather-sum over every batch, its rows offset by batch."""
    Bt, M, K = S.shape
    dim = 2 if along == "k" else 1
    n = S.shape[dim]
    pos = torch.arange(n, device=S.device)
    pos = pos if dim == 2 else pos.unsqueeze(1)
    key = torch.where(S != 0, 2 * n - pos, n - pos)  # distinct: non-zeros first, each in index order
    picked = key.topk(nnz, dim=dim).indices  # [Bt, M, nnz] or [Bt, nnz, K]
    weight = S.gather(dim, picked)
    acc = torch.float64 if X.dtype == torch.float64 else torch.float32
    X_flat = X.reshape(Bt * K, X.shape[2])
    batch = torch.arange(Bt, device=S.device).view(Bt, 1, 1)
    if dim == 2:  # entries (b, m, r): the output rows b*M + m are sorted
        rows = (batch * M + torch.arange(M, device=S.device).view(1, M, 1)).expand(Bt, M, nnz)
        return gather_segment_sum(X_flat, (batch * K + picked).reshape(-1), rows.reshape(-1), Bt * M,
                                  weight.reshape(-1).to(acc), idx_sorted=True).reshape(Bt, M, -1)
    # entries (b, k, r): the source rows b*K + k are sorted
    cols = (batch * K + torch.arange(K, device=S.device).view(1, 1, K)).expand(Bt, nnz, K)
    dest = batch * M + picked
    return gather_segment_sum(X_flat, cols.transpose(1, 2).reshape(-1), dest.transpose(1, 2).reshape(-1), Bt * M,
                              weight.transpose(1, 2).reshape(-1).to(acc), src_idx_sorted=True).reshape(Bt, M, -1)


__all__ = ["Plan", "run", "sparse_contraction"]
