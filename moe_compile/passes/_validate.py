"""Translation validation: a pass keeps its rewrites of a graph only if the graph after them computes what the
graph before them computed.

NOTE [translation validation]:
Proofs of a match cover the forms we thought of; a rewrite that is wrong in a case nobody thought of (an index
assumed distinct that is not, a mode the rewrite did not consider, a backward that is not the textbook one)
passes them. So after each pass that rewrote something, :class:`StageValidator` runs the graph as it was at the
start of the stage (the *baseline*) and the graph as the pass left it on the same inputs, and compares every
output: forward outputs, and in training the gradients too (the pre-grad graph through autograd, with the same
random cotangents; the joint graph has them among its outputs).

* Inputs: the graph's own shapes on its device, from the real example inputs of the compile: parameters as they
  are, float activations replaced by random values of the same mean and spread, integer and boolean inputs
  (token ids, masks) and non-finite or mask-sized floats as they are. Expert ids come out of the graph's own
  router. Inputs the graph mutates are cloned, attributes too (``get_attr``), so validating changes no state.
* Every run starts from the same random seed (dropout, Gumbel sampling), inside ``fork_rng``.
* Integer and boolean outputs must be equal, and so must floats of a pass registered ``exact``. A float tensor
  exactly zero in the baseline must stay exactly zero, and non-finite elements must stay where they were. Other
  floats are judged against a reference run of the baseline in higher precision (float32 for a graph in
  16-bit floats, float64 otherwise; dtypes written in the graph are raised too): the rewritten graph's max
  error from the reference may be ``4 x`` the baseline's own plus one rounding ``u * max|reference|`` (the
  family matrix's bound, tests/models/hf_families.py). An op without a kernel in the raised precision (flash
  attention, grouped GEMMs in float32 on CUDA) runs in the graph's own precision inside the reference run.
  A tensor of fewer than ``SMALL_TENSOR`` elements (a loss, an auxiliary loss) gives one or a few samples of the
  baseline's error, which can be near zero by chance (a loss from bf16 logits, rewritten attention: 23x its
  baseline's error, at 2e-5 of the loss, on an H200; a bias gradient of one token, 5x): the baseline's error
  it is allowed is at least the graph's noise (the baseline's largest relative error over the tensors of at least
  ``SMALL_TENSOR`` elements) times its magnitude, and its rounding term that of the graph's lowest float precision
  (``u_low``, of the lowest-precision float output). In a graph of float32 (or wider) outputs every tensor gets
  the noise floor: a weight gradient summed over a few tokens can sit within a rounding of the reference by luck
  (0.6 ulp, where another order of the same five products is 4 ulps: fuzz finding A14), and the noise there is
  ~1e-7 relative. A wrong expert or a dropped term is off by its own magnitude, far past either.
  The max bound is set by the largest rounding, and a small systematic error (one top-k choice's weight 4% too
  large) hides under it. So a 16-bit tensor of at least ``SMALL_TENSOR`` elements is also judged by its
  root-mean-square error from the reference, which averages the rounding noise over every element: at most
  ``RMS_ERROR_FACTOR x`` the baseline's plus ``RMS_ROUNDING`` roundings of the reference's rms (correct rewrites
  reach 1.23x the baseline's rms error over the pass tests, 2.6x on one sampled composed form). Elementwise
  structural zeros are not judged here: attention rewrites leave 1e-8 where eager and the reference cancel to an
  exact zero at single elements (the tests judge them with plain Inductor's result beside).
  Where the reference cannot run at all, a float is judged against the baseline alone: max error
  ``sqrt(u) * max|baseline|``, loose enough for any reordering of sums and tight enough for a wrong expert or a
  dropped term.
* A graph that validation cannot run (collectives, which would talk to other ranks; an op that fails on real
  tensors; data-dependent sizes without real inputs) keeps the pass's rewrites, recorded as ``unchecked`` with
  the reason.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.utils._python_dispatch import _disable_current_modes, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten, tree_map

from moe_compile.passes._graph import aliased_inputs, op_name, val, written_args
from moe_compile.passes._judge import LOW_PRECISION, Compared, Outputs, Verdict, judge

# A float input whose magnitude passes this is an additive mask (finfo.min), not an activation: kept as it is.
MASK_MAGNITUDE = 1e4
SEED = 20261127


class Unavailable(Exception):
    """The graph cannot be run for validation: the rewrite is kept, recorded as unchecked with this reason."""


@dataclasses.dataclass(frozen=True)
class CompileInputs:
    """The real inputs of the graph being compiled, and the grad mode it is compiled under."""

    example_inputs: tuple[Any, ...]
    grad_enabled: bool


_CURRENT: contextvars.ContextVar[CompileInputs | None] = contextvars.ContextVar("moe_validate_inputs", default=None)


@contextlib.contextmanager
def compiling(example_inputs: Sequence[Any]) -> Iterator[None]:
    """Make ``example_inputs`` (the real tensors ``compile_fx`` gets) the inputs that validation runs on."""
    token = _CURRENT.set(CompileInputs(tuple(example_inputs), torch.is_grad_enabled()))
    try:
        yield
    finally:
        _CURRENT.reset(token)


# ------------------------------------------------------------------------------------------ running a graph


def _is_collective(node: fx.Node) -> bool:
    target = node.target
    # an OpOverload has a schema; an OpOverloadPacket (Dynamo records funcol calls as torch.ops._c10d_functional.X)
    # only its qualified name
    namespace = getattr(getattr(target, "_schema", None), "name", "") or getattr(target, "_qualified_op_name", "") \
        or ""
    module = getattr(target, "__module__", "") or ""
    return namespace.startswith(("_c10d_functional::", "c10d::", "_dtensor::")) or module.startswith(
        "torch.distributed")


def mutated_sources(graph: fx.Graph) -> set[fx.Node]:
    """Placeholders and ``get_attr`` nodes whose tensors ``graph`` writes to (through views too)."""
    found: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        todo = [a for a in written_args(node) if isinstance(a, fx.Node)]
        seen: set[fx.Node] = set()
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            if n.op in ("placeholder", "get_attr"):
                found.add(n)
            elif n.op in ("call_function", "call_method"):
                todo += aliased_inputs(n)
    return found


def _raise_dtype(x: Any, to: torch.dtype) -> Any:
    """A float dtype written in the graph, raised to ``to`` (16-bit ones to float32; every one to float64)."""
    if isinstance(x, torch.dtype) and x.is_floating_point and torch.finfo(x).bits < torch.finfo(to).bits:
        return to
    return x


# Dispatch ops run with their CPU references in validation's runs on CUDA: the same values (their kernels are
# tested against the references, bitwise), without compiling the Triton kernels of every shape and dtype a
# validation run meets (most of validation's time on the GPU: benchmarks/results/validation_cost_cuda.json). Moves
# of rows: a copy each way costs less than one kernel's compile.
# (names as passes/_graph.py's op_name spells them)
HOST_OPS = frozenset({"moe.permute_pad", "moe.permute_pad_backward", "moe.unpad_unpermute",
                      "moe.unpad_unpermute_backward", "moe.segment_sum", "moe.gather_segment_sum",
                      "moe.gather_rows"})
_TRITON_KERNEL = getattr(torch.ops.higher_order, "triton_kernel_wrapper_functional", None)

# ops with no float32 kernel on CUDA: the reference run takes them in the graph's own precision at once
_NO_FP32_ON_CUDA = frozenset({
    "aten._scaled_dot_product_cudnn_attention", "aten._scaled_dot_product_cudnn_attention_backward",
    "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_flash_attention_backward",
    "aten._grouped_mm", "_grouped_mm"})


def _no_raised_kernel(n: fx.Node) -> bool:
    return op_name(n) in _NO_FP32_ON_CUDA and any(isinstance(v := val(a), torch.Tensor) and v.is_cuda
                                                  for a in n.all_input_nodes)


class _Runner(fx.Interpreter):
    """Runs a graph on real tensors: mutated attributes cloned, and in a reference run every 16-bit dtype
    written in the graph raised to ``raise_to``."""

    _LOW_METHODS = ("bfloat16", "half", "float")

    def __init__(self, graph: fx.Graph, cloned: set[str], raise_to: torch.dtype | None) -> None:
        super().__init__(graph.owning_module or torch.nn.Module(), garbage_collect_values=True, graph=graph)
        self.cloned = cloned
        self.raise_to = raise_to

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        value = super().get_attr(target, args, kwargs)
        if isinstance(value, torch.Tensor):
            if target in self.cloned:
                value = value.clone()
            if self.raise_to is not None and value.is_floating_point():
                value = value.to(_raise_dtype(value.dtype, self.raise_to))
        return value

    def run_node(self, n: fx.Node) -> Any:
        if op_name(n) in HOST_OPS:
            return self._on_host(n)
        if self.raise_to is not None and (n.target is _TRITON_KERNEL or _no_raised_kernel(n)):
            # a kernel traced for its dtypes (another would compile again), or an op without a kernel in the raised
            # precision on CUDA: trying it first costs a failed launch (cuDNN attention: ~0.8 s each, H100)
            return self._own_precision(n)
        try:
            return super().run_node(n)
        except Exception:
            if self.raise_to is None or n.op not in ("call_function", "call_method"):
                raise
        return self._own_precision(n)

    def _on_host(self, n: fx.Node) -> Any:
        """A dispatch op with its CPU reference, on copies of its CUDA inputs (differentiable both ways)."""
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        devices = {x.device for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor) and x.is_cuda}
        if not devices:
            return super().run_node(n)
        device = devices.pop()
        to_host = lambda x: x.cpu() if isinstance(x, torch.Tensor) and x.is_cuda else x  # noqa: E731
        result = n.target(*tree_map(to_host, args), **tree_map(to_host, kwargs))
        return tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, result)

    def _own_precision(self, n: fx.Node) -> Any:
        # an op without a kernel in the raised precision (flash attention, CUDA grouped GEMMs in float32): this
        # one op runs in the graph's own precision, each input rounded to its dtype in the graph, and its float
        # results are raised again
        saved = {}
        for a in n.all_input_nodes:
            value, meta = self.env.get(a), val(a)
            if isinstance(value, torch.Tensor) and isinstance(meta, torch.Tensor) and value.is_floating_point() \
                    and value.dtype != meta.dtype:
                saved[a], self.env[a] = value, value.to(meta.dtype)
        raise_to, self.raise_to = self.raise_to, None  # the op's own dtype arguments as written
        try:
            result = super().run_node(n)
        finally:
            self.env.update(saved)
            self.raise_to = raise_to
        return tree_map(lambda x: x.to(_raise_dtype(x.dtype, raise_to)) if isinstance(x, torch.Tensor)
                        and x.is_floating_point() else x, result)

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if self.raise_to is not None:
            args, kwargs = tree_map(lambda x: _raise_dtype(x, self.raise_to), (args, kwargs))
        return super().call_function(target, args, kwargs)

    def call_method(self, target: Any, args: Any, kwargs: Any) -> Any:
        if self.raise_to is not None:
            if target in self._LOW_METHODS and (target != "float" or self.raise_to == torch.float64):
                target = "float" if self.raise_to == torch.float32 else "double"
            args, kwargs = tree_map(lambda x: _raise_dtype(x, self.raise_to), (args, kwargs))
        return super().call_method(target, args, kwargs)


def _concrete(x: Any) -> Any:
    if isinstance(x, torch.SymInt):
        hint = x.node.hint
        if hint is None:
            raise Unavailable("a size is data-dependent (unbacked) and there is no real input for it")
        return int(hint)
    return x


def _flat_inputs(values: Sequence[Any]) -> list[Any]:
    """``values`` with tensor subclasses flattened to their inner tensors, as AOTAutograd's primals are."""
    flat: list[Any] = []
    for v in values:
        if is_traceable_wrapper_subclass(v):
            flat += _flat_inputs([getattr(v, name) for name in v.__tensor_flatten__()[0]])
        else:
            flat.append(v)
    return flat


def _matches(real: Any, fake: Any) -> bool:
    if isinstance(fake, torch.Tensor):
        return (isinstance(real, torch.Tensor) and real.dtype == fake.dtype and real.device == fake.device
                and tuple(real.shape) == tuple(_concrete(s) for s in fake.shape))
    if isinstance(fake, (int, torch.SymInt, float, bool)):
        # a dynamic-shape compile's example inputs hold its size symbols (SymInt) where the graph has placeholders
        return isinstance(real, (int, float, bool, torch.SymInt)) and not isinstance(real, torch.Tensor)
    return False


def _random_like(real: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random values with ``real``'s mean and spread (an activation), or ``real`` itself where it is not one."""
    if real.is_floating_point() and not isinstance(real, torch.nn.Parameter) and real.numel() > 1:
        stats = real.detach().float()
        if bool(stats.isfinite().all()) and float(stats.abs().max()) < MASK_MAGNITUDE:
            noise = torch.randn(real.shape, generator=generator, dtype=torch.float32, device="cpu").to(real.device)
            out = (noise * stats.std() + stats.mean()).to(real.dtype)
            return out.requires_grad_(real.requires_grad)
    return real


def _from_meta(fake: Any, generator: torch.Generator, *, scale: float, bools: bool = False) -> Any:
    """A random tensor like the example value ``fake``: floats normal times ``scale``, integers 0, bools ``bools``
    (True: a mask that allows everything, so a masked computation is compared on every element)."""
    if not isinstance(fake, torch.Tensor):
        return _concrete(fake)
    shape = tuple(_concrete(s) for s in fake.shape)
    if fake.is_floating_point():
        noise = torch.randn(shape, generator=generator, dtype=torch.float32, device="cpu") * scale
        return noise.to(device=fake.device, dtype=fake.dtype)
    if fake.dtype == torch.bool:
        return torch.full(shape, bools, dtype=torch.bool, device=fake.device)
    return torch.zeros(shape, dtype=fake.dtype, device=fake.device)


class StageValidator:
    """Validates the rewrites of one stage of one graph against the graph as it was at the stage's start.

    Built per stage run; the baseline (and its reference) run once, lazily, the first time a pass rewrote.
    """

    def __init__(self, stage: str, training: bool) -> None:
        self.stage = stage
        self.training = training
        self._baseline: fx.Graph | None = None
        self._inputs: list[Any] | None = None
        self._base: Outputs | None = None
        self._current: Outputs | None = None  # the outputs of the graph as the last accepted pass left it
        self._ref: Outputs | None = None
        self._ref_error: str = ""
        self._cotangents: list[torch.Tensor] | None = None
        self._autograd = False
        # an output's key (its position) -> its name in the baseline graph, for messages
        self.labels: dict[str, str] = {}

    # -- inputs

    def _prepare(self, graph: fx.Graph) -> None:
        bad = next((n for n in graph.nodes if n.op == "call_function" and _is_collective(n)), None)
        if bad is not None:
            raise Unavailable(f"the graph has collectives ({bad.target}); running it would talk to other ranks")
        current = _CURRENT.get()
        placeholders = list(graph.find_nodes(op="placeholder"))
        fakes = [val(p) for p in placeholders]
        generator = torch.Generator().manual_seed(SEED)
        if current is None:
            raise Unavailable("no compile in progress: no example inputs")
        real = list(current.example_inputs)
        if self.stage == "pre_grad" and (len(real) != len(placeholders)
                                         or not all(_matches(r, f) for r, f in zip(real, fakes))):
            # a subgraph (the body of an activation-checkpointed region, which Inductor's pre-grad passes visit on
            # their own): its inputs are not the compile's; random ones from the placeholders' example values
            if not all(isinstance(f, torch.Tensor) or _concrete(f) is not None for f in fakes):
                raise Unavailable(f"{len(placeholders)} placeholders but {len(real)} example inputs")
            inputs = [_from_meta(f, generator, scale=1.0, bools=True) for f in fakes]
            self._autograd = torch.is_grad_enabled() and any(
                isinstance(f, torch.Tensor) and f.requires_grad for f in fakes)
            for x, f in zip(inputs, fakes):
                if isinstance(x, torch.Tensor) and f.requires_grad and x.is_floating_point():
                    x.requires_grad_()
        elif self.stage == "pre_grad":
            inputs = [_random_like(r, generator) if isinstance(r, torch.Tensor) else _concrete(r) for r in real]
            self._autograd = current.grad_enabled and any(
                isinstance(r, torch.Tensor) and r.requires_grad for r in real)
        else:
            flat = _flat_inputs(real)
            primals = [p for p in placeholders if not p.name.startswith("tangents")]
            inputs = []
            for i, (p, fake) in enumerate(zip(placeholders, fakes)):
                if p.name.startswith("tangents"):
                    inputs.append(_from_meta(fake, generator, scale=1.0))
                elif len(flat) == len(primals) and _matches(flat[i], fake):
                    r = flat[i]
                    inputs.append(_random_like(r, generator).detach() if isinstance(r, torch.Tensor) else _concrete(r))
                else:
                    inputs.append(_from_meta(fake, generator, scale=0.02))
        self._inputs = inputs

    def _fresh_inputs(self, raise_to: torch.dtype | None, mutated: set[int]) -> list[Any]:
        """The inputs for one run: leaves of their own (no hooks of the user's tensors fire), those at the
        positions ``mutated`` cloned."""
        out = []
        for i, x in enumerate(self._inputs or []):
            if isinstance(x, torch.Tensor):
                y = x.detach()
                if i in mutated:
                    y = y.clone()
                if raise_to is not None and y.is_floating_point():
                    y = y.to(_raise_dtype(y.dtype, raise_to))
                x = y.requires_grad_(self._autograd and x.requires_grad and x.is_floating_point())
            out.append(x)
        return out

    # -- runs

    def _run(self, graph: fx.Graph, raise_to: torch.dtype | None = None) -> Outputs:
        # what the graph being run mutates is cloned: a rewrite can add a mutation the baseline does not have
        # (router_metrics' in-place accumulate into the process-wide metrics buffer)
        mutated = mutated_sources(graph)
        placeholders = list(graph.find_nodes(op="placeholder"))
        inputs = self._fresh_inputs(raise_to, {i for i, p in enumerate(placeholders) if p in mutated})
        cloned = {n.target for n in mutated if n.op == "get_attr"}
        devices = sorted({x.device.index or 0 for x in inputs if isinstance(x, torch.Tensor) and x.is_cuda})
        with torch.random.fork_rng(devices=devices), torch.set_grad_enabled(self._autograd):
            torch.manual_seed(SEED)
            result = _Runner(graph, cloned, raise_to).run(*inputs)
            leaves, _ = tree_flatten(result)
            out_nodes, _ = tree_flatten(next(iter(graph.find_nodes(op="output"))).args[0])
            self.labels = {f"output {i}": f"output {i} ({n.name})" for i, n in enumerate(out_nodes)
                           if isinstance(n, fx.Node)} if graph is self._baseline else self.labels
            tensors = {f"output {i}": leaf for i, leaf in enumerate(leaves)}
            if self._autograd:
                tensors.update(self._gradients(leaves, inputs, raise_to))
        return Outputs({k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in tensors.items()})

    def _gradients(self, outs: list[Any], inputs: list[Any], raise_to: torch.dtype | None) -> dict[str, Any]:
        diff_outs = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
        wrt = [(i, x) for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and x.requires_grad]
        if not diff_outs or not wrt:
            return {}
        if self._cotangents is None:
            generator = torch.Generator().manual_seed(SEED + 1)
            self._cotangents = [torch.randn(o.shape, generator=generator).to(o.device) for o in diff_outs]
        cot = [c.to(o.dtype) for c, o in zip(self._cotangents, diff_outs)]
        grads = torch.autograd.grad(diff_outs, [x for _, x in wrt], cot, allow_unused=True)
        return {f"grad of input {i}": torch.zeros_like(x) if g is None else g for (i, x), g in zip(wrt, grads)}

    def _reference_dtype(self, graph: fx.Graph) -> torch.dtype:
        dtypes = {getattr(val(n), "dtype", None) for n in graph.nodes}
        return torch.float32 if dtypes & set(LOW_PRECISION) else torch.float64

    def _ensure_baseline(self, baseline: fx.Graph) -> None:
        if self._base is not None:
            return
        self._baseline = baseline
        self._prepare(baseline)
        try:
            self._base = self._run(baseline)
        except Unavailable:
            raise
        except Exception as exc:  # noqa: BLE001 - an op that does not run eagerly here: unchecked, not wrong
            raise Unavailable(f"the graph before the rewrite does not run on real inputs ({type(exc).__name__}: "
                              f"{_first_line(exc)})") from exc

    def _reference(self) -> Outputs | None:
        if self._ref is None and not self._ref_error and self._baseline is not None:
            try:
                self._ref = self._run(self._baseline, self._reference_dtype(self._baseline))
            except Exception as exc:  # noqa: BLE001 - no reference: judged against the baseline alone
                self._ref_error = f"{type(exc).__name__}: {_first_line(exc)}"
        return self._ref

    # -- the check

    def check(self, baseline: fx.Graph, rewritten: fx.Graph, *, exact: bool = False) -> Verdict:
        """Run ``rewritten`` and compare it with the stage's baseline (``baseline`` the first time)."""
        # compile-time modes (fake tensors, functionalization) are off: these runs are on real tensors
        with _disable_current_modes():
            return self._check(baseline, rewritten, exact)

    def _check(self, baseline: fx.Graph, rewritten: fx.Graph, exact: bool) -> Verdict:
        self._ensure_baseline(baseline)
        try:
            got = self._run(rewritten)
        except Exception as exc:  # noqa: BLE001 - a rewrite that cannot run is a wrong rewrite
            return Verdict(False, Compared(f"the rewritten graph raised {type(exc).__name__}: {_first_line(exc)}",
                                           math.inf, 0.0, "run"))
        assert self._base is not None
        # a pass that claims bitwise equality is held to the graph it was given: the stage's earlier passes may
        # have changed bits within their bound (capacity_dispatch's gathers, then router_metrics' added op)
        base = (self._current or self._base) if exact else self._base
        verdict = judge(got.tensors, base.tensors, None if exact else self._reference, exact=exact,
                        labels=self.labels)
        if verdict.ok:  # the caller keeps this graph: later exact passes compare with it
            self._current = got
        return verdict


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else ""


__all__ = ["StageValidator", "Unavailable", "compiling", "mutated_sources"]
