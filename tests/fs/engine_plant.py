"""Engine leftovers to plant on a node, live and dead: real files, real child processes, real sockets.

Shared by the engine pass's own tests (tests/fs/test_engine_leftovers.py) and
kvctl's (tests/cli/test_engines_cli.py): `plant_matrix` plants every family
live and dead, young and foreign, and says what each must be decided.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import stat
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvcached.node.base.enums import StrEnum
from kvcached.node.base.layout import Layout
from kvcached.node.clean import cleanup
from kvcached.node.clean.decide import Policy, State
from kvcached.node.clean.leftovers.act import EnginePlan, plan_engines
from kvcached.node.clean.leftovers.decide import EngineReason
from kvcached.node.clean.leftovers.evidence import pid_view_gap
from kvcached.node.clean.rules import SharedReason
from kvcached.node.ops import gcrun

# Whether this machine's /proc shows every process (the initial PID namespace's procfs). In a container's
# own, nothing that maps or holds files can be proven absent, and every buffer stays unknown by design
# (test_engine_namespaces.py shows that case in a real namespace).
WHOLE_VIEW = pid_view_gap("/proc") is None
needs_whole_view = pytest.mark.skipif(not WHOLE_VIEW, reason=f"/proc here is a container's: {pid_view_gap('/proc')}")
SCHEMA = json.loads((Path(__file__).parents[2] / "kvctl/schemas/engine_entry.json").read_text())
OLD = 3600.0

READY_THEN_WAIT = 'print("ready", flush=True)\nsys.stdin.read()\n'
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
""") + READY_THEN_WAIT
HOLDER = "import os, sys\nfd = os.open(sys.argv[1], os.O_RDONLY)\n" + READY_THEN_WAIT
LISTENER = ("import socket, sys\ns = socket.socket(socket.AF_UNIX)\ns.bind(sys.argv[1])\ns.listen(4)\n"
            + READY_THEN_WAIT)
SLEEPER = "import sys\n" + READY_THEN_WAIT
# What CPython 3.11's tempfile draws its 8 characters from (SGLang's ZMQ endpoints are tempfile's names).
TEMPFILE_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789_"


class Children:
    """Child processes of one test: started until they say ready, killed and reaped at teardown."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def spawn(self, script: str, *args: str, user: int | None = None) -> subprocess.Popen[str]:
        # stderr to a pipe: these children write to it only when they fail, and then the test says why.
        p = subprocess.Popen([sys.executable, "-c", script, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, user=user)
        self.procs.append(p)
        assert p.stdout is not None and p.stderr is not None
        line = p.stdout.readline().strip()
        if line != "ready":
            p.kill()
            code = p.wait()
            raise AssertionError(f"child said {line!r} (exit {code}): {p.stderr.read()[-2000:]!r}")
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
                               .replace("_", "y"), uuid=uuid.uuid4(),
                               tmp8="".join(secrets.choice(TEMPFILE_CHARS) for _ in range(8)))
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


@pytest.fixture
def children() -> Iterator[Children]:
    """The test's child processes, killed and reaped at teardown."""
    kids = Children()
    yield kids
    kids.close()


@pytest.fixture(params=["private", "real"])
def engine_node(request: pytest.FixtureRequest, layout: Layout) -> Iterator[Node]:
    """A private root, or the machine's own /dev/shm and /tmp (this test's names only, removed after)."""
    n = Node(layout if request.param == "private" else Layout("/"))
    yield n
    n.cleanup()


def backdate(path: str, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t), follow_symlinks=False)


def names_of(paths: list[str]) -> list[str]:
    return [os.path.basename(p) for p in paths]


def engine_plan(n: Node, paths: list[str], **kw: object) -> EnginePlan:
    # Only our own names: on the real node, other processes' leftovers are not this test's to touch.
    return plan_engines(n.layout, Policy(grace=60), names=names_of(paths), **kw)  # type: ignore[arg-type]


def by_path(p: EnginePlan) -> dict[str, tuple[State, StrEnum]]:
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


def plant_matrix(n: Node, kids: Children, old: float = OLD) -> tuple[dict[str, tuple[State, StrEnum]], list[str]]:
    """Every family live and dead, young, foreign; (expected decision by path, every planted path).

    `old`: how long ago the old entries changed (their mtime; a grace age below it makes the dead ones stale).
    """

    def f(name: str, *, age: float = old, directory: str | None = None) -> str:
        return n.file(name, age=age, directory=directory)

    def s(name: str, *, age: float = old) -> str:
        return n.socket(name, age=age)

    want: dict[str, tuple[State, StrEnum]] = {}
    stale, live = State.STALE, State.LIVE
    R, S = EngineReason, SharedReason
    # dead
    for make in ("psm_{hex8}", "vllm_mm_" + "A" * 14 + "{hex8}", "nccl-{alnum6}", "cuda.shm.0.1a2b.{hex8}",
                 "sglang_loads_t_{hex8}.shm"):
        want[f(n.fresh(n.shm, make))] = (stale, R.UNUSED)
    dead = kids.dead_pid()
    for make in (f"sgl_shm_mm_{dead}_{{hex8}}", f"multi_tokenizer_args_{dead}"):
        path = f(n.fresh(n.shm, make))
        assert not os.path.exists(f"/proc/{dead}"), "PID reused at once; rerun"
        want[path] = (stale, R.CREATOR_GONE)
    want[s(n.fresh(n.tmp, "{uuid}"))] = (stale, S.NOT_LISTENING)
    want[s(n.fresh(n.tmp, "tmp{tmp8}"))] = (stale, S.NOT_LISTENING)  # SGLang's, after its serve was killed
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
    want[held] = (live, S.HELD_OPEN)
    want[kids_file(kids, f, n, "cuda.shm.0.1a2b.{hex8}", HOLDER)] = (live, S.HELD_OPEN)
    want[kids_file(kids, f, n, "sglang_loads_t_{hex8}.shm", MAPPER)] = (live, R.MAPPED)
    creator = kids.spawn(SLEEPER)
    for make in (f"sgl_shm_mm_{creator.pid}_{{hex8}}", f"multi_tokenizer_args_{creator.pid}"):
        want[f(n.fresh(n.shm, make))] = (live, R.CREATOR_ALIVE)  # backdated mtime; its ctime is now
    for make in ("{uuid}", "tmp{tmp8}"):
        listening = os.path.join(n.tmp, n.fresh(n.tmp, make))
        n.planted.append(listening)
        kids.spawn(LISTENER, listening)
        backdate(listening, old)
        want[listening] = (live, S.LISTENING)
    # young (not a psm_ name: a concurrent suite's sweep of its own vLLM buffers, tests/conftest.py, removes
    # unused psm_ files that appeared during it; dead, mapped and non-regular psm_ entries are safe from it)
    want[f(n.fresh(n.shm, "vllm_mm_" + "B" * 14 + "{hex8}"), age=0)] = (State.YOUNG, S.YOUNG)
    want[s(n.fresh(n.tmp, "{uuid}"), age=0)] = (State.YOUNG, S.YOUNG)
    # foreign: a symlink (to a dead buffer's data under another name), a hard link, a FIFO, a directory
    target = f(n.fresh(n.shm, "target-{hex8}"))
    link = os.path.join(n.shm, n.fresh(n.shm, "psm_{hex8}"))
    os.symlink(target, link)
    n.planted.append(link)
    want[link] = (State.FOREIGN, S.SYMLINK)
    linked = f(n.fresh(n.shm, "nccl-{alnum6}"))
    other_name = os.path.join(n.shm, n.fresh(n.shm, "hardlink-{hex8}"))
    os.link(linked, other_name)
    n.planted.append(other_name)
    want[linked] = (State.FOREIGN, S.HARD_LINKED)
    fifo = os.path.join(n.shm, n.fresh(n.shm, "psm_{hex8}"))
    os.mkfifo(fifo)
    n.planted.append(fifo)
    backdate(fifo, old)
    want[fifo] = (State.FOREIGN, S.WRONG_TYPE)
    sock_target = s(n.fresh(n.tmp, "target-{hex8}.sock"))
    tmp_link = os.path.join(n.tmp, n.fresh(n.tmp, "{uuid}"))
    os.symlink(sock_target, tmp_link)
    n.planted.append(tmp_link)
    want[tmp_link] = (State.FOREIGN, S.SYMLINK)
    directory = os.path.join(n.shm, n.fresh(n.shm, "nccl-{alnum6}"))
    os.mkdir(directory)
    n.planted.append(directory)
    want[directory] = (State.FOREIGN, S.WRONG_TYPE)
    # names that only look like a family's, dead and old: never looked at
    extra = [f(n.fresh(n.shm, make)) for make in ("psm_{hex8}0", "nccl-{alnum6}x", "sgl_shm_mm_0_{hex8}",
                                                  "cuda.shm.{hex8}", "multi_tokenizer_args_0{hex8}")]
    extra.append(s(n.fresh(n.tmp, "{uuid}.sock")))
    extra.append(f(n.fresh(n.tmp, "{uuid}"), directory=n.tmp))  # a regular file named by a uuid4
    # SGLang's empty tempfile that zmq never bound: a name only, no evidence either way
    extra.append(n.file(n.fresh(n.tmp, "tmp{tmp8}"), age=old, nbytes=0, directory=n.tmp))
    # one character off tempfile's shape: 9 after tmp, 7, an uppercase one, an uppercase prefix
    extra += [s(n.fresh(n.tmp, make)) for make in ("tmp{tmp8}x", "tmp{alnum6}0", "tmp{alnum6}Z_", "TMP{tmp8}")]
    extra += [target, other_name, sock_target]
    return want, list(want) + extra


def kids_file(kids: Children, f, n: Node, make: str, script: str) -> str:  # type: ignore[no-untyped-def]
    path = f(n.fresh(n.shm, make))
    kids.spawn(script, path)
    return path
