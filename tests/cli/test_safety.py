"""Issue 10 §3-§7: what kvctl writes or locks cannot be turned against it, nothing waits long, every stale
entry stays reachable, and machine output exists on every path."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import time

import pytest

from kvcached.node.state.gclock import GcLock
from kvcached.node.state.segment import create_segment, read_segment, write_segment

from ..fs.helpers import backdate, stale_socket
from ..waiting import wait_until
from .conftest import KVCTL, Run, assert_one_line_error, invoke, kvctl


def dead_deployment(layout, name: str, ranks: int = 2, seconds: float = 600) -> list[str]:
    """What a SIGKILLed serve leaves: segment, directory, socket nodes nobody is bound to; all old."""
    paths = [layout.segment_path(name)]
    create_segment(paths[0], 1 << 30)
    for r in range(ranks):
        path = layout.socket_path(name, r)
        stale_socket(path)
        paths.append(path)
    os.chmod(layout.socket_dir(name), 0o700)
    for p in reversed(paths[1:]):
        backdate(p, seconds)
    backdate(layout.socket_dir(name), seconds)
    backdate(paths[0], seconds)
    return [paths[0], layout.socket_dir(name), *paths[1:]]


def leftovers(layout) -> list[str]:
    return sorted(os.path.join(dp, n) for top in (layout.tmp_dir, layout.shm_dir)
                  for dp, dn, fn in os.walk(top) for n in dn + fn if not n.startswith("kvctl-gc.lock"))


def lock_env(layout) -> dict[str, str]:
    return {"KVCTL_LOCK": os.path.join(layout.root, "gc.lock")}


# §3 -----------------------------------------------------------------------------------

@pytest.mark.skipif(os.geteuid() != 0, reason="making a character device needs root")
def test_prometheus_never_replaces_a_device_or_fifo(layout, uniq) -> None:
    dev = os.path.join(layout.root, "null")
    os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    fifo = os.path.join(layout.root, "fifo")
    os.mkfifo(fifo)
    dead_deployment(layout, f"{uniq}d")
    for target, kind in ((dev, "a character device"), (fifo, "a FIFO"), (layout.root, "a directory")):
        r = kvctl("--root", layout.root, "gc", "--yes", "--prometheus", target, env=lock_env(layout))
        assert_one_line_error(r, 1)
        assert target in r.stderr and ".tmp" not in r.stderr, r.stderr
        assert f"is {kind}, not a regular file" in r.stderr, r.stderr
    assert stat.S_ISCHR(os.lstat(dev).st_mode) and stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert leftovers(layout), "a refused run must not have removed anything"


def test_prometheus_errors_name_the_target(layout, tmp_path) -> None:
    """Issue 38 made a metrics file that cannot be written a report, not a condition: the plan comes first, then
    one line naming the target (and its missing directory), exit 9 (tests/cli/test_metrics_report.py)."""
    target = os.path.join(str(tmp_path), "no-such-dir", "kvctl.prom")
    r = kvctl("--root", layout.root, "gc", "--dry-run", "--prometheus", target)
    assert r.code == 9 and "gc: would remove 0, kept 0" in r.stdout, (r.code, r.stdout, r.stderr)
    (line,) = r.stderr.strip().splitlines()
    assert target in line and ".tmp" not in line and "does not exist" in line, line


def test_a_fifo_at_the_lock_path_does_not_hang_gc(layout) -> None:
    lock = os.path.join(layout.root, "gc.lock")
    os.mkfifo(lock)
    r = kvctl("--root", layout.root, "gc", "--yes", env={"KVCTL_LOCK": lock}, timeout=30)
    assert_one_line_error(r, 1)
    assert "not a regular file" in r.stderr and "rm -- " in r.stderr


def test_a_lock_file_planted_and_held_by_another_user_is_refused_not_busy(layout, unpriv_user) -> None:
    lock = os.path.join(layout.tmp_dir, "planted.lock")
    holder = subprocess.Popen(
        ["runuser", "-u", unpriv_user.pw_name, "--", "/usr/bin/python3", "-c",
         "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY | os.O_CREAT, 0o644); "
         "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()", lock],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        r = kvctl("--root", layout.root, "gc", "--yes", env={"KVCTL_LOCK": lock})
        assert_one_line_error(r, 1)
        assert f"owned by uid {unpriv_user.pw_uid}" in r.stderr and "KVCTL_LOCK" in r.stderr
    finally:
        holder.kill()
        holder.wait()


def _metric(path: str, name: str) -> dict[str, float]:
    out = {}
    with open(path) as f:
        for line in f:
            if line.startswith(name):
                key, value = line.rsplit(" ", 1)
                out[key] = float(value)
    return out


def test_lock_busy_keeps_the_stale_counts(layout, uniq, tmp_path) -> None:
    prom = str(tmp_path / "kvctl.prom")
    dead_deployment(layout, f"{uniq}d")
    # Off a terminal without --yes, gc removes nothing: the stale gauges are non-zero.
    r = kvctl("--root", layout.root, "gc", "--prometheus", prom, env=lock_env(layout))
    assert r.code == 3
    stale = _metric(prom, "kvctl_gc_stale_entries")
    assert sum(stale.values()) == 4
    with GcLock(layout, os.path.join(layout.root, "gc.lock")):
        r = kvctl("--root", layout.root, "gc", "--yes", "--prometheus", prom, env=lock_env(layout))
    assert r.code == 5
    assert _metric(prom, "kvctl_gc_stale_entries") == stale, "a busy lock must not read as a clean node"
    assert _metric(prom, "kvctl_gc_lock_busy") == {"kvctl_gc_lock_busy": 1.0}


def test_duration_covers_the_whole_run(layout, uniq, tmp_path, monkeypatch) -> None:
    """kvctl_gc_duration_seconds times planning too, not only removal (a slow /proc pass shows)."""
    import kvcached.node.clean.cleanup

    real_plan = kvcached.node.clean.cleanup.plan

    def slow_plan(*a, **kw):  # the clock is what is measured here, not the OS
        time.sleep(0.3)
        return real_plan(*a, **kw)

    monkeypatch.setattr(kvcached.node.clean.cleanup, "plan", slow_plan)
    create_segment(layout.segment_path(f"{uniq}d"), 1 << 30)  # something to plan: an idle node plans nothing
    prom = str(tmp_path / "kvctl.prom")
    assert invoke("--root", layout.root, "gc", "--dry-run", "--prometheus", prom).code == 0
    assert _metric(prom, "kvctl_gc_duration_seconds")["kvctl_gc_duration_seconds"] >= 0.3


# §4 -----------------------------------------------------------------------------------

def test_locked_segments_cost_one_bounded_wait(layout, uniq) -> None:
    """Twenty segments that another process keeps write-locked: one short wait, values shown unknown."""
    names = [f"{uniq}l{i}" for i in range(20)]
    for n in names:
        create_segment(layout.segment_path(n), 1 << 30)
    holder = subprocess.Popen(
        [os.sys.executable, "-c",
         "import fcntl, os, sys\nfds = []\nfor p in sys.argv[1:]:\n    fd = os.open(p, os.O_RDWR)\n"
         "    fcntl.flock(fd, fcntl.LOCK_EX)\n    fds.append(fd)\nprint('held', flush=True)\nsys.stdin.read()",
         *[layout.segment_path(n) for n in names]], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        r = kvctl("--root", layout.root, "list", "--json")
        took = time.monotonic() - t0
        rows = r.json("list")
        assert r.code == 0 and sorted(x["ipc"] for x in rows) == sorted(names)
        assert all(x["limit_bytes"] is None and "locked" in x["error"] for x in rows)
        # Waiting 2 s per segment, as before, would take 40 s; one bounded wait takes well under 10.
        assert took < 10, took
        assert kvctl("--root", layout.root, "inspect").code == 0
    finally:
        holder.kill()
        holder.wait()


# §5 -----------------------------------------------------------------------------------

def test_kind_socket_never_strands_the_segment(layout, uniq) -> None:
    name = f"{uniq}k"
    seg, sdir, *socks = dead_deployment(layout, name)
    r = kvctl("--root", layout.root, "gc", "--yes", "--kind", "socket", env=lock_env(layout))
    assert r.code == 3, (r.stdout, r.stderr)  # the directory stays, so stale entries remain: say so
    assert not any(os.path.lexists(s) for s in socks)
    assert os.path.isdir(sdir), "the directory names the segment: it must outlive it"
    assert "names segment" in r.stdout
    # Removing the sockets made the directory young again: the segment waits with it, visibly.
    assert [x["ipc"] for x in kvctl("--root", layout.root, "list", "--json").json("list")] == [name]
    doc = kvctl("--root", layout.root, "gc", "--dry-run", "--min-age", "0", "--json").json("gc")
    assert {e["path"] for e in doc["entries"] if e["action"] == "would_remove"} == {seg, sdir}
    assert kvctl("--root", layout.root, "gc", "--yes", "--min-age", "0", env=lock_env(layout)).code == 0
    assert leftovers(layout) == []


def test_a_killed_gc_rerun_reaches_a_clean_node(layout, uniq) -> None:
    for i in range(150):
        dead_deployment(layout, f"{uniq}x{i}", ranks=1)
    p = subprocess.Popen([KVCTL, "--root", layout.root, "gc", "--yes"], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, env={**os.environ, **lock_env(layout)})
    n0 = len(os.listdir(layout.shm_dir))
    wait_until(lambda: p.poll() is not None or len(os.listdir(layout.shm_dir)) <= n0 - 20, 60, interval=0.001)
    p.send_signal(signal.SIGKILL)
    p.wait()
    # Whatever the moment of the kill: no segment has lost the directory that names it.
    names = set(os.listdir(layout.shm_dir))
    dirs = {d.split("-")[2] for d in os.listdir(layout.tmp_dir) if d.startswith("kvcached-tp-")}
    assert names <= dirs, f"stranded segments: {sorted(names - dirs)[:5]}"
    r = kvctl("--root", layout.root, "gc", "--yes", env=lock_env(layout))
    assert r.code == 0, r.stderr
    assert leftovers(layout) == []


def test_a_time_limited_run_then_a_rerun_reaches_a_clean_node(layout, uniq) -> None:
    for i in range(40):
        dead_deployment(layout, f"{uniq}t{i}", ranks=1)
    kvctl("--root", layout.root, "gc", "--yes", "--time-limit", "0.000001", env=lock_env(layout))
    names = set(os.listdir(layout.shm_dir))
    dirs = {d.split("-")[2] for d in os.listdir(layout.tmp_dir) if d.startswith("kvcached-tp-")}
    assert names <= dirs
    assert kvctl("--root", layout.root, "gc", "--yes", env=lock_env(layout)).code == 0
    assert leftovers(layout) == []


def test_a_segment_whose_directory_is_gone_stays_visible_and_removable(layout, uniq) -> None:
    """systemd-tmpfiles aged out /tmp: only the segment's shape says kvcached. Shown, kept, removable by name."""
    name = f"{uniq}orphan"
    path = layout.segment_path(name)
    with open(path, "wb") as f:  # upstream's segment: no mark
        f.write((5 << 30).to_bytes(8, "little") + bytes(16))
    backdate(path)
    rows = kvctl("--root", layout.root, "list", "--json").json("list")
    assert [(x["ipc"], x["state"], x["reason"], x["limit_bytes"]) for x in rows] == \
        [(name, "unknown", "unnamed_segment", 5 << 30)]
    assert name in kvctl("--root", layout.root, "inspect").stdout
    assert kvctl("--root", layout.root, "gc", "--yes", env=lock_env(layout)).code == 0
    assert os.path.exists(path), "nothing but its shape ties it to kvcached: gc keeps it"
    r = kvctl("--root", layout.root, "delete", name, "--yes")
    assert r.code == 0 and not os.path.exists(path), (r.stdout, r.stderr)


# §7 -----------------------------------------------------------------------------------

def json_error(r: Run, code: int) -> dict:
    assert r.code == code, (r.code, r.stdout, r.stderr)
    doc = r.json("error")
    assert doc["error"]["code"] == code and doc["exit_code"] == code
    assert r.stderr.startswith("kvctl: ") and "Traceback" not in r.stderr
    return doc


def test_json_on_every_path(layout, uniq, tmp_path) -> None:
    root = layout.root
    json_error(kvctl("--root", root, "list", "nothing-like-this", "--json"), 6)
    json_error(kvctl("--root", root, "inspect", "nothing-like-this", "--json"), 6)
    json_error(kvctl("--root", root, "gc", "nothing-like-this", "--yes", "--json"), 6)
    json_error(kvctl("--root", root, "limit", "bad name", "1G", "--json"), 2)
    json_error(kvctl("--root", root, "gc", "--min-age", "soon", "--json"), 2)
    live = f"{uniq}live"
    create_segment(layout.segment_path(live), 1 << 30)
    fd = os.open(layout.segment_path(live), os.O_RDONLY)
    try:
        doc = json_error(kvctl("--root", root, "delete", live, "--yes", "--json"), 7)
        assert "live" in doc["error"]["message"]
    finally:
        os.close(fd)
    with GcLock(layout, os.path.join(root, "gc.lock")):
        json_error(kvctl("--root", root, "gc", "--yes", "--json", env=lock_env(layout)), 5)
    # limit-percent where torch cannot be imported: a torch that fails to import shadows the real one.
    fake = tmp_path / "notorch"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text("raise ImportError('no torch here')\n")
    json_error(kvctl("--root", root, "limit-percent", live, "50", "--json", env={"PYTHONPATH": str(fake)}), 1)


def test_gc_name_that_matches_nothing_exits_6(layout) -> None:
    assert_one_line_error(kvctl("--root", layout.root, "gc", "--yes", "typo-name"), 6)
    assert_one_line_error(kvctl("--root", layout.root, "gc", "--dry-run", "typo*"), 6)


@pytest.mark.parametrize("cmd", ["watch", "top"])
@pytest.mark.parametrize("value", ["nan", "inf", "1e300", "0", "-1", "100000"])
def test_refresh_intervals_are_usage_errors(layout, cmd: str, value: str) -> None:
    r = kvctl("--root", layout.root, cmd, "-n", value, "--count", "1")
    assert_one_line_error(r, 2)


def test_limit_is_exact_and_impossible_values_show_as_such(layout, uniq) -> None:
    name = f"{uniq}n"
    path = layout.segment_path(name)
    create_segment(path, 1)
    assert kvctl("--root", layout.root, "limit", name, "123456789012345678").code == 0
    assert read_segment(path).total == 123456789012345678
    assert kvctl("--root", layout.root, "limit", name, "1.5K").code == 0 and read_segment(path).total == 1536
    with open(path, "r+b") as f:  # not something a runtime writes: a negative `used`
        f.seek(8)
        f.write((-5).to_bytes(8, "little", signed=True))
    rows = kvctl("--root", layout.root, "list", "--json").json("list")
    assert rows[0]["used_bytes"] == -5 and rows[0]["free_bytes"] is None
    assert any("negative" in p for p in rows[0]["problems"])
    r = kvctl("--root", layout.root, "list")
    assert "-5!" in r.stdout and "used is negative (-5)" in r.stderr
    write_segment(path, used=0, total=1)
