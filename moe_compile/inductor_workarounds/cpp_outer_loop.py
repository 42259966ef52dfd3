"""**CPU outer-loop fusion with a one-row local buffer under a tiled outer loop** (pytorch issue 185702, fixed upstream
by PR 185855; present in torch 2.13, the version moe_compile pins, and in every torch since outer-loop fusion came to
the C++ backend, PR 121625). Inductor's C++ codegen fuses a row reduction and the pointwise ops after it under one
outer loop, and keeps the intermediate row in a local buffer sized for one row (``local_buffer_data_0[x1]``). That is
only right when each iteration of the outer loop handles one row. When a read in transposed layout makes the
vectoriser tile the outer loop (``x0 += 16``, a ``transpose_mxn`` of the other operand), one iteration handles up to
16 rows, each writes its row into the same one-row buffer, and the pointwise phase reads the last row's values for
all of them: silently wrong results.

In an MoE this is expert-choice routing (each expert takes its top-C tokens): ``scores = softmax(router(x), -1)``,
``topk(scores.t(), C)``. The backward of ``topk`` over the transposed scores scatters the gradient into a ``[E, T]``
buffer, and softmax's backward (``y * (g - sum(g * y))``, a row reduction and a pointwise op over the same row of
``y``) reads it transposed: Inductor returns input and router gradients 0.4-0.9 normwise from eager's (fp32 and
bf16), the forward is right. The minimal reproducer is ``topk(softmax(s, -1).t(), 1)`` for ``s`` of shape ``[2, 8]``
(``tests/test_cpu_miscompile.py``); ``sort``, ``kthvalue``, ``max(dim)``, ``gather`` and advanced indexing over the
transposed softmax do the same, ``sigmoid`` scores do not (no row reduction), nor does ``topk(scores, C, dim=0)``.

What moe_compile does: a graph on CPU in which a softmax with a gradient reaches, through views and casts only, one of
those selection ops along a dimension that is not its input's contiguous one (:func:`find`) gets
``cpp.simdlen = 1`` (no vectorisation: no tiled outer loop, so the one-row buffer is right) for its *backward* graph
only (:func:`inner_compile`): the forward, and every graph without the pattern, keep vectorisation. Among Inductor's
options this is the one that removes the precondition of the bug; none of them turns outer-loop fusion off
(``cpp.enable_tiling_heuristics``, ``cpp.enable_loop_tail_vec``, ``pick_loop_orders``,
``loop_ordering_after_fusion``, ``cpp.max_horizontal_fusion_size`` leave the gradients wrong; ``cpp.simdlen = 256``
too; ``realize_reads_threshold = 1`` happens to avoid it by realising the softmax, a side effect that nothing
guarantees). A user's own ``cpp.simdlen`` in ``options=`` wins (a ``skip`` record says so). The backend records a
non-MoE ``rewrite`` (pass ``inductor_workaround``) per layer with the pattern, and logs it.

Caches: the patch is applied inside the backward's compile, so Inductor's FX graph cache keys it, but the AOTAutograd
cache key (taken outside) does not name it. It needs not: whether a graph gets it depends only on that graph,
``options=``, the torch version and moe_compile's sources, which that key holds (the stage passes' uuid hashes every
file of the package).

Retire it when the torch that moe_compile pins contains PR 185855: the control test in
``tests/test_cpu_miscompile.py`` then skips ("no longer miscompiles"), and :data:`FIXED_IN` set to that version
turns the workaround off for it and later versions (its tests stay: they check that the gradients are right).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from moe_compile import report
from moe_compile.inductor_workarounds._common import PASS_NAME, STAGE, Found, record_rewrite
from moe_compile.inductor_workarounds._common import needed as _needed
from moe_compile.passes._graph import arg, layer_name, op_name, val

log = logging.getLogger(__name__)

# torch version whose Inductor no longer needs the workaround (None: every version we know of still does)
FIXED_IN: tuple[int, int] | None = None

NAME = "cpp_outer_loop_local_buffer"
ISSUE = "pytorch/pytorch#185702 (fix: pytorch/pytorch#185855)"
# Inductor config for the backward graph of a graph that shows the pattern
PATCHES: dict[str, Any] = {"cpp.simdlen": 1}

_SOFTMAX = frozenset({"softmax", "log_softmax", "_softmax", "_log_softmax", "aten._softmax", "aten._log_softmax",
                      "aten.softmax", "aten.log_softmax"})
# views and casts a softmax's output may pass through on its way to the selection op (x.T / x.mT: getattr)
_THROUGH = frozenset({"t", "transpose", "permute", "swapaxes", "swapdims", "movedim", "moveaxis", "view", "reshape",
                      "contiguous", "to", "float", "double", "half", "bfloat16", "type", "type_as", "clone",
                      "unsqueeze", "squeeze", "flatten", "getattr", "aten.t", "aten.transpose", "aten.permute",
                      "aten.view", "aten.reshape", "aten.clone", "aten._to_copy", "aten.unsqueeze",
                      "aten.squeeze"})
# selection ops (their backward scatters into the layout of their input), with the position of ``dim`` and its
# default (None: the op selects along no single dim without one)
_SELECT: dict[str, tuple[int, int | None]] = {
    "topk": (2, -1), "sort": (1, -1), "kthvalue": (2, -1), "max": (1, None), "min": (1, None), "gather": (1, None),
    "take_along_dim": (2, None), "aten.topk": (2, -1), "aten.sort": (1, -1), "aten.kthvalue": (2, -1),
    "aten.max": (1, None), "aten.min": (1, None), "aten.gather": (1, None),
}


def needed(version: str = torch.__version__) -> bool:
    """Whether this torch still needs the workaround (:data:`FIXED_IN`)."""
    return _needed(FIXED_IN, version)


def _softmax_source(node: fx.Node) -> fx.Node | None:
    """The softmax that ``node`` is a view or cast of (a few steps back), else None."""
    for _ in range(8):
        name = op_name(node)
        if name in _SOFTMAX:
            return node
        if name not in _THROUGH or not node.args or not isinstance(node.args[0], fx.Node):
            return None
        if name == "getattr" and node.args[1:2] not in (("T",), ("mT",)):
            return None
        node = node.args[0]
    return None


def _selects_across_rows(node: fx.Node) -> bool:
    """``node`` selects along a dim of its input that is not the contiguous one (a transposed view)."""
    x = val(node.args[0]) if node.args else None
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        return False
    name = op_name(node) or ""
    if name == "getitem":  # advanced indexing by a tensor: rows of a view whose last dim is not contiguous
        index = node.args[1]
        parts = index if isinstance(index, (tuple, list)) else (index,)
        dim: Any = -1
        if not any(isinstance(val(p), torch.Tensor) for p in parts):
            return False
    else:
        pos, default = _SELECT[name]
        dim = arg(node, pos, "dim", default)
    if not isinstance(dim, int):
        return False
    dim %= x.dim()
    # sizes and strides may be symbolic (dynamic shapes): decide without adding guards
    return not statically_known_true(x.shape[dim] == 1) and not statically_known_true(x.stride(dim) == 1)


def find(gm: fx.GraphModule, inductor_options: dict[str, Any] | None = None) -> Found | None:
    """The layers of ``gm`` (Dynamo's graph, before moe_compile's passes) that trip the miscompile, or None.

    A match: on CPU, a softmax whose output requires grad reaches a selection op (``topk``, ``sort``, ``kthvalue``,
    ``max``/``min`` along a dim, ``gather``, ``take_along_dim``, advanced indexing) through views and casts only, and
    the op selects along a dim that is not contiguous in its input (``scores.t()``). One pass over the nodes.
    """
    if not needed():
        return None
    layers: list[str] = []
    for node in gm.graph.nodes:
        name = op_name(node)
        if name not in _SELECT and name != "getitem":
            continue
        if not node.args or not isinstance(node.args[0], fx.Node):
            continue
        source = _softmax_source(node.args[0])
        y = val(source) if source is not None else None
        if not isinstance(y, torch.Tensor) or y.device.type != "cpu" or not y.requires_grad:
            continue
        if _selects_across_rows(node):
            layers.append(layer_name(node))
    if not layers:
        return None
    overridden = any(k in PATCHES for k in (inductor_options or {}))
    return Found(tuple(dict.fromkeys(layers)), overridden)


def apply(found: Found | None, inner: Callable[..., Any]) -> Callable[..., Any]:
    """Record ``found`` (explain) and return ``inner`` (Inductor's ``compile_fx_inner``) patched for it."""
    if found is None:
        return inner
    if found.overridden:
        detail = (f"options= set {sorted(PATCHES)} themselves: the workaround for {ISSUE} is off, and the backward "
                  "may come out wrong on this torch")
        log.warning("moe_compile: %s (layers %s)", detail, ", ".join(found.layers))
        for layer in found.layers:
            report.add(report.PassRecord(PASS_NAME, STAGE, "skip", layer, "user_options", detail))
        return inner
    detail = (f"softmax scores selected across rows (topk/sort/gather of a transposed view): Inductor's C++ outer-loop "
              f"fusion miscompiles their backward ({ISSUE}); backward graph compiled with "
              f"{', '.join(f'{k}={v}' for k, v in PATCHES.items())}")
    record_rewrite(NAME, found, detail, log)
    return inner_compile(inner)


def inner_compile(inner: Callable[..., Any]) -> Callable[..., Any]:
    """``inner`` with :data:`PATCHES` applied to backward graphs (``is_backward=True``) only."""

    @functools.wraps(inner)
    def compile_inner(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
        if not kwargs.get("is_backward", False):
            return inner(gm, example_inputs, **kwargs)
        with torch._inductor.config.patch(PATCHES):
            return inner(gm, example_inputs, **kwargs)

    return compile_inner
