"""The long fuzz run: ``python -m tests.fuzz.run -n 2000 --json fuzz.json --scripts fuzz_failures/``.

Draws ``n`` specs from a seeded ``random.Random`` (the same grammar Hypothesis draws from in the tests), checks each
(:func:`tests.fuzz.harness.check`) and never stops at a failure: every result goes to ``--json`` as it comes (JSON
lines: one per layer, failures with their per-tensor errors), each failure also as a standalone script under
``--scripts``, and a summary is printed at the end (counts per verdict, which passes rewrote how often, time).
``--start`` skips the first draws (to resume a run or split one).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import pathlib
import random
import signal
import time
import warnings
from collections.abc import Iterator
from typing import Any

from tests.fuzz.emit import script
from tests.fuzz.grammar import draw, random_choose
from tests.fuzz.harness import Result, check


@contextlib.contextmanager
def _deadline(seconds: int) -> Iterator[None]:
    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"example took over {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the fuzzer (see the module docstring); returns the summary."""
    import logging

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--examples", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start", type=int, default=0, help="skip the first draws of the seed's sequence")
    parser.add_argument("--backend", choices=("passes", "inductor"), default="passes")
    parser.add_argument("--json", type=pathlib.Path, help="JSON lines, one per layer")
    parser.add_argument("--scripts", type=pathlib.Path, help="folder for one standalone script per failure")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per layer")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("torch").setLevel(logging.ERROR)
    rng = random.Random(args.seed)
    specs = [draw(random_choose(rng)) for _ in range(args.start + args.examples)][args.start:]
    kinds: collections.Counter[str] = collections.Counter()
    passes: collections.Counter[str] = collections.Counter()
    start = time.perf_counter()
    if args.scripts:
        args.scripts.mkdir(parents=True, exist_ok=True)
    out = args.json.open("a") if args.json else None
    try:
        for i, spec in enumerate(specs, start=args.start):
            try:
                with _deadline(args.timeout):
                    result = check(spec, args.backend)
            except TimeoutError as exc:
                result = Result(spec, args.backend, "timeout", detail=str(exc))
            verdict = result.kind if result.known is None else f"known:{result.known}"
            kinds[verdict] += 1
            passes.update(result.rewrites)
            print(f"{i} {verdict} {result.seconds:.1f}s {','.join(result.rewrites) or '-'} {spec}", flush=True)
            if result.kind != "ok":
                print(result.summary(), flush=True)
                if args.scripts:
                    header = "".join(f"# {line}".rstrip() + "\n" for line in result.summary().splitlines())
                    path = args.scripts / f"{args.backend}-{args.seed}-{i}-{result.kind}.py"
                    path.write_text(header + script(spec, args.backend))
            if out:
                row = result.to_json() if result.kind != "ok" else {
                    "spec": str(spec), "kind": result.kind, "rewrites": result.rewrites,
                    "seconds": round(result.seconds, 2)}
                out.write(json.dumps({"index": i, **row}) + "\n")
                out.flush()
    finally:
        if out:
            out.close()
    summary = {"examples": sum(kinds.values()), "seconds": round(time.perf_counter() - start, 1),
               "verdicts": dict(kinds), "rewrites_by_pass": dict(passes), "backend": args.backend, "seed": args.seed}
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
