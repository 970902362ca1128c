"""kvctl and the engines' own leftovers: inspect, gc --engines, --kind, delete, doctor, metrics; the real kvctl.

Every family is planted live and dead (tests/fs/engine_plant.py: real files,
real processes that map or hold them, real listeners, dead and live creator
PIDs, young, symlinked, hard-linked, names that only look like one) on a
private root and on this machine's real /dev/shm and /tmp, and kvctl runs in
process (typer's CliRunner) and as the installed program. On the real node
the old entries are 30 days old and every run says `--min-age 29d`: other
suites running beside this one plant entries an hour old, and a gc of ours
must leave theirs alone (they are young to it).
"""

from __future__ import annotations

import os
import pty
import subprocess
from collections.abc import Callable

import pytest

from kvcached.node.base.layout import Layout
from kvcached.node.clean.decide import State
from kvcached.node.state.segment import create_segment

from ..fs.engine_plant import Children, Node, needs_whole_view, plant_matrix
from ..fs.helpers import backdate, stale_socket
from .conftest import KVCTL, Run, assert_one_line_error, invoke, kvctl

MONTH = 30 * 86400.0
AGE = ("--min-age", "29d")


@pytest.fixture(params=["cli-runner", "subprocess"])
def run(request: pytest.FixtureRequest) -> Callable[..., Run]:
    """kvctl in process, or the installed program."""
    return invoke if request.param == "cli-runner" else kvctl


def _by_path(doc: dict, key: str = "entries") -> dict[str, dict]:
    return {e["path"]: e for e in doc[key]}


@needs_whole_view
def test_plain_gc_removes_none_and_gc_engines_exactly_the_dead(engine_node: Node, children: Children,
                                                                run: Callable[..., Run]) -> None:
    want, planted = plant_matrix(engine_node, children, old=MONTH)
    root, private = engine_node.layout.root, engine_node.layout.root != "/"
    dead = {p for p, (state, _) in want.items() if state is State.STALE}
    plain = run("--root", root, "gc", "--yes", *AGE, "--json")
    doc = plain.json("gc")
    assert not set(planted) & set(_by_path(doc)), "plain gc reported an engine leftover"
    assert "engines" not in doc["summary"]
    assert all(os.path.lexists(p) for p in planted)
    if private:
        assert plain.code == 0
    dry = run("--root", root, "gc", "--engines", "--dry-run", *AGE, "--json")
    assert dry.code == 3, dry.stderr
    doc = dry.json("gc")
    seen = {p: e for p, e in _by_path(doc).items() if p in want}
    assert {p: (State(e["state"]), e["reason"]) for p, e in seen.items()} == want
    assert {p for p, e in seen.items() if e["action"] == "would_remove"} == dead
    assert all(os.path.lexists(p) for p in planted)
    assert doc["summary"]["engines"]["states"]["stale"] >= len(dead)
    assert doc["summary"]["entries"] == len(doc["entries"])
    done = run("--root", root, "gc", "--engines", "--yes", *AGE, "--json")
    doc = done.json("gc")
    removed = {p for p, e in _by_path(doc).items() if p in want and e["action"] == "removed"}
    assert removed == dead
    assert {p for p in planted if not os.path.lexists(p)} == dead
    mine = [e for e in doc["entries"] if e["path"] in dead]
    assert all(e["engine"] in ("vllm", "sglang", "nccl", "cuda", "torch", "python") and e["bytes"] >= 0 for e in mine)
    assert doc["summary"]["engines"]["removed_bytes"] >= sum(e["bytes"] for e in mine)
    if private:
        assert done.code == 0, done.stdout
        again = run("--root", root, "gc", "--engines", "--yes", *AGE, "--json")
        assert again.code == 0 and not dead & set(_by_path(again.json("gc")))


@needs_whole_view
def test_inspect_shows_them_in_their_own_section(engine_node: Node, children: Children,
                                                 run: Callable[..., Run]) -> None:
    want, planted = plant_matrix(engine_node, children, old=MONTH)
    root = engine_node.layout.root
    doc = run("--root", root, "inspect", *AGE, "--json").json("inspect")
    state = {p: e for p, e in _by_path(doc, "engine_state").items() if p in want}
    assert {p: (State(e["state"]), e["reason"]) for p, e in state.items()} == want
    assert {e["action"] for p, e in state.items() if want[p][0] is State.STALE} == {"would_remove"}
    assert not set(planted) & {e["path"] for d in doc["deployments"] for e in d["entries"]}
    assert not set(planted) & {e["path"] for e in doc["unowned"]}
    assert all(os.path.lexists(p) for p in planted)  # inspect touches nothing
    text = run("--root", root, "inspect", *AGE)
    assert text.code == 0
    section = text.stdout.split("Engine leftovers (", 1)[1]
    for path in want:
        assert path in section
    assert "gc --engines --yes" in section


def test_names_select_deployments_so_inspect_shows_no_engine_section(layout: Layout, uniq: str) -> None:
    n = Node(layout)
    n.file("psm_0a1b2c3d", age=MONTH)
    create_segment(layout.segment_path(uniq), 1 << 20)
    doc = invoke("--root", layout.root, "inspect", uniq, "--json").json("inspect")
    assert doc["engine_state"] == [] and [d["name"] for d in doc["deployments"]] == [uniq]
    assert "Engine leftovers" not in invoke("--root", layout.root, "inspect", uniq).stdout


def _plant_both(layout: Layout, uniq: str) -> tuple[str, str, str]:
    """A dead kvcached deployment's segment, a dead NCCL buffer and a dead vLLM buffer, all old."""
    seg = layout.segment_path(f"{uniq}dead")
    create_segment(seg, 1 << 20)
    stale_socket(layout.socket_path(f"{uniq}dead", 0))
    for p in (layout.socket_path(f"{uniq}dead", 0), layout.socket_dir(f"{uniq}dead"), seg):
        backdate(p)
    os.chmod(layout.socket_dir(f"{uniq}dead"), 0o700)
    n = Node(layout)
    return seg, n.file("nccl-Ab3dE9", nbytes=65536), n.file("psm_0a1b2c3d")


@needs_whole_view
def test_kind_takes_engine_kinds_and_keeps_to_them(layout: Layout, uniq: str) -> None:
    seg, nccl, psm = _plant_both(layout, uniq)
    r = invoke("--root", layout.root, "gc", "--kind", "nccl-shm", "--yes", "--json")
    doc = r.json("gc")
    assert r.code == 0 and [e["path"] for e in doc["entries"]] == [nccl]
    assert not os.path.exists(nccl) and os.path.exists(psm) and os.path.exists(seg)
    r = invoke("--root", layout.root, "gc", "--engines", "--kind", "segment", "--yes", "--json")
    assert r.code == 0 and {e["kind"] for e in r.json("gc")["entries"]} == {"segment"}
    assert os.path.exists(psm) and not os.path.exists(seg)
    r = invoke("--root", layout.root, "gc", "--kind", "socket", "--kind", "vllm-shm", "--yes", "--json")
    assert r.code == 0 and {e["kind"] for e in r.json("gc")["entries"]} == {"socket", "directory", "vllm-shm"}
    assert not os.path.exists(psm)


def test_kind_rejects_what_is_no_kind(layout: Layout) -> None:
    r = kvctl("--root", layout.root, "gc", "--kind", "psm", "--dry-run")
    assert r.code == 2 and "vllm-shm" in r.stderr


def test_engine_leftovers_take_no_deployment_name(layout: Layout) -> None:
    for args in (["--engines"], ["--kind", "cuda-shm"]):
        assert_one_line_error(kvctl("--root", layout.root, "gc", *args, "--yes", "some-serve"), 2)
    doc = invoke("--root", layout.root, "gc", "--engines", "--yes", "some-serve", "--json").json("error")
    assert doc["error"]["name"] == "usage"


@needs_whole_view
def test_delete_refuses_engine_leftovers(layout: Layout) -> None:
    n = Node(layout)
    psm, cuda = n.file("psm_0a1b2c3d", age=MONTH), n.file("cuda.shm.0.1a2b.3", age=MONTH)
    for name in ("psm_0a1b2c3d", "cuda.shm.0.1a2b.3", "nccl-Zz9yY8"):
        r = kvctl("--root", layout.root, "delete", name, "--yes")
        assert_one_line_error(r, 7)
        assert "delete does not take engine leftovers" in r.stderr and "gc --engines --kind" in r.stderr
    assert os.path.exists(psm) and os.path.exists(cuda)
    # A kvcached deployment may well carry such a name (an explicit KVCACHED_IPC_NAME): that one delete takes.
    create_segment(layout.segment_path("psm_1a2b3c4d"), 1 << 20)
    backdate(layout.segment_path("psm_1a2b3c4d"))
    assert kvctl("--root", layout.root, "delete", "psm_1a2b3c4d", "--yes").code == 0


@needs_whole_view
def test_doctor_warns_with_count_bytes_and_the_fix(layout: Layout, uniq: str) -> None:
    _, nccl, psm = _plant_both(layout, uniq)
    held = sum(os.stat(p).st_blocks * 512 for p in (nccl, psm))
    r = invoke("--root", layout.root, "doctor", "engine-leftovers", "--json")
    (check,) = r.json("doctor")["checks"]
    assert check["status"] == "warn" and check["group"] == "node"
    assert check["summary"].startswith("2 dead entries left by the engines (1 nccl, 1 vllm)")
    assert check["details"]["bytes"] == held
    assert check["fix"] == f"kvctl --root {layout.root} gc --engines --yes"
    assert invoke("--root", layout.root, "gc", "--engines", "--yes").code == 0
    (check,) = invoke("--root", layout.root, "doctor", "engine-leftovers", "--json").json("doctor")["checks"]
    assert check["status"] == "ok" and check["fix"] is None


@needs_whole_view
def test_metrics_by_engine_and_state_only_when_engines_are_judged(layout: Layout, uniq: str, tmp_path) -> None:
    _, nccl, psm = _plant_both(layout, uniq)
    prom = tmp_path / "kvctl.prom"
    assert invoke("--root", layout.root, "gc", "--yes", "--prometheus", str(prom)).code == 0
    assert "engine" not in prom.read_text()  # plain gc: none written (not zeros: nobody looked)
    nccl_bytes = os.stat(nccl).st_blocks * 512
    assert invoke("--root", layout.root, "gc", "--engines", "--dry-run", "--prometheus", str(prom)).code == 3
    text = prom.read_text()
    assert 'kvctl_gc_engine_entries{engine="nccl",state="stale"} 1' in text
    assert f'kvctl_gc_engine_bytes{{engine="nccl",state="stale"}} {nccl_bytes}' in text
    assert 'kvctl_gc_engine_stale_entries{engine="vllm"} 1' in text
    assert invoke("--root", layout.root, "gc", "--engines", "--yes", "--prometheus", str(prom)).code == 0
    text = prom.read_text()
    assert f'kvctl_gc_engine_removed_bytes{{engine="nccl"}} {nccl_bytes}' in text
    assert 'kvctl_gc_engine_stale_entries{engine="vllm"} 0' in text


@needs_whole_view
def test_text_report_and_cron_log_name_the_engine_leftovers(layout: Layout, uniq: str) -> None:
    _, nccl, _ = _plant_both(layout, uniq)
    r = kvctl("--root", layout.root, "gc", "--engines", "--dry-run")
    assert r.code == 3
    assert "ENGINE" in r.stdout and nccl in r.stdout and "engine leftovers: would remove 2" in r.stdout
    r = kvctl("--root", layout.root, "gc", "--engines", "--yes")
    assert r.code == 0
    assert "kvctl gc: engine leftovers: removed 2" in r.stderr  # the log line cron keeps


def test_not_confirmed_off_a_terminal_removes_nothing_and_names_the_flags(layout: Layout, uniq: str) -> None:
    _, nccl, psm = _plant_both(layout, uniq)
    r = kvctl("--root", layout.root, "gc", "--engines")
    assert r.code == 3 and "gc --engines --yes" in r.stderr
    assert os.path.exists(nccl) and os.path.exists(psm)


@needs_whole_view
def test_plain_gc_on_a_terminal_counts_engine_names_and_names_the_flag(layout: Layout, uniq: str) -> None:
    """The count is by name alone (no /proc, no maps): live and dead ones alike, kvcached's own segments not."""
    _plant_both(layout, uniq)
    create_segment(layout.segment_path("psm_1a2b3c4d"), 1 << 20)  # a deployment's, named like a buffer
    stale_socket(layout.socket_path("psm_1a2b3c4d", 0))
    err = _stderr_on_a_terminal(["--root", layout.root, "gc", "--dry-run"])
    assert "2 entries here carry an engine's name" in err and f"kvctl --root {layout.root} gc --engines" in err
    assert "carry an engine's name" not in kvctl("--root", layout.root, "gc", "--dry-run").stderr  # cron


def _stderr_on_a_terminal(args: list[str]) -> str:
    """kvctl with its stderr on a pseudo-terminal (stdout a pipe), as an operator's shell gives it."""
    leader, follower = pty.openpty()
    try:
        p = subprocess.run([KVCTL, *args], stdout=subprocess.PIPE, stderr=follower, stdin=subprocess.DEVNULL,
                           timeout=60, env={**os.environ, "NO_COLOR": "1"})
        os.close(follower)
        follower = -1
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the writer is gone and everything was read
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert p.returncode in (0, 3), p
        return b"".join(chunks).decode()
    finally:
        if follower >= 0:
            os.close(follower)
        os.close(leader)
