"""Measured decisions for ``moe::expert_gemm`` / ``moe::expert_wgrad`` on CUDA: Triton family or CUTLASS per GEMM
(NOTE [grouped GEMM choice]) and the Triton kernels' tiles (NOTE [expert GEMM tiles], ``wgrad_config``).

Everything here is read from ``benchmarks/bench_grouped_gemm.py`` runs (its per-GEMM rows:
benchmarks/results/grouped_gemm.json; ``--sweep``: benchmarks/results/grouped_gemm_sweep.json) and, for quantised
weights, ``bench_quant_block.py`` / ``bench_grouped_weight.py`` (benchmarks/results/quant_block.json,
grouped_weight.json); ``expert_gemm.py`` asks, nothing here launches.
"""

from __future__ import annotations

import torch

from moe_compile.config import env_setting
from moe_compile.ops import grouped_mm as gmm

# NOTE [grouped GEMM choice]: per kind of GEMM, the rows per expert (M / E) at which the Triton family beats CUTLASS
# ``torch._grouped_mm`` for bf16 on sm90, keyed by the weight's size per expert (N * K). Fused gather / activation /
# row-weight savings are part of the measured Triton time, and the CUTLASS time counts the epilogue pass the shipped
# CUTLASS path runs, so the rule is per whole GEMM. Kinds: ``gated`` (gate_up with the gather prologue and the GLU
# epilogue), ``weighted`` (an un-gated GEMM with the row weight in its epilogue: the block's down), ``plain`` (any
# other un-gated forward), ``dx`` (the input gradient, against the transposed weights), ``wgrad`` (the weight
# gradient). Read from the per-GEMM rows under CUDA graphs (benchmarks/results/grouped_gemm.json; the table itself
# was set at commit 78d994c), with the tiles of NOTE [expert GEMM tiles] and
# NOTE [TMA loads] (moe_compile/ops/triton/expert_gemm.py):
# * up to the DeepSeek-V3-like weight (N*K 5.8M; Qwen3-like 3.1M) gated, weighted and dx win or tie at every row
#   count measured: the fused gather / GLU / row weight save passes that CUTLASS runs separately;
# * at the Mixtral-like weight (29M, 8 experts) the GEMM itself dominates and CUTLASS catches up: gated wins only at
#   64 rows and ties above (CUTLASS there), weighted wins above 512 rows, dx (losing at 64) above 2048;
# * plain (no row weight, so no epilogue on either side; measured before the TMA loads): behind CUTLASS at 256 rows
#   (benchmarks/results/grouped_gemm_sweep.json), ties at 64 (measured at commit 96b9c81);
# * wgrad: CUTLASS at every measured size: the Triton persistent wgrad is slower (``wgrad_config``).
TRITON_ROWS_PER_EXPERT: dict[str, tuple[tuple[float, int, int], ...]] = {
    # kind: ((max N*K of the weight per expert, rows per expert from, to: where Triton wins), ...), smallest first
    "gated": ((2048 * 3072, 0, 1 << 30), (float("inf"), 0, 64)),
    "weighted": ((2048 * 3072, 0, 1 << 30), (float("inf"), 513, 1 << 30)),
    "plain": ((float("inf"), 0, 64),),
    "dx": ((2048 * 3072, 0, 1 << 30), (float("inf"), 2049, 1 << 30)),
    "wgrad": ((float("inf"), 1, 0),),
}
# Quantised weights (MXFP8 / NVFP4) have no CUTLASS path on sm90: the alternative to the family is the weight-only
# kernels of ``moe::grouped_mm_<fmt>`` (decode-tuned; the epilogue then runs as for CUTLASS). Rows per expert from
# which the family wins, per kind (absent: never), Qwen3-like E128: the gated gate_up + SwiGLU reaches the
# weight-only kernels plus Inductor's GLU at 256 rows per expert (ties for MXFP8, ahead for NVFP4) and loses well
# below that (benchmarks/results/quant_block.json); the un-gated GEMMs alone stay on the weight-only kernels, which
# win at every T measured but NVFP4 at T4096 (benchmarks/results/grouped_weight.json).
QUANT_FAMILY_ROWS_FROM: dict[str, int] = {"gated": 256}


# NOTE [QuACK GEMM choice]: the GEMMs of NOTE [QuACK expert MLP] (moe_compile/ops/quack_gemm.py), per kind, where
# QuACK's CuTe-DSL kernels run rather than ``torch._grouped_mm`` (CUTLASS): ``gated`` decides the whole QuACK MLP
# (the gather-fused gate_up + SwiGLU has no CUTLASS twin in that layout, nor have ``up_dx`` / ``up_wgrad``);
# ``down``, ``down_dx`` (with dSwiGLU fused) and ``down_wgrad`` pick per shape. Rows per expert (M / E) where QuACK
# runs, keyed by the weight's size per expert (N * K), as TRITON_ROWS_PER_EXPERT. What stands behind each row:
# * gated: no range by default (``MOE_COMPILE_GROUPED_GEMM=quack`` turns the MLP on): this path has not yet run on a
#   GPU here (``bench_quack_gemm.py`` writes benchmarks/results/quack_gemm.json; set the row from it). Issue 53's
#   measurements (H100, autotuned configs, GEMMs alone) had the gather-fused gate_up ahead at Qwen3-like E128
#   (0.542 vs 0.556 ms at T4096, 1.47 vs 1.67 at T16384) and behind at Mixtral-like E8 I14336 (3.48 vs 3.16);
# * down: ahead or tied at all three (0.244 vs 0.294, 0.75 vs 0.84, 1.54 vs 1.55; issue 53, H100);
# * down_dx: dSwiGLU in the epilogue, where CUTLASS needs a pass of its own over dh and pre (not measured alone);
# * down_wgrad: not measured alone; the gate_up wgrad over varlen K was ahead at all three (issue 53).
QUACK_ROWS_PER_EXPERT: dict[str, tuple[tuple[float, int, int], ...]] = {
    "gated": ((float("inf"), 1, 0),),
    "down": ((float("inf"), 0, 1 << 30),),
    "down_dx": ((float("inf"), 0, 1 << 30),),
    "down_wgrad": ((float("inf"), 0, 1 << 30),),
}
# QuACK's autotuner compiles and times every candidate config on first use (minutes per GEMM kind, and timing
# inside a CUDA-graph capture or a compile breaks them): its default configs run instead.
QUACK_TUNED = False


def use_quack(kind: str, M: int, N: int, K: int, E: int) -> bool:
    """Whether GEMM ``kind`` of the QuACK expert MLP runs on QuACK (NOTE [QuACK GEMM choice]);
    ``MOE_COMPILE_GROUPED_GEMM=quack`` forces it, ``cutlass`` / ``triton`` turn the QuACK MLP off."""
    if kind not in QUACK_ROWS_PER_EXPERT:
        raise ValueError(f"kind={kind!r} is not one of {tuple(QUACK_ROWS_PER_EXPERT)}")
    choice = env_setting("grouped_gemm")  # MOE_COMPILE_GROUPED_GEMM
    if choice in ("triton", "cutlass", "quack"):
        return choice == "quack"
    rows = M / max(E, 1)
    for max_weight, rows_from, rows_to in QUACK_ROWS_PER_EXPERT[kind]:
        if N * K <= max_weight:
            return rows_from <= rows <= rows_to
    return False


def use_triton_grouped_gemm(
    M: int, N: int, K: int, E: int, dtype: torch.dtype, device: torch.device, fmt: str = "plain", kind: str = "plain"
) -> bool:
    """Whether ``moe::expert_gemm`` / ``moe::expert_wgrad`` run their Triton kernels (``True``) or the library
    alternative: CUTLASS for plain weights, the weight-only kernels for quantised ones.

    Triton where there is no alternative (not CUDA; plain weights not bf16 or not on sm90/sm100) and where the
    measured table for ``kind`` (NOTE [grouped GEMM choice]; ``QUANT_FAMILY_ROWS_FROM`` for quantised weights) says
    it wins; ``MOE_COMPILE_GROUPED_GEMM`` overrides.
    """
    if kind not in TRITON_ROWS_PER_EXPERT:
        raise ValueError(f"kind={kind!r} is not one of {tuple(TRITON_ROWS_PER_EXPERT)}")
    if device.type != "cuda":
        return True
    if fmt == "plain" and (dtype != torch.bfloat16 or torch.cuda.get_device_capability(device)[0] not in (9, 10)):
        return True
    choice = env_setting("grouped_gemm")  # MOE_COMPILE_GROUPED_GEMM
    if choice in ("triton", "cutlass"):
        return choice == "triton"
    rows = M / max(E, 1)
    if fmt != "plain":
        return kind in QUANT_FAMILY_ROWS_FROM and rows >= QUANT_FAMILY_ROWS_FROM[kind]
    for max_weight, rows_from, rows_to in TRITON_ROWS_PER_EXPERT[kind]:
        if N * K <= max_weight:
            return rows_from <= rows <= rows_to
    return False


def gemm_kind(w: torch.Tensor, activation: str, weighted: bool = False) -> str:
    """``gated`` / ``weighted`` (un-gated with a row weight: CUTLASS then needs an epilogue pass) / ``dx`` (a weight
    whose rows are not contiguous: the backward's ``w.transpose(1, 2)``) / ``plain``."""
    if activation != "none":
        return "gated"
    if weighted:
        return "weighted"
    return "dx" if w.stride(-1) != 1 else "plain"



def pick_config(
    M: int, E: int, N: int, K: int, fmt: str, fp32: bool, gated: bool, cuda: bool, tma_nk: bool = False
) -> dict:
    """Tile config from shapes (no autotune: it would bench inside CUDA graphs / compile).

    NOTE [expert GEMM tiles]: ``benchmarks/bench_grouped_gemm.py --sweep`` at T4096 (Qwen3-like E128, 256 rows per
    expert / DeepSeek-V3-like E64, 384 / Mixtral-like E8, 1024), CUDA graphs (benchmarks/results/grouped_gemm_sweep.json
    holds the shipped tiles against each alternative):

    * un-gated (down, and both dX GEMMs) with more than 96 rows per expert: ``[128, 256]`` tiles, 8 warps, 3
      stages, ahead of ``[128, 128]`` at every shape and format swept: the wider tile reads each row tile's ``x``
      once for twice the columns. MXFP8 down swaps the operands over ``[256, 128]`` tiles.
    * gated: two ``[128, 128]`` accumulators (gate, up), 8 warps, from 32 rows per expert; bf16 over 4 stages (3 in
      the quantised formats, where 4 did not gain; 5 stages run out of shared memory). Quantised gate_up swaps the
      MMA operands (``SWAP_AB``: the decoded weight tile is the register operand,
      NOTE [swapped operands] (moe_compile/ops/triton/expert_gemm.py)): MXFP8 ``[256, 64]`` tiles, NVFP4
      ``[128, 128]`` x 128-deep, both well ahead of the unswapped tiles.
    * up to 96 rows per expert (un-gated) / 32 (gated): ``[64, 128]`` / ``[64, 64]`` tiles, as before.
    * Tried, not kept, for MXFP8 (measured at commit c8daf4c; outputs bitwise equal): ``tl.dot_scaled`` (``e4m3``
      weight with its e8m0 scales, emulated on sm90 by Triton 3.6) and the scales loaded per element (no
      ``[BLOCK_N, BLOCK_K/32, 32]`` reshape, hoping the decoded tile would skip its trip through shared memory into
      the MMA's register layout): both slower than the shipped decode at every tile tried.
      What bounds the decode path (its SASS on triton 3.6): per 64-deep K step the decoded bf16 tile is stored to
      shared memory and read back with ``ldmatrix`` behind two barriers, about 400 instructions a warp.
    * Tried, not kept: short row tiles (an expert's rows past its last full tile in 64- or 32-row tiles, swapped or
      not, both heights compiled into the kernel; a ``--sweep`` run at commit fe0baee). They cut the padded
      MMA work but every row tile still streams its whole weight tile, which is what these GEMMs are bound by:
      gate_up got slower, down gained a few percent (the branch alone, never taken, cost nothing). Larger row
      tiles are the lever, not smaller ones (also why ``[128, *]`` beats ``[64, *]`` at 64 rows per expert).
    """
    if not cuda:  # interpreter: smallest legal tiles
        return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=max(32, gmm._MIN_BLOCK_K[fmt]), GROUP_M=4, SWAP_AB=False,
                    num_warps=4, num_stages=1)
    rows = M / max(E, 1)
    cfg = dict(BLOCK_M=64, BLOCK_N=64 if gated else 128, BLOCK_K=64, GROUP_M=8, SWAP_AB=False, num_warps=4,
               num_stages=4)
    if fp32:  # fp32 data (no bf16 MMA): the tiles before the sweep, narrower K steps
        if rows > 96:
            cfg.update(BLOCK_M=128, num_warps=8, num_stages=4 if gated else 3)
        cfg["BLOCK_K"] = 32
    elif gated and rows > 32:
        cfg.update(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4 if fmt == "plain" else 3)
        if fmt == "mxfp8":
            cfg.update(BLOCK_M=256, BLOCK_N=64, SWAP_AB=True)
        elif fmt == "nvfp4":
            cfg.update(BLOCK_K=128, SWAP_AB=True)
    elif not gated and rows > 96:
        cfg.update(BLOCK_M=128, BLOCK_N=256, num_warps=8, num_stages=4 if tma_nk else 3)
        if fmt == "mxfp8":
            cfg.update(BLOCK_M=256, BLOCK_N=128, SWAP_AB=True)
    cfg["BLOCK_K"] = max(min(cfg["BLOCK_K"], gmm._next_pow2(K)), gmm._MIN_BLOCK_K[fmt])
    cfg["BLOCK_N"] = max(min(cfg["BLOCK_N"], gmm._next_pow2(N)), 16)
    return cfg


def wgrad_config(N: int, K: int, fp32: bool, cuda: bool, row_scale: bool = False) -> dict:
    """Tile config of ``_expert_wgrad_kernel`` (``[BLOCK_N, BLOCK_K]`` output tiles, ``BLOCK_M`` rows a step).

    ``[128, 256]`` tiles in groups of 4 column tiles (each ``x`` row step serves 4 column tiles) against
    ``[128, 128]`` ungrouped: about a quarter less time at Qwen3-like T4096 (measured at commit d60e262); 256-wide
    N tiles and flattened / transposed-load variants were slower. 32-row steps over 5 stages win the gate_up wgrad
    and are within a few percent either way on the down wgrad (benchmarks/results/grouped_gemm_sweep.json);
    Triton 3.6's warp specialisation of the row loop (``tl.range(..., warp_specialize=True)``) only matched the
    3-stage loop with 8 warps and failed to compile with 4 (measured at commit 0620a25).
    With ``row_scale`` (``dy`` scaled in registers before the MMA) the ``[128, 256]`` tile gave different bits
    from run to run, and NaN, on triton 3.6 (Qwen3-like down wgrad, bf16 weights): that path keeps ``[128, 128]``
    (bitwise stable over repeated runs in the same test).
    Tried, not kept: TMA loads (``dy`` through a ``[M, N]`` descriptor, ``x`` too when not gathered; each expert's
    partial last row step with masked pointer loads; measured at commit 9b6ae09). Bitwise equal to the pointer
    loads where deterministic. Gathered ``x`` (gate_up): slower at every shape. Un-gathered, un-scaled (down):
    faster at the larger shapes, slower at Qwen3 T4096, and reaching CUTLASS at best. Row-scaled: faster but
    different bits from launch to launch at DeepSeek and Mixtral sizes, the row-scale instability above again.
    CUTLASS keeps the bf16 wgrad (NOTE [grouped GEMM choice]) either way.
    Also tried, not kept: the persistent tile loop flattened into the row loop (``tl.range(..., flatten=True)``, so
    the next tile's loads can overlap this tile's store; bitwise the same; measured at commit 9b23142): a few percent
    on the wgrad, still well behind CUTLASS; on the forward kernel it slowed gate_up and left the rest within 1%.
    """
    if not cuda:  # interpreter: small tiles, groups of 2 (several column tiles per group in the tests)
        bn, bk, bm, warps, stages, group = 16, 16, 16, 4, 1, 2
    elif fp32:
        bn, bk, bm, warps, stages, group = 64, 64, 32, 4, 3, 1
    else:
        bn, bk, bm, warps, stages, group = (128, 128, 64, 8, 3, 4) if row_scale else (128, 256, 32, 8, 5, 4)
    return dict(BLOCK_M=bm, BLOCK_N=max(min(bn, gmm._next_pow2(N)), 16), BLOCK_K=max(min(bk, gmm._next_pow2(K)), 16),
                GROUP_N=group, num_warps=warps, num_stages=stages)  # fmt: skip
