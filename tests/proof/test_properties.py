"""Property tests of the cleaner over random real node states (issue 6).

Every example builds a fresh node root with real state: sockets bound and
listening in this process or in a forked child that is then SIGSTOPped, socket
nodes whose listener closed (stale), real leases (flock on the directory, the
OFD lease on the segment), segments held open or mapped, symlinks, FIFOs, hard
links, wrong owners, bad hash suffixes, world-writable directories. Two helper
processes started once per module give "a process of the deployment is alive"
(by KVCACHED_IPC_NAME and by the PGID of a default name).

Time: the plan runs with `now` one hour ahead, so every entry made in the
example is past the 60-second grace without sleeping, and "young" entries get
an mtime a few seconds before that shifted `now`. PID-reuse cases backdate
entries to before the helper's start.

Invariants (the issue's list):
  * never removes a live, unknown, young or foreign entry (checked on disk by
    inode, and every live listener still accepts a connection);
  * in a quiet state, removes every stale entry (the model's list, exactly);
  * a second run finds nothing stale;
  * the dry-run plan equals what the real run removes;
  * with random events between plan and act (a successor binds, takes a lease,
    re-creates a segment or a directory; a worker exits), still nothing that
    was not stale at plan time, and nothing a successor made, is removed.

"unknown" needs evidence root cannot read; this suite runs as root, so it
models an unreadable network namespace by adding one to the gathered facts
(the hostile suite covers the unprivileged case for real).

About one quiet example in six runs the installed `kvctl --root DIR gc
--dry-run/--yes --min-age 0 --json` instead of the library (and checks its exit
code: 0, or 3 when stale entries remain).

CI runs 25 examples (`KVCACHED_PROPERTY_EXAMPLES`); `KVCACHED_SOAK=1` runs
10,000 (`KVCACHED_SOAK_EXAMPLES`), library only unless `KVCACHED_SOAK_KVCTL=1`:

    KVCACHED_SOAK=1 .venv/bin/python -m pytest tests/proof/test_properties.py -k invariants
"""

from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from kvcached.node.base import name_rules
from kvcached.node.base.layout import Layout
from kvcached.node.clean.cleanup import Action, Report, execute, plan
from kvcached.node.clean.decide import Policy, State
from kvcached.node.clean.facts import Facts, gather_facts
from kvcached.node.state.lease import SegmentLease
from kvcached.node.state.segment import create_segment

from ..conftest import KVCTL
from ..waiting import wait_for_state
from .kit import Helper, make_root

SOAK = os.environ.get("KVCACHED_SOAK") == "1"
EXAMPLES = int(os.environ.get("KVCACHED_SOAK_EXAMPLES", "10000")) if SOAK else int(
    os.environ.get("KVCACHED_PROPERTY_EXAMPLES", "25"))
SHIFT = 3600.0          # plan "now" = real time + SHIFT
GRACE = 60.0
OTHER_UID = 65534

SOCKET_STATES = ["absent", "stale", "live", "stopped", "symlink", "fifo", "regular", "dir", "other_owner"]
SEGMENT_STATES = ["none", "stale", "empty", "lease", "held_open", "mapped", "stopped_lease",
                  "hardlink", "symlink", "bad_size"]
DIR_MODES = ["none", "normal", "world_writable", "symlink", "bad_hash", "extras"]
NAME_KINDS = ["explicit", "explicit", "explicit", "owner_env", "group_alive", "pgid_reused", "default_dead"]
# Share of quiet examples that run the installed `kvctl gc` (subprocess, ~1 s each)
# instead of the library: on by default, off in soak mode unless KVCACHED_SOAK_KVCTL=1.
KVCTL_SHARE = os.path.exists(KVCTL) and (not SOAK or os.environ.get("KVCACHED_SOAK_KVCTL") == "1")
EVENTS = ["successor_binds", "successor_lease", "segment_recreated", "segment_leased", "worker_exits",
          "dir_recreated", "stage_recreated"]


@st.composite
def deployment_specs(draw: st.DrawFn) -> dict:
    tp = draw(st.integers(1, 4))
    pp = draw(st.integers(1, 3))
    return {
        "name_kind": draw(st.sampled_from(NAME_KINDS)),
        "tp": tp, "pp": pp,
        "dir": draw(st.sampled_from(DIR_MODES)),
        "lease": draw(st.sampled_from(["none", "none", "live", "stopped"])),
        "sockets": draw(st.lists(st.sampled_from(SOCKET_STATES) | st.sampled_from(["stale", "absent", "live"]),
                                 min_size=tp * pp, max_size=tp * pp)),
        "segment": draw(st.sampled_from(SEGMENT_STATES) | st.just("stale")),
        "young": draw(st.booleans()) and draw(st.booleans()),
    }


node_states = st.fixed_dictionaries({
    "deployments": st.lists(deployment_specs(), min_size=1, max_size=4),
    "blind_netns": st.booleans(),
    "via_kvctl": st.sampled_from([False] * 5 + [True]) if KVCTL_SHARE else st.just(False),
    "events": st.just([]) | st.lists(st.tuples(st.sampled_from(EVENTS), st.integers(0, 3), st.integers(0, 11)),
                                     min_size=1, max_size=4),
})


@dataclass
class Node:
    """One piece of state we made, and what the model says of it."""

    path: str
    ident: tuple[int, int] | None
    expect: str            # "removable", or why it must stay: live / foreign / young / unknown / kept
    listener: socket.socket | None = None


@dataclass
class World:
    layout: Layout
    base: str
    nodes: dict[str, Node] = field(default_factory=dict)
    fds: list[int] = field(default_factory=list)
    socks: list[socket.socket] = field(default_factory=list)
    maps: list[mmap.mmap] = field(default_factory=list)
    stopped_fds: list[int] = field(default_factory=list)  # handed to the stopped child
    child: int | None = None
    outside: dict[str, tuple[bytes, float]] = field(default_factory=dict)  # files never to change
    protected: set[str] = field(default_factory=set)     # made by a successor during the run
    exited: set[str] = field(default_factory=set)        # live at plan time, listener closed since

    def add(self, path: str, expect: str, listener: socket.socket | None = None) -> None:
        try:
            st_ = os.lstat(path)
            ident: tuple[int, int] | None = (st_.st_dev, st_.st_ino)
        except FileNotFoundError:
            ident = None
        self.nodes[path] = Node(path, ident, expect, listener)

    def close(self) -> None:
        if self.child is not None:
            os.kill(self.child, signal.SIGKILL)
            os.waitpid(self.child, 0)
        for m in self.maps:
            m.close()
        for s in self.socks:
            s.close()
        for fd in self.fds + self.stopped_fds:
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self.base, ignore_errors=True)


def _listen(path: str, backlog: int = 64) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    s.bind(path)
    s.listen(backlog)
    return s


def _stale_socket(path: str) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.close()  # the node stays; nobody listens: connect gets ECONNREFUSED


def _answers(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
    try:
        s.connect(path)
        return True
    except OSError as e:
        return e.errno in (errno.EAGAIN, errno.EINPROGRESS)
    finally:
        s.close()


def _mtime_all(paths: list[str], t: float) -> None:
    # Children first, directories last: making a child changes its directory's mtime.
    for p in sorted(paths, key=lambda p: -p.count("/")):
        try:
            os.utime(p, (t, t), follow_symlinks=False)
        except FileNotFoundError:
            pass


def _unused_pgid(skip: int) -> int:
    """A PID that names no process (so no group leader) now; the skip-th such from the top."""
    for cand in range(30000, 1000, -7):
        if not os.path.exists(f"/proc/{cand}"):
            if skip == 0:
                return cand
            skip -= 1
    raise RuntimeError("no free pid")


class Builder:
    """Turns one drawn node state into real files, sockets, locks and processes."""

    def __init__(self, world: World, helpers: dict[str, Helper], now: float) -> None:
        self.w = world
        self.L = world.layout
        self.helpers = helpers
        self.now = now
        self.used_names: set[str] = set()

    def name_for(self, i: int, kind: str) -> tuple[str, str]:
        """(name, effective kind): at most one deployment per helper-bound name."""
        if kind == "owner_env" and "owner_env" not in self.used_names:
            self.used_names.add("owner_env")
            return self.helpers["env"].ipc_name, kind  # type: ignore[return-value]
        if kind in ("group_alive", "pgid_reused") and "group" not in self.used_names:
            self.used_names.add("group")
            return f"kvcached_proc_{self.helpers['group'].pid}", kind
        if kind == "default_dead":
            return f"kvcached_proc_{_unused_pgid(i)}", kind
        return f"x{os.getpid()}d{i}", "explicit"

    def build(self, i: int, spec: dict) -> dict:
        w, L = self.w, self.L
        name, kind = self.name_for(i, spec["name_kind"])
        alive = kind in ("owner_env", "group_alive")
        young = spec["young"] and kind != "pgid_reused"
        tp, pp, dmode = spec["tp"], spec["pp"], spec["dir"]
        made: list[str] = []
        root = L.socket_dir(name)
        info = {"name": name, "kind": kind, "root": root, "dir": dmode, "lease_fd": None, "sockets": {},
                "segment": L.segment_path(name)}
        real_root = root
        if dmode == "symlink":
            real_root = os.path.join(w.base, "elsewhere", f"d{i}")
        elif dmode == "bad_hash":
            real_root = os.path.join(L.tmp_dir, f"kvcached-tp-{name}-00000000")
            if name_rules.socket_hash(name) == "00000000":
                real_root = os.path.join(L.tmp_dir, f"kvcached-tp-{name}-11111111")
        if dmode != "none":
            os.makedirs(real_root, 0o700)
            if dmode == "world_writable":
                os.chmod(real_root, 0o777)
            if dmode == "symlink":
                os.symlink(real_root, root)
                secret = os.path.join(real_root, "root-secret")
                with open(secret, "wb") as f:
                    f.write(b"do not touch")
            if dmode == "extras":
                with open(os.path.join(real_root, "notes.txt"), "w") as f:
                    f.write("not ours")
            for stage in range(1, pp):
                os.mkdir(os.path.join(real_root, f"pp{stage}"), 0o700)
            stopped_children: list[int] = []
            for idx, state in enumerate(spec["sockets"]):
                stage, rank = divmod(idx, tp)
                path = os.path.join(real_root, f"pp{stage}" if stage else "", f"w{rank}.sock")
                path = os.path.normpath(path)
                self._make_socket(path, state, stopped_children)
                info["sockets"][path] = (stage, state)
                made.append(path)
            if spec["lease"] != "none":
                fd = os.open(real_root, os.O_RDONLY | os.O_DIRECTORY)
                fcntl.flock(fd, fcntl.LOCK_SH)
                (w.stopped_fds if spec["lease"] == "stopped" else w.fds).append(fd)
                info["lease_fd"] = fd
            made += [os.path.join(real_root, f"pp{s}") for s in range(1, pp)] + [real_root]
        seg = L.segment_path(name)
        self._make_segment(seg, spec["segment"], i)
        if spec["segment"] not in ("none", "hardlink"):  # utime on a hard link would touch root's file
            made.append(seg)
        if young:
            _mtime_all(made, self.now - 5)
        elif kind == "pgid_reused":
            _mtime_all(made, self.helpers["group"].start_time - 100)
        info.update(alive=alive, young=young, made=made, real_root=real_root)
        return info

    def _make_socket(self, path: str, state: str, stopped: list[int]) -> None:
        w = self.w
        if state == "stale":
            _stale_socket(path)
        elif state == "live":
            w.socks.append(_listen(path))
        elif state == "stopped":
            s = _listen(path, backlog=1)
            w.stopped_fds.append(s.detach())  # the stopped child keeps it; we close our copy after fork
        elif state == "symlink":
            os.symlink(os.path.join(w.base, "elsewhere", "target.sock"), path)
        elif state == "fifo":
            os.mkfifo(path)
        elif state == "regular":
            with open(path, "w") as f:
                f.write("x")
        elif state == "dir":
            os.mkdir(path)
        elif state == "other_owner":
            _stale_socket(path)
            os.chown(path, OTHER_UID, OTHER_UID, follow_symlinks=False)

    def _make_segment(self, seg: str, state: str, i: int) -> None:
        w = self.w
        if state == "none":
            return
        if state in ("hardlink", "symlink"):
            target = os.path.join(w.base, "elsewhere", f"rootfile{i}")
            with open(target, "wb") as f:
                f.write(b"\0" * 24)
            st_ = os.stat(target)
            w.outside[target] = (b"\0" * 24, st_.st_mtime)
            (os.link if state == "hardlink" else os.symlink)(target, seg)
            return
        if state == "bad_size":
            with open(seg, "wb") as f:
                f.write(b"\0" * 100)
            return
        if state == "empty":
            open(seg, "wb").close()
            return
        create_segment(seg, 1 << 30)
        if state == "lease":
            lease = SegmentLease(seg)
            lease.acquire()
            w.fds.append(lease._fd)  # type: ignore[arg-type]
            lease._fd = None
        elif state == "stopped_lease":
            lease = SegmentLease(seg)
            lease.acquire()
            w.stopped_fds.append(lease._fd)  # type: ignore[arg-type]
            lease._fd = None
        elif state == "held_open":
            w.fds.append(os.open(seg, os.O_RDONLY))
        elif state == "mapped":
            fd = os.open(seg, os.O_RDWR)
            w.maps.append(mmap.mmap(fd, 24))
            os.close(fd)

    def start_stopped_child(self) -> None:
        """Fork a child that inherits the 'stopped' fds, then SIGSTOP it; our copies close."""
        w = self.w
        if not w.stopped_fds:
            return
        for fd in w.stopped_fds:
            os.set_inheritable(fd, True)
        pid = os.fork()
        if pid == 0:
            try:
                while True:
                    signal.pause()
            finally:
                os._exit(0)
        w.child = pid
        os.kill(pid, signal.SIGSTOP)
        wait_for_state(pid, "T")  # really stopped before our copies of its fds close
        for fd in w.stopped_fds:
            os.close(fd)
        w.stopped_fds = []


_RANK = {"stale": 0, "young": 1, "unknown": 2, "live": 3}
_LIVE_SEGMENTS = ("lease", "held_open", "mapped", "stopped_lease")
_FOREIGN_SOCKETS = ("symlink", "fifo", "regular", "dir", "other_owner")


def _expectations(world: World, infos: list[dict], blind: bool) -> None:
    """The model: which made path a quiet real run must remove, and why every other one stays.

    `blind` (a network namespace we could not read) must change nothing: whether
    a socket is bound comes from the bind test, which sees every namespace.

    - A socket node stands alone: live when bound (listening, or held by the
      stopped child) or under its directory's lease; foreign when not a socket of
      ours; young inside the grace age; else stale, whoever else is alive.
    - Directories and the segment also count the deployment's processes (its
      name in an environment, or the PGID of a default name; a newer group of
      a Python process is ambiguous: unknown).
    - Then the deployment speaks for its segment and directories: while any of
      its entries is live (unknown, young) on its own evidence, they are too.
    """
    for info in infos:
        dmode, alive, young, kind = info["dir"], info["alive"], info["young"], info["kind"]
        leased = info["lease_fd"] is not None
        scanned = dmode in ("normal", "world_writable", "extras")
        ambiguous = kind == "pgid_reused"  # the group helper is a Python process: it may be a new serve
        stages = sorted({stage for stage, _ in info["sockets"].values()} - {0})
        seg, seg_state = info["segment"], info["seg_state"]
        # Explicit names are tied to kvcached by a socket directory of a valid hash, a
        # live process's KVCACHED_IPC_NAME, or our runtime's mark on the segment
        # (create_segment sets it): an unmarked bare explicit segment is not a candidate.
        marked = seg_state not in ("none", "hardlink", "symlink", "bad_size", "empty")
        seg_scanned = (name_rules.DEFAULT_NAME_RE.match(info["name"]) is not None or alive or marked
                       or dmode in ("normal", "world_writable", "extras", "symlink"))
        seg_carrier = os.path.lexists(seg) and seg_scanned and seg_state not in ("hardlink", "symlink", "bad_size")

        socks: dict[str, tuple[int, str]] = {}
        for path, (stage, state) in info["sockets"].items():
            if state == "absent":
                continue
            if state in _FOREIGN_SOCKETS or not scanned:
                why = "foreign"  # or inside a symlinked / bad-hash directory: never entered
            elif state in ("live", "stopped") or leased:
                why = "live"
            elif young:
                why = "young"
            else:
                why = "stale"
            socks[path] = (stage, why)

        # Directories whose own evidence counts: a world-writable root is foreign before anything
        # else; a root with an entry not ours is live when leased or named by a live process, and
        # foreign otherwise (so never young); stage directories inside a scanned root always count.
        stage_carrier = scanned and bool(stages)
        dir_carrier = dmode in ("normal", "extras") or stage_carrier
        evidence = max([_RANK.get(why, -1) for _, why in socks.values()] + [0])
        if leased and dir_carrier:
            evidence = 3
        if seg_carrier and seg_state in _LIVE_SEGMENTS:
            evidence = 3
        if dir_carrier or seg_carrier:
            evidence = max(evidence, 3 if alive else 2 if ambiguous else 0)
        if young and (dmode == "normal" or stage_carrier or seg_carrier):
            evidence = max(evidence, 1)

        for path, (_, why) in socks.items():
            world.add(path, "removable" if why == "stale" else why)
        stage_removable: dict[int, bool] = {}
        for stage in stages if dmode != "none" else []:
            mine = [why for st_, why in socks.values() if st_ == stage]
            ok = scanned and evidence == 0 and all(w == "stale" for w in mine)
            stage_removable[stage] = ok
            world.add(os.path.join(info["real_root"], f"pp{stage}"), "removable" if ok else "kept")
        if dmode != "none":
            if dmode == "bad_hash":
                world.add(info["real_root"], "foreign")
            elif dmode != "normal":
                world.add(info["root"], "foreign")
            else:
                ok = evidence == 0 and all(why == "stale" for st_, why in socks.values() if st_ == 0) \
                    and all(stage_removable.values())
                world.add(info["root"], "removable" if ok else "kept")
            if dmode == "symlink":
                secret = os.path.join(os.readlink(info["root"]), "root-secret")
                world.outside[secret] = (b"do not touch", os.stat(secret).st_mtime)
        if os.path.lexists(seg):
            if not seg_scanned:
                world.add(seg, "unscanned")
            elif not seg_carrier:
                world.add(seg, "foreign")
            else:
                ok = seg_state in ("stale", "empty") and evidence == 0
                world.add(seg, "removable" if ok else "kept")


def _apply_events(world: World, infos: list[dict], events: list[tuple[str, int, int]]) -> None:
    """Change the node between plan and act, the way successors and dying workers do."""
    for kind, di, si in events:
        info = infos[di % len(infos)]
        socks = [p for p, (_, s) in info["sockets"].items()]
        if kind == "successor_binds" and socks and info["dir"] in ("normal", "world_writable", "extras"):
            path = socks[si % len(socks)]
            if not os.path.isdir(os.path.dirname(path)) or os.path.isdir(path):
                continue
            try:
                os.unlink(path)  # upstream's blind os.remove before bind
            except FileNotFoundError:
                pass
            world.socks.append(_listen(path))
            world.protected.add(path)
        elif kind == "successor_lease" and info["dir"] in ("normal", "world_writable", "extras"):
            if not os.path.isdir(info["root"]):
                continue
            fd = os.open(info["root"], os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            fcntl.flock(fd, fcntl.LOCK_SH)
            world.fds.append(fd)
            for p in socks + [info["root"]] + [p for p in info["made"] if os.path.basename(p).startswith("pp")]:
                if os.path.lexists(p):
                    world.protected.add(p)
        elif kind in ("segment_recreated", "segment_leased") and info["seg_state"] in ("stale", "empty"):
            seg = info["segment"]
            if kind == "segment_recreated":
                try:
                    os.unlink(seg)
                except FileNotFoundError:
                    pass
                create_segment(seg, 1 << 20)
            elif os.path.exists(seg) and os.path.getsize(seg) == 24:
                lease = SegmentLease(seg)
                lease.acquire()
                world.fds.append(lease._fd)  # type: ignore[arg-type]
                lease._fd = None
            else:
                continue
            world.protected.add(seg)
        elif kind == "worker_exits":
            live = [n for n in world.nodes.values() if n.path in socks and n.expect == "live"]
            for s in list(world.socks):
                try:
                    bound = s.getsockname()
                except OSError:
                    continue
                if live and bound == live[si % len(live)].path:
                    s.close()
                    world.socks.remove(s)
                    world.exited.add(bound)
                    break
        elif kind in ("dir_recreated", "stage_recreated") and info["dir"] in ("normal", "world_writable",
                                                                                 "extras"):
            target = info["root"] if kind == "dir_recreated" else os.path.join(info["root"], "pp1")
            if not os.path.isdir(target) or os.path.islink(target):
                continue
            # Only re-create a directory that holds no live listener of ours: a
            # successor would not rip a live deployment out.
            if any(n.expect == "live" and n.path.startswith(target + "/") for n in world.nodes.values()) or any(
                    p.startswith(target + "/") for p in world.protected):
                continue
            shutil.rmtree(target)
            os.mkdir(target, 0o700)
            new = os.path.join(target, "w0.sock")
            world.socks.append(_listen(new))
            world.protected.update({target, new})
            for p in list(world.nodes):
                if p.startswith(target + "/"):
                    world.nodes[p].expect = "gone"  # removed by the successor, not by us


@pytest.fixture(scope="module")
def helpers() -> Iterator[dict[str, Helper]]:
    env = Helper(ipc_name=f"x{os.getpid()}live")
    group = Helper()
    time.sleep(1.1)  # entries made from now on are newer than the helpers (1 s start-time slack)
    yield {"env": env, "group": group}
    env.stop()
    group.stop()


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("prop"))


def _facts(blind: bool) -> Facts:
    """One /proc pass; `blind` adds a network namespace we could not read."""
    f = gather_facts()
    if blind:
        f.unreadable_netns.add("net:[4026599999]")
    return f


@dataclass
class CliEntry:
    """A `kvctl gc --json` entry, shaped like cleanup.Entry for the checks below."""

    path: str
    state: State
    action: Action
    note: str
    decision: Any


@dataclass
class CliReport:
    entries: list[CliEntry]
    code: int

    @property
    def failures(self) -> list[CliEntry]:
        return [e for e in self.entries if e.action is Action.FAILED]


def _kvctl_gc(world: World, *args: str) -> CliReport:
    env = {**os.environ, "KVCTL_LOCK": os.path.join(world.base, "kvctl-gc.lock"), "NO_COLOR": "1"}
    r = subprocess.run([KVCTL, "--root", world.layout.root, "gc", "--min-age", "0", "--json", *args],
                       capture_output=True, text=True, env=env, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode in (0, 3), f"kvctl gc {args} exited {r.returncode}: {r.stderr[-2000:]}"
    doc = json.loads(r.stdout)
    entries = [CliEntry(e["path"], State(e["state"]), Action(e["action"]),
                        e.get("detail", ""), type("D", (), {"reason": e["reason"]})()) for e in doc["entries"]]
    stale_left = any(e.state is State.STALE and e.action is not Action.REMOVED for e in entries)
    assert r.returncode == (3 if stale_left else 0), f"kvctl gc {args}: exit {r.returncode}, stale left: {stale_left}"
    return CliReport(entries, r.returncode)


def _removed(r: Report | CliReport) -> set[str]:
    return {e.path for e in r.entries if e.action is Action.REMOVED and "already gone" not in e.note}


def _would(r: Report | CliReport) -> set[str]:
    return {e.path for e in r.entries if e.action is Action.WOULD_REMOVE}


def _explain(paths: set[str], *reports: Report | CliReport) -> str:
    """Each path with what every report said of it (state, reason, action, note)."""
    out = []
    for p in sorted(paths):
        said = [f"{e.state}/{e.decision.reason}/{e.action}{'/' + e.note if e.note else ''}"
                for r in reports for e in r.entries if e.path == p]
        out.append(f"{p}: {' vs '.join(said) or 'not in the report'}")
    return "; ".join(out)


def _check_survivors(world: World) -> None:
    for n in world.nodes.values():
        if n.expect in ("removable", "gone"):
            continue
        if n.path in world.protected and n.ident is not None:
            continue  # checked below by what the successor made
        st_ = os.lstat(n.path)  # FileNotFoundError here is the bug we look for
        assert (st_.st_dev, st_.st_ino) == n.ident, f"{n.path} ({n.expect}) was replaced"
    for p in world.protected:
        assert os.path.lexists(p), f"{p}, made by a successor during the run, was removed"
    for s in world.socks:
        path = s.getsockname()
        assert _answers(path), f"live listener {path} no longer answers"
    for path, (content, mtime) in world.outside.items():
        with open(path, "rb") as f:
            assert f.read() == content, f"{path} was written"
        assert os.stat(path).st_mtime == mtime, f"{path} mtime changed"


def _run_example(state: dict, helpers: dict[str, Helper], base_dir: str, note=lambda _s: None) -> None:
    if state.get("via_kvctl"):
        state = {**state, "events": [], "blind_netns": False}  # a quiet, fully visible node
    base = os.path.join(base_dir, f"e{time.monotonic_ns() % 10**9}")
    os.makedirs(os.path.join(base, "elsewhere"))
    world = World(make_root(base), base)
    now = time.time() + SHIFT
    policy = Policy(grace=GRACE)
    try:
        b = Builder(world, helpers, now)
        infos = []
        for i, spec in enumerate(state["deployments"]):
            info = b.build(i, spec)
            info["seg_state"] = spec["segment"]
            infos.append(info)
        b.start_stopped_child()
        blind = state["blind_netns"]
        _expectations(world, infos, blind)
        removable = {p for p, n in world.nodes.items() if n.expect == "removable"}

        if not state["events"]:
            dry: Report | CliReport
            real: Report | CliReport
            if state.get("via_kvctl"):
                # The installed CLI end to end. `--min-age 0` at the real time classifies like
                # the library with grace 60 one hour ahead: young entries carry future mtimes.
                dry = _kvctl_gc(world, "--dry-run")
                real = _kvctl_gc(world, "--yes")
                note("quiet via kvctl")
            else:
                dry = execute(plan(world.layout, policy, facts=_facts(blind), now=now), dry_run=True)
                real = execute(plan(world.layout, policy, facts=_facts(blind), now=now), dry_run=False)
            removed = _removed(real)
            note(f"quiet: removed {'none' if not removed else '1-5' if len(removed) <= 5 else '>5'}")
            note(f"quiet: kept {sorted({n.expect for n in world.nodes.values() if n.expect != 'removable'})}")
            assert removed <= removable, f"removed what the model keeps: {_explain(removed - removable, real)}"
            assert removable <= removed, f"left stale entries: {_explain(removable - removed, real)}"
            assert _would(dry) == removed, "dry-run plan differs from what the real run removed: " + _explain(
                _would(dry) ^ removed, dry, real)
            assert not real.failures, [e.note for e in real.failures]
            for p in removable:
                assert not os.path.lexists(p), f"{p} reported removed but still there"
            again = execute(plan(world.layout, policy, facts=_facts(blind), now=now), dry_run=True)
            assert not _would(again), f"a second run would remove more: {sorted(_would(again))}"
            left = {e.path for e in again.entries if e.state is State.STALE}
            assert not left, f"a second run still finds stale entries: {sorted(left)}"
        else:
            planned = plan(world.layout, policy, facts=_facts(blind), now=now)
            _apply_events(world, infos, state["events"])
            real = execute(planned, dry_run=False)  # type: ignore[assignment]
            removed = _removed(real)
            note(f"events: {sorted({k for k, _, _ in state['events']})[:2]} removed={bool(removed)} "
                  f"protected={bool(world.protected)}")
            allowed = removable - world.protected
            assert removed <= allowed, f"removed what it must not: {sorted(removed - allowed)}"
            for path in world.exited:
                assert os.path.lexists(path), f"{path}, live at plan time, was removed"
        _check_survivors(world)
    finally:
        world.close()


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.data_too_large],
          phases=[Phase.explicit, Phase.generate, Phase.shrink] if not SOAK else [Phase.generate])
@given(state=node_states)
def test_cleaner_invariants(state: dict, helpers: dict[str, Helper], base_dir: str) -> None:
    """Never removes live/unknown/young/foreign; removes all stale when quiet; idempotent; dry == real."""
    _run_example(state, helpers, base_dir, event)


def test_quiet_mixed_node_example(helpers: dict[str, Helper], base_dir: str) -> None:
    """One hand-picked node with every kind of entry, as a readable regression example."""
    dep = lambda **kw: {"name_kind": "explicit", "tp": 2, "pp": 2, "dir": "normal", "lease": "none",
                        "sockets": ["stale"] * 4, "segment": "stale", "young": False, **kw}
    state = {"deployments": [dep(), dep(sockets=["live", "stale", "stopped", "symlink"], segment="lease"),
                             dep(dir="world_writable", segment="hardlink"),
                             dep(name_kind="pgid_reused", segment="stale"),
                             # A leased directory holding an entry not ours keeps its segment live.
                             dep(tp=1, pp=1, dir="extras", lease="live", sockets=["absent"])],
             "blind_netns": False, "events": []}
    _run_example(state, helpers, base_dir)
