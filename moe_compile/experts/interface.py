"""Run a routed expert MLP through the fused path: ``permute_pad -> grouped GEMMs -> unpad_unpermute``.

Shapes: ``T`` tokens, ``H`` hidden, ``E`` experts, ``K`` top-k, ``M`` static padded rows, ``N``/``I``
projection output / intermediate features.

One place runs experts whose Python loop Dynamo cannot capture (``nonzero``-driven trip counts):

* :func:`fused_experts_forward` is the shared body: ``rows_MH = permute_pad(x_TH, ids_TK)``, one grouped
  GEMM per projection (``torch.ops.moe.grouped_mm``: CUTLASS ``_grouped_mm`` for bf16 on sm90+, Triton
  otherwise, the PyTorch reference on CPU), the row-wise middle (GLU / activation), and the fp32
  gather-sum ``unpad_unpermute``. No host sync, no atomics, static shapes, deterministic autograd.
  NOTE [expert MLP through expert_gemm]: without a gradient (inference), a SwiGLU / GeGLU MLP over one gate-first
  ``gate_up`` weight, without biases, routing weights after the MLP, runs instead as two ``moe.expert_gemm``
  calls: the GLU in the first GEMM's epilogue, the routing weight in the second's (the combine then sums weighted
  rows). Each GEMM picks the Triton family or CUTLASS from the measured table
  (NOTE [grouped GEMM choice] (moe_compile/ops/_expert_gemm_tuning.py)); the callers say which GLU ``middle`` is
  (:func:`glu_of`), checked once, outside tracing. The forward is faster than through the grouped GEMMs,
  forward+backward is not (the Qwen3-MoE-like loop block, bench_loops at commit c5e95e5): training keeps the
  grouped GEMMs, as ``fuse_expert_mlp`` does
  (NOTE [expert MLP fusion in training] (moe_compile/passes/fuse_expert_mlp.py)).
* :func:`hf_experts_forward` is registered as transformers' ``"moe_compile"`` experts implementation
  (:func:`register_hf_experts`); it reads the decorated ``*Experts`` module's attributes.
* ``moe_compile/experts/swap.py`` calls :func:`fused_experts_forward` for ``nn.ModuleList`` experts.

Routing weights are applied where the model applies them: after the MLP (in the combine, the default)
or before it (``weights_before=True``: the permuted rows are scaled first).

NOTE [identity experts]: LongCat-Flash routes some choices to ``Z`` zero-compute experts, ids ``E .. E+Z-1`` past
the ``E`` MLP experts, whose output is the token itself (``fused_experts_forward(identity_experts=Z)``).
``permute_pad`` groups the rows over all ``E + Z`` ids, so the identity experts' rows are the last segments; the
grouped GEMMs run over the first ``E`` segments only (``offs_E[:E]``), with ``zero_tail``: the rows past them are
exact zeros in every GEMM output and in every ``dX``; ``where(row >= offs_E[E-1], rows_MH, y_MH)`` then puts the
token's own row there, and ``unpad_unpermute`` weights and sums every choice in fp32 in ascending expert order
(the identity experts last, as the eager loop adds them). Backward: the ``where`` passes ``dy`` to the identity rows
and exact zeros to the GEMMs' rows there (no weight gradient from them); ``permute_pad``'s backward gathers
``dx[t]`` over all its rows. No host read, no per-expert loop, no accumulating scatter; the inference path through
``expert_gemm`` is not taken (its epilogue has no identity rows).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor, nn

from moe_compile.ops import grouped_mm as gmm
from moe_compile.ops import quack_gemm
from moe_compile.ops.expert_gemm import GLU_ACTIVATIONS, expert_gemm, runs_on_weight
from moe_compile.ops.permute_pad import permute_pad
from moe_compile.ops.unpad_unpermute import unpad_unpermute

IMPLEMENTATION_NAME = "moe_compile"
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclasses.dataclass(frozen=True)
class Projection:
    """One expert projection over all experts.

    Attributes:
        w_ENK: ``[E, N, K]`` weight (any strides: a ``transpose(1, 2)`` view of an ``[E, K, N]`` tensor works).
        bias_EN: optional ``[E, N]`` per-expert bias.
    """

    w_ENK: Tensor
    bias_EN: Tensor | None = None


def glu_of(middle: Callable[[Tensor], Tensor], width: int = 64) -> str | None:
    """The name in ``ops/expert_gemm.py``'s ``GLU_ACTIVATIONS`` (the GLUs the kernels fuse) of the GLU ``middle``
    computes on one ``[rows, width]`` ``gate_up`` output (``act(gate) * up``, gate columns first), or None.
    Probed on fixed fp32 inputs against each entry, at two scales: values of a few units, and of a few hundred (a
    GLU clamped at a limit past the first scale's values, as Step3p7's and GPT-OSS's can be, is another function;
    a limit of 30 once passed); call it eagerly (not while Dynamo traces). Used by ``experts/swap.py``, the experts
    interface and ``fuse_expert_mlp``."""
    if width < 2 or width % 2:
        return None
    gen = torch.Generator().manual_seed(0)
    names = None
    for scale in (4.0, 256.0):
        gate_up = torch.randn(16, width, generator=gen, dtype=torch.float32) * scale
        try:
            with torch.no_grad():
                got = middle(gate_up.clone())
        except Exception:  # noqa: BLE001 - a middle that does not take one plain tensor is not one of ours
            return None
        if not isinstance(got, Tensor) or got.shape != (16, width // 2) or got.dtype != torch.float32:
            return None
        gate, up = gate_up.chunk(2, dim=-1)
        matched = {name for name, act in GLU_ACTIVATIONS.items()
                   if torch.allclose(got, act(gate) * up, rtol=1e-6, atol=1e-6)}
        names = matched if names is None else names & matched
    return next((name for name in GLU_ACTIVATIONS if name in names), None)


def expert_of_rows(offs_E: Tensor, num_rows: int) -> Tensor:
    """int64 ``[M]``: the expert owning each padded row (tail rows get ``E - 1``; their output is never read)."""
    rows_M = torch.arange(num_rows, device=offs_E.device, dtype=offs_E.dtype)
    return torch.searchsorted(offs_E, rows_M, right=True).clamp_(max=offs_E.shape[0] - 1)


def grouped_linear(x_MK: Tensor, proj: Projection, offs_E: Tensor, onehot_ME: Tensor | None, *,
                   zero_tail: bool = False) -> Tensor:
    """``x_MK @ w_ENK[e]^T (+ bias_EN[e])`` per expert segment; ``onehot_ME`` is needed only with a bias.

    The bias is added as ``onehot_ME @ bias_EN`` rather than ``bias_EN[expert_M]``: the gather's backward is an
    accumulating scatter (atomics, order-dependent); the matmul's is ``onehot^T @ dY``, deterministic.
    Without biases, rows past the last expert are left unspecified (``zero_tail=False``): everything after the
    GEMMs is row-wise and ``unpad_unpermute`` reads only the rows its row map names. A bias's gradient
    ``onehot^T @ dY`` sums every row, so with biases those rows stay zero; so do they with ``zero_tail`` (and the
    rows of ``dX``): NOTE [identity experts] reads its rows there.
    """
    y_MN = gmm.grouped_mm(x_MK, proj.w_ENK, offs_E, zero_tail=zero_tail or onehot_ME is not None)
    if proj.bias_EN is not None:
        y_MN = y_MN + onehot_ME @ proj.bias_EN.to(y_MN.dtype)
    return y_MN


def fused_experts_forward(
    x_TH: Tensor,
    ids_TK: Tensor,
    weights_TK: Tensor,
    up: Projection | tuple[Projection, ...],
    middle: Callable[..., Tensor],
    down: Projection,
    *,
    num_experts: int,
    weights_before: bool = False,
    post: Callable[[Tensor], Tensor] | None = None,
    align: int = 1,
    glu: str | None = None,
    identity_experts: int = 0,
) -> Tensor:
    """``sum_k w[t, k] * down(middle(up(x[t])))`` with expert ``ids[t, k]``, through the fused ops.

    Args:
        x_TH: ``[T, H]`` activations (bf16/fp16/fp32; the weights must have this dtype).
        ids_TK: ``[T, K]`` integer expert ids in ``[0, num_experts)``.
        weights_TK: ``[T, K]`` routing weights (any float dtype).
        up: the first projection (``gate_up`` or ``up``), ``[E, N, H]``, or several (``gate``, ``up``),
            each run as one grouped GEMM over the same rows.
        middle: row-wise map of the ``up`` outputs ``[M, N]...`` to ``[M, I]`` (``act(gate) * up``, or the
            activation).
        down: the last projection, ``[E, H, I]``.
        num_experts: ``E``.
        weights_before: scale the rows by their weight before ``up`` instead of in the combine.
        post: optional row-wise map after ``down`` (a post-expert norm).
        align: segment alignment of ``permute_pad``.
        glu: a name in ``GLU_ACTIVATIONS`` (:func:`glu_of`) when ``middle`` is that GLU over one ``up``
            projection (gate rows first): NOTE [expert MLP through expert_gemm].
        identity_experts: ``Z``: ids in ``[num_experts, num_experts + Z)`` are identity experts, whose term is
            ``w[t, k] * x[t]`` (NOTE [identity experts]).

    Returns:
        ``[T, H]`` in ``x_TH.dtype``; the combine accumulates in fp32 in a fixed order.
    """
    if x_TH.dim() != 2 or ids_TK.dim() != 2 or ids_TK.shape != weights_TK.shape or ids_TK.shape[0] != x_TH.shape[0]:
        raise ValueError(
            f"expected x_TH [T, H], ids_TK and weights_TK [T, K]; got {tuple(x_TH.shape)}, "
            f"{tuple(ids_TK.shape)}, {tuple(weights_TK.shape)}"
        )
    ups = up if isinstance(up, tuple) else (up,)
    has_bias = any(p.bias_EN is not None for p in (*ups, down))
    needs_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (x_TH, weights_TK, *(p.w_ENK for p in ups), down.w_ENK))
    if glu is not None and not needs_grad and not weights_before and not has_bias and len(ups) == 1 \
            and not identity_experts:
        return _expert_gemm_mlp(x_TH, ids_TK, weights_TK, ups[0], down, num_experts, post, align, glu)
    if glu == "swiglu" and not weights_before and not has_bias and len(ups) == 1 and not identity_experts \
            and post is None and align == 1 and ups[0].w_ENK.is_contiguous() and down.w_ENK.is_contiguous() \
            and _quack_mlp(ids_TK.numel(), down.w_ENK.shape[1], down.w_ENK.shape[2], num_experts, x_TH.dtype,
                           x_TH.device.type, x_TH.device.index):
        return _quack_expert_mlp(x_TH, ids_TK, weights_TK, ups[0], down, num_experts)
    probs = weights_TK if weights_before else None
    out = permute_pad(x_TH, ids_TK, probs, num_experts=num_experts + identity_experts, align=align)
    # the MLP experts' segments; identity experts' rows follow them (NOTE [identity experts])
    offs_E = out.offs_E[:num_experts] if identity_experts else out.offs_E
    rows_MH = out.rows_MH
    if weights_before:
        rows_MH = (rows_MH * out.probs_M.unsqueeze(-1)).to(x_TH.dtype)
    onehot_ME = None
    if has_bias:
        expert_M = expert_of_rows(offs_E, rows_MH.shape[0])
        onehot_ME = (expert_M[:, None] == torch.arange(num_experts, device=expert_M.device)).to(x_TH.dtype)
    zero_tail = identity_experts > 0
    h_MI = middle(*(grouped_linear(rows_MH, proj, offs_E, onehot_ME, zero_tail=zero_tail) for proj in ups))
    y_MH = grouped_linear(h_MI.to(x_TH.dtype), down, offs_E, onehot_ME, zero_tail=zero_tail)
    if post is not None:
        y_MH = post(y_MH)
    if identity_experts:
        rows_M = torch.arange(rows_MH.shape[0], device=offs_E.device, dtype=offs_E.dtype)
        y_MH = torch.where((rows_M >= offs_E[-1]).unsqueeze(-1), rows_MH, y_MH)
    return unpad_unpermute(y_MH, out.row_map, None if weights_before else weights_TK).to(x_TH.dtype)


def _expert_gemm_mlp(
    x_TH: Tensor, ids_TK: Tensor, weights_TK: Tensor, gate_up: Projection, down: Projection, num_experts: int,
    post: Callable[[Tensor], Tensor] | None, align: int, glu: str,
) -> Tensor:
    """The GLU and (without ``post``) the routing weight in the GEMMs' epilogues
    (NOTE [expert MLP through expert_gemm])."""
    weight_in_gemm = post is None
    out = permute_pad(x_TH, ids_TK, weights_TK if weight_in_gemm else None, num_experts=num_experts, align=align)
    h_MI, _ = expert_gemm(out.rows_MH, gate_up.w_ENK, out.offs_E, activation=glu)
    y_MH, _ = expert_gemm(h_MI, down.w_ENK, out.offs_E, row_weight_M=out.probs_M if weight_in_gemm else None)
    if post is not None:
        y_MH = post(y_MH)
    return unpad_unpermute(y_MH, out.row_map, None if weight_in_gemm else weights_TK).to(x_TH.dtype)


@torch.compiler.assume_constant_result
def _quack_mlp(rows: int, hidden: int, inter: int, experts: int, dtype: torch.dtype, device_type: str,
               device_index: int | None) -> bool:
    """NOTE [QuACK expert MLP] (moe_compile/ops/quack_gemm.py) applies (decided once per trace: constant to
    Dynamo); ``quack`` is not imported unless installed."""
    if device_type != "cuda":
        return False
    return quack_gemm.quack_usable(rows, hidden, inter, experts, dtype, torch.device(device_type, device_index))


def _quack_expert_mlp(x_TH: Tensor, ids_TK: Tensor, weights_TK: Tensor, gate_up: Projection, down: Projection,
                      num_experts: int) -> Tensor:
    """The SwiGLU MLP on QuACK: the routing index from ``permute_pad`` (over a narrow dummy row: the GEMM
    gathers the tokens itself), then the MLP and the weighted combine
    (NOTE [QuACK expert MLP] (moe_compile/ops/quack_gemm.py))."""
    index = permute_pad(x_TH.new_zeros(x_TH.shape[0], 8), ids_TK, None, num_experts=num_experts, align=1)
    y_MH = quack_gemm.glu_expert_mlp(x_TH.contiguous(), index.row_map, index.offs_E, gate_up.w_ENK, down.w_ENK,
                          index.rows_MH.shape[0])
    return unpad_unpermute(y_MH, index.row_map, weights_TK).to(x_TH.dtype)


# ===== transformers' experts interface =====


def hf_unsupported_reason(module: nn.Module) -> str | None:
    """Why the decorated transformers ``*Experts`` ``module`` cannot take the fused path (``None``: it can)."""
    has_gate = getattr(module, "has_gate", None)
    if has_gate is None or not hasattr(module, "down_proj") or not hasattr(module, "num_experts"):
        return "not_hf_experts: no has_gate / down_proj / num_experts attributes"
    if getattr(module, "_is_expert_parallel", False):
        return "expert_parallel: sentinel ids >= E (expert parallelism) are not supported"
    up = module.gate_up_proj if has_gate else getattr(module, "up_proj", None)
    weights = [up, module.down_proj]
    if any(not isinstance(w, Tensor) or w.dim() != 3 for w in weights):
        return "weights_not_stacked: expected 3-D gate_up_proj/up_proj and down_proj"
    if not all(runs_on_weight(w) for w in weights):
        return f"weight_subclass: {type(up).__name__} weights (sharded, ...) keep their own implementation"
    if up.dtype not in SUPPORTED_DTYPES or module.down_proj.dtype != up.dtype:
        return f"dtype: {up.dtype} / {module.down_proj.dtype} (supported: bf16, fp16, fp32, one dtype)"
    return None


def hf_projection(module: nn.Module, name: str) -> Projection:
    w = getattr(module, name)
    bias = getattr(module, name + "_bias", None) if getattr(module, "has_bias", False) else None
    return Projection(w.transpose(1, 2) if getattr(module, "is_transposed", False) else w, bias)


def original_forward(module: nn.Module) -> Callable[..., Tensor]:
    """The class's own (eager loop) experts forward, under the ``use_experts_implementation`` wrapper."""
    forward = type(module).forward
    return getattr(forward, "__wrapped__", forward)


def hf_experts_forward(module: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """transformers' ``"moe_compile"`` experts implementation: ``[T, H], [T, K], [T, K] -> [T, H]``.

    Supports concatenated or interleaved gate/up (the class's ``_apply_gate``), transposed weights, biases,
    non-gated MLPs (``act_fn``) and a post-expert norm. A module that :func:`hf_unsupported_reason`
    rejects runs its class's eager forward (``moe_compile.compile`` records why for ``explain``).
    """
    if getattr(module, "_moe_compile_unsupported", None) or hf_unsupported_reason(module) is not None:
        return original_forward(module)(module, hidden_states, top_k_index, top_k_weights)
    has_gate = module.has_gate
    up = hf_projection(module, "gate_up_proj" if has_gate else "up_proj")
    middle = module._apply_gate if has_gate else module.act_fn
    post = module.post_expert_norm if getattr(module, "has_post_expert_norm", False) else None
    return fused_experts_forward(
        hidden_states, top_k_index, top_k_weights, up, middle, hf_projection(module, "down_proj"),
        num_experts=module.num_experts, post=post, glu=getattr(module, "_moe_compile_glu", None),
    )


def register_hf_experts() -> bool:
    """Register :func:`hf_experts_forward` as transformers' ``"moe_compile"`` experts implementation.

    Returns False (and does nothing) when transformers or its experts interface is not importable.
    """
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except Exception:  # noqa: BLE001 - transformers is optional
        return False
    if ALL_EXPERTS_FUNCTIONS.get(IMPLEMENTATION_NAME, None) is not hf_experts_forward:
        ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION_NAME, hf_experts_forward)
    return True


def is_hf_experts(module: nn.Module) -> bool:
    """A module decorated by transformers' ``use_experts_implementation`` (it has a ``config`` and ``has_gate``)."""
    return hasattr(module, "has_gate") and hasattr(module, "config") and hasattr(module, "is_concatenated")


def use_fused_hf_experts(model: nn.Module) -> list[tuple[str, str, str, str]]:
    """Point every transformers experts module of ``model`` whose implementation is eager (or unset) to ours.

    Modules set to another implementation (``grouped_mm``, ...) are left alone: the FX passes handle them.
    Returns ``(module name, kind, tag, detail)`` records for ``explain`` (kind ``"rewrite"`` or ``"skip"``).
    """
    records: list[tuple[str, str, str, str]] = []
    experts = [(n, m) for n, m in model.named_modules() if is_hf_experts(m)]
    if not experts or not register_hf_experts():
        return records
    for name, module in experts:
        if getattr(module, "_moe_compile_ep_implementation", False):  # experts/expert_parallel.py recorded it
            continue
        impl = getattr(module.config, "_experts_implementation", None)
        if impl not in (None, "eager", IMPLEMENTATION_NAME):
            continue
        reason = hf_unsupported_reason(module)
        if reason is not None:
            module._moe_compile_unsupported = reason
            tag, _, detail = reason.partition(": ")
            records.append((name, "skip", tag, f"eager experts loop kept: {detail}"))
            continue
        module.config._experts_implementation = IMPLEMENTATION_NAME
        module._moe_compile_glu = glu_of(module._apply_gate) if module.has_gate else None
        records.append(
            (
                name,
                "rewrite",
                f"experts_implementation={impl or 'unset'}",
                "transformers experts interface 'moe_compile': permute_pad -> grouped GEMMs -> unpad_unpermute",
            )
        )
    return records
