"""Every document that README, docs/ and the code name exists in this repository (docs/CONTRIBUTING.md §10).

A reader follows a citation: `docs/NODE.md §3` must open a file of this
repository at a section numbered 3, `docs/gpu-check-h200.log` must be there,
and nothing may point into the team's shared folder above the checkout, which
a user or a new maintainer does not have.

What counts as a reference: a relative path ending in `.md` (`README.md`,
`docs/CLEANER.md`, `../x/Y.md`), any path under `docs/`, and a section sign
after a document (`docs/NODE.md §1-3`: sections 1 to 3 must exist). Each is
resolved against the repository root and against the citing file's
directory; it dangles when neither holds it. Absolute paths (`/tmp/crash.md`,
an install target) and URLs are not references to this repository.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
THIS = Path(__file__).resolve()
SOURCE_SUFFIXES = (".py", ".sh", ".cpp", ".c", ".h", ".toml", ".md")
SOURCE_NAMES = ("Makefile",)
SKIP_DIRS = {".git", "build", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache",
             ".hypothesis", "node_modules"}
# The folder outside the repository that the team's notes live in, spelt so that this file
# does not match its own rule.
OUTSIDE = "../" + "shared"

_URL = re.compile(r"[a-z][a-z0-9+.-]*://\S+", re.IGNORECASE)
_PATH_CHARS = r"[\w.\-/]"
# A relative path that ends in .md, or any path under docs/. The look-behind keeps absolute
# paths (/usr/share/doc/x/README.md) and the tail of longer paths out.
_MD = re.compile(rf"(?<![\w./\-])(?!/){_PATH_CHARS}*?[\w\-]+\.md(?![\w\-])")
_DOCS = re.compile(r"(?<![\w./\-])docs/[\w\-][\w.\-]*(?:/[\w.\-]+)*")
_SECTION = re.compile(r"(?<![\w./\-])(?!/)([\w.\-/]*[\w\-]+\.md)`?\s*§\s*(\d+)(?:\s*[-–]\s*(\d+))?")
_HEADING = re.compile(r"^#{1,6}\s+(\d+)\.\s", re.MULTILINE)


def cited_files() -> Iterator[Path]:
    """README, docs/ and every source file of the repository (tool caches and the venvs left out)."""
    for d, dirs, files in os.walk(REPO):
        # A venv is one by its pyvenv.cfg, whatever its name (.venv, make test-vllm033's .venv-vllm033).
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS and not x.endswith(".egg-info")
                         and not os.path.exists(os.path.join(d, x, "pyvenv.cfg")))
        here = Path(d)
        in_docs = here == REPO / "docs" or REPO / "docs" in here.parents
        for f in sorted(files):
            p = here / f
            if p == THIS:
                continue  # its own examples are test data, not citations
            if in_docs or f.endswith(SOURCE_SUFFIXES) or f in SOURCE_NAMES or here == REPO / ".ci":
                yield p


def references(text: str) -> Iterator[tuple[int, str, tuple[int, int] | None]]:
    """(line, reference, section range or None) for every document reference in `text`."""
    for n, line in enumerate(text.splitlines(), 1):
        line = _URL.sub(" ", line)
        sections = {}
        for m in _SECTION.finditer(line):
            lo = int(m.group(2))
            sections[m.start(1)] = (m.group(1), (lo, int(m.group(3) or lo)))
        seen = set()
        for rx in (_MD, _DOCS):
            for m in rx.finditer(line):
                ref = m.group(0).rstrip(".")
                if m.start() in seen or not ref or "*" in ref:
                    continue
                seen.add(m.start())
                sec = sections.get(m.start())
                yield n, ref, sec[1] if sec and sec[0] == m.group(0) else None


def resolve(ref: str, citing: Path, repo: Path = REPO) -> Path | None:
    """The file `ref` names, relative to the repository root or the citing file; None when neither has it."""
    for base in (repo, citing.parent):
        p = (base / ref).resolve()
        if p.exists() and (p == repo or repo in p.parents):
            return p
    return None


def numbered_sections(doc: Path) -> set[int]:
    try:
        return {int(m.group(1)) for m in _HEADING.finditer(doc.read_text(encoding="utf-8"))}
    except (OSError, UnicodeDecodeError):
        return set()


def dangling(path: Path, repo: Path = REPO) -> list[str]:
    """What in `path` names a document that a reader of this repository cannot open."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return []
    rel = path.relative_to(repo)
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if OUTSIDE in line:
            out.append(f"{rel}:{n}: points outside the repository ({OUTSIDE}...)")
    for n, ref, sec in references(text):
        if ref.startswith(OUTSIDE):
            continue  # reported above
        target = resolve(ref, path, repo)
        if target is None:
            out.append(f"{rel}:{n}: {ref} does not exist in the repository")
        elif sec is not None:
            missing = sorted(set(range(sec[0], sec[1] + 1)) - numbered_sections(target))
            if missing:
                out.append(f"{rel}:{n}: {ref} has no section {', '.join(f'§{s}' for s in missing)}")
    return out


def test_every_document_named_exists() -> None:
    problems = [p for f in cited_files() for p in dangling(f)]
    assert not problems, "dangling document references:\n" + "\n".join(problems)


def test_the_scan_covers_readme_docs_code_and_build_files() -> None:
    names = {str(p.relative_to(REPO)) for p in cited_files()}
    for expected in ("README.md", "docs/NODE.md", "docs/CLEANER.md", "docs/CONTRIBUTING.md", "Makefile",
                     "pyproject.toml", "kvcached/node/clean/decide.py", "csrc/module.cpp", ".ci/run",
                     "scripts/install-vllm.sh", "csrc/testing/fake_libcuda.c"):
        assert expected in names, expected


@pytest.mark.parametrize(("text", "found"), [
    ("see `docs/NODE.md` §3 first", [("docs/NODE.md", (3, 3))]),
    ("(docs/NODE.md §1-3)", [("docs/NODE.md", (1, 3))]),
    ("`docs/NODE.md` §1–3", [("docs/NODE.md", (1, 3))]),
    ("README.md and docs/gpu-check-h200.log.", [("README.md", None), ("docs/gpu-check-h200.log", None)]),
    ("install -m 644 README.md /usr/local/share/doc/kvcached/README.md", [("README.md", None)]),
    ("KVCACHED_CRASH_TABLE=/tmp/crash.md and https://example.org/docs/X.md", []),
    ("a bare LAYOUT.md §4, and ../notes/DESIGN.md", [("LAYOUT.md", (4, 4)), ("../notes/DESIGN.md", None)]),
    ("the `docs/` folder, *.md files", []),
])
def test_what_counts_as_a_reference(text: str, found: list) -> None:
    assert [(ref, sec) for _, ref, sec in references(text)] == found


def test_a_dangling_reference_is_named(tmp_path: Path) -> None:
    # The same checks on a small repository of our making: what is missing is reported, what exists is not.
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    (repo / "docs" / "NODE.md").write_text("# Node\n\n## 1. Names\n\n## 2. Segments\n")
    (repo / "README.md").write_text("# R\n")
    cite = repo / "pkg" / "mod.py"
    cite.parent.mkdir()
    (cite.parent / "NOTES.md").write_text("next to the code\n")
    cite.write_text(f'"""docs/NODE.md §2, NOTES.md, README.md, docs/NODE.md §2-3, docs/GONE.md, {OUTSIDE}/X.md."""\n')
    assert dangling(cite, repo) == [
        "pkg/mod.py:1: points outside the repository (../shared...)",
        "pkg/mod.py:1: docs/NODE.md has no section §3",
        "pkg/mod.py:1: docs/GONE.md does not exist in the repository",
    ]
