"""``moe_compile/passes/README.md`` against the code: every registered pass in run order with its stage, and
every reason tag a pass's own modules can raise listed in its row."""

from __future__ import annotations

import ast
import pathlib
import re
import sys

from moe_compile.passes import PASSES

PASSES_DIR = pathlib.Path(__file__).resolve().parents[2] / "moe_compile" / "passes"
TAG_PATTERNS = (r'NoMatch\(\s*"([a-z_]+)"', r'ctx\.skip\([^,()]+,\s*"([a-z_]+)"')


def _rows() -> dict[str, tuple[str, set[str]]]:
    text = (PASSES_DIR / "README.md").read_text()
    section = text.split("## Passes, in run order", 1)[1]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = (cells[1], set(re.findall(r"`([a-z_]+)`", cells[3])))
    return rows


def _own_modules(target: str) -> list[pathlib.Path]:
    name = target.split(":")[0].rsplit(".", 1)[1]
    package = PASSES_DIR / name
    return sorted(package.rglob("*.py")) if package.is_dir() else [PASSES_DIR / f"{name}.py"]


def _tags(paths: list[pathlib.Path]) -> set[str]:
    text = "\n".join(p.read_text() for p in paths)
    return {tag for pattern in TAG_PATTERNS for tag in re.findall(pattern, text)}


def test_readme_lists_every_pass_in_run_order_with_its_stage():
    rows = _rows()
    assert list(rows) == [e.name for e in PASSES]
    assert {name: stage for name, (stage, _) in rows.items()} == {e.name: e.stage for e in PASSES}


def test_readme_lists_every_reason_tag_of_a_pass():
    rows = _rows()
    for entry in PASSES:
        missing = _tags(_own_modules(entry.target)) - rows[entry.name][1]
        assert not missing, f"{entry.name}: tags {sorted(missing)} are not in moe_compile/passes/README.md"


def test_tag_scan_finds_tags():
    """The scan above sees a planted tag in both spellings (so an empty scan cannot pass for a listed one)."""
    assert re.findall(TAG_PATTERNS[0], 'raise NoMatch("some_tag", "x")') == ["some_tag"]
    assert re.findall(TAG_PATTERNS[1], 'ctx.skip(layer, "other_tag")') == ["other_tag"]
    assert _tags(_own_modules("moe_compile.passes.fuse_dispatch:run")) >= {"descending_sort", "region_not_rowwise"}


def test_run_is_the_first_function_of_every_pass_module():
    """The README's rule: a reader opening a pass finds its entry point first."""
    for entry in PASSES:
        module = sys.modules[entry.load().__module__]
        tree = ast.parse(pathlib.Path(module.__file__).read_text())
        functions = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
        assert functions[:1] == ["run"], f"{module.__name__}: first function is {functions[:1]}, not run"
