"""Every kvctl command: exit codes, --json against the documented schema, bad input as one clear line.

In-process through typer's CliRunner for speed, and through the installed
`kvctl` in a subprocess for what only a real process shows (entry point,
stderr, signals, no traceback).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest

from kvcached.node.base.layout import Layout
from kvcached.node.state.segment import create_segment, read_segment, write_segment
from kvcached.runtime.harness import start_deployment
from kvcached.runtime.ipc.client import ping

from ..fs.helpers import backdate
from .conftest import KVCTL, assert_one_line_error, invoke, kvctl

COMMANDS = ["list", "limit", "limit-percent", "watch", "top", "delete", "shell", "inspect", "gc", "doctor", "demo"]


def stale_segment(layout, name: str, total: int = 1 << 30) -> str:
    path = layout.segment_path(name)
    create_segment(path, total)
    backdate(path)
    return path


def dead_name(uniq: str) -> str:
    # A default-form name whose process group cannot exist (pid_max is at most 2**22).
    return f"kvcached_proc_{9_000_000 + int(uniq.split('x')[-1])}"


@pytest.mark.parametrize("cmd", COMMANDS)
def test_help_of_every_command(cmd: str) -> None:
    r = invoke(cmd, "--help")
    assert r.code == 0 and "Usage" in r.stdout


def test_help_and_version_of_the_installed_program() -> None:
    r = kvctl("--help")
    assert r.code == 0 and all(c in r.stdout for c in COMMANDS)
    r = kvctl("--version")
    assert r.code == 0 and r.stdout.startswith("kvctl ")
    assert kvctl().code == 2 or kvctl().code == 0  # no command: help (typer's no_args_is_help)


def test_global_options(root: str) -> None:
    assert_one_line_error(kvctl("--root", "/nonexistent/dir", "list"), 2)
    assert_one_line_error(kvctl("list", "--bogus"), 2)
    assert_one_line_error(kvctl("bogus-command"), 2)
    stale_segment(Layout(root), "viaenv", 1 << 30)
    r = kvctl("list", "--json", env={"KVCTL_ROOT": root})
    assert r.code == 0 and [x["path"] for x in r.json("list")] == [os.path.join(root, "dev/shm/viaenv")]


def test_list(layout, uniq: str, deployments) -> None:
    root = layout.root
    r = invoke("--root", root, "list")
    assert r.code == 0 and "No kvcached segments" in r.stdout
    dead = dead_name(uniq)
    stale_segment(layout, dead, 2 << 30)
    deployments.append(start_deployment(f"{uniq}live", 1, 1, layout=layout))
    doc = invoke("--root", root, "list", "--json").json("list")
    states = {s["ipc"]: (s["state"], s["limit_bytes"]) for s in doc}
    assert states == {dead: ("stale", 2 << 30), f"{uniq}live": ("live", 1 << 30)}
    r = kvctl("--root", root, "list")
    assert r.code == 0 and dead in r.stdout and "stale" in r.stdout and "live" in r.stdout and "2G" in r.stdout
    assert [x["ipc"] for x in invoke("--root", root, "list", dead, "--json").json("list")] == [dead]
    assert_one_line_error(kvctl("--root", root, "list", "nothing-like-this"), 6)


def test_list_json_is_what_upstreams_consumers_read(layout, uniq: str) -> None:
    """Upstream's `kvctl list --json` is a JSON array of {"ipc", "limit_bytes", "used_bytes"}: scripts
    written for it (`[r["ipc"] for r in json.loads(out)]`, `jq '.[].ipc'`) must keep working on ours."""
    name = dead_name(uniq)
    write_segment(stale_segment(layout, name, 3 << 30), used=1 << 20)
    out = kvctl("--root", layout.root, "list", "--json").stdout
    rows = json.loads(out)
    assert [r["ipc"] for r in rows] == [name]
    assert (rows[0]["limit_bytes"], rows[0]["used_bytes"]) == (3 << 30, 1 << 20)
    assert list(rows[0])[:3] == ["ipc", "limit_bytes", "used_bytes"], "upstream's keys come first"


def test_limit(layout, uniq: str) -> None:
    root = layout.root
    name = dead_name(uniq)
    path = stale_segment(layout, name)
    doc = invoke("--root", root, "limit", name, "1.5GiB", "--json").json("limit")
    assert doc["previous"] == 1 << 30 and doc["limit"] == 3 << 29 and read_segment(path).total == 3 << 29
    r = kvctl("--root", root, "limit", name, "512M")
    assert r.code == 0 and "512M" in r.stdout and read_segment(path).total == 512 << 20
    for bad in ("-1", "-1G", "garbage", "1.5", "2X"):
        r = kvctl("--root", root, "limit", name, bad)
        assert_one_line_error(r, 2)
        assert "size" in r.stderr
    assert read_segment(path).total == 512 << 20
    assert_one_line_error(kvctl("--root", root, "limit", "no-such-segment", "1G"), 6)
    assert_one_line_error(kvctl("--root", root, "limit", "bad name", "1G"), 2)


def test_limit_refuses_what_is_not_a_segment(layout) -> None:
    shm = layout.shm_dir
    with open(os.path.join(shm, "short"), "wb") as f:
        f.write(b"x" * 10)
    with open(os.path.join(shm, "linked"), "wb") as f:
        f.write(b"\0" * 24)
    os.link(os.path.join(shm, "linked"), os.path.join(layout.tmp_dir, "elsewhere"))
    os.symlink("/etc/passwd", os.path.join(shm, "symlinked"))
    os.mkdir(os.path.join(shm, "adir"))
    for name, why in (("short", "bytes"), ("linked", "hard links"), ("symlinked", "symbolic link"),
                      ("adir", "regular file")):
        r = kvctl("--root", layout.root, "limit", name, "1G")
        assert_one_line_error(r, 7)
        assert why in r.stderr
    with open(os.path.join(layout.tmp_dir, "elsewhere"), "rb") as f:
        assert f.read() == b"\0" * 24  # nothing written through the hard link


def test_limit_percent(layout, uniq: str) -> None:
    name = dead_name(uniq)
    stale_segment(layout, name)
    for bad in ("0", "-5", "100.5", "abc"):
        r = kvctl("--root", layout.root, "limit-percent", name, bad)
        assert_one_line_error(r, 2)
        assert "percentage" in r.stderr
    r = kvctl("--root", layout.root, "limit-percent", name, "50")
    try:
        import torch  # noqa: F401
        has_torch = True
    except ImportError:
        has_torch = False
    if not has_torch:
        assert_one_line_error(r, 1)
        assert "PyTorch" in r.stderr
    elif r.code != 0:  # torch without a visible GPU
        assert_one_line_error(r, 1)
        assert "GPU" in r.stderr


def test_watch_and_top(layout, uniq: str, deployments) -> None:
    stale_segment(layout, dead_name(uniq))
    deployments.append(start_deployment(f"{uniq}w", 2, 1, layout=layout))
    r = invoke("--root", layout.root, "watch", "-n", "0.05", "--count", "2")
    assert r.code == 0 and r.stdout.count(f"{uniq}w") == 2
    r = kvctl("--root", layout.root, "top", "--count", "1")
    assert r.code == 0 and f"{uniq}w" in r.stdout and "ORPHANS" in r.stdout
    r = subprocess.run([os.path.join(os.path.dirname(KVCTL), "kvtop"), "--root", layout.root, "--count", "1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and f"{uniq}w" in r.stdout
    assert_one_line_error(kvctl("--root", layout.root, "watch", "-n", "0"), 2)
    assert_one_line_error(kvctl("--root", layout.root, "top", "--count", "x"), 2)


def test_ctrl_c_exits_130_without_a_traceback(root: str) -> None:
    # As from a terminal: SIGINT at its default. A suite started in the background by a
    # non-interactive shell inherits SIGINT ignored, and Python then installs no handler.
    p = subprocess.Popen([KVCTL, "--root", root, "watch", "-n", "30"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    # Once the first snapshot is out, kvctl is waiting for the next refresh: Ctrl-C now, not at a
    # moment of the interpreter's start-up that a busy machine makes later or earlier.
    assert p.stdout.readline().strip()
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 130
    assert "Traceback" not in err


def test_delete(layout, uniq: str, deployments) -> None:
    root = layout.root
    live = start_deployment(f"{uniq}live", 2, 1, layout=layout)
    deployments.append(live)
    r = kvctl("--root", root, "delete", f"{uniq}live")
    assert_one_line_error(r, 7)
    assert "live" in r.stderr
    assert ping(layout.socket_path(f"{uniq}live", 1))["rank"] == 1

    dead = start_deployment(f"{uniq}dead", 2, 2, layout=layout)
    dead.kill()
    doc = invoke("--root", root, "delete", f"{uniq}dead", "--min-age", "0", "--json").json("gc")
    assert doc["schema"] == "kvctl.delete/1" and doc["exit_code"] == 0
    assert {e["action"] for e in doc["entries"]} == {"removed"}
    assert not os.path.exists(layout.segment_path(f"{uniq}dead"))
    assert not os.path.exists(layout.socket_dir(f"{uniq}dead"))

    assert_one_line_error(kvctl("--root", root, "delete", f"{uniq}nothing"), 6)
    assert_one_line_error(kvctl("--root", root, "delete", "bad name"), 2)


def test_delete_asks_before_what_is_not_proven_dead(layout, uniq: str) -> None:
    name = dead_name(uniq)
    path = layout.segment_path(name)
    create_segment(path, 1 << 30)  # just made: young, inside the grace age
    r = kvctl("--root", layout.root, "delete", name)
    assert_one_line_error(r, 7)
    assert "young" in r.stderr and "--yes" in r.stderr and os.path.exists(path)
    r = kvctl("--root", layout.root, "delete", name, "--yes")
    assert r.code == 0 and not os.path.exists(path)


def test_shell(layout, uniq: str) -> None:
    name = dead_name(uniq)
    stale_segment(layout, name)
    marker = os.path.join(layout.root, "pwned")
    r = kvctl("--root", layout.root, "shell", input=f"help\nlist\nlimit {name} 3G\ntouch {marker}\n")
    assert "commands:" in r.stderr and name in r.stdout and "3G" in r.stdout
    assert "unknown command 'touch'" in r.stderr and not os.path.exists(marker)  # never a system shell
    assert r.code == 2 and "Traceback" not in r.stderr  # the last command's code
    r = kvctl("--root", layout.root, "shell", input="list\nexit\nlist\n")
    assert r.code == 0 and r.stdout.count(name) == 1


def test_inspect(layout, uniq: str, deployments) -> None:
    root = layout.root
    deployments.append(start_deployment(f"{uniq}live", 2, 2, layout=layout))
    dead = start_deployment(f"{uniq}dead", 1, 1, layout=layout)
    dead.kill()
    doc = invoke("--root", root, "inspect", "--min-age", "0", "--json").json("inspect")
    deps = {d["name"]: d for d in doc["deployments"]}
    assert deps[f"{uniq}live"]["state"] == "live" and deps[f"{uniq}dead"]["state"] == "stale"
    roles = sorted(p["role"] for p in deps[f"{uniq}live"]["processes"])
    assert roles == ["api", "engine", "worker", "worker", "worker", "worker"]
    socks = {(e["stage"], e["rank"]): e for e in deps[f"{uniq}live"]["entries"] if e["kind"] == "socket"}
    workers = {(p["stage"], p["rank"]): p["pid"] for p in deps[f"{uniq}live"]["processes"] if p["role"] == "worker"}
    assert {k: e["served_by"] for k, e in socks.items()} == {k: [pid] for k, pid in workers.items()}
    assert deps[f"{uniq}live"]["segment"]["limit"] == 1 << 30
    r = kvctl("--root", root, "inspect", f"{uniq}live")
    assert r.code == 0 and f"Deployment {uniq}live" in r.stdout and "harness worker" in r.stdout
    assert f"{uniq}dead" not in r.stdout
    assert_one_line_error(kvctl("--root", root, "inspect", "nothing-*"), 6)
    assert_one_line_error(kvctl("--root", root, "inspect", "--pid", "-1"), 2)
    assert_one_line_error(kvctl("--root", root, "inspect", "--pid", "4194304"), 6)
    assert_one_line_error(kvctl("--root", root, "inspect", "--min-age", "soon"), 2)


def test_escape_sequences_in_names_are_neutralised(layout) -> None:
    os.mkdir(os.path.join(layout.tmp_dir, "kvcached-tp-\x1b]0;owned\x07\x1b[2J-00000000"), 0o700)
    r = kvctl("--root", layout.root, "inspect")
    assert r.code == 0 and "\x1b" not in r.stdout and "\x07" not in r.stdout
    assert "\\x1b]0;owned\\x07\\x1b[2J" in r.stdout
    doc = kvctl("--root", layout.root, "inspect", "--json").json("inspect")
    assert doc["unowned"][0]["state"] == "foreign"


def test_gc_without_yes_off_a_terminal_removes_nothing(layout, uniq: str) -> None:
    path = stale_segment(layout, dead_name(uniq))
    r = kvctl("--root", layout.root, "gc")
    assert r.code == 3 and "nothing removed" in r.stderr and "--yes" in r.stderr and os.path.exists(path)
    doc = kvctl("--root", layout.root, "gc", "--json").json("gc")
    assert doc["dry_run"] is True and doc["exit_code"] == 3 and os.path.exists(path)
    r = kvctl("--root", layout.root, "gc", "--yes")
    assert r.code == 0 and "removed 1" in r.stdout and not os.path.exists(path)
    r = kvctl("--root", layout.root, "gc", "--yes")
    assert r.code == 0 and "removed 0" in r.stdout


def test_gc_bad_input(root: str) -> None:
    for args in (["--min-age", "-5"], ["--min-age", "ten"], ["--kind", "file"], ["--time-limit", "x"],
                 ["--bogus"]):
        assert_one_line_error(kvctl("--root", root, "gc", *args), 2)


def test_gc_filters(layout, uniq: str) -> None:
    a, b = dead_name(uniq), dead_name(uniq) + "1"
    stale_segment(layout, a)
    stale_segment(layout, b)
    doc = invoke("--root", layout.root, "gc", "--yes", "--json", a).json("gc")
    assert [e["path"] for e in doc["entries"]] == [layout.segment_path(a)]
    doc = invoke("--root", layout.root, "gc", "--yes", "--json", "--kind", "socket").json("gc")
    assert doc["entries"] == [] and os.path.exists(layout.segment_path(b))
    doc = invoke("--root", layout.root, "gc", "--yes", "--json", "kvcached_proc_*", "--kind", "segment").json("gc")
    assert [e["action"] for e in doc["entries"]] == ["removed"]


def test_gc_prometheus_textfile(layout, uniq: str, tmp_path) -> None:
    prom = tmp_path / "kvctl.prom"
    stale_segment(layout, dead_name(uniq))
    r = kvctl("--root", layout.root, "gc", "--dry-run", "--prometheus", str(prom))
    assert r.code == 3
    text = prom.read_text()
    assert 'kvctl_gc_stale_entries{kind="segment"} 1' in text
    assert "kvctl_gc_last_success_timestamp_seconds" not in text
    assert kvctl("--root", layout.root, "gc", "--yes", "--prometheus", str(prom)).code == 0
    text = prom.read_text()
    assert 'kvctl_gc_removed{kind="segment"} 1' in text and 'kvctl_gc_stale_entries{kind="segment"} 0' in text
    success = [ln for ln in text.splitlines() if ln.startswith("kvctl_gc_last_success_timestamp_seconds ")]
    assert len(success) == 1 and abs(float(success[0].split()[1]) - time.time()) < 60
    assert [p.name for p in tmp_path.iterdir()] == ["kvctl.prom"]  # no temp file left behind
    assert oct(prom.stat().st_mode & 0o777) == "0o644"


def test_doctor(layout, uniq: str) -> None:
    doc = invoke("--root", layout.root, "doctor", "--json").json("doctor")
    names = {c["name"] for c in doc["checks"]}
    assert {"shm-present", "shm-tmpfs", "shm-space", "tmp-sticky", "proc-readable", "privileges", "ipc-name",
            "socket-paths", "extension", "stale", "orphans", "namespaces"} <= names
    assert any(c["group"] == "engine" for c in doc["checks"])
    assert doc["healthy"] == (doc["exit_code"] == 0)
    # Every command line a fix prints carries this run's --root: pasted as printed, it acts on this node.
    command_line = re.compile(r"\bkvctl (gc|inspect|delete|list|doctor)\b")
    bare = [c["fix"] for c in doc["checks"] if command_line.search(c.get("fix") or "")]
    assert not bare, bare
    stale_segment(layout, dead_name(uniq))
    r = kvctl("--root", layout.root, "doctor", "node")
    # The whole report on failure: another worker's processes are on this node too (it failed once under -n 2).
    assert "warn" in r.stdout and f"fix: kvctl --root {layout.root} gc --yes" in r.stdout and r.code == 0, \
        (r.code, r.stdout, r.stderr)
    r = kvctl("--root", layout.root, "doctor", "stale", "--strict")
    assert r.code == 8 and "unhealthy" in r.stdout
    r = kvctl("--root", layout.root, "doctor", "ipc-name", env={"KVCACHED_IPC_NAME": "my model/v1"})
    assert "my-model-v1" in r.stdout and "export KVCACHED_IPC_NAME=my-model-v1" in r.stdout
    assert_one_line_error(kvctl("--root", layout.root, "doctor", "no-such-check"), 2)
    for entry in os.listdir(layout.shm_dir):
        os.unlink(os.path.join(layout.shm_dir, entry))
    os.rmdir(layout.shm_dir)
    r = kvctl("--root", layout.root, "doctor", "shm", "--json")
    assert r.code == 8 and r.json("doctor")["checks"][0]["status"] == "fail"


def test_doctor_says_an_engines_fix_once_and_lists_its_patches_under_it() -> None:
    """Any engine kvcached is not switched on for (this one made up: doctor knows engines only from the document):
    one fix line for the engine, its six patches indented below it, a run of conditions' shared fix shown once."""
    import io

    from kvcached.node.ops.detectdoc import Condition, EngineSection, PatchReport, PatchStatus, Plugin
    from kvcached.node.ops.diagnostics import engine_results, healthy
    from kvctl.commands.doctor import _render
    from kvctl.render import Out

    enable = "export ACME_SWITCH=1 (Acme's own switch)"
    plugin = Plugin.of(enabled=False, allowed=True, allow_list_var="ACME_PLUGINS", allow_list=None, listed=[],
                       label="Acme", enable=enable)
    section = EngineSection(version="1.0", error=None, label="Acme", plugin=plugin,
                            patches=tuple(PatchReport(name=f"p{i}", status=PatchStatus.READY, reason="hooks it")
                                          for i in range(6)),
                            conditions=(Condition(name="c1", present=True, detail="leaks"),
                                        Condition(name="c2", present=True, detail="leaks too")))
    results = engine_results("acme", section, kvctl="kvctl --root /r")
    buf = io.StringIO()
    _render(Out(buf, styled=False, terminal=False), results, ok=healthy(results), strict=False)
    text = buf.getvalue()
    assert text.count(enable) == 1 and text.count("kvctl --root /r gc --yes") == 1, text
    lines = text.splitlines()
    assert lines[1].startswith("  warn acme ") and enable in lines[2]
    assert [ln.split()[1] for ln in lines[3:9]] == [f"acme-patch:p{i}" for i in range(6)]
    assert all(ln.startswith("    warn acme-patch:") for ln in lines[3:9])  # listed under the engine's line
    assert lines[9].startswith("    warn acme:c1") and lines[10].startswith("    warn acme:c2")
    assert "gc --yes" in lines[11] and lines[11].index("fix: ") == lines[2].index("fix: ")
    doc = [r.to_dict() for r in results]
    assert [c["name"] for c in doc if c["fix"] and enable in c["fix"]] == ["acme"]
    assert all(c["under"] == "acme" for c in doc[1:]) and doc[0]["under"] is None


def test_demo(root: str) -> None:
    r = kvctl("--root", root, "demo", "--json", timeout=120)
    doc = r.json("demo")
    assert r.code == 0 and doc["clean"] and doc["left"] == []
    dep = doc["inspect"]["deployments"][0]
    assert dep["name"] == doc["name"] and dep["state"] == "stale" and dep["processes"] == []
    assert {e["action"] for e in doc["gc"]["entries"]} == {"removed"}
    assert "clean:" in r.stderr and "[5]" in r.stderr
    assert os.listdir(os.path.join(root, "dev/shm")) == []
