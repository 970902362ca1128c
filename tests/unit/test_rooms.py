"""The house's rooms: which folder may import which, the node layer's face, and the map that names them.

- Each room of `kvcached/node/` imports only the rooms below it (ROOMS): what
  it may lean on says whom it serves. Function-level imports count too.
- Code outside the node layer (kvctl, the integrations, the runtime) imports
  the node layer through its face, `kvcached.node`, never a room: the rooms
  can move without their callers knowing.
- The face's table is true (every name loads from its room) and mypy reads
  the same names (the TYPE_CHECKING block lists exactly the table's).
- docs/ARCHITECTURE.md names every package and module of the tree, under a
  heading for its folder: a module added without a line there fails here.
- One name, one thing (docs/CONTRIBUTING.md §14): a class name is one class in the
  product (kvcached/ and kvctl/); each module's logger is named by the module
  (`logging.getLogger(__name__)`); a comment or docstring that names a file
  names one that exists.
"""

from __future__ import annotations

import ast
import io
import pkgutil
import re
import subprocess
import tokenize
from collections import defaultdict
from pathlib import Path

import pytest

import kvcached
import kvcached.node
import kvctl

from .test_core_import_boundary import imports_of, modules, source_of

REPO = Path(__file__).resolve().parents[2]
NODE = "kvcached.node"
# room -> the rooms it may import (itself included); the face (kvcached.node itself) may import any.
ROOMS: dict[str, set[str]] = {
    "base": {"base"},
    "state": {"base", "state"},
    "clean": {"base", "state", "clean"},
    "gpu": {"base", "state", "clean", "gpu"},
    "in_engine": {"base", "state", "clean", "in_engine"},
    "places": {"base", "state", "clean", "places"},
    "ops": {"base", "state", "clean", "gpu", "places", "ops"},
}
# Outside the node layer: package -> what of kvcached it may import (the node layer only through its face).
OUTSIDE: dict[str, tuple[str, ...]] = {
    "kvctl": ("kvctl", "kvcached", "kvcached.settings", NODE),
    "kvcached.integration": ("kvcached", "kvcached.settings", NODE, "kvcached.integration", "kvcached.runtime"),
    "kvcached.runtime": ("kvcached", "kvcached.settings", NODE, "kvcached.runtime"),
}


def room_of(module: str) -> str | None:
    """The room a node module lives in ('' for the face), None outside the node layer."""
    if module == NODE:
        return ""
    if not module.startswith(NODE + "."):
        return None
    return module.split(".")[2]


def ours(name: str) -> bool:
    return name == "kvcached" or name.startswith(("kvcached.", "kvctl"))


def owner_module(name: str) -> str:
    """The module an imported name lives in: `kvcached.node.base.layout.Layout` -> its module."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        head = ".".join(parts[:k])
        path = REPO / Path(*head.split("."))
        if path.is_dir() or path.with_suffix(".py").is_file():
            return head
    return name


def test_every_folder_of_the_node_layer_is_a_known_room() -> None:
    folders = {p.name for p in (REPO / "kvcached" / "node").iterdir() if (p / "__init__.py").is_file()}
    assert folders and folders <= set(ROOMS), f"rooms without a rule in ROOMS: {folders - set(ROOMS)}"
    assert not [p.name for p in (REPO / "kvcached" / "node").glob("*.py") if p.name != "__init__.py"], \
        "a module directly in kvcached/node/: put it in the room whose audience it serves"


@pytest.mark.parametrize("module", [m for m in modules(kvcached.node) if room_of(m)])
def test_a_room_imports_only_the_rooms_below_it(module: str) -> None:
    room = room_of(module)
    assert room is not None
    bad = []
    for name, line, _ in imports_of(module):
        target = owner_module(name)
        other = room_of(target)
        if other is None:
            continue
        if other == "" or other not in ROOMS[room]:  # a room never goes through the face: it would hide a cycle
            bad.append(f"line {line}: {name} ({other or 'the face'})")
    assert not bad, f"{module} (room {room}) may import only {sorted(ROOMS[room])}: {bad}"


def _outside_modules() -> list[str]:
    import kvcached.integration
    import kvcached.runtime

    return [m for pkg in (kvctl, kvcached.integration, kvcached.runtime) for m in modules(pkg)
            if source_of(m).is_file()]  # the compiled extension has no source to read


@pytest.mark.parametrize("module", _outside_modules())
def test_code_outside_the_node_layer_imports_only_its_face(module: str) -> None:
    allowed = next(v for k, v in OUTSIDE.items() if module == k or module.startswith(k + "."))
    bad = []
    for name, line, _ in imports_of(module):
        if not ours(name):
            continue
        target = owner_module(name)
        if room_of(target):
            bad.append(f"line {line}: {name} (a room of the node layer: import it from kvcached.node)")
        elif not any(target == a or target.startswith(a + ".") for a in allowed) and target != "kvcached":
            bad.append(f"line {line}: {name}")
    assert not bad, f"{module} may import {allowed}: {bad}"


def test_settings_lean_only_on_the_node_layers_building_blocks() -> None:
    """kvcached.settings sits below the face (every room reads it), so it may import only base/ of the node."""
    bad = [f"line {line}: {name}" for name, line, _ in imports_of("kvcached.settings")
           if room_of(owner_module(name)) not in (None, "base")]
    assert not bad, bad


def test_contributings_map_names_every_folder() -> None:
    """The map of the repository (folders and what each may import) is for contributors: docs/CONTRIBUTING.md."""
    doc = (REPO / "docs/CONTRIBUTING.md").read_text()
    missing = [folder for folder, _ in _packages() if folder != "kvcached/" and f"| `{folder}` |" not in doc]
    assert not missing, f"docs/CONTRIBUTING.md's map of the repository has no row for {missing}"
    assert "| folder | what it holds | may import |" not in (REPO / "README.md").read_text(), "README is for users"


def _type_checking_names() -> set[str]:
    tree = ast.parse(source_of(NODE).read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom)
                names.update(a.asname or a.name for a in imp.names)
    return names


def test_the_face_table_loads_from_its_rooms_and_mypy_reads_the_same_names() -> None:
    table = kvcached.node.FACE
    names = [n for names in table.values() for n in names]
    assert len(names) == len(set(names)), "a face name in two modules of the table"
    assert _type_checking_names() == set(names)
    for home, exported in table.items():
        assert room_of(f"{NODE}.{home}"), f"{home} is not in a room"
        mod = __import__(f"{NODE}.{home}", fromlist=["_"])
        for name in exported:
            value = getattr(kvcached.node, name)
            expected = getattr(mod, name, None)
            if expected is None:  # a module of the room (ops.diagnostics)
                expected = __import__(f"{NODE}.{home}.{name}", fromlist=["_"])
            assert value is expected, f"{name} is not {home}'s"
    with pytest.raises(AttributeError):
        kvcached.node.no_such_name  # noqa: B018


def test_the_face_is_the_one_lazy_loader() -> None:
    """No other package of the node layer loads its names on first use: one table, one loader."""
    lazy = [m for m in modules(kvcached.node) if m != NODE and source_of(m).name == "__init__.py"
            and any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__"
                    for n in ast.parse(source_of(m).read_text()).body)]
    assert not lazy, f"lazy loaders besides the face's: {lazy}"


def _packages() -> list[tuple[str, list[str]]]:
    """(folder path, its modules' file stems) for every package of kvcached and kvctl."""
    out = []
    for top in (kvcached, kvctl):
        for pkg in [top.__name__] + [m.name for m in pkgutil.walk_packages(top.__path__, top.__name__ + ".")
                                     if m.ispkg]:
            folder = REPO / Path(*pkg.split("."))
            stems = sorted(p.stem for p in folder.glob("*.py") if p.name != "__init__.py")
            out.append((pkg.replace(".", "/") + "/", stems))
    return out


def _sections(text: str) -> dict[str, str]:
    """Folder heading (`### \\`kvcached/node/clean/\\``) -> the text up to the next heading."""
    out: dict[str, str] = {}
    parts = re.split(r"^###\s+`([\w/]+/)`.*$", text, flags=re.M)
    for i in range(1, len(parts), 2):
        out[parts[i]] = parts[i + 1].split("\n## ", 1)[0]
    return out


@pytest.mark.parametrize(("folder", "stems"), _packages())
def test_architecture_names_every_folder_and_module(folder: str, stems: list[str]) -> None:
    sections = _sections((REPO / "docs/ARCHITECTURE.md").read_text())
    assert folder in sections, f"docs/ARCHITECTURE.md: no section headed ### `{folder}`"
    missing = [s for s in stems if f"`{s}`" not in sections[folder]]
    assert not missing, f"docs/ARCHITECTURE.md's {folder} section does not name {missing}"


# The engine half of the house's fourth step (issue 35) renames these on its own branch; until both branches
# are merged they still break the rules below. The lead empties this when they are: nothing else goes in it.
# Files the code cites that are not this repository's: the engines' and the kernel's, where a comment says
# which of their sources a rule was read from.
NOT_OURS = {"sglang/srt/plugins/__init__.py", "srt/server_args.py", "vllm/envs.py", "v1/worker/utils.py",
            "v1/kv_cache_interface.py", "linux/stat.h", "cuda.h",
            # the container runtimes' state files a sandbox's holder is read from (places/sandbox.py)
            "config.json", "config.v2.json"}


def _product_modules() -> list[tuple[str, Path]]:
    """(module, source) of every module of kvcached and kvctl that has a source."""
    out = []
    for top in (kvcached, kvctl):
        for m in modules(top):
            path = source_of(m)
            if path.is_file():
                out.append((m, path))
    return out


def test_one_class_name_is_one_class() -> None:
    homes: dict[str, set[str]] = defaultdict(set)
    for module, path in _product_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                homes[node.name].add(module)  # one module may define a class twice (mypy's branch, the run's)
    twins = {name: sorted(mods) for name, mods in homes.items()
             if len(mods) > 1}
    assert not twins, f"a class name that names two classes: {twins}"


def test_each_modules_logger_is_named_by_the_module() -> None:
    bad = []
    for module, path in _product_modules():
        for node in ast.parse(path.read_text()).body:
            call = node.value if isinstance(node, ast.Assign) else None
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                    and call.func.attr == "getLogger"):
                continue
            arg = call.args[0] if call.args else None
            named = (isinstance(arg, ast.Name) and arg.id == "__name__") or \
                (isinstance(arg, ast.Constant) and arg.value == module)
            if not named:
                bad.append(f"{module}: getLogger({ast.unparse(arg) if arg is not None else ''})")
    assert not bad, f"loggers not named by their module (logging.getLogger(__name__)): {bad}"


_FILE_REF = re.compile(r"(?<![\w/.*-])((?:[\w.-]+/)*[\w-]+\.(?:py|pyi|md|json|cpp|h|toml|yaml|yml|sh))(?![\w/])")


def _comments_and_docstrings(path: Path) -> list[tuple[int, str]]:
    src = path.read_text()
    out = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(src).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                out.append((node.body[0].lineno, doc))
    return out


def test_comments_name_files_that_exist() -> None:
    """A file named in a comment or docstring is one of the repository's (by its path, or its path's tail)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split()
    files = {f for f in listed if (REPO / f).exists()}
    tails = {"/".join(f.split("/")[i:]) for f in files for i in range(f.count("/") + 1)}
    bad = []
    for _, path in _product_modules():
        for line, text in _comments_and_docstrings(path):
            bad += [f"{path.relative_to(REPO)}:{line}: {ref}" for ref in _FILE_REF.findall(text)
                    if ref not in tails and ref not in NOT_OURS]
    assert not bad, f"comments and docstrings that name files the repository does not have: {bad}"
