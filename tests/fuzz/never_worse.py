"""Never worse, measured: moe_compile's error against a wider reference next to eager's and plain Inductor's.

``python -m tests.fuzz.never_worse [--families F ...] [--no-families] [--corpus N] [--json PATH]``

For every layer (each transformers MoE family of the family matrix, one training step of its tiny causal LM; and
each layer of the fuzzer's fixed corpus, ``tests.fuzz.grammar.corpus(N, seed)``), every tensor of the step (loss or
outputs, every gradient) is computed four ways: eager in the low-precision dtype, eager in a wider one (the
reference), ``backend="moe_compile"`` and plain Inductor. One line per layer shows the tensor where moe_compile is
furthest from the reference relative to eager's own error, as ``|moe - ref|``, ``|eager - ref|``,
``|inductor - ref|`` (max over the tensor) and the ratios of moe_compile's and plain Inductor's errors to the
eager-only bound of :func:`tests._tolerance.eager_bound_errors` (``4 |eager - ref| + u max|ref|``): a ratio at or
below 1 is no worse than eager allows. ``verdict`` is the family matrix's and the fuzzer's judgement
(:func:`tests._tolerance.within_eager_bound`, with plain Inductor's own error added to the bound where moe_compile
alone is past it). The full family matrix takes about an hour on 2 cores; name families to run a subset.
"""

from __future__ import annotations

import argparse
import copy
import json
import pathlib
import time
import warnings
from typing import Any

import torch

from tests._tolerance import TensorError, eager_bound_errors, within_eager_bound

Step = dict[str, torch.Tensor]


def compare(name: str, eager: Step, ref: Step, moe: Step | None, inductor: Step | None, dtype: torch.dtype,
            rewrites: list[str], always_judged: tuple[str, ...]) -> dict[str, Any]:
    """One layer's row: the worst tensor (by moe_compile's ratio to the eager bound) and the verdict."""
    if moe is None or inductor is None:
        return {"layer": name, "status": "compile fails: " + ("moe_compile" if moe is None else "plain Inductor"),
                "rewrites": rewrites}
    moe_rows = {r.name: r for r in eager_bound_errors(moe, eager, ref, dtype=dtype)}
    ind_rows = {r.name: r for r in eager_bound_errors(inductor, eager, ref, dtype=dtype)}
    worst = max(moe_rows.values(), key=lambda r: _key(r.ratio))
    ok, judged_worst, unjudged = within_eager_bound(moe, eager, ref, dtype=dtype, always_judged=always_judged)
    noise = "eager"
    if not ok:
        ok, judged_worst, unjudged = within_eager_bound(moe, eager, ref, inductor, dtype=dtype,
                                                        always_judged=always_judged)
        noise = "eager + plain Inductor"
    ind = ind_rows[worst.name]
    return {"layer": name, "status": "ok", "rewrites": rewrites, "worst": worst.name, "moe_err": worst.compiled,
            "eager_err": worst.eager, "inductor_err": ind.compiled, "moe_ratio": worst.ratio, "inductor_ratio":
            ind.ratio, "worst_inductor_ratio": max((_key(r.ratio) for r in ind_rows.values()), default=0.0),
            "verdict": "ok" if ok else "WORSE", "noise": noise, "judged_worst": list(judged_worst),
            "unjudged": unjudged, "note": worst.note,
            "tensors": [_row(moe_rows[n], ind_rows[n]) for n in moe_rows]}


def _key(ratio: float) -> float:
    return float("inf") if ratio != ratio else ratio


def _row(moe: TensorError, ind: TensorError) -> dict[str, Any]:
    return {"name": moe.name, "moe_err": moe.compiled, "eager_err": moe.eager, "inductor_err": ind.compiled,
            "bound": moe.bound, "moe_ratio": moe.ratio, "inductor_ratio": ind.ratio}


def family_row(family: str) -> dict[str, Any]:
    """A family's training step four ways (``tests/models/hf_families.py`` builds it)."""
    from moe_compile import report
    from tests.models.hf_families import Unbuildable, _loss_and_grads, build

    try:
        model, inputs = build(family)
    except Unbuildable as exc:
        return {"layer": family, "status": f"skip: {exc}", "rewrites": []}
    model.train()

    def named(step: tuple[torch.Tensor, Step]) -> Step:
        return {"loss": step[0], **step[1]}

    ref = named(_loss_and_grads(copy.deepcopy(model).float(), inputs))
    eager = named(_loss_and_grads(model, inputs))
    steps: dict[str, Step | None] = {}
    rewrites: list[str] = []
    for backend in ("moe_compile", "inductor"):
        torch._dynamo.reset()
        try:
            with report.collecting() as rep, torch._inductor.config.patch(force_disable_caches=True):
                steps[backend] = named(_loss_and_grads(model, inputs, torch.compile(model, backend=backend,
                                                                                   fullgraph=True)))
        except Exception:  # noqa: BLE001 - a compile failure is this row's status
            steps[backend] = None
        finally:
            torch._dynamo.reset()
        if backend == "moe_compile":
            rewrites = sorted({r.pass_name for r in rep.rewrites})
    return compare(family, eager, ref, steps["moe_compile"], steps["inductor"], torch.bfloat16, rewrites, ("loss",))


def corpus_row(index: int, spec: Any, backend: str) -> dict[str, Any]:
    """A fuzzer corpus layer four ways (:func:`tests.fuzz.harness.check` with plain Inductor always run)."""
    from tests.fuzz.emit import DTYPES
    from tests.fuzz.harness import check

    result = check(spec, backend, always_plain=True)
    steps = result.steps
    if not steps:
        return {"layer": f"corpus[{index}]", "status": result.kind, "spec": str(spec), "rewrites": result.rewrites}
    outs = tuple(n for n in steps["eager"] if n.rpartition(":")[2].startswith("out"))
    row = compare(f"corpus[{index}]", steps["eager"], steps["ref"], steps["compiled"], steps["plain"],
                  DTYPES[spec.dtype], result.rewrites, outs)
    return {**row, "spec": str(spec)}


def format_row(row: dict[str, Any]) -> str:
    head = f"{row['layer']:20s} {','.join(row['rewrites']) or '-':60.60s}"
    if row["status"] != "ok":
        return f"{head} {row['status'][:100]}"
    return (f"{head} {row['worst'][:36]:36s} moe {row['moe_err']:9.3g} eager {row['eager_err']:9.3g} "
            f"inductor {row['inductor_err']:9.3g}  moe/bound {row['moe_ratio']:6.3g} inductor/bound "
            f"{row['inductor_ratio']:6.3g}  {row['verdict']}")


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Print the table (see the module docstring); returns its rows."""
    from tests.fuzz.grammar import corpus

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*", help="family matrix families (default: all of them)")
    parser.add_argument("--no-families", action="store_true")
    parser.add_argument("--corpus", type=int, default=40, help="layers of the fuzzer's corpus (0: none)")
    parser.add_argument("--corpus-seed", type=int, default=0)
    parser.add_argument("--backend", choices=("inductor", "passes"), default="inductor",
                        help="corpus layers: real Inductor, or moe_compile's passes with eager kernels")
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    print(f"{'layer':20s} {'rewrites':60s} {'worst tensor':36s} max |x - ref| over it; ratio to 4|eager - ref| + "
          "u max|ref|", flush=True)
    families: list[str] = []
    if not args.no_families:
        from tests.models.hf_families import moe_families

        families = args.families or list(moe_families())
    for family in families:
        rows.append(family_row(family))
        print(format_row(rows[-1]), flush=True)
    for i, spec in enumerate(corpus(args.corpus, args.corpus_seed)):
        rows.append(corpus_row(i, spec, args.backend))
        print(format_row(rows[-1]), flush=True)
    judged = [r for r in rows if r["status"] == "ok"]
    worse = [r["layer"] for r in judged if r["verdict"] != "ok"]
    print(f"{len(judged)} layers judged ({len(rows) - len(judged)} not: skipped or not compiled), "
          f"{sum(r['moe_ratio'] <= 1 for r in judged)} within eager's bound alone, {len(worse)} worse than eager "
          f"and plain Inductor allow{': ' + ', '.join(worse) if worse else ''}; {time.perf_counter() - start:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        import transformers

        args.json.write_text(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                                         "backend": args.backend, "corpus_seed": args.corpus_seed, "rows": rows},
                                        indent=1, default=_jsonable))
    return rows


def _jsonable(x: Any) -> Any:
    return str(x)


if __name__ == "__main__":
    main()
