"""TAB completion as the shells run it: the committed scripts' protocol against the installed kvctl and kvtop.

bash runs the committed script itself (its completion function, COMPREPLY).
zsh and fish are not on the test machines, so their requests are made the way
their committed scripts make them: the variable assignments are read out of
the script text, so a script and kvctl that stopped agreeing fail here.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from kvcached.node.base.layout import Layout
from kvcached.node.clean.present import SEGMENT_SIZE, deployment_names
from kvcached.node.clean.scan import scan
from kvcached.node.state.segment import SEGMENT_SIZE as REAL_SEGMENT_SIZE
from kvcached.node.state.segment import create_segment

from .conftest import KVCTL, REPO

BIN = os.path.dirname(KVCTL)
COMPLETIONS = REPO / "completions"


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KVCTL_ROOT", "_KVCTL_COMPLETE", "_KVTOP_COMPLETE")}
    env["PATH"] = f"{BIN}:{env.get('PATH', '')}"  # the scripts run `kvctl` / `$1` from PATH
    env.update(extra or {})
    return env


def bash(line: str, prog: str = "kvctl", extra: dict[str, str] | None = None) -> list[str]:
    """COMPREPLY after the committed bash script completes `line` (a trailing space: a new, empty word)."""
    if shutil.which("bash") is None:
        pytest.skip("bash is not installed")
    words = line.split()
    if line.endswith(" "):
        words.append("")
    script = (f"source {COMPLETIONS / f'{prog}.bash'}\n"
              f"COMP_WORDS=({' '.join(_sh_quote(w) for w in words)}); COMP_CWORD={len(words) - 1}\n"
              f"_{prog}_completion {prog}\nprintf '%s\\n' \"${{COMPREPLY[@]}}\"\n")
    r = subprocess.run(["bash", "--norc", "--noprofile", "-c", script], capture_output=True, text=True,
                       env=_env(extra), timeout=60)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    return [w for w in r.stdout.split("\n") if w]


def _sh_quote(word: str) -> str:
    return "'" + word.replace("'", "'\\''") + "'"


def _assignments(script: str, prog: str) -> list[dict[str, str]]:
    """The `env VAR=value ... prog` invocations of a committed script, as {VAR: value} (shell expansions kept)."""
    value = r"""(?:\([^)]*\)|"[^"]*"|[^\s"()]+)"""  # (fish command), "zsh/bash expansion", or a word
    found = []
    for m in re.finditer(rf"env ((?:\w+={value} )+){re.escape(prog)}\b", script):
        found.append(dict(re.findall(rf"(\w+)=({value})", m.group(1))))
    assert found, f"no `env ... {prog}` invocation in the script"
    return found


def zsh(line: str, prog: str = "kvctl", extra: dict[str, str] | None = None) -> str:
    """What kvctl prints for the committed zsh script's request (the script `eval`s it)."""
    [call] = _assignments((COMPLETIONS / f"_{prog}").read_text(), prog)
    assert call["_TYPER_COMPLETE_ARGS"] == '"${words[1,$CURRENT]}"'  # the words up to the cursor
    env = {k: v for k, v in call.items() if not v.startswith('"$')}
    r = subprocess.run([os.path.join(BIN, prog)], capture_output=True, text=True, timeout=60,
                       env=_env({**env, "_TYPER_COMPLETE_ARGS": line, **(extra or {})}))
    assert r.returncode == 0, r.stderr
    return r.stdout


def fish(line: str, prog: str = "kvctl", extra: dict[str, str] | None = None) -> tuple[list[str], int]:
    """(the lines kvctl prints for fish's get-args request, is-args's exit status), as the script asks."""
    calls = _assignments((COMPLETIONS / f"{prog}.fish").read_text(), prog)
    by_action = {c["_TYPER_COMPLETE_FISH_ACTION"]: c for c in calls}
    assert set(by_action) == {"get-args", "is-args"}
    out = []
    for action in ("get-args", "is-args"):
        env = {k: v for k, v in by_action[action].items() if not v.startswith("(")}
        r = subprocess.run([os.path.join(BIN, prog)], capture_output=True, text=True, timeout=60,
                           env=_env({**env, "_TYPER_COMPLETE_ARGS": line, **(extra or {})}))
        out.append(r)
    assert out[0].returncode == 0, out[0].stderr
    return [w for w in out[0].stdout.split("\n") if w], out[1].returncode


@pytest.fixture
def node(layout, uniq: str) -> Layout:
    """Two deployments of this test, one other, a directory with a forged hash, and a default-named segment."""
    for name in (f"{uniq}alpha", f"{uniq}beta", "other"):
        create_segment(layout.segment_path(name), 1 << 20)
        os.makedirs(layout.socket_dir(name), mode=0o700)
    os.mkdir(os.path.join(layout.tmp_dir, f"kvcached-tp-{uniq}forged-00000000"))  # bad hash: never offered
    create_segment(layout.segment_path("kvcached_vLLM_4242"), 1 << 20)
    return layout


def test_bash_completes_commands_options_choices_and_checks() -> None:
    assert bash("kvctl g") == ["gc"]
    assert bash("kvctl ins") == ["inspect"]
    assert "limit-percent" in bash("kvctl ")
    assert bash("kvctl gc --d") == ["--dry-run"]
    assert bash("kvctl gc --dry-run --d") == []  # an option given once is not offered again
    # kvcached's kinds, then the engines' (the engine pass's), in their enums' order
    assert bash("kvctl gc --kind ") == ["segment", "socket", "directory", "vllm-shm", "vllm-ipc", "sglang-shm",
                                        "sglang-ipc", "nccl-shm", "cuda-shm", "torch-shm", "python-sem"]
    assert bash("kvctl gc --kind sglang-") == ["sglang-shm", "sglang-ipc"]
    assert bash("kvctl gc --kind n") == ["nccl-shm"]
    assert bash("kvctl gc --kind=so") == ["socket"]
    assert bash("kvctl doctor sh") == ["shm"]
    assert bash("kvctl doctor e") == ["events", "extension", "engine-leftovers", "engines", "environment", "engine"]
    assert bash("kvctl --v") == ["--verbose", "--version"]
    assert "--root" not in bash("kvctl gc --r")  # after the command, --root is accepted, not offered
    assert bash("kvtop --c", prog="kvtop") == ["--count"]


def test_bash_completes_the_ipc_names_on_the_node(node: Layout, uniq: str) -> None:
    root = node.root
    assert bash(f"kvctl --root {root} inspect {uniq}") == [f"{uniq}alpha", f"{uniq}beta"]
    assert bash(f"kvctl --root={root} delete {uniq}a") == [f"{uniq}alpha"]
    assert bash(f"kvctl inspect {uniq}", extra={"KVCTL_ROOT": root}) == [f"{uniq}alpha", f"{uniq}beta"]
    assert bash(f"kvctl gc --root {root} {uniq}b") == [f"{uniq}beta"]  # --root after the command counts too
    assert bash(f"kvctl --root {root} limit kvcached_") == ["kvcached_vLLM_4242"]
    assert bash(f"kvctl --root {root} limit {uniq}alpha ") == []  # SIZE: nothing to offer
    assert bash(f"kvtop --root {root} {uniq}", prog="kvtop") == [f"{uniq}alpha", f"{uniq}beta"]
    offered = bash(f"kvctl --root {root} gc ")
    assert {f"{uniq}alpha", f"{uniq}beta", "other"} <= set(offered) and not any("forged" in w for w in offered)


def test_zsh_and_fish_requests_as_their_scripts_make_them(node: Layout, uniq: str) -> None:
    root = node.root
    out = zsh(f"kvctl --root {root} limit {uniq}b")
    assert out == f"_arguments '*: :((\"{uniq}beta\"))'\n"
    out = zsh("kvctl gc --dry")
    assert out.startswith("_arguments '*: :((\"--dry-run\":\"Show what would be removed; remove nothing.\"")
    assert zsh(f"kvctl --root {root} limit {uniq}alpha ") == "_files\n"  # nothing to offer: zsh offers files
    words, is_args = fish(f"kvctl --root {root} list {uniq}")
    assert words == [f"{uniq}alpha", f"{uniq}beta"] and is_args == 0
    words, _ = fish("kvctl doctor n")
    assert words == ["namespaces", "node"]
    assert fish("kvctl gc --prometheus ")[1] == 1  # nothing to offer: fish may offer files
    assert fish("kvtop --c", prog="kvtop") == (["--count\tStop after N refreshes (0: until q or Ctrl-C)."], 0)


def test_a_tab_press_imports_neither_typer_nor_the_node_scan(node: Layout, uniq: str) -> None:
    env = _env({"_KVCTL_COMPLETE": "complete_bash", "COMP_WORDS": f"kvctl --root {node.root} inspect {uniq}",
                "COMP_CWORD": "4"})
    r = subprocess.run([sys.executable, "-X", "importtime", KVCTL], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.stdout.split() == [f"{uniq}alpha", f"{uniq}beta"], r.stderr[-2000:]
    mods = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "kvcached.node.clean.present" in mods  # the measurement works
    heavy = {m for m in mods if m.split(".")[0] in ("typer", "click", "rich", "psutil")
             or m in ("kvcached.node.clean.scan", "kvcached.node.clean.facts", "dataclasses")}
    assert heavy == set()


def test_the_quick_name_scan_offers_what_the_scan_finds(layout, uniq: str) -> None:
    assert SEGMENT_SIZE == REAL_SEGMENT_SIZE
    for name in (f"{uniq}a", f"{uniq}b"):
        create_segment(layout.segment_path(name), 1 << 20)
        os.makedirs(layout.socket_dir(name), mode=0o700)
    os.makedirs(layout.socket_dir(f"{uniq}dironly"), mode=0o700)
    os.mkdir(os.path.join(layout.tmp_dir, f"kvcached-tp-{uniq}forged-00000000"))
    shm = layout.shm_dir
    with open(os.path.join(shm, f"{uniq}shaped"), "wb") as f:  # upstream's, its directory gone: a positive limit
        f.write((1 << 30).to_bytes(8, "little") + bytes(16))
    with open(os.path.join(shm, f"{uniq}zero"), "wb") as f:  # 24 bytes, limit 0: not a segment by its shape
        f.write(bytes(24))
    with open(os.path.join(shm, f"{uniq}big"), "wb") as f:
        f.write(bytes(4096))
    os.symlink("/etc/passwd", os.path.join(shm, f"{uniq}link"))
    os.symlink("/etc/passwd", os.path.join(shm, "kvcached_vLLM_77"))  # a default name: a candidate (foreign)
    os.mkdir(os.path.join(shm, f"{uniq}dironly"))  # named by its socket directory: a candidate (foreign)
    expected = {c.deployment for c in scan(layout).candidates if c.deployment and c.hash_ok}
    assert deployment_names(layout.root) == expected
    assert {f"{uniq}a", f"{uniq}b", f"{uniq}dironly", f"{uniq}shaped", "kvcached_vLLM_77"} <= expected
    assert not expected & {f"{uniq}zero", f"{uniq}big", f"{uniq}link", f"{uniq}forged"}


def test_the_scripts_print_themselves_and_a_bad_request_is_refused() -> None:
    for shell, name in (("bash", "kvctl.bash"), ("zsh", "_kvctl"), ("fish", "kvctl.fish")):
        r = subprocess.run([KVCTL], capture_output=True, text=True, env=_env({"_KVCTL_COMPLETE": f"source_{shell}"}))
        assert r.returncode == 0 and r.stdout and r.stdout in (COMPLETIONS / name).read_text(), shell
    r = subprocess.run([KVCTL], capture_output=True, text=True, env=_env({"_KVCTL_COMPLETE": "complete_tcsh"}))
    assert r.returncode == 1 and r.stdout == "" and "not supported" in r.stderr
