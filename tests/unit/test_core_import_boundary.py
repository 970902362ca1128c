"""DESIGN.md §2: importing the core never pulls in torch, vLLM, numpy or the extension."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import kvcached

HEAVY = ("torch", "vllm", "numpy", "kvcached._kvpages", "kvcached.runtime", "kvcached.integration")
LAYER2 = ("kvcached.runtime", "kvcached.integration", "kvcached._kvpages")


def core_modules() -> list[str]:
    mods = ["kvcached"]
    for m in pkgutil.walk_packages(kvcached.__path__, "kvcached."):
        if not m.name.startswith(LAYER2):
            mods.append(m.name)
    return mods


def test_core_modules_import_nothing_heavy() -> None:
    mods = core_modules()
    assert "kvcached.cleanup" in mods and "kvcached.ipc.listener" in mods
    code = (
        "import importlib, json, sys\n"
        f"for m in {mods!r}: importlib.import_module(m)\n"
        f"print(json.dumps([h for h in {HEAVY!r} if h in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
