"""Runs the grouped GEMM Triton kernels through their launchers on CPU tensors under TRITON_INTERPRET=1.

Started in a fresh interpreter by ``test_grouped_mm_kernels.py``: the variable must be set before
``triton`` is first imported (the interpreter needs interpreted ``tl.cumsum`` & co.), which a pytest
process cannot guarantee. Prints one JSON line ``{case name: "ok" | traceback}``. ``CASES`` is plain
data so the parent can import it cheaply.

Interpreter quirks (triton 3.9): ``tl.dot`` is wrong for bf16 inputs, so the launchers use the
fp32-ieee dot on CPU tensors (``IEEE_DOT``); the fp32 -> bf16 cast truncates (a whole ulp, not half).
Results are compared within bounds derived from the computation (``tests/_tolerance.py``,
NOTE [derived tolerances] (tests/_tolerance.py)): two fp32 sums of K products, the rounding of dequantised weights, the
output casts. Quantised weights are random valid encodings (every e2m1 code, e8m0 exponents around 2**0), so no
torchao import is needed.
"""

from __future__ import annotations

# name: (kernel, counts per expert, M, N, K, dtype name)
CASES = {
    "plain_fp32_empty_experts": ("plain", [3, 0, 5, 2], 12, 24, 40, "float32"),
    "plain_bf16_e7_tail_rows": ("plain", [2, 0, 0, 1, 4, 0, 3], 14, 24, 40, "bfloat16"),
    "plain_fp16_one_expert": ("plain", [0, 0, 9], 9, 16, 24, "float16"),
    "plain_fp32_fewer_rows_than_experts": ("plain", [0, 1, 0, 0, 0, 1, 0, 0], 2, 16, 16, "float32"),
    "plain_fp32_strided_weight": ("plain_strided", [4, 0, 5], 9, 40, 24, "float32"),
    "plain_fp32_no_rows": ("plain", [0, 0, 0], 4, 16, 16, "float32"),
    "mxfp8_fp32_empty_experts": ("mxfp8", [3, 0, 5, 2], 12, 24, 96, "float32"),
    "mxfp8_bf16_e7_tail_rows": ("mxfp8", [2, 0, 0, 1, 4, 0, 3], 14, 24, 64, "bfloat16"),
    "mxfp8_fp32_special_scales": ("mxfp8_special", [2, 3], 5, 16, 64, "float32"),
    "nvfp4_fp32_empty_experts": ("nvfp4", [3, 0, 5, 2], 12, 24, 96, "float32"),
    "nvfp4_bf16_e7_tail_rows": ("nvfp4", [2, 0, 0, 1, 4, 0, 3], 14, 24, 48, "bfloat16"),
    "nvfp4_fp32_one_expert": ("nvfp4", [0, 7], 7, 16, 32, "float32"),
    "nvfp4_fp16_swapped": ("swapped:nvfp4", [4, 0, 3], 9, 24, 80, "float16"),
    "plain_bf16_swapped": ("swapped:plain", [2, 5, 0], 10, 16, 40, "bfloat16"),
    "wgrad_fp32_empty_experts": ("wgrad", [3, 0, 5, 2], 12, 24, 40, "float32"),
    "wgrad_fp32_tail_rows": ("wgrad", [1, 0, 6], 10, 16, 48, "float32"),
    "wgrad_bf16_one_expert": ("wgrad", [0, 0, 9], 9, 16, 24, "bfloat16"),
    # only the empty experts' groups are zeroed; the others keep their values bit for bit
    "zero_empty_groups_bf16": ("zero_empty", [3, 0, 5, 0, 0, 2], 10, 24, 40, "bfloat16"),
    "zero_empty_groups_fp32_none_empty": ("zero_empty", [1, 2, 3], 6, 8, 16, "float32"),
    # only the rows past the last expert are zeroed (tails across a program's 64 rows, none, all rows)
    "zero_rows_past_bf16_tail": ("zero_rows", [30, 0, 41], 150, 24, 8, "bfloat16"),
    "zero_rows_past_fp32_no_tail": ("zero_rows", [64, 0, 64], 128, 40, 8, "float32"),
    "zero_rows_past_fp32_all_rows": ("zero_rows", [0, 0], 70, 1100, 8, "float32"),
    "deterministic_nvfp4": ("repeat", [3, 0, 5, 2], 12, 16, 64, "bfloat16"),
    # issue 35: offsets outside [0, M] (invalid; CPU raises) are clamped by every kernel, none reads outside x / dy
    "bad_offs_fp32_outside_rows": ("bad_offs", [3, 0, 5, 2], 12, 24, 40, "float32"),
    # decode kernel: (fmt, split_k, swap_ab); split-K partials + fixed-order reduction, row tiles > 1 per expert
    "decode_plain_fp32_split3_swap": ("decode:plain:3:1", [3, 0, 5, 2], 12, 24, 96, "float32"),
    "decode_mxfp8_bf16_split2": ("decode:mxfp8:2:0", [2, 0, 0, 1, 4, 0, 3], 14, 24, 128, "bfloat16"),
    "decode_mxfp8_fp32_split1_swap": ("decode:mxfp8:1:1", [3, 0, 5, 2], 12, 24, 96, "float32"),
    "decode_nvfp4_fp32_split2_swap_big_expert": ("decode:nvfp4:2:1", [0, 37, 0, 2], 41, 24, 128, "float32"),
    "decode_nvfp4_bf16_split1": ("decode:nvfp4:1:0", [0, 7, 1], 9, 16, 32, "bfloat16"),
    "decode_nvfp4_fp32_no_rows": ("decode:nvfp4:2:1", [0, 0, 0], 4, 16, 64, "float32"),
    # deliberate bugs: the kernel run on a perturbed input must FAIL the derived comparison with the
    # unperturbed reference (tests/test_tolerance.py does the same on the CPU ops, on Hypothesis inputs)
    "bug_mxfp8_fp32_scale_exponent_plus_one": ("bug:scale", [3, 0, 5, 2], 12, 24, 96, "float32"),
    "bug_plain_fp32_offset_shifted_one_row": ("bug:offs", [3, 0, 5, 2], 12, 24, 40, "float32"),
    "bug_plain_bf16_dropped_k_term": ("bug:k", [2, 0, 0, 1, 4, 0, 3], 14, 24, 40, "bfloat16"),
}


def _operand_rel(torch, fmt, dtype):
    """Relative rounding of the dequantised weight, both sides together
    (NOTE [derived tolerances] (tests/_tolerance.py)).

    plain: none (both sides read the same values). MXFP8: none (e4m3 x 2**k is exact in fp32 and bf16).
    NVFP4: the reference rounds ``expert_scale * scale`` and then ``value * block_scale`` in fp32 (2 u32)
    and the kernel at most as often (the per-expert scale on the accumulator, or both in the tile: 2 u32);
    a bf16/fp16 reference then rounds the weight to its dtype (u of dtype). The kernel's e2m1 x e4m3
    products have 6 significant bits: exact in every dtype.
    """
    from tests import _tolerance as tol
    if fmt != "nvfp4":
        return 0.0
    rel = 4 * tol.unit_roundoff(torch.float32)
    return rel + (tol.unit_roundoff(dtype) if dtype in tol.LOW_PRECISION else 0.0)


def _assert_close(torch, got, want, mag, k, operand_rel=0.0):
    """Within the derived bound: two fp32 sums of ``k`` products of magnitude ``mag = |a| @ |b|``,
    the weights' rounding, and the output casts (the interpreter's truncates, the reference's rounds)."""
    from tests import _tolerance as tol
    bound = tol.matmul_bound(mag, k, want, operand_rel=operand_rel, got_dtype=got.dtype, want_dtype=want.dtype,
                             got_truncates=True)
    tol.assert_within(got, want, bound)


def _random_mxfp8(torch, gen, E, N, K):
    qdata = (torch.randn(E, N, K, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.randint(120, 135, (E, N, K // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
    return qdata, scale


def _random_nvfp4(torch, gen, E, N, K):
    qdata = torch.randint(0, 256, (E, N, K // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    scale = (torch.rand(E, N, K // 16, generator=gen) * 8 + 0.01).to(torch.float8_e4m3fn)
    expert_scale = torch.rand(E, generator=gen) + 0.5
    return qdata, scale, expert_scale


def _run_case(gmm, kind, counts, M, N, K, dtype_name):
    import torch

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(len(kind) + M)
    E = len(counts)
    offs = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    x = torch.randn(M, K, generator=gen).to(dtype)

    config = None
    if kind.startswith("swapped:"):  # the tiled kernel computing (W x^T)^T
        kind = kind.split(":")[1]
        config = dict(gmm._pick_config(M, E, N, K, kind, None, False), SWAP_AB=True)
    if kind.startswith("decode:"):  # the decode kernel, with explicit split-K and operand order
        _, kind, split_k, swap = kind.split(":")
        block_k = max(32, gmm._MIN_BLOCK_K[kind])
        config = dict(
            KERNEL="decode", BLOCK_M=16, BLOCK_N=16, BLOCK_K=block_k, SPLIT_K=int(split_k), SWAP_AB=swap == "1"
        )

    def launch(w, scale, gscale, fmt):
        out = torch.full((M, N), float("nan"), dtype=dtype)
        return gmm.launch_grouped_mm(x, w, scale, gscale, offs, out, fmt, config=config)

    if kind == "zero_empty":
        w = torch.randn(E, N, K, generator=gen).to(dtype)
        got = gmm.zero_empty_groups(w.clone(), offs)
        empty = torch.tensor(counts) == 0
        assert torch.equal(got[~empty], w[~empty]) and torch.all(got[empty] == 0)
        return
    if kind == "zero_rows":
        y = torch.randn(M, N, generator=gen).to(dtype)
        got = gmm.zero_rows_past(y.clone(), offs)
        end = sum(counts)
        assert torch.equal(got[:end], y[:end]) and torch.all(got[end:] == 0)
        return
    if kind.startswith("bug:"):
        _run_bug(torch, gmm, kind.split(":")[1], gen, x, offs, E, M, N, K, dtype)
        return
    if kind == "bad_offs":
        _run_bad_offs(torch, gmm, gen, x, offs, E, M, N, K, dtype)
        return
    if kind == "wgrad":
        dy = torch.randn(M, N, generator=gen).to(dtype)
        dw = torch.full((E, N, K), float("nan"), dtype=dtype)
        gmm.launch_grouped_mm_wgrad(dy, x, offs, dw)
        from tests import _tolerance as tol

        mag = tol.grouped_wgrad_abs(dy, x, offs)
        _assert_close(torch, dw, gmm.grouped_mm_wgrad_reference(dy, x, offs), mag, max(max(counts), 1))
        assert torch.all(dw[torch.tensor(counts) == 0] == 0)
        return
    if kind in ("plain", "plain_strided"):
        w = torch.randn(E, N, K, generator=gen).to(dtype)
        if kind == "plain_strided":  # a w.transpose(1, 2) view, as the dX operand of the backward
            w = torch.randn(E, K, N, generator=gen).to(dtype).transpose(1, 2)
        y, w_ref = launch(w, None, None, "plain"), w
    elif kind.startswith("mxfp8"):
        qdata, scale = _random_mxfp8(torch, gen, E, N, K)
        if kind == "mxfp8_special":  # e8m0 code 0 (2**-127) and an all-zero block
            scale[0, 3, 1] = 0
            qdata[1, 5, :32] = 0
        y, w_ref = launch(qdata, scale, None, "mxfp8"), gmm.dequantize_mxfp8(qdata, scale, dtype)
    else:
        qdata, scale, expert_scale = _random_nvfp4(torch, gen, E, N, K)
        y = launch(qdata, scale, expert_scale, "nvfp4")
        w_ref = gmm.dequantize_nvfp4(qdata, scale, expert_scale, dtype)
        if kind == "repeat":
            assert torch.equal(y, launch(qdata, scale, expert_scale, "nvfp4"))
    fmt = "plain" if kind.startswith("plain") else "mxfp8" if kind.startswith("mxfp8") else "nvfp4"
    from tests import _tolerance as tol

    mag = tol.grouped_abs_matmul(x, w_ref, offs)
    _assert_close(torch, y, gmm.grouped_mm_reference(x, w_ref, offs), mag, K, _operand_rel(torch, fmt, dtype))
    assert torch.all(y[int(offs[-1]) :] == 0), "rows past offs[-1] must be zero"


def _run_bad_offs(torch, gmm, gen, x, offs, E, M, N, K, dtype):
    """The first offset negative, the last past ``M``: each kernel (tiled, decode with split-K, wgrad) gives the
    reference's result (its row masks amount to the kernels' clamp into ``[0, M]``), and reads no row outside ``x`` /
    ``dy``: both are views into buffers whose other rows are huge, which would show in the result."""
    from tests import _tolerance as tol

    bad = offs.clone()
    bad[0], bad[-1] = -3, M + 5
    huge = torch.finfo(dtype).max / 4

    def padded(t):
        buf = torch.full((t.shape[0] + 16, t.shape[1]), huge, dtype=dtype)
        buf[8 : 8 + t.shape[0]] = t
        return buf[8 : 8 + t.shape[0]]

    xv = padded(x)
    w = torch.randn(E, N, K, generator=gen).to(dtype)
    want = gmm.grouped_mm_reference(x, w, bad)
    mag = tol.grouped_abs_matmul(x, w, bad)
    decode = dict(KERNEL="decode", BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, SPLIT_K=2, SWAP_AB=False)
    for config in (None, decode):
        y = gmm.launch_grouped_mm(xv, w, None, None, bad, torch.full((M, N), float("nan"), dtype=dtype), "plain",
                                  config=config)
        assert bool(torch.isfinite(y).all()), ("a row outside x was read", config)
        _assert_close(torch, y, want, mag, K)
    dy = torch.randn(M, N, generator=gen).to(dtype)
    dw = torch.full((E, N, K), float("nan"), dtype=dtype)
    gmm.launch_grouped_mm_wgrad(padded(dy), xv, bad, dw)
    assert bool(torch.isfinite(dw).all()), "a row outside dy / x was read"
    _assert_close(torch, dw, gmm.grouped_mm_wgrad_reference(dy, x, bad), tol.grouped_wgrad_abs(dy, x, bad), M)


def _run_bug(torch, gmm, bug, gen, x, offs, E, M, N, K, dtype):
    """Launch the kernel with one deliberate bug; the derived comparison must raise (and pass without it)."""

    def launch(x_in, w, scale, offs_in, fmt):
        out = torch.full((M, N), float("nan"), dtype=dtype)
        return gmm.launch_grouped_mm(x_in, w, scale, None, offs_in, out, fmt, config=None)

    if bug == "scale":  # one e8m0 exponent + 1 on expert 2 (5 rows): one block of 32 weights doubled
        qdata, scale = _random_mxfp8(torch, gen, E, N, K)
        w_ref, fmt = gmm.dequantize_mxfp8(qdata, scale, dtype), "mxfp8"
        bad = scale.clone()
        bad[2, 7, 1] += 1
        right, wrong = launch(x, qdata, scale, offs, fmt), launch(x, qdata, bad, offs, fmt)
    else:
        w_ref = torch.randn(E, N, K, generator=gen).to(dtype)
        right = launch(x, w_ref, None, offs, "plain")
        if bug == "offs":  # expert 2 ends one row early (offs 3 3 8 10 -> 3 3 7 10): row 7 gets expert 3
            bad = offs.clone()
            bad[2] -= 1
            wrong = launch(x, w_ref, None, bad, "plain")
        else:  # column 5 of x left out of the K sum
            dropped = x.clone()
            dropped[:, 5] = 0
            wrong = launch(dropped, w_ref, None, offs, "plain")
    want = gmm.grouped_mm_reference(x, w_ref, offs)
    from tests import _tolerance as tol

    mag = tol.grouped_abs_matmul(x, w_ref, offs)
    _assert_close(torch, right, want, mag, K)
    try:
        _assert_close(torch, wrong, want, mag, K)
    except AssertionError:
        return
    raise AssertionError(f"deliberate bug {bug!r} passed the derived comparison")


# (M, E, N, K): Qwen3-MoE-like decode and prefill shapes of the benchmark (the two tile families)
SM90_SHAPES = ((8, 128, 1536, 2048), (32768, 128, 1536, 2048))
_SM90_TYPES = {  # format, activation dtype -> (x/y, weight, scale, per-expert scale) pointer types
    ("plain", "bf16"): ("*bf16", "*bf16", "*bf16", "*i32"),
    ("plain", "fp16"): ("*fp16", "*fp16", "*fp16", "*i32"),
    ("plain", "fp32"): ("*fp32", "*fp32", "*fp32", "*i32"),
    ("mxfp8", "bf16"): ("*bf16", "*fp8e4nv", "*u8", "*i32"),
    ("nvfp4", "bf16"): ("*bf16", "*i16", "*fp8e4nv", "*fp32"),  # int16 words of four e2m1 codes
}


def compile_sm90() -> dict:
    """Compile (no GPU needed) every kernel specialisation the CUDA launchers pick for the benchmark
    shapes, for sm_90: the bf16/fp16 ``tl.dot`` paths never run under the interpreter."""
    from tests.ops.triton._interp import compile_for_sm90, import_ops_only

    (gmm,) = import_ops_only("grouped_mm")
    kernel = gmm._kernels._grouped_mm_kernel
    jobs = {}
    for M, E, N, K in SM90_SHAPES:
        for (fmt, dtype), (x_t, w_t, s_t, g_t) in _SM90_TYPES.items():
            if dtype != "bf16" and M > 8:
                continue  # fp16/fp32 plain weights: one shape is enough
            cfg = gmm._pick_config(M, E, N, K, fmt, 132, dtype == "fp32")
            consts = dict(
                W_FORMAT=gmm._FORMATS[fmt],
                IEEE_DOT=dtype == "fp32",
                PTX_DECODE=dtype == "bf16",
                BLOCK_E=max(gmm._next_pow2(E), 16),
                K_ALIGN=gmm.k_align(K),
            )
            consts.update({k: v for k, v in cfg.items() if k.isupper()})
            ptrs = dict(x_ptr=x_t, w_ptr=w_t, w_scale_ptr=s_t, w_gscale_ptr=g_t, offs_ptr="*i32", y_ptr=x_t)
            sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in kernel.arg_names}
            options = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
            jobs[f"{fmt}_{dtype}_{sorted(cfg.items())}"] = (kernel, sig, consts, options)
    decode = gmm._kernels._grouped_mm_decode_kernel
    for (fmt, dtype), (x_t, w_t, s_t, g_t) in _SM90_TYPES.items():
        for M in (8, 512, 2048):  # T = 1, 64, 256 at top-8: BLOCK_M 16 / 32, split-K or not
            cfg = gmm._pick_decode_config(M, 128, 1536, 2048, fmt, 132, dtype == "fp32")
            split = cfg.pop("SPLIT_K") > 1
            consts = dict(
                W_FORMAT=gmm._FORMATS[fmt],
                IEEE_DOT=dtype == "fp32",
                PTX_DECODE=dtype == "bf16",
                BLOCK_E=128,
                K_ALIGN=gmm.k_align(2048),
            )
            consts.update({k: v for k, v in cfg.items() if k.isupper() and k != "KERNEL"})
            ptrs = dict(x_ptr=x_t, w_ptr=w_t, w_scale_ptr=s_t, w_gscale_ptr=g_t, offs_ptr="*i32")
            ptrs["y_ptr"] = "*fp32" if split else x_t
            sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in decode.arg_names}
            options = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
            jobs[f"decode_{fmt}_{dtype}_{sorted(cfg.items())}_split{split}"] = (decode, sig, consts, options)
    reduce = gmm._kernels._splitk_reduce_kernel
    sig = dict(part_ptr="*fp32", y_ptr="*bf16", M="i32", N="i32", SPLIT_K="i32", stride_ym="i32", stride_yn="i32")
    jobs["splitk_reduce_bf16"] = (reduce, dict(sig, BLOCK="constexpr"), dict(BLOCK=1024), dict(num_warps=4))
    wgrad = gmm._kernels._grouped_mm_wgrad_kernel
    for dtype, consts, warps in (("bf16", (False, 32, 128, 128), 8), ("fp32", (True, 32, 64, 64), 4)):
        consts = dict(zip(("IEEE_DOT", "BLOCK_M", "BLOCK_N", "BLOCK_K"), consts))
        sig = {n: "constexpr" if n in consts else f"*{dtype}" if n.endswith("_ptr") else "i32" for n in wgrad.arg_names}
        sig["offs_ptr"] = "*i32"
        jobs[f"wgrad_{dtype}"] = (wgrad, sig, consts, dict(num_warps=warps, num_stages=3))
    zero = gmm._kernels._zero_empty_groups_kernel
    sig = dict(w_ptr="*bf16", offs_ptr="*i32", GROUP_NUMEL="i32", CHUNK="constexpr", BLOCK="constexpr")
    jobs["zero_empty_groups_bf16"] = (zero, sig, dict(CHUNK=1 << 16, BLOCK=1024), dict(num_warps=4))
    zero_rows = gmm._kernels._zero_rows_past_kernel
    sig = dict(y_ptr="*bf16", offs_ptr="*i32", NUM_EXPERTS="i32", M="i32", N="i32", ROWS="constexpr", BLOCK="constexpr")
    jobs["zero_rows_past_bf16"] = (zero_rows, sig, dict(ROWS=64, BLOCK=1024), dict(num_warps=4))
    return compile_for_sm90(jobs)


def main() -> None:
    import json
    import os
    import sys

    from tests.ops.triton._interp import import_ops_only, run_cases

    if "--sm90" in sys.argv:
        print(json.dumps(compile_sm90()))
        return

    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    from triton.runtime.interpreter import InterpretedFunction

    (gmm,) = import_ops_only("grouped_mm")
    kernels = [k for k in vars(gmm._kernels) if k.endswith("_kernel")]
    assert all(isinstance(getattr(gmm._kernels, k), InterpretedFunction) for k in kernels)
    jobs = [(name, lambda case=case: _run_case(gmm, *case)) for name, case in CASES.items()]
    print(json.dumps(run_cases(jobs, {"_kernels": sorted(kernels)})))


if __name__ == "__main__":
    main()
