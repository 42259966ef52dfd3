"""The one row-wise prover: row ``r`` of a node's output depends only on row ``r`` of its region inputs.

Every pass that moves the routed rows (``fuse_dispatch``, ``strip_host_padding``, ``fuse_expert_loop``) asks
:class:`RowwiseProof` whether each node of its expert region keeps rows apart. :data:`RULES` maps an op name
to its rule (elementwise, last-dim split, reduction over non-row dims, grouped GEMM, dense projection, ...);
a :class:`RowwisePolicy` says which ops a pass accepts and how strictly, and each of its fields is one place
where the passes differ (they had one prover each until the two were merged; ``tests/passes/forms/
test_rowwise.py`` feeds every op to every policy and keeps the table of differences):

    field                 DISPATCH (fuse_dispatch)        HOST_SYNC (strip_host_padding)     EXPERT_LOOP
    ops                   all of RULES but ``narrow``,    grouped GEMMs, linear / matmul /   elementwise, last-dim
                          ``__matmul__``                  __matmul__, elementwise,           splits, getitem (GEMMs:
                                                          last-dim splits, getitem           planned by the loop)
    tag                   region_not_rowwise              region_not_rowwise                 per_expert_op_unsupported
    tail_rows             yes (NOTE [tail rows])          yes                                no
    host_inputs           no                              yes                                no
    operands              aligned                         broadcast                          unchecked
    grouped_mm_offsets    no                              yes                                -
    matmul_vector_weight  yes                             no                                 -
    split_dims            by position (unbind: 1)         chunk/split: 2, narrow: 1,         as HOST_SYNC
                                                          others by keyword
    getitem               rows_kept                       last_dims                          tuples
    spaces                yes (S and M)                   no                                 no

:func:`rowwise_region` collects and proves a host-sync region (``strip_host_padding``); ``fuse_dispatch``
classifies its region node by node (:meth:`RegionProof._rowwise`) with the same prover.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
import torch.fx as fx

from moe_compile.passes import NoMatch
from moe_compile.passes._graph import (
    arg,
    has_unbacked_shape,
    known_int,
    op_name,
    outside_users,
    same_int,
    tensor_val,
    topo_index,
    transitive_users,
)
from moe_compile.passes._host_sync import sym_expr
from moe_compile.passes.forms.ops import (
    ALONG_DIM,
    BINARY,
    CASTS,
    GROUPED_MM,
    LAST_DIM_SPLITS,
    REDUCTIONS,
    SPLITS,
    UNARY,
)

UNARY_ROWWISE = UNARY | CASTS
BINARY_ROWWISE = BINARY | {"clamp"}
DROPOUTS = frozenset({"dropout", "dropout_", "feature_alpha_dropout", "alpha_dropout"})
NORMS = frozenset({"layer_norm", "rms_norm", "group_norm"})
DENSE = frozenset({"linear", "matmul", "__matmul__", "mm"})
VIEWS = frozenset({"view", "reshape", "flatten", "unflatten", "expand", "expand_as", "permute", "transpose",
                   "movedim"})

# op name -> rule (later entries win: ``contiguous`` is a cast, ``clamp`` unary)
RULES: dict[str, str] = {
    **dict.fromkeys(VIEWS, "view"),
    **dict.fromkeys(REDUCTIONS | ALONG_DIM, "reduce"),
    **dict.fromkeys(NORMS, "norm"),
    **dict.fromkeys(DROPOUTS, "dropout"),
    **dict.fromkeys(("unsqueeze", "squeeze"), "unsqueeze"),
    "cat": "cat",
    **dict.fromkeys(SPLITS | LAST_DIM_SPLITS, "split"),
    "getitem": "getitem",
    **dict.fromkeys(DENSE, "dense"),
    **dict.fromkeys(GROUPED_MM, "grouped_mm"),
    **dict.fromkeys(BINARY_ROWWISE, "binary"),
    **dict.fromkeys(UNARY, "unary"),
    **dict.fromkeys(CASTS, "cast"),
}


# a table gathered by each row's index (a per-expert bias ``bias_EN[ids]``): each row reads its own entry, and a tail
# row's gradient (exactly 0) reaches the entry it read, not a weight every row shares
_ROW_GATHERS = frozenset({"getitem", "index_select", "embedding", "take"})


@dataclasses.dataclass(frozen=True)
class RowwisePolicy:
    """What one pass accepts as row-wise; each field is one difference between the passes."""

    name: str
    # the ops of RULES this pass accepts; any other op is refused
    ops: frozenset[str]
    # reason tag of a refusal (the host-input checks have their own tags)
    tag: str = "region_not_rowwise"
    # NOTE [tail rows]: in training, refuse a trained tensor from outside the region (a weight shared by all
    # rows) anywhere but a grouped GEMM (``shared_param_in_expert_region``). A grouped GEMM leaves the rows past
    # its last offset (the tail of a static row bound) unwritten; nothing reads them back, so their gradient is 0,
    # but a shared weight's gradient sums over every row, and 0 * a NaN left there is NaN (tests/passes/
    # test_fuse_dispatch.py::test_shared_trained_weight_between_the_gemms_and_tail_rows: translation validation
    # refused such a rewrite for a "non-finite pattern" before fuse_dispatch refused it here)
    tail_rows: bool = False
    # refuse host sizes (``host_size_in_expert_region``) and host-sized tensors from outside the region
    host_inputs: bool = False
    # tensor operands of elementwise ops from outside the region: "broadcast" (every one broadcasts along
    # rows), "aligned" (binary ops' and ``type_as``'s: in the region, broadcast along rows, or a function of
    # ``row_independent`` values; unary ops must read the region), "unchecked"
    operands: str = "unchecked"
    # a grouped GEMM reads offsets from outside the region, a [E, ., .] weight and nothing else (the pass
    # rewrites those offsets); otherwise only a bias is refused
    grouped_mm_offsets: bool = False
    # ``matmul(rows, w)`` with a 1-D ``w`` (one value per row) is row-wise
    matmul_vector_weight: bool = False
    # where each split reads its dim positionally (ops missing here: keyword only)
    split_dims: Mapping[str, int] = dataclasses.field(default_factory=dict)
    # ``getitem`` on a tensor: "rows_kept" (a leading full slice or an Ellipsis short of the row dim; no
    # tensors or None; a table lookup by row-independent ids), "last_dims" (a tuple index whose first entry
    # is a full slice or Ellipsis; no tensors), "tuples" (only items of tuples, no tensor indexing)
    getitem: str = "tuples"
    # row spaces are tracked (fuse_dispatch: sorted rows "S", padded rows "M"): every node reads exactly one
    spaces: bool = False


_HOST_SYNC_OPS = GROUPED_MM | {"linear", "matmul", "__matmul__"} | LAST_DIM_SPLITS | {"getitem"} \
    | UNARY_ROWWISE | BINARY_ROWWISE
DISPATCH = RowwisePolicy(
    "fuse_dispatch", frozenset(RULES) - {"narrow", "__matmul__"}, tail_rows=True, operands="aligned",
    matmul_vector_weight=True,
    split_dims={"chunk": 2, "split": 2, "tensor_split": 2, "split_with_sizes": 2, "unbind": 1}, getitem="rows_kept",
    spaces=True,
)
HOST_SYNC = RowwisePolicy(
    "strip_host_padding", frozenset(_HOST_SYNC_OPS), tail_rows=True, host_inputs=True, operands="broadcast",
    grouped_mm_offsets=True, split_dims={"chunk": 2, "split": 2, "narrow": 1}, getitem="last_dims",
)
EXPERT_LOOP = RowwisePolicy(
    "fuse_expert_loop", frozenset(UNARY_ROWWISE | BINARY_ROWWISE | LAST_DIM_SPLITS | {"getitem"}),
    tag="per_expert_op_unsupported", split_dims={"chunk": 2, "split": 2, "narrow": 1},
)


class Rowwise(NamedTuple):
    space: str  # the row space of the result ("rows"; fuse_dispatch: "S" sorted rows or "M" padded rows)
    offs: fx.Node | None  # the offsets a grouped GEMM reads


class RowwiseProof:
    """Proves nodes row-wise in ``region`` (node -> row space) under ``policy``.

    ``num_experts`` (if known) is checked against grouped GEMM weights; ``training`` turns on
    NOTE [tail rows]; ``row_independent(node)`` says a value is the same in any expert-sorted row order (fuse_dispatch:
    a function of the sorted expert ids).
    """

    def __init__(self, policy: RowwisePolicy, region: Mapping[fx.Node, str], num_experts: int | None = None,
                 training: bool = False, row_independent: Callable[[Any], bool] | None = None) -> None:
        self.policy = policy
        self.region = region
        self.num_experts = num_experts
        self.training = training
        self.row_independent = row_independent or (lambda _: False)

    def check(self, node: fx.Node) -> Rowwise:
        """The row space of ``node`` (and the offsets it reads) if it is row-wise, else raise NoMatch."""
        name = op_name(node)
        self._check_inputs(node, name)
        rule = RULES.get(name) if name in self.policy.ops else None
        if rule is None:
            raise self._fail(node, "is not a supported row-wise op")
        spaces: set[str] = set()
        offs = getattr(self, f"_{rule}")(node, name, spaces)
        if len(spaces) > 1 or (self.policy.spaces and not spaces):
            raise self._fail(node, "mixes padded and unpadded rows")
        return Rowwise(spaces.pop() if spaces else "rows", offs)

    # -- shared ---------------------------------------------------------------------------------------
    def _fail(self, node: fx.Node, why: str) -> NoMatch:
        return NoMatch(self.policy.tag, f"{node.name} ({op_name(node)}) {why}")

    def _inside(self, x: Any) -> bool:
        return isinstance(x, fx.Node) and x in self.region

    def _read(self, x: Any, spaces: set[str], node: fx.Node, why: str) -> None:
        """``x`` must be in the region: record its row space."""
        if not self._inside(x):
            raise self._fail(node, why)
        spaces.add(self.region[x])

    def _tensor_out(self, node: fx.Node) -> torch.Tensor:
        out = tensor_val(node)
        if out is None:
            raise self._fail(node, "has no tensor value")
        return out

    def _check_inputs(self, node: fx.Node, name: str | None) -> None:
        outside = [a for a in node.all_input_nodes if a not in self.region]
        if self.policy.tail_rows and self.training and name not in GROUPED_MM and name not in _ROW_GATHERS:
            out = tensor_val(node)
            for a in outside:
                av = tensor_val(a)
                per_row = av is not None and out is not None and av.dim() == out.dim() >= 1 \
                    and known_int(av.shape[0]) not in (None, 1) and same_int(av.shape[0], out.shape[0])
                if av is not None and av.requires_grad and not per_row:  # a per-row tensor is no shared weight
                    raise NoMatch("shared_param_in_expert_region",
                                  f"{node.name}: {a.name} is shared by all rows and trained (see NOTE [tail rows])")
        if self.policy.host_inputs:
            for a in outside:
                if tensor_val(a) is None and sym_expr(a) is not None:
                    raise NoMatch("host_size_in_expert_region", f"{node.name} uses host size {a.name}")
            for a in outside:
                if has_unbacked_shape(a):
                    raise self._fail(node, f"mixes in {a.name}, a host-sized tensor outside the region")

    def _aligned(self, x: Any, out: torch.Tensor, spaces: set[str]) -> bool:
        """A tensor operand: in the region, broadcast along rows, or row-independent."""
        if self._inside(x):
            spaces.add(self.region[x])
            return True
        if isinstance(x, (list, tuple)):
            return all(self._aligned(y, out, spaces) for y in x)
        v = tensor_val(x) if isinstance(x, fx.Node) else None
        if v is None:
            return True  # a constant, SymInt or scalar node
        if v.dim() < out.dim() or (v.dim() == out.dim() and v.dim() > 0 and same_int(v.shape[0], 1)):
            return True
        if self.row_independent(x):
            spaces.add("S")
            return True
        return False

    # -- rules ----------------------------------------------------------------------------------------
    def _grouped_mm(self, node: fx.Node, name: str, spaces: set[str]) -> fx.Node | None:
        x, w = node.args[0], node.args[1]
        if self._inside(w):
            raise self._fail(node, "grouped GEMM whose weight comes from the routed rows")
        self._read(x, spaces, node, "grouped GEMM whose input rows are not the routed rows")
        if not self.policy.grouped_mm_offsets:
            if arg(node, 3, "bias") is not None:
                raise self._fail(node, "grouped GEMM with a bias")
            return None
        offs = node.args[2] if len(node.args) > 2 else node.kwargs.get("offs")
        if not isinstance(offs, fx.Node) or offs in self.region:
            raise self._fail(node, "grouped GEMM without offsets from outside the region")
        wv = tensor_val(w)
        if wv is None or wv.dim() != 3 or (self.num_experts is not None and wv.shape[0] != self.num_experts):
            raise self._fail(node, "grouped GEMM weight is not [E, ., .]")
        if len(node.args) > 3 or set(node.kwargs) - {"offs", "out_dtype"}:
            raise self._fail(node, "grouped GEMM with a bias")
        return offs

    def _dense(self, node: fx.Node, name: str, spaces: set[str]) -> None:
        others = [a for a in (*node.args[1:], *node.kwargs.values()) if self._inside(a)]
        if others:
            raise self._fail(node, f"is not rows @ a shared weight ({others[0].name} comes from the rows)")
        self._read(node.args[0], spaces, node, "is not a projection of the routed rows")
        w = tensor_val(node.args[1])
        vector_ok = self.policy.matmul_vector_weight or name == "linear"
        if w is None or w.dim() > 2 or (w.dim() < 2 and not vector_ok):
            raise self._fail(node, "has a weight that is not 2-D")

    def _split(self, node: fx.Node, name: str, spaces: set[str]) -> None:
        position = self.policy.split_dims.get(name)
        dim = arg(node, position, "dim", 0) if position is not None else node.kwargs.get("dim", 0)
        src = tensor_val(node.args[0])
        if src is None or src.dim() < 2 or not isinstance(dim, int) or dim % src.dim() == 0:
            raise self._fail(node, "splits along the row dimension")
        if self._inside(node.args[0]):
            spaces.add(self.region[node.args[0]])

    def _getitem(self, node: fx.Node, name: str, spaces: set[str]) -> None:
        src, index = node.args[0], node.args[1]
        if not isinstance(tensor_val(src), torch.Tensor):
            # an item of a tuple: of a split (its row space), or (not fuse_dispatch) of any tuple by an int
            if self.policy.getitem == "rows_kept":
                if not (isinstance(index, int) and op_name(src) in SPLITS):
                    raise self._fail(node, "is an item of a tuple that is not a split")
            elif self.policy.getitem == "last_dims" and not isinstance(index, int):
                raise self._fail(node, "is an unsupported getitem")
            if self._inside(src):
                spaces.add(self.region[src])
            return
        getattr(self, f"_getitem_{self.policy.getitem}")(node, src, index, spaces)

    def _getitem_tuples(self, node: fx.Node, src: fx.Node, index: Any, spaces: set[str]) -> None:
        raise self._fail(node, "indexes a tensor")

    def _getitem_last_dims(self, node: fx.Node, src: fx.Node, index: Any, spaces: set[str]) -> None:
        if not (isinstance(index, tuple) and len(index) >= 2 and (index[0] is Ellipsis or index[0] == slice(None))
                and all(not isinstance(i, fx.Node) for i in index)):
            raise self._fail(node, "indexes over rows")
        if self._inside(src):
            spaces.add(self.region[src])

    def _getitem_rows_kept(self, node: fx.Node, src: fx.Node, index: Any, spaces: set[str]) -> None:
        if not self._inside(src):
            # table[ids_sorted]: per-row lookups of per-expert values (same in any expert-sorted order)
            if self._inside(index) and self.row_independent(index):
                spaces.add(self.region[index])
                return
            raise self._fail(node, "indexes with routed rows")
        items = index if isinstance(index, tuple) else (index,)
        if any(isinstance(i, fx.Node) or i is None for i in items):
            raise self._fail(node, "indexes the routed rows with tensors or adds dimensions")
        explicit = [i for i in items if i is not Ellipsis]
        if items[0] is Ellipsis:
            if len(explicit) >= tensor_val(src).dim():
                raise self._fail(node, "indexes the row dimension")
        elif items[0] != slice(None, None, None):
            raise self._fail(node, "slices the row dimension")
        spaces.add(self.region[src])

    def _elementwise(self, node: fx.Node, name: str, spaces: set[str], binary: bool) -> None:
        out = tensor_val(node)
        mode = self.policy.operands
        if mode == "unchecked":
            for a in node.all_input_nodes:
                if self._inside(a):
                    spaces.add(self.region[a])
            return
        if out is None and (mode == "aligned" or name not in CASTS):
            raise self._fail(node, "has no tensor value")
        if mode == "broadcast":
            for a in node.all_input_nodes:
                av = tensor_val(a)
                if self._inside(a):
                    spaces.add(self.region[a])
                elif av is not None and out is not None and av.dim() >= out.dim() and av.shape[0] != 1:
                    raise self._fail(node, f"has a per-row operand {a.name}")
            return
        if not binary:
            if name == "type_as" and not self._aligned(node.args[1], out, spaces):
                raise self._fail(node, "casts like a row-aligned tensor")
            self._read(node.args[0], spaces, node, "is not applied to the routed rows")
            return
        tensors = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node)]
        if not all(self._aligned(a, out, spaces) for a in tensors):
            raise self._fail(node, "combines the routed rows with a row-aligned tensor in another order")
        rows = next((tensor_val(a).shape[0] for a in node.all_input_nodes if self._inside(a)), None)
        if out.dim() == 0 or not same_int(out.shape[0], rows):
            raise self._fail(node, "changes the number of rows")

    def _unary(self, node: fx.Node, name: str, spaces: set[str]) -> None:
        self._elementwise(node, name, spaces, binary=False)

    _cast = _unary

    def _binary(self, node: fx.Node, name: str, spaces: set[str]) -> None:
        self._elementwise(node, name, spaces, binary=True)

    def _dropout(self, node: fx.Node, name: str, spaces: set[str]) -> None:
        self._tensor_out(node)
        if arg(node, 1, "p", 0.5) not in (0, 0.0) and arg(node, 2, "training", True):
            raise self._fail(node, "is a random dropout (row order changes the random mask)")
        self._read(node.args[0], spaces, node, "drops out a tensor from outside the region")

    def _norm(self, node: fx.Node, name: str, spaces: set[str]) -> None:
        self._tensor_out(node)
        if any(self._inside(a) for a in node.args[1:]):
            raise self._fail(node, "normalizes with row-aligned parameters")
        if name == "group_norm":
            raise self._fail(node, "mixes rows (group_norm)")
        self._read(node.args[0], spaces, node, "normalizes a tensor from outside the region")

    def _reduce(self, node: fx.Node, name: str, spaces: set[str]) -> None:
        self._tensor_out(node)
        src = tensor_val(node.args[0])
        dim = arg(node, 1, "dim", None)
        if not self._inside(node.args[0]) or dim is None:
            raise self._fail(node, "reduces over all elements")
        dims = dim if isinstance(dim, (list, tuple)) else (dim,)
        if any(not isinstance(d, int) or d % src.dim() == 0 for d in dims):
            raise self._fail(node, "reduces over the row dimension")
        spaces.add(self.region[node.args[0]])

    def _unsqueeze(self, node: fx.Node, name: str, spaces: set[str]) -> None:
        self._tensor_out(node)
        src = tensor_val(node.args[0])
        dim = arg(node, 1, "dim")
        if name == "unsqueeze" and (dim == 0 or (dim < 0 and dim % (src.dim() + 1) == 0)):
            raise self._fail(node, "adds a leading dimension")
        if name == "squeeze" and (dim is None or dim % src.dim() == 0):
            raise self._fail(node, "may squeeze the row dimension")
        self._read(node.args[0], spaces, node, "reshapes a tensor from outside the region")

    def _view(self, node: fx.Node, name: str, spaces: set[str]) -> None:
        out, src = self._tensor_out(node), tensor_val(node.args[0])
        self._read(node.args[0], spaces, node, "reshapes a row-aligned tensor")
        if name in ("permute", "transpose", "movedim"):
            raise self._fail(node, "moves the row dimension")
        if name == "flatten" and arg(node, 1, "start_dim", 0) % max(src.dim(), 1) == 0:
            raise self._fail(node, "flattens the row dimension")
        if out.dim() == 0 or src.dim() == 0 or not same_int(out.shape[0], src.shape[0]):
            raise self._fail(node, "changes the number of rows")
        if name == "unflatten" and arg(node, 1, "dim") % src.dim() == 0:
            raise self._fail(node, "splits the row dimension")

    def _cat(self, node: fx.Node, name: str, spaces: set[str]) -> None:
        parts, out = arg(node, 0, "tensors"), self._tensor_out(node)
        if arg(node, 1, "dim", 0) % out.dim() == 0:
            raise self._fail(node, "concatenates along rows")
        for p in parts:
            self._read(p, spaces, node, "concatenates routed rows with other tensors")


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


def rowwise_region(
    X: fx.Node, Y: fx.Node, num_experts: int | None, y_consumers: set[fx.Node]
) -> tuple[list[fx.Node], list[fx.Node], list[fx.Node]]:
    """The expert region from ``X`` to ``Y`` proven row-wise under :data:`HOST_SYNC` and closed: returns (its
    nodes in graph order, the grouped GEMMs reading offsets, those offsets nodes). Only ``Y`` may also feed
    ``y_consumers``; any other use outside the region raises ``expert_region_escapes``."""
    middle = region_nodes(X, Y)
    if Y not in middle:
        raise NoMatch("region_not_rowwise", f"{Y.name} is not computed from {X.name}")
    inside = set(middle) | {X}
    training = bool(getattr(tensor_val(Y), "requires_grad", False))
    proof = RowwiseProof(HOST_SYNC, dict.fromkeys(inside, "rows"), num_experts, training)
    offs_uses: list[fx.Node] = []
    offs_nodes: list[fx.Node] = []
    for node in middle:
        offs = proof.check(node).offs
        if offs is not None:
            offs_uses.append(node)
            if offs not in offs_nodes:
                offs_nodes.append(offs)
        allowed = inside | y_consumers if node is Y else inside
        escaping = outside_users([node], allowed)
        if escaping:
            raise NoMatch("expert_region_escapes", f"{node.name} is also used by {escaping[0].name}")
    return middle, offs_uses, offs_nodes


__all__ = [
    "BINARY_ROWWISE", "DISPATCH", "EXPERT_LOOP", "HOST_SYNC", "RULES", "UNARY_ROWWISE", "Rowwise", "RowwisePolicy",
    "RowwiseProof", "region_nodes", "rowwise_region",
]
