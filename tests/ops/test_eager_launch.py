"""The cached eager Triton launch (NOTE [cached eager launch] (moe_compile/ops/_eager_launch.py)).

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
    """Forward and backward of permute_pad -> unpad_unpermute (every launcher of the two ops)."""
    x, probs = x.detach().requires_grad_(True), probs.detach().requires_grad_(True)
    out = permute_pad(x, ids, probs, num_experts=E, align=16)
    y = unpad_unpermute(out.rows_MH * 1.5, out.row_map, probs)
    weight = torch.linspace(-1, 1, y.numel(), device=y.device).view_as(y).to(y.dtype)
    (y * weight).sum().backward()
    return [out.rows_MH, out.probs_M, out.offs_E, out.row_map, out.counts_E, y, x.grad, probs.grad]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("H", [64, 72])
def test_cached_and_replayed_launches_match_triton_launch_bitwise(monkeypatch, H):
    import sys

    T, E, K = 37, 6, 2
    ids = torch.rand(T, E, device="cuda").argsort(1)[:, :K].contiguous()
    probs = torch.rand(T, K, device="cuda").to(torch.bfloat16)
    aligned = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    misaligned = _misaligned((T, H), torch.bfloat16, "cuda")
    misaligned.copy_(aligned)
    monkeypatch.setattr(_eager_launch, "ENABLED", False)
    want = {id(x): _dispatch(x, ids, probs, E) for x in (aligned, misaligned)}
    monkeypatch.setattr(_eager_launch, "ENABLED", True)
    from moe_compile.ops.triton import dispatch as kernels

    # the first call of a specialisation compiles / finds it and records it, later calls with its key replay;
    # aligned and misaligned inputs of one shape alternate (different keys: Triton specialises on alignment)
    for x in (aligned, misaligned, aligned, misaligned, aligned):
        got = _dispatch(x, ids, probs, E)
        for g, w in zip(got, want[id(x)], strict=True):
            assert torch.equal(_bits(g), _bits(w))
    assert _eager_launch.cached_kernels(kernels._permute_rows_kernel) >= 2
    pp, uu = sys.modules["moe_compile.ops.permute_pad"], sys.modules["moe_compile.ops.unpad_unpermute"]
    for replays in (pp._REPLAYS, uu._GATHER_SUM_REPLAYS, uu._BACKWARD_REPLAYS):
        assert len(replays.recorded) >= 1


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


# ===== replay keys: a launcher's replay key is at least as fine as every launch's key =====
# (NOTE [replayed eager launches] (moe_compile/ops/_eager_launch.py))


def _launches_by_replay_key(monkeypatch, calls) -> dict[tuple, set[tuple]]:
    """Run each launcher call on CPU tensors with the launches captured (not run); map each replay key the
    launcher built to the set of what its launches were (kernel, grid, Triton-level key of every argument)."""
    from triton.runtime.jit import JITFunction

    from moe_compile.ops import _common

    launched: list[tuple] = []
    keys: list[tuple] = []

    def capture(kernel, grid, *args, traced, options, record=None, **kwargs):
        if type(kernel) is not JITFunction:
            pytest.skip("the interpreter's kernels are launched through Triton")
        launches = _eager_launch._launches_of(kernel)
        key, _ = _eager_launch.key_and_pointers(launches, -1, args, {**kwargs, **options})
        launched.append((kernel.fn.__name__, tuple(grid), key))
        if record is not None:
            record.append(None)

    replay_key = _eager_launch.replay_key

    def spy_key(*a):
        keys.append(replay_key(*a))
        return keys[-1]

    monkeypatch.setattr(_common, "launch_kernel", capture)
    monkeypatch.setattr(_eager_launch, "replay_key", spy_key)
    seen: dict[tuple, set[tuple]] = {}
    for call in calls:
        launched.clear()
        n_keys = len(keys)
        call()
        assert len(keys) == n_keys + 1, "the launcher built no replay key"
        seen.setdefault(keys[-1], set()).add(tuple(launched))
    return seen


def _dispatch_inputs(gen: torch.Generator, T, H, E, K, dtype, with_probs, misaligned, wide, ids_dtype):
    if misaligned:
        x = _misaligned((T, H), dtype, "cpu")
    elif wide:  # rows of a wider buffer: stride(0) != H
        x = torch.randn(T, H + 8, generator=gen).to(dtype)[:, :H]
    else:
        x = torch.randn(T, H, generator=gen).to(dtype)
    ids = torch.rand(T, E, generator=gen).argsort(1)[:, :K].to(ids_dtype)
    probs = torch.rand(T, K, generator=gen).to(dtype) if with_probs else None
    return x, ids, probs


_FLIPS = {"T": [5, 16], "H": [16, 24], "K": [1, 2], "dtype": [torch.bfloat16, torch.float32],
          "with_probs": [True, False], "misaligned": [True, False], "wide": [True, False],
          "ids_dtype": [torch.int64, torch.int32], "align": [1, 16], "debug": [False, True]}


def _dispatch_cases(seed: int, n: int):
    """``n`` random configurations, each twice (fresh tensors), then once with each property flipped: a key
    that leaves out a property the launches depend on maps a flipped case and its base to one key."""
    gen = torch.Generator().manual_seed(seed)
    pick = lambda options: options[int(torch.randint(len(options), (1,), generator=gen))]  # noqa: E731
    for _ in range(n):
        base = {name: pick(options) for name, options in _FLIPS.items()} | {"E": 4}
        flipped = [base | {name: next(o for o in options if o != base[name])} for name, options in _FLIPS.items()]
        for case in [base, base, *flipped]:
            tensors = _dispatch_inputs(gen, **{k: v for k, v in case.items() if k not in ("align", "debug")})
            yield case, tensors, case["align"], case["debug"]


def _check_replay_keys(seen: dict[tuple, set[tuple]]) -> None:
    for key, launches in seen.items():
        assert len(launches) == 1, f"replay key {key} covers launches that Triton tells apart: {launches}"
    # not vacuous: several keys, and different keys where Triton's keys differ
    assert len(seen) > 5


def test_permute_pad_replay_key_fixes_its_launches(monkeypatch):
    import sys

    pp = sys.modules["moe_compile.ops.permute_pad"]
    calls = [
        (lambda s=s, x=x, ids=ids, probs=probs, a=a, d=d: pp._launch_triton(x, ids, probs, s["E"], a, d))
        for s, (x, ids, probs), a, d in _dispatch_cases(0, 6)
    ]
    _check_replay_keys(_launches_by_replay_key(monkeypatch, calls))


def test_unpermute_replay_keys_fix_their_launches(monkeypatch):
    import sys

    from moe_compile.ops import permute_pad_reference

    uu = sys.modules["moe_compile.ops.unpad_unpermute"]
    forward, backward = [], []
    for s, (x, ids, probs), a, d in _dispatch_cases(1, 6):
        out = permute_pad_reference(x.contiguous(), ids, probs, s["E"], a)
        rows, row_map = out.rows_MH, out.row_map
        if s["misaligned"]:
            rows = _misaligned(tuple(rows.shape), rows.dtype, "cpu")
        grad_probs_M = out.probs_M if (probs is not None and s["wide"]) else None  # permute_pad's backward
        forward.append(
            lambda rows=rows, row_map=row_map, p=probs if grad_probs_M is None else None, d=d, g=grad_probs_M: (
                uu.launch_gather_sum_triton(rows, row_map, p, d, grad_probs_M=g)
            )
        )
        grad_y = torch.randn(x.shape[0], x.shape[1]).to(x.dtype)
        backward.append(lambda g=grad_y, row_map=row_map, p=probs, r=rows if s["wide"] else None, m=rows.shape[0], d=d:
                        uu.launch_unpad_unpermute_backward_triton(g, row_map, p, r, m, d))
    _check_replay_keys(_launches_by_replay_key(monkeypatch, forward))
    _check_replay_keys(_launches_by_replay_key(monkeypatch, backward))


def test_launch_hooks_turn_off_cached_launches_and_replays(monkeypatch):
    """While Triton launch hooks are set (a profiler), neither a cached launch nor a replay runs: the launch goes
    through ``kernel[grid]`` and records nothing replayable. Driver and runtime are stand-ins (CPU)."""
    import types

    calls = []

    class Driver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device):
            return 7

    class Kernel:
        def __getitem__(self, grid):
            return lambda *a, **k: calls.append(("triton", grid))

    kernel = Kernel()
    runtime = types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)
    monkeypatch.setattr(_eager_launch, "_runtime", (runtime, Driver()))
    monkeypatch.setattr(_eager_launch, "_launches_of", lambda k: _eager_launch._KernelLaunches.__new__(
        _eager_launch._KernelLaunches))
    replays = _eager_launch.Replays()
    replays.recorded["key"] = (("run", "fn", "meta", (), 1, 1, 1),)
    assert replays.get("key", 0) == (replays.recorded["key"], 7)  # no hooks: replayable on the current device
    assert replays.get("key", 1) is None  # another device
    runtime.launch_enter_hook = lambda *a: None
    assert replays.get("key", 0) is None
    record = []
    _eager_launch.launch(kernel, (3,), (1, 2), {}, record)
    assert calls == [("triton", (3,))] and record == [None]
