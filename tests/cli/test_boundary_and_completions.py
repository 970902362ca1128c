"""Start-up stays light (DESIGN.md §2), completion scripts are current, and TAB completes live names."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jsonschema
import pytest

from kvcached.node.segment import create_segment

from .conftest import KVCTL, REPO, SCHEMAS
from .test_commands import COMMANDS

HEAVY = {"torch", "vllm", "numpy", "kvcached.runtime._kvpages", "kvcached.runtime", "kvcached.integration",
         "pydantic"}  # pydantic: typer's default coercion, which kvctl.coerce avoids (~100 ms)


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
    assert names == ["demo", "doctor", "engine_entry", "error", "gc", "inspect", "limit", "list"]
    for name in names:
        jsonschema.Draft202012Validator.check_schema(json.loads((SCHEMAS / f"{name}.json").read_text()))


def test_committed_completions_are_current(tmp_path) -> None:
    gen = [sys.executable, str(REPO / "scripts" / "gen_completions.py")]
    r = subprocess.run([*gen, "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert subprocess.run([*gen, "--out", str(tmp_path)], capture_output=True).returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["_kvctl", "_kvtop", "kvctl.bash", "kvctl.fish",
                                                           "kvtop.bash", "kvtop.fish"]
    (tmp_path / "kvctl.bash").write_text("# edited by hand\n")
    r = subprocess.run([*gen, "--check", "--out", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 1 and "kvctl.bash" in r.stderr


def complete(shell: str, words: str, extra: dict[str, str] | None = None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "KVCTL_ROOT"}
    env["_KVCTL_COMPLETE"] = f"complete_{shell}"
    if shell == "bash":
        env.update(COMP_WORDS=words, COMP_CWORD=str(len(words.split(" ")) - 1))
    else:
        env["_TYPER_COMPLETE_ARGS"] = words
        if shell == "fish":
            env["_TYPER_COMPLETE_FISH_ACTION"] = "get-args"
    env.update(extra or {})
    r = subprocess.run([KVCTL], capture_output=True, text=True, env=env, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_tab_completes_commands_checks_and_live_ipc_names(layout, uniq: str) -> None:
    for name in (f"{uniq}alpha", f"{uniq}beta", "other"):
        create_segment(layout.segment_path(name), 1 << 20)
        os.makedirs(layout.socket_dir(name), mode=0o700)
    os.mkdir(os.path.join(layout.tmp_dir, "kvcached-tp-forged-00000000"))  # bad hash: never offered
    root = layout.root
    assert "inspect" in complete("bash", "kvctl ins")
    assert complete("bash", "kvctl doctor sh") == ["shm"]
    assert complete("bash", f"kvctl --root {root} inspect {uniq}") == [f"{uniq}alpha", f"{uniq}beta"]
    assert complete("bash", f"kvctl --root {root} delete {uniq}a") == [f"{uniq}alpha"]
    assert complete("bash", f"kvctl inspect {uniq}", {"KVCTL_ROOT": root}) == [f"{uniq}alpha", f"{uniq}beta"]
    assert "forged" not in " ".join(complete("bash", f"kvctl --root {root} gc "))
    zsh = " ".join(complete("zsh", f"kvctl --root {root} limit {uniq}b"))
    assert f"{uniq}beta" in zsh and f"{uniq}alpha" not in zsh
    assert f"{uniq}alpha" in complete("fish", f"kvctl --root {root} list {uniq}")
