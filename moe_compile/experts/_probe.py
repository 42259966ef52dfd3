"""The probe that decides whether a block's own forward and the fused path compute the same
(NOTE [probe before swap] (moe_compile/experts/swap.py)): a random probe input, a row-wise ulp comparison, and the
checks in training mode and of the backward.

NOTE [gradient precision]: the backward check judges each gradient in ulps of the lowest floating precision among
the tensors that gradient flows through in the block's own backward, from the output back to the parameter or the
probe (:func:`path_dtypes`), not in ulps of the gradient's own dtype. A float32 parameter whose gradient flows
through bfloat16 tensors carries their roundings: SwitchTransformers' router computes in float32 (its classifier
cast to float32 on every call) and casts its probabilities to the bf16 model's dtype before they weight the experts,
so ``dL/dW`` sums ``dL/dprobs`` rounded to bf16, and two correct orders of the same sums differ by up to half a bf16
ulp of the row's largest value: 1.9e3-4.6e3x of 8 float32 ulps, 0.03-0.07x of 8 bf16 ulps (6 random blocks). The
tolerance is still the probe's (``PROBE_ULPS`` of the row's largest value plus ``PROBE_FLOOR_ULPS`` of all the
gradients'); only its unit is the path's. The path is the block's own, not the fused one's: a fused path that
computes in a lower precision than the block is held to the block's. A gradient whose path stays in its own dtype
(every gradient of a block in one dtype, a float32 weight used in float32 beside bf16 tensors it does not flow
through) is judged as before; one wrong by 32 of its path's ulps is still refused
(``test_switch_bf16_wrong_router_gradient_is_refused`` in ``tests/experts/test_swap_capacity.py``: a
routing-weight gradient scaled by ``1 + 32 eps_bf16``, 2.1x of the tolerance).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor, nn


class NotSwappable(Exception):
    """A block the swap leaves alone; ``tag`` is the ``explain`` reason."""

    def __init__(self, tag: str, detail: str):
        super().__init__(f"{tag}: {detail}")
        self.tag, self.detail = tag, detail


# The tolerance of NOTE [probe before swap] (moe_compile/experts/swap.py): each token's output row (and each
# gradient's row) within this many ulps of its own largest value; the fused path computes the same sums in another
# order (at most 2.2 ulps over 40 random blocks in bf16/fp16/fp32), while a routing choice it makes differently (a
# selection bias, a scaled weight) moves a token's row by 50 ulps and more.
PROBE_ULPS = 8
PROBE_FLOOR_ULPS = 4  # ... plus this many of the tensor's (a gradient's: all the gradients') largest value
PROBE_SHAPES = ((4, 64), (256,))  # batch and sequence, or tokens only: 256 tokens, the same draws in either
TOKENS_FIRST = ((256,), (4, 64))


# NOTE [probe shapes on a GPU]: a block written for [T, H] that is given [B, S, H] can index past the batch dim
# (token ids up to B*S - 1 into a tensor of B rows). On the CPU that is an IndexError the probe catches; on CUDA it
# is a device-side assert, which no code can catch and which loses the process's CUDA context (the expert-parallel
# GPU test died so on 2026-11-28). So on a GPU each shape is first tried on CPU copies of the block's parameters and
# buffers (``torch.func.functional_call``); only a shape that runs there is tried on the device. Where no shape runs
# on the CPU (an op without a CPU kernel, tensors that do not copy), the device is tried tokens first: a block
# written for [B, S, H] refuses [T, H] in Python, unpacking its shape. The batch-and-sequence shape stays first
# otherwise: a block is verified on the shape its model gives it (a [B, S, H] block's [T, H] output, capacity per
# sequence). Expert-parallel blocks, whose forward runs collectives, go tokens first on the device directly.


class _Forward(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: Tensor) -> Any:
        return self.block.forward(x)


def _cpu_copies(block: nn.Module) -> dict[str, Tensor] | None:
    """CPU copies of the block's parameters and buffers, named as in :class:`_Forward`; ``None`` when one does not
    copy (a tensor subclass without a CPU form)."""
    wrapper = _Forward(block)
    try:
        return {name: t.detach().to("cpu") for name, t in
                [*wrapper.named_parameters(remove_duplicate=False), *wrapper.named_buffers(remove_duplicate=False)]}
    except Exception:  # noqa: BLE001 - any tensor that does not copy
        return None


def _runs_on_cpu(block: nn.Module, tensors: dict[str, Tensor], x: Tensor) -> bool:
    """Whether ``block``'s forward runs on ``x`` with ``tensors`` (:func:`_cpu_copies`) in place of its own."""
    try:
        with torch.no_grad():
            torch.func.functional_call(_Forward(block), tensors, (x,), tie_weights=False)
    except Exception:  # noqa: BLE001 - any failure of the user's forward on this shape
        return False
    return True


def _device_safe_shapes(block: nn.Module, hidden: int, dtype: torch.dtype,
                        shapes: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    """The first of ``shapes`` that runs on CPU copies of the block's tensors, alone; when none does (or the tensors
    do not copy), every shape, tokens first (NOTE [probe shapes on a GPU])."""
    tensors = _cpu_copies(block)
    if tensors is not None:
        for lead in shapes:
            x = torch.randn(*lead, hidden, generator=torch.Generator().manual_seed(0)).to(dtype)
            if _runs_on_cpu(block, tensors, x):
                return (lead,)
    return tuple(sorted(shapes, key=len))


def probe_input(block: nn.Module, hidden: int, dtype: torch.dtype, device: torch.device,
                shapes: tuple[tuple[int, ...], ...] = PROBE_SHAPES, cpu_first: bool = True) -> Tensor:
    """A random probe of 256 tokens the block's own forward accepts, of the first of ``shapes`` that runs:
    ``[4, 64, H]`` (batch and sequence), else ``[256, H]`` (tokens only); a block that runs on neither is not
    swapped. On a GPU, NOTE [probe shapes on a GPU] (``cpu_first=False``: tokens first, on the device)."""
    if device.type != "cpu" and cpu_first:
        shapes = _device_safe_shapes(block, hidden, dtype, shapes)
    gen = torch.Generator(device="cpu").manual_seed(0)
    failures = []
    for lead in shapes:
        x = torch.randn(*lead, hidden, generator=gen).to(device=device, dtype=dtype)
        try:
            block.forward(x)
        except Exception as exc:  # noqa: BLE001 - any failure of the user's forward on this shape
            failures.append(f"{[*lead, hidden]}: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        return x
    raise NotSwappable("probe_failed", "the block's forward fails on every probe shape (" + "; ".join(failures) + ")")


def row_mismatch(got: Tensor | None, want: Tensor | None, scale: float = 0.0, eps: float = 0.0) -> float:
    """``max`` over rows of ``max |got - want| / tol`` (a row: the last dim), ``tol`` being ``PROBE_ULPS`` ulps of the
    row's largest value plus ``PROBE_FLOOR_ULPS`` of ``max(scale, max |want|)`` (a row that cancels to nearly nothing
    is judged against the tensor, a gradient that does against all the gradients: ``scale``); ``inf`` when the
    shapes differ. An ulp is ``want``'s dtype's, or ``eps`` where that is coarser (a gradient: the lowest precision
    on its path, NOTE [gradient precision])."""
    if got is None and want is None:  # both return no second output (Megatron's (output, mlp_bias=None))
        return 0.0
    if not isinstance(got, Tensor) or not isinstance(want, Tensor) or got.shape != want.shape:
        return math.inf
    if want.numel() == 0:
        return 0.0
    eps = max(torch.finfo(want.dtype).eps if want.is_floating_point() else 0.0, eps)
    g, w = got.detach().float().reshape(-1, want.shape[-1] if want.dim() else 1), want.detach().float()
    w = w.reshape(g.shape)
    floor = PROBE_FLOOR_ULPS * eps * max(w.abs().max().item(), scale)
    tol = PROBE_ULPS * eps * w.abs().amax(dim=1) + floor
    err = (g - w).abs().amax(dim=1)
    if not bool(torch.isfinite(err).all()):
        return math.inf
    return float((err / tol.clamp_min(1e-30)).max().item()) if bool((err > 0).any()) else 0.0


def outputs(out: Any) -> tuple[Any, ...]:
    return out if isinstance(out, tuple) else (out,)


def forward_in_both_modes(block: nn.Module, forward_error: Callable[[], float],
                         message: Callable[[str, float], str]) -> None:
    """``forward_error()`` (no grad) with ``block`` in eval, then in training mode; ``NotSwappable("probe_mismatch",
    message(mode, error))`` at the first past 1."""
    first = next(_forward_failures(block, forward_error, message), None)
    if first is not None:
        raise first


def _forward_failures(block: nn.Module, forward_error: Callable[[], float],
                      message: Callable[[str, float], str]) -> Iterator[NotSwappable]:
    for training in (False, True):
        block.train(training)
        with torch.no_grad():
            err = forward_error()
        if not err <= 1:
            yield NotSwappable("probe_mismatch", message("training" if training else "eval", err))


Candidate = TypeVar("Candidate")


def ranked_candidates(candidates: Sequence[Candidate], error_of: Callable[[Candidate], float], *,
                      agree: Callable[[list[float]], list[float]] | None = None,
                      refusals_propagate: bool = True, where: str = "") -> list[Candidate]:
    """The ``candidates`` whose forward matches the block's own on the probe, closest first (in bf16 a wrong
    candidate can come close; ties keep the given order): ``error_of(candidate)`` sets the candidate and returns its
    worst row (:func:`row_mismatch`, ``<= 1`` a match); one that raises counts as no match, a
    :class:`NotSwappable` too unless ``refusals_propagate``. ``agree`` combines the errors across ranks (the
    worst of every rank's, so that all ranks rank alike). Raises ``NotSwappable("probe_mismatch")`` if none
    matches; ``where`` ends the probe's words in its detail."""
    errors = []
    for candidate in candidates:
        try:
            errors.append(error_of(candidate))
        except NotSwappable:
            if refusals_propagate:
                raise
            errors.append(math.inf)
        except Exception:  # noqa: BLE001 - a candidate the block's shapes or dtypes do not admit
            errors.append(math.inf)
    if agree is not None:
        errors = agree(errors)
    ranked = sorted((err, i) for i, err in enumerate(errors) if err <= 1)
    if not ranked:
        closest = min((err for err in errors if not math.isnan(err)), default=math.inf)
        raise NotSwappable("probe_mismatch", f"no fused candidate matched the block's own forward on a probe{where} "
                                             f"(closest: worst row {closest:.3g}x of {PROBE_ULPS} ulps)")
    return [candidates[i] for _, i in ranked]


def first_verified(candidates: Sequence[Candidate], failures_of: Callable[[Candidate], list[NotSwappable]], *,
                   agree: Callable[[bool], bool] | None = None) -> Candidate:
    """The first of ``candidates`` (:func:`ranked_candidates`' order) with no failure: ``failures_of(candidate)``
    sets the candidate and runs :func:`verification_failures` (forwards that tie can differ in backward: the two
    top-k softmax forms at ``K = 1``). ``agree`` says whether any rank failed. The candidate returned is the one
    ``failures_of`` set last. Raises the first candidate's first failure if none passes."""
    first: NotSwappable | None = None
    for candidate in candidates:
        failures = failures_of(candidate)
        if not (agree(bool(failures)) if agree is not None else failures):
            return candidate
        first = first or (failures[0] if failures else NotSwappable(
            "probe_grad_mismatch", "the fused path does not match the block's own on another rank"))
    if first is None:
        raise NotSwappable("probe_mismatch", "no candidate to verify")
    raise first


def verify(block: nn.Module, forward_error: Callable[[], float], fused: Callable[[Tensor], Any], x: Tensor, *,
           same_draws: bool = False) -> None:
    """The chosen candidate in training mode too (the block's training forward may differ: an extra output, noise):
    ``forward_error()`` (the candidate against the block's own forward on the probe, ``<= 1`` a match) in eval and
    in training mode; and the backward of ``fused`` against the block's own (a custom autograd function in the block
    has a backward that the forward does not show): gradients of the probe and of every parameter that requires one,
    each within :func:`row_mismatch` in ulps of the lowest precision on its path (NOTE [gradient precision]), and
    one exactly zero in the block's own exactly zero in the fused (a cancellation the fused path computes as
    rounding residue: top-1 ``softmax`` over the top-k logits against a renormalised one). Raises
    :class:`NotSwappable` at the first mismatch.

    ``same_draws``: the two backward forwards start from one random state and each takes its own copy of the probe
    (:func:`same_draws_run`), for a candidate that calls the block's own noisy router (its draws are then the same)."""
    first = next(verification_failures(block, forward_error, fused, x, same_draws=same_draws), None)
    if first is not None:
        raise first


def verification_failures(block: nn.Module, forward_error: Callable[[], float], fused: Callable[[Tensor], Any],
                          x: Tensor, *, same_draws: bool = False) -> Iterator[NotSwappable]:
    """:func:`verify`'s mismatches, lazily, in its order: consumed to the end, every forward and backward runs
    whatever the earlier ones found (a block whose forward calls collectives must call them on every rank)."""
    yield from _forward_failures(block, forward_error, lambda mode, err: (
        f"the fused forward does not match the block's own in {mode} mode (worst row {err:.3g}x of {PROBE_ULPS} ulps)"))
    names, params = zip(*[(n, p) for n, p in block.named_parameters() if p.requires_grad]) if any(
        p.requires_grad for p in block.parameters()) else ((), ())
    probe = x.detach().clone().requires_grad_(x.is_floating_point())
    gen = torch.Generator(device="cpu").manual_seed(1)
    with torch.enable_grad():
        if same_draws:
            want, got = (outputs(out)[0] for out in same_draws_run(block.forward, fused, probe))
        else:
            want, got = outputs(block.forward(probe))[0], outputs(fused(probe))[0]
        cot = torch.randn(want.shape, generator=gen).to(device=want.device, dtype=want.dtype)
        inputs = (probe, *params)
        path = path_dtypes(want, inputs)
        grads_want = torch.autograd.grad(want, inputs, cot, allow_unused=True)
        grads_got = torch.autograd.grad(got, inputs, cot, allow_unused=True)
    pairs = [(name, g, w, unit) for name, g, w, unit in zip(("input", *names), grads_got, grads_want, path)
             if g is not None or w is not None]
    scale = max((t.detach().abs().max().item() for _, g, w, _ in pairs for t in (g, w) if t is not None and t.numel()),
                default=0.0)
    for name, g, w, unit in pairs:
        g = torch.zeros_like(w) if g is None else g
        w = torch.zeros_like(g) if w is None else w
        unit = _coarsest([unit, w.dtype])
        if not w.any() and g.any():
            yield NotSwappable("probe_grad_mismatch", f"the fused backward does not match the block's own: gradient "
                                                      f"of {name} is exactly zero in the block's own, not in the "
                                                      f"fused (largest {g.abs().max().item():.3g})")
            continue
        err = row_mismatch(g, w, scale, torch.finfo(unit).eps if unit is not None else 0.0)
        if not err <= 1:
            yield NotSwappable("probe_grad_mismatch", f"the fused backward does not match the block's own: gradient "
                                                      f"of {name} (worst row {err:.3g}x of {PROBE_ULPS} "
                                                      f"{str(unit).removeprefix('torch.')} ulps)")


def path_dtypes(root: Tensor, leaves: tuple[Tensor, ...]) -> list[torch.dtype | None]:
    """For each of ``leaves``, the lowest floating precision (the largest eps) among the tensors on any autograd path
    from ``root`` back to it (NOTE [gradient precision]): every node of ``root``'s graph that reaches the leaf's
    ``AccumulateGrad`` contributes the dtypes of what it computed (its forward outputs, which are the gradients it
    receives: ``Node._input_metadata``; the leaf's own dtype is its ``AccumulateGrad``'s, the output's the root's).
    ``None`` for a leaf the root does not reach; a node that does not tell its dtypes contributes none (the unit is
    then no coarser for it)."""
    start = root.grad_fn
    if start is None:
        return [None] * len(leaves)
    # every node of the graph (an iterative walk: graphs of thousands of nodes), then each one's coarsest dtype over
    # its ancestors, in topological order (Kahn: a node once all its parents are done)
    children: dict[Any, list[Any]] = {}
    parents = {start: 0}
    stack = [start]
    while stack:
        node = stack.pop()
        children[node] = [n for n, _ in node.next_functions if n is not None]
        for child in children[node]:
            if child not in parents:
                parents[child] = 0
                stack.append(child)
            parents[child] += 1
    coarsest = {node: _coarsest(_node_dtypes(node)) for node in children}
    ready = [start]
    while ready:
        node = ready.pop()
        for child in children[node]:
            coarsest[child] = _coarsest([coarsest[child], coarsest[node]])
            parents[child] -= 1
            if parents[child] == 0:
                ready.append(child)
    by_leaf = {id(n.variable): dtype for n, dtype in coarsest.items() if hasattr(n, "variable")}
    return [by_leaf.get(id(leaf)) for leaf in leaves]


def _node_dtypes(node: Any) -> list[torch.dtype]:
    """The dtypes of the tensors a node of the autograd graph computed (none when it does not say)."""
    try:
        return [m.dtype for m in node._input_metadata]
    except (AttributeError, RuntimeError):
        return []


def _coarsest(dtypes: list[torch.dtype | None]) -> torch.dtype | None:
    """The floating dtype of the largest eps among ``dtypes`` (``None`` if none is floating)."""
    floating = [d for d in dtypes if d is not None and d.is_floating_point]
    return max(floating, key=lambda d: torch.finfo(d).eps, default=None)


def same_draws_run(first: Callable[[Tensor], Any], second: Callable[[Tensor], Any], x: Tensor) -> tuple[Any, Any]:
    """``(first(x'), second(x''))`` from one random state (put back after ``first``, so ``second`` draws what it
    drew; ``second``'s draws are kept), each on its own copy of ``x`` (a router that jitters its input in place,
    SwitchTransformers' in fp32, would otherwise hand the second call a jittered probe, and cannot scale a leaf in
    place)."""
    devices = [x.device] if x.device.type != "cpu" else []
    with torch.random.fork_rng(devices=devices, device_type=x.device.type):
        a = first(x.clone())
    b = second(x.clone())
    return a, b


__all__ = ["PROBE_FLOOR_ULPS", "PROBE_SHAPES", "PROBE_ULPS", "TOKENS_FIRST", "NotSwappable", "first_verified",
           "forward_in_both_modes", "outputs", "path_dtypes", "probe_input", "ranked_candidates", "row_mismatch",
           "same_draws_run", "verification_failures", "verify"]
