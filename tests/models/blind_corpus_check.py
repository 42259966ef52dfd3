"""What moe_compile makes of the blind corpus (``tests/models/blind_corpus``: MoE layers written from public MoE code by
someone who had not read the passes): per layer, whether it was rewritten, compiled as one graph with no graph break,
left no accumulating scatter or host sync (``Report.clean``), and gave a training step within eager's distance from a
float64 run on every tensor (output, input gradient, every parameter gradient).

``python -m tests.models.blind_corpus_check [--layers a,b] [--json PATH]`` prints the table and the rate;
``tests/models/test_blind_corpus.py`` asserts it per layer (slow). ``tests/models/BLIND_CORPUS.md`` keeps the runs.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import traceback

import torch
from torch import nn
from torch._dynamo.utils import counters

import moe_compile
from moe_compile import report
from tests import _tolerance as tol


class _First(nn.Module):
    """The layer's output tensor (a layer returning ``(out, aux)`` is judged on ``out``)."""

    def __init__(self, layer: nn.Module, returns_tuple: bool) -> None:
        super().__init__()
        self.layer, self.returns_tuple = layer, returns_tuple

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layer(x)
        return out[0] if self.returns_tuple else out


@dataclasses.dataclass
class Outcome:
    name: str
    style: str
    dtype: str = ""
    rewritten: bool = False
    graphs: int = 0
    graph_breaks: int = 0
    clean: bool = False
    within_bound: bool = False
    worst: str = ""
    error: str = ""
    records: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Rewritten, one graph, no graph break, clean, and within eager's bound."""
        return (self.rewritten and self.graphs == 1 and self.graph_breaks == 0 and self.clean and self.within_bound
                and not self.error)


def _needs_bf16(exc: BaseException) -> bool:
    """CPU Inductor compiles ``torch._grouped_mm`` in bf16 only."""
    return "BF16" in str(exc) or "bfloat16" in str(exc)


def check(entry, seed: int = 0, dtype: torch.dtype = torch.float32) -> Outcome:
    """One layer of the corpus through ``moe_compile.compile`` (the entry point the README recommends)."""
    out = Outcome(entry.name, entry.style, str(dtype).removeprefix("torch."))
    gen = torch.Generator().manual_seed(seed + 1)
    original = _First(entry.make(dtype, seed), entry.returns_tuple)
    x = torch.randn(entry.input_shape, generator=gen).to(dtype)
    cot = torch.randn(entry.input_shape, generator=gen)
    # copies before any forward: a layer may keep non-leaf tensors of its last call (an aux loss) as attributes
    wide = torch.float64 if dtype == torch.float32 else torch.float32
    ref_model, model, plain = copy.deepcopy(original).to(wide), copy.deepcopy(original), copy.deepcopy(original)
    eager = tol.layer_step(original, original, x, cot)
    try:
        ref = tol.layer_step(ref_model, ref_model, x, cot, wide)
    except RuntimeError:
        if dtype != torch.float32:
            raise
        # the layer casts to float32 itself (a router kept in fp32): no float64 run; bf16 judged against float32
        return check(entry, seed, torch.bfloat16)
    torch._dynamo.reset()
    counters.clear()
    try:
        with report.collecting() as rep, torch._inductor.config.patch(force_disable_caches=True):
            compiled = moe_compile.compile(model)
            got = tol.layer_step(compiled, model, x, cot)
            rep.records[:0] = report.module_records(model)
    except Exception as exc:  # noqa: BLE001 - a layer that fails to compile is an outcome, not a crash of the run
        if dtype == torch.float32 and _needs_bf16(exc):
            return check(entry, seed, torch.bfloat16)
        out.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        out.records = traceback.format_exc().splitlines()[-3:]
        return out
    finally:
        torch._dynamo.reset()
    out.graph_breaks = sum(counters["graph_break"].values())
    out.graphs = rep.graphs
    out.clean = rep.clean
    out.rewritten = any(r.kind == "rewrite" and r.moe for r in rep.records)
    out.records = [f"{r.pass_name}:{r.kind}:{r.what}" for r in rep.records if r.kind in ("rewrite", "skip", "error")
                   and (r.moe or r.kind != "rewrite")]
    for name, p in model.named_parameters():  # an expert no token reached: no gradient in eager, zeros rewritten
        if p.requires_grad:
            got.setdefault(f"grad:{name}", torch.zeros_like(p))
            eager.setdefault(f"grad:{name}", torch.zeros_like(p))
            ref.setdefault(f"grad:{name}", torch.zeros_like(p, dtype=torch.float64))
    ok, worst, unjudged = tol.within_eager_bound(got, eager, ref, dtype=dtype, always_judged=tuple(ref))
    if not ok:
        # a layer that rounds to bf16 itself (around a grouped GEMM) rounds alike in eager and in the wide run:
        # plain Inductor's distance from the wide run is then part of the bound, as tests/_tolerance.py allows
        torch._dynamo.reset()
        try:
            with torch._inductor.config.patch(force_disable_caches=True):
                inductor = tol.layer_step(torch.compile(plain), plain, x, cot)
        finally:
            torch._dynamo.reset()
        for name, p in plain.named_parameters():
            if p.requires_grad:
                inductor.setdefault(f"grad:{name}", torch.zeros_like(p))
        ok, worst, unjudged = tol.within_eager_bound(got, eager, ref, inductor, dtype=dtype, always_judged=tuple(ref))
    out.within_bound = ok and not unjudged
    out.worst = f"{worst[0]} {worst[1]:.2f}" + (f"; unjudged {unjudged}" if unjudged else "")
    return out


def run(names: list[str] | None = None) -> list[Outcome]:
    from tests.models.blind_corpus import LAYERS

    chosen = [e for e in LAYERS if not names or e.name in names]
    outcomes = []
    for entry in chosen:
        try:
            outcome = check(entry)
        except Exception as exc:  # noqa: BLE001 - the layer's eager or float64 step itself failed
            outcome = Outcome(entry.name, entry.style, error=f"eager: {type(exc).__name__}: {str(exc)[:160]}")
        outcomes.append(outcome)
        print(f"{'ok  ' if outcome.ok else 'MISS'} {outcome.name:40s} {outcome.style:16s} {outcome.dtype:8s} "
              f"rewritten={outcome.rewritten!s:5s} graphs={outcome.graphs} breaks={outcome.graph_breaks} "
              f"clean={outcome.clean!s:5s} bound={outcome.within_bound!s:5s} {outcome.worst} {outcome.error}",
              flush=True)
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="", help="comma-separated layer names (default: all)")
    parser.add_argument("--json", default="", help="write the outcomes here")
    args = parser.parse_args(argv)
    outcomes = run([n for n in args.layers.split(",") if n] or None)
    good = sum(o.ok for o in outcomes)
    print(f"\n{good}/{len(outcomes)} rewritten and clean ({100.0 * good / max(len(outcomes), 1):.0f}%)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**dataclasses.asdict(o), "ok": o.ok} for o in outcomes], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
