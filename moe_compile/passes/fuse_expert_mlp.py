"""Fuse an expert MLP's first grouped GEMM and its GLU into ``moe.expert_gemm`` (the GLU in the GEMM's epilogue).

Matches (in a layer ``fuse_dispatch`` rewrote; ``offs_E`` is ``moe.permute_pad``'s):
    ``gu = grouped_mm(x_MK, W, offs_E)``: ``torch._grouped_mm(x, W_EKN, offs=offs_E)`` or
    ``moe.grouped_mm(x, W_ENK, offs_E)``, no bias, no ``out_dtype``;
    ``h = middle(gu)``: any subgraph of ``gu`` alone (nothing else of the graph enters it) whose last node feeds a
    second grouped GEMM over the same ``offs_E``, and which computes a GLU of ``ops/expert_gemm.py``'s
    ``GLU_ACTIVATIONS`` (``act(gate) * up``, gate columns first): checked by running it (float casts taken out)
    on a probe (:func:`moe_compile.experts.interface.glu_of`), not by its spelling, so ``chunk`` / slicing /
    ``nn.SiLU`` / ``x * sigmoid(x)`` all count.

Rewrites to:
    ``h = moe.expert_gemm(x_MK, W_ENK, offs_E, None, None, glu, M, False)[0]`` (cast to ``h``'s dtype if
    the middle ended in another); the second GEMM and the combine stay as they are. The Triton family or CUTLASS
    runs per GEMM from the measured table (NOTE [grouped GEMM choice] (moe_compile/ops/_expert_gemm_tuning.py)); the GLU
    is computed in fp32 and cast once (the middle may have rounded in bf16 between its ops: within the op's documented
    tolerance).

Skips when (reason tags):
    ``training`` (the GEMM's output needs a gradient: NOTE [expert MLP fusion in training]), ``weight_subclass``
    (a tensor subclass that runs its own grouped GEMM, e.g. sharded weights; ``GroupedQuantWeight`` declares
    ``handles_expert_gemm`` and gets the fused op on its MXFP8 / NVFP4 data),
    ``unexpected_signature`` (ranks, dtypes, a bias or ``out_dtype``), ``middle_not_isolated`` (the GEMM's output
    or an intermediate of the middle is used outside it), ``glu_not_recognised`` (the middle computes another
    function: interleaved gate/up, clamped or tanh-GELU GLUs, a non-gated activation).

NOTE [expert MLP fusion in training]: fused, the forward is faster (Qwen3-MoE-like, DeepSeek-V3-like; Mixtral-like
ties, CUTLASS keeps its gated GEMM there), but forward+backward is not. In training the un-fused graph already has the
permuted rows (from ``permute_pad``) and one Inductor kernel for the GLU each way, and CUTLASS runs the gate_up forward
and dX faster than the Triton pair: the fusion saves a small GLU kernel and loses more in the GEMMs
(``bench_moe_block.py``: benchmarks/results/moe_block_expert_mlp.json, moe_block_expert_mlp_training_fused.json).
So the pass fuses inference graphs only (no gradient through the GEMM); training keeps the grouped GEMMs.

Stage:
    pre-grad, after ``fuse_dispatch`` and ``replace_grouped_mm_fallback``.

Seen in:
    transformers 5.x ``grouped_mm`` experts (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, ...: ``_apply_gate``),
    torchtitan-style ``silu(x @ w1) * (x @ w3)`` over one stacked ``w13``.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch
import torch.fx as fx
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from moe_compile.experts.interface import glu_of
from moe_compile.ops.expert_gemm import runs_on_weight
from moe_compile.passes import NoMatch, PassContext
from moe_compile.passes._graph import arg, graph_call, known_int, layer_name, op_name, tensor_val, topo_index
from moe_compile.passes.forms.ops import CASTS

# the grouped GEMMs this pass rewrites, by op name: True when the weight operand is [E, K, N]
_GEMMS = {"_grouped_mm": True, "aten._grouped_mm": True, "moe.grouped_mm": False}
_PERMUTE_PAD = "moe.permute_pad"
_FLOAT_CASTS = frozenset(CASTS - {"int", "long"})


def run(graph: fx.Graph, ctx: PassContext) -> None:
    for gemm in [n for n in graph.nodes if op_name(n) in _GEMMS]:
        if not _offs_from_permute_pad(gemm):
            continue
        layer = layer_name(gemm)
        try:
            match = _match(gemm)
        except NoMatch as exc:
            ctx.skip(layer, exc.reason, exc.detail)
            continue
        if match is None:  # not the first GEMM of an MLP (nothing of its output reaches a second one)
            continue
        _rewrite(graph, gemm, match)
        ctx.rewrite(layer, f"grouped_mm + {match.glu} ({len(match.middle)} ops)",
                    f"moe.expert_gemm(activation={match.glu!r})")


def _offs_from_permute_pad(gemm: fx.Node) -> bool:
    offs = arg(gemm, 2, "offs")
    return (isinstance(offs, fx.Node) and op_name(offs) == "getitem" and offs.args[1] == 2
            and op_name(offs.args[0]) == _PERMUTE_PAD)


def _operands(gemm: fx.Node) -> tuple[fx.Node, fx.Node, bool]:
    """``(x, weight, weight_is_EKN)``, or NoMatch when the call is not a plain 2-D x 3-D grouped GEMM."""
    x, w = gemm.args[0], arg(gemm, 1, "mat2")
    ekn = _GEMMS[op_name(gemm)]
    extra = {k: v for k, v in gemm.kwargs.items() if k not in ("offs", "mat2") and v is not None}
    if op_name(gemm) == "moe.grouped_mm":
        extra = {k: v for k, v in extra.items() if k != "zero_tail"}
    if len(gemm.args) > 3 and any(a is not None for a in gemm.args[3:]) and ekn:
        extra["positional"] = gemm.args[3:]
    xv, wv = tensor_val(x), tensor_val(w)
    if is_traceable_wrapper_subclass(xv) or not runs_on_weight(wv):
        raise NoMatch("weight_subclass", f"{type(wv).__name__} operands (sharded weights, ...) keep their own grouped "
                      "GEMM")
    if extra or xv is None or wv is None or xv.dim() != 2 or wv.dim() != 3 or xv.dtype != wv.dtype \
            or xv.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise NoMatch("unexpected_signature", "expected grouped_mm(x[M, K], W[E, ...], offs) of one float dtype, "
                      f"no bias / out_dtype; got extra {sorted(extra)}")
    return x, w, ekn


class _Match(NamedTuple):
    x: fx.Node
    w: fx.Node
    w_is_EKN: bool
    middle: list[fx.Node]  # topological order
    out: fx.Node  # the middle's last node (the second GEMM's input)
    glu: str


def _match(gemm: fx.Node) -> _Match | None:
    """The GEMM's operands, the middle and the GLU it computes; None when no row-wise result of ``gemm`` feeds a
    second grouped GEMM over the same offsets."""
    offs = arg(gemm, 2, "offs")
    # nodes computed from the GEMM's output alone (stopping at the next grouped GEMM)
    frontier = list(gemm.users)
    closure: set[fx.Node] = set()
    while frontier:
        node = frontier.pop()
        if node in closure or op_name(node) in _GEMMS or node.op == "output":
            continue
        if any(a is not gemm and a not in closure for a in node.all_input_nodes):
            continue
        closure.add(node)
        frontier.extend(node.users)
    ends = [n for n in closure for u in n.users
            if op_name(u) in _GEMMS and u.args[0] is n and arg(u, 2, "offs") is offs]
    if not ends:
        return None
    x, w, w_is_EKN = _operands(gemm)
    if len(set(ends)) != 1:
        raise NoMatch("glu_not_recognised", f"{len(set(ends))} row-wise results of the GEMM feed a second grouped "
                      "GEMM over the same offsets (expected one)")
    out = ends[0]
    middle = _ancestors_within(out, closure)
    inner = set(middle) | {gemm}
    for node in [gemm, *middle]:
        if node is not out and any(u not in inner for u in node.users):
            raise NoMatch("middle_not_isolated", f"{node.name} is used outside the GEMM -> GLU -> GEMM chain")
    if tensor_val(gemm).requires_grad:
        raise NoMatch("training", "the GEMM's output needs a gradient: un-fused is faster in training "
                      "(NOTE [expert MLP fusion in training])")
    # a symbolic width (dynamic shapes): the middle's size arithmetic then reads the probe's own sizes
    width = known_int(tensor_val(gemm).shape[1]) or 64
    glu = glu_of(_middle_module(gemm, middle, out), width)
    if glu is None:
        raise NoMatch("glu_not_recognised", f"the {len(middle)} ops after the GEMM compute no GLU of "
                      "expert_gemm.GLU_ACTIVATIONS on a probe (gate columns first)")
    return _Match(x, w, w_is_EKN, middle, out, glu)


def _ancestors_within(out: fx.Node, closure: set[fx.Node]) -> list[fx.Node]:
    seen, work = set(), [out]
    while work:
        node = work.pop()
        if node in seen or node not in closure:
            continue
        seen.add(node)
        work.extend(node.all_input_nodes)
    order = topo_index(out.graph)
    return sorted(seen, key=order.__getitem__)


def _middle_module(gemm: fx.Node, middle: list[fx.Node], out: fx.Node) -> fx.GraphModule:
    """The middle as a module of the GEMM's output, float casts taken out (the probe runs in fp32)."""
    sub = fx.Graph()
    env = {gemm: sub.placeholder("gate_up")}
    for node in middle:
        value = tensor_val(node)
        if op_name(node) in _FLOAT_CASTS and value is not None and value.is_floating_point() and node.args \
                and node.args[0] in env:
            env[node] = env[node.args[0]]
            continue
        env[node] = sub.node_copy(node, lambda n: env[n])
    sub.output(env[out])
    return fx.GraphModule(torch.nn.Module(), sub)


def _rewrite(graph: fx.Graph, gemm: fx.Node, m: _Match) -> None:
    x, out = m.x, m.out
    offs = arg(gemm, 2, "offs")
    rows = known_int(tensor_val(x).shape[0])
    with graph.inserting_before(gemm):
        w_ENK = graph_call(graph, torch.transpose, m.w, -2, -1, meta_from=gemm) if m.w_is_EKN else m.w
        if rows is None:
            rows = graph_call(graph, torch.ops.aten.sym_size.int, x, 0, meta_from=gemm)
        fused = graph_call(graph, torch.ops.moe.expert_gemm.default, x, w_ENK, offs, None, None, m.glu, rows,
                           False, meta_from=gemm, name="expert_gemm_glu")
        h = graph_call(graph, operator.getitem, fused, 0, meta_from=gemm)
        if tensor_val(out).dtype != tensor_val(h).dtype:
            h = graph_call(graph, torch.Tensor.to, h, tensor_val(out).dtype, meta_from=gemm)
    out.replace_all_uses_with(h)
    for node in reversed([gemm, *m.middle]):
        if not node.users:
            graph.erase_node(node)
