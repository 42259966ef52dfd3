"""What translation validation costs at compile time (NOTE [translation validation] (moe_compile/passes/_validate.py)).

Per model: the first training step under ``torch.compile(model, backend="moe_compile")`` (compile, forward and
backward, each in an empty cache directory) with ``moe.validate`` off and on, side by side in one process, and the
seconds spent inside validation in the run with it on (``StageValidator.check``, timed around each call); then the
same step again, as a new process would run it with the caches the first left (Inductor's, Triton's and the
validation verdicts): ``warm_compile_s``, ``warm_validate_s`` and ``warm_fraction``. Columns:
``compile_s_off`` / ``compile_s_on`` (wall time of that first step; an unrecorded compile of the first model
comes before, so that neither side pays the process's one-time costs), ``validate_s`` (time inside validation),
``fraction`` (``validate_s / compile_s_on``), ``checks`` (validations run), ``run_s`` (seconds of each graph run
inside them: baseline, rewritten, reference, in the order they ran), ``refused`` and ``unchecked`` (rewrites
refused, and kept without validation, in the run with it on) and ``notes`` (why).

Models: ``--families`` the transformers families of the family matrix (tests/models/hf_families.py; tiny configs,
bf16, on CPU or the GPU: ``--device``), and on a GPU ``--causal-lm [qwen3_moe,mixtral,...]`` the 2-layer CausalLMs
of ``bench_train_determinism`` (batch 2 x 2048; alone: Qwen3-MoE, H 2048, E 128, top-8).

Usage, from the repository root: ``python -m benchmarks.bench_validation_cost [--families qwen3_moe,mixtral]
[--device cpu] [--causal-lm] [--save]``; ``--save`` writes ``benchmarks/results/validation_cost_<device>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from benchmarks._bench_env import add_results_args, device_env, results_path, write_results


@contextlib.contextmanager
def timing_validation() -> Iterator[dict[str, float]]:
    """Time every ``StageValidator.check`` call while the block is open."""
    from moe_compile.passes import _validate

    stats: dict[str, Any] = {"seconds": 0.0, "checks": 0, "runs": []}
    original = _validate.StageValidator.check
    original_run = _validate.StageValidator._run

    def run(self: Any, graph: Any, raise_to: Any = None) -> Any:
        start = time.perf_counter()
        try:
            return original_run(self, graph, raise_to)
        finally:
            stats["runs"].append(round(time.perf_counter() - start, 3))

    def check(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            stats["seconds"] += time.perf_counter() - start
            stats["checks"] += 1

    _validate.StageValidator.check = check
    _validate.StageValidator._run = run
    try:
        yield stats
    finally:
        _validate.StageValidator.check = original
        _validate.StageValidator._run = original_run


@contextlib.contextmanager
def timing_ops(device: str) -> Iterator[dict[str, float]]:
    """Seconds per op target inside validation's graph runs (``--profile-ops``; a CUDA sync after each node)."""
    from moe_compile.passes import _validate

    seconds: dict[str, float] = {}
    original = _validate._Runner.run_node

    def run_node(self: Any, n: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(self, n)
        finally:
            if device == "cuda":
                torch.cuda.synchronize()
            name = f"{n.op}:{getattr(n.target, '__name__', n.target)}" + (" (raised)" if self.raise_to else "")
            seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start

    _validate._Runner.run_node = run_node
    try:
        yield seconds
    finally:
        _validate._Runner.run_node = original


def _caches(cache_dir: str | None) -> Any:
    """Inductor's caches in ``cache_dir`` (and moe_compile's verdicts beside them), or off (None)."""
    if cache_dir is None:
        return torch._inductor.config.patch(force_disable_caches=True)
    return _cache_dir(cache_dir)


@contextlib.contextmanager
def _cache_dir(cache_dir: str) -> Iterator[None]:
    import os
    import unittest.mock

    utils = torch._inductor.utils
    clear = getattr(utils, "clear_caches", None) or utils.clear_inductor_caches
    clear()  # the in-memory caches too, as in a new process (as torch._inductor.utils.fresh_cache does)
    env = {"TORCHINDUCTOR_CACHE_DIR": cache_dir, "TRITON_CACHE_DIR": os.path.join(cache_dir, "triton"),
           "MOE_COMPILE_VERDICT_CACHE": "1"}
    try:
        with unittest.mock.patch.dict("os.environ", env):
            yield
    finally:
        clear()


def first_step(build: Callable[[], tuple[torch.nn.Module, dict[str, Any]]], validate: bool, device: str,
               cache_dir: str | None = None, ops: dict[str, float] | None = None
               ) -> tuple[float, dict[str, float], Any]:
    """Compile and run one training step; (wall seconds, validation stats, report). ``cache_dir``: Inductor's
    caches (and validation's verdicts) there, cold or warm as the directory is; None: caches off."""
    from moe_compile import report
    from moe_compile.passes import _verdicts

    model, inputs = build()
    torch._dynamo.reset()
    _verdicts.clear_memory()  # as a new process: only what the cache directory holds
    compiled = torch.compile(model, backend="moe_compile", options={"moe.validate": validate})
    profile = timing_ops(device) if ops is not None else contextlib.nullcontext({})
    with timing_validation() as stats, report.collecting() as rep, _caches(cache_dir), profile as op_seconds:
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = compiled(**inputs)
        out.loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    torch._dynamo.reset()
    if ops is not None:
        for name, t in op_seconds.items():
            ops[name] = ops.get(name, 0.0) + t
    return seconds, stats, rep


def family_builder(family: str, device: str) -> Callable[[], tuple[torch.nn.Module, dict[str, Any]]]:
    from tests.models import hf_families

    def build() -> tuple[torch.nn.Module, dict[str, Any]]:
        model, inputs = hf_families.build(family)
        return model.to(device), {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}

    return build


def causal_lm_builder(model_name: str = "qwen3_moe") -> Callable[[], tuple[torch.nn.Module, dict[str, Any]]]:
    from benchmarks.bench_train_determinism import build_model

    def build() -> tuple[torch.nn.Module, dict[str, Any]]:
        model = build_model(2, model=model_name)
        ids = torch.randint(0, 32000, (2, 2048), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        return model, {"input_ids": ids, "labels": ids}

    return build


def measure(name: str, build: Callable[[], tuple[torch.nn.Module, dict[str, Any]]], device: str,
            profile_ops: bool = False) -> dict[str, Any]:
    import tempfile

    ops: dict[str, float] | None = {} if profile_ops else None
    with tempfile.TemporaryDirectory(prefix="bench_validation_off_") as off_dir, \
            tempfile.TemporaryDirectory(prefix="bench_validation_on_") as on_dir:
        off_s, _, _ = first_step(build, False, device, off_dir)
        on_s, stats, rep = first_step(build, True, device, on_dir, ops)
        # a recompile in a new process with the caches the first compile left: validation's share of it
        warm_s, warm_stats, _ = first_step(build, True, device, on_dir)
    top = sorted((ops or {}).items(), key=lambda kv: -kv[1])[:12]
    return {"model": name, "compile_s_off": round(off_s, 3), "compile_s_on": round(on_s, 3),
            "validate_s": round(stats["seconds"], 3), "fraction": round(stats["seconds"] / on_s, 4),
            "warm_compile_s": round(warm_s, 3), "warm_validate_s": round(warm_stats["seconds"], 4),
            "warm_fraction": round(warm_stats["seconds"] / warm_s, 4),
            **({"top_ops_s": "; ".join(f"{k} {v:.3f}" for k, v in top)} if profile_ops else {}),
            "checks": int(stats["checks"]), "run_s": stats["runs"],
            "refused": sum(r.what == "validation_failed" for r in rep.skips), "unchecked": len(rep.unchecked),
            "notes": [f"{r.pass_name} {r.layer}: {r.what}: {r.detail}"[:300] for r in rep.records
                      if r.what in ("validation_failed", "validation_unavailable")]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_results_args(parser)
    parser.add_argument("--families", default="", help="comma-separated families; 'all' for the whole matrix")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--causal-lm", nargs="?", const="qwen3_moe", default="",
                        help="comma-separated CausalLMs of bench_train_determinism (GPU; alone: qwen3_moe)")
    parser.add_argument("--no-warmup", action="store_true", help="skip the unrecorded first compile")
    parser.add_argument("--profile-ops", action="store_true",
                        help="record the ops that take longest inside validation's runs (a sync after each)")
    args = parser.parse_args()
    import warnings

    warnings.filterwarnings("ignore")
    families: list[str] = []
    if args.families == "all":
        from tests.models.hf_families import moe_families

        families = list(moe_families())
    elif args.families:
        families = args.families.split(",")
    models = [(f, family_builder(f, args.device)) for f in families]
    for model_name in filter(None, args.causal_lm.split(",")):
        models.append((f"{model_name}_causal_lm_2x2048", causal_lm_builder(model_name)))
    rows = []
    if models and not args.no_warmup:  # the process's first compile pays one-time costs: not either side's
        first_step(models[0][1], False, args.device)  # caches off
    for name, build in models:
        try:
            row = measure(name, build, args.device, args.profile_ops)
        except Exception as exc:  # noqa: BLE001 - a family that does not build or compile here: say so, go on
            first = str(exc).splitlines()[0][:160] if str(exc) else ""
            row = {"model": name, "error": f"{type(exc).__name__}: {first}"}
        rows.append(row)
        print(row, flush=True)
    ok = [r for r in rows if "fraction" in r]
    if ok:
        total_on = sum(r["compile_s_on"] for r in ok)
        total_val = sum(r["validate_s"] for r in ok)
        print(f"validation: {total_val:.1f} s of {total_on:.1f} s compile ({100 * total_val / total_on:.1f}%), "
              f"worst {max(r['fraction'] for r in ok):.1%} ({max(ok, key=lambda r: r['fraction'])['model']})")
    if args.save:
        write_results(results_path(args, "validation_cost", args.device), rows, device_env(
            args.device if args.device == "cpu" else None))


if __name__ == "__main__":
    main()
