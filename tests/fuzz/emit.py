"""Python source of the MoE layer a :class:`~tests.fuzz.grammar.Spec` describes.

:func:`source` writes a module with one ``class Layer(nn.Module)`` (``Layer(dtype, seed)``, ``forward(x)``) and the
custom autograd functions it uses; :func:`build` execs it. The source is what a person would write, so a failing
example prints as a script that needs nothing from this package (:func:`script`). This module writes the layer's
skeleton, router, experts and shared expert; :mod:`tests.fuzz.emit_dispatch` writes the dispatch and the combine.

Names in the forward: ``x_TH`` the tokens, ``logits_TE``, ``scores_TE``, ``w_TK`` (routing weights), ``idx_TK``
(expert ids), ``T H E K`` the sizes; expert weights are ``[E, N, K]`` stacks (``stacked_cat``: ``w13_EIH`` with gate
and up concatenated; ``stacked_t``: ``w13_EHI``, GPT-OSS's layout; ``stacked_sep``: ``w1_EIH`` / ``w3_EIH``) or an
``nn.ModuleList`` of ``Expert`` modules (``module_list``).
"""

from __future__ import annotations

import textwrap
import types
from typing import Any

import torch

from tests.fuzz.emit_dispatch import dispatch_lines
from tests.fuzz.grammar import Spec

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

ACT = {"swiglu": "F.silu({})", "swiglu_manual": "{0} * torch.sigmoid({0})", "geglu": "F.gelu({})",
       "geglu_tanh": "F.gelu({}, approximate='tanh')", "gelu": "F.gelu({})", "relu": "F.relu({})"}

FUNCTIONS = {
    "GradScale": '''
class GradScale(torch.autograd.Function):
    """Identity forward, gradient scaled by ``scale``: a backward that is not the forward's derivative."""

    @staticmethod
    def forward(ctx, t, scale):
        ctx.scale = scale
        return t.clone()

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None
''',
    "StraightThrough": '''
class StraightThrough(torch.autograd.Function):
    """Hard routing weights (ones) forward; the gradient reaches the soft weights unchanged."""

    @staticmethod
    def forward(ctx, w):
        return torch.ones_like(w)

    @staticmethod
    def backward(ctx, g):
        return g
''',
    "GatherRows": '''
class GatherRows(torch.autograd.Function):
    """``x[index]`` with a hand-written backward (an ``index_add_`` into zeros)."""

    @staticmethod
    def forward(ctx, x, index):
        ctx.save_for_backward(index)
        ctx.rows = x.shape[0]
        return x[index]

    @staticmethod
    def backward(ctx, g):
        (index,) = ctx.saved_tensors
        return g.new_zeros(ctx.rows, g.shape[1]).index_add_(0, index, g), None
''',
    "ScatterRows": '''
class ScatterRows(torch.autograd.Function):
    """Rows added into ``[rows, H]`` zeros at ``index``, with a hand-written backward (a gather)."""

    @staticmethod
    def forward(ctx, ys, index, rows):
        ctx.save_for_backward(index)
        return ys.new_zeros(rows, ys.shape[1]).index_add_(0, index, ys)

    @staticmethod
    def backward(ctx, g):
        (index,) = ctx.saved_tensors
        return g[index], None, None
''',
}


def _functions(spec: Spec) -> list[str]:
    used = []
    if "grad_scale" in spec.router_fn or spec.rows_fn == "grad_scale":
        used.append("GradScale")
    if spec.router_fn == "straight_through":
        used.append("StraightThrough")
    if spec.gather == "custom_fn" and spec.dispatch == "sorted":
        used.append("GatherRows")
    if spec.combine == "custom_scatter" and spec.dispatch in ("sorted", "masked"):
        used.append("ScatterRows")
    return used


def source(spec: Spec) -> str:
    """The module source of ``spec``'s layer."""
    parts = [f'"""MoE layer written by tests.fuzz: {spec}"""\n', "import itertools  # noqa: F401",
             "", "import torch", "import torch.nn.functional as F", "from torch import nn", ""]
    if spec.exec == "hf_fallback" and spec.dispatch in ("sorted", "masked"):
        # registers torch.ops.transformers.grouped_mm_fallback
        parts[-1:-1] = ["import transformers.integrations.moe  # noqa: F401"]
    parts += [FUNCTIONS[name] for name in _functions(spec)]
    if spec.layout == "module_list":
        parts.append(_expert_module(spec))
    parts.append(_layer(spec))
    return "\n".join(parts) + "\n"


def build(spec: Spec, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The layer of ``spec`` with its seeded weights, in ``dtype`` (default: the spec's)."""
    module = load(source(spec))
    return module.Layer(dtype=dtype or DTYPES[spec.dtype], seed=spec.seed)


def load(src: str, name: str = "fuzz_layer") -> types.ModuleType:
    """Exec ``src`` as a module (its classes keep a real ``__module__``, so Dynamo and pickling see them)."""
    import sys

    module = types.ModuleType(name)
    module.__dict__["__file__"] = f"<{name}>"
    exec(compile(src, f"<{name}>", "exec"), module.__dict__)  # noqa: S102 - the fuzzer's own generated source
    sys.modules.setdefault(name, module)
    return module


# ---- the layer ---------------------------------------------------------------------------------------------


ACT_MODULES = {"swiglu": "nn.SiLU()", "swiglu_manual": "SigmoidGate()", "geglu": "nn.GELU()",
               "geglu_tanh": "nn.GELU(approximate='tanh')", "gelu": "nn.GELU()", "relu": "nn.ReLU()"}


def _expert_module(spec: Spec) -> str:
    """``Expert``: one MLP of ``nn.Linear`` projections and an ``act_fn`` module (transformers 4.x's layout)."""
    bias = spec.bias
    if spec.gated:
        body = (f"        self.gate_proj = nn.Linear(hidden, inter, bias={bias})\n"
                f"        self.up_proj = nn.Linear(hidden, inter, bias={bias})\n"
                f"        self.down_proj = nn.Linear(inter, hidden, bias={bias})\n")
        fwd = "self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))"
    else:
        body = (f"        self.fc1 = nn.Linear(hidden, inter, bias={bias})\n"
                f"        self.fc2 = nn.Linear(inter, hidden, bias={bias})\n")
        fwd = "self.fc2(self.act_fn(self.fc1(x)))"
    extra = ""
    if spec.mlp == "swiglu_manual":
        extra = ("\nclass SigmoidGate(nn.Module):\n    def forward(self, g):\n        return g * torch.sigmoid(g)\n\n")
    return (f"{extra}\nclass Expert(nn.Module):\n    def __init__(self, hidden, inter):\n        super().__init__()\n"
            f"{body}        self.act_fn = {ACT_MODULES[spec.mlp]}\n\n    def forward(self, x):\n        return {fwd}\n")


def _param(name: str, scale: str, shape: str) -> str:
    return f"        self.{name} = nn.Parameter(({scale} * torch.randn({shape}, generator=gen)).to(dtype))"


def _init(spec: Spec) -> list[str]:
    E, H, I, K = spec.experts, spec.hidden, spec.inter, spec.top_k  # noqa: E741 - the shape legend's I
    N1 = 2 * I if spec.gated and spec.layout in ("stacked_cat", "stacked_t") else I
    out = ["    def __init__(self, dtype=torch.bfloat16, seed=0):", "        super().__init__()",
           "        gen = torch.Generator().manual_seed(seed)",
           f"        self.num_experts, self.top_k, self.align = {E}, {K}, {spec.align}"]
    if spec.router == "param":
        out.append(_param("router", f"{H} ** -0.5", f"{E}, {H}"))
    else:
        out += [f"        self.gate = nn.Linear({H}, {E}, bias=False, dtype=dtype)",
                "        with torch.no_grad():",
                f"            self.gate.weight.copy_({H} ** -0.5 * torch.randn({E}, {H}, generator=gen))"]
    if spec.expert_bias:
        out.append(f"        self.register_buffer('e_bias', 0.1 * torch.randn({E}, generator=gen))")
    if spec.layout == "stacked_cat":
        out += [_param("w13_EIH", f"{H} ** -0.5", f"{E}, {N1}, {H}"),
                _param("w2_EHI", f"{I} ** -0.5", f"{E}, {H}, {I}")]
    elif spec.layout == "stacked_t":
        out += [_param("w13_EHI", f"{H} ** -0.5", f"{E}, {H}, {N1}"),
                _param("w2_EIH", f"{I} ** -0.5", f"{E}, {I}, {H}")]
    elif spec.layout == "stacked_sep":
        out.append(_param("w1_EIH", f"{H} ** -0.5", f"{E}, {I}, {H}"))
        if spec.gated:
            out.append(_param("w3_EIH", f"{H} ** -0.5", f"{E}, {I}, {H}"))
        out.append(_param("w2_EHI", f"{I} ** -0.5", f"{E}, {H}, {I}"))
    else:
        out += [f"        self.experts = nn.ModuleList(Expert({H}, {I}) for _ in range({E})).to(dtype)",
                "        with torch.no_grad():", "            for p in self.experts.parameters():",
                "                scale = 0.1 if p.dim() == 1 else p.shape[-1] ** -0.5",
                "                p.copy_(scale * torch.randn(p.shape, generator=gen))"]
    if spec.bias and spec.layout != "module_list":
        first = ("b1_EI", "b3_EI") if spec.layout == "stacked_sep" and spec.gated else (
            ("b1_EI",) if spec.layout == "stacked_sep" else ("b13_EI",))
        for name in first:
            out.append(_param(name, "0.1", f"{E}, {N1}"))
        out.append(_param("b2_EH", "0.1", f"{E}, {H}"))
    if spec.shared != "none":
        out += [_param("s_up", f"{H} ** -0.5", f"{2 * I}, {H}"), _param("s_down", f"{I} ** -0.5", f"{H}, {I}")]
        if spec.shared == "gated":
            out.append(_param("s_gate", f"{H} ** -0.5", f"1, {H}"))
    return out


def _softmax(spec: Spec, t: str) -> str:
    return f"torch.softmax({t}, dim=-1, dtype=torch.float32)" if spec.score == "softmax_dtype" else f"{t}.softmax(-1)"


def router_lines(spec: Spec) -> list[str]:
    """Router: defines ``w_TK``, ``idx_TK`` (and ``scores_TE`` for the aux loss)."""
    weight = "self.router" if spec.router == "param" else "self.gate.weight"
    linear = "F.linear(x_TH, self.router)" if spec.router == "param" else "self.gate(x_TH)"
    out = [{"fp32": f"logits_TE = {linear}.float()", "act": f"logits_TE = {linear}",
            "linear_fp32": f"logits_TE = F.linear(x_TH.float(), {weight}.float())"}[spec.router_dtype]]
    if spec.router_fn == "grad_scale_logits":
        out.append("logits_TE = GradScale.apply(logits_TE, 0.5)")
    if spec.topk_on == "logits":
        out += ["top_TK, idx_TK = torch.topk(logits_TE, K, dim=-1)", f"w_TK = {_softmax(spec, 'top_TK')}"]
        if spec.aux_loss:
            out.append(f"scores_TE = {_softmax(spec, 'logits_TE')}")
    else:
        score = "logits_TE.sigmoid()" if spec.score == "sigmoid" else _softmax(spec, "logits_TE")
        out.append(f"scores_TE = {score}")
        if spec.groups or spec.expert_bias:
            out.append("choice_TE = scores_TE + self.e_bias" if spec.expert_bias else "choice_TE = scores_TE")
            if spec.groups:
                G, n = spec.groups, spec.experts // spec.groups
                out += [f"group_TG = choice_TE.view(T, {G}, {n}).topk(2, dim=-1)[0].sum(-1)",
                        f"gidx_TG = torch.topk(group_TG, k={G // 2}, dim=-1, sorted=False)[1]",
                        "gmask_TG = torch.zeros_like(group_TG).scatter_(1, gidx_TG, 1)",
                        f"smask_TE = gmask_TG.unsqueeze(-1).expand(T, {G}, {n}).reshape(T, E)",
                        "choice_TE = choice_TE.masked_fill(~smask_TE.bool(), 0.0)"]
            out += ["idx_TK = torch.topk(choice_TE, K, dim=-1, sorted=False)[1]", "w_TK = scores_TE.gather(1, idx_TK)"]
        else:
            out.append("w_TK, idx_TK = torch.topk(scores_TE, K, dim=-1)")
    out += {"none": [], "sum": ["w_TK = w_TK / w_TK.sum(-1, keepdim=True)"],
            "sum_eps": ["w_TK = w_TK / (w_TK.sum(-1, keepdim=True) + 1e-20)"],
            "sum_inplace": ["w_TK /= w_TK.sum(dim=-1, keepdim=True)"]}[spec.renorm]
    if spec.route_scale != 1.0:
        out.append(f"w_TK = w_TK * {spec.route_scale}")
    if spec.router_fn == "grad_scale_weights":
        out.append("w_TK = GradScale.apply(w_TK, 0.5)")
    elif spec.router_fn == "straight_through":
        out.append("w_TK = StraightThrough.apply(w_TK)")
    if spec.weights_dtype == "act":
        out.append("w_TK = w_TK.to(x_TH.dtype)")
    return out


def _forward(spec: Spec) -> list[str]:
    out = ["    def forward(self, x):"]
    body = ["x_TH = x.reshape(-1, x.shape[-1])" if spec.batch3d else "x_TH = x", "T, H = x_TH.shape",
            "E, K = self.num_experts, self.top_k"]
    body += router_lines(spec)
    body += dispatch_lines(spec)  # defines out_TH (activation dtype)
    if spec.shared != "none":
        body += ["gate_TI, up_TI = F.linear(x_TH, self.s_up).chunk(2, dim=-1)",
                 "shared_TH = F.linear(F.silu(gate_TI) * up_TI, self.s_down)"]
        if spec.shared == "gated":
            body.append("shared_TH = shared_TH * torch.sigmoid(F.linear(x_TH, self.s_gate))")
        body.append("out_TH = out_TH + shared_TH")
    ret = "out_TH.view(x.shape)" if spec.batch3d else "out_TH"
    if spec.aux_loss:
        body += ["if self.training:",
                 "    frac_E = F.one_hot(idx_TK, E).sum((0, 1)).float() / (T * K)",
                 "    aux = E * (frac_E * scores_TE.float().mean(0)).sum()",
                 f"    return {ret}, aux"]
    body.append(f"return {ret}")
    return out + ["        " + line for text in body for line in text.split("\n")]


def _layer(spec: Spec) -> str:
    lines = ["", "class Block(nn.Module):"] + _init(spec) + [""] + _forward(spec)
    lines += [""] + expert_methods(spec)
    if spec.depth == 1:
        return "\n".join(lines + ["", "Layer = Block"])
    return "\n".join(lines) + f'''

class Layer(nn.Module):
    """{spec.depth} MoE blocks with residual connections (the aux losses summed)."""

    def __init__(self, dtype=torch.bfloat16, seed=0):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dtype, seed + i) for i in range({spec.depth}))

    def forward(self, x):
        aux = None
        for block in self.blocks:
            out = block(x)
            if isinstance(out, tuple):
                out, a = out
                aux = a if aux is None else aux + a
            x = x + out
        return x if aux is None else (x, aux)
'''


# ---- experts -----------------------------------------------------------------------------------------------


def _weights(spec: Spec) -> dict[str, str]:
    """``[E, K, N]`` expressions of the projections (``up`` also for gate+up concatenated), and biases ``[E, N]``."""
    if spec.layout == "module_list":
        first = "gate_proj" if spec.gated else "fc1"
        stack = "torch.stack([m.{}.{} for m in self.experts])"
        w = {"up": stack.format(first, "weight") + ".transpose(-2, -1)",
             "down": stack.format("down_proj" if spec.gated else "fc2", "weight") + ".transpose(-2, -1)"}
        if spec.gated:
            w["up3"] = stack.format("up_proj", "weight") + ".transpose(-2, -1)"
        if spec.bias:
            w["b_up"] = stack.format(first, "bias")
            w["b_down"] = stack.format("down_proj" if spec.gated else "fc2", "bias")
            if spec.gated:
                w["b_up3"] = stack.format("up_proj", "bias")
        return w
    if spec.layout == "stacked_cat":
        w = {"up": "self.w13_EIH.transpose(-2, -1)", "down": "self.w2_EHI.transpose(-2, -1)"}
    elif spec.layout == "stacked_t":
        w = {"up": "self.w13_EHI", "down": "self.w2_EIH"}
    else:
        w = {"up": "self.w1_EIH.transpose(-2, -1)", "down": "self.w2_EHI.transpose(-2, -1)"}
        if spec.gated:
            w["up3"] = "self.w3_EIH.transpose(-2, -1)"
    if spec.bias:
        w["b_up"] = "self.b1_EI" if spec.layout == "stacked_sep" else "self.b13_EI"
        w["b_down"] = "self.b2_EH"
        if spec.layout == "stacked_sep" and spec.gated:
            w["b_up3"] = "self.b3_EI"
    return w


def _split(spec: Spec, h: str) -> str:
    n = spec.inter
    return {"chunk": f"gate, up = {h}.chunk(2, dim=-1)", "slice": f"gate, up = {h}[..., :{n}], {h}[..., {n}:]",
            "interleaved": f"gate, up = {h}[..., ::2], {h}[..., 1::2]"}[spec.glu_split]


def _mlp(spec: Spec, mm: Any, rows: str, bias: Any) -> list[str]:
    """The expert MLP over ``rows``: ``mm(rows, weight_key)`` writes one projection, ``bias(key)`` its bias term."""
    w = _weights(spec)
    out = [f"h = {mm(rows, 'up')}{bias('b_up')}"]
    if spec.gated and "up3" in w:
        out += ["gate = h", f"up = {mm(rows, 'up3')}{bias('b_up3')}"]
    elif spec.gated:
        out.append(_split(spec, "h"))
    act = ACT[spec.mlp].format("gate") + " * up" if spec.gated else ACT[spec.mlp].format("h")
    out += [f"a = {act}", f"return {mm('a', 'down')}{bias('b_down')}"]
    return out


def expert_methods(spec: Spec) -> list[str]:
    """``expert(e, rows)``: expert ``e`` on its rows; ``grouped(rows, offs)``: all experts on sorted rows by grouped
    GEMMs; ``all_experts(x_ERH)``: expert ``e`` on ``x_ERH[e]`` (bmm); ``row_experts(x_SH, ids_S)``: each row through
    its own expert's gathered weights (transformers' ``batched_mm``)."""
    w = _weights(spec)
    ml = spec.layout == "module_list"
    methods: dict[str, list[str]] = {}
    if ml:
        methods["expert(self, e, rows)"] = ["return self.experts[e](rows)"]
    else:
        def per_expert(rows: str, key: str) -> str:
            if w[key].endswith(".transpose(-2, -1)"):
                return f"F.linear({rows}, {w[key].removesuffix('.transpose(-2, -1)')}[e])"
            return f"{rows} @ {w[key]}[e]"

        methods["expert(self, e, rows)"] = _mlp(spec, per_expert, "rows", lambda k: f" + {w[k]}[e]" if k in w else "")
    gemm = "torch.ops.transformers.grouped_mm_fallback" if spec.exec == "hf_fallback" else "torch._grouped_mm"
    methods["grouped(self, rows, offs, ids=None)"] = _mlp(
        spec, lambda rows, k: f"{gemm}({rows}, {w[k]}, offs=offs)", "rows",
        lambda k: f" + {w[k]}[ids]" if k in w else "")
    if ml:
        methods["all_experts(self, x_ERH)"] = [
            "return torch.stack([self.experts[e](x_ERH[e]) for e in range(len(x_ERH))])"]
    else:
        methods["all_experts(self, x_ERH)"] = _mlp(
            spec, lambda rows, k: f"torch.bmm({rows}, {w[k]})", "x_ERH",
            lambda k: f" + {w[k]}[:, None]" if k in w else "")
    methods["row_experts(self, x_SH, ids_S)"] = _mlp(
        spec, lambda rows, k: f"torch.bmm({rows}.unsqueeze(1), {w[k]}[ids_S]).squeeze(1)", "x_SH",
        lambda k: f" + {w[k]}[ids_S]" if k in w else "")
    needed = {"sorted": "grouped" if spec.exec != "split_loop" else "expert", "masked": "grouped"
              if spec.exec != "split_loop" else "expert", "loop": "expert", "hit_loop": "expert", "skip_loop": "expert",
              "dense": "all_experts", "capacity": "all_experts", "batched": "row_experts",
              "expert_choice": "all_experts", "drop_and_pad": "all_experts"}[spec.dispatch]
    out = []
    for signature, body in methods.items():
        if not signature.startswith(needed + "("):
            continue
        out += [f"    def {signature}:"] + [f"        {line}" for line in body] + [""]
    return out


def script(spec: Spec, backend: str = "passes") -> str:
    """A standalone script: the layer's source, then a check of it against eager and float32 (run from the
    repository root: the check is :func:`tests.fuzz.harness.check_module`)."""
    return source(spec) + textwrap.dedent(f'''

        if __name__ == "__main__":
            import sys

            from tests.fuzz.grammar import Spec
            from tests.fuzz.harness import check_module

            result = check_module(sys.modules[__name__], {spec!r}, backend={backend!r})
            print(result.summary())
            sys.exit(0 if result.ok else 1)
        ''')
