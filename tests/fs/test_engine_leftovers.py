"""Engine leftovers planted live and dead, on a private root and on the real /dev/shm and /tmp.

Real files, real child processes that map (fd closed) or hold (never mapped)
them, real bound Unix sockets, real dead and reused PIDs. The engine plan
removes exactly the dead ones; kvcached's plain plan sees and removes none.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import time

import jsonschema
import pytest

from kvcached.node.base.layout import Layout
from kvcached.node.clean import cleanup
from kvcached.node.clean.cleanup import Action, execute
from kvcached.node.clean.decide import Policy, State
from kvcached.node.clean.facts import START_SLACK
from kvcached.node.clean.leftovers.act import plan_engines
from kvcached.node.clean.leftovers.decide import EngineReason
from kvcached.node.clean.leftovers.families import EngineKind
from kvcached.node.clean.rules import SharedReason

from .engine_plant import (
    OLD,
    SCHEMA,
    SLEEPER,
    Children,
    Node,
    assert_plain_gc_ignores,
    backdate,
    by_path,
    engine_plan,
    names_of,
    needs_whole_view,
    plant_matrix,
)
from .engine_plant import READY_THEN_WAIT as _READY_THEN_WAIT
from .helpers import live_socket, run_as


@needs_whole_view
def test_the_engine_plan_removes_exactly_the_dead_ones(engine_node: Node, children: Children) -> None:
    want, planted = plant_matrix(engine_node, children)
    p = engine_plan(engine_node, planted)
    assert by_path(p) == want
    dead = {path for path, (state, _) in want.items() if state is State.STALE}
    dry = execute(p, dry_run=True)
    assert {e.candidate.path for e in dry.entries if e.action is Action.WOULD_REMOVE} == dead
    assert all(os.path.lexists(x) for x in planted)
    for e in dry.entries:
        jsonschema.validate(e.to_dict(), SCHEMA)
    assert_plain_gc_ignores(engine_node, planted)
    report = execute(p, dry_run=False)
    assert {e.candidate.path for e in report.entries if e.action is Action.REMOVED} == dead
    assert not report.failures
    assert {x for x in planted if not os.path.lexists(x)} == dead
    for e in report.entries:
        jsonschema.validate(e.to_dict(), SCHEMA)
    assert report.count(action=Action.REMOVED) == len(dead)
    assert report.bytes(action=Action.REMOVED) == sum(e.bytes for e in report.entries if e.candidate.path in dead)
    again = engine_plan(engine_node, planted)
    assert {c.path for c, _ in again.entries()} == set(want) - dead


@needs_whole_view
def test_a_pid_reused_by_a_later_process_is_no_creator(engine_node: Node, children: Children) -> None:
    """The file's PID now belongs to a process that started after the file last changed (its ctime)."""
    if os.geteuid() != 0 or not os.access("/proc/sys/kernel/ns_last_pid", os.W_OK):
        pytest.skip("choosing the next PID (/proc/sys/kernel/ns_last_pid) needs root in the initial PID namespace")
    pid = children.dead_pid()
    path = engine_node.file(engine_node.fresh(engine_node.shm, f"sgl_shm_reuse_{pid}_{{hex8}}"))
    # /proc's start times come from a whole-second boot time, up to a second early: wait past the slack
    # twice, so that a process started now is seen to start after the file's ctime.
    time.sleep(2 * START_SLACK + 0.3)
    later = _spawn_at(children, pid)
    assert later is not None, f"could not start a process as PID {pid}: the machine forks too fast"
    ((_, dec),) = engine_plan(engine_node, [path]).entries()
    assert (dec.state, dec.reason) == (State.STALE, EngineReason.PID_REUSED), dec
    assert later.poll() is None
    assert f"PID {pid}" in dec.detail


def _spawn_at(kids: Children, pid: int) -> subprocess.Popen[str] | None:
    for _ in range(200):
        if os.path.exists(f"/proc/{pid}"):
            return None
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        p = kids.spawn(SLEEPER)
        if p.pid == pid:
            return p
        p.kill()
        p.wait()
    return None


def test_sizes_are_the_memory_held_not_the_apparent_size(engine_node: Node) -> None:
    path = engine_node.file(engine_node.fresh(engine_node.shm, "vllm_mm_" + "B" * 14 + "{hex8}"), nbytes=4096)
    os.truncate(path, 1 << 30)  # what vLLM's 250 MB buffers look like before anything is written
    backdate(path, OLD)
    (c, _), = engine_plan(engine_node, [path]).entries()
    st = os.stat(path)
    assert c.size == 1 << 30
    assert c.allocated == st.st_blocks * 512 < 1 << 20
    assert execute(engine_plan(engine_node, [path]), dry_run=True).entries[0].to_dict()["bytes"] == c.allocated


@needs_whole_view
def test_identity_is_rechecked_at_removal(engine_node: Node) -> None:
    """A successor made a new file of the same name between plan and act: it is not what was decided on."""
    path = engine_node.file(engine_node.fresh(engine_node.shm, "nccl-{alnum6}"))
    p = engine_plan(engine_node, [path])
    os.unlink(path)
    os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
    (e,) = execute(p, dry_run=False).entries
    assert (e.action, e.note) == (Action.KEPT, "replaced since the scan")
    assert os.path.exists(path)


@needs_whole_view
def test_owner_is_rechecked_at_removal(engine_node: Node, unpriv_user) -> None:  # type: ignore[no-untyped-def]
    path = engine_node.file(engine_node.fresh(engine_node.shm, "nccl-{alnum6}"))
    sock = engine_node.socket(engine_node.fresh(engine_node.tmp, "{uuid}"))
    p = engine_plan(engine_node, [path, sock])
    os.chown(path, unpriv_user.pw_uid, -1)
    os.chown(sock, unpriv_user.pw_uid, -1, follow_symlinks=False)
    for e in execute(p, dry_run=False).entries:
        assert e.action is Action.KEPT and "changed owner" in e.note, e
    assert os.path.exists(path) and os.path.lexists(sock)


@needs_whole_view
def test_a_lock_taken_since_the_scan_keeps_it(engine_node: Node, children: Children) -> None:
    path = engine_node.file(engine_node.fresh(engine_node.shm, "sglang_loads_t_{hex8}.shm"))
    p = engine_plan(engine_node, [path])
    children.spawn("import fcntl, os, sys\nfd = os.open(sys.argv[1], os.O_RDONLY)\nfcntl.flock(fd, fcntl.LOCK_SH)\n"
                   + _READY_THEN_WAIT, path)
    (e,) = execute(p, dry_run=False).entries
    assert (e.action, e.note) == (Action.KEPT, "locked by a process since the scan")
    assert os.path.exists(path)


@needs_whole_view
def test_the_time_limit_keeps_what_it_did_not_reach(engine_node: Node) -> None:
    # Not psm_ names: the test session's own sweep of vLLM's buffers (tests/conftest.py) runs in every
    # concurrent suite, and removes unused psm_ files that appeared during it, ours included.
    paths = [engine_node.file(engine_node.fresh(engine_node.shm, "nccl-{alnum6}")) for _ in range(3)]
    p = engine_plan(engine_node, paths)
    time.sleep(0.01)
    report = execute(p, dry_run=False, time_limit=1e-9)
    assert report.timed_out
    assert {e.note for e in report.entries} == {"time limit reached"}
    assert all(os.path.exists(x) for x in paths)


@needs_whole_view
def test_another_users_entries_as_root_and_as_that_user(engine_node: Node, unpriv_user) -> None:  # type: ignore[no-untyped-def]
    """Root decides and removes another user's dead entries; that user keeps root's as foreign, removes its own."""
    uid = unpriv_user.pw_uid
    mine = engine_node.file(engine_node.fresh(engine_node.shm, "vllm_mm_" + "B" * 14 + "{hex8}"))
    theirs = engine_node.file(engine_node.fresh(engine_node.shm, "vllm_mm_" + "B" * 14 + "{hex8}"))
    theirs_too = engine_node.file(engine_node.fresh(engine_node.shm, "vllm_mm_" + "B" * 14 + "{hex8}"))
    their_sock = engine_node.socket(engine_node.fresh(engine_node.tmp, "{uuid}"))
    for x in (theirs, theirs_too, their_sock):
        os.chown(x, uid, -1, follow_symlinks=False)
    as_user = _run_as(unpriv_user, engine_node.layout.root, [mine, theirs, their_sock])
    assert as_user[mine][:2] == ["foreign", "other_user"]
    assert as_user[theirs][:2] == ["stale", "unused"] and as_user[theirs][2] == "removed"
    assert as_user[their_sock][:3] == ["stale", "not_listening", "removed"]
    assert os.path.exists(mine) and not os.path.exists(theirs) and not os.path.lexists(their_sock)
    (e,) = execute(engine_plan(engine_node, [theirs_too]), dry_run=False).entries
    assert (e.state, e.action) == (State.STALE, Action.REMOVED)
    assert_plain_gc_ignores(engine_node, [mine])


_AS_USER = r"""
import json, sys
from kvcached.node.clean.decide import Policy
from kvcached.node.clean.cleanup import execute
from kvcached.node.clean.leftovers.act import plan_engines
from kvcached.node.base.layout import Layout
names = [p.rsplit("/", 1)[1] for p in sys.argv[2:]]
report = execute(plan_engines(Layout(sys.argv[1]), Policy(grace=60), names=names), dry_run=False)
print(json.dumps({e.candidate.path: [str(e.state), str(e.decision.reason), str(e.action)] for e in report.entries}))
"""


def _run_as(user, root: str, paths: list[str]) -> dict[str, list[str]]:  # type: ignore[no-untyped-def]
    r = run_as(user, _AS_USER, root, *paths)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_vllm_rpc_base_path_is_scanned_too(layout: Layout) -> None:
    n = Node(layout)
    base = os.path.join(layout.root, "rpc")
    os.mkdir(base)
    try:
        dead = n.socket(n.fresh(base, "{uuid}"), directory=base)
        p = engine_plan(n, [dead], rpc_dirs=[base])
        assert by_path(p) == {dead: (State.STALE, SharedReason.NOT_LISTENING)}
        assert execute(p, dry_run=False).entries[0].action is Action.REMOVED
    finally:
        n.cleanup()
        shutil.rmtree(base, ignore_errors=True)


def test_an_rpc_directory_that_is_a_symlink_is_not_followed(layout: Layout) -> None:
    n = Node(layout)
    real = os.path.join(layout.root, "rpc-real")
    os.mkdir(real)
    link = os.path.join(layout.root, "rpc-link")
    os.symlink(real, link)
    dead = n.socket(n.fresh(real, "{uuid}"), directory=real)
    p = engine_plan(n, [dead], rpc_dirs=[link])
    assert not p.entries()
    assert any("symbolic link" in e for e in p.errors)
    assert os.path.lexists(dead)


def test_kinds_filter_after_deciding(engine_node: Node) -> None:
    a = engine_node.file(engine_node.fresh(engine_node.shm, "vllm_mm_" + "B" * 14 + "{hex8}"))
    b = engine_node.file(engine_node.fresh(engine_node.shm, "nccl-{alnum6}"))
    p = plan_engines(engine_node.layout, Policy(grace=60), names=names_of([a, b]), kinds=[EngineKind.NCCL_SHM])
    assert [c.path for c, _ in p.entries()] == [b]
    assert p.matched >= 2


@needs_whole_view
def test_kvcached_segments_named_like_engine_buffers_stay_plain_gcs(layout: Layout) -> None:
    """An explicit KVCACHED_IPC_NAME may read like psm_…: kvcached's own scan judges it, never the engine pass.

    (An upstream segment is never mapped or held between accesses: as an engine buffer it would look unused.)
    """
    n = Node(layout)
    named = n.file("psm_0a1b2c3d", nbytes=0)  # a deployment's segment: its socket directory names it
    serving = live_socket(layout.socket_path("psm_0a1b2c3d", 0))
    shaped = n.file("psm_1a2b3c4d", nbytes=0)  # upstream's shape: 24 bytes, a positive limit, nothing names it
    with open(shaped, "r+b") as f:
        f.write(struct.pack("=qqq", 1 << 30, 0, 0))
    backdate(shaped, OLD)
    buffer = n.file("psm_2a3b4c5d", nbytes=0)  # 24 bytes but no limit: an engine's
    os.truncate(buffer, 24)
    backdate(buffer, OLD)
    try:
        p = engine_plan(n, [named, shaped, buffer])
        assert by_path(p) == {buffer: (State.STALE, EngineReason.UNUSED)}
        plain = {c.path: d for c, d in cleanup.plan(layout, Policy(grace=60)).entries()}
        assert plain[named].state is State.LIVE
        assert plain[shaped].state is State.UNKNOWN
        assert buffer not in plain
    finally:
        serving.close()
        n.cleanup()


@needs_whole_view
def test_a_directory_swapped_since_the_scan_is_never_acted_in(layout: Layout) -> None:
    """/dev/shm replaced under its path (a remount, a planted tree) between plan and act: nothing is removed."""
    n = Node(layout)
    path = n.file("nccl-Ab3dE9")
    p = engine_plan(n, [path])
    os.rename(layout.shm_dir, layout.shm_dir + ".old")
    os.mkdir(layout.shm_dir)
    os.rename(layout.shm_dir + ".old/nccl-Ab3dE9", path)  # the very file, now in another directory
    (e,) = execute(p, dry_run=False).entries
    assert (e.action, e.note) == (Action.KEPT, f"{layout.shm_dir} replaced since the scan")
    assert os.path.exists(path)
