"""Cross-referenced comments ("notes") stay findable: each is defined once, and every reference leads to it.

Convention. A note is *defined* by a line that starts (after indentation, a ``#`` comment marker or a docstring's
opening quotes) with ``NOTE [title]:``, followed by its text. Every other mention of ``NOTE [title]`` is a
*reference* and is written ``NOTE [title] (path)``, where ``path`` is the defining file relative to the repository
root (``moe_compile/ops/permute_pad.py``); inside the defining file itself the ``(path)`` may be left out. A title
stays on one line (never split by a line break). Notes outside the repository (PyTorch's, say) are cited in other
words, not as ``NOTE [...]``.

Scanned: the Python and Markdown files under ``moe_compile/``, ``tests/``, ``benchmarks/``, ``examples/`` and
``docs/``, and ``README.md`` (this file excepted: its text describes the convention and plants examples).
"""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCANNED_DIRS = ("moe_compile", "tests", "benchmarks", "examples", "docs")
SCANNED_FILES = ("README.md",)
SUFFIXES = (".py", ".md")

# A definition: at the start of a line, after indentation, ``#`` markers or a docstring's opening quotes.
DEFINITION = re.compile(r"""^\s*(?:#+\s*|[rRbBuU]?(?:\"\"\"|''')\s*)?NOTE \[([^\]\n]+)\]:""")
# Any mention, with the ``(path)`` that may follow it.
MENTION = re.compile(r"NOTE \[([^\]\n]+)\](?: \(([\w./-]+)\))?")
# A title broken by a line break: ``NOTE`` or ``NOTE [part`` at the end of a line.
SPLIT = re.compile(r"\bNOTE(?: \[[^\]\n]*)?\s*$")


def sources() -> dict[str, str]:
    """Repository-relative path -> text of every scanned file."""
    paths = [ROOT / name for name in SCANNED_FILES if (ROOT / name).is_file()]
    for folder in SCANNED_DIRS:
        paths += [p for p in sorted((ROOT / folder).rglob("*")) if p.is_file() and p.suffix in SUFFIXES]
    this = pathlib.Path(__file__).resolve()
    return {p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8") for p in paths if p.resolve() != this}


def scan(texts: dict[str, str]) -> list[str]:
    """Every breach of the convention in ``texts`` (path -> text), one line each."""
    definitions: dict[str, list[str]] = {}
    references = []  # (title, path given or None, where)
    problems = []
    for path, text in texts.items():
        for lineno, line in enumerate(text.splitlines(), 1):
            where = f"{path}:{lineno}"
            if SPLIT.search(line):
                problems.append(f"{where}: a NOTE title is split across lines")
            head = DEFINITION.match(line)
            for m in MENTION.finditer(line):
                if head and m.start() == head.start(1) - len("NOTE ["):
                    definitions.setdefault(m.group(1), []).append(path)
                else:
                    references.append((m.group(1), m.group(2), where, path))
    for title, paths in sorted(definitions.items()):
        if len(paths) > 1:
            problems.append(f"NOTE [{title}] is defined {len(paths)} times: {', '.join(paths)}")
    for title, given, where, path in references:
        defined = definitions.get(title)
        if not defined:
            problems.append(f"{where}: NOTE [{title}] is defined nowhere")
            continue
        home = defined[0]
        if given is None and path != home:
            problems.append(f"{where}: NOTE [{title}] needs its defining path ({home})")
        elif given is not None and given != home:
            problems.append(f"{where}: NOTE [{title}] names {given}, but it is defined in {home}")
    return problems


def test_every_note_is_defined_once_and_referenced_by_its_path():
    problems = scan(sources())
    assert not problems, "\n".join(problems)


def test_scan_reports_planted_breaches():
    planted = {
        "a.py": '# NOTE [kept]: the text.\n"""NOTE [twice]: once."""\n'
                'x = 1  # NOTE [kept]: a reference, not a definition\n',
        "b.py": "# NOTE [twice]: again.\n# see NOTE [nowhere] (a.py)\n# NOTE [kept] here\n# NOTE [kept] (b.py)\n"
                "# NOTE [kept] (a.py) is right\n# and NOTE [split\n# title]\n",
    }
    problems = scan(planted)
    assert "NOTE [twice] is defined 2 times: a.py, b.py" in problems
    assert "b.py:2: NOTE [nowhere] is defined nowhere" in problems
    assert "b.py:3: NOTE [kept] needs its defining path (a.py)" in problems
    assert "b.py:4: NOTE [kept] names b.py, but it is defined in a.py" in problems
    assert "b.py:6: a NOTE title is split across lines" in problems
    assert len(problems) == 5, problems  # a.py's own reference needs no path; b.py:5 is right
