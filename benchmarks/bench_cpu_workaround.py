"""Cost of moe_compile's CPU workaround for pytorch#185702 (``moe_compile/inductor_workarounds/cpp_outer_loop.py``).

Times one compiled training step (forward + backward) on CPU, one thread, of the expert-choice layer of
``tests/test_cpu_miscompile.py`` under three variants: the workaround (``cpp.simdlen=1`` for the backward graph only),
no workaround (wrong gradients: the ``x.grad`` column), and ``cpp.simdlen=1`` for the whole graph through
``options=``; and of a token-choice layer, which the workaround leaves alone (no record, same config). Each variant is
compiled with a fresh Inductor cache; the variants are timed in interleaved rounds (the machine may be shared).

    python -m benchmarks.bench_cpu_workaround [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

import moe_compile  # noqa: F401 - registers the backend
from moe_compile import report
from moe_compile.inductor_workarounds import cpp_outer_loop as iw
from tests.models.expert_choice import ExpertChoiceMoE
from tests.passes._harness import fresh_cache


class TokenChoiceMoE(ExpertChoiceMoE):
    """Top-2 token choice over the same experts (tokens per expert taken as balanced: a timing stand-in)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, H = x.shape
        x = x.reshape(-1, H)
        w, ids = torch.topk(F.softmax(self.router(x), dim=-1), 2, dim=-1)
        order = ids.reshape(-1).argsort(stable=True)
        tok = order // 2
        xe = x[tok].reshape(self.experts, -1, H)
        ye = torch.bmm(F.gelu(torch.bmm(xe, self.w1)), self.w2).reshape(-1, H) * w.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, tok, ye).reshape(B, S, H)


VARIANTS = {"workaround": (None, False), "none": (None, True), "simdlen1_whole_graph": ({"cpp.simdlen": 1}, False)}


def _step(model: torch.nn.Module, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    for p in model.parameters():
        p.grad = None
    x = x.detach().requires_grad_()
    model(x).backward(g)
    return x.grad


def _median_ms(model: torch.nn.Module, x: torch.Tensor, g: torch.Tensor, calls: int = 10) -> float:
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        _step(model, x, g)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="one small shape per layer")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    shapes = [(256, 64, 16)] if args.quick else [(256, 64, 16), (1024, 128, 32), (2048, 256, 64)]
    per_layer = {ExpertChoiceMoE: shapes, TokenChoiceMoE: shapes if args.quick else [(1024, 128, 32)]}
    for cls, layer_shapes in per_layer.items():
        for T, H, E in layer_shapes:
            for dtype in (torch.float32, torch.bfloat16):
                torch.manual_seed(0)
                model = cls(H, 2 * H, E).to(dtype)
                x, g = torch.randn(1, T, H, dtype=dtype), torch.randn(1, T, H, dtype=dtype)
                eager = _step(model, x, g).float()
                compiled, info = {}, {}
                for name, (options, off) in VARIANTS.items():
                    torch._dynamo.reset()
                    fixed_in = iw.FIXED_IN
                    iw.FIXED_IN = (0, 0) if off else fixed_in
                    try:
                        with report.collecting() as rep, fresh_cache():
                            compiled[name] = torch.compile(model, backend="moe_compile", options=options)
                            got = _step(compiled[name], x, g).float()
                            for _ in range(2):  # warm up
                                _step(compiled[name], x, g)
                    finally:
                        iw.FIXED_IN = fixed_in
                    info[name] = (((got - eager).norm() / eager.norm()).item(),
                                  [r.kind for r in rep.records if r.pass_name == iw.PASS_NAME])
                rounds: dict[str, list[float]] = {name: [] for name in compiled}
                for _ in range(5):
                    for name, c in compiled.items():
                        rounds[name].append(_median_ms(c, x, g))
                for name in compiled:
                    print(json.dumps({"layer": cls.__name__, "T": T, "H": H, "E": E, "dtype": str(dtype)[6:],
                                      "variant": name, "ms_best_round": round(min(rounds[name]), 3),
                                      "ms_median_round": round(statistics.median(rounds[name]), 3),
                                      "x_grad_from_eager": round(info[name][0], 4), "records": info[name][1]}),
                          flush=True)


if __name__ == "__main__":
    main()
