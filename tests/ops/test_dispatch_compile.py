"""How the dispatch ops reach compiled code (issue 14), on CPU.

* The references (the ops' CPU bodies, and their CUDA fallbacks) are gathers only: no scatter, no
  ``index_put`` / ``index_copy`` / ``index_add``, so a traced reference compiles without atomics.
* On CUDA the ops decompose into their Triton launches (``triton_kernel_wrapper_functional``) when
  AOTAutograd traces them, so Inductor launches the kernels itself (no custom-op call in the generated
  code). Checked by tracing with fake CUDA tensors (no GPU needed; the graph is inspected, never run).
* On CPU the ops stay one node through AOTAutograd and Inductor
  (NOTE [device-decomposed triton ops] (moe_compile/ops/_common.py)).
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from moe_compile.ops import (
    permute_pad,
    permute_pad_backward_reference,
    permute_pad_reference,
    unpad_unpermute,
    unpad_unpermute_backward_reference,
    unpad_unpermute_reference,
)

from ._dispatch_reference import make_routing

SCATTERS = ("index_put", "index_copy", "index_add", "scatter", "index_fill", "masked_scatter", "put")
T, H, E, K, A = 12, 8, 6, 2, 16


def _inputs(device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen)
    ids = make_routing(T, K, E, "uniform", gen)
    probs = torch.rand(T, K, generator=gen)
    return x.to(device), ids.to(device), probs.to(device)


def _aten_ops(gm: torch.fx.GraphModule) -> collections.Counter:
    return collections.Counter(
        str(n.target).split(".")[1] if str(n.target).startswith("aten.") else str(n.target)
        for n in gm.graph.nodes
        if n.op == "call_function"
    )


def _scatters(ops: collections.Counter) -> list[str]:
    return [op for op in ops if any(op == s or op.startswith(s + "_") or op == s + "_" for s in SCATTERS)]


@pytest.mark.parametrize("with_probs", (True, False))
def test_references_are_gathers_only(with_probs):
    x, ids, probs = _inputs()
    p = probs if with_probs else None
    out = permute_pad_reference(x, ids, p, E, A)
    M = out.rows_MH.shape[0]
    g_probs = torch.randn(M) if with_probs else None
    traced = {
        "permute_pad": make_fx(lambda x, i, p: permute_pad_reference(x, i, p, E, A))(x, ids, p),
        "permute_pad_backward": make_fx(permute_pad_backward_reference)(out.rows_MH, g_probs, out.row_map),
        "unpad_unpermute": make_fx(unpad_unpermute_reference)(out.rows_MH, out.row_map, p),
        "unpad_unpermute_backward": make_fx(
            lambda g, r, p, z: unpad_unpermute_backward_reference(g, r, p, z, M)
        )(x, out.row_map, p, out.rows_MH if with_probs else None),
    }
    for name, gm in traced.items():
        ops = _aten_ops(gm)
        assert _scatters(ops) == [], (name, ops)
        assert not any("_local_scalar_dense" in op or "nonzero" in op for op in ops), (name, ops)


def test_reference_compiles_without_atomics():
    """The references through Inductor's CPU codegen (what a traced CPU body becomes)."""
    from torch._inductor.utils import run_and_get_code
    from torch.testing import FileCheck

    x, ids, probs = _inputs(seed=1)

    def layer(x, ids, probs):
        out = permute_pad_reference(x, ids, probs, E, A)
        y = unpad_unpermute_reference(out.rows_MH.sin(), out.row_map, probs)
        g_rows, g_probs = unpad_unpermute_backward_reference(y, out.row_map, probs, out.rows_MH, out.rows_MH.shape[0])
        gx, gp = permute_pad_backward_reference(g_rows, out.probs_M, out.row_map)
        return y, gx, gp, g_probs

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="inductor", fullgraph=True)
    got, (code,) = run_and_get_code(compiled, x, ids, probs)
    torch._dynamo.reset()
    for g, want in zip(got, layer(x, ids, probs)):
        torch.testing.assert_close(g, want)
    for banned in ("atomic_add(", "tl.atomic_add", "index_put", "scatter"):
        FileCheck().check_not(banned).run(code)


class _Captured(Exception):
    pass


def _fake_cuda_graph(fn, *args, dynamic_tokens: bool = False):
    """The AOTAutograd (inference) graph of ``fn`` on fake CUDA tensors, never executed.

    Forward only: autograd metadata of a fake CUDA tensor aborts a CPU build, so the backward ops are
    traced as plain calls here (their autograd wiring is tested on CPU)."""
    from torch._functorch.aot_autograd import aot_function
    from torch._subclasses.fake_tensor import FakeTensorMode

    graphs = []

    def compiler(gm, example_inputs):
        graphs.append(gm)
        raise _Captured

    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    with FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv()) as mode:
        shapes = [a.shape if isinstance(a, torch.Tensor) else None for a in args]
        if dynamic_tokens:  # a symbolic first dim (T), as under dynamic=True or opcheck's dynamic test
            context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
            with torch._subclasses.fake_tensor.unset_fake_temporarily():
                meta = torch.empty(args[0].shape, device="meta")
            T = mode.from_tensor(meta, symbolic_context=context).shape[0]
            shapes = [(T, *s[1:]) if s is not None else None for s in shapes]
        # shapes and dtypes only: a fake graph never reads values
        fake = [torch.empty(s, dtype=a.dtype, device="cuda") if s is not None else a for a, s in zip(args, shapes)]
        try:
            aot_function(fn, fw_compiler=compiler)(*fake)
        except _Captured:
            pass
    (gm,) = graphs
    return gm


def _kernel_names(gm):
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    names = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and "triton_kernel_wrapper" in str(n.target):
            kernel = kernel_side_table.get_kernel(n.kwargs["kernel_idx"])
            kernel = getattr(kernel, "fn", kernel)  # Autotuner (num_warps) -> JITFunction
            names.append(kernel.__name__ if hasattr(kernel, "__name__") else kernel.fn.__name__)
    return names


@pytest.mark.filterwarnings("ignore:Encountered an exception in identify_mutated_tensors")
def test_cuda_trace_decomposes_into_triton_launches():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only trace; the GPU tests compile the real thing")
    x, ids, probs = _inputs(seed=2)
    M = permute_pad_reference(x, ids, probs, E, A).rows_MH.shape[0]

    def layer(x, ids, probs):
        out = permute_pad(x, ids, probs, num_experts=E, align=A)
        y = unpad_unpermute(out.rows_MH.sin(), out.row_map, probs)
        # the backward ops, as the autograd formulas call them
        g_rows, g_probs = torch.ops.moe.unpad_unpermute_backward(y, out.row_map, probs, out.rows_MH, M)
        gx, gp = torch.ops.moe.permute_pad_backward(g_rows, out.probs_M, out.row_map)
        return y, gx, gp, g_probs

    with torch.no_grad():
        gm = _fake_cuda_graph(layer, x, ids, probs)
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert not [t for t in targets if t.startswith("moe.")], targets  # no custom-op call left
    assert _scatters(_aten_ops(gm)) == []
    assert _kernel_names(gm) == [
        "_expert_offsets_kernel", "_permute_rows_kernel",  # permute_pad: two launches
        "_unpermute_rows_kernel",  # unpad_unpermute
        "_mark_used_rows_kernel", "_unpermute_backward_kernel",  # unpad_unpermute_backward
        "_unpermute_rows_kernel",  # permute_pad_backward
    ]  # fmt: skip
    # eager-only launch options (PDL, fp fusion, debug) are not passed to wrap_triton: Inductor owns them
    for n in gm.graph.nodes:
        if "triton_kernel_wrapper" in str(n.target):
            assert not {"launch_pdl", "enable_fp_fusion", "debug"} & set(n.kwargs["kwargs"]), n.kwargs["kwargs"]
            assert n.kwargs["kwargs"].get("USE_PDL", False) is False


@pytest.mark.filterwarnings("ignore")
def test_cuda_trace_with_symbolic_token_count():
    """Symbolic T (``dynamic=True``, opcheck's dynamic test): the launch plans specialise, no crash."""
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only trace")
    x, ids, probs = _inputs(seed=6)

    def layer(x, ids, probs):
        out = permute_pad(x, ids, probs, num_experts=E, align=A)
        y = unpad_unpermute(out.rows_MH, out.row_map, probs)
        g_rows, g_probs = torch.ops.moe.unpad_unpermute_backward(y, out.row_map, probs, out.rows_MH,
                                                                  out.rows_MH.shape[0])
        return y, torch.ops.moe.permute_pad_backward(g_rows, out.probs_M, out.row_map)[0], g_probs

    with torch.no_grad():
        gm = _fake_cuda_graph(layer, x, ids, probs, dynamic_tokens=True)
    assert len(_kernel_names(gm)) == 6


@pytest.mark.filterwarnings("ignore:Encountered an exception in identify_mutated_tensors")
def test_cuda_trace_debug_flag_reaches_the_kernels():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only trace")
    x, ids, probs = _inputs(seed=3)

    def layer(x, ids, probs):
        out = permute_pad(x, ids, probs, num_experts=E, align=A, debug=True)
        return unpad_unpermute(out.rows_MH, out.row_map, probs, debug=True)

    with torch.no_grad():
        fw = _fake_cuda_graph(layer, x, ids, probs)
    debug_flags = [
        n.kwargs["kwargs"].get("DEBUG") for n in fw.graph.nodes if "triton_kernel_wrapper" in str(n.target)
    ]
    # the index kernel and the combine assert on their inputs (the permute kernel is memory-safe)
    assert debug_flags == [True, None, True], debug_flags


@pytest.mark.parametrize("decompose", [True, False], ids=["traced", "one_node"])
def test_cpu_compiled_graph_has_no_atomics(decompose):
    """On CPU the ops trace into the graph as their gather-only references
    (NOTE [device-decomposed triton ops] (moe_compile/ops/_common.py)); with ``decompose_custom_triton_ops`` off
    (torch.export's setting) they stay one node each."""
    from torch._inductor.utils import run_and_get_code
    from torch.testing import FileCheck

    x, ids, probs = _inputs(seed=4)
    x.requires_grad_(True)
    post_grad = []

    class Keep(torch._inductor.custom_graph_pass.CustomGraphPass):
        def __call__(self, graph):
            post_grad.append(collections.Counter(str(n.target) for n in graph.nodes if n.op == "call_function"))

        def uuid(self):
            return None

    def layer(x, ids, probs):
        out = permute_pad(x, ids, probs, num_experts=E, align=A)
        return unpad_unpermute(out.rows_MH.sin(), out.row_map, probs)

    torch._dynamo.reset()
    with torch._inductor.config.patch(post_grad_custom_post_pass=Keep(), fx_graph_cache=False), \
            torch._functorch.config.patch(decompose_custom_triton_ops=decompose):
        compiled = torch.compile(layer, backend="inductor", fullgraph=True)

        def step():
            y = compiled(x, ids, probs)
            y.square().sum().backward()
            return y

        y, codes = run_and_get_code(step)
    torch._dynamo.reset()
    grad = x.grad.clone()
    x.grad = None
    want = layer(x, ids, probs)
    want.square().sum().backward()
    torch.testing.assert_close(y, want)
    torch.testing.assert_close(grad, x.grad)
    fw, bw = post_grad
    if decompose:
        assert not [t for t in (*fw, *bw) if t.startswith("moe.")], (fw, bw)
        assert not [t for t in (*fw, *bw) if "scatter" in t or "index_put" in t], (fw, bw)
    else:
        assert fw["moe.permute_pad.default"] == 1 and fw["moe.unpad_unpermute.default"] == 1, fw
        assert bw["moe.permute_pad_backward.default"] == 1 and bw["moe.unpad_unpermute_backward.default"] == 1, bw
    for code in codes:
        FileCheck().check_not("atomic_add(").check_not("tl.atomic_add").run(code)


def test_cpu_compiled_graph_rejects_out_of_range_ids():
    """Traced into a CPU graph, the op checks ``expert_idx`` there on every call (no host read)."""
    x, ids, probs = _inputs(seed=7)
    compiled = torch.compile(lambda *a: permute_pad(*a, num_experts=E, align=A).rows_MH, fullgraph=True)
    torch._dynamo.reset()
    compiled(x, ids, probs)  # in range: fine
    bad = ids.clone()
    bad[torch.randint(0, ids.shape[0], ()), 0] = E
    with pytest.raises(RuntimeError, match=r"expert_idx values must be in \[0, num_experts\)"):
        compiled(x, bad, probs)
    torch._dynamo.reset()


# written tensors per kernel under torch 2.11's mutation analysis (stores' addresses followed through
# loads); NOTE [no load-derived store addresses on graph inputs] (moe_compile/ops/triton/dispatch.py)
ALLOWED_WRITES = {
    "_expert_offsets_kernel": {"table_ptr", "offs_ptr"},
    "_permute_rows_kernel": {"table_ptr", "rows_ptr", "probs_out_ptr", "row_map_ptr"},  # ids from the table
    "_unpermute_rows_kernel": {"out_ptr", "grad_probs_ptr"},
    "_mark_used_rows_kernel": {"used_ptr", "row_map_ptr"},
    "_unpermute_backward_kernel": {"grad_rows_ptr", "grad_probs_ptr", "row_map_ptr"},
}
# ... and the arguments among them that must be private copies made inside the op
PRIVATE_COPIES = {
    "_mark_used_rows_kernel": {"row_map_ptr"},
    "_unpermute_backward_kernel": {"row_map_ptr"},
}


def _origin(node: torch.fx.Node) -> list[str]:
    """Targets and kernel-argument names from ``node`` back through kernel outputs to where it was made."""
    chain = []
    while node.op == "call_function" and "getitem" in str(node.target):
        hop, key = node.args
        chain.append(key)
        node = hop.kwargs["kwargs"][key]
    chain.append(str(node.target) if node.op == "call_function" else node.op)
    return chain


def _writes_following_loads(kernel, kwargs) -> set[str]:
    """Kernel parameters written per torch 2.11's TTIR analysis: walk back from every store's address
    through all operands, loads included (2.13 stops at loads)."""
    from torch._higher_order_ops import triton_kernel_wrap as tkw

    module, names = tkw.generate_ttir(kernel, kwargs, {})
    functions = tkw.ttir_to_functions(module)
    ops = functions[next(iter(functions))]
    stack = [op.args[0] for op_list in ops.values() for op in op_list if op.name == "tt.store"]
    seen, written = set(), set()
    while stack:
        arg = stack.pop()
        if isinstance(arg, tkw.Param):
            if arg.idx < len(names):
                written.add(names[arg.idx])
        elif isinstance(arg, tkw.Intermediate) and not arg.fake() and arg not in seen:
            seen.add(arg)
            for op in ops[arg]:
                stack.extend(op.args)
    return written


@pytest.mark.filterwarnings("ignore")
def test_no_graph_input_or_op_output_counts_as_written_under_torch_2_11_analysis(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only trace")
    import triton
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    import moe_compile.ops._common as common

    monkeypatch.setattr(common, "ttir_writes_follow_loads", lambda: True)  # the torch 2.11 path
    x, ids, probs = _inputs(seed=5)
    M = permute_pad_reference(x, ids, probs, E, A).rows_MH.shape[0]

    def layer(x, ids, probs):
        out = permute_pad(x, ids, probs, num_experts=E, align=A)
        y = unpad_unpermute(out.rows_MH, out.row_map, probs)
        g_rows, g_probs = torch.ops.moe.unpad_unpermute_backward(y, out.row_map, probs, out.rows_MH, M)
        gx, gp = torch.ops.moe.permute_pad_backward(g_rows, out.probs_M, out.row_map)
        return y, gx, gp, g_probs, out.counts_E, out.offs_E

    with torch.no_grad():
        gm = _fake_cuda_graph(layer, x, ids, probs)

    class FakeDriver:  # TTIR generation needs a target, not a GPU
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

    monkeypatch.setattr(driver, "_active", FakeDriver())
    checked = []
    for n in gm.graph.nodes:
        if "triton_kernel_wrapper" not in str(n.target):
            continue
        kernel = kernel_side_table.get_kernel(n.kwargs["kernel_idx"])
        kernel = kernel.fn if isinstance(kernel, triton.runtime.Autotuner) else kernel
        args = {**kernel_side_table.get_constant_args(n.kwargs["constant_args_idx"])}
        for name, v in n.kwargs["kwargs"].items():
            val = v.meta["val"] if isinstance(v, torch.fx.Node) else v
            args[name] = torch.empty(val.shape, dtype=val.dtype) if isinstance(val, torch.Tensor) else val
        written = {k for k in _writes_following_loads(kernel, args) if isinstance(args[k], torch.Tensor)}
        assert written <= ALLOWED_WRITES[kernel.__name__], (kernel.__name__, written)
        for name in written:  # (the CPU trace threads every argument through every kernel: follow it)
            chain = _origin(n.kwargs["kwargs"][name])
            assert chain[-1] != "placeholder", (kernel.__name__, name, chain)
        for name in PRIVATE_COPIES.get(kernel.__name__, ()):
            chain = _origin(n.kwargs["kwargs"][name])
            assert "aten.clone.default" in chain, (kernel.__name__, name, chain)
        checked.append(kernel.__name__)
    assert sorted(set(checked)) == sorted(ALLOWED_WRITES), checked
