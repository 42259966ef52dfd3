"""Rewrite sort-based MoE dispatch into ``moe.permute_pad`` + grouped GEMM + ``moe.unpad_unpermute``.

Matches:
    An ascending ``sort`` / ``argsort`` (stable or not) of flattened integer expert ids ``ids_S``, the
    token gather ``x_TH[perm // K]`` (``getitem`` / ``index_select`` / ``gather``), optionally the
    weight gather ``w_S[perm]``; counts on the device (``histc`` on float or int ids, ``bincount`` with
    ``minlength``, ``one_hot(...).sum``, ``(ids == arange(E)).sum``) -> ``cumsum`` -> int32 ``offs``
    of every grouped GEMM (``torch._grouped_mm``, ``transformers::grouped_mm_fallback``,
    ``moe::grouped_mm``); optional device padding to ``a`` rows per expert with a static bound
    (``zeros[M, H][dest] = x[perm // K]``, or a zero sentinel row gathered through
    ``full(M, T)[dest] = perm // K``; ``Y[dest]`` back); a row-wise region between gathers and combine
    (elementwise ops, GLU chunks, casts, per-row scales such as the routing weight after the MLP, in
    fp32 or between the two GEMMs, reductions over non-row dims, dense projections); and the combine
    ``y[inverse(perm)].view(T, K, H).sum(1)`` or ``zeros(T, H)`` accumulated at ``perm // K`` by
    ``index_add_`` / ``scatter_add_`` / ``index_put_(accumulate=True)``. This is transformers'
    ``grouped_mm`` experts implementation (Mixtral, Qwen2/3-MoE, OLMoE, Granite-MoE, ...).

Rewrites to:
    ``permute_pad(x_TH, ids_TK, w_TK, E, a)`` (rows, probs, offs); the gathered rows, gathered
    weights and padded buffers become ``rows_MH`` / ``probs_M``, every grouped GEMM of the region takes
    ``offs_E``; the combine becomes ``unpad_unpermute(y, row_map)``. The region itself, the router,
    shared experts and the aux loss are left as they are. Expert-parallel sentinel masks of the rows
    (``masked_fill(rows, ids_sorted >= E, v)``, transformers 5.17) are dropped: with the ids proven in
    ``[0, E)`` (a router's top-k) they are all False. The original sort, gathers, inverse
    permutation and scatter-adds are erased. Forward and backward are then sync-free gathers with
    deterministic autograd (no ``index_put(accumulate=True)`` / atomic adds from ``x[perm // K]``).

Fires when:
    every step above is proven (:mod:`~moe_compile.passes.fuse_dispatch.match` runs the steps, each
    returning a frozen result of :mod:`~moe_compile.passes.fuse_dispatch.steps`): in particular the region
    is row-wise, so the row order inside an expert (HF's unstable sort vs our stable one) and the padded
    layout do not change any combined value.

Skips when (reason tags, reported through ``explain``):
    ``descending_sort``, ``expert_ids_mutated`` (in-place writes to the ids that change ids in
    ``[0, E)``), ``expert_ids_unbounded`` (the graph handles sentinel ids ``>= E`` and the ids are not a
    router's top-k over ``E`` scores: expert parallelism), ``token_gather_not_matched``,
    ``weights_before_gather`` (rows weighted before the gather), ``multiple_gather_sources``,
    ``token_index_mismatch``, ``offsets_not_matched``, ``no_grouped_gemm``, ``padding_not_proven``,
    ``unsupported_alignment``, ``region_not_rowwise`` (an op between gather and combine mixes rows),
    ``shared_param_in_expert_region`` (training with a weight shared by all rows between the grouped GEMMs:
    NOTE [tail rows] (moe_compile/passes/forms/rowwise.py)),
    ``rows_escape_region`` (permuted rows are a graph output), ``combine_not_matched``,
    ``ops_unavailable``, ``internal_error`` (the matcher raised; the layer is left alone, other layers
    still rewrite; ``strict`` re-raises).

Stage:
    pre-grad (Dynamo's Torch IR). AOTAutograd then traces our ops' registered autograd, so one
    rewrite fixes forward and backward, for inference and training graphs and ``dynamic=True``
    alike; the joint graph would need the backward's ``index_put(accumulate=True)`` nodes matched too.

Seen in:
    transformers 5.x ``integrations/moe.py::grouped_mm_experts_forward`` (default experts
    implementation of ``*ForCausalLM`` models); hand-written sort + index_select + scatter_add_ layers
    and FP8-style device-padded layers (``tests/models/handwritten.py``).
"""

from moe_compile.passes.fuse_dispatch.rewrite import run

__all__ = ["run"]
