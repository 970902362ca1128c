"""Engine leftovers planted live and dead, on a private root and on the real /dev/shm and /tmp.

Real files, real child processes that map (fd closed) or hold (never mapped)
them, real bound Unix sockets, real dead and reused PIDs. The engine plan
removes exactly the dead ones; kvcached's plain plan sees and removes none.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import stat
import struct
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
import pytest

from kvcached.node import cleanup, gcrun
from kvcached.node.cleanup import Action
from kvcached.node.decide import Policy, State
from kvcached.node.engines import EngineKind, EngineReason, execute_engines, plan_engines
from kvcached.node.engines.act import EnginePlan
from kvcached.node.engines.evidence import pid_view_gap
from kvcached.node.facts import START_SLACK
from kvcached.node.layout import Layout

from .helpers import live_socket, run_as

# Whether this machine's /proc shows every process (the initial PID namespace's procfs). In a container's
# own, nothing that maps or holds files can be proven absent, and every buffer stays unknown by design
# (test_engine_namespaces.py shows that case in a real namespace).
WHOLE_VIEW = pid_view_gap("/proc") is None
needs_whole_view = pytest.mark.skipif(not WHOLE_VIEW, reason=f"/proc here is a container's: {pid_view_gap('/proc')}")
SCHEMA = json.loads((Path(__file__).parents[2] / "kvctl/schemas/engine_entry.json").read_text())
OLD = 3600.0

_READY_THEN_WAIT = 'print("ready", flush=True)\nsys.stdin.read()\n'
# Maps the file, then closes the fd: only /proc/<pid>/maps shows it. (Python's mmap keeps a dup of
# the fd for the mapping's life, so the mapping is made through libc.)
MAPPER = textwrap.dedent("""
    import ctypes, mmap, os, sys
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    fd = os.open(sys.argv[1], os.O_RDONLY)
    addr = libc.mmap(None, 4096, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        sys.exit("mmap: " + os.strerror(ctypes.get_errno()))
    os.close(fd)
""") + _READY_THEN_WAIT
HOLDER = "import os, sys\nfd = os.open(sys.argv[1], os.O_RDONLY)\n" + _READY_THEN_WAIT
LISTENER = ("import socket, sys\ns = socket.socket(socket.AF_UNIX)\ns.bind(sys.argv[1])\ns.listen(4)\n"
            + _READY_THEN_WAIT)
SLEEPER = "import sys\n" + _READY_THEN_WAIT


class Children:
    """Child processes of one test: started until they say ready, killed and reaped at teardown."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def spawn(self, script: str, *args: str, user: int | None = None) -> subprocess.Popen[str]:
        p = subprocess.Popen([sys.executable, "-c", script, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, user=user)
        self.procs.append(p)
        assert p.stdout is not None
        line = p.stdout.readline().strip()
        assert line == "ready", f"child said {line!r} (exit {p.poll()})"
        return p

    def dead_pid(self) -> int:
        """A PID that was a process of ours a moment ago and is free now."""
        p = subprocess.Popen([sys.executable, "-c", "pass"])
        p.wait()
        return p.pid

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


@pytest.fixture
def children() -> Iterator[Children]:
    kids = Children()
    yield kids
    kids.close()


@dataclass
class Node:
    """A node to plant on: a private root or the real one, with every planted path removed at teardown."""

    layout: Layout
    planted: list[str] = field(default_factory=list)

    @property
    def shm(self) -> str:
        return self.layout.shm_dir

    @property
    def tmp(self) -> str:
        return self.layout.tmp_dir

    def fresh(self, directory: str, make: str) -> str:
        for _ in range(100):
            name = make.format(hex8=secrets.token_hex(4), alnum6=secrets.token_urlsafe(8)[:6].replace("-", "x")
                               .replace("_", "y"), uuid=uuid.uuid4())
            if not os.path.lexists(os.path.join(directory, name)):
                return name
        raise AssertionError("no free name")

    def file(self, name: str, *, age: float = OLD, nbytes: int = 8192, mode: int = 0o600,
             directory: str | None = None) -> str:
        path = os.path.join(directory or self.shm, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        self.planted.append(path)
        try:
            os.write(fd, b"k" * nbytes)
        finally:
            os.close(fd)
        backdate(path, age)
        return path

    def socket(self, name: str, *, age: float = OLD, directory: str | None = None) -> str:
        """A socket node nobody is bound to any more (what a SIGKILLed ZMQ listener leaves)."""
        path = os.path.join(directory or self.tmp, name)
        s = socket.socket(socket.AF_UNIX)
        s.bind(path)
        self.planted.append(path)
        s.close()
        backdate(path, age)
        return path

    def cleanup(self) -> None:
        for path in self.planted:
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(st.st_mode):
                os.rmdir(path)
            else:
                os.unlink(path)


def backdate(path: str, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t), follow_symlinks=False)


@pytest.fixture(params=["private", "real"])
def node(request: pytest.FixtureRequest, layout: Layout) -> Iterator[Node]:
    """A private root, or the machine's own /dev/shm and /tmp (names unique to the test, removed after)."""
    n = Node(layout if request.param == "private" else Layout("/"))
    yield n
    n.cleanup()


def names_of(paths: list[str]) -> list[str]:
    return [os.path.basename(p) for p in paths]


def engine_plan(n: Node, paths: list[str], **kw: object) -> EnginePlan:
    # Only our own names: on the real node, other processes' leftovers are not this test's to touch.
    return plan_engines(n.layout, Policy(grace=60), names=names_of(paths), **kw)  # type: ignore[arg-type]


def by_path(p: EnginePlan) -> dict[str, tuple[State, EngineReason]]:
    return {c.path: (d.state, d.reason) for c, d in p.entries()}


def assert_plain_gc_ignores(n: Node, paths: list[str]) -> None:
    """kvcached's own plan (cleanup.plan, gcrun.make_plan) shows none of them and removes none."""
    planted = set(paths)
    for p in (cleanup.plan(n.layout, Policy(grace=0)), gcrun.make_plan(n.layout, grace=0)):
        assert not planted & {c.path for c, _ in p.entries()}
        dry = cleanup.execute(p, dry_run=True)
        assert not planted & {e.path for e in dry.entries}
        if n.layout.root != "/":  # on the real node a real run would touch other sessions' state
            cleanup.execute(p, dry_run=False)
    assert all(os.path.lexists(x) for x in paths), [x for x in paths if not os.path.lexists(x)]


def plant_matrix(n: Node, kids: Children) -> tuple[dict[str, tuple[State, EngineReason]], list[str]]:
    """Every family live and dead, young, foreign; (expected decision by path, every planted path)."""
    f, s = n.file, n.socket
    want: dict[str, tuple[State, EngineReason]] = {}
    stale, live = State.STALE, State.LIVE
    R = EngineReason
    # dead
    for make in ("psm_{hex8}", "vllm_mm_" + "A" * 14 + "{hex8}", "nccl-{alnum6}", "cuda.shm.0.1a2b.{hex8}",
                 "sglang_loads_t_{hex8}.shm"):
        want[f(n.fresh(n.shm, make))] = (stale, R.UNUSED)
    dead = kids.dead_pid()
    for make in (f"sgl_shm_mm_{dead}_{{hex8}}", f"multi_tokenizer_args_{dead}"):
        path = f(n.fresh(n.shm, make))
        assert not os.path.exists(f"/proc/{dead}"), "PID reused at once; rerun"
        want[path] = (stale, R.CREATOR_GONE)
    want[s(n.fresh(n.tmp, "{uuid}"))] = (stale, R.NOT_LISTENING)
    # live: mapped only, held only, a live creator, a listener
    mapped = f(n.fresh(n.shm, "psm_{hex8}"))
    mapper = kids.spawn(MAPPER, mapped)
    assert not any(os.path.realpath(f"/proc/{mapper.pid}/fd/{x}") == os.path.realpath(mapped)
                   for x in os.listdir(f"/proc/{mapper.pid}/fd")), "the mapper must not hold it open"
    want[mapped] = (live, R.MAPPED)
    held = f(n.fresh(n.shm, "nccl-{alnum6}"))
    holder = kids.spawn(HOLDER, held)
    with open(f"/proc/{holder.pid}/maps") as maps:
        assert held not in maps.read(), "the holder must not map it"
    want[held] = (live, R.HELD_OPEN)
    want[kids_file(kids, f, n, "cuda.shm.0.1a2b.{hex8}", HOLDER)] = (live, R.HELD_OPEN)
    want[kids_file(kids, f, n, "sglang_loads_t_{hex8}.shm", MAPPER)] = (live, R.MAPPED)
    creator = kids.spawn(SLEEPER)
    for make in (f"sgl_shm_mm_{creator.pid}_{{hex8}}", f"multi_tokenizer_args_{creator.pid}"):
        want[f(n.fresh(n.shm, make))] = (live, R.CREATOR_ALIVE)  # backdated mtime; its ctime is now
    listening = os.path.join(n.tmp, n.fresh(n.tmp, "{uuid}"))
    n.planted.append(listening)
    kids.spawn(LISTENER, listening)
    backdate(listening, OLD)
    want[listening] = (live, R.LISTENING)
    # young (not a psm_ name: a concurrent suite's sweep of its own vLLM buffers, tests/conftest.py, removes
    # unused psm_ files that appeared during it; dead, mapped and non-regular psm_ entries are safe from it)
    want[f(n.fresh(n.shm, "vllm_mm_" + "B" * 14 + "{hex8}"), age=0)] = (State.YOUNG, R.YOUNG)
    want[s(n.fresh(n.tmp, "{uuid}"), age=0)] = (State.YOUNG, R.YOUNG)
    # foreign: a symlink (to a dead buffer's data under another name), a hard link, a FIFO, a directory
    target = f(n.fresh(n.shm, "target-{hex8}"))
    link = os.path.join(n.shm, n.fresh(n.shm, "psm_{hex8}"))
    os.symlink(target, link)
    n.planted.append(link)
    want[link] = (State.FOREIGN, R.SYMLINK)
    linked = f(n.fresh(n.shm, "nccl-{alnum6}"))
    other_name = os.path.join(n.shm, n.fresh(n.shm, "hardlink-{hex8}"))
    os.link(linked, other_name)
    n.planted.append(other_name)
    want[linked] = (State.FOREIGN, R.HARD_LINKED)
    fifo = os.path.join(n.shm, n.fresh(n.shm, "psm_{hex8}"))
    os.mkfifo(fifo)
    n.planted.append(fifo)
    backdate(fifo, OLD)
    want[fifo] = (State.FOREIGN, R.WRONG_TYPE)
    sock_target = s(n.fresh(n.tmp, "target-{hex8}.sock"))
    tmp_link = os.path.join(n.tmp, n.fresh(n.tmp, "{uuid}"))
    os.symlink(sock_target, tmp_link)
    n.planted.append(tmp_link)
    want[tmp_link] = (State.FOREIGN, R.SYMLINK)
    directory = os.path.join(n.shm, n.fresh(n.shm, "nccl-{alnum6}"))
    os.mkdir(directory)
    n.planted.append(directory)
    want[directory] = (State.FOREIGN, R.WRONG_TYPE)
    # names that only look like a family's, dead and old: never looked at
    extra = [f(n.fresh(n.shm, make)) for make in ("psm_{hex8}0", "nccl-{alnum6}x", "sgl_shm_mm_0_{hex8}",
                                                  "cuda.shm.{hex8}", "multi_tokenizer_args_0")]
    extra.append(s(n.fresh(n.tmp, "{uuid}.sock")))
    extra.append(f(n.fresh(n.tmp, "{uuid}"), directory=n.tmp))  # a regular file named by a uuid4
    extra += [target, other_name, sock_target]
    return want, list(want) + extra


def kids_file(kids: Children, f, n: Node, make: str, script: str) -> str:  # type: ignore[no-untyped-def]
    path = f(n.fresh(n.shm, make))
    kids.spawn(script, path)
    return path


@needs_whole_view
def test_the_engine_plan_removes_exactly_the_dead_ones(node: Node, children: Children) -> None:
    want, planted = plant_matrix(node, children)
    p = engine_plan(node, planted)
    assert by_path(p) == want
    dead = {path for path, (state, _) in want.items() if state is State.STALE}
    dry = execute_engines(p, dry_run=True)
    assert {e.candidate.path for e in dry.entries if e.action is Action.WOULD_REMOVE} == dead
    assert all(os.path.lexists(x) for x in planted)
    for e in dry.entries:
        jsonschema.validate(e.to_dict(), SCHEMA)
    assert_plain_gc_ignores(node, planted)
    report = execute_engines(p, dry_run=False)
    assert {e.candidate.path for e in report.entries if e.action is Action.REMOVED} == dead
    assert not report.failures
    assert {x for x in planted if not os.path.lexists(x)} == dead
    for e in report.entries:
        jsonschema.validate(e.to_dict(), SCHEMA)
    assert report.count(action=Action.REMOVED) == len(dead)
    assert report.bytes(action=Action.REMOVED) == sum(e.bytes for e in report.entries if e.candidate.path in dead)
    again = engine_plan(node, planted)
    assert {c.path for c, _ in again.entries()} == set(want) - dead


@needs_whole_view
def test_a_pid_reused_by_a_later_process_is_no_creator(node: Node, children: Children) -> None:
    """The file's PID now belongs to a process that started after the file last changed (its ctime)."""
    if os.geteuid() != 0 or not os.access("/proc/sys/kernel/ns_last_pid", os.W_OK):
        pytest.skip("choosing the next PID (/proc/sys/kernel/ns_last_pid) needs root in the initial PID namespace")
    pid = children.dead_pid()
    path = node.file(node.fresh(node.shm, f"sgl_shm_reuse_{pid}_{{hex8}}"))
    # /proc's start times come from a whole-second boot time, up to a second early: wait past the slack
    # twice, so that a process started now is seen to start after the file's ctime.
    time.sleep(2 * START_SLACK + 0.3)
    later = _spawn_at(children, pid)
    assert later is not None, f"could not start a process as PID {pid}: the machine forks too fast"
    ((_, dec),) = engine_plan(node, [path]).entries()
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


def test_sizes_are_the_memory_held_not_the_apparent_size(node: Node) -> None:
    path = node.file(node.fresh(node.shm, "vllm_mm_" + "B" * 14 + "{hex8}"), nbytes=4096)
    os.truncate(path, 1 << 30)  # what vLLM's 250 MB buffers look like before anything is written
    backdate(path, OLD)
    (c, _), = engine_plan(node, [path]).entries()
    st = os.stat(path)
    assert c.size == 1 << 30
    assert c.allocated == st.st_blocks * 512 < 1 << 20
    assert execute_engines(engine_plan(node, [path]), dry_run=True).entries[0].to_dict()["bytes"] == c.allocated


@needs_whole_view
def test_identity_is_rechecked_at_removal(node: Node) -> None:
    """A successor made a new file of the same name between plan and act: it is not what was decided on."""
    path = node.file(node.fresh(node.shm, "nccl-{alnum6}"))
    p = engine_plan(node, [path])
    os.unlink(path)
    os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
    (e,) = execute_engines(p, dry_run=False).entries
    assert (e.action, e.note) == (Action.KEPT, "replaced since the scan")
    assert os.path.exists(path)


@needs_whole_view
def test_owner_is_rechecked_at_removal(node: Node, unpriv_user) -> None:  # type: ignore[no-untyped-def]
    path = node.file(node.fresh(node.shm, "nccl-{alnum6}"))
    sock = node.socket(node.fresh(node.tmp, "{uuid}"))
    p = engine_plan(node, [path, sock])
    os.chown(path, unpriv_user.pw_uid, -1)
    os.chown(sock, unpriv_user.pw_uid, -1, follow_symlinks=False)
    for e in execute_engines(p, dry_run=False).entries:
        assert e.action is Action.KEPT and "changed owner" in e.note, e
    assert os.path.exists(path) and os.path.lexists(sock)


@needs_whole_view
def test_a_lock_taken_since_the_scan_keeps_it(node: Node, children: Children) -> None:
    path = node.file(node.fresh(node.shm, "sglang_loads_t_{hex8}.shm"))
    p = engine_plan(node, [path])
    children.spawn("import fcntl, os, sys\nfd = os.open(sys.argv[1], os.O_RDONLY)\nfcntl.flock(fd, fcntl.LOCK_SH)\n"
                   + _READY_THEN_WAIT, path)
    (e,) = execute_engines(p, dry_run=False).entries
    assert (e.action, e.note) == (Action.KEPT, "locked by a process since the scan")
    assert os.path.exists(path)


@needs_whole_view
def test_the_time_limit_keeps_what_it_did_not_reach(node: Node) -> None:
    # Not psm_ names: the test session's own sweep of vLLM's buffers (tests/conftest.py) runs in every
    # concurrent suite, and removes unused psm_ files that appeared during it, ours included.
    paths = [node.file(node.fresh(node.shm, "nccl-{alnum6}")) for _ in range(3)]
    p = engine_plan(node, paths)
    time.sleep(0.01)
    report = execute_engines(p, dry_run=False, time_limit=1e-9)
    assert report.timed_out
    assert {e.note for e in report.entries} == {"time limit reached"}
    assert all(os.path.exists(x) for x in paths)


@needs_whole_view
def test_another_users_entries_as_root_and_as_that_user(node: Node, unpriv_user) -> None:  # type: ignore[no-untyped-def]
    """Root decides and removes another user's dead entries; that user keeps root's as foreign, removes its own."""
    uid = unpriv_user.pw_uid
    mine = node.file(node.fresh(node.shm, "vllm_mm_" + "B" * 14 + "{hex8}"))
    theirs = node.file(node.fresh(node.shm, "vllm_mm_" + "B" * 14 + "{hex8}"))
    theirs_too = node.file(node.fresh(node.shm, "vllm_mm_" + "B" * 14 + "{hex8}"))
    their_sock = node.socket(node.fresh(node.tmp, "{uuid}"))
    for x in (theirs, theirs_too, their_sock):
        os.chown(x, uid, -1, follow_symlinks=False)
    as_user = _run_as(unpriv_user, node.layout.root, [mine, theirs, their_sock])
    assert as_user[mine][:2] == ["foreign", "other_user"]
    assert as_user[theirs][:2] == ["stale", "unused"] and as_user[theirs][2] == "removed"
    assert as_user[their_sock][:3] == ["stale", "not_listening", "removed"]
    assert os.path.exists(mine) and not os.path.exists(theirs) and not os.path.lexists(their_sock)
    (e,) = execute_engines(engine_plan(node, [theirs_too]), dry_run=False).entries
    assert (e.state, e.action) == (State.STALE, Action.REMOVED)
    assert_plain_gc_ignores(node, [mine])


_AS_USER = r"""
import json, sys
from kvcached.node.decide import Policy
from kvcached.node.engines import execute_engines, plan_engines
from kvcached.node.layout import Layout
names = [p.rsplit("/", 1)[1] for p in sys.argv[2:]]
report = execute_engines(plan_engines(Layout(sys.argv[1]), Policy(grace=60), names=names), dry_run=False)
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
        assert by_path(p) == {dead: (State.STALE, EngineReason.NOT_LISTENING)}
        assert execute_engines(p, dry_run=False).entries[0].action is Action.REMOVED
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


def test_kinds_filter_after_deciding(node: Node) -> None:
    a = node.file(node.fresh(node.shm, "vllm_mm_" + "B" * 14 + "{hex8}"))
    b = node.file(node.fresh(node.shm, "nccl-{alnum6}"))
    p = plan_engines(node.layout, Policy(grace=60), names=names_of([a, b]), kinds=[EngineKind.NCCL_SHM])
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
    (e,) = execute_engines(p, dry_run=False).entries
    assert (e.action, e.note) == (Action.KEPT, f"{layout.shm_dir} replaced since the scan")
    assert os.path.exists(path)
