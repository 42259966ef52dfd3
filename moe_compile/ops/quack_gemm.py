"""The SwiGLU expert MLP on QuACK's CuTe-DSL varlen grouped GEMMs (``moe::quack_glu_up`` / ``moe::quack_glu_down``).

Shape suffixes: ``T`` tokens, ``H`` hidden, ``I`` expert intermediate, ``E`` experts, ``M`` routed rows
(``permute_pad``'s static bound; ``T*K`` with ``align=1``), ``N = 2I`` (gate and up).

NOTE [QuACK expert MLP]: optional (``pip install moe_compile[quack]``); taken by ``fused_experts_forward`` only
where :func:`quack_usable` holds (``quack`` imports, CUDA sm90/sm100, bf16, SwiGLU over one gate-first ``gate_up``
weight, no biases, ``align=1``) and the measured table says so
(NOTE [QuACK GEMM choice] (moe_compile/ops/_expert_gemm_tuning.py)).
Per GEMM (``cu`` = ``[0, offs_E]``, QuACK's ``cu_seqlens``):

    forward   pre_MN, h_MI = gemm_gated(x_TH, gate_up, cu_seqlens_m, A_idx=src_M)   "gated": the token gather in
                                                                                  the load, SwiGLU in the epilogue
              y_MH = gemm(h_MI, down, cu_seqlens_m)                               "down"
    backward  dz_MN, h_MI = gemm_dgated(dy_MH, down, pre_MN, cu_seqlens_m)        "down_dx": dSwiGLU in the epilogue,
                                                                                  ``h`` recomputed (not saved)
              dW_down = gemm(dy^T, h, cu_seqlens_k)                              "down_wgrad"
              dx_MH = gemm(dz, gate_up, cu_seqlens_m)                             "up_dx"
              dx_TH = unpad_unpermute(dx_MH, row_map)                             fixed-order fp32 gather-sum
              dW_gate_up = gemm(x^T, dz, cu_seqlens_k, A_idx=src_M)               "up_wgrad", the gather in the load

``pre`` is kept in QuACK's interleaved gated layout (columns ``g0, u0, g1, u1, ...``); the weights stay gate-first
(``[gate; up]`` rows): QuACK's ``concat_layout`` reads and writes them in place. The down projection's input
gradient goes to ``pre`` (``dz``), not to ``h``: the two ops are one MLP, and ``h`` / ``pre`` feed only
``quack_glu_down``. Saved for backward: ``x``, the index tensors, the weights and ``pre`` (not ``h``, not the
permuted rows, which are never written). ``down``, ``down_dx`` and ``down_wgrad`` can each run on
``torch._grouped_mm`` instead (``impl="cutlass"``, same layouts); CPU runs the PyTorch references (``impl="reference"``,
the tests' oracle). Deterministic: no split-K, no atomics (QuACK's dynamic scheduler only orders tiles); untuned
default configs (``TUNED``).
"""

from __future__ import annotations

import functools
import importlib.util
import logging

import torch
from torch import Tensor

from moe_compile.ops import grouped_mm as gmm
from moe_compile.ops._expert_gemm_tuning import QUACK_TUNED, use_quack
from moe_compile.ops.expert_gemm import gather_rows, source_rows
from moe_compile.ops.unpad_unpermute import unpad_unpermute

log = logging.getLogger(__name__)

# the GEMMs of NOTE [QuACK expert MLP] that may run on torch._grouped_mm instead (the others: QuACK or reference)
CUTLASS_KINDS = ("down", "down_dx", "down_wgrad")
KINDS = ("gated", "down", "down_dx", "down_wgrad", "up_dx", "up_wgrad")


# ===== availability =====


@functools.cache
def quack_importable() -> bool:
    """Whether the ``quack`` package (``quack-kernels``) is installed; nothing is imported."""
    return importlib.util.find_spec("quack") is not None


@functools.cache
def _qi():
    """``quack.gemm_interface``, imported on first use (it loads the CuTe DSL: seconds)."""
    import quack.gemm_interface as qi

    return qi


def quack_usable(rows: int, hidden: int, inter: int, experts: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the QuACK expert MLP can run here and the measured table takes it (``kind="gated"``)."""
    if device.type != "cuda" or dtype != torch.bfloat16 or hidden % 8 or inter % 8 or not quack_importable():
        return False
    if torch.cuda.get_device_capability(device)[0] not in (9, 10):
        return False
    return use_quack("gated", rows, 2 * inter, hidden, experts)


def _choice(kind: str, x: Tensor, n: int, k: int, experts: int) -> str:
    """``quack`` / ``cutlass`` / ``reference`` for one GEMM of NOTE [QuACK expert MLP] (logged once per shape)."""
    if not x.is_cuda:
        return "reference"
    impl = "quack" if kind not in CUTLASS_KINDS or use_quack(kind, x.shape[0], n, k, experts) else "cutlass"
    _log_choice(kind, x.shape[0], n, k, experts, impl)
    return impl


@functools.cache
def _log_choice(kind: str, m: int, n: int, k: int, experts: int, impl: str) -> None:
    log.info("moe_compile expert GEMM %s M=%d N=%d K=%d E=%d: %s", kind, m, n, k, experts, impl)


# ===== layouts and references =====


def cu_seqlens(offs_E: Tensor) -> Tensor:
    """int32 ``[E + 1]``: ``[0, offs_E...]`` (QuACK's ``cu_seqlens``)."""
    return torch.cat([offs_E.new_zeros(1), offs_E]).to(torch.int32)


def interleave(t_MN: Tensor) -> Tensor:
    """``[g | u]`` columns -> ``[g0, u0, g1, u1, ...]`` (QuACK's gated layout)."""
    m, n = t_MN.shape
    return t_MN.reshape(m, 2, n // 2).transpose(1, 2).reshape(m, n)


def deinterleave(t_MN: Tensor) -> Tensor:
    """QuACK's gated layout -> ``[g | u]`` columns."""
    m, n = t_MN.shape
    return t_MN.reshape(m, n // 2, 2).transpose(1, 2).reshape(m, n)


def _swiglu_fp32(pre_MN: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(gate, up, silu(gate) * up)`` in fp32 from the interleaved ``pre``."""
    g, u = pre_MN[:, 0::2].float(), pre_MN[:, 1::2].float()
    return g, u, torch.nn.functional.silu(g) * u


def dswiglu(dh_MI: Tensor, pre_MN: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(dz_MN interleaved, h_MI)`` in ``dtype`` from ``dh`` and the interleaved ``pre`` (fp32 math)."""
    g, u, h = _swiglu_fp32(pre_MN)
    s, dh = torch.sigmoid(g), dh_MI.float()
    dz = torch.stack([dh * u * s * (1 + g * (1 - s)), dh * g * s], dim=-1).reshape(pre_MN.shape)
    return dz.to(dtype), h.to(dtype)


def gated_reference(x_TH: Tensor, src_M: Tensor, offs_E: Tensor, w_ENH: Tensor) -> tuple[Tensor, Tensor]:
    """``(pre_MN interleaved, h_MI)``: ``pre = x[src] @ w[e]^T`` in fp32, ``h = silu(g) * u`` from the fp32 ``pre``
    (as QuACK's epilogue: from the accumulator, not from the rounded ``pre``), each cast once."""
    pre = gmm.grouped_mm_reference(gather_rows(x_TH, src_M).float(), w_ENH.float(), offs_E)
    n = pre.shape[1] // 2
    h = torch.nn.functional.silu(pre[:, :n]) * pre[:, n:]
    return interleave(pre.to(x_TH.dtype)), h.to(x_TH.dtype)


# ===== the GEMMs (one function per kind; ``impl`` from _choice) =====

# TODO(issue 53): probe scaffolding, removed once the first device run says which spelling QuACK 0.6.5 takes
_WORKING: dict[str, int] = {}


def _first_working(kind: str, *attempts):
    """Run the first of ``attempts`` (callables) that QuACK accepts, remembering which one per kind."""
    start = _WORKING.get(kind, 0)
    for i in range(start, len(attempts)):
        try:
            out = attempts[i]()
        except Exception as err:  # noqa: BLE001 - the DSL raises its own error types at compile time
            log.warning("QuACK %s: attempt %d failed (%s: %s)", kind, i, type(err).__name__, str(err)[:300])
            continue
        if _WORKING.get(kind, 0) != i:  # a fallback: say so once (the first spelling is silent)
            log.warning("QuACK %s runs attempt %d", kind, i)
        _WORKING[kind] = i
        return out
    raise RuntimeError(f"QuACK {kind}: no attempt ran")


def gated(x_TH: Tensor, src_M: Tensor, offs_E: Tensor, w_ENH: Tensor, store_preact: bool,
          impl: str) -> tuple[Tensor, Tensor]:
    """``(pre_MN interleaved or [0, N], h_MI)`` of the gate_up GEMM over the gathered rows."""
    if impl == "reference":
        pre, h = gated_reference(x_TH, src_M, offs_E, w_ENH)
        return (pre if store_preact else pre[:0]), h
    cu, idx = cu_seqlens(offs_E), src_M.clamp_min(0)
    pre, h = _first_working(
        "gated",
        lambda: _qi().gemm_gated(x_TH, w_ENH.mT, activation="swiglu", cu_seqlens_m=cu, A_idx=idx,
                                 store_preact=store_preact, concat_layout=("B",), tuned=QUACK_TUNED),
        lambda: _qi().gemm_gated(x_TH, w_ENH.unflatten(1, (2, -1)).transpose(1, 2).reshape(w_ENH.shape).mT,
                                 activation="swiglu", cu_seqlens_m=cu, A_idx=idx, store_preact=store_preact,
                                 tuned=QUACK_TUNED),
    )
    return (pre if store_preact else x_TH.new_empty(0, w_ENH.shape[1])), h


def down(h_MI: Tensor, offs_E: Tensor, w_EHI: Tensor, impl: str) -> Tensor:
    """``y_MH = h @ w[e]^T`` per expert segment (rows past ``offs[-1]`` unspecified)."""
    if impl == "reference":
        return gmm.grouped_mm_reference(h_MI, w_EHI, offs_E)
    if impl == "cutlass":
        return torch._grouped_mm(h_MI, w_EHI.mT, offs=offs_E)
    return _qi().gemm(h_MI, w_EHI.mT, cu_seqlens_m=cu_seqlens(offs_E), tuned=QUACK_TUNED)


def down_dx(dy_MH: Tensor, offs_E: Tensor, w_EHI: Tensor, pre_MN: Tensor, impl: str) -> tuple[Tensor, Tensor]:
    """``(dz_MN interleaved, h_MI)``: ``dh = dy @ w[e]`` through dSwiGLU at ``pre``; ``h`` recomputed."""
    if impl == "quack":
        return _qi().gemm_dgated(dy_MH, w_EHI, pre_MN, activation="swiglu", cu_seqlens_m=cu_seqlens(offs_E),
                                 tuned=QUACK_TUNED)
    if impl == "cutlass":
        dh = torch._grouped_mm(dy_MH, w_EHI, offs=offs_E)
    else:
        dh = gmm.grouped_mm_reference(dy_MH.float(), w_EHI.mT.float(), offs_E)
    return dswiglu(dh, pre_MN, dy_MH.dtype)


def down_wgrad(dy_MH: Tensor, h_MI: Tensor, offs_E: Tensor, impl: str) -> Tensor:
    """``dW_EHI[e] = dy[rows of e]^T @ h[rows of e]`` (zeros for empty experts)."""
    if impl == "reference":
        return gmm.grouped_mm_wgrad_reference(dy_MH, h_MI, offs_E)
    E = offs_E.shape[0]
    if impl == "cutlass":
        out = torch._grouped_mm(dy_MH.t(), h_MI, offs=offs_E).contiguous()
    else:
        out = dy_MH.new_empty(E, dy_MH.shape[1], h_MI.shape[1])
        _qi().gemm(dy_MH.t(), h_MI, out=out, cu_seqlens_k=cu_seqlens(offs_E), tuned=QUACK_TUNED)
    return gmm.zero_empty_groups(out, offs_E)


def up_dx(dz_MN: Tensor, offs_E: Tensor, w_ENH: Tensor, impl: str) -> Tensor:
    """``dx_MH = dz @ w[e]`` (``dz`` interleaved, ``w`` gate-first: QuACK reads it through ``concat_layout``)."""
    if impl == "reference":
        return gmm.grouped_mm_reference(deinterleave(dz_MN), w_ENH.mT, offs_E)
    cu = cu_seqlens(offs_E)
    return _first_working(
        "up_dx",
        lambda: _qi().gemm(dz_MN, w_ENH, cu_seqlens_m=cu, concat_layout=("B",), tuned=QUACK_TUNED),
        lambda: _qi().gemm(deinterleave(dz_MN), w_ENH, cu_seqlens_m=cu, tuned=QUACK_TUNED),
    )


def up_wgrad(dz_MN: Tensor, x_TH: Tensor, src_M: Tensor, offs_E: Tensor, impl: str) -> Tensor:
    """``dW_ENH[e] = dz[rows of e]^T @ x[src(rows of e)]`` in gate-first rows (zeros for empty experts): QuACK
    computes ``dW^T = x^T dz`` with the gather in its load, written through ``concat_layout`` into ``dW``."""
    if impl == "reference":
        return gmm.grouped_mm_wgrad_reference(deinterleave(dz_MN), gather_rows(x_TH, src_M), offs_E)
    E, N, H = offs_E.shape[0], dz_MN.shape[1], x_TH.shape[1]
    out = x_TH.new_empty(E, N, H)
    cu, idx = cu_seqlens(offs_E), src_M.clamp_min(0)
    _first_working(
        "up_wgrad",
        lambda: _qi().gemm(x_TH.t(), dz_MN, out=out.mT, cu_seqlens_k=cu, A_idx=idx, concat_layout=("out",),
                           tuned=QUACK_TUNED),
        lambda: _qi().gemm(dz_MN.t(), x_TH.index_select(0, idx), out=out, cu_seqlens_k=cu, concat_layout=("out",),
                           tuned=QUACK_TUNED),
        lambda: _qi().gemm(deinterleave(dz_MN).t(), x_TH.index_select(0, idx), out=out, cu_seqlens_k=cu,
                           tuned=QUACK_TUNED),
    )
    return gmm.zero_empty_groups(out, offs_E)


# ===== ops =====


@torch.library.custom_op("moe::quack_glu_up", mutates_args=())
def _glu_up_op(x_TH: Tensor, src_M: Tensor, row_map: Tensor, offs_E: Tensor, w_ENH: Tensor,
               store_preact: bool) -> tuple[Tensor, Tensor]:
    E, N, H = w_ENH.shape
    pre, h = gated(x_TH, src_M, offs_E, w_ENH, store_preact, _choice("gated", x_TH, N, H, E))
    return h, pre


@_glu_up_op.register_fake
def _glu_up_fake(x_TH, src_M, row_map, offs_E, w_ENH, store_preact):
    M, N = src_M.shape[0], w_ENH.shape[1]
    return x_TH.new_empty(M, N // 2), x_TH.new_empty(M if store_preact else 0, N)


@torch.library.custom_op("moe::quack_glu_down", mutates_args=())
def _glu_down_op(h_MI: Tensor, pre_MN: Tensor, offs_E: Tensor, w_EHI: Tensor) -> Tensor:
    E, H, inter = w_EHI.shape
    return down(h_MI, offs_E, w_EHI, _choice("down", h_MI, H, inter, E))


@_glu_down_op.register_fake
def _glu_down_fake(h_MI, pre_MN, offs_E, w_EHI):
    return h_MI.new_empty(h_MI.shape[0], w_EHI.shape[1])


# ===== autograd =====


def _up_setup_context(ctx, inputs, output) -> None:
    x_TH, src_M, row_map, offs_E, w_ENH, _ = inputs
    ctx.save_for_backward(x_TH, src_M, row_map, offs_E, w_ENH, output[1])
    ctx.set_materialize_grads(False)


def _up_backward(ctx, dh_MI, dz_MN):
    """``dz`` arrives as ``pre``'s gradient (from ``quack_glu_down``); a gradient of ``h`` from elsewhere is
    taken through dSwiGLU (PyTorch) and added."""
    x_TH, src_M, row_map, offs_E, w_ENH, pre_MN = ctx.saved_tensors
    if dh_MI is not None:
        dz_h, _ = dswiglu(dh_MI, pre_MN, x_TH.dtype)
        dz_MN = dz_h if dz_MN is None else dz_MN + dz_h
    if dz_MN is None:
        return None, None, None, None, None, None
    E, N, H = w_ENH.shape
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dx_MH = up_dx(dz_MN, offs_E, w_ENH, _choice("up_dx", dz_MN, H, N, E))
        dx = unpad_unpermute(dx_MH, row_map)
    if ctx.needs_input_grad[4]:
        dw = up_wgrad(dz_MN, x_TH, src_M, offs_E, _choice("up_wgrad", dz_MN, N, H, E))
    return dx, None, None, None, dw, None


def _down_setup_context(ctx, inputs, output) -> None:
    h_MI, pre_MN, offs_E, w_EHI = inputs
    ctx.save_for_backward(pre_MN, offs_E, w_EHI)


def _down_backward(ctx, dy_MH):
    pre_MN, offs_E, w_EHI = ctx.saved_tensors
    E, H, inter = w_EHI.shape
    dy_MH = dy_MH.contiguous()
    dz, h = down_dx(dy_MH, offs_E, w_EHI, pre_MN, _choice("down_dx", dy_MH, 2 * inter, H, E))
    dw = down_wgrad(dy_MH, h, offs_E, _choice("down_wgrad", dy_MH, H, inter, E)) if ctx.needs_input_grad[3] else None
    return None, (dz if ctx.needs_input_grad[1] else None), None, dw


_glu_up_op.register_autograd(_up_backward, setup_context=_up_setup_context)
_glu_down_op.register_autograd(_down_backward, setup_context=_down_setup_context)


# ===== public wrapper =====


def glu_expert_mlp(x_TH: Tensor, row_map: Tensor, offs_E: Tensor, w_gate_up_ENH: Tensor, w_down_EHI: Tensor,
                   num_rows: int) -> Tensor:
    """``y_MH[r] = down[e](swiglu(gate_up[e] @ x[src(r)]))`` for each routed row ``r`` of expert ``e`` (rows past
    ``offs_E[-1]`` unspecified); combine with ``unpad_unpermute(y_MH, row_map, weights_TK)``.

    Args:
        x_TH: ``[T, H]`` bf16 tokens (not permuted: the GEMM gathers them).
        row_map: ``permute_pad``'s int32 ``[T, 2K]`` map (``align=1``).
        offs_E: int32 ``[E]`` cumulative end offsets.
        w_gate_up_ENH: ``[E, 2I, H]``, gate rows first; w_down_EHI: ``[E, H, I]``; both contiguous, x's dtype.
        num_rows: ``M`` (``permute_pad``'s row bound).

    Returns:
        ``[M, H]`` in ``x``'s dtype; differentiable w.r.t. ``x`` and both weights (deterministic).
    """
    if w_gate_up_ENH.shape[1] != 2 * w_down_EHI.shape[2] or w_gate_up_ENH.shape[2] != x_TH.shape[1]:
        raise ValueError(f"gate_up {tuple(w_gate_up_ENH.shape)} and down {tuple(w_down_EHI.shape)} do not make "
                         f"an [E, 2I, H] / [E, H, I] pair for H={x_TH.shape[1]}")
    src_M = source_rows(row_map, num_rows)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x_TH, w_gate_up_ENH, w_down_EHI))
    h, pre = _glu_up_op(x_TH, src_M, row_map, offs_E, w_gate_up_ENH.contiguous(), grad)
    return _glu_down_op(h, pre, offs_E, w_down_EHI.contiguous())
