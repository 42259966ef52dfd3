"""The one row-wise prover (:mod:`moe_compile.passes.forms.rowwise`) under each pass's policy, op by op.

Each case is a tiny function of the routed rows ``x`` (and tensors from outside the region), traced to FX
(``call_function`` / ``call_method`` / ``operator.getitem``, as Dynamo spells them) with example values from
fresh random inputs. The last op is fed to :class:`RowwiseProof`; every other op computed from ``x`` is
region. A refusal must carry the exact reason tag.

Before the merge each pass had its own prover; where they disagreed, a policy field keeps each pass's answer
(see the table in the module docstring). The cases that show each difference:

=====================================  ===========  ===========  ===========  ==================================
case                                   dispatch     host_sync    expert_loop  policy field
=====================================  ===========  ===========  ===========  ==================================
unsqueeze, sum(-1), softmax, norms,    ok           refused      refused      ops (fuse_dispatch knows more ops)
view, cat(dim=1), mm
narrow                                 refused      ok           ok           ops
linear/matmul in the loop body         -            -            refused      ops (the loop plans its GEMMs
                                                                              itself, before asking the prover)
trained shared weight, training        shared_      shared_      refused      tail_rows
(NOTE [tail rows] (moe_compile/passes/forms/rowwise.py))
                                       param_...    param_...
type_as / mul by a per-row tensor      refused      refused      ok           operands
[6] + [1, 6] (rows become 1)           refused      ok           ok           operands ("aligned" counts rows)
table[sorted ids]                      ok           refused      refused      getitem + row_independent
x[:, None]                             refused      ok           refused      getitem
x[:, :4]                               ok           ok           refused      getitem
unbind(x, 1) (dim by position)         ok           refused      refused      split_dims (host_sync and the loop
                                                                              read unbind's dim by keyword only)
matmul(x, v) with 1-D v                ok           refused      refused      matmul_vector_weight
grouped GEMM, weight not [E, ., .]     ok           refused      refused      grouped_mm_offsets
=====================================  ===========  ===========  ===========  ==================================
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from moe_compile.passes import NoMatch
from moe_compile.passes._graph import op_name
from moe_compile.passes.forms.rowwise import (
    DISPATCH,
    EXPERT_LOOP,
    HOST_SYNC,
    RULES,
    RowwiseProof,
)

R = "region_not_rowwise"
P = "per_expert_op_unsupported"
T = "shared_param_in_expert_region"
OK = None
POLICIES = {"dispatch": DISPATCH, "host_sync": HOST_SYNC, "expert_loop": EXPERT_LOOP}
M, H, E = 6, 8, 2


def _rows(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(M, H, dtype=dtype)


# name -> (fn(x, *outside), x, outside inputs, {policy: expected}, options)
# options: "trained" (outside tensors require grad, prover in training), "row_independent" (fuse_dispatch
# treats the region input as the sorted ids), "num_experts"
CASES: dict[str, tuple[Callable[..., Any], Callable[[], Any], Callable[[], tuple], tuple, dict[str, Any]]] = {
    "silu": (lambda x: F.silu(x), _rows, tuple, (OK, OK, OK), {}),
    "cast": (lambda x: x.to(torch.bfloat16), _rows, tuple, (OK, OK, OK), {}),
    "float": (lambda x: x.float(), _rows, tuple, (OK, OK, OK), {}),
    "clamp": (lambda x: torch.clamp(x, min=0.0), _rows, tuple, (OK, OK, OK), {}),
    "mul_shared_vector": (lambda x, w: x * w, _rows, lambda: (torch.randn(H),), (OK, OK, OK), {}),
    "add_row_broadcast": (lambda x, b: x + b, _rows, lambda: (torch.randn(1, H),), (OK, OK, OK), {}),
    "mul_per_row": (lambda x, r: x * r, _rows, lambda: (torch.randn(M, H),), (R, R, OK), {}),
    "type_as_per_row": (lambda x, r: x.type_as(r), _rows, lambda: (torch.randn(M, H).half(),), (R, R, OK), {}),
    "rows_become_one": (lambda x, o: x + o, lambda: torch.randn(M), lambda: (torch.randn(1, M),), (R, OK, OK), {}),
    "unsqueeze_last": (lambda x: x.unsqueeze(-1), _rows, tuple, (OK, R, P), {}),
    "unsqueeze_first": (lambda x: x.unsqueeze(0), _rows, tuple, (R, R, P), {}),
    "sum_last": (lambda x: x.sum(-1), _rows, tuple, (OK, R, P), {}),
    "sum_rows": (lambda x: x.sum(0), _rows, tuple, (R, R, P), {}),
    "softmax": (lambda x: F.softmax(x, dim=-1), _rows, tuple, (OK, R, P), {}),
    "layer_norm": (lambda x, w, b: F.layer_norm(x, (H,), w, b), _rows, lambda: (torch.randn(H), torch.randn(H)),
                   (OK, R, P), {}),
    "layer_norm_trained": (lambda x, w, b: F.layer_norm(x, (H,), w, b), _rows,
                           lambda: (torch.randn(H), torch.randn(H)), (T, T, P), {"trained": True}),
    "dropout_random": (lambda x: F.dropout(x, 0.1, True), _rows, tuple, (R, R, P), {}),
    "dropout_off": (lambda x: F.dropout(x, 0.0, True), _rows, tuple, (OK, R, P), {}),
    "view_keeps_rows": (lambda x: x.view(M, 2, H // 2), _rows, tuple, (OK, R, P), {}),
    "view_flat": (lambda x: x.view(-1), _rows, tuple, (R, R, P), {}),
    "transpose": (lambda x: x.transpose(0, 1), _rows, tuple, (R, R, P), {}),
    "cat_last": (lambda x: torch.cat([x, F.silu(x)], dim=1), _rows, tuple, (OK, R, P), {}),
    "cat_rows": (lambda x: torch.cat([x, F.silu(x)], dim=0), _rows, tuple, (R, R, P), {}),
    "chunk_last": (lambda x: x.chunk(2, dim=-1), _rows, tuple, (OK, OK, OK), {}),
    "chunk_rows": (lambda x: x.chunk(2, 0), _rows, tuple, (R, R, P), {}),
    "split_positional_dim": (lambda x: torch.split(x, 4, 1), _rows, tuple, (OK, OK, OK), {}),
    "split_item": (lambda x: torch.split(x, 4, 1)[0], _rows, tuple, (OK, OK, OK), {}),
    "narrow_last": (lambda x: x.narrow(1, 0, 4), _rows, tuple, (R, OK, OK), {}),
    "unbind_positional_dim": (lambda x: x.unbind(1), _rows, tuple, (OK, R, P), {}),
    "unbind_keyword_dim": (lambda x: x.unbind(dim=1), _rows, tuple, (OK, OK, OK), {}),
    "index_last_dims": (lambda x: x[:, :4], _rows, tuple, (OK, OK, P), {}),
    "index_ellipsis": (lambda x: x[..., 0], _rows, tuple, (OK, OK, P), {}),
    "index_rows": (lambda x: x[:4], _rows, tuple, (R, R, P), {}),
    "index_new_dim": (lambda x: x[:, None], _rows, tuple, (R, OK, P), {}),
    "table_lookup": (lambda ids, table: table[ids], lambda: torch.randint(0, E, (M,)),
                     lambda: (torch.randn(E, H),), (OK, R, P), {"row_independent": True}),
    "linear_shared": (lambda x, w: F.linear(x, w), _rows, lambda: (torch.randn(4, H),), (OK, OK, P), {}),
    "linear_trained": (lambda x, w: F.linear(x, w), _rows, lambda: (torch.randn(4, H),), (T, T, P),
                       {"trained": True}),
    "matmul": (lambda x, w: x @ w, _rows, lambda: (torch.randn(H, 4),), (OK, OK, P), {}),
    "matmul_vector": (lambda x, v: torch.matmul(x, v), _rows, lambda: (torch.randn(H),), (OK, R, P), {}),
    "mm": (lambda x, w: torch.mm(x, w), _rows, lambda: (torch.randn(H, 4),), (OK, R, P), {}),
    "grouped_mm": (lambda x, w, offs: torch._grouped_mm(x, w, offs=offs), lambda: _rows(torch.bfloat16),
                   lambda: (torch.randn(E, H, 8, dtype=torch.bfloat16), torch.tensor([2, M], dtype=torch.int32)),
                   (OK, OK, P), {"num_experts": E}),
    "grouped_mm_wrong_E": (lambda x, w, offs: torch._grouped_mm(x, w, offs=offs), lambda: _rows(torch.bfloat16),
                           lambda: (torch.randn(E, H, 8, dtype=torch.bfloat16),
                                    torch.tensor([2, M], dtype=torch.int32)), (OK, R, P), {"num_experts": E + 1}),
    "grouped_mm_trained": (lambda x, w, offs: torch._grouped_mm(x, w, offs=offs), lambda: _rows(torch.bfloat16),
                           lambda: (torch.randn(E, H, 8, dtype=torch.bfloat16),
                                    torch.tensor([2, M], dtype=torch.int32)), (OK, OK, P),
                           {"num_experts": E, "trained": True}),
    "not_rowwise_flip": (lambda x: x.flip(0), _rows, tuple, (R, R, P), {}),
    "sort_last": (lambda x: torch.sort(x, -1), _rows, tuple, (R, R, P), {}),
}


class _Propagate(fx.Interpreter):
    """Runs the traced graph, keeping each node's value as its ``example_value`` (what Dynamo records)."""

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        n.meta["example_value"] = out
        return out


def traced(fn: Callable[..., Any], inputs: list[torch.Tensor]) -> fx.Graph:
    gm = fx.symbolic_trace(fn)
    mode = FakeTensorMode()
    with mode:
        fakes = [mode.from_tensor(t) for t in inputs]
        _Propagate(gm).run(*fakes)
    return gm.graph


def prove(case: str, policy_name: str) -> str | None:
    fn, make_x, make_outside, _, opts = CASES[case]
    outside = list(make_outside())
    if opts.get("trained"):
        outside = [t.requires_grad_() if t.is_floating_point() else t for t in outside]
    graph = traced(fn, [make_x(), *outside])
    x = next(iter(graph.find_nodes(op="placeholder")))
    tested = graph.output_node().args[0]
    space = "S" if policy_name == "dispatch" else "rows"
    region = {x: space}
    for n in graph.nodes:  # everything computed from x before the tested node
        if n is not tested and n.op in ("call_function", "call_method") and any(a in region for a in n.all_input_nodes):
            region[n] = space
    row_independent = (lambda node: node is x) if opts.get("row_independent") else None
    proof = RowwiseProof(POLICIES[policy_name], region, num_experts=opts.get("num_experts"),
                         training=bool(opts.get("trained")), row_independent=row_independent)
    try:
        proof.check(tested)
    except NoMatch as exc:
        return exc.reason
    return None


@pytest.mark.parametrize("policy_name", list(POLICIES))
@pytest.mark.parametrize("case", list(CASES))
def test_rowwise_rules(case: str, policy_name: str) -> None:
    expected = dict(zip(POLICIES, CASES[case][3]))[policy_name]
    assert prove(case, policy_name) == expected


def test_every_accepted_op_has_a_rule() -> None:
    for policy in POLICIES.values():
        assert policy.ops <= set(RULES), policy.ops - set(RULES)


def test_cases_use_the_ops_they_name() -> None:
    """The traced spellings are the ones the rule table knows (a renamed op would make the table silently lie)."""
    names = set()
    for fn, make_x, make_outside, _, _ in CASES.values():
        graph = traced(fn, [make_x(), *make_outside()])
        names.add(op_name(graph.output_node().args[0]))
    assert {"silu", "to", "unsqueeze", "layer_norm", "linear", "matmul", "_grouped_mm", "getitem", "unbind",
            "narrow", "split", "chunk", "cat", "view", "dropout", "sum", "softmax"} <= names
