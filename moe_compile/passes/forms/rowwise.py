"""The expert region between the permuted rows and the combine, proven row-wise and closed.

Row ``r`` of the output may depend only on row ``r`` of the input (and on weights): elementwise ops, casts,
last-dim splits and reductions, and grouped GEMMs over offsets. Shared by ``strip_host_padding`` and
``fuse_expert_loop``; the op tables are :mod:`moe_compile.passes.forms.ops`.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from moe_compile.passes import NoMatch
from moe_compile.passes._graph import (
    arg,
    has_unbacked_shape,
    op_name,
    outside_users,
    tensor_val,
    topo_index,
    transitive_users,
)
from moe_compile.passes._host_sync import sym_expr
from moe_compile.passes.forms.ops import (
    BINARY,
    CASTS,
    GROUPED_MM,
    LAST_DIM_SPLITS,
    UNARY,
)

UNARY_ROWWISE = UNARY | CASTS
BINARY_ROWWISE = BINARY | {"clamp"}


def region_nodes(X: fx.Node, Y: fx.Node) -> list[fx.Node]:
    """Nodes on a path from ``X`` to ``Y`` (``Y`` included, ``X`` excluded), in graph order."""
    forward = transitive_users(X)
    backward: set[fx.Node] = set()
    stack = [Y]
    while stack:
        n = stack.pop()
        if n in backward:
            continue
        backward.add(n)
        stack.extend(a for a in n.all_input_nodes if a in forward)
    order = topo_index(X.graph)
    return sorted(forward & backward, key=order.__getitem__)


def check_rowwise(
    node: fx.Node, inside: set[fx.Node], num_experts: int | None, training: bool = False
) -> list[fx.Node]:
    """Raise unless ``node`` maps row r of its region inputs to row r of its output. Returns offs nodes.

    NOTE [tail rows]: after the rewrite the region runs over ``M`` static rows; rows past ``offs_E[-1]``
    are never read by the combine, but ``torch._grouped_mm`` leaves them uninitialized. Row-wise ops
    keep that garbage in the tail, except in a gradient that sums over rows: a weight shared by all
    rows (``linear``, a per-channel scale) would get ``0 * garbage`` (NaN for NaN/inf garbage). Such
    weights are refused in training (``shared_param_in_expert_region``).
    """
    name = op_name(node)
    value = tensor_val(node)
    if training and name not in GROUPED_MM:
        for a in node.all_input_nodes:
            av = tensor_val(a)
            if a not in inside and av is not None and av.requires_grad:
                raise NoMatch("shared_param_in_expert_region",
                            f"{node.name}: {a.name} is shared by all rows and trained (see NOTE [tail rows])")
    for a in node.all_input_nodes:
        if a not in inside and tensor_val(a) is None and sym_expr(a) is not None:
            raise NoMatch("host_size_in_expert_region", f"{node.name} uses host size {a.name}")
    outside = [a for a in node.all_input_nodes if a not in inside]
    for a in outside:
        if has_unbacked_shape(a):
            raise NoMatch(
                "region_not_rowwise", f"{node.name} mixes in {a.name}, a host-sized tensor outside the region"
            )
    if name in GROUPED_MM:
        x, w = node.args[0], node.args[1]
        offs = node.args[2] if len(node.args) > 2 else node.kwargs.get("offs")
        if x not in inside or w in inside or not isinstance(offs, fx.Node) or offs in inside:
            raise NoMatch("region_not_rowwise", f"{node.name}: grouped GEMM not over the region's rows")
        wv = tensor_val(w)
        if wv is None or wv.dim() != 3 or (num_experts is not None and wv.shape[0] != num_experts):
            raise NoMatch("region_not_rowwise", f"{node.name}: grouped GEMM weight is not [E, ., .]")
        if len(node.args) > 3 or set(node.kwargs) - {"offs", "out_dtype"}:
            raise NoMatch("region_not_rowwise", f"{node.name}: grouped GEMM with bias")
        return [offs]
    if name in ("linear", "matmul", "__matmul__"):
        if node.args[0] not in inside or any(a in inside for a in node.args[1:] if isinstance(a, fx.Node)):
            raise NoMatch("region_not_rowwise", f"{node.name}: {name} is not rows @ shared weight")
        w = tensor_val(node.args[1])
        if w is None or (name != "linear" and w.dim() != 2):
            raise NoMatch("region_not_rowwise", f"{node.name}: {name} weight is not 2-D")
        return []
    if name == "getitem":
        src, index = node.args
        if isinstance(tensor_val(src), torch.Tensor):
            ok = isinstance(index, tuple) and len(index) >= 2 and (index[0] is Ellipsis or index[0] == slice(None)) \
                and all(not isinstance(i, fx.Node) for i in index)
            if not ok:
                raise NoMatch("region_not_rowwise", f"{node.name}: indexing over rows")
        elif not isinstance(index, int):
            raise NoMatch("region_not_rowwise", f"{node.name}: unsupported getitem")
        return []
    if name in LAST_DIM_SPLITS:
        src = tensor_val(node.args[0])
        dim = arg(node, "dim", default=0) if name != "chunk" else arg(node, 2, "dim", 0)
        if name == "narrow":
            dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        if src is None or src.dim() < 2 or not isinstance(dim, int) or dim % src.dim() == 0:
            raise NoMatch("region_not_rowwise", f"{node.name}: {name} over the row dim")
        return []
    if name in UNARY_ROWWISE or name in BINARY_ROWWISE:
        if value is None and name not in CASTS:
            raise NoMatch("region_not_rowwise", f"{node.name}: {name} without a tensor value")
        for a in outside:
            av = tensor_val(a)
            if av is not None and value is not None and av.dim() >= value.dim() and av.shape[0] != 1:
                raise NoMatch("region_not_rowwise", f"{node.name}: {name} with a per-row operand {a.name}")
        return []
    raise NoMatch("region_not_rowwise", f"{node.name}: {name} is not a supported row-wise op")


def rowwise_region(
    X: fx.Node, Y: fx.Node, num_experts: int | None, y_consumers: set[fx.Node]
) -> tuple[list[fx.Node], list[fx.Node], list[fx.Node]]:
    """The expert region from ``X`` to ``Y``, proven row-wise and closed: returns (its nodes in graph
    order, the grouped GEMMs reading offsets, those offsets nodes). Only ``Y`` may also feed
    ``y_consumers``; any other use outside the region raises ``expert_region_escapes``."""
    middle = region_nodes(X, Y)
    if Y not in middle:
        raise NoMatch("region_not_rowwise", f"{Y.name} is not computed from {X.name}")
    inside = set(middle) | {X}
    training = bool(getattr(tensor_val(Y), "requires_grad", False))
    offs_uses: list[fx.Node] = []
    offs_nodes: list[fx.Node] = []
    for node in middle:
        found = check_rowwise(node, inside, num_experts, training)
        if found:
            offs_uses.append(node)
            offs_nodes += [o for o in found if o not in offs_nodes]
        allowed = inside | y_consumers if node is Y else inside
        escaping = outside_users([node], allowed)
        if escaping:
            raise NoMatch("expert_region_escapes", f"{node.name} is also used by {escaping[0].name}")
    return middle, offs_uses, offs_nodes
