"""Replace transformers' ``grouped_mm_fallback`` custom op (hidden host sync) by ``moe.grouped_mm``.

Matches:
    ``torch.ops.transformers.grouped_mm_fallback(x_SK, w_EKN, offs=offs_E)``: what transformers' experts
    call instead of ``torch._grouped_mm`` when the weights are not bf16 under ``torch.compile`` (fp32,
    fp16 models). Its eager body runs ``offs.tolist()`` and a loop of ``torch.mm`` in forward *and*
    backward: a device-to-host sync per call, not CUDA-graph safe, opaque to Inductor.

Rewrites to:
    ``torch.ops.moe.grouped_mm(x_SK, w_EKN.transpose(-2, -1), offs_E)``: the same product per expert
    segment (rows past ``offs[-1]`` are zero in both), sync-free on the device, with deterministic
    autograd (``dX`` by a grouped GEMM, ``dW`` by ``moe.grouped_mm_wgrad``).

Fires when:
    ``x`` is 2-D, ``w`` is 3-D with ``x``'s dtype, ``offs`` is a 1-D int32 tensor with one entry per expert.

Skips when (reason tags):
    ``unexpected_signature`` (other ranks / dtypes / offsets), ``ops_unavailable`` (``moe.grouped_mm``
    is not registered).

Stage:
    pre-grad, after ``fuse_dispatch`` (which only swaps the op's ``offs``): AOTAutograd then traces
    ``moe.grouped_mm``'s registered autograd, so the fallback's backward op disappears too.

Seen in:
    transformers 5.x ``integrations/moe.py::_grouped_mm`` (fp32/fp16 Mixtral, Qwen2/3-MoE, OLMoE,
    Granite-MoE, ... under ``torch.compile``).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from moe_compile.passes import PassContext
from moe_compile.passes._graph import arg, graph_call, layer_name, op_name, ops_available, tensor_val

FALLBACK = "transformers.grouped_mm_fallback"


def run(graph: fx.Graph, ctx: PassContext) -> None:
    for node in list(graph.nodes):
        if op_name(node) != FALLBACK or node.op != "call_function":
            continue
        layer = layer_name(node)
        x, w, offs = node.args[0], arg(node, 1, "weight"), arg(node, 2, "offs")
        xv, wv, ov = tensor_val(x), tensor_val(w), tensor_val(offs)
        if xv is None or wv is None or ov is None or xv.dim() != 2 or wv.dim() != 3 or xv.dtype != wv.dtype \
                or ov.dim() != 1 or ov.dtype != torch.int32 or ov.shape[0] != wv.shape[0]:
            ctx.skip(layer, "unexpected_signature",
                     "grouped_mm_fallback needs x[S, K], w[E, K, N] of x's dtype and int32 offs[E]")
            continue
        if not ops_available("grouped_mm"):
            ctx.skip(layer, "ops_unavailable", "torch.ops.moe.grouped_mm is not registered")
            continue
        with graph.inserting_before(node):
            w_ENK = graph_call(graph, torch.transpose, w, -2, -1, meta_from=node)
            new = graph_call(graph, torch.ops.moe.grouped_mm.default, x, w_ENK, offs, meta_from=node)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        ctx.rewrite(layer, "transformers.grouped_mm_fallback (offs.tolist() host sync)", "moe.grouped_mm (sync-free)")

