"""The package's import graph: no cycle, and no moe_compile module imported inside a function except one that
imports an optional dependency.

Read from the source (every ``import`` statement, function-level ones included), so a cycle that only shows
when a function runs is found too.
"""

from __future__ import annotations

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "moe_compile"

# moe_compile modules imported inside functions on purpose: they import an optional dependency (triton, which
# has no wheel off Linux; torchao, only needed for quantised weights).
OPTIONAL = ("moe_compile.ops.triton", "moe_compile.experts.grouped_weight")


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> list[tuple[str, bool]]:
    """``(imported module, inside a function)`` for every moe_compile module ``name`` imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        nested = node.col_offset > 0
        if isinstance(node, ast.Import):
            out += [(a.name, nested) for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod
                out.append((f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base, nested))
    return out


def test_no_import_cycle():
    modules = _modules()
    edges = {m: {t for t, _ in _imports(m, p, modules) if t in modules and t != m} for m, p in modules.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                cycle = stack[stack.index(t):] + [t]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(modules):
        if m not in state:
            visit(m)


def test_imports_inside_functions_are_optional_dependencies():
    modules = _modules()
    bad = [
        f"{m}: {t}"
        for m, p in modules.items()
        for t, nested in _imports(m, p, modules)
        if nested and t.startswith("moe_compile") and not any(t == o or t.startswith(o + ".") for o in OPTIONAL)
    ]
    assert bad == [], "imports inside functions (move them to the top of the module):\n" + "\n".join(bad)


def test_the_checker_finds_a_cycle(tmp_path, monkeypatch):
    """The walk above on a planted two-module cycle, one side imported inside a function."""
    pkg = tmp_path / "moe_compile"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from moe_compile import b\n")
    (pkg / "b.py").write_text("def f():\n    from moe_compile.a import x\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    try:
        test_no_import_cycle()
    except AssertionError as exc:
        assert "moe_compile.a -> moe_compile.b -> moe_compile.a" in str(exc)
    else:
        raise AssertionError("the planted cycle was not found")
