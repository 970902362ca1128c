"""gc end to end on real local deployments (harness: api + engine + TP×PP workers in their own group)."""

from __future__ import annotations

import os
import signal
import subprocess

from kvcached.node.state.gclock import GcLock
from kvcached.runtime.harness import start_deployment
from kvcached.runtime.ipc.client import ping

from ..waiting import wait_until
from .conftest import KVCTL, Run, assert_one_line_error, kvctl


def tree(root: str) -> set[str]:
    out = set()
    for d, dirs, files in os.walk(root):
        out |= {os.path.join(d, x) for x in dirs + files}
    return out


def state_of(layout, name: str) -> set[str]:
    """Every path deployment `name` left: its segment and its socket directory tree."""
    sock = layout.socket_dir(name)
    paths = {p for p in tree(layout.root) if p == sock or p.startswith(sock + "/")}
    if os.path.exists(layout.segment_path(name)):
        paths.add(layout.segment_path(name))
    return paths


def gc(layout, *args: str) -> Run:
    return kvctl("--root", layout.root, "gc", "--min-age", "0", *args)


def paths(doc: dict, action: str) -> set[str]:
    return {e["path"] for e in doc["entries"] if e["action"] == action}


def test_gc_removes_exactly_the_dead_and_never_touches_the_live(layout, uniq: str, deployments) -> None:
    live = start_deployment(f"{uniq}live", 2, 2, layout=layout)
    deployments.append(live)
    dead = [start_deployment(f"{uniq}dead{i}", tp, pp, layout=layout) for i, (tp, pp) in enumerate([(2, 2), (1, 1)])]
    for d in dead:
        d.kill()  # SIGKILL to every process: nothing of theirs cleans up
    expected = set().union(*(state_of(layout, d.name) for d in dead))
    live_paths = state_of(layout, live.name)
    assert len(expected) == 7 + 3 and len(live_paths) == 7

    before = tree(layout.root)
    plan = gc(layout, "--dry-run", "--json")
    assert plan.code == 3  # stale entries remain after a dry run
    plan_doc = plan.json("gc")
    assert plan_doc["dry_run"] is True and tree(layout.root) == before
    assert paths(plan_doc, "would_remove") == expected
    assert {e["path"] for e in plan_doc["entries"] if e["state"] == "live"} == live_paths

    done = gc(layout, "--yes", "--json")
    doc = done.json("gc")
    assert done.code == 0 and doc["dry_run"] is False
    assert paths(doc, "removed") == paths(plan_doc, "would_remove")  # the dry run was the plan
    assert paths(doc, "failed") == set()
    assert tree(layout.root) - {os.path.join(layout.tmp_dir, "kvctl-gc.lock")} == before - expected
    for (stage, rank), pid in live.worker_pids.items():  # still serving, not just present
        assert ping(layout.socket_path(live.name, rank, stage))["pid"] == pid

    again = gc(layout, "--yes", "--json")
    doc = again.json("gc")
    assert again.code == 0 and paths(doc, "removed") == set() and doc["summary"]["states"]["stale"] == 0


def test_gc_time_limit_keeps_the_rest(layout, uniq: str) -> None:
    d = start_deployment(f"{uniq}t", 2, 1, layout=layout)
    d.kill()
    r = gc(layout, "--yes", "--time-limit", "0.000001", "--json")
    doc = r.json("gc")
    assert r.code == 3 and doc["summary"]["timed_out"] is True
    assert all(e["action"] == "kept" for e in doc["entries"])
    assert gc(layout, "--yes").code == 0 and state_of(layout, d.name) == set()


def test_a_second_gc_waits_for_nobody_and_says_so(layout, uniq: str, tmp_path) -> None:
    d = start_deployment(f"{uniq}l", 1, 1, layout=layout)
    d.kill()
    prom = tmp_path / "gc.prom"
    with GcLock(layout):
        r = gc(layout, "--yes", "--prometheus", str(prom))
        assert_one_line_error(r, 5)
        assert f"PID {os.getpid()}" in r.stderr
        assert "kvctl_gc_lock_busy 1" in prom.read_text()
        assert state_of(layout, d.name)  # nothing removed while another gc runs
        assert gc(layout, "--dry-run").code == 3  # a dry run changes nothing and needs no lock
    assert gc(layout, "--yes").code == 0 and state_of(layout, d.name) == set()


def test_two_gc_at_once_do_not_interfere(layout, uniq: str) -> None:
    dead = [start_deployment(f"{uniq}c{i}", 2, 2, layout=layout) for i in range(3)]
    for d in dead:
        d.kill()
    expected = set().union(*(state_of(layout, d.name) for d in dead))
    args = [KVCTL, "--root", layout.root, "gc", "--min-age", "0", "--yes", "--json"]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(60), *p.communicate()) for p in procs]
    codes = sorted(code for code, _, _ in results)
    assert codes in ([0, 0], [0, 5]), results
    removed: set[str] = set()
    for code, out, err in results:
        if code == 0:
            doc = Run(code, out, err).json("gc")
            assert paths(doc, "failed") == set()
            removed |= paths(doc, "removed")
        else:
            assert err.startswith("kvctl: another kvctl gc is running")
    assert removed == expected and tree(layout.root) & expected == set()


def test_orphaned_workers_are_reported_and_killed_only_on_request(layout, uniq: str, deployments) -> None:
    dep = start_deployment(f"{uniq}o", 2, 1, layout=layout)
    deployments.append(dep)
    os.kill(dep.engine_pid, signal.SIGKILL)  # the engine dies; its workers live on, reparented
    dep.api.wait(10)
    workers = sorted(dep.worker_pids.values())
    docs = []

    def orphans_shown() -> bool:
        docs.append(kvctl("--root", layout.root, "inspect", "--json").json("inspect"))
        return sorted(docs[-1]["deployments"][0]["orphans"]) == workers

    wait_until(orphans_shown, 60, interval=0.1)
    doc = docs[-1]
    procs = {p["pid"]: p for p in doc["deployments"][0]["processes"]}
    assert sorted(doc["deployments"][0]["orphans"]) == workers
    assert all("engine is gone" in procs[w]["orphan_reason"] for w in workers)

    r = gc(layout, "--yes")
    assert r.code == 0 and f"kvctl --root {layout.root} gc --kill-orphans --min-age 0 terminates it" in r.stdout
    assert all(ping(layout.socket_path(dep.name, rank, stage)) for stage, rank in dep.worker_pids)

    r = gc(layout, "--yes", "--kill-orphans", "--json")
    doc = r.json("gc")
    assert r.code == 0, r.stderr
    assert sorted(k["pid"] for k in doc["killed"]) == workers
    assert {k["outcome"] for k in doc["killed"]} <= {"terminated", "killed"}
    assert state_of(layout, dep.name) == set()
    for pid in workers:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split(") ")[1][0] in "ZX"
