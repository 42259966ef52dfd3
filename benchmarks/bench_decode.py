"""Decode-like MoE step with host-sized padding: eager vs Inductor vs moe_compile (default, reduce-overhead).

The layer is ``tests/models/host_padded.py::SplitPadGroupedMoE`` (bf16, align 16): router, argsort
permute, ``counts.tolist()``, ``split`` + ``F.pad`` + ``cat``, offsets from ``torch.tensor(host list)``,
two ``torch._grouped_mm``, ``split``/``narrow``/``cat`` unpad, ``index_add_`` combine. Forward only, under
``no_grad``, for T in {1, 8, 64} tokens and two shapes:

* ``mixtral``: H 4096, I 14336, E 8, K 2 (full size; ``--small`` uses I 3584);
* ``qwen3``: H 2048, I 768, E 128, K 8.

Variants: ``eager``; ``inductor`` (``torch.compile(fullgraph=True)``, default backend: the host-sized
region is captured with unbacked sizes and synced on the host); ``moe`` (``moe_compile.compile``,
default mode); ``moe_ro`` (``moe_compile.compile(mode="reduce-overhead")``: CUDA graphs, possible only
because ``strip_host_padding`` removed the host syncs). ``floor``: bytes of the expert weights the
step must read (experts hit by this routing) / measured copy bandwidth. Each variant is compiled
once per T (``dynamic=False``); the compile time is reported separately.

Usage, from the repository root: ``python -m benchmarks.bench_decode --save [--quick] [--small]
[--models qwen3] [--variants inductor]`` (``--save`` writes ``benchmarks/results/decode.json``). A time budget
(``--budget-s``, default 80) skips what is left once exceeded (reported as skipped), and ``--compile-timeout-s``
gives up on a compile that runs longer.
An existing results file from the same setup (device, torch, triton, Mixtral size) is merged into:
rows measured now replace the rows of the same (model, T, variant), except that a row skipped now
never replaces a measured one, so one table can be filled over several runs (plain Inductor's
compile of the E=128 host-padded graph alone takes minutes).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import signal
import time

import torch

from benchmarks._bench_env import add_results_args, copy_bandwidth, device_env, read_rows, results_path, write_results

# plain Inductor last: its compile of the unbacked host-padded graph is the slowest
VARIANTS = ("eager", "moe", "moe_ro", "inductor")
DEVICE = "cuda"


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    H: int
    I: int  # noqa: E741 - expert intermediate size, as in the notes
    E: int
    K: int
    align: int = 16


@dataclasses.dataclass
class Result:
    model: str
    T: int
    variant: str
    time_us: float
    compile_s: float
    max_abs_err: float
    floor_us: float
    note: str = ""


def get_configs(small: bool) -> list[Config]:
    return [Config("mixtral", 4096, 3584 if small else 14336, 8, 2), Config("qwen3", 2048, 768, 128, 8)]


def _make(variant: str, model: torch.nn.Module):
    import moe_compile

    if variant == "eager":
        return model
    if variant == "inductor":
        return torch.compile(model, fullgraph=True, dynamic=False)
    if variant == "moe":
        return moe_compile.compile(model, dynamic=False)
    return moe_compile.compile(model, mode="reduce-overhead", dynamic=False)


def _floor_us(cfg: Config, model: torch.nn.Module, x: torch.Tensor, bw: float) -> float:
    with torch.no_grad():
        _, idx_TK = model.route(x)
    hit = int(torch.unique(idx_TK).numel())
    weight_bytes = hit * 3 * cfg.H * cfg.I * 2  # w13 (2I x H) + w2 (H x I), bf16
    act_bytes = x.numel() * x.element_size() * (2 + 2 * cfg.K)
    return (weight_bytes + act_bytes) / bw * 1e6


@contextlib.contextmanager
def _time_limit(seconds: float | None):
    """Raise ``TimeoutError`` in the main thread after ``seconds`` (a compile that would eat the budget)."""
    if not seconds:
        yield
        return

    def expire(signum, frame):
        raise TimeoutError(f"first call (compile) exceeded {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_model(cfg: Config, tokens: list[int], bw: float, rep: int, deadline: float,
              variants: tuple[str, ...] = VARIANTS, compile_timeout_s: float | None = None) -> list[Result]:
    from triton.testing import do_bench

    from tests.models.host_padded import make_layer

    model = make_layer(
        "split_pad", hidden=cfg.H, inter=cfg.I, num_experts=cfg.E, top_k=cfg.K, align=cfg.align, device=DEVICE
    ).eval()
    inputs = {T: torch.randn(T, cfg.H, device=DEVICE, dtype=torch.bfloat16) for T in tokens}
    with torch.no_grad():
        reference = {T: model(x) for T, x in inputs.items()}
    results = []
    for variant in variants:
        torch._dynamo.reset()
        fn = _make(variant, model)
        for T, x in inputs.items():
            floor = _floor_us(cfg, model, x, bw)
            if time.perf_counter() > deadline:
                results.append(
                    Result(cfg.name, T, variant, math.nan, math.nan, math.nan, floor, "skipped: time budget")
                )
                continue

            def step(fn=fn, x=x):
                if variant == "moe_ro":
                    torch.compiler.cudagraph_mark_step_begin()
                return fn(x)

            note = ""
            try:
                with torch.no_grad():
                    start = time.perf_counter()
                    with _time_limit(compile_timeout_s if variant != "eager" else None):
                        out = step()
                    torch.cuda.synchronize() if DEVICE == "cuda" else None
                    compile_s = time.perf_counter() - start if variant != "eager" else 0.0
                    err = (out.float() - reference[T].float()).abs().max().item()
                    us = do_bench(step, warmup=10, rep=rep) * 1e3
            except Exception as exc:  # noqa: BLE001 - report the failure in the table, keep going
                us, compile_s, err, note = math.nan, math.nan, math.nan, f"failed: {type(exc).__name__}: {exc}"[:160]
            results.append(Result(cfg.name, T, variant, us, compile_s, err, floor, note))
            print(f"  {cfg.name} T={T} {variant}: {us:.1f} us (compile {compile_s:.1f} s) {note}", flush=True)
    torch._dynamo.reset()
    del model
    torch.cuda.empty_cache()
    return results


def summarize(results: list[Result]) -> list[dict]:
    rows = []
    keys = sorted({(r.model, r.T) for r in results}, key=lambda k: (k[0], k[1]))
    for model, T in keys:
        row: dict = {"model": model, "T": T}
        cell = {r.variant: r for r in results if r.model == model and r.T == T}
        for v in VARIANTS:
            row[f"{v}_us"] = round(cell[v].time_us, 1) if v in cell and not math.isnan(cell[v].time_us) else None
        row["floor_us"] = round(next(iter(cell.values())).floor_us, 1)
        ro, eager = row.get("moe_ro_us"), row.get("eager_us")
        row["eager/moe_ro"] = round(eager / ro, 2) if ro and eager else None
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_results_args(parser)
    parser.add_argument("--quick", action="store_true", help="T in {1, 8} only, fewer repetitions")
    parser.add_argument("--small", action="store_true", help="Mixtral-like with I=3584 instead of 14336")
    parser.add_argument("--budget-s", type=float, default=80.0, help="skip what is left after this many seconds")
    parser.add_argument("--models", nargs="+", default=None, help="subset of: mixtral qwen3")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--tokens", nargs="+", type=int, default=None, help="T values (default 1 8 64)")
    parser.add_argument("--compile-timeout-s", type=float, default=None,
                        help="give up on a variant's first call (the compile) after this many seconds")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_decode: no CUDA device; nothing to benchmark (this benchmark needs a GPU).")
        return
    for name, value in (("cache_size_limit", 64), ("recompile_limit", 64), ("accumulated_cache_size_limit", 256)):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, value)
    tokens = args.tokens or ([1, 8] if args.quick else [1, 8, 64])
    rep = 20 if args.quick else 50
    start = time.perf_counter()
    deadline = start + args.budget_s
    bw = copy_bandwidth()
    results: list[Result] = []
    configs = [c for c in get_configs(args.small) if args.models is None or c.name in args.models]
    for i, cfg in enumerate(configs):  # an equal share of the budget per model; unused time carries over
        share = start + args.budget_s * (i + 1) / len(configs)
        results += run_model(cfg, tokens, bw, rep, min(share, deadline), tuple(args.variants), args.compile_timeout_s)
        print(f"{cfg.name}: done at {time.perf_counter() - start:.0f} s", flush=True)
    env = device_env(copy_bandwidth_GBps=round(bw / 1e9, 1), mixtral_I=get_configs(args.small)[0].I,
                     wall_s=round(time.perf_counter() - start, 1))
    path = results_path(args, "decode")
    earlier_env, earlier_rows = read_rows(path) if args.save else ({}, [])
    same_setup = ("device", "torch", "triton", "mixtral_I")
    if all(earlier_env.get(k) == env[k] for k in same_setup):
        # a row skipped now (time budget) never replaces a row measured earlier on the same setup
        earlier = {(r.model, r.T, r.variant): r for r in (Result(**d) for d in earlier_rows)}
        for r in results:
            key = (r.model, r.T, r.variant)
            if key not in earlier or not r.note.startswith("skipped") or earlier[key].note.startswith("skipped"):
                earlier[key] = r
        results = list(earlier.values())
    summary = summarize(results)
    if args.save:
        write_results(path, [dataclasses.asdict(r) for r in results], env)
    print(f"device={env['device']} torch={env['torch']} triton={env['triton']} copy={env['copy_bandwidth_GBps']} GB/s "
          f"mixtral I={env['mixtral_I']} wall={env['wall_s']} s")
    keys = list(summary[0].keys())
    widths = [max(len(k), *(len(str(r.get(k))) for r in summary)) for k in keys]
    print("  ".join(k.ljust(w) for k, w in zip(keys, widths)))
    for r in summary:
        print("  ".join(str(r.get(k)).ljust(w) for k, w in zip(keys, widths)))


if __name__ == "__main__":
    main()
