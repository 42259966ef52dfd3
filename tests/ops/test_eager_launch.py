"""The cached eager Triton launch (NOTE [cached eager launch] in ``moe_compile/ops/_eager_launch.py``).

CPU: the launch key separates every argument property Triton specialises on. CUDA (``gpu``): the dispatch ops
launched through the cache give the bits of Triton's own launch path, across specialisations.
"""

from __future__ import annotations

import pytest
import torch

from moe_compile.ops import _eager_launch, permute_pad, unpad_unpermute
from moe_compile.ops._eager_launch import arg_key


def _misaligned(shape: tuple[int, int], dtype: torch.dtype, device: str) -> torch.Tensor:
    """A contiguous tensor whose address is not a multiple of 16 bytes."""
    flat = torch.randn(shape[0] * shape[1] + 1, device=device).to(dtype)
    t = flat[1:].view(shape)
    assert t.data_ptr() % 16 != 0
    return t


def test_key_separates_pointer_alignment_and_dtype():
    aligned = torch.randn(4, 8).to(torch.bfloat16)
    assert arg_key(aligned, False) == (torch.bfloat16, True)
    assert arg_key(_misaligned((4, 8), torch.bfloat16, "cpu"), False) == (torch.bfloat16, False)
    assert arg_key(aligned.float(), False) != arg_key(aligned, False)


@pytest.mark.parametrize(
    "a, b",
    [(1, 2), (16, 17), (32, 48 + 1), (2**31 - 16, 2**31), (-(2**31), -(2**31) - 16), (2**63 - 16, 2**63)],
)
def test_key_separates_what_triton_specialises_ints_on(a, b):
    # == 1, divisibility by 16, the int32 / int64 / uint64 argument type
    assert arg_key(a, False) != arg_key(b, False)


def test_key_merges_ints_triton_does_not_tell_apart():
    assert arg_key(3, False) == arg_key(5, False)
    assert arg_key(32, False) == arg_key(4096, False)


def test_key_keeps_constexpr_and_bool_values():
    assert arg_key(3, True) != arg_key(5, True)
    assert arg_key(True, False) != arg_key(False, False)
    assert arg_key(1.5, False) == arg_key(-2.0, False)
    assert arg_key(None, False) is None


def test_unhashable_argument_raises_type_error():
    # ``launch`` catches TypeError and takes Triton's own path
    with pytest.raises(TypeError):
        hash(arg_key([1, 2], False))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.is_floating_point() else t


def _dispatch(x: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor, E: int) -> list[torch.Tensor]:
    out = permute_pad(x, ids, probs, num_experts=E, align=16)
    y = unpad_unpermute(out.rows_MH, out.row_map, probs)
    return [out.rows_MH, out.probs_M, out.offs_E, out.row_map, out.counts_E, y]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("H", [64, 72])
@pytest.mark.parametrize("aligned", [True, False])
def test_cached_launch_matches_triton_launch_bitwise(monkeypatch, H, aligned):
    T, E, K = 37, 6, 2
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16) if aligned else _misaligned((T, H), torch.bfloat16, "cuda")
    ids = torch.rand(T, E, device="cuda").argsort(1)[:, :K].contiguous()
    probs = torch.rand(T, K, device="cuda").to(torch.bfloat16)
    monkeypatch.setattr(_eager_launch, "ENABLED", False)
    want = _dispatch(x, ids, probs, E)
    monkeypatch.setattr(_eager_launch, "ENABLED", True)
    from moe_compile.ops.triton import dispatch as kernels

    _dispatch(x, ids, probs, E)  # the first launch of a specialisation compiles / finds it, then it is cached
    assert _eager_launch.cached_kernels(kernels._permute_rows_kernel) >= 1
    for _ in range(2):
        got = _dispatch(x, ids, probs, E)
        for g, w in zip(got, want):
            assert torch.equal(_bits(g), _bits(w))


@pytest.mark.parametrize("constexprs_by_position", [False, True])
def test_key_and_pointers_pass_tensors_as_addresses(constexprs_by_position):
    from triton.runtime.jit import JITFunction

    from moe_compile.ops.triton import dispatch as kernels

    kernel = kernels._expert_offsets_kernel
    if type(kernel) is not JITFunction:  # under TRITON_INTERPRET the kernels are not cached
        pytest.skip("the interpreter's kernels are launched through Triton")
    launches = _eager_launch._launches_of(kernel)
    ids = torch.randint(0, 4, (6,))
    table = torch.zeros(40, dtype=torch.int32)
    args = (ids, table, table, table[:4], table[4:8], 6, 4, 2**31 + 1)
    constexprs = dict(ALIGN=32, E_PAD=16, BLOCK_N=1024, SUB=1, COPY_IDS=False, DEBUG=False, USE_PDL=False)
    if constexprs_by_position:
        args, kwargs = (*args, *constexprs.values()), {"num_warps": 4}
    else:
        kwargs = {**constexprs, "num_warps": 4}
    key, pointers = _eager_launch.key_and_pointers(launches, -1, args, kwargs)
    assert key == (-1, tuple(map(arg_key, args, launches.constexpr)), tuple(kwargs.items()))
    assert pointers[:5] == [ids.data_ptr(), table.data_ptr(), table.data_ptr(), table.data_ptr(), table[4:].data_ptr()]
    assert pointers[5:] == list(args[5:])
    # a tensor off the launch's CUDA device: no address list (the launch takes Triton's checked path)
    assert _eager_launch.key_and_pointers(launches, 0, args, kwargs)[1] is None
