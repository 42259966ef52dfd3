"""Run one generated layer eagerly, in a wider reference dtype and through moe_compile, and judge the compiled step.

:func:`check` (or :func:`check_module` for a layer module already loaded, as a printed script does) runs the
layer of a :class:`~tests.fuzz.grammar.Spec` in its mode (``train`` / ``eval_grad``: forward and backward on fixed
random cotangents; ``eval``: forward under ``no_grad``) four ways, each on the same (rounded) weights and inputs:

* eager in the spec's dtype, and eager in a wider one (float32, float64 for a float32 layer): the reference;
* compiled by moe_compile (the spec's entry: ``torch.compile(fullgraph=True)``, ``torch.compile()`` or
  ``moe_compile.compile``);
* compiled without moe_compile's passes (only where the first judgement fails, or when asked): the compile's own
  noise, and the witness of whether a failure is Inductor's too.

Every output and gradient must be within :func:`tests._tolerance.within_eager_bound`: no further from the reference
than eager's own distance allows, and exact zeros kept. Backends: ``"inductor"`` is the real thing
(``backend="moe_compile"`` against plain Inductor; 5-20 s a layer on CPU); ``"passes"`` runs moe_compile's
backend as it is (every pass, pre-grad, joint and post-grad, Inductor's decompositions and partitioner) but runs
the partitioned graphs with eager kernels instead of generated code (about 1 s a layer), against the same without
our passes. Caches are off in both: a cache hit would skip the passes (and in ``"passes"``, run cached code).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import os
import re
import time
import types
import unittest.mock
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tests._tolerance import TensorError, eager_bound_errors, within_eager_bound
from tests.fuzz.emit import DTYPES, load, script, source
from tests.fuzz.grammar import Spec

BACKENDS = ("passes", "inductor")
_ROUTER_PARAMS = ("router", "gate.")


@dataclasses.dataclass
class Result:
    """The verdict on one layer. ``kind``: ``ok``, ``numerics`` (outside the bound), ``crash`` (moe_compile fails
    where the compile without it works), ``pass_error`` (a pass raised, or its rewrite failed Inductor's compile,
    and was rolled back), ``validation_refused`` (translation validation refused a rewrite: a wrong rewrite caught,
    or a right one refused), ``both_fail`` (the compile fails with and without moe_compile, the same way: not
    ours to judge; a different failure with moe_compile is a ``crash``), ``generator_error`` (eager fails: the
    generator wrote a broken layer), ``unjudged`` (a MoE-rewritten layer with a tensor that eager's or plain
    Inductor's noise leaves out of the bound: a rewritten layer answers for every tensor). ``known`` names the entry of
    :data:`tests.fuzz.known.KNOWN` that explains a failure."""

    spec: Spec
    backend: str
    kind: str
    worst: tuple[str, float] = ("", 0.0)
    rewrites: list[str] = dataclasses.field(default_factory=list)
    skips: list[str] = dataclasses.field(default_factory=list)
    detail: str = ""
    plain_fails_too: bool | None = None  # the compile without our passes also fails the bound against eager
    rows: list[TensorError] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    known: str | None = None
    # the steps themselves (eager, reference, compiled, plain), each {name: tensor}; not serialised
    steps: dict[str, dict[str, torch.Tensor] | None] = dataclasses.field(default_factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        return self.kind in ("ok", "both_fail")

    @property
    def passed(self) -> bool:
        """Ok, or a failure that a :data:`~tests.fuzz.known.KNOWN` entry explains."""
        return self.ok or self.known is not None

    def summary(self) -> str:
        lines = [f"{self.kind}{f' (known: {self.known})' if self.known else ''} [{self.backend}] {self.spec}",
                 f"  rewrites: {', '.join(self.rewrites) or '-'}; worst: {self.worst[0]} "
                 f"({self.worst[1]:.3g} of bound); {self.seconds:.1f} s"]
        if self.plain_fails_too is not None:
            verdict = "also fails" if self.plain_fails_too else "passes"
            lines.append(f"  the compile without moe_compile's passes {verdict} the bound against eager")
        if self.detail:
            lines.append("  " + self.detail.replace("\n", "\n  "))
        if self.rows and self.kind != "ok":
            lines.append("  tensor: |moe - ref| |eager - ref| |plain - ref| bound ratio")
            for r in sorted(self.rows, key=lambda r: -_sortable(r.ratio))[:8]:
                plain = f"{r.inductor:.3g}" if r.inductor is not None else "-"
                lines.append(f"    {r.name}: {r.compiled:.3g} {r.eager:.3g} {plain} {r.bound:.3g} {r.ratio:.3g} "
                             f"{r.note}")
        return "\n".join(lines)

    def failure_message(self) -> str:
        """The summary and a standalone script that reproduces it."""
        return f"{self.summary()}\n\n# ---- standalone script ----\n{script(self.spec, self.backend)}"

    def to_json(self) -> dict[str, Any]:
        return {"spec": dataclasses.asdict(self.spec), "backend": self.backend, "kind": self.kind,
                "known": self.known, "worst": list(self.worst), "rewrites": self.rewrites, "skips": self.skips,
                "detail": self.detail, "plain_fails_too": self.plain_fails_too, "seconds": round(self.seconds, 2),
                "rows": [dataclasses.asdict(r) for r in self.rows]}


def _sortable(x: float) -> float:
    return float("inf") if x != x else x


def check(spec: Spec, backend: str = "passes", *, always_plain: bool = False) -> Result:
    """Judge ``spec``'s layer compiled by moe_compile (see the module docstring)."""
    return check_module(load(source(spec)), spec, backend, always_plain=always_plain)


def check_module(module: types.ModuleType, spec: Spec, backend: str = "passes", *,
                 always_plain: bool = False) -> Result:
    """:func:`check` for the layer class of an already loaded ``module`` (a printed script's own)."""
    from tests.fuzz.known import explain_failure

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    start = time.perf_counter()
    dtype = DTYPES[spec.dtype]
    wide = torch.float64 if dtype == torch.float32 else torch.float32
    layer = module.Layer(dtype=dtype, seed=spec.seed)
    freeze(layer, spec)
    ref_layer = copy.deepcopy(layer).to(wide)
    try:
        eager = run_calls(layer, layer, spec, dtype)
    except Exception as exc:  # noqa: BLE001 - a layer that does not run eagerly is the generator's bug
        return Result(spec, backend, "generator_error", detail=_first_line(exc), seconds=time.perf_counter() - start)
    ref = run_calls(ref_layer, ref_layer, spec, dtype, wide)
    from moe_compile import report

    moe_layer = copy.deepcopy(layer)
    with report.collecting() as rep:
        compiled, error = _compiled_step(moe_layer, spec, backend, moe=True)
    records = list(rep.records) + list(report.module_records(moe_layer))
    rewrites = sorted({f"{r.pass_name}" for r in records if r.kind == "rewrite"})
    skips = sorted({f"{r.pass_name}:{r.what}" for r in records if r.kind == "skip"})
    result = Result(spec, backend, "ok", rewrites=rewrites, skips=skips)
    outs = tuple(n for n in eager if n.rpartition(":")[2].startswith("out"))
    few = one_token_tensors(spec, eager)
    plain = None
    if error is not None:
        plain, plain_error = _compiled_step(copy.deepcopy(layer), spec, backend, moe=False)
        # both fail alike: not ours to judge; a different failure with moe_compile is ours
        result.kind = "both_fail" if plain_error is not None and same_failure(error, plain_error) else "crash"
        result.detail = f"moe_compile: {error}" + (f"\nwithout our passes: {plain_error}" if plain_error else "")
    else:
        ok, result.worst, _ = within_eager_bound(compiled, eager, ref, dtype=dtype, always_judged=outs, few_samples=few)
        if not ok or always_plain:
            plain, plain_error = _compiled_step(copy.deepcopy(layer), spec, backend, moe=False)
            if plain_error is None:
                ok, result.worst, unjudged = within_eager_bound(compiled, eager, ref, plain, dtype=dtype,
                                                                always_judged=outs, few_samples=few)
                if unjudged and any(r.kind == "rewrite" and r.moe for r in records):
                    # a rewritten layer answers for every tensor: noise that hides a tensor from the bound is a
                    # finding to classify, not a pass (issue 52)
                    result.kind = "unjudged"
                    result.detail = f"rewritten, with tensors the bound cannot judge (noise in every low-precision " \
                                    f"computation): {', '.join(unjudged)}"
                elif unjudged:
                    result.detail = f"unjudged (noise in every low-precision computation): {', '.join(unjudged)}"
            else:
                result.detail = f"the compile without our passes fails: {plain_error}"
        result.rows = eager_bound_errors(compiled, eager, ref, plain if plain and error is None else None, dtype=dtype,
                                         few_samples=few)
        if not ok:
            result.kind = "numerics"
            if plain:
                result.plain_fails_too = not within_eager_bound(plain, eager, ref, dtype=dtype, always_judged=outs,
                                                             few_samples=few)[0]
        elif any(r.kind == "error" for r in records):
            result.kind = "pass_error"
            result.detail = "; ".join(f"{r.pass_name}: {r.what} {r.detail[:200]}" for r in records if r.kind == "error")
        elif any(r.kind == "skip" and r.what == "validation_failed" for r in records):
            # translation validation caught a wrong rewrite (or refused a right one): either is a bug to find
            result.kind = "validation_refused"
            result.detail = "; ".join(f"{r.pass_name}: {r.detail[:300]}" for r in records
                                      if r.kind == "skip" and r.what == "validation_failed")
    result.seconds = time.perf_counter() - start
    result.steps = {"eager": eager, "ref": ref, "compiled": compiled, "plain": plain}
    if not result.ok:
        result.known = explain_failure(result)
    return result


def _failure_key(text: str) -> str:
    """A compile failure without what differs between two backends' reports of it: the backend's name, addresses,
    numbers, and the prefix Dynamo wraps a backend's exception in."""
    text = re.sub(r"backend='[^']*' raised:", "", text)
    text = re.sub(r"^(BackendCompilerFailed|InductorError):\s*", "", text.strip())
    text = re.sub(r"0x[0-9a-f]+", "ADDR", text)
    return re.sub(r"\d+", "N", text)[:200]


def same_failure(moe_error: str, plain_error: str) -> bool:
    """Whether two compiles failed the same way (``_first_line`` of each)."""
    return _failure_key(moe_error) == _failure_key(plain_error)


def _first_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return " ".join(text.split())[:400]


# ---- inputs, modes and one step --------------------------------------------------------------------------


def one_token_tensors(spec: Spec, step: dict[str, torch.Tensor]) -> frozenset[str]:
    """The tensors of ``step`` computed from one token (``spec.tokens == 1``; a second call of the same shape
    too): each is a product of that one row's values, so eager's error is one draw of a few roundings and judges
    with the step's noise as its floor (``few_samples`` of :func:`tests._tolerance.eager_bound_errors`;
    FINDINGS C5)."""
    if spec.tokens != 1:
        return frozenset()
    return frozenset(n for n in step if not n.startswith("call1:") or spec.second_call == "same_shape")


def make_input(spec: Spec, dtype: torch.dtype, call: int = 0) -> torch.Tensor:
    """``[T, H]`` (or ``[B, T/B, H]`` with ``batch3d``) standard normal tokens, seeded by the spec and the call
    (a second call has other tokens; with ``second_call="new_shape"``, three more of them)."""
    gen = torch.Generator().manual_seed(spec.seed + 1 + 7 * call)
    T, H = spec.tokens + (3 if call and spec.second_call == "new_shape" else 0), spec.hidden
    shape = (T, H) if not spec.batch3d else ((2, T // 2, H) if T % 2 == 0 else (1, T, H))
    return torch.randn(shape, generator=gen).to(dtype)


def run_calls(fn: Callable[..., Any], layer: torch.nn.Module, spec: Spec, dtype: torch.dtype,
              wide: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """:func:`run_step` on the first input and, with ``second_call``, on a second one (its tensors prefixed
    ``call1:``): the compiled graph must hold for routing it was not traced on, and for a new token count (a
    recompile with symbolic sizes)."""
    tensors = {}
    for call in range(2 if spec.second_call != "none" else 1):
        x = make_input(spec, dtype, call)
        step = run_step(fn, layer, x.to(wide or dtype), spec)
        tensors.update({(f"call{call}:" if call else "") + name: t for name, t in step.items()})
    return tensors


def freeze(layer: torch.nn.Module, spec: Spec) -> None:
    """``requires_grad`` off for the router's, the experts' or all parameters, as the spec says."""
    for name, p in layer.named_parameters():
        name = re.sub(r"^blocks\.\d+\.", "", name)
        router = name.startswith(_ROUTER_PARAMS)
        if spec.frozen == "all" or (spec.frozen == "router" and router) or (
                spec.frozen == "experts" and not router and not name.startswith("s_")):
            p.requires_grad_(False)


def run_step(fn: Callable[..., Any], layer: torch.nn.Module, x: torch.Tensor, spec: Spec) -> dict[str, torch.Tensor]:
    """Outputs (``out0``, ...) and, with a backward, the gradients (``grad:<param>``, ``grad:x``) of one step of
    ``fn`` (``layer`` or its compiled form) on ``x``, the loss a fixed random projection of the outputs."""
    layer.train(spec.mode == "train")
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(spec.x_grad and spec.backward)
    with contextlib.nullcontext() if spec.backward else torch.no_grad():
        out = fn(x)
    outs = out if isinstance(out, tuple) else (out,)
    tensors = {f"out{i}": o.detach().clone() for i, o in enumerate(outs)}
    if spec.backward:
        gen = torch.Generator().manual_seed(spec.seed + 2)
        cots = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in outs]
        loss = sum((o.to(c.dtype) * c).sum() for o, c in zip(outs, cots))
        if loss.requires_grad:
            loss.backward()
        for name, p in layer.named_parameters():
            if p.grad is not None:
                tensors[f"grad:{name}"] = p.grad.detach().clone()
        if x.grad is not None:
            tensors["grad:x"] = x.grad.detach().clone()
    layer.zero_grad(set_to_none=True)
    return tensors


# ---- compiling -----------------------------------------------------------------------------------------------


def _eager_inner(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
    """Inductor's inner compile replaced: the partitioned ATen graph, run by its own Python code."""
    from torch._functorch.aot_autograd import make_boxed_func

    return make_boxed_func(gm.forward)


def _plain_passes_backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
    """``"passes"`` mode's compile without moe_compile: Inductor's pipeline, eager kernels, no custom passes."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, inner_compile=_eager_inner)


@contextlib.contextmanager
def _mode(backend: str, validate: bool) -> Iterator[None]:
    """Caches off (every pass runs; no cached code stands in); translation validation on or off; in ``"passes"``,
    Inductor's codegen replaced."""
    from torch._inductor.compile_fx import compile_fx

    with contextlib.ExitStack() as stack:
        stack.enter_context(torch._inductor.config.patch(force_disable_caches=True))
        # translation validation as the spec says (the test suite turns it on for every compile; users have it off)
        stack.enter_context(unittest.mock.patch.dict(os.environ, {"MOE_COMPILE_VALIDATE_ALL": str(int(validate))}))
        if backend == "passes":
            import moe_compile.backend

            stack.enter_context(unittest.mock.patch.object(
                moe_compile.backend, "compile_fx", functools.partial(compile_fx, inner_compile=_eager_inner)))
        yield


def compile_layer(layer: torch.nn.Module, spec: Spec, backend: str, *, moe: bool) -> Callable[..., Any]:
    """``layer`` compiled by the spec's entry, with moe_compile (``moe``) or without its passes."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    import moe_compile
    from moe_compile.api import CAPTURE_FLAGS

    plain = _plain_passes_backend if backend == "passes" else "inductor"
    dynamic = True if spec.dynamic else None
    if spec.entry == "moe_compile":
        if moe:
            return moe_compile.compile(layer, dynamic=dynamic)
        compiled = torch.compile(layer, backend=plain, dynamic=dynamic)
        flags = dict(CAPTURE_FLAGS)

        def call(*args: Any) -> Any:
            # as moe_compile.compile does (NOTE [capture fallback] (moe_compile/api.py)): a loop over
            # data-dependent values cannot be traced with the host reads captured; then trace without them
            try:
                with torch._dynamo.config.patch(**flags):
                    return compiled(*args)
            except GuardOnDataDependentSymNode:
                if not flags:
                    raise
                flags.clear()
                return compiled(*args)

        return call
    return torch.compile(layer, backend="moe_compile" if moe else plain, fullgraph=spec.entry == "fullgraph",
                         dynamic=dynamic)


def _compiled_step(layer: torch.nn.Module, spec: Spec, backend: str, *, moe: bool
                   ) -> tuple[dict[str, torch.Tensor] | None, str | None]:
    torch._dynamo.reset()
    try:
        with _mode(backend, spec.validate):
            fn = compile_layer(layer, spec, backend, moe=moe)
            return run_calls(fn, layer, spec, DTYPES[spec.dtype]), None
    except Exception as exc:  # noqa: BLE001 - a compile failure is a finding, reported with its message
        return None, _first_line(exc)
    finally:
        torch._dynamo.reset()
