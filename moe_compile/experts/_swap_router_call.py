"""How a block calls its routing module, read from the call itself (issue 51: recognise by behaviour, not names).

NOTE [recorded router call]: the expert-loop swap (:mod:`moe_compile.experts.swap`) calls a block's ``gate`` /
``router`` module that routes itself (``gate_call`` / ``router_call``) in place of the block's loop. What it calls it
with is not guessed: the block's own forward runs once on the probe with a hook on that module, in eval and in
training mode, and the call it makes is read back (:func:`record_router_call`):

* the input: the block's input as given (DeepSeek-V2's ``MoEGate`` and NLLB-MoE's router unpack
  ``bsz, seq_len, h = hidden_states.shape``: they take ``[B, S, H]`` only) or its tokens ``[T, H]``;
* every further argument: a tensor of the block's own (torchtitan's ``self.router(x, self.expert_bias)``: a
  selection-only bias added to the scores before the top-k, not to the weights), read from the block by name on
  every call (an update of the bias, in place or not, is seen), or a plain value (``None``, a number, a string);
  any other tensor (one computed from the input) is refused (``router_input_unknown``);
* every buffer of the block outside the router that the forward changes must change by exactly one of the router's
  returned tensors, in both modes (torchtitan's ``self.tokens_per_expert.add_(num_tokens_per_expert)``, the counts
  its load balancing reads between steps): the fused path adds that output under ``no_grad`` as the block does. A
  buffer written otherwise (or in one mode only) is refused (``block_state_written``): dropping it would be silent.

The ids and weights then come from the block's own routing code, so such state is used exactly as the block uses it;
the probe still has to match the block's own outputs and gradients
(NOTE [probe before swap] (moe_compile/experts/swap.py)). The probe's calls leave every buffer as it found it
(:func:`kept_buffers`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from moe_compile.experts._probe import NotSwappable

_PLAIN = (type(None), bool, int, float, str)


@dataclasses.dataclass(frozen=True)
class RouterCall:
    """How the block calls its routing module (NOTE [recorded router call])."""

    on_hidden: bool = False  # the router takes the block's input as given ([B, S, H]), else its tokens [T, H]
    # after the input: ("state", name) a tensor of the block read by name on each call, or ("value", v)
    args: tuple[tuple[str, Any], ...] = ()
    kwargs: tuple[tuple[str, tuple[str, Any]], ...] = ()
    counters: tuple[tuple[str, int], ...] = ()  # (block buffer, router output index): buffer += output, no grad

    @property
    def state(self) -> tuple[str, ...]:
        """The names of the block's tensors the fused path reads (passed to the router) or writes (counters)."""
        passed = [v for kind, v in (*self.args, *(a for _, a in self.kwargs)) if kind == "state"]
        return (*passed, *(name for name, _ in self.counters))

    def describe(self) -> str:
        parts = ["[B, S, H]" if self.on_hidden else "[T, H]"]
        parts += [v if kind == "state" else repr(v) for kind, v in self.args]
        parts += [f"{k}={v if kind == 'state' else repr(v)}" for k, (kind, v) in self.kwargs]
        counted = "".join(f", {name} += output {i}" for name, i in self.counters)
        return f"({', '.join(parts)}){counted}"


def _tensor_of(block: nn.Module, name: str) -> Tensor:
    owner, _, leaf = name.rpartition(".")
    return getattr(block.get_submodule(owner) if owner else block, leaf)


def call_router(block: nn.Module, router: str, call: RouterCall, x_TH: Tensor, hidden: Tensor) -> Any:
    """``block.<router>(input, *args, **kwargs)`` as :class:`RouterCall` says, then its counters."""
    def value(arg: tuple[str, Any]) -> Any:
        kind, v = arg
        return _tensor_of(block, v) if kind == "state" else v

    out = getattr(block, router)(hidden if call.on_hidden else x_TH, *(value(a) for a in call.args),
                                 **{k: value(a) for k, a in call.kwargs})
    if call.counters:
        with torch.no_grad():
            for name, i in call.counters:
                _tensor_of(block, name).add_(out[i].to(_tensor_of(block, name).dtype))
    return out


@contextlib.contextmanager
def kept_buffers(block: nn.Module) -> Iterator[None]:
    """Every buffer of ``block`` put back as it was (the probe's forwards update counters)."""
    saved = [(b, b.detach().clone()) for b in block.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, v in saved:
                b.copy_(v)


def record_router_call(block: nn.Module, router: str, x: Tensor) -> RouterCall:
    """The call the block's own forward makes to ``block.<router>`` on the probe ``x``, in eval and in training mode
    (NOTE [recorded router call]); the default (tokens, no arguments) where the forward does not call it."""
    module = getattr(block, router)
    names = {id(t): n for n, t in (*block.named_parameters(remove_duplicate=False),
                                   *block.named_buffers(remove_duplicate=False))}
    outside = [(n, b) for n, b in block.named_buffers() if not n.startswith(router + ".")]
    found: list[tuple[RouterCall, tuple[str, ...]]] = []
    was_training = [m.training for m in block.modules()]
    try:
        for training in (False, True):
            block.train(training)
            calls: list[tuple[tuple[Any, ...], dict[str, Any], Any]] = []
            handle = module.register_forward_hook(lambda m, a, k, o: calls.append((a, k, o)), with_kwargs=True)
            with kept_buffers(block):
                before = [b.detach().clone() for _, b in outside]
                try:
                    with torch.no_grad():
                        block.forward(x.clone())
                finally:
                    handle.remove()
                changed = [(n, b.detach() - old) for (n, b), old in zip(outside, before) if not torch.equal(b, old)]
            if not calls:
                return RouterCall()
            found.append(_read_call(block, router, calls[0], x, names, changed))
    finally:
        for m, t in zip(block.modules(), was_training):
            m.training = t
    (eval_call, eval_written), (train_call, train_written) = found
    if eval_written != train_written or eval_call != train_call:
        raise NotSwappable("block_state_written", f"the block's forward calls its {router} or writes its buffers "
                                                  "differently in eval and in training mode")
    return eval_call


def _read_call(block: nn.Module, router: str, call: tuple[tuple[Any, ...], dict[str, Any], Any], x: Tensor,
               names: dict[int, str], changed: list[tuple[str, Tensor]]) -> tuple[RouterCall, tuple[str, ...]]:
    args, kwargs, out = call
    H = x.shape[-1]
    inp = args[0] if args else None
    if not isinstance(inp, Tensor) or inp.shape[-1] != H or inp.numel() != x.numel():
        raise NotSwappable("router_input_unknown", f"the block calls its {router} with no [.., {H}] input of its "
                                                   "tokens first")
    on_hidden = inp.dim() != 2
    if on_hidden and inp.shape != x.shape:
        raise NotSwappable("router_input_unknown", f"the block calls its {router} on {list(inp.shape)}, neither "
                                                   f"its input {list(x.shape)} nor its tokens [T, {H}]")

    def read(a: Any, where: str) -> tuple[str, Any]:
        if isinstance(a, Tensor):
            if id(a) not in names:
                raise NotSwappable("router_input_unknown", f"the block passes its {router} a tensor that is none of "
                                                           f"its own ({where}, {list(a.shape)}): the fused path "
                                                           "could not compute it")
            return "state", names[id(a)]
        if not isinstance(a, _PLAIN):
            raise NotSwappable("router_input_unknown", f"the block passes its {router} a {type(a).__name__} "
                                                       f"({where})")
        return "value", a

    extra = tuple(read(a, f"argument {i + 1}") for i, a in enumerate(args[1:]))
    named = tuple((k, read(a, k)) for k, a in kwargs.items())
    outs = out if isinstance(out, tuple) else (out,)
    counters = []
    for name, delta in changed:
        hit = next((i for i, t in enumerate(outs) if isinstance(t, Tensor) and t.shape == delta.shape
                    and torch.equal(t.to(delta.dtype), delta)), None)
        if hit is None:
            raise NotSwappable("block_state_written", f"the block's forward writes {name}, not by adding one of its "
                                                      f"{router}'s outputs: the fused path would drop it")
        counters.append((name, hit))
    return RouterCall(on_hidden, extra, named, tuple(counters)), tuple(n for n, _ in changed)
