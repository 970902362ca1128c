"""gc --every's event path (kvcached/node/ops/events.py, ops/react.py): real pidfds, inotify, children, signals.

Each test watches a directory of its own tmp_path as a place and real child
processes as its viewers; the kernel's pidfds and inotify do the rest. Only
the degraded modes that this machine cannot be made to show are simulated,
each test saying why.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcached.node.base.place import Place, PlaceKind, Seen
from kvcached.node.clean.facts import process_start_time
from kvcached.node.ops.events import Changed, Watch, key_of
from kvcached.node.ops.react import COALESCE_S, SETTLE_S, Reactor

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="os.pidfd_open needs Linux 5.3 and Python 3.9")


def _place(d: Path, pids: tuple[int, ...] = (), holder: int | None = None) -> Place:
    st = os.stat(d)
    return Place(PlaceKind.POD_VOLUME, str(d), Seen.SHM, st.st_dev, st.st_ino, pids=pids, holder=holder)


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def _sleeper(procs: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    procs.append(p)
    return p


def _started(pids: list[int]) -> dict[int, float]:
    out = {}
    for pid in pids:
        t = process_start_time(pid)
        assert t is not None
        out[pid] = t
    return out


def _until(watch: Watch, pred: object, seconds: float = 30.0) -> list[Changed]:
    """Every wait until `pred(all seen so far)` holds (exits of many children arrive over several polls)."""
    seen: list[Changed] = []
    deadline = time.monotonic() + seconds
    while not pred(seen):  # type: ignore[operator]
        assert time.monotonic() < deadline, seen
        seen.append(watch.wait(deadline - time.monotonic()))
    return seen


def test_the_last_viewer_exiting_touches_its_place_and_orphans_it(tmp_path: Path, children: list) -> None:
    a, b = _sleeper(children), _sleeper(children)
    pl = _place(tmp_path, (a.pid, b.pid))
    with Watch() as w:
        w.arm([pl], _started([a.pid, b.pid]))
        assert w.watched_pids == 2 and w.watched_places == 1
        assert w.wait(0.05) == Changed()  # nothing happened: the poll times out empty
        a.kill()
        a.wait()
        first = w.wait(10)
        assert first.places == {key_of(pl)} and first.exited == 1 and not first.orphaned  # b still sees it
        b.kill()
        b.wait()
        last = w.wait(10)
        assert last.places == {key_of(pl)} and last.orphaned == {key_of(pl)}


def test_the_holder_is_watched_but_is_no_viewer(tmp_path: Path, children: list) -> None:
    app, pause = _sleeper(children), _sleeper(children)
    pl = _place(tmp_path, (app.pid, pause.pid), holder=pause.pid)
    with Watch() as w:
        w.arm([pl], _started([app.pid, pause.pid]))
        app.kill()
        app.wait()
        ch = w.wait(10)
        assert ch.orphaned == {key_of(pl)}  # only the pause process is left: nobody can be making files


def test_a_viewer_gone_before_its_pidfd_opens_is_an_exit_at_once(tmp_path: Path, children: list) -> None:
    live = _sleeper(children)
    pl = _place(tmp_path, (live.pid,))
    with Watch() as w:
        # The pass saw another process under this PID (another start time): the one it saw is gone.
        w.arm([pl], {live.pid: _started([live.pid])[live.pid] - 5.0})
        assert w.watched_pids == 0
        ch = w.wait(10)
        assert ch.places == {key_of(pl)} and ch.exited == 1 and ch.orphaned == {key_of(pl)}


def test_a_new_file_touches_its_place_and_the_host_is_never_watched(tmp_path: Path, children: list) -> None:
    d = tmp_path / "vol"
    d.mkdir()
    viewer = _sleeper(children)
    pl = _place(d, (viewer.pid,))
    host = Place(PlaceKind.HOST, "/", Seen.SHM)
    with Watch() as w:
        w.arm([host, pl], _started([viewer.pid]))
        assert w.watched_places == 1
        (d / "psm_0123abcd").write_bytes(b"x" * 10)
        ch = w.wait(10)
        assert ch.places == {key_of(pl)} and ch.files == 1 and ch.exited == 0 and not ch.orphaned


def test_a_link_at_the_place_is_not_followed(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    st = os.stat(tmp_path / "real")
    pl = Place(PlaceKind.POD_VOLUME, str(tmp_path / "link"), Seen.SHM, st.st_dev, st.st_ino)
    with Watch() as w:
        w.arm([pl], {})
        assert w.watched_places == 0  # IN_DONT_FOLLOW refused it; the next pass says what the place is


def test_the_stop_pipe_ends_a_wait(tmp_path: Path) -> None:
    r, wfd = os.pipe()
    try:
        with Watch(r) as w:
            w.arm([_place(tmp_path)], {})
            os.write(wfd, b"x")
            assert w.wait(10).stop
    finally:
        os.close(r)
        os.close(wfd)


def test_a_burst_of_exits_is_one_judgement_per_place(tmp_path: Path, children: list) -> None:
    dirs = [tmp_path / f"p{i}" for i in range(3)]
    for d in dirs:
        d.mkdir()
    procs = [_sleeper(children) for _ in range(60)]
    places = [_place(d, tuple(p.pid for p in procs[i::3])) for i, d in enumerate(dirs)]
    judged: list[set] = []
    reactor = Reactor(_opts(tmp_path), None)
    real = reactor.judge

    def judge(keys: set) -> object:  # the real judgement (these directories are no mounts: it finds none)
        judged.append(set(keys))
        return real(keys)

    reactor.judge = judge  # type: ignore[method-assign,assignment]
    try:
        reactor.watch.arm(places, _started([p.pid for p in procs]))
        for p in procs:
            os.kill(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait()
        reactor.run_for(COALESCE_S + 1.0, lambda _: None)
    finally:
        reactor.close()
    # However the 60 exits spread over polls, each place was judged once, all three in one pass.
    assert judged == [{key_of(pl) for pl in places}]


def test_a_live_place_touched_again_waits_for_the_settle_time(tmp_path: Path, children: list) -> None:
    now = [100.0]
    viewer = _sleeper(children)
    pl = _place(tmp_path, (viewer.pid,))
    reactor = Reactor(_opts(tmp_path), None, clock=lambda: now[0])
    try:
        reactor.note(Changed(places=frozenset({key_of(pl)}), files=1))  # type: ignore[arg-type]
        assert reactor._due[key_of(pl)] == 100.0 + SETTLE_S  # type: ignore[index]
        now[0] = 105.0
        reactor.note(Changed(places=frozenset({key_of(pl)}), exited=1))  # type: ignore[arg-type]
        assert reactor._due[key_of(pl)] == 100.0 + SETTLE_S  # type: ignore[index]  (a stream never postpones)
        reactor.note(Changed(places=frozenset({key_of(pl)}), orphaned=frozenset({key_of(pl)})))  # type: ignore
        assert reactor._due[key_of(pl)] == 105.0 + COALESCE_S  # type: ignore[index]
    finally:
        reactor.close()


def _opts(tmp_path: Path) -> object:
    from kvcached.node import GcOptions, Layout

    return GcOptions(layout=Layout(str(tmp_path)), dry_run=True, all_places=True, engines=True)


def test_no_pidfd_degrades_to_rounds_said_once(tmp_path: Path, children: list,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # Simulated: this machine's kernel has pidfd_open and no seccomp filter refuses it; a kernel below 5.3
    # answers ENOSYS, a container's seccomp profile EPERM.
    viewer = _sleeper(children)

    def refused(pid: int, flags: int = 0) -> int:
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.setattr(os, "pidfd_open", refused)
    with Watch() as w:
        w.arm([_place(tmp_path, (viewer.pid,))], _started([viewer.pid]))
        w.arm([_place(tmp_path, (viewer.pid,))], _started([viewer.pid]))
        news = w.news()
        assert [d.what for d in news] == ["pidfd"] and "rounds only" in news[0].why
        assert w.news() == [] and w.watched_pids == 0 and w.watched_places == 1  # inotify still works


def test_inotify_watches_exhausted_degrade_those_places(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Simulated: max_user_watches is one limit for the whole machine; lowering it would fail other tests'
    # and the machine's own watches.
    from kvcached.node.base import inotify

    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    real = inotify.Inotify.add
    calls = []

    def add(self: inotify.Inotify, path: str, mask: int = inotify.WANTED) -> int:
        calls.append(path)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real(self, path, mask)

    monkeypatch.setattr(inotify.Inotify, "add", add)
    with Watch() as w:
        w.arm([_place(d) for d in dirs], {})
        assert w.watched_places == 1 and [d.what for d in w.news()] == ["inotify-limit"]


def test_a_mount_in_kvctls_own_table_is_news(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    code = ("import os, subprocess, sys\n"
            "from kvcached.node.ops.events import Watch\n"
            "w = Watch()\n"
            "assert not w.wait(0.05).mounts\n"
            "subprocess.run(['mount', '-t', 'tmpfs', 'kvctest', sys.argv[1]], check=True)\n"
            "print(w.wait(10).mounts)\n")
    (tmp_path / "m").mkdir()
    # A private mount namespace of its own: the machine's mount table never changes.
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", code,
                        str(tmp_path / "m")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True"


def _doctor_events(tmp_path: Path, prefix: str = "") -> dict:
    import json

    kvctl = str(Path(sys.executable).with_name("kvctl"))
    (tmp_path / "dev" / "shm").mkdir(parents=True, exist_ok=True)
    (tmp_path / "tmp").mkdir(exist_ok=True)
    r = subprocess.run(["sh", "-c", f'{prefix}exec "$@"', "sh", kvctl, "--root", str(tmp_path), "doctor", "events",
                        "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode in (0, 1), r.stderr
    [check] = json.loads(r.stdout)["checks"]
    return check


def test_doctor_events_says_what_the_event_path_has(tmp_path: Path) -> None:
    check = _doctor_events(tmp_path)
    assert check["name"] == "events" and check["status"] == "ok", check
    assert check["details"]["pidfd"] is True and check["details"]["inotify"] is True


def test_doctor_events_warns_when_the_open_files_limit_is_below_the_processes(tmp_path: Path) -> None:
    # A real limit (ulimit -n in the shell that execs kvctl): below the node's processes plus kvctl's own
    # descriptors (64), whatever few processes run.
    check = _doctor_events(tmp_path, "ulimit -n 40; ")
    assert check["status"] == "warn" and "open-files limit (40)" in check["summary"], check
    assert check["details"]["nofile"] == 40 and "LimitNOFILE" in check["fix"]
