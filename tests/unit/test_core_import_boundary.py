"""DESIGN.md §2 and the layout of the tree: the node layer and kvctl import nothing of the runtime.

`kvcached.node` (everything that reads and cleans a node) and every module of
`kvctl` must import neither torch, vLLM, numpy nor the compiled extension, nor
anything of `kvcached.runtime` or `kvcached.integration` (engine processes only).
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import pytest

import kvcached.node
import kvctl

FORBIDDEN = ("torch", "vllm", "numpy", "kvcached.runtime", "kvcached.integration")


def modules(package) -> list[str]:  # type: ignore[no-untyped-def]
    return [package.__name__] + [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]


def imported_by(module: str) -> list[str]:
    code = (
        "import importlib, json, sys\n"
        f"importlib.import_module({module!r})\n"
        f"print(json.dumps(sorted(m for m in sys.modules if any(m == f or m.startswith(f + '.') "
        f"for f in {FORBIDDEN!r}))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_the_layers_are_the_folders() -> None:
    node = modules(kvcached.node)
    assert "kvcached.node.cleanup" in node and "kvcached.node.view" in node
    assert not any(m.startswith(("kvcached.runtime", "kvcached.integration")) for m in node)


@pytest.mark.parametrize("module", modules(kvcached.node) + modules(kvctl))
def test_imports_nothing_of_the_runtime(module: str) -> None:
    assert imported_by(module) == []
