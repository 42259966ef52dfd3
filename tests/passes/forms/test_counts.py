"""``forms.counts``: per-expert counts are read in every spelling the Dynamo versions we support record.

torch 2.11's Dynamo records ``ids[:, None] == torch.arange(E)`` on tensors as the method ``__eq__``, torch 2.13 as
``operator.eq``: both must be the same count (the GPU capture test of a Megatron-style layer found the first left
alone: ``counts_not_histogram``).
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

from moe_compile.passes._graph import op_name
from moe_compile.passes.forms.counts import expert_counts
from tests.passes.forms.test_rowwise import _Propagate


@pytest.mark.parametrize("spelling", ["method __eq__", "operator.eq", "unsqueeze(dim=-1)"])
def test_eq_arange_sum_counts_in_either_spelling(spelling):
    """Also with the column made by ``unsqueeze(dim=-1)`` (a keyword: vLLM's spelling; read positionally it was an
    IndexError that made three passes raise on the blind corpus's ``vllm_pallas_gmm``)."""
    E, S = 8, 12
    graph = fx.Graph()
    ids = graph.placeholder("ids_S")
    col = graph.call_method("unsqueeze", (ids,), {"dim": -1}) if spelling.startswith("unsqueeze") \
        else graph.call_method("unsqueeze", (ids, 1))
    experts = graph.call_function(torch.arange, (E,))
    eq = graph.call_method("__eq__", (col, experts)) if spelling.startswith("method") \
        else graph.call_function(operator.eq, (col, experts))
    counts = graph.call_method("sum", (eq, 0))
    graph.output(counts)
    gm = fx.GraphModule(torch.nn.Module(), graph)
    ids_S = torch.randint(0, E, (S,))
    out = _Propagate(gm).run(ids_S)
    assert torch.equal(out, torch.bincount(ids_S, minlength=E))  # the graph does count
    assert op_name(eq) == "eq"
    assert expert_counts(counts, lambda n: n is ids) == (E, "(ids == arange(E)).sum")
