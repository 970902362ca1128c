"""Start-up stays light (docs/CLEANER.md §2), the schemas are valid, the completion files are current."""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import pytest

from .conftest import KVCTL, REPO, SCHEMAS
from .test_commands import COMMANDS

HEAVY = {"torch", "vllm", "numpy", "kvcached.runtime._kvpages", "kvcached.runtime", "kvcached.integration",
         "pydantic",  # typer 0.29's coercion, which kvctl/typer_adapter.py avoids (bench/bench_cli_start.py)
         "pynvml", "kvcached.node.gpu"}  # NVML: only inside a GPU-holder pass that found an NVIDIA holder


def imported(*args: str) -> set[str]:
    r = subprocess.run([sys.executable, "-X", "importtime", KVCTL, *args], capture_output=True, text=True,
                       timeout=60, stdin=subprocess.DEVNULL)
    assert "Traceback" not in r.stderr, r.stderr
    return {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("args", [["--help"], ["gc", "--dry-run"], *([c, "--help"] for c in COMMANDS)],
                         ids=lambda a: " ".join(a))
def test_no_heavy_imports(args: list[str], root: str) -> None:
    mods = imported("--root", root, *args)
    assert "typer" in mods  # the measurement works
    heavy = {m for m in mods if m.split(".")[0] in HEAVY or any(m == h or m.startswith(h + ".") for h in HEAVY)}
    assert heavy == set()


def test_schemas_are_valid_json_schema() -> None:
    names = sorted(p.stem for p in SCHEMAS.glob("*.json"))
    assert names == ["demo", "doctor", "engine_entry", "error", "gc", "gc_event", "inspect", "limit", "list", "place"]
    for name in names:
        jsonschema.Draft202012Validator.check_schema(json.loads((SCHEMAS / f"{name}.json").read_text()))


def test_committed_completions_are_current(tmp_path) -> None:
    """completions/, kvctl/completion_table.py and docs/KVCTL.md's --help blocks are what
    scripts/gen_completions.py writes from the commands."""
    gen = [sys.executable, str(REPO / "scripts" / "gen_completions.py")]
    r = subprocess.run([*gen, "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    table = tmp_path / "completion_table.py"
    out = tmp_path / "completions"
    doc = tmp_path / "kvctl_doc.txt"
    doc.write_text((REPO / "docs/KVCTL.md").read_text())
    paths = ["--out", str(out), "--table", str(table), "--doc", str(doc)]
    assert subprocess.run([*gen, *paths], capture_output=True).returncode == 0
    assert sorted(p.name for p in out.iterdir()) == ["_kvctl", "_kvtop", "kvctl.bash", "kvctl.fish",
                                                      "kvtop.bash", "kvtop.fish"]
    assert table.read_text() == (REPO / "kvctl" / "completion_table.py").read_text()
    assert doc.read_text() == (REPO / "docs/KVCTL.md").read_text()
    for edited, change in ((out / "kvctl.bash", "# edited by hand\n"), (table, "# edited by hand\n"),
                           (doc, None)):
        text = edited.read_text()
        # The doc's prose is by hand; what is checked is its generated blocks (an exit code changed there).
        edited.write_text(text + change if change else text.replace("0 ok; 6 NAME matches nothing", "0 ok", 1))
        assert edited.read_text() != text
        r = subprocess.run([*gen, "--check", *paths], capture_output=True, text=True)
        assert r.returncode == 1 and edited.name in r.stderr, r.stderr
        edited.write_text(text)
