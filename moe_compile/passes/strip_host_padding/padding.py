"""Host padding forms: per-expert chunks padded to a multiple of ``a`` before the experts, unpadded after.

One table of what a host-padded layer looks like in Dynamo's Torch IR (rows ``N``, hidden ``H``, split sizes
``s_e`` read on the host, pad lengths ``q_e``):

    pad      ``cat([F.pad(c_e, (0, 0, 0, q_e)) | cat([c_e, zeros(q_e, H)]) | c_e for c_e in split(x_NH, s)])``
    unpad    ``cat([c_e[:n_e] | c_e.narrow(0, 0, n_e) for c_e in split(y_PH, p)])``

:func:`match_pad` / :func:`match_unpad` return the nodes and the host sizes they use (proving those sizes
are the per-expert counts and ``ceil_align`` of them is the caller's job), or None.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.fx as fx

from moe_compile.passes._graph import arg, is_call, op_name, outside_users, tensor_val
from moe_compile.passes.forms.ops import is_zeros


@dataclasses.dataclass
class Unpad:
    split: fx.Node
    cat: fx.Node
    padded_sizes: list[Any]
    lengths: list[Any]


def match_unpad(y_NH: fx.Node) -> Unpad | None:
    """``cat([narrow(y_e, 0, 0, s_e) | y_e[:s_e] for y_e in split(Y, sizes)])``, else None."""
    if not is_call(y_NH, "cat") or arg(y_NH, "dim", default=0) != 0:
        return None
    pieces = y_NH.args[0]
    split, lengths = None, []
    for i, piece in enumerate(pieces):
        if is_call(piece, "narrow") and arg(piece, "dim") == 0 and arg(piece, "start") == 0:
            chunk, length = piece.args[0], arg(piece, "length")
        elif is_call(piece, "getitem") and isinstance(piece.args[1], slice) \
                and piece.args[1].start in (None, 0) and piece.args[1].step in (None, 1):
            chunk, length = piece.args[0], piece.args[1].stop
        elif is_call(piece, "getitem") and isinstance(piece.args[1], tuple) and len(piece.args[1]) >= 1 \
                and isinstance(piece.args[1][0], slice) and piece.args[1][0].start in (None, 0) \
                and all(s == slice(None) or s is Ellipsis for s in piece.args[1][1:]):
            chunk, length = piece.args[0], piece.args[1][0].stop
        else:
            return None
        is_chunk = is_call(chunk, "getitem") and chunk.args[1] == i
        if not (is_chunk and is_call(chunk.args[0], "split", "split_with_sizes")):
            return None
        if split is None:
            split = chunk.args[0]
        elif chunk.args[0] is not split:
            return None
        lengths.append(length)
    sizes = split.args[1] if len(split.args) > 1 else arg(split, "split_size_or_sections")
    if split is None or not isinstance(sizes, (list, tuple)) or len(sizes) != len(pieces):
        return None
    if arg(split, 2, "dim", 0) != 0:
        return None
    return Unpad(split, y_NH, list(sizes), lengths)


@dataclasses.dataclass
class Pad:
    split: fx.Node
    cat: fx.Node
    sizes: list[Any]
    pads: list[Any]
    nodes: list[fx.Node]


def match_pad(x_NH: fx.Node) -> Pad | None:
    """``cat([F.pad(c_e, (0, 0, 0, q_e)) | cat([c_e, zeros(q_e, H)]) | c_e for c_e in split(x_NH, s)])``."""
    splits = [u for u in x_NH.users if is_call(u, "split", "split_with_sizes")]
    if len(splits) != 1:
        return None
    split = splits[0]
    sizes = split.args[1] if len(split.args) > 1 else arg(split, "split_size_or_sections")
    if not isinstance(sizes, (list, tuple)) or arg(split, 2, "dim", 0) != 0:
        return None
    chunks: dict[int, fx.Node] = {}
    for u in split.users:
        if not (is_call(u, "getitem") and isinstance(u.args[1], int)):
            return None
        chunks[u.args[1]] = u
    if sorted(chunks) != list(range(len(sizes))):
        return None
    cat, pads, nodes = None, [], []
    for i in range(len(sizes)):
        chunk = chunks[i]
        # `chunk.new_zeros(q, H)` only borrows dtype and device from the chunk
        users = [u for u in outside_users([chunk], ()) if not (is_call(u, "new_zeros") and u.args[0] is chunk)]
        if len(users) != 1:
            return None
        user = users[0]
        padded, pad = user, None
        if is_call(user, "pad"):
            spec = arg(user, "pad")
            mode, value = arg(user, "mode", default="constant"), arg(user, "value")
            if not (isinstance(spec, (list, tuple)) and len(spec) == 4 and list(spec[:3]) == [0, 0, 0]):
                return None
            if mode != "constant" or value not in (None, 0, 0.0):
                return None
            pad = spec[3]
            nodes.append(user)
        elif is_call(user, "cat") and len(user.args[0]) == 2 and user.args[0][0] is chunk \
                and arg(user, "dim", default=0) == 0 and is_zeros(user.args[0][1]):
            zeros = user.args[0][1]
            shape = tensor_val(zeros).shape
            if len(shape) != 2 or len(zeros.users) != 1:
                return None
            pad = _zeros_rows_arg(zeros)
            if pad is None:
                return None
            nodes += [user, zeros]
        else:
            pad, padded = 0, chunk
        pads.append(pad)
        if cat is None:
            if not (is_call(next(iter(padded.users), None), "cat") and len(padded.users) == 1):
                return None
            cat = next(iter(padded.users))
        if padded not in cat.args[0] or list(cat.args[0]).index(padded) != i or len(padded.users) != 1:
            return None
    if cat is None or len(cat.args[0]) != len(sizes) or arg(cat, "dim", default=0) != 0:
        return None
    return Pad(split, cat, list(sizes), pads, nodes)


def _zeros_rows_arg(zeros: fx.Node) -> Any:
    """The row count argument of ``new_zeros(q, H)`` / ``zeros(q, H)`` / ``new_zeros((q, H))``."""
    args = zeros.args[1:] if op_name(zeros) == "new_zeros" else zeros.args
    if len(args) == 1 and isinstance(args[0], (list, tuple)):
        args = tuple(args[0])
    return args[0] if len(args) == 2 else None
