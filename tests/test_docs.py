"""The README and ``docs/`` against the code: generated tables as their functions give them, links and repository
paths that exist, ``python -m`` commands whose modules import, scripts they name that exist, and (``-m slow``) the
README's usage example and the examples, run as a new user's install would run them.

Where each check lives: the performance tables in ``tests/test_benchmarks.py``, the notes' pointers in
``tests/test_notes.py``, the README's test command against ``.ci/run`` and the options' rows against
``moe_compile.config.SETTINGS`` in ``tests/test_package.py``.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

from tests import docs_tables
from tests._subprocess import WITHOUT_TORCHAO

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
IDS = [p.relative_to(ROOT).as_posix() for p in DOCS]
# the top-level folders a path cited in the docs may start with
TOP = ("moe_compile/", "tests/", "benchmarks/", "examples/", "docs/", ".ci/")


def _pinned(name: str) -> str | None:
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        m = re.match(rf"^{re.escape(name)}==(\S+)\s*$", line)
        if m:
            return m.group(1)
    return None


def test_docs_index_lists_every_page():
    index = (ROOT / "docs" / "README.md").read_text()
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    linked = set(re.findall(r"\]\(([\w-]+\.md)\)", index))
    assert pages <= linked, f"docs/README.md does not link {sorted(pages - linked)}"


@pytest.mark.parametrize("block", [b for b in docs_tables.BLOCKS if b.name != "models"], ids=lambda b: b.name)
def test_generated_table_is_current(block):
    assert block.current() == block.lines(), f"{block.path}: run python -m tests.docs_tables --write"


def test_supported_models_table_is_current():
    """The README's supported-models table is :func:`tests.models.hf_families.support_table` at the pinned
    transformers (the families differ from release to release: another one skips)."""
    transformers = pytest.importorskip("transformers")
    pin = _pinned("transformers")
    if transformers.__version__ != pin:
        pytest.skip(f"the table is for transformers {pin} (constraints.txt), this is {transformers.__version__}")
    block = next(b for b in docs_tables.BLOCKS if b.name == "models")
    assert block.current() == block.lines(), "README.md: run python -m tests.docs_tables --write"
    assert f"transformers {'.'.join(pin.split('.')[:2])}" in (ROOT / "README.md").read_text()


def test_stale_block_is_caught(tmp_path, monkeypatch):
    """A block that differs from its function's lines is reported (so a passing check means something)."""
    (tmp_path / "docs").mkdir()
    block = docs_tables.BLOCKS[0]
    text = (ROOT / block.path).read_text().replace("| `debug` |", "| `debugging` |")
    (tmp_path / block.path).write_text(text)
    monkeypatch.setattr(docs_tables, "ROOT", tmp_path)
    assert block.current() != block.lines()
    (tmp_path / block.path).write_text(block.rewritten())
    assert block.current() == block.lines()


@pytest.mark.parametrize("path", DOCS, ids=IDS)
def test_relative_links_exist(path):
    """Every ``[text](target)`` that is not a URL leads to a file or folder of the repository; an anchor
    (``page.md#section``) to a heading of that page."""
    text = path.read_text()
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            missing.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text()):
            missing.append(target)
    assert not missing, f"{path.name}: broken links {missing}"


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", markdown, re.M)}


@pytest.mark.parametrize("path", DOCS, ids=IDS)
def test_cited_repository_paths_exist(path):
    """Every path in backticks that starts with a top-level folder (``tests/models/hf_families.py``,
    ``moe_compile/passes/``) exists; ``::name`` suffixes and globs are read as the file or folder before them."""
    missing = []
    for cited in re.findall(r"`([^`\s]+)`", path.read_text()):
        cited = cited.split("::")[0].rstrip(".,;:")
        if not cited.startswith(TOP) or "<" in cited:
            continue
        if "*" in cited:
            if not list(ROOT.glob(cited)):
                missing.append(cited)
        elif not (ROOT / cited).exists():
            missing.append(cited)
    assert not missing, f"{path.name}: cites paths that do not exist: {missing}"


@pytest.mark.parametrize("path", DOCS, ids=IDS)
def test_python_m_modules_exist(path):
    """Every ``python -m <module>`` of this repository (``tests.``, ``benchmarks.``, ``moe_compile.``) names a module
    that exists."""
    modules = set(re.findall(r"python3? -m ((?:tests|benchmarks|moe_compile)(?:\.\w+)+)", path.read_text()))
    missing = [m for m in sorted(modules) if importlib.util.find_spec(m) is None]
    assert not missing, f"{path.name}: python -m of modules that do not exist: {missing}"


def _cited_scripts() -> list[str]:
    """The scripts the README and docs tell a reader to run (``python3 examples/compile_moe_model.py``)."""
    text = "".join(p.read_text() for p in DOCS)
    return sorted(set(re.findall(r"python3? ((?:examples|benchmarks|tests)/[\w/.-]+\.py)", text)))


def test_cited_scripts_exist():
    scripts = _cited_scripts()
    assert "examples/compile_moe_model.py" in scripts, scripts
    missing = [s for s in scripts if not (ROOT / s).is_file()]
    assert not missing, f"the docs tell readers to run scripts that do not exist: {missing}"


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "examples").glob("*.py")))
def test_examples_run_quietly(script):
    """Each example runs as the docs say (``python3 examples/<script>``, CPU, ~40 s each) in what the README's install
    gives (no torchao), succeeds (``compile_moe_model.py`` checks itself against eager), and prints nothing to
    stderr."""
    pytest.importorskip("transformers")
    path = f"examples/{script}"
    assert path in _cited_scripts(), f"{path} is not in the README or docs"
    code = WITHOUT_TORCHAO + f"import runpy; sys.argv = [{path!r}]; runpy.run_path({path!r}, run_name='__main__')\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == "", proc.stderr[-3000:]


def _readme_example() -> str:
    readme = (ROOT / "README.md").read_text()
    return re.search(r"## Usage\n.*?```python\n(.*?)```", readme, re.S).group(1)


def test_readme_example_uses_the_public_api():
    """The usage example parses, and the ``moe_compile.<name>`` it calls are public names."""
    import moe_compile

    code = _readme_example()
    tree = ast.parse(code)
    used = {n.attr for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "moe_compile"}
    assert used >= {"compile", "last_report"}, used
    assert used <= set(moe_compile.__all__), used - set(moe_compile.__all__)


@pytest.mark.slow
def test_readme_example_runs():
    """The usage example runs as written (CPU, 1-2 min: one compile of a tiny Mixtral) in what the README's install
    gives (no torchao), prints nothing to stderr, and ``last_report`` shows both MoE layers rewritten."""
    pytest.importorskip("transformers")
    proc = subprocess.run([sys.executable, "-c", WITHOUT_TORCHAO + _readme_example()], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == "", proc.stderr[-3000:]
    assert "2 MoE layer(s) rewritten" in proc.stdout, proc.stdout[-3000:]
