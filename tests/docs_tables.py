"""The generated tables of the README and ``docs/``: each sits between two HTML comment markers, written by a function
of the code it describes, and ``tests/test_docs.py`` checks that the file holds what the function gives now.

* ``docs/options.md``: the compile options and the environment variables, from ``moe_compile.config.SETTINGS``;
* ``README.md``: the supported-models table, from :func:`tests.models.hf_families.support_table`.

The performance tables are ``benchmarks/summarize.py``'s (``python -m benchmarks.summarize --write``).

Usage, from the repository root: ``python -m tests.docs_tables --write`` rewrites every block, ``--check`` exits 1
when one is stale.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
from collections.abc import Callable

from moe_compile import config

ROOT = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Block:
    """A generated block: the file (relative to the repository root), the marker's name, the function."""

    path: str
    name: str
    lines: Callable[[], list[str]]

    @property
    def begin(self) -> str:
        return f"<!-- {self.name}:begin (python -m tests.docs_tables --write writes this table) -->"

    @property
    def end(self) -> str:
        return f"<!-- {self.name}:end -->"

    def current(self) -> list[str]:
        """The lines the file holds between the markers now."""
        text = (ROOT / self.path).read_text()
        start, stop = text.find(self.begin), text.find(self.end)
        if start < 0 or stop < start:
            raise ValueError(f"{self.path}: no {self.begin} ... {self.end} block")
        return text[start + len(self.begin):stop].strip("\n").splitlines()

    def rewritten(self) -> str:
        """The file's text with the block replaced by what the function gives."""
        text = (ROOT / self.path).read_text()
        start, stop = text.find(self.begin), text.find(self.end)
        if start < 0 or stop < start:
            raise ValueError(f"{self.path}: no {self.begin} ... {self.end} block")
        return text[:start + len(self.begin)] + "\n" + "\n".join(self.lines()) + "\n" + text[stop:]


def _cell(text: str) -> str:
    """A table cell of a setting's doc: names of code in backticks would need a parser; the doc stays plain text, with
    ``|`` escaped."""
    return text.replace("|", "\\|")


def options_table() -> list[str]:
    """The compile options of :data:`moe_compile.config.SETTINGS`: name, default, meaning (the row's doc)."""
    lines = ["| option | default | meaning |", "| --- | --- | --- |"]
    for s in config.SETTINGS.values():
        if s.kind == "option":
            lines.append(f"| `{s.name}` | `{s.default_text()}` | {_cell(s.doc)} |")
    return lines


def env_table() -> list[str]:
    """The environment variables of :data:`moe_compile.config.SETTINGS`: variable, default, when it is read, meaning."""
    lines = ["| variable | default | read | meaning |", "| --- | --- | --- | --- |"]
    for s in config.SETTINGS.values():
        if s.kind == "env":
            shown = s.default_text()
            default = shown if shown == "unset" else f"`{shown}`"
            lines.append(f"| `{s.env}` | {default} | {s.read} | {_cell(s.doc)} |")
    return lines


def models_table() -> list[str]:
    from tests.models.hf_families import support_table

    return support_table()


BLOCKS = (
    Block("docs/options.md", "options", options_table),
    Block("docs/options.md", "environment", env_table),
    Block("README.md", "models", models_table),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite every generated block")
    parser.add_argument("--check", action="store_true", help="exit 1 when a block is stale")
    args = parser.parse_args(argv)
    stale = 0
    for block in BLOCKS:
        if args.write:
            (ROOT / block.path).write_text(block.rewritten())
            print(f"rewrote the {block.name} table of {block.path}")
        elif block.current() != block.lines():
            stale += 1
            print(f"{block.path}: the {block.name} table is stale: run python -m tests.docs_tables --write")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
