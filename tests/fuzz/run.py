"""The long fuzz run: ``python -m tests.fuzz.run -n 2000 --json fuzz.json --scripts fuzz_failures/``.

Draws ``n`` specs from a seeded ``random.Random`` (the same grammar Hypothesis draws from in the tests), checks each
(:func:`tests.fuzz.harness.check`) and never stops at a failure: every result goes to ``--json`` as it comes (JSON
lines: one per layer, failures with their per-tensor errors), each failure also as a standalone script under
``--scripts``, and a summary is printed at the end (counts per verdict, which passes rewrote how often, time).
``--start`` skips the first draws (to resume a run or split one).

The layers run in a child process: a layer that kills it (an abort in generated code: FINDINGS B4 ended a run so)
is recorded as an ``abort`` with its script, and a new child goes on from the next layer (``--in-process`` runs
them in this process instead).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from typing import Any

from tests.fuzz.emit import script
from tests.fuzz.grammar import Spec, draw, random_choose
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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--examples", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start", type=int, default=0, help="skip the first draws of the seed's sequence")
    parser.add_argument("--backend", choices=("passes", "inductor"), default="passes")
    parser.add_argument("--json", type=pathlib.Path, help="JSON lines, one per layer")
    parser.add_argument("--scripts", type=pathlib.Path, help="folder for one standalone script per failure")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per layer")
    parser.add_argument("--in-process", action="store_true", help="run the layers in this process (a layer that "
                                                                   "aborts ends the run)")
    # the child's side of the supervision (not for users): where it notes each layer it starts, and its summary
    parser.add_argument("--progress", type=pathlib.Path, help=argparse.SUPPRESS)
    parser.add_argument("--summary", type=pathlib.Path, help=argparse.SUPPRESS)
    return parser


def _specs(seed: int, start: int, examples: int) -> list[Spec]:
    rng = random.Random(seed)
    return [draw(random_choose(rng)) for _ in range(start + examples)][start:]


def _record(i: int, result: Result, args: argparse.Namespace, kinds: collections.Counter[str],
            passes: collections.Counter[str]) -> None:
    """Count ``result`` (layer ``i``), print it, and write its script and JSON line."""
    verdict = result.kind if result.known is None else f"known:{result.known}"
    kinds[verdict] += 1
    passes.update(result.rewrites)
    print(f"{i} {verdict} {result.seconds:.1f}s {','.join(result.rewrites) or '-'} {result.spec}", flush=True)
    if result.kind != "ok":
        print(result.summary(), flush=True)
        if args.scripts:
            args.scripts.mkdir(parents=True, exist_ok=True)
            header = "".join(f"# {line}".rstrip() + "\n" for line in result.summary().splitlines())
            path = args.scripts / f"{args.backend}-{args.seed}-{i}-{result.kind}.py"
            path.write_text(header + script(result.spec, args.backend))
    if args.json:
        row = result.to_json() if result.kind != "ok" else {
            "spec": str(result.spec), "kind": result.kind, "rewrites": result.rewrites,
            "seconds": round(result.seconds, 2)}
        with args.json.open("a") as out:
            out.write(json.dumps({"index": i, **row}) + "\n")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the fuzzer (see the module docstring); returns the summary."""
    import logging

    args = _parser().parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("torch").setLevel(logging.ERROR)
    start = time.perf_counter()
    kinds: collections.Counter[str] = collections.Counter()
    passes: collections.Counter[str] = collections.Counter()
    if args.in_process or args.progress:
        _run_layers(args, _specs(args.seed, args.start, args.examples), kinds, passes)
    else:
        _supervise(args, argv if argv is not None else sys.argv[1:], kinds, passes)
    summary = {"examples": sum(kinds.values()), "seconds": round(time.perf_counter() - start, 1),
               "verdicts": dict(kinds), "rewrites_by_pass": dict(passes), "backend": args.backend, "seed": args.seed}
    if args.summary:
        args.summary.write_text(json.dumps(summary))
    else:
        print(json.dumps(summary, indent=1))
    return summary


def _supervise(args: argparse.Namespace, argv: list[str], kinds: collections.Counter[str],
               passes: collections.Counter[str]) -> None:
    """Run the layers in child processes; a child that dies mid-layer leaves that layer an ``abort``, and the next
    child starts after it."""
    first, end = args.start, args.start + args.examples
    with tempfile.TemporaryDirectory(prefix="moe_fuzz_") as tmp:
        progress, summary = pathlib.Path(tmp, "progress"), pathlib.Path(tmp, "summary.json")
        while first < end:
            progress.write_text("")
            summary.unlink(missing_ok=True)
            child = [sys.executable, "-m", "tests.fuzz.run", *argv, "--start", str(first), "-n", str(end - first),
                     "--progress", str(progress), "--summary", str(summary)]
            done = subprocess.run(child)
            if summary.exists():
                part = json.loads(summary.read_text())
                kinds.update(part["verdicts"])
                passes.update(part["rewrites_by_pass"])
            started = progress.read_text().split()
            if done.returncode == 0 or not started:
                if done.returncode != 0:
                    raise RuntimeError(f"the fuzz child exited {done.returncode} before its first layer")
                return
            i = int(started[-1])
            (spec,) = _specs(args.seed, i, 1)
            detail = f"the process running the layer died (exit status {done.returncode}: {_signal_name(done)})"
            _record(i, Result(spec, args.backend, "abort", detail=detail), args, kinds, passes)
            first = i + 1


def _signal_name(done: subprocess.CompletedProcess) -> str:
    if done.returncode < 0:
        with contextlib.suppress(ValueError):
            return signal.Signals(-done.returncode).name
    return "not a signal"


def _run_layers(args: argparse.Namespace, specs: list[Spec], kinds: collections.Counter[str],
                passes: collections.Counter[str]) -> None:
    """Check each of ``specs`` (layer ``args.start`` on) in this process, noting each in ``args.progress`` first."""
    abort_at = os.environ.get("MOE_FUZZ_ABORT_AT")  # the supervisor's test: this layer kills its process
    for i, spec in enumerate(specs, start=args.start):
        if args.progress:
            with args.progress.open("a") as note:
                note.write(f"{i}\n")
        if abort_at is not None and i == int(abort_at):
            os.abort()
        try:
            with _deadline(args.timeout):
                result = check(spec, args.backend)
        except TimeoutError as exc:
            result = Result(spec, args.backend, "timeout", detail=str(exc))
        _record(i, result, args, kinds, passes)
        if args.summary:  # the child's running totals: what it did is counted even if a later layer kills it
            args.summary.write_text(json.dumps({"verdicts": dict(kinds), "rewrites_by_pass": dict(passes)}))


if __name__ == "__main__":
    main()
