"""Fuse a Python loop over per-expert chunks into grouped GEMMs over all rows.

Shape suffixes: ``N`` routed rows (expert-major), ``n_e`` rows of expert ``e``, ``H`` hidden, ``I``
intermediate, ``E`` experts.

Matches (Dynamo Torch IR; the loop is unrolled, one copy of the expert MLP per chunk)::

    c_0, ..., c_{E-1} = torch.split(x_NH, sizes)          sizes = C.tolist() (host) or static ints
    y_e = MLP_e(c_e)       for every e: the same ops, node by node, with expert e's weights
                           (``experts[e]`` of a ModuleList -> F.linear(c, W_e); or ``c @ w[e].T`` slices)
    y_NH = torch.cat([y_0, ..., y_{E-1}])

Rewrites to::

    offs_E = cumsum(C, 0).to(int32)          (on the device; a constant tensor for static sizes)
    W_ENK = torch.stack([W_0, ..., W_{E-1}])  (or the stacked parameter ``w`` itself for ``w[e]`` slices)
    y_NH = MLP(x_NH) with each per-expert GEMM -> torch._grouped_mm(h, W_ENK.mT, offs=offs_E) (bf16)
                                              or torch.ops.moe.grouped_mm(h, W_ENK, offs_E) (fp32/fp16)

The split, the E copies and the cat are erased, and so are the host reads that only sized the split
(with their ``_assert_scalar`` checks). A later pass (``strip_host_padding`` or ``fuse_dispatch``)
then sees a grouped-GEMM dispatch with device offsets.

Fires when: the E per-chunk subgraphs are identical node by node (same targets, same constants, same
wiring), every input that differs between experts is a weight of the same shape consumed as the
weight of ``linear`` / ``matmul``, and the sizes are the elements of one device tensor in order.

Skips when (reason tags): ``loop_not_matched`` (chunks do not meet in one cat in order),
``experts_not_identical`` (structure differs between experts), ``per_expert_op_unsupported`` (a
per-expert input used by another op than a GEMM, or a per-expert bias), ``weights_not_stackable``,
``expert_region_escapes`` (a per-chunk value is used outside its copy), ``sizes_not_device_counts``,
``no_grouped_mm_for_dtype`` (fp32/fp16 without ``torch.ops.moe.grouped_mm``, or strides not 16-byte
aligned).

Stage: pre-grad, before ``strip_host_padding``: the unrolled loop only exists in Dynamo's graph, and
AOTAutograd then differentiates the grouped GEMMs (the weight stack becomes a copy per step).

Seen in: Megatron-LM ``SequentialMLP``, DeepSeek-V3 reference ``MoE.forward``, torchtitan's
``_run_experts_for_loop``, older Hugging Face MoE blocks rewritten with ``split`` (``tests/models/host_padded.py``).
"""

from moe_compile.passes.fuse_expert_loop.rewrite import run

__all__ = ["run"]
