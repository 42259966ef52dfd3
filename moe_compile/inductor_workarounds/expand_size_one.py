"""**A broadcast of a size that the shape guards make 1 but that is not the literal 1** (dynamic shapes; torch 2.13;
in Inductor's device-independent IR, seen on CPU, not yet run on a GPU; not reported upstream from here: the
reproducer is ``tests/test_expand_size_one.py``).

With dynamic shapes a size can be an expression, such as expert-choice's capacity ``C = max(1, 2 * T // E)``
(``Max(1, s0//4)``). On a call where it is 1, tracing adds the guard ``Eq(Max(1, s0//4), 1)`` (broadcasting asks
whether it is 1), and the graph is compiled for every ``T`` that keeps it 1 (``T < 8`` there). Inductor then decides
broadcasts with the guards (``sizevars.is_size_one_or_false``: the expression is 1, the other operand's size wins),
but ``ExpandView.make_reindexer`` zeroes the index of a broadcast dimension only where the size *is* the literal 1
(``actual[i] == 1``). So the expression-sized dimension is read at the other operand's index: a ``[E, H, C]`` times
``[E, C, N]`` product (the outer-product form Inductor gives ``bmm`` when its inner dimension is known to be 1, as in
the weight gradient of an expert-choice layer) reads ``tok[e, n]`` for every ``n < N``: past the end of ``tok``
(on CPU a ``TORCH_CHECK`` inside an OpenMP region, which aborts the process) or, within it, other experts' tokens:
silently wrong gradients. Plain Inductor does the same.

What moe_compile does: a graph (Dynamo's, before the passes) in which some tensor has a dimension whose size is a
symbolic expression, not a number, and statically known to be 1 (:func:`find`; no guard is added to decide it) is
compiled, forward and backward, with ``ExpandView.make_reindexer`` zeroing the index wherever the size is known to be 1
(:func:`patched_reindexer`: ``sizevars.statically_known_equals(size, 1)``, the literal 1 included), the same decision
its broadcast took. Other graphs compile as they are. The generated code differs only in the indices of such
dimensions (0 instead of a loop variable), so it costs nothing. The patch is in place only while that graph's
compile runs in this thread's call (Inductor lowers a graph in the calling thread; its compile workers only build the
code). The backend records a non-MoE ``rewrite`` (pass ``inductor_workaround``) per layer with such a size.

Caches: as for :mod:`.cpp_outer_loop`, whether a graph gets the patch depends only on that graph and moe_compile's
sources, which the FX graph and AOTAutograd cache keys hold (the stage passes' uuid), so a hit returns code compiled
with it.

Retire it when the pinned torch's ``make_reindexer`` decides by the guards: the control test then skips ("no longer
miscompiles"), and :data:`FIXED_IN` set to that version turns the workaround off (its tests stay).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from moe_compile.inductor_workarounds._common import Found, record_rewrite
from moe_compile.inductor_workarounds._common import needed as _needed
from moe_compile.passes._graph import layer_name

log = logging.getLogger(__name__)

# torch version whose Inductor no longer needs the workaround (None: every version we know of still does)
FIXED_IN: tuple[int, int] | None = None

NAME = "expand_of_size_known_one"


def needed(version: str = torch.__version__) -> bool:
    """Whether this torch still needs the workaround (:data:`FIXED_IN`)."""
    return _needed(FIXED_IN, version)


def _sizes_known_one(value: Any) -> bool:
    """Whether a tensor in ``value`` (a node's example value: a tensor or a tuple of them) has a dimension whose
    size is a symbolic expression that is statically known to be 1."""
    if isinstance(value, (tuple, list)):
        return any(_sizes_known_one(v) for v in value)
    if not isinstance(value, torch.Tensor):
        return False
    return any(isinstance(size, torch.SymInt) and not isinstance(size.node.expr, sympy.Number)
               and statically_known_true(size == 1) for size in value.shape)


def find(gm: fx.GraphModule, inductor_options: dict[str, Any] | None = None) -> Found | None:
    """The layers of ``gm`` (Dynamo's graph) with a tensor that has a dimension of a symbolic size known to be 1,
    or None. One pass over the nodes' example values."""
    if not needed():
        return None
    layers = [layer_name(node) for node in gm.graph.nodes
              if _sizes_known_one(node.meta.get("example_value", node.meta.get("val")))]
    return Found(tuple(dict.fromkeys(layers))) if layers else None


def patched_reindexer(self: Any) -> Callable[[Sequence[sympy.Expr]], Sequence[sympy.Expr]]:
    """``ExpandView.make_reindexer`` zeroing a broadcast dimension's index wherever its size is known to be 1."""
    from torch._inductor.virtualized import V

    target, actual = self.get_size(), self.data.get_size()
    skip = len(target) - len(actual)
    ones = [V.graph.sizevars.statically_known_equals(size, 1) for size in actual]

    def reindex(index: Sequence[sympy.Expr]) -> Sequence[sympy.Expr]:
        index = list(index[skip:])
        assert len(index) == len(actual)
        return [sympy.S.Zero if one else i for i, one in zip(index, ones)]

    return reindex


@contextlib.contextmanager
def reindexer_patched() -> Iterator[None]:
    """:func:`patched_reindexer` in place of Inductor's for the duration (restored after, also on error)."""
    from torch._inductor import ir

    original = ir.ExpandView.make_reindexer
    ir.ExpandView.make_reindexer = patched_reindexer
    try:
        yield
    finally:
        ir.ExpandView.make_reindexer = original


def apply(found: Found | None, inner: Callable[..., Any]) -> Callable[..., Any]:
    """Record ``found`` (explain) and return ``inner`` (Inductor's ``compile_fx_inner``) patched for it."""
    if found is None:
        return inner
    detail = ("a dimension whose size is a symbolic expression the shape guards make 1 (dynamic shapes): Inductor "
              "broadcasts it by the guards but indexes it as full size (ExpandView.make_reindexer); compiled with "
              "the reindexing decided by the guards")
    record_rewrite(NAME, found, detail, log)

    @functools.wraps(inner)
    def compile_inner(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
        with reindexer_patched():
            return inner(gm, example_inputs, **kwargs)

    return compile_inner
