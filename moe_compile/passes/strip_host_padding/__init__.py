"""Strip host-sized expert padding: make a host-padded MoE dispatch static-shape and CUDA-graph safe.

Shape suffixes: ``T`` tokens, ``H`` hidden, ``E`` experts, ``K`` top-k, ``N = T*K`` routed rows, ``P``
host-sized padded rows, ``M = static_row_bound(N, E, a)`` (static).

Matches (Dynamo Torch IR, one region per combine)::

    permute   x_NH = x_TH[argsort(idx_TK.flatten()) // K]                         (or index_select; a
              masked_select over a top-k routing map arrives in this form: normalize's rule 6)
    counts    s_0..s_{E-1} = C.tolist()  (getitem + item per element), C a histogram of idx_TK
              (one_hot(...).sum(0), (idx == arange(E)).sum(0), routing_map.sum(0), histc)
    pad       x_PH = cat([F.pad(c_e, (0, 0, 0, q_e)) | cat([c_e, zeros(q_e, H)]) for c_e in split(x_NH, s)])
              with q_e == ceil(s_e / a) * a - s_e                                     (optional)
    experts   row-wise ops and grouped GEMMs whose ``offs`` equal cumsum of the padded sizes
              (torch.tensor(host list) [.cumsum(0)] .to(int32), or cumsum of C on the device)
    unpad     y_NH = cat([narrow(y_e, 0, 0, s_e) | y_e[:s_e] for y_e in split(y_PH, padded sizes)])  (optional)
    combine   zeros(T, H).index_add_(0, token_N, (y_NH * probs_N[:, None]).to(dtype))
              | zeros(T, H).scatter_add_(0, token_N[:, None].expand(-1, H), ...)
              with probs_N = probs_TK.flatten()[order] | probs_TE[order // K, ids[order]]  (optional)

Rewrites to::

    rows_MH, _, offs_E, row_map, _ = moe.permute_pad(x_TH, idx_TK, None, E, a)
    y_MH = experts(rows_MH) with offs=offs_E
    y_TH = moe.unpad_unpermute(y_MH, row_map, probs_TK) [.to(dtype)]

then erases the host reads (``item``) that no longer feed a tensor op, with their ``_assert_scalar``
checks (side-effecting: DCE would keep them). A model that pads on the host right after
``moe.permute_pad`` has its pad, narrow and host offsets removed (``_pad_after_permute_pad``): the rows are
already aligned and are not padded twice. The permute forms are ``_permute_forms``'s.

Fires when: every step above is proven. The permutation is proven from the graph (ascending argsort of
the same ids whose histogram gives the split sizes), the pad lengths, padded sizes and offsets are proven by
evaluating their symbolic expressions on sample counts (:func:`moe_compile.passes._host_sync.same_on_samples`), and
every op between pad and unpad is row-wise, so the row order inside an expert and the static buffer change no output.

Skips when (reason tags):
    ``combine_buffer_reused`` (the zeros buffer is read before the combine), ``combine_index_not_matched``,
    ``permute_not_matched`` (no argsort permute behind the combine index), ``counts_not_histogram``
    (split sizes not proven to be the per-expert counts of the permuted ids), ``pad_not_matched``,
    ``alignment_unsupported``, ``unpad_not_matched``, ``offsets_not_matched``, ``probs_not_matched``
    (the combine weight is not the routing prob permuted alongside), ``region_not_rowwise`` (an op
    between pad and unpad mixes rows), ``host_size_in_expert_region``, ``expert_region_escapes`` (a
    padded tensor is used outside the region), ``shared_param_in_expert_region`` (training with a weight
    shared by all rows between pad and unpad: its gradient would sum over the static buffer's
    uninitialized tail rows), ``ops_unavailable``, ``host_read_kept`` (recorded after
    the rewrites when host reads still feed tensor ops, e.g. a logging ``.item()``: the graph stays
    CUDA-graph unsafe), ``already_aligned`` (the host pad is a no-op on rows that are already aligned:
    it is removed, nothing is padded again).

Stage: pre-grad. Only Dynamo's Torch IR still shows ``tolist`` / ``split`` / ``F.pad`` as such; after the
rewrite AOTAutograd traces the ops' registered autograd, so forward and backward are both static.
Needs the region to be captured: ``fullgraph=True`` or ``moe_compile.compile`` (capture flags).

Seen in: torchao / legacy torchtitan ``_permute`` + host-padded grouped GEMM, TransformerEngine
``Fp8Padding`` / ``Fp8Unpadding`` with host ``m_splits``, Megatron-LM's unfused ``permute`` /
``unpermute`` (``masked_select`` + ``scatter_add_``) with ``tokens_per_expert.tolist()``
(``tests/models/host_padded.py``).
"""

from moe_compile.passes.strip_host_padding.rewrite import run

__all__ = ["run"]
