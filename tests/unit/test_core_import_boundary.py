"""docs/CLEANER.md §2 and the layout of the tree: who may import what.

- `kvcached.node` (everything that reads and cleans a node), `kvcached.settings`
  and every module of `kvctl` import neither torch, vLLM, SGLang, numpy, wrapt
  nor anything of `kvcached.runtime` or `kvcached.integration` (engine processes
  only). Read from the source: every import statement, those inside functions
  too, so an import that only runs later (a command, a check) counts as well.
  The allow-list below names the few function-level exceptions and why.
- The same modules, imported in a subprocess, leave none of those in sys.modules.
- Every module of `kvcached.integration` imports neither vLLM nor torch when
  imported (the patches import vLLM when they run), but for the engine-side
  modules docs/VLLM.md names.
"""

from __future__ import annotations

import ast
import json
import pkgutil
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvcached.integration
import kvcached.node
import kvctl

REPO = Path(__file__).resolve().parents[2]
FORBIDDEN = ("torch", "vllm", "sglang", "numpy", "wrapt", "kvcached.runtime", "kvcached.integration")
# (package, imported module) -> why: imports allowed inside a function of that package, never at module level.
ALLOWED_IN_FUNCTIONS = {
    ("kvctl", "torch"): "kvctl limit-percent reads one device's memory through torch, imported when it runs",
}
# Modules of kvcached.integration that import their engine when imported (docs/VLLM.md and docs/SGLANG.md say
# so, and why): subclasses of the engine's classes.
ENGINE_SIDE = {"kvcached.integration.vllm.elastic_alloc": "vllm",
               "kvcached.integration.sglang.elastic_alloc": "sglang",
               "kvcached.integration.sglang.elastic_buffers": "sglang"}


def modules(package) -> list[str]:  # type: ignore[no-untyped-def]
    return [package.__name__] + [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]


def source_of(module: str) -> Path:
    path = REPO / Path(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def imports_of(module: str) -> list[tuple[str, int, bool]]:
    """(absolute module imported, line, inside a function) for every import statement of `module`."""
    tree = ast.parse(source_of(module).read_text())
    package = module if source_of(module).name == "__init__.py" else module.rsplit(".", 1)[0]
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((a.name, child.lineno, in_function) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                found.append((base, child.lineno, in_function))
                found.extend((f"{base}.{a.name}", child.lineno, in_function) for a in child.names)
            visit(child, nested)

    visit(tree, False)
    return found


def forbidden(name: str) -> str | None:
    return next((f for f in FORBIDDEN if name == f or name.startswith(f + ".")), None)


class Import:
    """A fresh interpreter importing `module`, then printing which of `watch` it loaded (started now)."""

    def __init__(self, module: str, watch: tuple[str, ...] = FORBIDDEN) -> None:
        code = (
            "import importlib, json, sys\n"
            f"importlib.import_module({module!r})\n"
            f"print(json.dumps(sorted(m for m in sys.modules if any(m == f or m.startswith(f + '.') "
            f"for f in {watch!r}))))\n"
        )
        # Output to unlinked files: an interpreter nobody reads yet must never block on a full pipe.
        self.out, self.err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=self.out, stderr=self.err, text=True)

    def loaded(self) -> list[str]:
        """What it loaded; fails with its stderr when the import failed."""
        self.proc.wait(timeout=900)
        self.out.seek(0)
        self.err.seek(0)
        assert self.proc.returncode == 0, self.err.read()[-3000:]
        return json.loads(self.out.read())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.out.close()
        self.err.close()


CORE = modules(kvcached.node) + ["kvcached", "kvcached.settings"] + modules(kvctl)


def test_the_layers_are_the_folders() -> None:
    node = modules(kvcached.node)
    assert "kvcached.node.clean.cleanup" in node and "kvcached.node.ops.view" in node
    assert not any(m.startswith(("kvcached.runtime", "kvcached.integration")) for m in node)


def test_the_reader_sees_imports_inside_functions() -> None:
    """The import scan itself: kvctl's limit-percent imports torch in a function, and the scan finds it."""
    found = [(m, fn) for mod in modules(kvctl) for m, _, fn in imports_of(mod) if m == "torch"]
    assert found and all(fn for _, fn in found)


@pytest.mark.parametrize("module", CORE)
def test_no_import_statement_reaches_the_runtime(module: str) -> None:
    bad = []
    for name, line, in_function in imports_of(module):
        hit = forbidden(name)
        if hit is None:
            continue
        if in_function and (module.split(".")[0], hit) in ALLOWED_IN_FUNCTIONS:
            continue
        bad.append(f"{source_of(module).relative_to(REPO)}:{line} imports {name}"
                   + (" (inside a function)" if in_function else ""))
    assert bad == []


@pytest.fixture(scope="module")
def core_imports() -> Iterator[dict[str, Import]]:
    """Every core module imported in an interpreter of its own, all started together (each about half a second)."""
    imports = {m: Import(m) for m in CORE}
    yield imports
    for imp in imports.values():
        imp.close()


@pytest.mark.parametrize("module", CORE)
def test_imports_nothing_of_the_runtime(core_imports, module: str) -> None:
    assert core_imports[module].loaded() == []


@pytest.fixture(scope="module")
def integration_imports() -> Iterator[dict[str, Import]]:
    """Every kvcached.integration module imported in an interpreter of its own, all started together.

    The engine-side ones import vLLM or SGLang (about 20 CPU seconds each):
    together, both cores work while the first case waits.
    """
    imports = {m: Import(m, ("vllm", "torch", "sglang")) for m in modules(kvcached.integration)}
    yield imports
    for imp in imports.values():
        imp.close()


@pytest.mark.parametrize("module", modules(kvcached.integration))
def test_integration_modules_import_no_engine(integration_imports, module: str) -> None:
    found = integration_imports[module].loaded()
    if module in ENGINE_SIDE:
        assert ENGINE_SIDE[module] in found  # it is engine-side indeed: keep the list short and true
    else:
        assert found == []


def test_the_engine_side_modules_are_the_documented_ones() -> None:
    """docs/VLLM.md and docs/SGLANG.md name them on one line each: `Engine-side modules (...): ...`."""
    for doc, engine in (("docs/VLLM.md", "vllm"), ("docs/SGLANG.md", "sglang")):
        line = next(ln for ln in (REPO / doc).read_text().splitlines() if ln.startswith("Engine-side modules"))
        assert set(re.findall(r"`(kvcached\.[\w.]+)`", line)) == {m for m, e in ENGINE_SIDE.items() if e == engine}


# doctor's engine checks and the document they read: what they say about an engine comes from its section.
ENGINE_AGNOSTIC = ("kvcached.node.ops.diagnostics", "kvcached.node.ops.detectdoc")


@pytest.mark.parametrize("module", ENGINE_AGNOSTIC)
def test_doctor_names_no_engine_of_its_own(module: str) -> None:
    """No string in their code names vLLM, SGLang or Ray (docstrings and comments may, as examples)."""
    tree = ast.parse(source_of(module).read_text())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    named = [(n.lineno, n.value) for n in ast.walk(tree)
             if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
             and re.search(r"\b(vllm|sglang|ray)\b", n.value, re.IGNORECASE)]
    assert named == []
