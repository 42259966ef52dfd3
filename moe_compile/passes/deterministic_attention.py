"""With ``deterministic=True``: library kernels with a deterministic mode are called in that mode.

FlashAttention-2's and memory-efficient attention's backward kernels sum dQ over key blocks with atomic
adds unless torch's deterministic flag is on when they are called; that was the last
run-to-run difference in a Qwen3-MoE training step once the scatters were deterministic (the gradients
of every query projection, and everything before it). Each such node is pointed at
``moe::deterministic_<op>`` (:mod:`moe_compile.ops.deterministic_flag`), which calls the same aten op
with the flag on for that call only.

Matches::

    g_q, g_k, g_v = aten._scaled_dot_product_flash_attention_backward(grad, q, k, v, out, lse, ...)

Rewrites to::

    g_q, g_k, g_v = moe.deterministic__scaled_dot_product_flash_attention_backward(grad, q, k, v, out, lse, ...)

(the same arguments; the ops are :data:`moe_compile.ops.deterministic_flag.WRAPPED`). Any device: on CPU
the wrapped ops do not exist as kernels, so the nodes never appear there.

Fires when:
    ``config.deterministic`` is on. The cuDNN attention backward has no such mode: with the option the
    backend traces SDPA with cuDNN disabled (``deterministic_flag.deterministic_sdpa``), so SDPA becomes
    flash attention; a cuDNN attention called directly stays, and the audit names it.

Stage:
    joint (ATen), after ``deterministic_scatter``: the backward formulas are in the joint graph.
"""

from __future__ import annotations

import torch.fx as fx

from moe_compile.ops.deterministic_flag import WRAPPED
from moe_compile.passes import PassContext
from moe_compile.passes._graph import layer_name, op_name


def run(graph: fx.Graph, ctx: PassContext) -> None:
    for node in graph.nodes:
        if node.op == "call_function" and node.target in WRAPPED:
            before = op_name(node)
            node.target = WRAPPED[node.target]
            ctx.rewrite(layer_name(node), before, f"{op_name(node)} (torch's deterministic flag on for the call)",
                        moe=False)
