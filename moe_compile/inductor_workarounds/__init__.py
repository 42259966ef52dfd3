"""Known Inductor miscompiles that moe_compile steers around, per graph: one module each, with what the bug is,
when it applies, what the workaround costs and how to retire it.

* :mod:`.cpp_outer_loop`: CPU outer-loop fusion with a one-row local buffer under a tiled outer loop (pytorch
  issue 185702): wrong gradients for expert-choice routing's softmax scores; ``cpp.simdlen = 1`` for the backward.
* :mod:`.expand_size_one`: a broadcast of a dimension whose size is a symbolic expression the shape guards make 1
  (dynamic shapes, ``C = max(1, T // E)``): indexed as if it were full size, out of bounds or silently wrong (the
  IR is device-independent; seen on CPU); the expand's reindexing patched for that graph's compile.

Each module has ``find(gm, inductor_options) -> Found | None`` (on Dynamo's graph, before the pre-grad passes) and
``apply(found, inner) -> inner`` (records the rewrite or the skip for ``explain``, pass :data:`PASS_NAME`, and wraps
Inductor's inner compile). :func:`wrap_inner_compile` runs every one of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.fx as fx

from moe_compile.inductor_workarounds import cpp_outer_loop, expand_size_one
from moe_compile.inductor_workarounds._common import PASS_NAME, STAGE

WORKAROUNDS = (cpp_outer_loop, expand_size_one)


def wrap_inner_compile(gm: fx.GraphModule, inductor_options: dict[str, Any] | None,
                       inner: Callable[..., Any]) -> Callable[..., Any]:
    """``inner`` (Inductor's ``compile_fx_inner``) wrapped by every workaround ``gm`` needs; ``inner`` itself when
    it needs none."""
    for workaround in WORKAROUNDS:
        inner = workaround.apply(workaround.find(gm, inductor_options), inner)
    return inner


__all__ = ["PASS_NAME", "STAGE", "WORKAROUNDS", "cpp_outer_loop", "expand_size_one", "wrap_inner_compile"]
