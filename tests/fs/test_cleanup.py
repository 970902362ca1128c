"""The cleanup engine on real files, real sockets and real child processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

from kvcached.node.clean.cleanup import Action, execute, plan, run_cleanup
from kvcached.node.clean.decide import Policy, Reason, State
from kvcached.node.clean.rules import SharedReason
from kvcached.node.clean.scan import Kind
from kvcached.node.state.segment import create_segment
from kvcached.runtime.harness import start_deployment
from kvcached.runtime.ipc.client import ping

from ..waiting import wait_for
from .helpers import (
    backdate,
    cleanup_as,
    live_socket,
    stale_socket,
    start_upstream_listener,
    stop_one_kill_rest,
    upstream_request,
)

NOW_POLICY = Policy(grace=0)


def by_path(report) -> dict:
    return {e.path: e for e in report.entries}


def tree(root: str) -> list[str]:
    out = []
    for d, dirs, files in os.walk(root):
        out += [os.path.relpath(os.path.join(d, x), root) for x in dirs + files]
    return sorted(out)


def test_group_sigkill_leaves_state_that_cleanup_removes_completely(layout, uniq, deployments) -> None:
    dep = start_deployment(uniq, tp=2, pp=2, layout=layout)
    deployments.append(dep)
    assert len(tree(layout.tmp_dir)) == 6 and os.path.exists(layout.segment_path(uniq))
    dep.signal_group(signal.SIGKILL)
    dep.wait()
    dry = run_cleanup(layout, NOW_POLICY, dry_run=True)
    assert {e.state for e in dry.entries} == {State.STALE}
    assert len(dry.entries) == 7  # 4 sockets, pp1, the socket dir and the segment; nothing else
    assert len(tree(layout.tmp_dir)) == 6  # a dry run removes nothing
    real = run_cleanup(layout, NOW_POLICY)
    assert sorted(e.path for e in real.entries if e.action is Action.REMOVED) == \
        sorted(e.path for e in dry.entries if e.action is Action.WOULD_REMOVE)
    assert tree(layout.tmp_dir) == [] and os.listdir(layout.shm_dir) == []
    assert run_cleanup(layout, NOW_POLICY).entries == []


def test_grace_age_keeps_fresh_state(layout, uniq, deployments) -> None:
    dep = start_deployment(uniq, layout=layout)
    deployments.append(dep)
    dep.kill()
    report = run_cleanup(layout, Policy(grace=60))
    assert {e.state for e in report.entries} == {State.YOUNG}
    assert all(e.action is Action.KEPT for e in report.entries)


def test_sigstopped_worker_socket_is_kept(layout, uniq, deployments) -> None:
    dep = start_deployment(uniq, tp=2, layout=layout)
    deployments.append(dep)
    stopped = stop_one_kill_rest(dep)
    report = by_path(run_cleanup(layout, NOW_POLICY))
    kept = report[layout.socket_path(uniq, 1)]
    assert (kept.state, kept.action) == (State.LIVE, Action.KEPT)
    # The stopped worker still holds the directory lease: its dead peer's node is
    # covered by it, and the directory stays.
    for path in (layout.socket_path(uniq, 0), layout.socket_dir(uniq)):
        assert (report[path].state, report[path].decision.reason, report[path].action) == \
            (State.LIVE, Reason.LEASE_HELD, Action.KEPT)
    assert stopped in report[layout.socket_dir(uniq)].decision.pids
    os.kill(stopped, signal.SIGCONT)
    assert ping(layout.socket_path(uniq, 1))["pid"] == stopped


def test_live_deployment_untouched_and_answering(layout, uniq, deployments) -> None:
    dep = start_deployment(uniq, tp=2, pp=2, layout=layout)
    deployments.append(dep)
    before = tree(layout.tmp_dir)
    report = run_cleanup(layout, NOW_POLICY)
    assert {e.state for e in report.entries} == {State.LIVE}
    assert tree(layout.tmp_dir) == before
    for (stage, rank), pid in dep.worker_pids.items():
        assert ping(layout.socket_path(uniq, rank, stage))["pid"] == pid


def test_same_name_replacement_between_scan_and_act_is_kept(layout, uniq) -> None:
    path = layout.socket_path(uniq, 0)
    stale_socket(path)
    backdate(path)
    p = plan(layout, NOW_POLICY)
    assert p.decisions[path].state is State.STALE
    os.unlink(path)  # a successor does upstream's blind remove, then binds
    successor = live_socket(path)
    try:
        report = by_path(execute(p, dry_run=False))
        assert report[path].action is Action.KEPT and "replaced" in report[path].note
        assert os.path.exists(path)
        probe = socket.socket(socket.AF_UNIX)
        probe.connect(path)
        probe.close()
    finally:
        successor.close()


def test_directory_recreated_between_scan_and_act_is_kept(layout, uniq) -> None:
    path = layout.socket_path(uniq, 0)
    stale_socket(path)
    p = plan(layout, NOW_POLICY)
    os.unlink(path)
    os.rmdir(layout.socket_dir(uniq))
    stale_socket(path)  # a new directory (new inode) with a new node in it
    report = execute(p, dry_run=False)
    assert all(e.action is Action.KEPT for e in report.entries)
    assert os.path.exists(path)


def test_foreign_types_at_socket_paths_and_linked_segments_untouched(layout, uniq, tmp_path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"\x01" * 24)
    d0 = layout.socket_dir(uniq)
    os.makedirs(os.path.join(d0, "pp1"))
    os.mkfifo(layout.socket_path(uniq, 0))
    with open(layout.socket_path(uniq, 1), "w") as f:
        f.write("x")
    os.symlink(str(victim), layout.socket_path(uniq, 2))
    os.mkdir(layout.socket_path(uniq, 0, 1))
    seg_hard, seg_sym = f"{uniq}h", f"{uniq}s"
    os.link(victim, layout.segment_path(seg_hard))
    os.symlink(str(victim), layout.segment_path(seg_sym))
    segments = [layout.segment_path(seg_hard), layout.segment_path(seg_sym)]
    for p in [layout.socket_path(uniq, r) for r in range(3)] + segments:
        backdate(p)
    report = by_path(run_cleanup(layout, NOW_POLICY, names=[seg_hard, seg_sym]))
    expect = {
        layout.socket_path(uniq, 0): SharedReason.WRONG_TYPE,
        layout.socket_path(uniq, 1): SharedReason.WRONG_TYPE,
        layout.socket_path(uniq, 2): SharedReason.SYMLINK,
        layout.socket_path(uniq, 0, 1): SharedReason.WRONG_TYPE,
        layout.segment_path(seg_hard): SharedReason.HARD_LINKED,
        layout.segment_path(seg_sym): SharedReason.SYMLINK,
    }
    for path, reason in expect.items():
        assert (report[path].state, report[path].decision.reason, report[path].action) == (
            State.FOREIGN,
            reason,
            Action.KEPT,
        ), path
        assert os.path.lexists(path)
    assert victim.read_bytes() == b"\x01" * 24


def test_pgid_named_segment_when_its_group_is_newer_or_older(layout, tmp_path) -> None:
    """A PGID is reused: a newer group proves nothing, but may be a new serve of the same name.

    Newer and engine-like (a Python process): unknown, kept. Newer and not
    engine-like (/bin/sleep can load no kvcached): stale, pgid_reused. Older
    than the segment's last change: live.
    """
    for argv, expect in (
        ([sys.executable, "-c", "import time; time.sleep(60)"], (State.UNKNOWN, Reason.PGID_AMBIGUOUS)),
        (["sleep", "60"], (State.STALE, Reason.PGID_REUSED)),
    ):
        group = subprocess.Popen(argv, start_new_session=True)
        try:
            # Until exec has happened /proc shows the forked pytest, an engine-like process either way.
            cmdline = Path(f"/proc/{group.pid}/cmdline")
            wait_for(lambda tail=argv[-1].encode(), cmdline=cmdline: tail in cmdline.read_bytes())
            older = layout.segment_path(f"kvcached_vLLM_{group.pid}")
            create_segment(older, 1)
            backdate(older, 600)  # last changed long before this process group existed: PGID reused
            d = plan(layout, NOW_POLICY).decisions[older]
            assert (d.state, d.reason) == expect, argv
            os.utime(older)  # now changed after the group started: the group may own it
            d = plan(layout, NOW_POLICY).decisions[older]
            assert (d.state, d.reason, d.pids) == (State.LIVE, Reason.GROUP_ALIVE, (group.pid,))
        finally:
            group.kill()
            group.wait()
        d = plan(layout, NOW_POLICY).decisions[older]
        assert (d.state, d.reason) == (State.STALE, Reason.NO_OWNER)
        os.unlink(older)


def test_upstream_listener_survives_scan_and_dry_run(layout, uniq) -> None:
    path = layout.socket_path(uniq, 0)
    proc = start_upstream_listener(path)
    try:
        backdate(path)
        for _ in range(3):
            report = by_path(run_cleanup(layout, NOW_POLICY, dry_run=True))
            assert report[path].state is State.LIVE and report[path].decision.reason is SharedReason.LISTENING
        assert upstream_request(path)["status"] == "success"
        # The control: a bare connect does kill it, so the assertion above can fail.
        s = socket.socket(socket.AF_UNIX)
        s.connect(path)
        s.close()
        assert proc.stdout.readline().strip() == "listener thread died"
    finally:
        proc.kill()
        proc.wait()


def test_permission_denied_probe_keeps_node(layout, uniq, unpriv_user) -> None:
    path = layout.socket_path(uniq, 0)
    stale_socket(path)
    os.chmod(path, 0)  # even its owner may not connect: the probe gets EACCES
    for p in (path, os.path.dirname(path)):
        os.chown(p, unpriv_user.pw_uid, unpriv_user.pw_gid)
    os.chmod(os.path.dirname(path), 0o700)
    backdate(path)
    entries = cleanup_as(unpriv_user, layout.root)
    assert (entries[path]["state"], entries[path]["reason"]) == ("unknown", "bind_test_denied")
    assert os.path.lexists(path)


def test_other_users_entries_untouched_when_not_root(layout, uniq, unpriv_user) -> None:
    path = layout.socket_path(uniq, 0)
    stale_socket(path)
    seg = layout.segment_path(uniq)
    create_segment(seg, 1)
    for p in (path, seg):
        backdate(p)
    entries = cleanup_as(unpriv_user, layout.root)
    for p in (path, seg, layout.socket_dir(uniq)):
        assert entries[p]["state"] == "foreign" and entries[p]["action"] == "kept", entries[p]
        assert os.path.lexists(p)


def test_kind_and_name_filters(layout, uniq) -> None:
    a, b = f"{uniq}a", f"{uniq}b"
    for n in (a, b):
        stale_socket(layout.socket_path(n, 0))
        create_segment(layout.segment_path(n), 1)
    report = run_cleanup(layout, NOW_POLICY, globs=[f"{uniq}a"], kinds=[Kind.SEGMENT])
    assert [e.path for e in report.entries] == [layout.segment_path(a)]
    assert not os.path.exists(layout.segment_path(a)) and os.path.exists(layout.segment_path(b))
    assert os.path.exists(layout.socket_path(a, 0))


def test_time_limit_keeps_the_rest(layout, uniq) -> None:
    for r in range(4):
        stale_socket(layout.socket_path(uniq, r))
    report = execute(plan(layout, NOW_POLICY), dry_run=False, time_limit=1e-9)
    assert report.timed_out and all(e.action is Action.KEPT for e in report.entries)
    assert report.stale_remaining


def test_explicit_name_segment_found_by_mark_and_innocent_files_ignored(layout, uniq) -> None:
    ours, innocent = layout.segment_path(f"{uniq}m"), layout.segment_path(f"{uniq}i")
    create_segment(ours, 1)  # our runtime marks it: found with no socket dir and no process
    with open(innocent, "wb") as f:
        f.write(b"\0" * 24)  # same size and a valid name, but not ours to judge
    for p in (ours, innocent):
        backdate(p)
    report = run_cleanup(layout, NOW_POLICY)
    assert [(e.path, e.action) for e in report.entries] == [(ours, Action.REMOVED)]
    assert os.path.exists(innocent)


def test_segment_mapped_by_a_process_is_live(layout, uniq) -> None:
    path = layout.segment_path(uniq)
    create_segment(path, 1)
    backdate(path)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import mmap, os, sys
        fd = os.open({path!r}, os.O_RDWR)
        m = mmap.mmap(fd, 24)
        os.close(fd)  # mapped, not held open: only /proc/<pid>/maps shows it
        print("mapped", flush=True)
        sys.stdin.read()
    """),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "mapped"
        d = plan(layout, NOW_POLICY).decisions[path]
        assert (d.state, d.reason, d.pids) == (State.LIVE, SharedReason.HELD_OPEN, (holder.pid,))
    finally:
        holder.stdin.close()
        holder.wait(10)
    assert plan(layout, NOW_POLICY).decisions[path].state is State.STALE
