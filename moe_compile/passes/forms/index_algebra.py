"""Integer index expressions of a dispatch as linear forms, so spellings can be compared exactly.

Routing code builds ``offs`` and padded destination rows from per-expert counts with a handful of
integer ops. :func:`linear_form` turns such a subgraph into a canonical linear combination of atoms:

==================================  ==============================================================
atom                                meaning
==================================  ==============================================================
``("counts",)``                     tokens per expert ``[E]`` (a node :class:`Counts` verified)
``("ceil", form, a)``               ``ceil(form / a)`` (``(c + a - 1) // a``, ``ceil(c / a)``)
``("cumsum", atom)``                inclusive ``cumsum`` over experts of an ``[E]`` atom
``("arange",)``                     ``arange(S)`` over the sorted rows
``("at_ids", atom)``                an ``[E]`` atom gathered at the sorted expert ids ``[S]``
==================================  ==============================================================

``cumsum`` and ``gather at ids`` are linear, so they distribute over sums; an exclusive cumsum
(``cumsum(c) - c``, ``cat([0, cumsum(c)[:-1]])``, ``F.pad(cumsum(c), (1, 0))[:-1]``) lands on the
same form. Anything else (data-dependent ops, float math other than ``ceil(c / a)``) is
:class:`NotLinear`. Casts and ``contiguous`` are transparent: the values are small non-negative
integers that every integer and float dtype used here represents exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch.fx as fx

from moe_compile.passes._graph import arg, known_int, op_name, tensor_val
from moe_compile.passes.forms.ops import INDEX_CASTS, is_zeros, strip_casts

Atom = tuple[Any, ...]


class NotLinear(Exception):
    """The subgraph is not a linear form over the atoms above."""


@dataclasses.dataclass(frozen=True)
class Form:
    """``const + sum(coef * atom)``; ``terms`` is a sorted tuple of ``(atom, coef)`` with coef != 0."""

    terms: tuple[tuple[Atom, int], ...] = ()
    const: int = 0

    @staticmethod
    def atom(atom: Atom, coef: int = 1) -> Form:
        return Form(((atom, coef),), 0)

    def as_dict(self) -> dict[Atom, int]:
        return dict(self.terms)

    def __add__(self, other: Form) -> Form:
        d = self.as_dict()
        for a, c in other.terms:
            d[a] = d.get(a, 0) + c
        return Form(tuple(sorted(((a, c) for a, c in d.items() if c), key=repr)), self.const + other.const)

    def scale(self, k: int) -> Form:
        if k == 0:
            return Form()
        return Form(tuple((a, c * k) for a, c in self.terms), self.const * k)

    def __neg__(self) -> Form:
        return self.scale(-1)

    def __sub__(self, other: Form) -> Form:
        return self + (-other)

    def map_atoms(self, fn: Callable[[Atom], Atom]) -> Form:
        out = Form(const=self.const)
        for a, c in self.terms:
            out = out + Form.atom(fn(a), c)
        return out


COUNTS: Atom = ("counts",)
ARANGE: Atom = ("arange",)


def ceil_atom(form: Form, align: int) -> Atom:
    return ("ceil", form, align)


def padded_counts(align: int) -> Form:
    """``ceil(counts / a) * a``, or ``counts`` when ``a == 1``."""
    if align == 1:
        return Form.atom(COUNTS)
    return Form.atom(ceil_atom(Form.atom(COUNTS), align), align)


def cumsum(form: Form) -> Form:
    if form.const:
        raise NotLinear("cumsum of a constant vector")
    return form.map_atoms(lambda a: ("cumsum", a))


def at_ids(form: Form) -> Form:
    if form.const:
        # a constant E-vector gathered at ids is the same constant per row
        return form.map_atoms(lambda a: ("at_ids", a)) + Form(const=form.const)
    return form.map_atoms(lambda a: ("at_ids", a))


def expected_offsets(align: int) -> Form:
    """``cumsum(padded counts)``: what ``offs`` for ``_grouped_mm`` must be."""
    return cumsum(padded_counts(align))


def expected_destination(align: int) -> Form:
    """Padded row of sorted row ``i``: ``excl_cumsum(padded)[e] + i - excl_cumsum(counts)[e]``."""
    padded = padded_counts(align)
    counts = Form.atom(COUNTS)
    return at_ids(cumsum(padded) - padded) + Form.atom(ARANGE) - at_ids(cumsum(counts) - counts)


def _strip(node: Any) -> Any:
    return strip_casts(node, INDEX_CASTS)


class LinearForms:
    """Computes :class:`Form` of integer index nodes.

    ``is_counts(node)`` says whether a node is a verified per-expert count (``[E]``);
    ``is_sorted_ids(node)`` whether it is the expert ids in sorted order (``[S]``);
    ``num_rows`` is ``S`` (checked against ``arange``).
    """

    def __init__(self, is_counts: Callable[[fx.Node], bool], is_sorted_ids: Callable[[fx.Node], bool],
                 same_rows: Callable[[Any], bool]) -> None:
        self.is_counts = is_counts
        self.is_sorted_ids = is_sorted_ids
        self.same_rows = same_rows
        self._memo: dict[fx.Node, Form] = {}

    def __call__(self, node: Any) -> Form:
        node = _strip(node)
        k = known_int(node)
        if k is not None:
            return Form(const=k)
        if isinstance(node, float) and node.is_integer():
            return Form(const=int(node))
        if not isinstance(node, fx.Node):
            raise NotLinear(f"unsupported constant {node!r}")
        if node not in self._memo:
            self._memo[node] = self._form(node)
        return self._memo[node]

    def _form(self, node: fx.Node) -> Form:
        if self.is_counts(node):
            return Form.atom(COUNTS)
        name = op_name(node)
        if name in ("add", "add_") or name == "sub" or name == "rsub":
            a, b = self(node.args[0]), self(node.args[1])
            alpha = node.kwargs.get("alpha", 1)
            if alpha != 1:
                b = b.scale(int(alpha))
            if name == "sub":
                return a - b
            if name == "rsub":
                return b - a
            return a + b
        if name == "neg":
            return -self(node.args[0])
        if name == "mul":
            a, b = node.args[0], node.args[1]
            ka, kb = known_int(_strip(a)), known_int(_strip(b))
            if kb is not None:
                return self(a).scale(kb)
            if ka is not None:
                return self(b).scale(ka)
            raise NotLinear("product of two non-constant index tensors")
        if name in ("floordiv", "floor_divide") or (name == "div" and node.kwargs.get("rounding_mode") == "floor"):
            divisor = known_int(_strip(node.args[1]))
            if divisor is None or divisor <= 0:
                raise NotLinear("floor division by a non-constant")
            inner = self(node.args[0])
            # (c + a - 1) // a == ceil(c / a) for integer c >= 0
            return Form.atom(ceil_atom(inner - Form(const=divisor - 1), divisor))
        if name == "ceil":
            inner = _strip(node.args[0])
            if isinstance(inner, fx.Node) and op_name(inner) in ("truediv", "div") \
                    and inner.kwargs.get("rounding_mode") is None:
                divisor = known_int(_strip(inner.args[1]))
                if divisor is None or divisor <= 0:
                    raise NotLinear("ceil of a division by a non-constant")
                return Form.atom(ceil_atom(self(inner.args[0]), divisor))
            raise NotLinear("ceil of something other than a division")
        if name == "cumsum":
            dim = arg(node, 1, "dim")
            v = tensor_val(node)
            if v is None or v.dim() != 1 or dim not in (0, -1):
                raise NotLinear("cumsum that is not over a 1-D expert vector")
            return cumsum(self(node.args[0]))
        if name == "arange":
            return self._arange(node)
        if name in ("getitem", "index_select"):
            return self._getitem(node, name)
        if name == "cat":
            return self._shifted_cat(node)
        if name == "pad":
            raise NotLinear("pad is only understood as F.pad(cumsum, (1, 0))[:-1]")
        if self.is_sorted_ids(node):
            raise NotLinear("sorted ids used as a value")
        raise NotLinear(f"unsupported op {name}")

    def _arange(self, node: fx.Node) -> Form:
        only_end = len(node.args) == 1 and "start" not in node.kwargs  # arange(end)
        start = 0 if only_end else arg(node, 0, "start", 0)
        step = 1 if only_end else arg(node, 2, "step", 1)
        # (the length is read from the traced value below, so `end` itself is not needed)
        if known_int(start) != 0 or known_int(step) != 1:
            raise NotLinear("arange with a non-zero start or step != 1")
        v = tensor_val(node)
        if v is None or not self.same_rows(v.shape[0]):
            raise NotLinear("arange over a length other than the routed rows")
        return Form.atom(ARANGE)

    def _getitem(self, node: fx.Node, name: str) -> Form:
        src, idx = node.args[0], node.args[1]
        if name == "index_select":
            if known_int(idx) != 0:
                raise NotLinear("index_select along dim != 0")
            idx = node.args[2]
        if isinstance(idx, fx.Node) and self.is_sorted_ids(_strip(idx)):
            return at_ids(self(src))
        if idx == slice(None, -1, None) and isinstance(src, fx.Node) and op_name(src) == "pad":
            # F.pad(cumsum(x), (1, 0))[:-1] == cumsum(x) - x
            pad = arg(src, 1, "pad")
            value = arg(src, 3, "value", None)
            if tuple(pad) == (1, 0) and value in (None, 0, 0.0) and arg(src, 2, "mode", "constant") == "constant":
                return _uncumsum(self(src.args[0]))
        if isinstance(idx, slice):
            # cumsum(x)[:-1] only inside a shifted cat/pad
            raise NotLinear("slice of an index vector outside an exclusive cumsum")
        raise NotLinear("gather by something other than the sorted expert ids")

    def _shifted_cat(self, node: fx.Node) -> Form:
        """``cat([zeros(1), cumsum(x)[:-1]])`` == ``cumsum(x) - x``."""
        parts = arg(node, 0, "tensors")
        dim = arg(node, 1, "dim", 0)
        if dim not in (0, -1) or not isinstance(parts, (list, tuple)) or len(parts) != 2:
            raise NotLinear("cat that is not [0, cumsum[:-1]]")
        head, tail = parts
        hv = tensor_val(head)
        if hv is None or hv.numel() != 1 or not is_zeros(head):
            raise NotLinear("cat whose head is not a single zero")
        if not (isinstance(tail, fx.Node) and op_name(tail) == "getitem" and tail.args[1] == slice(None, -1, None)):
            raise NotLinear("cat whose tail is not x[:-1]")
        inner = self(tail.args[0])
        return _uncumsum(inner)


def _uncumsum(form: Form) -> Form:
    """``cumsum(x) - x`` for a form that is a pure cumsum (the exclusive scan, shifted by one)."""
    base = Form()
    for a, c in form.terms:
        if a[0] != "cumsum":
            raise NotLinear("shifted vector is not a cumsum")
        base = base + Form.atom(a[1], c)
    if form.const:
        raise NotLinear("shifted cumsum with a constant")
    return form - base


__all__ = [
    "ARANGE", "COUNTS", "Form", "LinearForms", "NotLinear", "expected_destination", "expected_offsets",
    "padded_counts",
]
