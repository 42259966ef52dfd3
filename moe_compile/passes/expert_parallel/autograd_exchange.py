"""Exchanges written as an ``autograd.Function`` around ``dist.all_to_all_single`` (Megatron's ``_AllToAll``,
DeepSpeed's), made the functional autograd collective that :mod:`~moe_compile.passes.expert_parallel.match` reads.

Dynamo traces such a function into an ``autograd_function_apply`` whose forward body exchanges the rows into a fresh
buffer and whose backward body exchanges the gradient back at the swapped split sizes::

    recv = autograd_function_apply(fwd_body, bwd_body, *inputs)[0]
      fwd_body:  buf = rows.new_empty(sum(out_sizes), ...);  buf.copy_(wait(all_to_all_single(rows, out_sizes,
                 in_sizes, group)));  return (buf,), saved
      bwd_body:  back = grad.new_empty(...);  back.copy_(wait(all_to_all_single(grad, in_sizes, out_sizes, group)))
                 return (None, ..., back, ..., None)                          # back at the rows' position

Rewrites to (the same values and the same gradient, by the bodies' proof below)::

    recv = wait_with_grad(_c10d_functional_autograd.all_to_all_single(rows, out_sizes, in_sizes, group))

Proof, on the bodies: the forward calls nothing but grad-mode switches, size arithmetic (``size``, ``getitem``,
``sym_sum``), ``contiguous``, one ``new_empty``, one all-to-all, its wait and one ``copy_`` of it into the
``new_empty`` buffer it returns; its split sizes are body inputs (the sizes the function was called with) or sizes
it saved for the backward; the backward does the same with the incoming gradient, its split sizes the forward's
swapped (through what the forward saved), one group, and returns its buffer at the rows' input position and ``None``
everywhere else. Anything else is left alone.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from moe_compile.passes._graph import graph_call, op_name

ALL_TO_ALL = "_c10d_functional.all_to_all_single"
WAIT = "_c10d_functional.wait_tensor"
# pure ops a body may hold besides the exchange (sizes, views of inputs): none writes, and the proof below pins what
# the exchange reads and what the body returns
_PLUMBING = frozenset({"sym_sum", "contiguous", "size", "getitem"})


class _WaitWithGrad(torch.autograd.Function):
    """``wait_tensor`` whose gradient is the incoming one (whatever torch's own wait registers for autograd)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return torch.ops._c10d_functional.wait_tensor(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def wait_with_grad(tensor: torch.Tensor) -> torch.Tensor:
    return _WaitWithGrad.apply(tensor)


def canonicalise(graph: fx.Graph) -> list[fx.Node]:
    """Rewrite every proven ``autograd_function_apply`` exchange of ``graph``; returns the ones left alone whose
    forward body holds an all-to-all (not proven: the caller says so)."""
    unproven = []
    for hop in list(graph.nodes):
        found = _exchange_of(hop)
        if found is None:
            if _calls_all_to_all(hop):
                unproven.append(hop)
            continue
        item, rows, out_sizes, in_sizes, group = found
        with graph.inserting_before(hop):
            send = graph_call(graph, torch.ops._c10d_functional_autograd.all_to_all_single.default, rows,
                              out_sizes, in_sizes, group, meta_from=item)
            recv = graph_call(graph, wait_with_grad, send, meta_from=item)
        item.replace_all_uses_with(recv)
        bodies = hop.args[:2]
        graph.erase_node(item)
        graph.erase_node(hop)
        for body in bodies:
            if not body.users:
                graph.erase_node(body)
    return unproven


def _calls_all_to_all(hop: fx.Node) -> bool:
    gm = hop.graph.owning_module
    if op_name(hop) != "autograd_function_apply" or gm is None or not hop.args or not isinstance(hop.args[0], fx.Node):
        return False
    fwd = getattr(gm, str(hop.args[0].target), None)
    return isinstance(fwd, fx.GraphModule) and any(op_name(n) == ALL_TO_ALL for n in fwd.graph.nodes)


def function_bodies(hop: fx.Node) -> tuple[fx.Node, fx.GraphModule, fx.GraphModule, list[Any]] | None:
    """``(getitem, fwd_body, bwd_body, inputs)`` when ``hop`` is an ``autograd_function_apply`` read once, at its
    first output (the function's result), else None."""
    gm = hop.graph.owning_module
    if op_name(hop) != "autograd_function_apply" or gm is None or len(hop.args) < 3 or len(hop.users) != 1 \
            or not all(isinstance(a, fx.Node) and a.op == "get_attr" for a in hop.args[:2]):
        return None
    (item,) = hop.users
    if op_name(item) != "getitem" or item.args[1] != 0:
        return None
    fwd, bwd = (getattr(gm, a.target, None) for a in hop.args[:2])
    if not isinstance(fwd, fx.GraphModule) or not isinstance(bwd, fx.GraphModule):
        return None
    return item, fwd, bwd, list(hop.args[2:])


def _exchange_of(hop: fx.Node) -> tuple[fx.Node, fx.Node, list[Any], list[Any], str] | None:
    """``(getitem, rows, out_sizes, in_sizes, group)`` of the main graph when ``hop`` is a proven exchange."""
    parts = function_bodies(hop)
    if parts is None:
        return None
    item, fwd, bwd, inputs = parts
    fwd_in = list(fwd.graph.find_nodes(op="placeholder"))
    if len(fwd_in) != len(inputs):
        return None
    fwd_ex = _body_exchange(fwd, fwd_in)
    if fwd_ex is None:
        return None
    buf, src, out_sizes, in_sizes, group = fwd_ex
    out = fwd.graph.output_node().args[0]
    if not (isinstance(out, tuple) and len(out) == 2 and out[0] == (buf,) and isinstance(out[1], tuple)):
        return None
    if src not in fwd_in or not all(s in fwd_in for s in (*out_sizes, *in_sizes)):
        return None
    at = fwd_in.index(src)
    saved = list(out[1])  # what the forward hands the backward, in order after the gradient
    bwd_in = list(bwd.graph.find_nodes(op="placeholder"))
    if len(bwd_in) != 1 + len(saved):
        return None
    as_fwd = dict(zip(bwd_in[1:], saved))  # a backward input -> the forward value it is
    bwd_ex = _body_exchange(bwd, bwd_in)
    if bwd_ex is None:
        return None
    back, grad, b_out, b_in, b_group = bwd_ex
    if grad is not bwd_in[0] or b_group != group \
            or [as_fwd.get(s) for s in b_out] != list(in_sizes) or [as_fwd.get(s) for s in b_in] != list(out_sizes):
        return None
    bwd_out = bwd.graph.output_node().args[0]
    if not isinstance(bwd_out, tuple) or len(bwd_out) != len(inputs) \
            or any((o is not back) if i == at else (o is not None) for i, o in enumerate(bwd_out)):
        return None
    main = dict(zip(fwd_in, inputs))
    return item, main[src], [main[s] for s in out_sizes], [main[s] for s in in_sizes], group


def _body_exchange(body: fx.GraphModule, inputs: list[fx.Node]) -> tuple[fx.Node, fx.Node, list, list, str] | None:
    """``(buffer, source, out_sizes, in_sizes, group)`` when ``body`` is one all-to-all of an input into a fresh
    buffer (module docstring), the sizes body nodes; else None."""
    calls = [n for n in body.graph.nodes if n.op in ("call_function", "call_method")
             and n.target is not torch._C._set_grad_enabled]
    by_name: dict[str, list[fx.Node]] = {}
    for n in calls:
        by_name.setdefault(op_name(n) or "", []).append(n)
    if set(by_name) - _PLUMBING - {"new_empty", ALL_TO_ALL, WAIT, "copy_"} \
            or any(len(by_name.get(k, [])) != 1 for k in ("new_empty", ALL_TO_ALL, WAIT, "copy_")):
        return None
    (exchange,), (wait,), (copy,), (buf,) = by_name[ALL_TO_ALL], by_name[WAIT], by_name["copy_"], by_name["new_empty"]
    if len(exchange.args) < 4 or wait.args[0] is not exchange or copy.args[:2] != (buf, wait):
        return None
    src = exchange.args[0]
    if op_name(src) == "contiguous":
        src = src.args[0]
    out_sizes, in_sizes, group = exchange.args[1:4]
    if src not in inputs or not isinstance(out_sizes, (list, tuple)) or not isinstance(in_sizes, (list, tuple)) \
            or not isinstance(group, str):
        return None
    return buf, src, list(out_sizes), list(in_sizes), group
