"""``moe_compile.compile``: torch.compile with the moe_compile backend and MoE-friendly capture."""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import logging
import warnings
import weakref
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from moe_compile import fallbacks, report
from moe_compile import metrics as router_metrics
from moe_compile.backend import ConfiguredBackend
from moe_compile.config import CAPTURE_FLAGS, make_config
from moe_compile.experts.discovery import find_expert_layers
from moe_compile.experts.expert_parallel import use_hf_expert_parallel
from moe_compile.experts.hub_kernels import unwrap_idle_kernel_wrappers
from moe_compile.experts.interface import is_hf_experts, use_fused_hf_experts
from moe_compile.experts.swap import swap_expert_loops as swap_loops
from moe_compile.options import check_compile_call, torch_compile_keywords

log = logging.getLogger(__name__)

# The keywords from ``metrics`` to ``validate`` are config.OPTIONS, with their defaults, and their Args entries
# begin with the rows' docs (tests/test_api.py checks both).
def compile(  # noqa: A001 - mirrors torch.compile
    model: Any,
    *,
    metrics: bool = False,
    passes: dict[str, bool] | None = None,
    debug: bool = False,
    strict: bool = False,
    deterministic: bool = False,
    validate: bool = True,
    ep_capacity_factor: float | None = None,
    capture_host_syncs: bool = True,
    swap_expert_loops: bool = True,
    **torch_compile_kwargs: Any,
) -> Any:
    """``torch.compile(model, backend=moe_compile)`` with MoE-friendly Dynamo settings.

    When to use it: the model reads expert counts on the host (``counts.tolist()``, ``.item()``,
    ``torch.split`` by counts, ``masked_select`` / ``nonzero`` permutes) and you do not pass
    ``fullgraph=True``. Dynamo then graph-breaks at the host read by default, the padding region runs
    eagerly, and no pass can make it static or CUDA-graph safe. This wrapper turns on
    ``capture_scalar_outputs`` and ``capture_dynamic_output_shape_ops`` around every call, so the
    first trace and every recompile (new shapes, grad mode) capture the region, and
    ``strip_host_padding`` / ``fuse_expert_loop`` can rewrite it. With ``fullgraph=True`` Dynamo turns
    both flags on itself and ``torch.compile(model, backend="moe_compile", fullgraph=True)`` is
    equivalent. Models without host reads lose nothing either way.

    The flags are patched only while a call runs (``torch._dynamo.config`` is unchanged afterwards).
    Dynamo reads them when it traces: code that was already traced without them in this process
    (e.g. the same model class compiled by a plain ``torch.compile`` earlier) can keep its cached,
    graph-broken entry until ``torch._dynamo.reset()``.

    Args:
        model: an ``nn.Module`` or a function.
        metrics: insert on-device router metrics; read them with ``moe_compile.metrics.collect()``.
        passes: ``{pass_name: bool}`` turns single passes on or off (names in ``moe_compile.passes.PASSES``);
            a pass that needs an option (metrics, deterministic) runs only with it on, whatever passes says.
        debug: device-side asserts in the dispatch kernels (expert ids in range).
        strict: a pass that raises, or a rewrite Inductor cannot compile, fails the compile instead of falling back to
            plain Inductor.
        deterministic: no atomic accumulation in the generated code anywhere in the graph; every
            accumulating scatter that ``deterministic_accumulate`` leaves (the token embedding's backward
            included) becomes a sort + fixed-order segment sum (``moe.segment_sum``). Library kernels that
            are non-deterministic themselves (attention backward on CUDA) are not changed; ``explain``
            lists them (``nondeterministic``).
        validate: translation validation: each pass's rewrites of a graph are kept only if the graph after them
            gives the outputs and gradients of the graph before them on real-shaped inputs (passes/_validate.py);
            a verdict is cached per graph and pass versions, so a recompile or a warm cache pays nothing; False
            opts out (benchmarks/results/validation_cost_*.json: its share of the first compiled step).
            A rewrite that fails is refused (``validation_failed`` in ``explain``) and the graph compiles without it.
        ep_capacity_factor: expert parallelism (the expert_parallel pass): rows each rank sends to one rank, as a
            multiple of an even share N/W of its N routed rows; None: the worst case, no row dropped; a float f:
            ceil(f*N/W) rows, the rows past it in each destination's block dropped (their expert outputs are zero).
        capture_host_syncs: trace with ``capture_scalar_outputs`` and
            ``capture_dynamic_output_shape_ops`` on (the default).
        swap_expert_loops: for a module, first route expert loops that Dynamo cannot capture through the
            fused ops (in place, parameters and ``state_dict`` unchanged): transformers experts set to
            ``"eager"`` (or unset) are set to the ``"moe_compile"`` experts implementation, and blocks that
            loop over an ``nn.ModuleList`` (or stacked weights) of experts get a fused forward
            (``moe_compile/experts/swap.py``). ``explain`` lists what was swapped and what was left, with reasons.
            Without CUDA graphs the per-expert gradient views of swapped ModuleList blocks are recycled from
            step to step, and each call first frees the gradient memory that ``zero_grad`` let go of
            (NOTE [recycled gradient views] (moe_compile/experts/_grad_views.py)).
        **torch_compile_kwargs: ``mode``, ``options``, ``dynamic``, ``fullgraph``, ... as for
            ``torch.compile`` (``backend`` is set here and rejected).

    What the passes did is kept for the model this returns: ``moe_compile.last_report()`` after a call gives the report
    of every graph compiled for it so far, as ``explain`` would print it, without compiling again.

    Returns:
        For a module, the ``OptimizedModule`` from ``torch.compile`` whose ``forward`` runs under the
        capture flags (``compiled._orig_mod`` is ``model``); for a function, a wrapper of the compiled
        function that does the same.

    Raises:
        TypeError: a keyword that is neither an option here nor ``torch.compile``'s (with the closest names), or an
            option value of the wrong type.
        ValueError: ``backend=`` given, unknown pass names, ``options=`` keys that are no Inductor config, or a
            ``"moe."`` key in ``options=`` (give those as keywords here).
    """
    if "backend" in torch_compile_kwargs:
        raise ValueError("moe_compile.compile sets backend= itself; call torch.compile for another backend")
    check_compile_call({"passes": passes, **torch_compile_kwargs}, _keywords(), where="moe_compile.compile()")
    config = make_config(metrics=metrics, passes=passes or {}, debug=debug, strict=strict, deterministic=deterministic,
                         validate=validate, ep_capacity_factor=ep_capacity_factor)
    compiled_report = report.Report()
    backend = ConfiguredBackend(config, compiled_report)  # checks the pass names before the model is touched
    _remember(model, compiled_report)
    swapped: list[Any] = []
    if isinstance(model, torch.nn.Module):
        unwrapped = unwrap_idle_kernel_wrappers(model)
        if unwrapped:
            log.info("original forward restored on %d module(s) wrapped by kernels' use_kernelized_func, which "
                     "Dynamo cannot trace under activation checkpointing: %s", len(unwrapped), ", ".join(unwrapped))
    if swap_expert_loops and isinstance(model, torch.nn.Module):
        prepare_expert_loops(model, ep_capacity_factor)
        swapped = _recycle_expert_gradients(model, not _uses_cuda_graphs(torch_compile_kwargs))
    if metrics and isinstance(model, torch.nn.Module):
        # hooks cover frames Dynamo runs eagerly and checkpointed blocks; the pass never counts a layer twice
        router_metrics.attach(model)
    compiled = torch.compile(model, backend=backend, **torch_compile_kwargs)
    if not (capture_host_syncs or swapped):
        return compiled
    return _wrap_calls(compiled, capture_host_syncs, swapped)


# (a weak reference to the model or function, or None; its report): the most recent ``moe_compile.compile``
_LATEST: tuple[Any, report.Report] | None = None


def _remember(model: Any, compiled_report: report.Report) -> None:
    global _LATEST
    try:
        ref = weakref.ref(model)
    except TypeError:
        ref = None
    _LATEST = (ref, compiled_report)


def last_report() -> report.Report:
    """The report of the model (or function) most recently given to ``moe_compile.compile``: what each pass did in
    every graph compiled for it so far (forward, backward, recompiles), with its experts layers accounted for as
    ``explain`` does (a skip with its reason for each one no record accounts for). Nothing is compiled again: call
    the compiled model first (and its backward, for the backward graph's records), then print this.

    Unlike ``explain``, the caches stay on: a graph that Inductor's caches served ran no pass, and the report says it
    is incomplete (:attr:`Report.cached_graphs`). Each call returns a new :class:`Report` (a copy); before any
    ``moe_compile.compile`` call, or before the compiled model's first call, it has no records and 0 graphs (and
    prints as such, with the hint to call the model first: torch.compile compiles at the first call), not a
    ``not_in_graph`` skip for each experts layer, which would send the reader after a graph break.
    """
    if _LATEST is None:
        return report.Report()
    ref, compiled_report = _LATEST
    rep = compiled_report.copy()
    model = ref() if ref is not None else None
    if isinstance(model, torch.nn.Module) and (rep.graphs or rep.cached_graphs):
        account_expert_layers(model, rep)
    return rep


@functools.cache
def _keywords() -> frozenset[str]:
    """``compile``'s own keywords (its options, ``capture_host_syncs``, ``swap_expert_loops``)."""
    params = inspect.signature(compile).parameters
    return frozenset(name for name, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY)


def prepare_expert_loops(model: torch.nn.Module, ep_capacity_factor: float | None = None) -> list[report.PassRecord]:
    """Route ``model``'s uncapturable expert loops through the fused ops (see ``compile``); returns the records.

    Idempotent: already swapped modules are not swapped again. The records are kept for ``explain``.
    """
    # transformers' expert-parallel experts first: the experts interface skips them
    found = [("experts_impl", *r) for r in use_hf_expert_parallel(model, ep_capacity_factor)]
    found += [("experts_impl", *r) for r in use_fused_hf_experts(model)]
    found += [("swap_expert_loops", *r) for r in swap_loops(model, ep_capacity_factor)]
    records = [report.PassRecord(name, "module", kind, layer, what, detail)
               for name, layer, kind, what, detail in found]
    for r in records:  # as the graph passes log theirs (TORCH_LOGS="moe_compile"): what was swapped, what was declined
        if r.kind == "rewrite":
            log.info("[%s] %s: swapped (%s) %s", r.pass_name, r.layer, r.what, r.detail)
        else:
            log.info("[%s] %s: declined (%s) %s", r.pass_name, r.layer, r.what, r.detail)
    report.add_module_records(model, records)
    return records


def _uses_cuda_graphs(torch_compile_kwargs: dict[str, Any]) -> bool:
    """Whether ``torch.compile(**torch_compile_kwargs)`` records CUDA graphs (``mode`` or ``options``)."""
    mode = torch_compile_kwargs.get("mode")
    options = torch._inductor.list_mode_options(mode) if mode else {}
    options = {**options, **(torch_compile_kwargs.get("options") or {})}
    return bool(options.get("triton.cudagraphs", torch._inductor.config.triton.cudagraphs))


def _recycle_expert_gradients(model: torch.nn.Module, on: bool) -> list[Any]:
    """Turn NOTE [recycled gradient views] (moe_compile/experts/_grad_views.py) on or off for ``model``'s swapped
    ModuleList blocks; returns their grouped views, whose gradient memory every call of the compiled model releases."""
    grouped = [m._moe_compile_views for m in model.modules() if getattr(m, "_moe_compile_views", None) is not None]
    for views in grouped:
        views.recycle_gradients(on)
    return grouped if on else []


def _wrap_calls(compiled: Any, capture_flags: bool, swapped: list[Any]) -> Any:
    """Each call of ``compiled`` first releases the swapped blocks' recycled gradient memory that the
    parameters let go of (``zero_grad``), then runs under the capture flags if ``capture_flags``."""
    call = compiled.forward if isinstance(compiled, torch.nn.Module) else compiled

    config = torch._dynamo.config
    flags = dict(CAPTURE_FLAGS) if capture_flags else {}

    @functools.wraps(call)
    def run(*args: Any, **kwargs: Any) -> Any:
        for views in swapped:
            views.release_gradients()
        # set and restore by hand: `config.patch` costs ~4x more per call, paid on every step
        saved = {name: getattr(config, name) for name in flags}
        for name, value in flags.items():
            setattr(config, name, value)
        try:
            return call(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - only a data-dependent guard is handled; anything else re-raised
            guard = _guard_on_data(exc)
            if not flags or guard is None:
                raise
            # NOTE [capture fallback]: a loop over data-dependent values that nothing swapped (``for e in
            # nonzero(...).tolist()``) cannot be traced with the host reads captured; without the flags Dynamo
            # graph-breaks there and runs it, as plain torch.compile does
            warnings.warn(f"moe_compile.compile: tracing with the host reads captured failed "
                          f"({str(guard).strip().splitlines()[0]}); this model now runs with Dynamo's default flags, "
                          "graph-breaking at host reads", stacklevel=2)
            flags.clear()
            for name, value in saved.items():
                setattr(config, name, value)
            return call(*args, **kwargs)
        finally:
            for name, value in saved.items():
                setattr(config, name, value)

    if isinstance(compiled, torch.nn.Module):
        compiled.forward = run
        return compiled
    return run


def _guard_on_data(exc: BaseException) -> GuardOnDataDependentSymNode | None:
    """``exc``, or what caused it, where that is a guard on a data-dependent value: raised by Dynamo while tracing, or
    inside the backend (AOTAutograd tracing ``one_hot(ids, num_classes=capacity)`` with a capacity read on the host,
    DeepSpeed's ``top1gating``), which Dynamo wraps in ``BackendCompilerFailed``."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, GuardOnDataDependentSymNode):
            return exc
        seen.add(id(exc))
        exc = getattr(exc, "inner_exception", None) or exc.__cause__ or exc.__context__
    return None


def _check_inputs_are_no_options(model: Any, kwargs: dict[str, Any]) -> None:
    """``explain(model, x, deterministic=True)``: a compile option given as an input of the model (which its forward
    does not take) raises TypeError saying to pass it in ``compile_options``, before anything is copied or compiled."""
    options = [name for name in kwargs if name in _keywords() or name in torch_compile_keywords()]
    if not options:
        return
    try:
        params = inspect.signature(model.forward if isinstance(model, torch.nn.Module) else model).parameters
    except (TypeError, ValueError):  # no signature to read: the call will say
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    for name in options:
        if name not in params:
            raise TypeError(f"explain(): {name!r} is a compile option, not an input of the model: pass it as "
                            f"compile_options={{{name!r}: ...}}")


def explain(model: Any, *args: Any, backward: bool | None = None, compile_options: dict[str, Any] | None = None,
            **kwargs: Any) -> report.Report:
    """Compile a copy of ``model`` with moe_compile, run it on ``args``/``kwargs``, and report what each pass did.

    Runs one forward (and one backward if the output requires grad, unless ``backward=False``) so that
    both the forward and the joint graph are compiled. ``model`` is not modified: a module is explained on a deep
    copy (``copy.deepcopy``: a second copy of its parameters in memory while explain runs), so its ``forward``, its
    modules, its ``state_dict`` and its ``.grad`` fields are what they were; the expert-loop swap of
    ``moe_compile.compile`` happens on the copy only. A module that cannot be deep-copied is explained in place, with
    a warning saying so (its expert loops are then swapped as ``moe_compile.compile`` swaps them; ``.grad`` is
    restored). Caches are bypassed, so every pass runs; Dynamo's caches are reset before and after
    (``torch._dynamo.reset()``). ``moe_compile.last_report()`` is left as it was. Every experts layer of ``model``
    that no record accounts for gets a skip with its reason (``not_in_graph``, ``dispatch_form_unknown``); no such
    skip is given to a layer that a pass rewrote.
    ``compile_options`` are keywords of ``moe_compile.compile`` (``{"deterministic": True}``: what is left
    with the option on; :attr:`Report.nondeterministic` lists the sources per layer), checked before anything runs:
    an unknown keyword raises TypeError naming ``compile_options`` and the closest name.
    Returns a :class:`Report`: ``print(report)`` shows a table with a legend of its results, ``report.to_dict()`` a
    dict. To see what an actual compile did without compiling twice, use ``moe_compile.last_report()`` instead.
    """
    global _LATEST
    check_compile_call(compile_options or {}, _keywords(), where="explain(compile_options=...)")
    _check_inputs_are_no_options(model, kwargs)
    params = list(model.parameters()) if isinstance(model, torch.nn.Module) else []
    saved_grads = [p.grad for p in params]
    latest = _LATEST
    target = model
    try:
        for p in params:  # not copied, and the backward below would add into the saved .grad tensors in place
            p.grad = None
        if isinstance(model, torch.nn.Module):
            try:
                target = copy.deepcopy(model)
            except Exception as exc:  # noqa: BLE001 - any model that cannot be copied is explained in place
                warnings.warn(f"moe_compile.explain: the model could not be copied ({type(exc).__name__}: {exc}); "
                              "explaining it in place, which swaps its expert loops as moe_compile.compile does",
                              stacklevel=2)
        torch._dynamo.reset()
        compiled = compile(target, **(compile_options or {}))
        with report.collecting() as rep, torch._inductor.config.patch(force_disable_caches=True), \
                warnings.catch_warnings():
            # the caches are off on purpose (every pass must run); PGO warns that it is off with them
            warnings.filterwarnings("ignore", message="dynamo_pgo force disabled", category=UserWarning)
            out = compiled(*args, **kwargs)
            if hasattr(out, "to_tuple"):  # transformers ModelOutput
                out = out.to_tuple()
            tensors = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            grads = [t for t in tensors if t.requires_grad and t.is_floating_point()]
            if grads and backward is not False:
                sum(t.float().square().mean() for t in grads).backward()
    finally:
        for p, g in zip(params, saved_grads):
            p.grad = g
        _LATEST = latest
        torch._dynamo.reset()
        fallbacks.install()  # the reset cleared Dynamo's callbacks (NOTE [loud fallbacks] (moe_compile/fallbacks.py))
    if isinstance(target, torch.nn.Module):
        # the loop swaps of an earlier moe_compile.compile(model) are recorded on model; the copy's on target
        own = report.module_records(target)
        account_expert_layers(target, rep, [*[r for r in report.module_records(model) if r not in own], *own])
    return rep


def account_expert_layers(model: torch.nn.Module, rep: report.Report,
                          module_records: list[report.PassRecord] | None = None) -> dict[str, str]:
    """Put ``model``'s module-level records (``moe_compile.compile``'s loop swaps, or ``module_records``), the model's
    experts layers (:attr:`Report.expert_layers`) and a skip for every experts layer no record accounts for
    (:func:`_unaccounted_expert_layers`) into ``rep``, as ``explain`` does; a record made outside any module
    (``<graph>``) in a graph that holds one experts layer is named by that layer first (:func:`_name_unnamed`).
    Returns each experts layer's outcome: ``"rewritten"``, or its skip and error tags (``"not_in_graph"``, ...) joined
    by ``", "``."""
    layers = find_expert_layers(model)
    rep.records[:0] = report.module_records(model) if module_records is None else module_records
    rep.expert_layers = [layer.name for layer in layers]
    _name_unnamed(layers, rep)
    rep.records += _unaccounted_expert_layers(model, rep)
    outcomes = {}
    for layer in layers:
        mine = [r for r in rep.records if _same_module(layer.name, r.layer)]
        if any(r.kind == "rewrite" and r.moe for r in mine):
            outcomes[layer.name] = "rewritten"
        else:
            outcomes[layer.name] = ", ".join(sorted({r.what for r in mine if r.kind in ("skip", "error")}))
    return outcomes


def _name_unnamed(layers: list[Any], rep: report.Report) -> None:
    """Name by its experts layer each MoE rewrite, ``unchecked`` or skip recorded at ``<graph>`` in a compiled graph
    (``PassRecord.graph``) that holds exactly one experts layer of the model. Its nodes carry no module path: an MoE
    block compiled as the model itself (Dynamo's frame), whose routing and dispatch are its own code, in no
    submodule; only its experts (``experts.0.up``, ...) carry one. With several experts layers in the graph the record
    stays ``<graph>``."""
    for i, r in enumerate(rep.records):
        if r.layer != "<graph>" or not r.graph or r.kind not in ("rewrite", "unchecked", "skip") \
                or (r.kind == "rewrite" and not r.moe):
            continue
        seen = rep.compile_layers.get(r.graph, set())
        hits = [layer.name for layer in layers if any(_inside(layer.name, path) for path in seen)]
        if len(hits) == 1:
            rep.records[i] = dataclasses.replace(r, layer=hits[0])


def _unaccounted_expert_layers(model: torch.nn.Module, rep: report.Report) -> list[report.PassRecord]:
    """A skip for every experts layer of ``model`` (``find_expert_layers``) that no rewrite, skip or error accounts
    for (at its path, inside it or around it: :func:`_same_module`): ``not_in_graph`` when no compiled graph
    contained it, else ``dispatch_form_unknown`` (no pass recognised its dispatch); the detail says what the layer
    looks like."""
    accounted = {r.layer for r in rep.records if r.kind in ("skip", "error") or (r.kind == "rewrite" and r.moe)}
    # the swap names the model itself "<root>" (a block that is the whole model): swapped, it holds every layer
    root = any(r.pass_name == "swap_expert_loops" and r.layer == "<root>" and r.kind == "rewrite" for r in rep.records)
    records = []
    for layer in find_expert_layers(model):
        if root or any(_same_module(layer.name, seen) for seen in accounted):
            continue
        if any(_inside(layer.name, seen) for seen in rep.graph_layers):
            tag, why = "dispatch_form_unknown", "is in a compiled graph, but no pass recognised its dispatch"
        else:
            hint = "transformers: set_experts_implementation('grouped_mm')" if is_hf_experts(layer.module) else \
                "swap_expert_loops reads no such layout: it takes stacked [E, N, K] weights, flat [E*I, H] ones or " \
                "a ModuleList of experts"
            tag, why = "not_in_graph", ("is in no compiled graph (graph break, or an eager per-expert loop that Dynamo "
                                        f"does not capture; {hint})")
        records.append(report.PassRecord("explain", "-", "skip", layer.name, tag, f"{layer.seen} {why}"))
    return records


# record paths against module names (moe_compile/report.py, where the summary counts layers by them too)
_inside = report.inside
_same_module = report.same_module
