"""Compile every Triton kernel launch seen under the interpreter for a real GPU target, on a CPU machine.

The interpreter runs kernels as NumPy code and misses errors that Triton's compiler frontend raises
(type unification across branches, constexpr misuse, unsupported ops). CI has no GPU, but Triton can
lower a kernel all the way to a cubin for sm_90 without one. So:

1. ``python sm90_compile.py record OUT.json SCRIPT`` runs ``SCRIPT`` (an interpreter worker) with
   ``TRITON_INTERPRET=1`` and writes the argument types and constexpr values of every launch.
2. ``python sm90_compile.py compile OUT.json`` (no interpreter) compiles each distinct launch with
   ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`` and prints a JSON result.
"""

from __future__ import annotations

import json
import os
import runpy
import sys


def _type_of(value: object) -> tuple[str, object]:
    """("sig", type string) for a runtime argument, or ("const", json value) for a constexpr-like one."""
    import torch

    if isinstance(value, torch.Tensor):
        names = {
            torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
            torch.int32: "i32", torch.int64: "i64", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
            torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5",
        }
        return "sig", "*" + names[value.dtype]
    if isinstance(value, bool):
        return "sig", "i1"
    if isinstance(value, int):
        return "sig", "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "sig", "fp32"
    return "const", None if value is None else str(value)


def record(out_path: str, script: str) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    import triton.runtime.interpreter as interp

    launches: dict[str, dict] = {}
    original_run = interp.InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        params = dict(zip(self.arg_names, args))
        params.update({k: v for k, v in kwargs.items() if k in self.arg_names})
        constexpr_names = {
            name for name, p in __import__("inspect").signature(fn).parameters.items()
            if "constexpr" in str(p.annotation)
        }
        sig, consts = {}, {}
        for name in self.arg_names:
            if name not in params:
                continue  # defaulted
            value = params[name]
            if name in constexpr_names:
                sig[name] = "constexpr"
                consts[name] = value if isinstance(value, (int, float, bool)) or value is None else str(value)
                continue
            kind, t = _type_of(value)
            if kind == "const":
                sig[name] = "constexpr"
                consts[name] = t
            else:
                sig[name] = t
        entry = {"module": fn.__module__, "name": fn.__name__, "signature": sig, "constexprs": consts}
        launches[json.dumps(entry, sort_keys=True)] = entry
        return original_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    interp.InterpretedFunction.run = recording_run
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        with open(out_path, "w") as f:
            json.dump(list(launches.values()), f)


def _constexpr_value(value: object) -> object:
    import triton.language as tl

    if isinstance(value, str) and value.startswith(("fp", "bf", "int", "uint")):
        return getattr(
            tl, {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp64": "float64"}.get(value, value)
        )
    return value


def compile_all(path: str) -> dict[str, str]:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    with open(path) as f:
        launches = json.load(f)
    target = GPUTarget("cuda", 90, 32)
    results: dict[str, str] = {}
    for entry in launches:
        fn = getattr(importlib.import_module(entry["module"]), entry["name"])
        while not isinstance(fn, triton.runtime.jit.JITFunction):
            fn = fn.fn  # unwrap autotuners / heuristics
        consts = {(fn.arg_names.index(k),): _constexpr_value(v) for k, v in entry["constexprs"].items()}
        key = f"{entry['name']}{sorted(entry['constexprs'].items())}"
        try:
            triton.compile(ASTSource(fn, entry["signature"], consts), target=target)
            results[key] = "ok"
        except Exception as exc:  # noqa: BLE001 - reported to the test
            results[key] = f"{type(exc).__name__}: {str(exc)[-2000:]}"
    return results


if __name__ == "__main__":
    if sys.argv[1] == "record":
        record(sys.argv[2], sys.argv[3])
    else:
        print(json.dumps(compile_all(sys.argv[2])))
