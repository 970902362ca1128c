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
"""

from __future__ import annotations

import ast
import pkgutil
import re
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
    assert _type_checking_names() == set(table)
    for name, (home, attr) in table.items():
        assert room_of(f"{NODE}.{home}"), f"{name}: {home} is not in a room"
        value = getattr(kvcached.node, name)
        mod = __import__(f"{NODE}.{home}", fromlist=["_"])
        assert value is (mod if attr is None else getattr(mod, attr))
    with pytest.raises(AttributeError):
        kvcached.node.no_such_name  # noqa: B018


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
