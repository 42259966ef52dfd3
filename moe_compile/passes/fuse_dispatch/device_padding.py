"""Step 4 of the dispatch proof (:mod:`moe_compile.passes.fuse_dispatch.match`): a device-padded layout.

The sorted token rows reach a padded ``[M, H]`` buffer on the device in one of two forms (``perm`` the
sort's permutation, ``dest_S`` each sorted row's padded row, ``K`` top-k, ``T`` tokens):

    (a) zeros        buf = zeros(M, H); buf[dest_S] = x[perm // K]   (or ``index_put_`` / ``index_copy_``;
                     the rows may be weighted by the routing weights gathered alongside)
    (b) sentinel     src = full((M,), T); src[dest_S] = perm // K; rows = cat([x, zeros(1, H)])[src]

and the probs may be written the same way into a zero ``[M]`` buffer. The step runs in two halves,
because ``dest_S`` can only be proven once the offsets' alignment ``a`` is known:

    find_padding(SortedIds, Gathers)              -> Padding | None   which form, dest_S, the buffers, M
    check_destination(Padding, Offsets, S)        -> None             dest_S is the canonical a-aligned
                                                                      destination (as a linear form,
                                                                      ``index_algebra.expected_destination``)
                                                                      and M >= the static worst case

After the rewrite ``permute_pad`` writes the same rows (``rows_MH``; ``Y[dest_S]`` becomes ``Y``).
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from moe_compile.ops._common import static_row_bound
from moe_compile.passes import NoMatch
from moe_compile.passes._graph import arg, known_int, op_name, same_int, tensor_val
from moe_compile.passes.forms import index_algebra as ia
from moe_compile.passes.forms.ops import is_zeros
from moe_compile.passes.fuse_dispatch.region import gather_parts, index_of_floordiv
from moe_compile.passes.fuse_dispatch.steps import Gathers, Offsets, Padding, SortedIds


def sentinel_base(node: Any) -> fx.Node | None:
    """``x`` for ``cat([x, zeros(1, H)])`` or ``F.pad(x, (0, 0, 0, 1))`` (x with a zero row at index T)."""
    if not isinstance(node, fx.Node):
        return None
    name = op_name(node)
    if name == "cat":
        parts = arg(node, 0, "tensors")
        if known_int(arg(node, 1, "dim", 0)) != 0 or not isinstance(parts, (list, tuple)) or len(parts) != 2:
            return None
        first, zero = parts
        zv, fv = tensor_val(zero), tensor_val(first)
        if fv is not None and fv.dim() == 2 and zv is not None and zv.dim() == 2 and zv.shape[0] == 1 \
                and is_zeros(zero):
            return first
        return None
    if name == "pad":
        pad = tuple(arg(node, 1, "pad"))
        fv = tensor_val(node.args[0])
        if fv is not None and fv.dim() == 2 and pad == (0, 0, 0, 1) and arg(node, 3, "value", None) in (None, 0, 0.0):
            return node.args[0]
    return None


def _padded_write(buf: fx.Node, value: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(write, dest)`` for ``buf[dest] = value`` / ``buf.index_put_((dest,), value)`` /
    ``buf.index_copy_(0, dest, value)``, else None."""
    for w in buf.users:
        name = op_name(w)
        if name == "setitem" and w.args[0] is buf and w.args[2] is value and isinstance(w.args[1], fx.Node):
            return w, w.args[1]
        if name == "index_put_" and w.args[0] is buf and arg(w, 2, "values") is value \
                and not arg(w, 3, "accumulate", False):
            idx = arg(w, 1, "indices")
            if isinstance(idx, (list, tuple)) and len(idx) == 1:
                return w, idx[0]
        if name == "index_copy_" and w.args[0] is buf and known_int(arg(w, 1, "dim")) == 0 \
                and arg(w, 3, "source") is value:
            return w, arg(w, 2, "index")
    return None


def _is_weighted_rows_of(node: fx.Node, rows: fx.Node, weight_gathers: tuple[fx.Node, ...]) -> bool:
    """``rows * w[perm][:, None]`` (through casts of the column) with ``w[perm]`` a weight gather."""
    if op_name(node) != "mul" or len(node.args) != 2 or rows not in node.args:
        return False
    col = node.args[1] if node.args[0] is rows else node.args[0]
    while isinstance(col, fx.Node) and op_name(col) in ("to", "float", "bfloat16", "half", "type_as"):
        col = col.args[0]
    if not isinstance(col, fx.Node):
        return False
    if op_name(col) == "unsqueeze" and arg(col, 1, "dim") in (-1, 1):
        col = col.args[0]
    elif op_name(col) == "getitem" and col.args[1] in ((slice(None), None), (Ellipsis, None)):
        col = col.args[0]
    else:
        return False
    return col in weight_gathers


def find_padding(sorted_ids: SortedIds, gathers: Gathers) -> Padding | None:
    """Step 4, first half: the padded layout (a) or (b) built from the sorted rows, else None (no padding).

    Only found here; :func:`check_destination` proves it once the offsets' alignment is known.
    """
    perm = sorted_ids.perm
    writes: list[fx.Node] = []
    seeds: list[fx.Node] = []
    prob_seeds: list[fx.Node] = []
    dest = None

    # (a) zeros[M, H] written at dest with the gathered token rows, or with them weighted by the
    # routing weight gathered alongside (weights applied before the experts)
    weighted_seeds: list[fx.Node] = []
    for g in gathers.token_gathers:
        values = [(g, False)] + [(u, True) for u in g.users
                                 if _is_weighted_rows_of(u, g, gathers.weight_gathers)]
        for value, weighted in values:
            for w in list(value.users):
                name = op_name(w)
                if name in ("setitem", "index_put_", "index_copy_") and w.args[0] is not value \
                        and is_zeros(w.args[0]):
                    found = _padded_write(w.args[0], value)
                    if found is None or found[0] is not w:
                        continue
                    if dest is not None and found[1] is not dest:
                        raise NoMatch("padding_not_proven", "two different padded destinations")
                    dest = found[1]
                    writes.append(w)
                    seeds.append(w.args[0])
                    if weighted:
                        weighted_seeds.append(w.args[0])
    # (b) sentinel gather: src = full((M,), T); src[dest] = perm // K; cat([x, zeros(1, H)])[src]
    for u in perm.users:
        if index_of_floordiv(u, perm) is None:
            continue
        for w in u.users:
            if op_name(w) not in ("setitem", "index_put_", "index_copy_") or w.args[0] is u:
                continue
            buf = w.args[0]
            if op_name(buf) not in ("full", "new_full") or not same_int(
                arg(buf, 1 if op_name(buf) == "full" else 2, "fill_value"), gathers.num_tokens
            ):
                continue
            found = _padded_write(buf, u)
            if found is None or found[0] is not w:
                continue
            for g in buf.users:
                parts = gather_parts(g)
                if parts is None or parts[1] is not buf or sentinel_base(parts[0]) is not gathers.x_TH:
                    continue
                if dest is not None and found[1] is not dest:
                    raise NoMatch("padding_not_proven", "two different padded destinations")
                dest = found[1]
                seeds.append(g)
                writes.append(w)
    if dest is None:
        return None
    # probs written into a padded zeros[M] buffer at the same dest
    for g in gathers.weight_gathers:
        for w in list(g.users):
            if op_name(w) in ("setitem", "index_put_", "index_copy_") and w.args[0] is not g \
                    and is_zeros(w.args[0]):
                found = _padded_write(w.args[0], g)
                if found is not None and found[0] is w and found[1] is dest:
                    writes.append(w)
                    prob_seeds.append(w.args[0])
    rows = [tensor_val(s).shape[0] for s in seeds + prob_seeds]
    num_rows = tensor_val(seeds[0]).shape[0]
    if not all(same_int(r, num_rows) for r in rows):
        raise NoMatch("padding_not_proven", "padded buffers of different sizes")
    return Padding(
        num_rows=num_rows, dest=dest, seeds=tuple(seeds), prob_seeds=tuple(prob_seeds), writes=tuple(writes),
        weighted_seeds=tuple(weighted_seeds),
        matched="pad(index_put into zeros)" if op_name(seeds[0]) != "getitem" else "pad(sentinel row)",
    )


def check_destination(padding: Padding, offsets: Offsets, num_rows: Any) -> None:
    """Step 4, second half: ``dest_S`` is the canonical ``offsets.align``-aligned destination of the ``S =
    num_rows`` sorted rows, and the buffer has at least the static worst case of rows. Raises
    :class:`NoMatch` (``padding_not_proven``) otherwise."""
    align = offsets.align
    try:
        form = offsets.forms(padding.dest)
    except ia.NotLinear as exc:
        raise NoMatch("padding_not_proven", f"padded destination is not understood: {exc}") from None
    if form != ia.expected_destination(align):
        raise NoMatch("padding_not_proven", f"padded destination rows differ from the per-expert {align}-aligned "
                      "layout")
    bound = static_row_bound(num_rows, offsets.num_experts, align)
    if not same_int(bound, padding.num_rows) and not statically_known_true(padding.num_rows >= bound):
        raise NoMatch("padding_not_proven", f"padded buffer has {padding.num_rows} rows, fewer than the "
                      f"worst case {bound}")
