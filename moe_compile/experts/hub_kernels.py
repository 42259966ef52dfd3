"""Step around the ``kernels`` package's per-instance wrapper that Dynamo cannot trace under activation checkpointing.

transformers 5.25 depends on ``kernels``, whose ``use_kernelized_func`` (``kernels/_internals/layer/layer.py``)
wraps the ``forward`` of classes such as ``Qwen3MoeAttention``: ``new_forward`` sets a module-global
``CompileableContextVar`` before the original forward and resets it after. Under ``torch.compile`` that ``set`` is an
attribute write on a global object. Inside ``torch.utils.checkpoint`` (a higher-order op to Dynamo) a write outside the
op's scope is an "unsafe side effect": Dynamo graph-breaks and the whole checkpointed decoder layer, its MoE experts
included, runs eagerly (``not_in_graph``).

The wrapper only routes the class's hub functions to this instance's kernelized ones. While none of them is kernelized
(each ``_kernel_funcs`` entry still runs its class's own ``forward``), the functions it routes to run the original
Python function under compile either way, so the original ``forward`` computes exactly what the wrapper does. For
such instances :func:`unwrap_idle_kernel_wrappers` sets the instance's ``forward`` to the original one; kernelized
instances keep the wrapper.
"""

from __future__ import annotations

import sys
import types

from torch import nn

_KERNELS_LAYER = "kernels._internals.layer.layer"


def _wrapper_codes() -> frozenset[types.CodeType]:
    """The code objects of ``use_kernelized_func``'s ``new_forward`` (empty when ``kernels`` is not imported)."""
    layer = sys.modules.get(_KERNELS_LAYER)
    decorator = getattr(layer, "use_kernelized_func", None)
    if decorator is None:
        return frozenset()

    def nested(code: types.CodeType):
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                yield const
                yield from nested(const)

    return frozenset(c for c in nested(decorator.__code__) if c.co_name == "new_forward")


def _idle(module: nn.Module) -> bool:
    """Whether none of ``module``'s hub functions is kernelized: each runs its own class's ``forward``."""
    funcs = getattr(module, "_kernel_funcs", None)
    if not isinstance(funcs, dict):
        return False
    for func in funcs.values():
        bound = getattr(func, "forward", None)
        if getattr(bound, "__func__", None) is not type(func).forward:
            return False
    return True


def unwrap_idle_kernel_wrappers(model: nn.Module) -> list[str]:
    """Give every module of ``model`` whose class ``forward`` is the idle ``kernels`` wrapper its original ``forward``
    (see the module docstring); returns their names. Idempotent; the class and other instances are unchanged."""
    codes = _wrapper_codes()
    if not codes:
        return []
    unwrapped = []
    for name, module in model.named_modules():
        forward = type(module).forward
        original = getattr(forward, "__wrapped__", None)
        if getattr(forward, "__code__", None) not in codes or original is None or "forward" in module.__dict__:
            continue
        if _idle(module):
            module.forward = types.MethodType(original, module)
            unwrapped.append(name)
    return unwrapped
