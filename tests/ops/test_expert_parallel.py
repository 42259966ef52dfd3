"""``moe.gather_rows``, ``moe.ep_send_index``, ``moe.ep_regroup_index`` (``moe_compile/ops/expert_parallel.py``) on CPU:
against plain Python references of the padded exchange's layout, ``opcheck``, and the gather's gradient."""

from __future__ import annotations

import pytest
import torch

from moe_compile.ops.expert_parallel import ep_regroup_index, ep_send_index, gather_rows


def _send_reference(send: list[int], S: int) -> list[int]:
    """Block ``w`` of ``S`` rows: the first ``min(send[w], S)`` rows for rank ``w``, then the sentinel ``N``."""
    N, pack, start = sum(send), [], 0
    for n in send:
        kept = min(n, S)
        pack += [start + p for p in range(kept)] + [N] * (S - kept)
        start += n
    return pack


def _regroup_reference(counts: torch.Tensor, S: int) -> list[int]:
    """Received slots by local expert, then source rank, then row (blocks truncated to ``S``)."""
    W, L = counts.shape
    out = []
    for e in range(L):
        for s in range(W):
            before = int(counts[s, :e].sum())
            out += [s * S + before + r for r in range(max(0, min(int(counts[s, e]), S - before)))]
    return out


def _cases(n: int = 120):
    gen = torch.Generator().manual_seed(0)
    for _ in range(n):
        W, L = (int(torch.randint(1, 5, (1,), generator=gen)) for _ in range(2))
        counts = torch.randint(0, 5, (W, L), generator=gen) * (torch.rand(W, L, generator=gen) > 0.25)
        yield counts, int(torch.randint(1, 10, (1,), generator=gen))


def test_send_index_matches_reference():
    for counts, S in _cases():
        send = counts.sum(1)
        N, W = int(send.sum()), send.numel()
        pack, slot = ep_send_index(send, N, S)
        want = _send_reference(send.tolist(), S)
        assert pack.tolist() == want
        for j, i in enumerate(want):  # slot is pack's inverse; dropped rows get the sentinel W*S
            if i < N:
                assert slot[i] == j
        assert int((slot < W * S).sum()) == sum(i < N for i in want)


def test_regroup_index_matches_reference():
    for counts, S in _cases():
        W, L = counts.shape
        regroup, inverse, offs = ep_regroup_index(counts, S)
        want = _regroup_reference(counts, S)
        assert regroup[:len(want)].tolist() == want and (regroup[len(want):] == W * S).all()
        assert offs.dtype == torch.int32 and offs[-1] == len(want)
        kept = [sum(1 for t in want if t // S == s and t % S >= int(counts[s, :e].sum())
                    and t % S < int(counts[s, :e + 1].sum())) for e in range(L) for s in range(W)]
        assert offs.tolist() == torch.tensor(kept).view(L, W).sum(1).cumsum(0).tolist()
        for d, t in enumerate(want):
            assert inverse[t] == d
        assert int((inverse < W * S).sum()) == len(want)


def test_gather_rows_forward_and_inverse_backward():
    src = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([4, 7, 0, 2, 5, 1])  # 7 and 5: out of range, zero rows; row 3 is read by no one
    inverse = torch.tensor([2, 5, 3, 6, 0])  # row 3: sentinel (6 = len(index)); row 1 at 5
    out = gather_rows(src, index, inverse)
    want = torch.stack([src[4], torch.zeros(3), src[0], src[2], torch.zeros(3), src[1]])
    assert torch.equal(out, want)
    g = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, src, g)
    assert torch.equal(grad, torch.stack([g[2], g[5], g[3], torch.zeros(3, dtype=torch.float64), g[0]]))
    torch.autograd.gradcheck(lambda s: gather_rows(s, index, inverse), (src,))


@pytest.mark.parametrize("S", [1, 4])
def test_opcheck(S):
    counts = torch.tensor([[2, 0, 3], [1, 4, 0]])
    send = counts.sum(1)
    torch.library.opcheck(torch.ops.moe.ep_send_index.default, (send, int(send.sum()), S))
    torch.library.opcheck(torch.ops.moe.ep_regroup_index.default, (counts, S))
    pack, slot = ep_send_index(send, int(send.sum()), S)
    rows = torch.randn(int(send.sum()), 8, requires_grad=True)
    torch.library.opcheck(torch.ops.moe.gather_rows.default, (rows, pack, slot))
    regroup, inverse, _ = ep_regroup_index(counts, S)
    buf = torch.randn(2 * S, 8, requires_grad=True)
    torch.library.opcheck(torch.ops.moe.gather_rows.default, (buf, regroup, inverse))


def test_gather_rows_round_trip_drops_to_zero():
    """pack then unpack (the exchange without the network): kept rows come back, dropped rows are zero."""
    send = torch.tensor([5, 1, 3])
    N, S = 9, 2
    pack, slot = ep_send_index(send, N, S)
    rows = torch.randn(N, 4)
    back = gather_rows(gather_rows(rows, pack, slot), slot, pack)
    kept = slot < 3 * S
    assert torch.equal(back[kept], rows[kept]) and not back[~kept].any()
    assert kept.tolist() == [True, True, False, False, False, True, True, True, False]
