"""Expert parallelism without host syncs: the rows exchange at host-read split sizes -> a static padded exchange.

Matches (torchtitan's ``ExpertParallel``, ``tests/models/ep_layers.py::TitanStyleEP``), on each rank of ``W``, with
``L`` experts per rank and ``N`` routed rows sorted by expert (so grouped by destination rank)::

    C = wait(all_to_all_single(counts_E, [E/W]*W, [E/W]*W))           # counts exchange, static: kept
    send_W = counts_E.view(W, L).sum(1);  recv_W = C.view(W, L).sum(1)
    recv = wait(all_to_all_single(rows_NH, recv_W.tolist(), send_W.tolist()))       # A: host reads
    perm = <(source, expert) -> (expert, source) regroup of C.view(W, L)>             # device
    offs = C.view(W, L).sum(0).cumsum(0).int()
    y = <row-wise region on recv[perm]: grouped GEMMs at offs, GLU, casts, ...>
    back = zeros_like(y).index_copy(0, perm, y)                                       # or zeros[perm] = y
    returned = wait(all_to_all_single(back, send_W.tolist(), recv_W.tolist()))       # B: host reads

Rewrites to, with ``S`` rows per destination: ``moe.ep_capacity_factor=None`` (default) the bound, no row dropped
(``N``, or ``T * min(K, L)`` when the counts are a top-k's histogram: a token sends a rank at most ``min(K, L)``
rows); a float ``f``: ``ceil(f * N / W)``, at least 1 and at most the bound::

    pack, slot = moe.ep_send_index(send_W, N, S)            # device indices, sentinels for padding / drops
    regroup, inverse, offs' = moe.ep_regroup_index(C.view(W, L), S)
    recv_buf = wait(all_to_all_single(moe.gather_rows(rows_NH, pack, slot), [S]*W, [S]*W))   # [W*S, H]
    y' = <the same region on moe.gather_rows(recv_buf, regroup, inverse), grouped GEMMs at offs'>
    returned' = moe.gather_rows(wait(all_to_all_single(moe.gather_rows(y', inverse, regroup), [S]*W, [S]*W)),
                                slot, pack)                                                  # [N, H]

Destination block ``w`` of the send buffer holds the rows for experts ``w*L .. w*L+L-1`` in order, then zero
padding; rows past ``S`` in a block are dropped (their ``returned'`` rows are zero, their gradients zero). The
received buffer is regrouped by local expert, then source rank, then row; rows past ``offs'[-1]`` are padding that
no result reads. Every data movement is ``moe.gather_rows``, whose backward is the inverse gather: no atomics, no
host read, forward and backward deterministic. The host reads of the split sizes are erased. When the counts are
``bincount(ids, minlength=E)`` of a top-k over ``E`` scores, whose length is data-dependent to the compiler (a host
sync on CUDA), they become ``diff(searchsorted(sort(ids), arange(E + 1)))``: static, no atomics.

``S`` is static, so every rank of the group must compile the layer with the same ``N`` (the same tokens per rank):
the exchange's equal splits are ``S`` on both ends.

Fires when (:mod:`~moe_compile.passes.expert_parallel.match` proves it step by step): both exchanges' split sizes
are ``.item()`` reads of device vectors, B's are A's swapped, in one group; A's result is gathered once by a
device permutation, the region from there to one un-regroup by the same permutation is row-wise
(:mod:`~moe_compile.passes.forms.rowwise`, fuse_dispatch's policy) with grouped GEMMs; the output split sizes,
the permutation and the offsets are checked on sample counts as functions of the received counts ``C`` alone.
The program is assumed valid as eager requires (the input split sizes sum to ``N``).

An exchange written as an ``autograd.Function`` around ``dist.all_to_all_single`` (Megatron's ``_AllToAll``),
which Dynamo traces into an ``autograd_function_apply``, is first made the functional autograd collective when its
bodies are proven to be the exchange and its reverse
(:mod:`~moe_compile.passes.expert_parallel.autograd_exchange`), then matched as above.

Skips when (reason tags, reported through ``explain``): ``splits_not_host_reads``, ``splits_are_graph_inputs``,
``autograd_exchange_unproven``, ``symbolic_rows`` (``N`` not static), ``regroup_not_matched``,
``region_not_rowwise``, ``rows_escape_region``, ``inverse_not_matched``, ``no_grouped_gemm``,
``exchanges_not_paired``, ``counts_not_exchanged``, ``offsets_not_matched``, ``ops_unavailable``,
``internal_error``.

Stage: pre-grad (Dynamo's Torch IR); AOTAutograd traces the ops' autograd and the functional all-to-all's.
Translation validation cannot run graphs with collectives (``validation_unavailable``): ``tests/models/test_ep.py``
compares against eager on 2 gloo ranks.
"""

from moe_compile.passes.expert_parallel.rewrite import run

__all__ = ["run"]
