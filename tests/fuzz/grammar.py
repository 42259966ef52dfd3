"""The grammar of MoE layers the fuzzer writes: tables of spellings and a :class:`Spec` that picks one of each.

A layer is ``route -> dispatch -> experts -> combine (+ shared expert)``; each step has several spellings, as
people write them (transformers, DeepSeek, Megatron, torchtitan, GShard, research code) and a few that are
plausible but that no pass knows. :func:`draw` picks a :class:`Spec` through a ``choose(name, options)`` callback,
so one grammar serves Hypothesis (``data.draw(sampled_from)``) and a seeded ``random.Random`` (the corpus and the
long run); :mod:`tests.fuzz.emit` writes the layer of a spec as Python source.

The tables of expression spellings (``PERMUTES``, ``COUNTS``) are source lines over fixed names: ``ids_S`` (the
flattened expert ids), ``idx_TK``, ``E``; a permutation defines ``ids_sorted_S`` and ``perm_S``, a count
``counts_E``. ``tests/models/composed.py`` takes the subset every dispatch pass must rewrite from these tables.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

# ---- permutation of the flattened ids: defines ids_sorted_S, perm_S ----------------------------------------
PERMUTES: dict[str, str] = {
    "sort": "ids_sorted_S, perm_S = torch.sort(ids_S)",
    "sort_stable": "ids_sorted_S, perm_S = torch.sort(ids_S, stable=True)",
    "argsort_stable": "perm_S = torch.argsort(ids_S, stable=True)\nids_sorted_S = ids_S[perm_S]",
    "argsort": "perm_S = torch.argsort(ids_S)\nids_sorted_S = ids_S[perm_S]",
    "argsort_method_gather": "perm_S = ids_S.argsort(stable=True)\nids_sorted_S = ids_S.gather(0, perm_S)",
    # plausible, unknown to the passes: a unique composite key (stable by construction), float ids
    "sort_composite_key": "key_S = ids_S * ids_S.shape[0] + torch.arange(ids_S.shape[0], device=ids_S.device)\n"
                          "perm_S = torch.sort(key_S).indices\nids_sorted_S = ids_S[perm_S]",
    "sort_float": "ids_sorted_f_S, perm_S = torch.sort(ids_S.float(), stable=True)\n"
                  "ids_sorted_S = ids_sorted_f_S.long()",
    # Megatron's unfused permute (masked_select over the [E, T] routing map): written by the emitter itself
    "masked_select": "",
}

# ---- tokens per expert: defines counts_E -------------------------------------------------------------------
COUNTS: dict[str, str] = {
    "histc": "counts_E = torch.histc(ids_S.float(), bins=E, min=0, max=E - 1)",
    "histc_sorted": "counts_E = torch.histc(ids_sorted_S.float(), bins=E, min=0, max=E - 1)",
    "one_hot_sum": "counts_E = F.one_hot(ids_S, E).sum(0)",
    "eq_arange_sum": "counts_E = (ids_S.unsqueeze(1) == torch.arange(E, device=ids_S.device)).sum(0)",
    "histc_max_E": "counts_E = torch.histc(ids_S.float(), bins=E, min=0, max=E)",
    "bincount": "counts_E = torch.bincount(ids_S, minlength=E)",
    "one_hot_TK_sum": "counts_E = F.one_hot(idx_TK, E).sum((0, 1))",
    # plausible, unknown to the passes
    "scatter_add_ones": "counts_E = torch.zeros(E, dtype=torch.long, device=ids_S.device)"
                        ".scatter_add_(0, ids_S, torch.ones_like(ids_S))",
    "searchsorted_diff": "counts_E = torch.searchsorted(ids_sorted_S, torch.arange(E + 1, device=ids_S.device))"
                         ".diff()",
}
SORTED_ONLY_COUNTS = ("histc_sorted", "searchsorted_diff")  # read ids_sorted_S

COUNT_PLACES = ("device", "host")  # host: sizes read with .tolist()
PADDINGS = ("none", "device_static", "host_pad", "host_cat")
# accumulating combines (into a zeros [T, H] buffer at the token index)
ACCUMULATES = ("index_add", "scatter_add", "index_put_acc", "index_add_functional", "custom_scatter")
# un-permute, then reduce over the top-k slots of the [T, K, H] view
UNPERMUTES = ("inverse_gather", "scatter_unpermute", "argsort_gather", "index_copy")
REDUCES = ("sum", "einsum", "bmm")
COMBINES = ACCUMULATES + tuple(f"{u}_{r}" for u in UNPERMUTES for r in REDUCES)
# where the routing weight multiplies: the sorted expert outputs (fp32 / activation dtype), the sorted rows
# before the experts, the un-permuted [T, K, H] view (sum reduce), or inside the reduce (einsum / bmm)
WEIGHTS = ("rows_fp32", "rows_act", "before_experts", "after_unpermute", "in_combine")

DISPATCHES = ("sorted", "masked", "loop", "hit_loop", "skip_loop", "dense", "batched", "capacity", "expert_choice",
              "drop_and_pad")
EXECS = ("grouped_mm", "hf_fallback", "split_loop")
SELECTS = ("eq", "one_hot", "nonzero", "mask_any")
LOOP_COMBINES = ("index_add", "index_put_acc", "setitem_add")
LAYOUTS = ("stacked_cat", "stacked_t", "stacked_sep", "module_list")
MLPS = ("swiglu", "swiglu_manual", "geglu", "geglu_tanh", "gelu", "relu")
GATED = ("swiglu", "swiglu_manual", "geglu", "geglu_tanh")
GLU_SPLITS = ("chunk", "slice", "interleaved")

DTYPES = ("bf16", "fp16", "fp32")
MODES = ("train", "eval", "eval_grad")
ENTRIES = ("fullgraph", "default", "moe_compile")


# The spellings the passes are documented to know (docs/passes.md, "What the passes recognise"): half of the draws
# keep to them (and a loop over the experts hit gets what the swap reads), so that rewrites are frequent; the other
# half take any spelling.
TAME: dict[str, tuple[Any, ...]] = {
    "dispatch": ("sorted", "masked", "loop", "hit_loop", "skip_loop"),
    "permute": ("sort", "sort_stable", "argsort_stable", "argsort", "argsort_method_gather"),
    "counts": ("histc", "histc_sorted", "one_hot_sum", "eq_arange_sum", "histc_max_E", "bincount", "one_hot_TK_sum"),
    "token": ("div", "floor_divide"),
    "gather": ("index", "index_select", "gather"),
    "combine": ("index_add", "scatter_add", "index_put_acc", "inverse_gather_sum", "scatter_unpermute_sum",
                "argsort_gather_sum") + LOOP_COMBINES,
    "exec": ("grouped_mm", "hf_fallback"),
    "router_fn": ("none",),
    "rows_fn": ("none",),
}


@dataclasses.dataclass(frozen=True)
class Spec:
    """One MoE layer and how it is run. The defaults are ``tests/models/composed.py``'s layer."""

    seed: int = 0
    # shapes
    tokens: int = 10
    hidden: int = 16
    inter: int = 32
    experts: int = 4
    top_k: int = 2
    align: int = 8
    batch3d: bool = False
    depth: int = 1  # MoE blocks stacked with residual connections
    # how it runs
    dtype: str = "bf16"
    mode: str = "train"  # train: module.train() + backward; eval: no_grad; eval_grad: module.eval() + backward
    x_grad: bool = True
    frozen: str = "none"  # none | router | experts | all: parameters with requires_grad off
    entry: str = "fullgraph"  # torch.compile(fullgraph=True) | torch.compile() | moe_compile.compile()
    dynamic: bool = False  # compiled with dynamic=True
    validate: bool = False  # translation validation (moe_compile.config's validate; off for users by default)
    second_call: str = "none"  # none | same_shape | new_shape: a second call on other tokens (three more of them)
    # router
    router: str = "param"  # param: F.linear(x, self.router) | linear: self.gate = nn.Linear(H, E)
    router_dtype: str = "fp32"  # fp32: logits.float() | act | linear_fp32: F.linear(x.float(), w.float())
    score: str = "softmax"  # softmax | softmax_dtype | sigmoid
    topk_on: str = "scores"  # scores | logits: top-k of the logits, softmax over the k values (Granite)
    groups: int = 0  # group-limited routing (DeepSeek): n_group, topk_group = n_group // 2
    expert_bias: bool = False  # aux-loss-free selection bias (DeepSeek-V3): selects, does not weight
    renorm: str = "sum"  # none | sum | sum_eps | sum_inplace
    route_scale: float = 1.0
    router_fn: str = "none"  # none | grad_scale_logits | grad_scale_weights | straight_through
    weights_dtype: str = "fp32"  # fp32 | act: the routing weights cast to the activation dtype
    aux_loss: bool = False  # in training, also return a load-balancing loss
    # dispatch
    dispatch: str = "sorted"
    flatten: str = "reshape"  # reshape | view | flatten
    permute: str = "sort"
    token: str = "div"  # div | floor_divide | repeat_interleave
    gather: str = "index"  # index | index_select | gather | custom_fn
    counts: str = "histc"
    count_place: str = "device"
    offsets: str = "cumsum_int32"  # cumsum_int32 | cumsum_to
    padding: str = "none"
    exec: str = "grouped_mm"
    select: str = "eq"
    # experts
    layout: str = "stacked_cat"
    mlp: str = "swiglu"
    glu_split: str = "chunk"
    bias: bool = False
    # weight, combine, extras
    weight: str = "rows_fp32"
    combine: str = "index_add"
    shared: str = "none"  # none | plain | gated
    rows_fn: str = "none"  # none | grad_scale: a custom autograd function on the expert outputs

    def __str__(self) -> str:
        default = Spec()
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                        if getattr(self, f.name) != getattr(default, f.name)) or "composed-default"

    @property
    def host(self) -> bool:
        return self.count_place == "host"

    @property
    def gated(self) -> bool:
        return self.mlp in GATED

    @property
    def backward(self) -> bool:
        return self.mode != "eval"

    @property
    def combine_parts(self) -> tuple[str, str] | None:
        """``(unpermute, reduce)`` of a sum combine, ``None`` for an accumulating one."""
        if self.combine in ACCUMULATES:
            return None
        unpermute, _, reduce = self.combine.rpartition("_")
        return unpermute, reduce

    def replace(self, **changes: Any) -> Spec:
        return dataclasses.replace(self, **changes)


Choose = Callable[[str, Sequence[Any]], Any]


def draw(choose: Choose) -> Spec:
    """A spec whose choices are made by ``choose(name, options)``; every spec drawn is a coherent layer."""
    wild, tame = choose, choose("tame", (True, False))
    pinned: dict[str, tuple[Any, ...]] = {}

    def choose(name: str, options: Sequence[Any]) -> Any:
        if tame and name in TAME:
            options = [o for o in options if o in TAME[name]]
        if tame and name in pinned:
            options = [o for o in options if o in pinned[name]] or options
        return wild(name, options)

    c: dict[str, Any] = {"seed": choose("seed", range(1 << 16))}
    c["dtype"] = dtype = choose("dtype", ("bf16", "bf16", "fp16", "fp32"))
    c["mode"] = mode = choose("mode", MODES)
    c["experts"] = E = choose("experts", (2, 3, 4, 8))
    c["top_k"] = K = choose("top_k", tuple(k for k in (1, 2, 3) if k <= E))
    c["tokens"] = choose("tokens", (1, 5, 8, 13))
    c["hidden"] = choose("hidden", (8, 16))
    c["inter"] = choose("inter", (8, 16))
    c["align"] = choose("align", (8, 16))
    c["batch3d"] = choose("batch3d", (False, True))
    c["depth"] = choose("depth", (1, 1, 2))
    c["x_grad"] = choose("x_grad", (True, False)) if mode != "eval" else False
    c["frozen"] = choose("frozen", ("none", "none", "router", "experts", "all")) if mode != "eval" else "none"
    dispatch = c["dispatch"] = choose("dispatch", DISPATCHES + ("sorted", "sorted", "loop"))
    if dispatch in ("hit_loop", "skip_loop"):  # what moe_compile.compile's swap reads: a gate Linear, ModuleList
        pinned.update(router=("linear",), layout=("module_list",))
    _draw_router(choose, c, E, K)
    c["aux_loss"] = choose("aux_loss", (False, True)) if mode == "train" else False
    host = False
    if dispatch in ("sorted", "masked"):
        host = _draw_sorted(choose, c, dtype, dispatch)
    elif dispatch in ("loop", "hit_loop", "skip_loop"):
        c["select"] = {"loop": None, "hit_loop": "one_hot", "skip_loop": "eq"}[dispatch] or choose("select", SELECTS)
        c["combine"] = choose("combine", LOOP_COMBINES)
        c["weight"] = choose("weight", ("rows_fp32", "rows_act", "before_experts"))
    elif dispatch == "batched":
        c["weight"] = choose("weight", ("rows_fp32", "rows_act", "after_unpermute"))
    elif dispatch in ("dense", "capacity"):
        c["weight"] = choose("weight", ("rows_fp32", "rows_act"))
    elif dispatch in ("expert_choice", "drop_and_pad"):
        c["weight"] = choose("weight", ("rows_fp32", "rows_act"))
        c["combine"] = choose("combine", ("index_add", "scatter_add"))
    c["layout"] = layout = choose("layout", LAYOUTS)
    c["mlp"] = choose("mlp", MLPS)
    if c["mlp"] in GATED and layout in ("stacked_cat", "stacked_t"):
        c["glu_split"] = choose("glu_split", GLU_SPLITS)
    c["bias"] = choose("bias", (False, True)) if _bias_possible(c) else False
    c["shared"] = choose("shared", ("none", "none", "plain", "gated"))
    c["rows_fn"] = choose("rows_fn", ("none", "none", "grad_scale"))
    c["entry"] = choose("entry", _entries(dispatch, host))
    c["dynamic"] = choose("dynamic", (False, False, True))
    c["validate"] = choose("validate", (False, True))
    c["second_call"] = choose("second_call", ("none", "same_shape", "new_shape"))
    return Spec(**c)


def _draw_router(choose: Choose, c: dict[str, Any], E: int, K: int) -> None:
    c["router"] = choose("router", ("param", "linear"))
    c["router_dtype"] = choose("router_dtype", ("fp32", "act", "linear_fp32"))
    c["score"] = score = choose("score", ("softmax", "softmax_dtype", "sigmoid"))
    c["topk_on"] = topk_on = choose("topk_on", ("scores", "logits")) if score != "sigmoid" else "scores"
    if topk_on == "scores":
        groups = choose("groups", (0, 2, 4))
        if groups and (E % groups or E // groups < 2 or K > E // groups * (groups // 2)):
            groups = 0
        c["groups"] = groups
        c["expert_bias"] = choose("expert_bias", (False, True))
    c["renorm"] = choose("renorm", ("none", "sum", "sum_eps", "sum_inplace")) if topk_on == "scores" else "none"
    c["route_scale"] = choose("route_scale", (1.0, 2.5))
    c["router_fn"] = choose("router_fn", ("none", "none", "grad_scale_logits", "grad_scale_weights",
                                          "straight_through"))
    c["weights_dtype"] = choose("weights_dtype", ("fp32", "act"))


def _draw_sorted(choose: Choose, c: dict[str, Any], dtype: str, dispatch: str) -> bool:
    """The sort-based and masked_select dispatches; returns whether sizes are read on the host."""
    masked = dispatch == "masked"
    c["permute"] = "masked_select" if masked else choose("permute", tuple(p for p in PERMUTES if p != "masked_select"))
    c["flatten"] = choose("flatten", ("reshape", "view", "flatten"))
    counts = tuple(n for n in COUNTS if not (masked and n in SORTED_ONLY_COUNTS))
    c["counts"] = choose("counts", counts)
    if not masked:
        c["token"] = choose("token", ("div", "floor_divide", "repeat_interleave"))
        c["gather"] = choose("gather", ("index", "index_select", "gather", "custom_fn"))
    execs = ("grouped_mm", "split_loop") if dtype == "bf16" else ("hf_fallback", "split_loop")
    c["exec"] = exec_ = choose("exec", execs)
    host = masked or exec_ == "split_loop" or choose("count_place", COUNT_PLACES) == "host"
    c["count_place"] = "host" if host else "device"
    c["offsets"] = choose("offsets", ("cumsum_int32", "cumsum_to"))
    if exec_ == "split_loop":
        c["padding"] = "none"
    elif host:
        c["padding"] = choose("padding", ("none", "host_pad", "host_cat"))
    else:
        c["padding"] = choose("padding", ("none", "device_static"))
    combines = ACCUMULATES if masked else COMBINES
    c["combine"] = combine = choose("combine", combines)
    reduce = combine.rpartition("_")[2] if combine not in ACCUMULATES else None
    if reduce in ("einsum", "bmm"):
        c["weight"] = "in_combine"
    else:
        c["weight"] = choose("weight", ("rows_fp32", "rows_act", "before_experts")
                             + (("after_unpermute",) if reduce == "sum" else ()))
    return host


def _bias_possible(c: dict[str, Any]) -> bool:
    """Per-expert biases: everywhere but a grouped GEMM over padded or masked_select rows (whose expert ids per
    row the layer does not have)."""
    grouped = c["dispatch"] in ("sorted", "masked") and c.get("exec") != "split_loop"
    return not (grouped and (c["dispatch"] == "masked" or c.get("padding", "none") != "none"))


def _entries(dispatch: str, host: bool) -> tuple[str, ...]:
    """How the layer is compiled: a loop over the experts hit (``.tolist()`` of a ``nonzero``) or one that skips
    the experts without tokens (``if counts[e] == 0``) cannot be traced whole, so ``fullgraph=True`` is out there."""
    if dispatch in ("hit_loop", "skip_loop"):
        return ("moe_compile", "default")
    return ("fullgraph", "fullgraph", "moe_compile", "default")


def random_choose(rng: Any) -> Choose:
    """``choose`` for a seeded ``random.Random``."""
    return lambda name, options: rng.choice(list(options))


def corpus(n: int, seed: int = 0) -> list[Spec]:
    """A fixed, seeded set of ``n`` specs (the never-worse script's corpus)."""
    import random

    rng = random.Random(seed)
    return [draw(random_choose(rng)) for _ in range(n)]
