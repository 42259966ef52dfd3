"""The backend on graphs without MoE dispatch compiles exactly as plain Inductor; ``explain`` reports.

Bitwise: an MLP (forward + backward), an attention block (forward + backward) and a conv net (forward)
give outputs and grads identical to ``torch.compile(backend="inductor")``.
"""

from __future__ import annotations

import unittest

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moe_compile
from tests._subprocess import run_python
from tests.models import handwritten as hw
from tests.passes._harness import fresh_cache


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))

    def forward(self, x):
        return self.net(x)


class AttentionBlock(nn.Module):
    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, S, D = x.shape
        q, k, v = self.qkv(self.norm(x)).view(B, S, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(attn.transpose(1, 2).reshape(B, S, D))


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = F.relu(self.bn(self.conv1(x)))
        x = F.relu(self.conv2(x))
        return self.head(x.mean(dim=(2, 3)))


def _run(model, x, backend, train):
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    for p in model.parameters():
        p.grad = None
    with fresh_cache():
        out = compiled(x)
        grads = []
        if train:
            out.float().pow(2).mean().backward()
            grads = [p.grad.clone() for p in model.parameters()]
    torch._dynamo.reset()
    return out.detach(), grads


@pytest.mark.parametrize("make,shape,train", [
    (MLP, (4, 16), True),
    (AttentionBlock, (2, 5, 16), True),
    (ConvNet, (2, 3, 8, 8), False),
], ids=["mlp", "attention", "convnet"])
def test_non_moe_graph_bitwise_equal_to_inductor(make, shape, train):
    torch.manual_seed(0)
    model = make()
    model.train(train)
    x = torch.randn(*shape)
    ours, ours_grads = _run(model, x, "moe_compile", train)
    plain, plain_grads = _run(model, x, "inductor", train)
    assert torch.equal(ours, plain)
    for a, b in zip(ours_grads, plain_grads, strict=True):
        assert torch.equal(a, b)


class TwoLayers(nn.Module):
    """One layer that rewrites and one that must not (weights applied before the gather)."""

    def __init__(self) -> None:
        super().__init__()
        self.good = hw.SortIndexSelectScatterAdd(hidden=32)
        self.bad = hw.WeightsBeforeGather(hidden=32, seed=1)

    def forward(self, x):
        return self.bad(self.good(x))


def test_explain_reports_rewrites_and_skips_per_layer():
    model = TwoLayers()
    for p in model.parameters():
        p.requires_grad_(False)
    x = torch.randn(6, 32).bfloat16()
    rep = moe_compile.explain(model, x, backward=False,  # the bad layer's combine left as it is
                              compile_options={"passes": {"routed_accumulate": False}})
    table = rep.table()
    assert "good" in table and "bad" in table
    assert "combine not matched: weights applied before gather" in table
    d = rep.to_dict()
    assert d["summary"]["rewritten_layers"] == ["good"]
    good = {r["pass"]: r for r in d["layers"]["good"]}
    # inference: the layer's gate_up GEMM + SwiGLU is fused too
    assert sorted(good) == ["fuse_dispatch", "fuse_expert_mlp"] and good["fuse_expert_mlp"]["kind"] == "rewrite"
    good = good["fuse_dispatch"]
    assert good["kind"] == "rewrite"
    assert "moe.permute_pad" in good["detail"] and "sort(ids)" in good["what"]
    bad = {r["pass"]: r for r in d["layers"]["bad"]}
    assert (bad["fuse_dispatch"]["kind"], bad["fuse_dispatch"]["what"]) == ("skip", "weights_before_gather")
    # the layer's combine keeps its accumulating index_add, and explain says so
    assert (bad["deterministic_accumulate"]["kind"], bad["deterministic_accumulate"]["what"]) == \
        ("skip", "index_not_distinct")
    assert all(p.grad is None for p in model.parameters())


def test_explain_without_moe():
    rep = moe_compile.explain(MLP(), torch.randn(2, 16), backward=False)
    assert rep.records == [] and rep.graphs >= 1
    assert "no MoE dispatch found" in rep.table()
    assert rep.to_dict()["summary"]["rewrites"] == 0


def test_explain_leaves_existing_gradients_as_they_were():
    """``explain`` runs a backward: it once added into the model's existing ``.grad`` tensors in place, so that the
    gradients it restored afterwards had its own loss's gradient in them."""
    model = MLP()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    saved = [p.grad for p in model.parameters()]
    moe_compile.explain(model, torch.randn(2, 16))
    for p, g in zip(model.parameters(), saved, strict=True):
        assert p.grad is g and torch.equal(g, torch.ones_like(g))


def test_report_groups_repeated_records():
    from moe_compile.report import PassRecord, Report

    r1 = PassRecord("fuse_dispatch", "pre_grad", "rewrite", "model.layers.10.mlp.experts", "m", "r")
    r2 = PassRecord("fuse_dispatch", "pre_grad", "rewrite", "model.layers.2.mlp.experts", "m", "r")
    rep = Report(records=[r1, r2, r1], graphs=2)
    d = rep.to_dict()
    assert list(d["layers"]) == ["model.layers.2.mlp.experts", "model.layers.10.mlp.experts"]
    assert d["layers"]["model.layers.10.mlp.experts"][0]["count"] == 2
    assert "rewrite x2" in rep.table() and rep.count("fuse_dispatch") == 3


class ToyExperts(nn.Module):
    """Stacked expert weights run by a Python loop that Dynamo does not capture (like the eager loop)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 16, 16) / 4)

    @torch.compiler.disable
    def forward(self, x):
        ids = x.abs().argmax(-1) % 4
        return torch.stack([x[i] @ self.w[int(e)] for i, e in enumerate(ids)])


def test_explain_lists_experts_not_in_any_graph():
    model = nn.Sequential(nn.Linear(16, 16), ToyExperts())
    rep = moe_compile.explain(model, torch.randn(3, 16), backward=False)
    [rec] = [r for r in rep.records if r.pass_name == "explain"]
    assert (rec.layer, rec.kind, rec.what) == ("1", "skip", "not_in_graph")
    assert "ToyExperts" in rec.detail
    # moe_compile.compile's expert-loop swap looked at the block and left it alone, saying why
    [swap] = [r for r in rep.records if r.pass_name == "swap_expert_loops"]
    assert (swap.kind, swap.what) == ("skip", "unknown_expert_mlp")


def _tiny_dbrx():
    from transformers import DbrxConfig, DbrxForCausalLM

    config = DbrxConfig(d_model=32, n_heads=4, n_layers=1, max_seq_len=64, vocab_size=128,
                        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                        ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2})
    return DbrxForCausalLM(config), ["transformer.blocks.0.ffn.experts"]


def _tiny_switch_encoder():
    from transformers import SwitchTransformersConfig, SwitchTransformersEncoderModel

    config = SwitchTransformersConfig(vocab_size=128, d_model=32, d_kv=8, d_ff=32, num_layers=1, num_heads=4,
                                      num_experts=4, encoder_sparse_step=1, expert_capacity=16)
    return SwitchTransformersEncoderModel(config), ["encoder.block.0.layer.1.mlp.experts"]


def test_explain_gives_every_expert_layer_left_alone_a_reason():
    """SwitchTransformers (a ModuleDict of experts, capacity routing) loops over its experts with a ``nonzero`` trip
    count, which Dynamo runs outside any graph. ``explain`` once said "0 skip(s)" for it (and for DBRX, which the swap
    now rewrites: below). The capacity swap (NOTE [capacity swap] (moe_compile/experts/_swap_capacity.py)) leaves
    this block alone with the default config's expert dropout (0.1, drawn per expert in the loop's order): the block
    holding the experts gets a skip with that reason, and what it found."""
    pytest.importorskip("transformers")
    from moe_compile.experts.discovery import find_expert_layers

    torch.manual_seed(0)
    model, experts = _tiny_switch_encoder()
    assert [layer.name for layer in find_expert_layers(model)] == experts
    ids = torch.randint(0, 128, (2, 8))
    rep = moe_compile.explain(model, input_ids=ids, backward=False)
    for name in experts:
        block = name.rpartition(".")[0]
        [rec] = [r for r in rep.records if r.layer in (name, block)]
        assert (rec.pass_name, rec.kind, rec.what) == ("swap_expert_loops", "skip", "expert_dropout"), rep.table()
        assert "dropout (p=0.1)" in rec.detail, rec.detail
    assert rep.moe_rewrites == [] and f"{len(experts)} skip(s)" in rep.table(), rep.table()


def test_explain_gives_dbrx_experts_the_swap():
    """DBRX's experts (2-D ``[E*I, H]`` weights, the same eager loop) were left alone the same way (``not_in_graph``);
    the expert-loop swap now reads them as ``[E, I, H]`` views (issue 36): ``explain`` gives its block the rewrite
    and its experts layer no skip."""
    pytest.importorskip("transformers")
    from moe_compile.api import account_expert_layers

    torch.manual_seed(0)
    model, [experts] = _tiny_dbrx()
    rep = moe_compile.explain(model, input_ids=torch.randint(0, 128, (2, 8)), backward=False)
    [swap] = [r for r in rep.records if r.pass_name == "swap_expert_loops"]
    assert (swap.layer, swap.kind, swap.what) == ("transformer.blocks.0.ffn", "rewrite", "expert_loop_swapped")
    assert swap.detail.startswith("flat experts (4, gated w1/v1/w2)"), swap.detail
    assert not [r for r in rep.records if r.layer == experts and r.kind == "skip"], rep.table()
    # explain swapped a copy; moe_compile.compile swaps the model itself and keeps the records on it
    assert account_expert_layers(model, moe_compile.Report()) == {experts: "not_in_graph"}
    moe_compile.compile(model)
    assert account_expert_layers(model, moe_compile.Report()) == {experts: "rewritten"}


class DenseExperts(nn.Module):
    """Every token through every expert, weighted by a softmax (a soft MoE): in the graph, but no dispatch."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(16, 4)
        self.w = nn.Parameter(torch.randn(4, 16, 16) / 4)

    def forward(self, x):
        return torch.einsum("te,eoh,th->to", self.gate(x).softmax(-1), self.w, x)


def test_explain_tags_an_expert_layer_in_a_graph_that_no_pass_recognises():
    model = nn.Sequential(nn.Linear(16, 16), DenseExperts())
    rep = moe_compile.explain(model, torch.randn(3, 16), backward=False, compile_options={"swap_expert_loops": False})
    # besides normalize's non-MoE split of its three-operand einsum, one record: explain's skip
    [rec] = [r for r in rep.records if r.layer == "1" and r.moe and r.pass_name != "normalize"]
    assert (rec.kind, rec.what) == ("skip", "dispatch_form_unknown"), rep.table()
    assert rec.detail.startswith("DenseExperts (stacked: w [4, 16, 16])"), rec.detail


def test_expert_layers_are_found_in_every_layout():
    """``find_expert_layers``: stacked and ModuleList experts (``find_expert_weights``) and the layouts nothing
    rewrites: SwitchTransformers' ModuleDict (encoder and decoder), DBRX's ``*Experts`` module of 2-D weights."""
    pytest.importorskip("transformers")
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    from moe_compile.experts.discovery import find_expert_layers
    from tests.models.host_padded import make_layer

    config = SwitchTransformersConfig(vocab_size=128, d_model=32, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2,
                                      num_heads=4, num_experts=4, encoder_sparse_step=2, decoder_sparse_step=2)
    found = find_expert_layers(SwitchTransformersForConditionalGeneration(config))
    assert [f.name for f in found] == ["encoder.block.1.layer.1.mlp.experts", "decoder.block.1.layer.2.mlp.experts"]
    assert all("ModuleDict of 4 SwitchTransformersDenseActDense" in f.seen for f in found)
    assert [f.name for f in find_expert_layers(_tiny_dbrx()[0])] == ["transformer.blocks.0.ffn.experts"]
    assert [(f.name, f.seen.split(" (")[1].split(":")[0]) for f in find_expert_layers(make_layer("loop"))] == \
        [("experts", "module_list")]
    assert find_expert_layers(MLP()) == []
    # Doge's retrieval experts: rows of nn.Embedding tables, num_experts on the module
    from transformers import DogeConfig, DogeModel

    doge = DogeModel(DogeConfig(vocab_size=128, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                num_attention_heads=4, num_key_value_heads=4, is_moe=True, num_experts=16))
    assert [f.name for f in find_expert_layers(doge)] == ["layers.0.mlp"]


def test_explain_matches_layers_of_frames_compiled_below_the_root():
    """transformers' CausalLM is compiled frame by frame: records name ``layers.0.mlp.experts`` (relative to
    ``model.model``); the experts modules are in the graph, so none is reported ``not_in_graph``."""
    pytest.importorskip("transformers")
    from tests.models.hf_models import build_causal_lm

    model, inputs = build_causal_lm("mixtral", dtype=torch.bfloat16)
    inputs.pop("labels")
    rep = moe_compile.explain(model, backward=False, **inputs)
    assert rep.count("fuse_dispatch") == 2, rep.table()
    assert [r for r in rep.records if r.what == "not_in_graph"] == [], rep.table()


def test_pass_that_raises_is_undone_and_compilation_goes_on(monkeypatch):
    """A pre-grad pass that raises after leaving the graph out of order: the graph is restored (with the
    placeholder nodes Dynamo and AOTAutograd annotate), a warning names the pass, the later passes still
    run, and training through Inductor matches eager."""
    from moe_compile.passes import strip_host_padding
    from tests.passes._harness import Run, assert_matches_eager

    def broken(graph, ctx):
        first = next(n for n in graph.nodes if n.op == "call_function")
        with graph.inserting_before(first):  # a node that uses `first` before it is defined
            graph.call_function(torch.neg, (first,))
        raise RuntimeError("boom")

    monkeypatch.setattr(strip_host_padding, "run", broken)
    model = hw.SortIndexSelectScatterAdd(hidden=32)
    x = torch.randn(6, 32, dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="strip_host_padding"), moe_compile.report.collecting() as rep:
        ours, ours_grads = _run(model, x, "moe_compile", True)
    assert [(r.pass_name, r.what) for r in rep.errors] == [("strip_host_padding", "RuntimeError")]
    assert rep.count("fuse_dispatch") == 1
    eager, eager_grads = _run(model, x, "eager", True)
    assert_matches_eager(Run(ours, ours_grads, rep, []), model, (x,), train=True, eager=(eager, eager_grads),
                         loss_fn=lambda out: out.float().pow(2).mean())


@torch.library.custom_op("moe_compile_test::unlowerable", mutates_args=())
def _unlowerable(x: torch.Tensor) -> torch.Tensor:
    """The identity, which Inductor cannot lower (below): what a rewrite that Inductor cannot compile inserts."""
    return x.clone()


_unlowerable.register_fake(lambda x: torch.empty_like(x))
_unlowerable.register_autograd(lambda ctx, grad: grad)


def _refuse_lowering(*args, **kwargs):
    raise NotImplementedError("moe_compile_test::unlowerable has no lowering")


torch._inductor.lowering.register_lowering(torch.ops.moe_compile_test.unlowerable.default)(_refuse_lowering)


def _breaks_its_rewrite(run):
    """``run`` (a pass), then an op Inductor cannot lower after the first grouped GEMM the pass inserted."""

    def broken(graph, ctx):
        before = set(graph.nodes)
        run(graph, ctx)
        new = next(n for n in graph.nodes if n not in before and "grouped_mm" in str(n.target))
        with graph.inserting_after(new):
            bad = graph.call_function(torch.ops.moe_compile_test.unlowerable.default, (new,))
        bad.meta["example_value"] = new.meta["example_value"]
        new.replace_all_uses_with(bad, delete_user_cb=lambda user: user is not bad)

    return broken


class LoopThenSortLayer(nn.Module):
    """A host-sized expert loop (``fuse_expert_loop``) and a sort-based layer (``fuse_dispatch``)."""

    def __init__(self) -> None:
        super().__init__()
        from tests.models.host_padded import make_layer

        self.loop = make_layer("loop", seed=0)
        self.sort = hw.SortIndexSelectScatterAdd(hidden=16, seed=1)

    def forward(self, x):
        return self.sort(self.loop(x))


def test_compile_failure_after_a_rewrite_falls_back_without_that_pass(monkeypatch):
    """A pass whose rewrite Inductor cannot compile (here: an op without a lowering after its grouped GEMM) does
    not fail the compile: the graph is compiled again from Dynamo's graph, first without each pass that rewrote it
    alone (the last in run order first), so only the guilty pass is turned off. A warning names it, the report
    has an ``error`` record for it and none of its rewrites, the other layer stays rewritten, and a training step
    matches eager. With ``strict`` the failure is raised."""
    from moe_compile.passes import fuse_expert_loop
    from tests.passes._host_padding_checks import assert_matches_eager, layer_input, run_layer

    monkeypatch.setattr(fuse_expert_loop, "run", _breaks_its_rewrite(fuse_expert_loop.run))
    model = LoopThenSortLayer()
    with pytest.warns(UserWarning, match="pass 'fuse_expert_loop' rewrote it"):
        got, want = run_layer(model, layer_input(0), path="backend", train=True)
    rep = got.records
    assert [(r.pass_name, r.what) for r in rep.errors] == [("fuse_expert_loop", "InductorError")], rep.table()
    assert "moe_compile_test::unlowerable has no lowering" in rep.errors[0].detail
    assert rep.count("fuse_expert_loop") == 0 and rep.count("fuse_dispatch") == 1, rep.table()
    assert rep.graphs == 1, rep.table()  # the attempts taken back are not counted
    assert "fuse_expert_loop" in rep.table() and "1 error(s)" in rep.table()
    assert_matches_eager(unittest.TestCase(), got, want)

    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="unlowerable has no lowering"):
        torch._dynamo.reset()
        with fresh_cache():
            torch.compile(model, backend="moe_compile", fullgraph=True, options={"moe.strict": True})(layer_input(0))
    torch._dynamo.reset()


def test_user_defined_kernels_are_launched_statically_unless_the_user_says_otherwise():
    """Our dispatch kernels take Inductor's static launcher (host cost); a user's options= still win."""
    from moe_compile.backend import INDUCTOR_DEFAULTS, inductor_patches
    from moe_compile.config import make_config

    key = "static_launch_user_defined_triton_kernels"
    if not hasattr(torch._inductor.config, key):
        pytest.skip(f"this torch has no Inductor option {key}")
    assert INDUCTOR_DEFAULTS[key] is True
    assert inductor_patches(make_config(), None, {})[key] is True
    assert inductor_patches(make_config(), None, {key: False})[key] is False


def _python(body: str, env_update: dict[str, str | None]) -> str:
    """The stdout of ``body`` run in a fresh interpreter (:func:`tests._subprocess.run_python`), which must succeed."""
    done = run_python(body, env_update, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize("user_value", (None, "0"), ids=("unset", "user_says_0"))
def test_compile_workers_see_the_static_launch_option(user_value):
    """NOTE [static launch in compile workers] (moe_compile/backend.py): a process started after ``import moe_compile``
    (as Inductor's compile workers are) reads static launch of user kernels as on; a value the user set is kept."""
    from moe_compile.backend import STATIC_LAUNCH_ENV

    out = _python(f"""
        import os, subprocess, sys
        import moe_compile
        child = "import torch._inductor.config as c; print(c.static_launch_user_defined_triton_kernels)"
        print(os.environ["{STATIC_LAUNCH_ENV}"])
        print(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout)
    """, {STATIC_LAUNCH_ENV: user_value})
    assert out.split() == (["1", "True"] if user_value is None else ["0", "False"])


def test_compile_workers_started_before_import_are_restarted_once(monkeypatch):
    """A worker pool that predates the variable is shut down at the first compile (Inductor starts a new one
    that inherits it), and only then."""
    from torch._inductor import async_compile

    from moe_compile import backend

    calls = []
    monkeypatch.setattr(async_compile, "shutdown_compile_workers", lambda: calls.append(1))
    monkeypatch.setattr(backend, "_restart_compile_workers", True)
    x = torch.randn(4, 16)
    for _ in range(2):
        torch._dynamo.reset()
        torch.compile(MLP(), backend="moe_compile")(x)
    assert calls == [1]


_STATIC_LAUNCH_SCRIPT = """
    import time
    import torch
    from torch._inductor import async_compile, config
    config.compile_threads = 4  # compile in worker processes, as on any machine with a few cores

    def pool_ready():  # Inductor compiles in this process until its pool answers
        async_compile.AsyncCompile.warm_pool()
        deadline = time.time() + 120
        while not async_compile.AsyncCompile.use_process_pool():
            assert time.time() < deadline
            time.sleep(0.1)

    if {pool_first}:
        pool_ready()  # a pool started before moe_compile is imported
    import moe_compile
    if {pool_first}:  # our first compile restarts it
        torch.compile(lambda t: t * 2, backend="moe_compile")(torch.ones(3, device="cuda"))
    pool_ready()
    from moe_compile.ops import permute_pad, unpad_unpermute
    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner, HeuristicType

    def layer(x, ids, probs, w):
        out = permute_pad(x, ids, probs, num_experts=8, align=16)
        return unpad_unpermute(torch.nn.functional.silu(out.rows_MH @ w), out.row_map, probs)

    x = torch.randn(64, 128, device="cuda", requires_grad=True)
    ids = torch.randint(0, 8, (64, 2), device="cuda")
    probs = torch.rand(64, 2, device="cuda", requires_grad=True)
    w = torch.randn(128, 128, device="cuda", requires_grad=True)
    torch.compile(layer, backend="moe_compile", fullgraph=True)(x, ids, probs, w).sum().backward()
    kernels = {{v.fn.__name__: v.is_statically_launchable() for m in PyCodeCache.modules for v in vars(m).values()
               if isinstance(v, CachingAutotuner) and v.heuristic_type == HeuristicType.USER_AUTOTUNE}}
    print(sorted(kernels.items()))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("pool_first,user_value", [(False, None), (True, None), (False, "0")], ids=str)
def test_dispatch_kernels_compiled_in_workers_launch_statically(pool_first, user_value, tmp_path):
    """Forward and backward dispatch kernels compiled in Inductor's worker processes get the static launcher
    (also when the pool started before ``import moe_compile``); with the user's ``0`` they do not (which shows
    the check can fail)."""
    import ast

    from moe_compile.backend import STATIC_LAUNCH_ENV

    # compiled, not loaded; in a worker pool, as on any machine with a few cores (tests/conftest.py sets 1 thread)
    env = {STATIC_LAUNCH_ENV: user_value, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path),
           "TORCHINDUCTOR_COMPILE_THREADS": None}
    out = _python(_STATIC_LAUNCH_SCRIPT.format(pool_first=pool_first), env)
    kernels = dict(ast.literal_eval(out.strip().splitlines()[-1]))
    assert {"_expert_offsets_kernel", "_permute_rows_kernel", "_unpermute_rows_kernel"} <= set(kernels), kernels
    assert set(kernels.values()) == {user_value is None}, kernels
