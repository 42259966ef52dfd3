"""``moe.gather_rows`` / ``ep_send_index`` / ``ep_regroup_index`` on CUDA: no host sync forward or backward (CUDA's
sync debug mode raises on one), the CPU results, ``opcheck``."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from moe_compile.ops.expert_parallel import ep_regroup_index, ep_send_index, gather_rows  # noqa: E402


def _exchange(counts: torch.Tensor, rows: torch.Tensor, S: int) -> tuple[torch.Tensor, ...]:
    """Pack, regroup, un-regroup and unpack on one rank (the exchange without the network), with a gradient."""
    send = counts.sum(1)
    pack, slot = ep_send_index(send, rows.shape[0], S)
    regroup, inverse, offs = ep_regroup_index(counts, S)
    grouped = gather_rows(gather_rows(rows, pack, slot), regroup, inverse)
    out = gather_rows(gather_rows(grouped * 2, inverse, regroup), slot, pack)
    (grad,) = torch.autograd.grad(out.square().sum(), rows)
    return pack, slot, regroup, inverse, offs, grouped, out, grad


@pytest.mark.parametrize("S", [3, 64])
def test_no_host_sync_and_matches_cpu(S):
    gen = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 9, (4, 8), generator=gen)
    rows = torch.randn(int(counts.sum()), 64, generator=gen, requires_grad=True)
    want = _exchange(counts, rows, S)
    rows_cuda = rows.detach().cuda().requires_grad_()
    counts_cuda = counts.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = _exchange(counts_cuda, rows_cuda, S)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for g, w in zip(got, want):
        assert torch.equal(g.cpu(), w), (g, w)


def test_opcheck_cuda():
    counts = torch.tensor([[2, 0, 3], [1, 4, 0]], device="cuda")
    send = counts.sum(1)
    torch.library.opcheck(torch.ops.moe.ep_send_index.default, (send, 10, 4))
    torch.library.opcheck(torch.ops.moe.ep_regroup_index.default, (counts, 4))
    pack, slot = ep_send_index(send, 10, 4)
    rows = torch.randn(10, 16, device="cuda", requires_grad=True)
    torch.library.opcheck(torch.ops.moe.gather_rows.default, (rows, pack, slot))
