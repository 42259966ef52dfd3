"""``GroupedQuantWeight``: expert weights ``[E, N, K]`` stored as MXFP8 or NVFP4, one tensor for all experts.

Layouts (stored, ``K`` = reduction dim = last dim; quantisation blocks run along ``K``):

recipe | ``qdata`` | ``scale`` | ``expert_scale`` | error vs bf16
--- | --- | --- | --- | ---
``"mxfp8"`` | float8_e4m3fn ``[E, N, K]`` | e8m0 as **uint8** ``[E, N, K/32]`` | -- | ~3%
``"nvfp4"`` | uint8 ``[E, N, K/2]`` (two e2m1, low nibble first) | float8_e4m3fn ``[E, N, K/16]`` | fp32 ``[E]`` | ~10%

e8m0 scales are kept as uint8 because CPU Inductor has no C++ type for float8_e8m0fnu. Quantisation
is torchao's (``MXTensor.to_mx`` FLOOR scaling; ``NVFP4Tensor.to_nvfp4`` with per-expert
``per_tensor_amax_to_scale(amax_e)``); dequantisation matches torchao bit for bit.

The tensor presents itself as a ``[E, N, K]`` tensor of ``orig_dtype`` (``[E, K, N]`` when
``is_transposed``, which is how a ``w.transpose(-2, -1)`` view, or an HF ``is_transposed`` weight, looks).
It works below autograd (``__torch_dispatch__``; ``__torch_function__`` is disabled so Dynamo and
AOTAutograd trace it as an ordinary subclass and flatten it into its inner tensors). Supported ops (op -- behaviour):

- ``aten._grouped_mm`` (``torch._grouped_mm``, ``F.grouped_mm``), ``moe::grouped_mm``,
  ``transformers::grouped_mm_fallback`` -- ``x @ W[e]^T``: CUDA -> weight-only Triton kernel
  (``moe::grouped_mm_mxfp8/_nvfp4``); CPU -> dequantise, then the same op
- ``aten.mm`` / ``aten.addmm`` with a 2-D expert slice -- CUDA -> the same kernel with one group; CPU -> dequantise
- ``transpose`` (last two dims), ``t``, ``select``/``slice`` on dim 0 -- views that stay quantised
- ``copy_`` -- quantised -> quantised copies bytes (no re-quantisation); plain -> quantised quantises; quantised ->
  plain dequantises (or copies the master)
- ``detach``, ``clone``, ``alias``, ``_to_copy`` (device, logical dtype) -- on the inner tensors
- other in-place ops (optimizer updates) -- see NOTE [training with quantised weights]
- anything else -- runs on the dequantised tensor and returns a plain tensor

NOTE [training with quantised weights]:
Gradients are straight-through: autograd sees the weight as ``W = dequantize(Q)``, so ``dL/dW`` is the
bf16 gradient a bf16 model with weights ``dequantize(Q)`` would get (``dX`` uses the quantised weight).
Two ways to hold the parameter:
* quantised primary (``master=None``): the parameter *is* ``Q``. An in-place update ``W.op_(...)``
  runs on ``dequantize(Q)`` and re-quantises into ``Q``. Updates smaller than half a quantisation
  step are lost (no stochastic rounding): use it for fine-tuning with large steps or for memory.
* bf16 master (``master`` set): the update runs on the master in place and ``Q`` is re-quantised from
  it at once, so the compute copy is never stale: no cache, nothing to invalidate in ``eval()``, and
  train -> eval -> train equals train alone.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import return_and_correct_aliasing
from torch.utils._pytree import tree_map
from torchao.utils import TorchAOBaseTensor

from moe_compile.config import env_setting
from moe_compile.ops import grouped_mm as gmm

aten = torch.ops.aten
RECIPES = ("mxfp8", "nvfp4")
BLOCK_SIZE = {"mxfp8": gmm.MX_BLOCK, "nvfp4": gmm.NV_BLOCK}
# Opt-in (MOE_COMPILE_HW_FP4=1, env_setting("hw_fp4")): on compute capability >= 10 route NVFP4 through torchao's
# hardware grouped GEMM (MSLK activation quantisation + F.scaled_grouped_mm). Untested here (no Blackwell).


# ===== quantisation (torchao primitives only) =====


def _check_hp(w: torch.Tensor, recipe: str, arg: str) -> None:
    if recipe not in RECIPES:
        raise ValueError(f"recipe={recipe!r} is not supported; use one of {RECIPES}")
    if w.dim() not in (2, 3):
        raise ValueError(f"{arg} must be 3-D [E, N, K] (or 2-D [N, K]), got shape {tuple(w.shape)}")
    if w.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{arg}.dtype={w.dtype} is not supported; use bf16, fp16 or fp32")
    block = BLOCK_SIZE[recipe]
    if w.shape[-1] % block != 0:
        raise ValueError(f"{arg}: K={w.shape[-1]} (last dim) must be a multiple of the {recipe} block size {block}")


def quantize_stored(hp_NK: torch.Tensor, recipe: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantise ``[E, N, K]`` / ``[N, K]`` (blocks along the last dim) -> ``(qdata, scale, expert_scale)``."""
    hp = hp_NK.detach().contiguous()
    if hp.dtype == torch.float16:
        hp = hp.float()  # torchao quantises bf16 and fp32
    if recipe == "mxfp8":
        from torchao.prototype.mx_formats.mx_tensor import MXTensor

        mx = MXTensor.to_mx(hp, torch.float8_e4m3fn, block_size=gmm.MX_BLOCK)
        return mx.qdata, mx.scale.view(torch.uint8), None
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    amax = hp.abs().amax(dim=(-2, -1)).float().clamp(min=torch.finfo(torch.float32).tiny)
    expert_scale = per_tensor_amax_to_scale(amax)  # fp32 [E] (or 0-dim)
    if hp.dim() == 2:
        nv = NVFP4Tensor.to_nvfp4(hp, gmm.NV_BLOCK, per_tensor_scale=expert_scale)
        return nv.qdata, nv.scale, expert_scale
    # one expert at a time: torchao before 0.18 does not broadcast an [E, 1, 1] scale over [E, N, K] (its view of
    # the scaled data fails); the same bits as 0.18's one call (tests/experts/test_grouped_weight.py)
    parts = [NVFP4Tensor.to_nvfp4(w, gmm.NV_BLOCK, per_tensor_scale=s) for w, s in zip(hp, expert_scale)]
    return torch.stack([p.qdata for p in parts]), torch.stack([p.scale for p in parts]), expert_scale


# ===== the subclass =====


class GroupedQuantWeight(TorchAOBaseTensor):
    """Blockwise-quantised expert weights; see the module docstring for layouts and ops.

    Args:
        qdata: stored values, ``[E, N, K]`` (mxfp8) or ``[E, N, K/2]`` (nvfp4); a 2-D tensor is one expert.
        scale: block scales ``[E, N, K/block]``.
        recipe: ``"mxfp8"`` or ``"nvfp4"``.
        orig_dtype: the logical dtype (what ``dequantize()`` returns).
        is_transposed: present as ``[E, K, N]`` (a transposed view of the stored layout).
        expert_scale: nvfp4 per-expert fp32 scale ``[E]``.
        master: optional high-precision master ``[E, N, K]`` (stored layout); see
            NOTE [training with quantised weights].
    """

    # runs ``moe::expert_gemm`` on its quantised op (``_gw_expert_gemm``); ``ops.expert_gemm.runs_on_weight`` reads it
    handles_expert_gemm = True
    tensor_data_names = ["qdata", "scale"]
    tensor_attribute_names = ["recipe", "orig_dtype", "is_transposed"]
    optional_tensor_data_names = ["expert_scale", "master"]

    def __new__(cls, qdata, scale, recipe, orig_dtype, is_transposed, expert_scale=None, master=None):
        shape = list(qdata.shape)
        if recipe == "nvfp4":
            shape[-1] *= 2
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
        if is_transposed:
            shape[-2], shape[-1] = shape[-1], shape[-2]
            strides[-2], strides[-1] = strides[-1], strides[-2]
        return torch.Tensor._make_wrapper_subclass(
            cls, shape, strides=strides, dtype=orig_dtype, device=qdata.device, requires_grad=False
        )

    def __init__(self, qdata, scale, recipe, orig_dtype, is_transposed, expert_scale=None, master=None):
        self.qdata = qdata
        self.scale = scale
        self.recipe = recipe
        self.orig_dtype = orig_dtype
        self.is_transposed = is_transposed
        self.expert_scale = expert_scale
        self.master = master

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def from_hp(
        cls, w: torch.Tensor, recipe: str, *, keep_master: bool = False, is_transposed: bool = False
    ) -> GroupedQuantWeight:
        """Quantise ``w``: ``[E, N, K]`` (blocks along K), or ``[E, K, N]`` with ``is_transposed=True``.

        Raises:
            ValueError / TypeError: unknown recipe, rank not 2 or 3, dtype not bf16/fp16/fp32, K not a
                multiple of the block size (32 for mxfp8, 16 for nvfp4).
        """
        if isinstance(w, GroupedQuantWeight):
            raise TypeError("w is already a GroupedQuantWeight")
        stored = w.detach().transpose(-2, -1) if is_transposed else w.detach()
        _check_hp(stored, recipe, "w")
        qdata, scale, expert_scale = quantize_stored(stored, recipe)
        master = stored.contiguous().clone() if keep_master else None
        return cls(qdata, scale, recipe, w.dtype, is_transposed, expert_scale, master)

    @classmethod
    def from_qdata_and_scale(
        cls,
        qdata: torch.Tensor,
        scale: torch.Tensor,
        recipe: str,
        orig_dtype: torch.dtype = torch.bfloat16,
        expert_scale: torch.Tensor | None = None,
        *,
        is_transposed: bool = False,
    ) -> GroupedQuantWeight:
        """Wrap already-quantised tensors (stored layout) without touching their values."""
        if (recipe == "nvfp4") != (expert_scale is not None):
            raise ValueError(f"expert_scale is required for nvfp4 and not allowed for mxfp8 (recipe={recipe!r})")
        scale = scale.view(torch.uint8) if recipe == "mxfp8" else scale
        return cls(qdata, scale, recipe, orig_dtype, is_transposed, expert_scale)

    # ----- conversions -----

    def dequantize_stored(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Dequantised ``[E, N, K]`` in the stored layout (ignores ``is_transposed``)."""
        dtype = dtype or self.orig_dtype
        if self.recipe == "mxfp8":
            return gmm.dequantize_mxfp8(self.qdata, self.scale, dtype)
        return gmm.dequantize_nvfp4(self.qdata, self.scale, self.expert_scale, dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Dequantised tensor with this tensor's logical shape and strides."""
        w = self.dequantize_stored(dtype)
        return w.transpose(-2, -1) if self.is_transposed else w

    def _hp_logical(self) -> torch.Tensor:
        """Master (a view, so in-place ops write through) or a fresh dequantised copy, logical layout."""
        w = self.master if self.master is not None else self.dequantize_stored()
        return w.transpose(-2, -1) if self.is_transposed else w

    def _requantize_from(self, hp_logical: torch.Tensor, *, is_master_view: bool = False) -> None:
        """Quantise ``hp_logical`` into this tensor's buffers in place (aliases see the update); the
        master, if any, takes the new values too unless ``hp_logical`` already is a view of it."""
        stored = hp_logical.transpose(-2, -1) if self.is_transposed else hp_logical
        qdata, scale, expert_scale = quantize_stored(stored, self.recipe)
        self.qdata.copy_(qdata)
        self.scale.copy_(scale)
        if expert_scale is not None:
            self.expert_scale.copy_(expert_scale)
        if self.master is not None and not is_master_view:
            self.master.copy_(stored)

    @classmethod
    def stack(cls, experts: list[GroupedQuantWeight]) -> GroupedQuantWeight:
        """Stack 2-D single-expert tensors of one recipe and layout into ``[E, ...]`` (bytes copied)."""
        first = experts[0]
        if any(w.recipe != first.recipe or w.is_transposed != first.is_transposed or w.dim() != 2 for w in experts):
            raise ValueError("stack: every expert must be a 2-D GroupedQuantWeight with the same recipe and layout")
        expert_scale = torch.stack([w.expert_scale for w in experts]) if first.expert_scale is not None else None
        has_master = all(w.master is not None for w in experts)
        master = torch.stack([w.master for w in experts]) if has_master else None
        qdata, scale = torch.stack([w.qdata for w in experts]), torch.stack([w.scale for w in experts])
        return cls(qdata, scale, first.recipe, first.orig_dtype, first.is_transposed, expert_scale, master)

    def _stable_hash_for_caching(self) -> str:
        """Metadata-only key for AOTAutograd's cache (values are graph inputs, not constants)."""
        present = [n for n in self.optional_tensor_data_names if getattr(self, n) is not None]
        return f"GroupedQuantWeight:{self.recipe}:{self.orig_dtype}:{self.is_transposed}:{present}"

    def stored_view(self) -> GroupedQuantWeight:
        """The same buffers presented in the stored ``[E, N, K]`` layout."""
        return self if not self.is_transposed else self._with(lambda t: t, is_transposed=False)

    def _with(self, fn, is_transposed: bool | None = None) -> GroupedQuantWeight:
        """New wrapper with ``fn`` applied to every inner tensor."""
        opt = {n: getattr(self, n) for n in self.optional_tensor_data_names}
        opt = {n: (fn(t) if t is not None else None) for n, t in opt.items()}
        flag = self.is_transposed if is_transposed is None else is_transposed
        return GroupedQuantWeight(fn(self.qdata), fn(self.scale), self.recipe, self.orig_dtype, flag, **opt)


torch.serialization.add_safe_globals([GroupedQuantWeight])
implements = GroupedQuantWeight.implements


# ===== views =====


def _is_last_two(ndim: int, d0: int, d1: int) -> bool:
    return {d0 % ndim, d1 % ndim} == {ndim - 2, ndim - 1}


@implements([aten.transpose.int])
def _gw_transpose(func, types, args, kwargs):
    w, d0, d1 = args
    if not _is_last_two(w.dim(), d0, d1):
        return _gw_fallback(func, types, args, kwargs)
    return return_and_correct_aliasing(func, args, kwargs, w._with(aten.alias.default, not w.is_transposed))


@implements([aten.t.default])
def _gw_t(func, types, args, kwargs):
    w = args[0]
    return return_and_correct_aliasing(func, args, kwargs, w._with(aten.alias.default, not w.is_transposed))


@implements([aten.select.int])
def _gw_select(func, types, args, kwargs):
    w, dim, index = args
    if w.dim() != 3 or dim % 3 != 0:
        return _gw_fallback(func, types, args, kwargs)
    return return_and_correct_aliasing(func, args, kwargs, w._with(lambda t: t.select(0, index)))


@implements([aten.slice.Tensor])
def _gw_slice(func, types, args, kwargs):
    w, dim = args[0], (args[1] if len(args) > 1 else kwargs.get("dim", 0))
    if w.dim() != 3 or dim % 3 != 0:
        return _gw_fallback(func, types, args, kwargs)
    rest = tuple(args[2:])
    return return_and_correct_aliasing(func, args, kwargs, w._with(lambda t: aten.slice.Tensor(t, 0, *rest)))


# ===== GEMMs =====


def _hw_fp4_enabled(x: torch.Tensor, w: GroupedQuantWeight) -> bool:
    return (
        w.recipe == "nvfp4"
        and x.is_cuda
        and env_setting("hw_fp4")
        and w.dim() == 3
        and w.qdata.shape[1] % 128 == 0
        and (w.qdata.shape[2] * 2 // gmm.NV_BLOCK) % 4 == 0
        and torch.cuda.get_device_capability(x.device)[0] >= 10
    )


def _hw_fp4_grouped_mm(x_MK: torch.Tensor, w: GroupedQuantWeight, offs_E: torch.Tensor) -> torch.Tensor:
    """UNTESTED (needs sm100 + MSLK): torchao's NVFP4Tensor grouped GEMM with swizzled weight scales."""
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor
    from torchao.prototype.mx_formats.utils import hp_data_dims_to_swizzled_scale_dims_nvfp4, to_blocked

    E, N, K = w.qdata.shape[0], w.qdata.shape[1], w.qdata.shape[2] * 2
    # flattening E*N rows blocks each expert separately only when N is a multiple of the 128-row tile
    swizzled = to_blocked(w.scale.reshape(E * N, K // gmm.NV_BLOCK))
    swizzled = swizzled.view(E, *hp_data_dims_to_swizzled_scale_dims_nvfp4(N, K))
    global_scale = w.expert_scale.view(E, 1, 1)
    nv = NVFP4Tensor(w.qdata, swizzled, gmm.NV_BLOCK, w.orig_dtype, global_scale, None, True, False, None)
    return torch._grouped_mm(x_MK, nv.transpose(-2, -1), offs=offs_E)


def quantized_grouped_mm_nt(x_MK: torch.Tensor, w: GroupedQuantWeight, offs_E: torch.Tensor) -> torch.Tensor:
    """``x_MK @ W[e]^T`` per expert on CUDA (weight-only Triton, or hardware FP4 when opted in)."""
    if _hw_fp4_enabled(x_MK, w):
        return _hw_fp4_grouped_mm(x_MK, w, offs_E)
    return gmm.weight_only_grouped_mm(x_MK, w.qdata, w.scale, w.expert_scale, offs_E, w.recipe)


def _use_kernel(x: Any, w: Any, want_transposed: bool) -> bool:
    """True when the fused weight-only kernel applies: CUDA, plain 2-D activations, ``x @ W^T`` orientation."""
    return (
        isinstance(w, GroupedQuantWeight)
        and not isinstance(x, GroupedQuantWeight)
        and isinstance(x, torch.Tensor)
        and x.is_cuda
        and x.dim() == 2
        and w.is_transposed == want_transposed
    )


@implements([aten._grouped_mm.default])
def _gw_grouped_mm(func, types, args, kwargs):
    x, w = args[0], args[1]
    offs = args[2] if len(args) > 2 else kwargs.get("offs")
    bias = args[3] if len(args) > 3 else kwargs.get("bias")
    out_dtype = args[4] if len(args) > 4 else kwargs.get("out_dtype")
    plain_call = bias is None and out_dtype in (None, x.dtype) and offs is not None and w.dim() == 3
    # _grouped_mm(x, mat2) multiplies by mat2 = W^T, i.e. a transposed view of the stored layout
    if plain_call and _use_kernel(x, w, want_transposed=True):
        return quantized_grouped_mm_nt(x, w.stored_view(), offs.to(torch.int32))
    return _gw_fallback(func, types, args, kwargs)


@implements([torch.ops.moe.grouped_mm.default])
def _gw_moe_grouped_mm(func, types, args, kwargs):
    x, w, offs = args[0], args[1], args[2]
    # moe::grouped_mm takes the stored [E, N, K] layout directly
    if _use_kernel(x, w, want_transposed=False):
        return quantized_grouped_mm_nt(x, w, offs)
    return _gw_fallback(func, types, args, kwargs)


@implements([aten.mm.default, aten.addmm.default])
def _gw_mm(func, types, args, kwargs):
    if func is aten.addmm.default:
        bias, x, w = args[0], args[1], args[2]
        simple = not kwargs and len(args) == 3 and bias.dim() == 1
    else:
        bias, (x, w) = None, args
        simple = not kwargs
    if simple and isinstance(w, GroupedQuantWeight) and w.dim() == 2 and _use_kernel(x, w, want_transposed=True):
        w3 = w._with(lambda t: t.unsqueeze(0), is_transposed=False)
        offs = torch.full((1,), x.shape[0], dtype=torch.int32, device=x.device)
        y = quantized_grouped_mm_nt(x, w3, offs)
        return y if bias is None else y + bias
    return _gw_fallback(func, types, args, kwargs)


@implements([torch.ops.moe.expert_gemm.default])
def _gw_expert_gemm(func, types, args, kwargs):
    """``moe::expert_gemm`` (gather / GLU / row weight fused) on the quantised weight: its MXFP8 / NVFP4 op, the
    tiles decoded in registers; a transposed view (the backward's ``w.transpose(1, 2)``) runs dequantised."""
    names = [a.name for a in func._schema.arguments]
    bound = {**dict(zip(names, args)), **kwargs}
    x, w = bound["x_SK"], bound["w_ENK"]
    if not isinstance(w, GroupedQuantWeight) or isinstance(x, GroupedQuantWeight) or w.is_transposed or w.dim() != 3:
        return _gw_fallback(func, types, args, kwargs)
    rest = [bound[n] for n in names[2:]]  # offs_E, row_map, row_weight_M, activation, num_rows, store_preact
    if w.recipe == "mxfp8":
        return torch.ops.moe.expert_gemm_mxfp8(x, w.qdata, w.scale, *rest)
    return torch.ops.moe.expert_gemm_nvfp4(x, w.qdata, w.scale, w.expert_scale, *rest)


# ===== copies and dtype/device moves =====


@implements([aten.copy_.default])
def _gw_copy_(func, types, args, kwargs):
    dst, src = args[0], args[1]
    if isinstance(dst, GroupedQuantWeight):
        if dst.shape != src.shape:
            raise ValueError(f"copy_: shape mismatch, destination {tuple(dst.shape)} vs source {tuple(src.shape)}")
        if isinstance(src, GroupedQuantWeight) and src.recipe == dst.recipe and src.is_transposed == dst.is_transposed:
            dst.qdata.copy_(src.qdata)
            dst.scale.copy_(src.scale)
            if dst.expert_scale is not None:
                dst.expert_scale.copy_(src.expert_scale)
            if dst.master is not None:
                dst.master.copy_(src.master if src.master is not None else src.dequantize_stored())
        else:
            hp = src.dequantize() if isinstance(src, GroupedQuantWeight) else src
            dst._requantize_from(hp.to(dst.orig_dtype))
        return dst
    src_hp = src.master.transpose(-2, -1) if src.master is not None and src.is_transposed else src.master
    dst.copy_(src_hp if src_hp is not None else src.dequantize())
    return dst


@implements([aten._to_copy.default])
def _gw_to_copy(func, types, args, kwargs):
    w = args[0]
    device, dtype = kwargs.get("device"), kwargs.get("dtype")
    non_blocking = kwargs.get("non_blocking", False)
    moved = w._with(lambda t: t.to(device=device, non_blocking=non_blocking)) if device else w._with(torch.clone)
    if dtype is not None and dtype != w.orig_dtype:
        master = moved.master.to(dtype) if moved.master is not None else None
        moved = GroupedQuantWeight(
            moved.qdata, moved.scale, w.recipe, dtype, w.is_transposed, moved.expert_scale, master
        )
    return return_and_correct_aliasing(func, args, kwargs, moved)


# ===== fallback: in-place updates re-quantise, everything else runs dequantised =====


def _mutates_self(func) -> bool:
    schema_args = func._schema.arguments
    return bool(schema_args) and schema_args[0].alias_info is not None and schema_args[0].alias_info.is_write


def _gw_fallback(func, types, args, kwargs):
    def unwrap(t):
        return t.dequantize() if isinstance(t, GroupedQuantWeight) else t

    first = args[0] if args else None
    targets = [first] if isinstance(first, GroupedQuantWeight) else []
    targets = list(first) if isinstance(first, (list, tuple)) else targets
    if _mutates_self(func) and any(isinstance(t, GroupedQuantWeight) for t in targets):
        # in-place update (optimizer step; also _foreach_*_ / fused optimizers on a list of params)
        hps = [t._hp_logical() if isinstance(t, GroupedQuantWeight) else t for t in targets]
        func(hps[0] if first is targets[0] else hps, *tree_map(unwrap, args[1:]), **tree_map(unwrap, kwargs))
        for t, hp in zip(targets, hps):
            if isinstance(t, GroupedQuantWeight):
                t._requantize_from(hp, is_master_view=t.master is not None)
        return first if isinstance(first, GroupedQuantWeight) else None
    return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))


def _dispatch(cls, func, types, args, kwargs):
    table = cls._ATEN_OP_TABLE[cls]
    kwargs = kwargs or {}
    if func in table:
        return table[func](func, types, args, kwargs)
    if func.name() == "transformers::grouped_mm_fallback":  # HF's fp32/fp16 path: same (x, W^T, offs) contract
        return _gw_grouped_mm(func, types, args, kwargs)
    return _gw_fallback(func, types, args, kwargs)


GroupedQuantWeight.__torch_dispatch__ = classmethod(_dispatch)
