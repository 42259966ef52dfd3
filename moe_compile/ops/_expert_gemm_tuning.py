"""Measured decisions for ``moe::expert_gemm`` / ``moe::expert_wgrad`` on CUDA: Triton family or CUTLASS per GEMM
(NOTE [grouped GEMM choice]) and the Triton kernels' tiles (NOTE [expert GEMM tiles], ``wgrad_config``).

Everything here is a table read from ``benchmarks/bench_grouped_gemm.py`` runs on the H100 (its ``choice`` rows and
``--sweep``); ``expert_gemm.py`` asks, nothing here launches.
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
# gradient). Measured on the H100 (triton 3.6, ``benchmarks/bench_grouped_gemm.py``'s per-GEMM rows, CUDA graphs,
# us Triton vs CUTLASS; ``grouped_gemm.json``), with the tiles of NOTE [expert GEMM tiles] and NOTE [TMA loads]:
# * gated: Qwen3-like (N*K 3.1M) and DeepSeek-V3-like (5.8M) win at every row count measured (T4096: 474 vs 623,
#   579 vs 705; T16384 1524 vs 1910, 1966 vs 2347); Mixtral-like (29M) wins at 64 rows (T256 188 vs 212) and
#   ties above (T4096 877 vs 892, T16384 3197 vs 3170): CUTLASS there;
# * weighted: Qwen3 T4096 275 vs 369, T16384 851 vs 1129; DeepSeek T4096 309 vs 379; Mixtral ties at 64 rows (T256
#   110 vs 107) and wins above 512 (T4096 430 vs 446, T16384 1466 vs 1659);
# * plain (no row weight, so no epilogue on either side; measured before the TMA loads): Qwen3 T4096 297 vs 283
#   (``--sweep``), ties at 64 rows;
# * dx (TMA reads the ``[E, K, N]`` weights): Qwen3 and DeepSeek win or tie at every row count (gate_up dX T4096 512
#   vs 551, 568 vs 663; down dX T4096 267 vs 266, 333 vs 338; T16384 1518 vs 1656, 774 vs 813); Mixtral loses at 64
#   rows (gate_up dX T256 202 vs 179), ties at 1024 (T4096 829 vs 860, 434 vs 427) and wins at 4096 (T16384 2801 vs
#   3239, 1498 vs 1601): Triton above 2048 rows there;
# * wgrad: Qwen3-like T4096 828 vs 650 us (gate_up, CUTLASS on gathered rows), 358 vs 299 (down): CUTLASS.
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
# which the family wins, per kind (absent: never), measured on the H100 (``bench_quant_block.py`` and
# ``bench_grouped_weight.py``, Qwen3-like E128, triton 3.6; ``quant_block.json``): the gated gate_up + SwiGLU in the
# Qwen3-MoE block, kernel us per forward, family vs weight-only + Inductor GLU: T4096 (256 rows per expert) MXFP8 1231
# vs 1233, NVFP4 1210 vs 1279; T1024 (64 rows) 665 vs 503, 503 vs 515; T64 (4 rows) 452 vs 293, 504 vs 230; T1 62 vs
# 52, 65 vs 45. The un-gated GEMMs alone (both of the block, us): the weight-only kernels win at every T measured but
# one (MXFP8 T1 25.6 vs 40.0, T64 242 vs 329, T1024 437 vs 466, T4096 1140 vs 1305; NVFP4 T4096 1142 vs 1092).
QUANT_FAMILY_ROWS_FROM: dict[str, int] = {"gated": 256}


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

    NOTE [expert GEMM tiles]: H100 (triton 3.6), ``benchmarks/bench_grouped_gemm.py --sweep``; us per GEMM at
    T4096 (Qwen3-like E128, 256 rows per expert / DeepSeek-V3-like E64, 384 / Mixtral-like E8, 1024), CUDA graphs:

    * un-gated (down, and both dX GEMMs) with more than 96 rows per expert: ``[128, 256]`` tiles, 8 warps, 3
      stages. Qwen3 down 350 -> 297 us, gate_up dX 621 -> 504, down dX 324 -> 270; DeepSeek down 394 -> 333,
      gate_up dX 756 -> 559; Mixtral down 594 -> 476; NVFP4 down 478 -> 372. MXFP8 down swaps the operands
      over ``[256, 128]`` tiles: 495 -> 366 (DeepSeek 594 -> 403).
    * gated: two ``[128, 128]`` accumulators (gate, up), 8 warps, from 32 rows per expert: Qwen3 612 -> 517 us
      (T1024, 64 rows: 345 -> 310), DeepSeek 764 -> 627, Mixtral 1130 -> 936; bf16 over 4 stages (3 in the
      quantised formats, where 4 did not gain): Qwen3 512 -> 473, 517 -> 462, 527 -> 506 us in three runs
      (DeepSeek 639 -> 631, T1024 312 -> 310; 5 stages run out of shared memory). Quantised gate_up swaps the MMA
      operands (``SWAP_AB``: the decoded weight tile is the register operand, NOTE [swapped operands] in the
      kernels): MXFP8 ``[256, 64]`` tiles 974 -> 724 us, NVFP4 ``[128, 128]`` x 128-deep 1182 -> 682 (DeepSeek
      1246 -> 894, 1478 -> 856).
    * up to 96 rows per expert (un-gated) / 32 (gated): ``[64, 128]`` / ``[64, 64]`` tiles, as before.
    * Tried, not kept, for MXFP8 (Qwen3 T4096, us, shipped decode 724 gate_up / 367 down; outputs bitwise equal):
      ``tl.dot_scaled`` (``e4m3`` weight with its e8m0 scales, emulated on sm90 by Triton 3.6) 1098-3911 / 492-1893
      over the same tile grid; the scales loaded per element (no ``[BLOCK_N, BLOCK_K/32, 32]`` reshape, hoping the
      decoded tile would skip its trip through shared memory into the MMA's register layout) 1431-3054 / 451-610.
      What bounds the decode path (its SASS on triton 3.6): per 64-deep K step the decoded bf16 tile is stored to
      shared memory and read back with ``ldmatrix`` behind two barriers, about 400 instructions a warp.
    * Tried, not kept: short row tiles (an expert's rows past its last full tile in 64- or 32-row tiles, swapped or
      not, both heights compiled into the kernel; ``grouped_gemm_sweep_short_tiles.json``). They cut the padded
      MMA work (Qwen3 T4096: 1.24x -> 1.06-1.12x of the routed rows) but every row tile still streams its whole
      weight tile, which is what these GEMMs are bound by: gate_up 506-514 -> 557-631 us, down 292-295 -> 280-286
      (the branch alone, never taken, cost nothing: 506 vs 510). Larger row tiles are the lever, not smaller ones
      (also why ``[128, *]`` beats ``[64, *]`` at 64 rows per expert).
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

    H100 (triton 3.6), Qwen3-like T4096 (E128, ~256 rows per expert): ``[128, 256]`` tiles in groups of 4
    column tiles took the gate_up wgrad from 1137 to 866 us and the down wgrad from 470 to 365 us against
    ``[128, 128]`` ungrouped; 256-wide N tiles and flattened / transposed-load variants were slower. 32-row steps
    were slower with 3 stages, faster with 5: 872 -> 811 us (gate_up), 361 -> 355 (down); Triton 3.6's warp
    specialisation of the row loop (``tl.range(..., warp_specialize=True)``) gave 870 us with 8 warps and failed to
    compile with 4.
    With ``row_scale`` (``dy`` scaled in registers before the MMA) the ``[128, 256]`` tile gave different bits
    from run to run, and NaN, on triton 3.6 (Qwen3-like down wgrad, bf16 weights): that path keeps ``[128, 128]``
    (bitwise stable over repeated runs in the same test).
    Tried, not kept: TMA loads (``dy`` through a ``[M, N]`` descriptor, ``x`` too when not gathered; each expert's
    partial last row step with masked pointer loads; ``grouped_gemm_wgrad_tma.json``, us pointer -> TMA vs CUTLASS).
    Bitwise equal to the pointer loads where deterministic. Gathered ``x`` (gate_up): slower at every shape (Qwen3
    T4096 813 -> 927, DeepSeek 943 -> 1027, Mixtral 1263 -> 1312). Un-gathered, un-scaled (down): DeepSeek 426 ->
    375 (CUTLASS 351), Mixtral 532 -> 405 (414), Qwen3 T16384 915 -> 782 (781), but Qwen3 T4096 355 -> 372 (292).
    Row-scaled: faster (Mixtral 974 -> 796) but different bits from launch to launch at DeepSeek and Mixtral sizes,
    the row-scale instability above again. CUTLASS keeps the bf16 wgrad (NOTE [grouped GEMM choice]) either way.
    Also tried, not kept: the persistent tile loop flattened into the row loop (``tl.range(..., flatten=True)``, so
    the next tile's loads can overlap this tile's store; bitwise the same), T4096 us: Qwen3 gate_up wgrad 817 -> 802,
    down 354 -> 354, row-scaled down 642 -> 609; DeepSeek 925 -> 909, 418 -> 416, 792 -> 743: still behind CUTLASS
    (654 / 305 at Qwen3). The same flag on the forward kernel: gate_up 445 -> 482 (DeepSeek 517 -> 583), the rest
    within 1%.
    """
    if not cuda:  # interpreter: small tiles, groups of 2 (several column tiles per group in the tests)
        bn, bk, bm, warps, stages, group = 16, 16, 16, 4, 1, 2
    elif fp32:
        bn, bk, bm, warps, stages, group = 64, 64, 32, 4, 3, 1
    else:
        bn, bk, bm, warps, stages, group = (128, 128, 64, 8, 3, 4) if row_scale else (128, 256, 32, 8, 5, 4)
    return dict(BLOCK_M=bm, BLOCK_N=max(min(bn, gmm._next_pow2(N)), 16), BLOCK_K=max(min(bk, gmm._next_pow2(K)), 16),
                GROUP_N=group, num_warps=warps, num_stages=stages)  # fmt: skip
