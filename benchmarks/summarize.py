"""Print one short table from the benchmark JSON files (the last thing run_gpu.sh prints)."""

from __future__ import annotations

import json
import sys


def main(paths: list[str]) -> None:
    print("\n==== summary ====")
    for path in paths:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            print(f"{path}: unreadable ({exc})")
            continue
        env = data.get("env", {})
        print(f"\n# {path}  [{env.get('device')}, torch {env.get('torch')}, triton {env.get('triton')}]")
        rows = data.get("summary") or data.get("results") or []
        if not rows:
            continue
        keys = list(rows[0].keys())
        widths = [max(len(k), *(len(_fmt(r.get(k))) for r in rows)) for k in keys]
        print("  ".join(k.ljust(w) for k, w in zip(keys, widths)))
        for r in rows:
            print("  ".join(_fmt(r.get(k)).ljust(w) for k, w in zip(keys, widths)))


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


if __name__ == "__main__":
    main(sys.argv[1:])
