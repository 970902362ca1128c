"""`make clean` removes what the build wrote, and nothing else, on a copy of this repository's files."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# What `make test` and `pip install -e .` write (the extension lands in kvcached/runtime/).
BUILD_OUTPUTS = (
    ".venv/bin/python",
    ".venv/.base",
    ".venv-vllm033/bin/python",  # make test-vllm033's venv
    ".venv-vllm033/.vllm",
    "build/temp.linux-x86_64-cpython-311/csrc/module.o",
    "kvcached.egg-info/PKG-INFO",
    "kvcached/runtime/_kvpages.cpython-311-x86_64-linux-gnu.so",
    "kvcached/_kvpages.cpython-311-x86_64-linux-gnu.so",  # where builds before the rename put it
)
# Not build outputs: a developer's notes, tool caches, hypothesis's example database.
KEPT = ("notes.txt", "kvcached/runtime/scratch.py", ".hypothesis/examples/x", ".pytest_cache/v/x",
        ".mypy_cache/x", ".ruff_cache/x")


def test_make_clean_removes_the_build_outputs_and_nothing_else(tmp_path: Path) -> None:
    if shutil.which("make") is None or shutil.which("git") is None:
        pytest.skip("needs make and git")
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, check=True).stdout
    tracked = [f for f in listed.decode().split("\0") if f and (REPO / f).is_file()]
    tree = tmp_path / "tree"
    for f in tracked:
        (tree / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, tree / f)
    for f in BUILD_OUTPUTS + KEPT:
        (tree / f).parent.mkdir(parents=True, exist_ok=True)
        (tree / f).write_bytes(b"x")
    r = subprocess.run(["make", "-C", str(tree), "clean"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    left = {str(p.relative_to(tree)) for p in tree.rglob("*") if p.is_file()}
    assert left == set(tracked) | set(KEPT), (
        f"removed but not build output: {sorted((set(tracked) | set(KEPT)) - left)}; "
        f"build output left: {sorted(left - set(tracked) - set(KEPT))}")
    for d in (".venv", ".venv-vllm033", "build", "kvcached.egg-info"):
        assert not (tree / d).exists(), d
