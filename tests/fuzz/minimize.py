"""Shrink a failing spec: ``python -m tests.fuzz.minimize --from fuzz.json --index 24 [--backend inductor]``.

Greedy, one field at a time: a field goes to its default (``Spec()``'s, the composed layer's) or to a smaller value
(fewer tokens, experts, top-k) as long as the layer still fails the same way (same verdict, and for a crash the same
first words of the error). Prints the minimal spec, its summary and its standalone script (``--out`` writes it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import warnings
from typing import Any

from tests.fuzz.emit import script
from tests.fuzz.grammar import Spec
from tests.fuzz.harness import Result, check

SMALLER: dict[str, tuple[Any, ...]] = {"tokens": (1, 2, 4, 5), "experts": (2, 3, 4), "top_k": (1, 2), "hidden": (8,),
                                       "inter": (8,), "depth": (1,), "groups": (0,), "align": (8,)}


def signature(result: Result) -> tuple[str, str]:
    """What must stay the same while shrinking: the verdict and the error's first words (or the failing check)."""
    detail = result.detail.split(": ", 2)
    words = " ".join(detail[1].split()[:3]) if result.kind == "crash" and len(detail) > 1 else ""
    return result.kind, words


def minimize(spec: Spec, backend: str = "passes", log: Any = print) -> tuple[Spec, Result]:
    """The smallest spec found that fails like ``spec`` does."""
    best = check(spec, backend)
    want = signature(best)
    if best.ok:
        raise ValueError(f"the spec does not fail: {best.summary()}")
    default = Spec()
    changed = True
    while changed:
        changed = False
        for field in dataclasses.fields(Spec):
            current = getattr(spec, field.name)
            candidates = [v for v in (getattr(default, field.name), *SMALLER.get(field.name, ()))
                          if v != current and (not isinstance(v, int) or isinstance(v, bool) or v < current)]
            for value in candidates:
                trial = spec.replace(**{field.name: value})
                try:
                    result = check(trial, backend)
                except Exception as exc:  # noqa: BLE001 - an incoherent combination: not a simplification
                    log(f"  {field.name}={value!r}: {type(exc).__name__}")
                    continue
                if not result.ok and signature(result) == want:
                    log(f"  {field.name}={value!r}: still fails")
                    spec, best, changed = trial, result, True
                    break
                log(f"  {field.name}={value!r}: {result.kind}")
    return spec, best


def main(argv: list[str] | None = None) -> None:
    """Shrink one failing spec from a ``tests.fuzz.run`` JSON file (or ``--spec '{...}'``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="source", type=pathlib.Path, help="JSON lines from tests.fuzz.run")
    parser.add_argument("--index", type=int, help="the 'index' of the line to shrink")
    parser.add_argument("--spec", help="a spec as a JSON object instead")
    parser.add_argument("--backend", choices=("passes", "inductor"), default="passes")
    parser.add_argument("--out", type=pathlib.Path, help="write the minimal script here")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.spec:
        fields = json.loads(args.spec)
    else:
        rows = [json.loads(line) for line in args.source.read_text().splitlines() if line.strip()]
        fields = next(r for r in rows if r["index"] == args.index)["spec"]
    spec, result = minimize(Spec(**fields), args.backend, log=lambda m: print(m, flush=True))
    print(result.summary())
    text = "".join(f"# {line}\n" for line in result.summary().splitlines()) + script(spec, args.backend)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
