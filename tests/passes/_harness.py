"""One harness for pass tests: compile, compare with eager (outputs and grads), read our report.

``check_rewrite(fn, args, expected_rewrites, ...)`` compiles ``fn`` with a fresh cache, runs it (and a
backward when ``train``), compares with eager PyTorch within the layer's derived bound (``tests/_tolerance.py``),
asserts the number of rewrites / skips per pass from moe_compile's report (never Inductor's global counters), and
returns a :class:`Run` with the report and, for the Inductor backend, the generated code.

Backends:
    ``"moe_compile"``: the real backend (Inductor codegen; slow on CPU, ~5-20 s per HF model).
    ``"passes+aot_eager"``: moe_compile's pre-grad passes on the Dynamo graph, then AOTAutograd with
    eager kernels. The rewrite and our ops' autograd are exercised exactly as under Inductor (the
    passes run before AOTAutograd either way) at a fraction of the compile time.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from moe_compile import report as report_mod
from moe_compile.config import MoECompileConfig
from moe_compile.passes._judge import Outputs, judge
from tests import _tolerance as tol


def fresh_cache():
    """A fresh Inductor cache (match counts read 0 on a cache hit: the passes do not run)."""
    utils = torch._inductor.utils
    fn = getattr(utils, "fresh_cache", None) or utils.fresh_inductor_cache
    return fn()


def passes_then_aot_eager(config: MoECompileConfig | None = None) -> Callable[..., Any]:
    """A Dynamo backend: moe_compile's pre-grad passes, then AOTAutograd with eager kernels."""
    from torch._dynamo.backends.debugging import aot_eager

    from moe_compile.passes import StagePass
    from moe_compile.passes._validate import compiling

    stage = StagePass("pre_grad", config or MoECompileConfig())

    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        with compiling(example_inputs):  # the real inputs translation validation runs on, as the backend gives
            stage(gm.graph)
        gm.recompile()
        return aot_eager(gm, example_inputs)

    return backend


@dataclasses.dataclass
class Run:
    out: Any
    grads: list[torch.Tensor | None]
    report: report_mod.Report
    code: list[str]


def _float_leaves(out: Any) -> list[torch.Tensor]:
    leaves = torch.utils._pytree.tree_leaves(out if not hasattr(out, "to_tuple") else out.to_tuple())
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]


def default_loss(out: Any) -> torch.Tensor:
    """``sum(mean(o.float()**2))`` over float outputs (no stride-0 grads: CPU grouped_mm rejects them)."""
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    return sum(t.float().pow(2).mean() for t in _float_leaves(out))


def _grad_inputs(fn: Any, args: Sequence[Any]) -> list[torch.Tensor]:
    params = list(fn.parameters()) if isinstance(fn, torch.nn.Module) else []
    return params + [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]


def run_once(fn: Any, args: Sequence[Any], kwargs: dict[str, Any] | None = None, *, train: bool = False,
             loss_fn: Callable[[Any], torch.Tensor] = default_loss) -> tuple[Any, list[torch.Tensor | None]]:
    kwargs = kwargs or {}
    targets = _grad_inputs(fn, args) if train else []
    for t in targets:
        t.grad = None
    if train:
        out = fn(*args, **kwargs)
        loss_fn(out).backward()
    else:
        with torch.no_grad():
            out = fn(*args, **kwargs)
    grads = [None if t.grad is None else t.grad.clone() for t in targets]
    for t in targets:
        t.grad = None
    return out, grads


def compile_and_run(fn: Any, args: Sequence[Any], kwargs: dict[str, Any] | None = None, *,
                    backend: str = "passes+aot_eager", dynamic: bool | None = None, train: bool = False,
                    get_code: bool = False, fullgraph: bool = False, config: MoECompileConfig | None = None,
                    loss_fn: Callable[[Any], torch.Tensor] = default_loss) -> Run:
    torch._dynamo.reset()
    compiled_backend: Any = passes_then_aot_eager(config) if backend == "passes+aot_eager" else backend
    compiled = torch.compile(fn, backend=compiled_backend, dynamic=dynamic, fullgraph=fullgraph)
    code: list[str] = []
    with fresh_cache(), report_mod.collecting() as rep:
        if get_code:
            from torch._inductor.utils import run_and_get_code

            result: dict[str, Any] = {}

            def step() -> None:
                result["r"] = run_once(compiled, args, kwargs, train=train, loss_fn=loss_fn)

            _, code = run_and_get_code(step)
            out, grads = result["r"]
        else:
            out, grads = run_once(compiled, args, kwargs, train=train, loss_fn=loss_fn)
    torch._dynamo.reset()
    return Run(out, grads, rep, code)


def _rows(args: Sequence[Any], kwargs: dict[str, Any] | None) -> int:
    """Tokens in the inputs (the reduction length of every weight gradient)."""
    rows = 1
    for a in [*args, *(kwargs or {}).values()]:
        if isinstance(a, torch.Tensor) and a.dim():
            rows = max(rows, a.numel() // a.shape[-1] if a.is_floating_point() else a.numel())
    return rows


def layer_k_dims(fn: Any, args: Sequence[Any]) -> list[int]:
    """The GEMM reduction lengths of ``fn``: from its parameters, or from the weight-like tensor arguments
    (2-D and up, after the first) of a plain function."""
    weights = list(fn.parameters()) if isinstance(fn, torch.nn.Module) else []
    weights += [a for a in args[1:] if isinstance(a, torch.Tensor) and a.dim() >= 2]
    return tol.gemm_k_dims(weights) or [args[0].shape[-1]]


def assert_matches_eager(run: Run, fn: Any, args: Sequence[Any], kwargs: dict[str, Any] | None = None, *,
                         train: bool = False, loss_fn: Callable[[Any], torch.Tensor] = default_loss,
                         eager: tuple[Any, list[torch.Tensor | None]] | None = None,
                         tol_dtype: torch.dtype | None = None) -> None:
    """Outputs and grads within the derived layer bound (``tests/_tolerance.py::layer_rel``: the GEMM K dims
    of ``fn``'s weights, the roundings in ``tol_dtype``, the compute dtype; default: each tensor's)."""
    ref_out, ref_grads = eager or run_once(fn, args, kwargs, train=train, loss_fn=loss_fn)
    outs, refs = _float_leaves(run.out), _float_leaves(ref_out)
    assert len(outs) == len(refs), f"{len(outs)} compiled outputs vs {len(refs)} eager"
    for i, (a, e) in enumerate(zip(outs, refs)):
        assert a.shape == e.shape and a.dtype == e.dtype, f"output {i}: {a.shape} {a.dtype} vs {e.shape} {e.dtype}"
    assert len(run.grads) == len(ref_grads)
    for i, (g, r) in enumerate(zip(run.grads, ref_grads)):
        assert (g is None) == (r is None), f"grad {i}: compiled {'None' if g is None else 'set'} vs eager"
    low = any(t.dtype in (torch.bfloat16, torch.float16) for t in [*refs, *(g for g in ref_grads if g is not None)])
    # 16-bit layers: tensor by tensor, against eager's own distance from a float32 run (the layer bound grows with
    # the weights and lets a 4% combine error through); float32 layers keep the layer bound, 1e-5 of a tensor
    wide = wide_reference(fn, args, kwargs, train=train, loss_fn=loss_fn) if low else None
    if wide is not None:
        got = _named(outs, run.grads)
        verdict = judge(got, _named(refs, ref_grads), lambda: Outputs(_named(*wide)))
        assert verdict.ok, f"compiled vs eager, judged against a {wide[0][0].dtype} run: {verdict}"
        return
    # no wider run (an op without a kernel in the wider dtype): the derived layer bound
    k_dims, rows = layer_k_dims(fn, args), _rows(args, kwargs)
    for i, (a, e) in enumerate(zip(outs, refs)):
        tol.assert_layer_close(a, e, k_dims, tol_dtype or e.dtype, what=f"output {i}")
    for i, (g, r) in enumerate(zip(run.grads, ref_grads)):
        if r is not None:
            tol.assert_layer_close(g, r, k_dims, tol_dtype or r.dtype, backward=True, rows=rows,
                                   what=f"grad {i} {tuple(r.shape)}")


def _named(outs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> dict[str, torch.Tensor]:
    named = {f"output {i}": t.detach() for i, t in enumerate(outs)}
    named.update({f"grad {i}": g for i, g in enumerate(grads) if g is not None})
    return named


def wide_reference(fn: Any, args: Sequence[Any], kwargs: dict[str, Any] | None = None, *, train: bool = False,
                   loss_fn: Callable[[Any], torch.Tensor] = default_loss
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]] | None:
    """``fn`` run in a wider precision (float32 where it holds 16-bit floats, else float64) on the same values:
    its float outputs and gradients, or None where it cannot run so (a kernel without the wider dtype)."""
    kwargs = kwargs or {}
    tensors = [*(fn.parameters() if isinstance(fn, torch.nn.Module) else ()), *args, *kwargs.values()]
    floats = {t.dtype for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()}
    to = torch.float32 if floats & {torch.bfloat16, torch.float16} else torch.float64

    def widen(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.detach().to(to).requires_grad_(t.requires_grad)
        return t

    wide_fn = copy.deepcopy(fn).to(to) if isinstance(fn, torch.nn.Module) else fn
    try:
        out, grads = run_once(wide_fn, [widen(a) for a in args], {k: widen(v) for k, v in kwargs.items()},
                              train=train, loss_fn=loss_fn)
    except (RuntimeError, NotImplementedError, ValueError, TypeError):
        return None
    return _float_leaves(out), grads


def assert_report(rep: report_mod.Report, rewrites: dict[str, int] | None = None,
                  skips: dict[str, list[str]] | None = None) -> None:
    """Exact rewrite counts per pass, and the reason tags of skips per pass (sorted)."""
    assert not rep.errors, f"pass errors: {rep.errors}"
    for name, n in (rewrites or {}).items():
        assert rep.count(name) == n, f"{name}: {rep.count(name)} rewrites, expected {n}\n{rep.table()}"
    for name, reasons in (skips or {}).items():
        got = sorted(r.what for r in rep.skips if r.pass_name == name)
        assert got == sorted(reasons), f"{name}: skips {got}, expected {sorted(reasons)}\n{rep.table()}"


def check_rewrite(fn: Any, args: Sequence[Any], expected_rewrites: dict[str, int], *,
                  expected_skips: dict[str, list[str]] | None = None, kwargs: dict[str, Any] | None = None,
                  backend: str = "passes+aot_eager", dynamic: bool | None = None, train: bool = True,
                  code_checks: Sequence[Callable[[str], None]] = (), fullgraph: bool = False,
                  loss_fn: Callable[[Any], torch.Tensor] = default_loss) -> Run:
    """Compile, compare with eager (forward and, with ``train``, grads), assert our report and the code."""
    eager = run_once(fn, args, kwargs, train=train, loss_fn=loss_fn)
    run = compile_and_run(fn, args, kwargs, backend=backend, dynamic=dynamic, train=train,
                          get_code=bool(code_checks), fullgraph=fullgraph, loss_fn=loss_fn)
    assert_report(run.report, expected_rewrites, expected_skips)
    assert_matches_eager(run, fn, args, kwargs, train=train, loss_fn=loss_fn, eager=eager)
    if code_checks:
        assert run.code, "no generated code captured"
        for check in code_checks:
            for code in run.code:
                check(code)
    return run


# An atomic add in generated code: Triton ``tl.atomic_add(``, C++ ``atomic_add(`` and ``atomic_add_vec<...>(``
# (Inductor's kernel metadata spells ``atomic_add_found``, which this does not match).
ATOMIC_ADD = re.compile(r"atomic_add(?:_vec)?\s*[<(]")


def accumulates(code: str) -> bool:
    """Whether generated code adds at computed indices: an atomic add or Inductor's CPU scatter-add fallback."""
    return ATOMIC_ADD.search(code) is not None or any(s in code for s in ("scatter_reduce", "index_put_("))


def no_accumulation(code: str) -> None:
    assert not accumulates(code), "accumulating scatter left in the generated code"


def no_scatter_add(code: str) -> None:
    """Generated code (forward or backward) holds no atomic add and no scatter-add / accumulate index_put."""
    from torch.testing import FileCheck

    assert ATOMIC_ADD.search(code) is None, "atomic add in the generated code"
    FileCheck().check_not("scatter_add").run(code)
    FileCheck().check_not("index_put").run(code)


@contextlib.contextmanager
def deterministic_seed(seed: int = 0):
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.random.set_rng_state(state)


def clone_module(module: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(module)


def metrics_over_calls(model: torch.nn.Module, xs: Sequence[torch.Tensor], *, per_layer: bool = False,
                       **config: Any) -> tuple[dict[str, float], Any]:
    """``(metrics.collect(per_layer), report)`` of ``model`` compiled with ``metrics=True`` (and ``config``, e.g.
    ``validate=True``) and called on each of ``xs``, from fresh metrics and a fresh Dynamo; both left fresh after."""
    from moe_compile import metrics
    from moe_compile.backend import ConfiguredBackend
    from moe_compile.config import make_config

    metrics.forget()
    torch._dynamo.reset()
    patches = {**metrics.inductor_patches(True), "force_disable_caches": True}
    try:
        with torch._inductor.config.patch(patches), report_mod.collecting() as rep:
            compiled = torch.compile(model, backend=ConfiguredBackend(make_config(metrics=True, **config)),
                                     fullgraph=True)
            for x in xs:
                compiled(x)
        return metrics.collect(per_layer=per_layer), rep
    finally:
        metrics.forget()
        torch._dynamo.reset()
