"""What moe_compile's passes record on every transformers MoE family: the rewrites and reason tags of one
compiled training step per family, as a table that two commits can be compared by.

A restructuring must not change what the passes do: run this before and after and compare the two files
(``python -m tests.models.family_records --out before.json``; ``--compare before.json after.json``).
It compiles and runs one step per family (no float32 reference, no numerics: ``test_hf_families`` judges
those), so the whole matrix takes a fraction of the ``-m slow`` run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch

from tests.models.hf_families import Unbuildable, build, moe_families, records_of


def family_records(family: str) -> dict[str, Any]:
    """The distinct ``(pass, stage, kind, layer, what)`` records of one compiled training step of ``family``
    (``what``: the matched chain of a rewrite, the reason tag of a skip), or the reason it did not run."""
    from moe_compile import report

    try:
        model, inputs = build(family)
    except Unbuildable as exc:
        return {"status": f"skip: {exc}"}
    model.train()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="moe_compile", fullgraph=True)
    try:
        with report.collecting() as rep, torch._inductor.config.patch(force_disable_caches=True):
            compiled(**inputs).loss.backward()
    except Exception as exc:  # noqa: BLE001 - recorded, compared like any other outcome
        return {"status": f"fails: {type(exc).__name__}"}
    finally:
        torch._dynamo.reset()
    return {"status": "ok", "records": records_of(rep)}


def add_to_file(path: str, family: str, entry: dict[str, Any]) -> None:
    """Merge one family's entry into the record file at ``path`` (created when missing)."""
    table = json.load(open(path)) if os.path.exists(path) else {}
    table[family] = entry
    with open(path, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)


def compare(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """One line per family whose status or records differ."""
    lines = []
    for family in sorted(set(before) | set(after)):
        b, a = before.get(family, {"status": "absent"}), after.get(family, {"status": "absent"})
        if b["status"] != a["status"]:
            lines.append(f"{family}: status {b['status']!r} -> {a['status']!r}")
            continue
        gone = [r for r in b.get("records", []) if r not in a.get("records", [])]
        new = [r for r in a.get("records", []) if r not in b.get("records", [])]
        lines += [f"{family}: - {r}" for r in gone] + [f"{family}: + {r}" for r in new]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the records of every family (or of --families) here")
    parser.add_argument("--families", nargs="*", help="only these families")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two record files")
    args = parser.parse_args(argv)
    if args.compare:
        before, after = (json.load(open(p)) for p in args.compare)
        diff = compare(before, after)
        print("\n".join(diff) if diff else f"same records on {len(before)} families")
        return 1 if diff else 0
    table = {}
    for family in args.families or moe_families():
        table[family] = family_records(family)
        print(family, table[family]["status"], len(table[family].get("records", [])), flush=True)
    with open(args.out, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
