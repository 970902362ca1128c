"""One pass over /proc per run: who is alive, what they hold, and what we could not see.

Every field a decision may need is read here, once, so that `decide` stays a
pure function and a run's cost is linear in processes + candidates.
"""

from __future__ import annotations

import errno
import os
import stat
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from ..base.fdstat import fd_stat
from ..base.mounts import hidepid
from ..base.name_rules import ENV_NAME, sanitize
from ..state.lease import LockEntry, read_proc_locks
from .sight import hides_other_users

# Process start times come from boot-relative ticks plus a whole-second btime,
# so they can be off by up to a second: a process is taken to have started
# before a change when it started no later than one second after it.
START_SLACK = 1.0
_ENGINE_MARKERS = ("python", "vllm", "sglang", "kvcached", "ray::", "engine", "worker", "pt_")
_ENV_KEY = ENV_NAME.encode() + b"="


class ProcessInfo(NamedTuple):
    """One process as /proc showed it; identity is (pid, start_time).

    An immutable NamedTuple, not a frozen dataclass: a pass builds one per
    process, and a frozen dataclass's __init__ pays an object.__setattr__ per field (bench/README.md).
    """

    pid: int
    start_time: float  # seconds since the epoch
    ppid: int
    pgid: int
    uid: int
    comm: str
    cmdline: tuple[str, ...]
    ipc_name: str | None  # sanitised KVCACHED_IPC_NAME from the environment, if readable and set
    socket_inodes: frozenset[int]
    # (st_dev, st_ino) of every file it holds open but its sockets: whatever path it was opened by, in any
    # mount namespace (a segment's evidence of life compares identities, never paths)
    held_files: frozenset[tuple[int, int]]
    mnt_ns: str | None
    net_ns: str | None
    unreadable: frozenset[str]  # which of environ / fd / ns could not be read (maps: Facts.unreadable_pids)
    # (fd, st_rdev, st_dev, st_ino) of each character device it holds open: what the GPU-holder pass judges
    # (kvcached/node/gpu/holders.py), so that it lists and stats no fd directory again
    char_devices: tuple[tuple[str, int, int, int], ...] = ()
    proc_state: str = ""  # /proc/<pid>/stat's letter when read: D uninterruptible sleep, T stopped, R, S...

    @property
    def complete(self) -> bool:
        return not self.unreadable

    @property
    def engine_like(self) -> bool:
        """Could this process be part of a serving deployment (and so carry its name)?

        Only Python processes and serving engines (vLLM sets titles such as
        `VLLM::EngineCore`) can load kvcached. Used to decide whether a process
        we could not fully read leaves our evidence incomplete: a sandbox init
        or an sshd we may not ptrace is not a reason to keep a dead pool forever.
        """
        text = " ".join((self.comm, *self.cmdline[:2])).lower()
        return any(k in text for k in _ENGINE_MARKERS)


@dataclass(kw_only=True)
class Facts:
    """What one /proc pass saw; read-only once built."""

    proc_root: str
    my_mnt_ns: str | None
    my_net_ns: str | None
    processes: dict[int, ProcessInfo] = field(default_factory=dict)
    # (st_dev, st_ino) of a socket file -> inodes of the listening sockets bound to it,
    # from sock_diag in every network namespace we could enter (sockdiag.py)
    listeners: dict[tuple[int, int], set[int]] = field(default_factory=dict)
    # socket inode -> pids holding it
    socket_holders: dict[int, set[int]] = field(default_factory=dict)
    # (st_dev, st_ino) -> locks from /proc/locks; None until first needed (see the `locks` property)
    lock_table: dict[tuple[int, int], list[LockEntry]] | None = None
    unreadable_netns: set[str] = field(default_factory=set)
    unreadable_pids: dict[int, frozenset[str]] = field(default_factory=dict)
    hidepid: bool = False
    # hidepid hides other users' processes from this pass (we can see past it by neither CAP_SYS_PTRACE nor gid=):
    # a candidate of another user may have owners the pass never listed
    hidden_users: bool = False
    errors: list[str] = field(default_factory=list)
    # (st_dev, st_ino) -> pids mapping it; None until first needed (see mapped())
    mapped_files: dict[tuple[int, int], list[int]] | None = None
    # Indexes built on first use, so that deciding N candidates stays O(processes + N).
    _index: _Index | None = field(default=None, repr=False, compare=False)
    _blind: list[ProcessInfo] | None = field(default=None, repr=False, compare=False)
    # The engine pass's reads (leftovers/evidence.py), made on first use; plain gc never asks for them.
    _device_maps: dict[frozenset[int], dict[tuple[int, int], list[int]]] = field(
        default_factory=dict, repr=False, compare=False)
    _ns_pids: dict[int, tuple[int, ...]] | None = field(default=None, repr=False, compare=False)
    # map_users' reads by device: what was read, and what a later pass asked to be read with it (also_map)
    _per_device: dict[int, dict[tuple[int, int], list[int]]] = field(default_factory=dict, repr=False,
                                                                     compare=False)
    _maps_read: set[int] = field(default_factory=set, repr=False, compare=False)
    _maps_wanted: set[int] = field(default_factory=set, repr=False, compare=False)

    @property
    def locks(self) -> dict[tuple[int, int], list[LockEntry]]:
        """Every lock the kernel lists, read on first use.

        A process's first read of /proc/locks is slow in the kernel (bench/README.md),
        which a kvctl run on a node with nothing to judge should not pay.
        """
        if self.lock_table is None:
            self.lock_table = read_proc_locks(self.proc_root)
        return self.lock_table

    def _indexed(self) -> _Index:
        idx = self._index
        if idx is None or idx.n != len(self.processes):
            idx = _Index(len(self.processes), defaultdict(list), defaultdict(list), defaultdict(list))
            for p in self.processes.values():
                idx.pgid[p.pgid].append(p)
                if p.ipc_name:
                    idx.name[p.ipc_name].append(p)
                for ident in p.held_files:
                    idx.file[ident].append(p)
            self._index = idx
        return idx

    def by_pgid(self, pgid: int) -> list[ProcessInfo]:
        return self._indexed().pgid.get(pgid, [])

    def by_ipc_name(self, name: str) -> list[ProcessInfo]:
        return self._indexed().name.get(name, [])

    def holders_of_file(self, ident: tuple[int, int]) -> list[ProcessInfo]:
        """Processes that hold `ident` open or map it."""
        held = self._indexed().file.get(ident, [])
        mapped = [self.processes[pid] for pid in self.mapped().get(ident, ()) if pid in self.processes]
        return held + [p for p in mapped if p not in held] if mapped else held

    def mapped(self) -> dict[tuple[int, int], list[int]]:
        """/dev/shm files mapped by each process, read from /proc/<pid>/maps on first use.

        Reading every process's maps is most of a /proc pass's cost, and only a
        segment without a lease needs it; so it is read once, when first asked.
        """
        if self.mapped_files is not None:
            return self.mapped_files
        out: dict[tuple[int, int], list[int]] = {}
        for pid in self.processes:
            if (raw := self._read_maps(pid)) is None:
                continue
            for ident in _shm_maps(raw):
                out.setdefault(ident, []).append(pid)
        self.mapped_files = out
        self._blind = None  # new unreadable processes may be blind spots
        return out

    def map_users(self, devices: Iterable[int]) -> dict[tuple[int, int], list[int]]:
        """Every file on `devices` mapped by each process, by identity: one read of every /proc/<pid>/maps.

        By device, not by path: a process may map a /dev/shm file through any
        mount of that tmpfs. The same read fills `mapped()` when it has not
        run yet, and collects the devices `also_map` asked for, so a run whose
        passes ask for several read each maps file once.
        """
        key = frozenset(devices)
        if key in self._device_maps:
            return self._device_maps[key]
        if key - self._maps_read:
            self._read_device_maps(key | self._maps_wanted)
        out: dict[tuple[int, int], list[int]] = {}
        for dev in key:
            out.update(self._per_device.get(dev, {}))  # idents carry their device: no two devices share one
        self._device_maps[key] = out
        return out

    def maps_read(self, devices: Iterable[int]) -> bool:
        """Whether a read of every maps file has already collected the mappings on `devices`."""
        return set(devices) <= self._maps_read

    def also_map(self, devices: Iterable[int]) -> None:
        """Devices whose mappings the next read of every maps file collects too (a later pass's question)."""
        self._maps_wanted |= set(devices) - self._maps_read

    def _read_device_maps(self, key: frozenset[int]) -> None:
        needles = [(dev, f" {os.major(dev):02x}:{os.minor(dev):02x} ".encode()) for dev in key]
        plain: dict[tuple[int, int], list[int]] | None = {} if self.mapped_files is None else None
        for dev in key:
            self._per_device[dev] = {}
        for pid in self.processes:
            if (raw := self._read_maps(pid)) is None:
                continue
            if plain is not None:
                for ident in _shm_maps(raw):
                    plain.setdefault(ident, []).append(pid)
            for ident in _device_maps(raw, needles):
                self._per_device[ident[0]].setdefault(ident, []).append(pid)
        if plain is not None:
            self.mapped_files = plain
        self._maps_read |= key
        self._maps_wanted -= key
        self._blind = None

    def _read_maps(self, pid: int) -> bytes | None:
        """/proc/<pid>/maps, or None where it cannot be read.

        EACCES/EPERM makes the process a blind spot (it may map a candidate we
        cannot see); any other error means it exited since the pass, which
        hides nothing.
        """
        try:
            return _read(f"{self.proc_root}/{pid}/maps")
        except PermissionError:
            self.unreadable_pids[pid] = self.unreadable_pids.get(pid, frozenset()) | {"maps"}
        except OSError:
            pass
        return None

    def namespace_pids(self) -> dict[int, tuple[int, ...]]:
        """Each process's PID in every PID namespace it is in, outermost first (NSpid), read on first use.

        A PID in a file name is the one its creator saw, maybe inside a
        container: from the host it is only found through NSpid.
        """
        if self._ns_pids is None:
            out: dict[int, tuple[int, ...]] = {}
            for pid in self.processes:
                try:
                    out[pid] = _status_nspids(_read(f"{self.proc_root}/{pid}/status"), pid)
                except OSError:
                    out[pid] = (pid,)
            self._ns_pids = out
        return self._ns_pids

    def serving_pids(self, ident: tuple[int, int]) -> tuple[int, ...]:
        """PIDs holding a listening socket bound to the file `ident`."""
        inodes = self.listeners.get(ident)
        if not inodes:
            return ()  # most nodes a gc judges: nobody listens (asked for every socket of a full node)
        pids: set[int] = set()
        for ino in inodes:
            pids |= self.socket_holders.get(ino, set())
        return tuple(sorted(pids))

    def uid_of(self, pid: int) -> int | None:
        """The owner of a process the pass recorded, None when it did not (sight.PassView)."""
        p = self.processes.get(pid)
        return None if p is None else p.uid

    def engine_like(self, pid: int) -> bool:
        """Whether a process the pass recorded could be part of a deployment (sight.PassView)."""
        p = self.processes.get(pid)
        return p is not None and p.engine_like

    def blind_spots(self, uid: int) -> list[int]:
        """Engine-like processes of `uid` that we could not fully read.

        Such a process might hold, map or name a candidate without our seeing it,
        so a candidate it could belong to cannot be proven stale. When it started
        says nothing: a same-name successor may have started a second ago.
        """
        blind = self._blind
        if blind is None:
            blind = self._blind = [
                p for pid in self.unreadable_pids if (p := self.processes.get(pid)) is not None and p.engine_like]
        if not blind:
            return []  # the usual case, asked once per candidate
        return [p.pid for p in blind if p.uid == uid]


class _Index(NamedTuple):
    n: int  # processes indexed; a Facts built by hand in tests may grow after a first query
    pgid: dict[int, list[ProcessInfo]]
    name: dict[str, list[ProcessInfo]]
    file: dict[tuple[int, int], list[ProcessInfo]]


_CHUNK = 65536


def _read(path: str, *, whole: bool = False) -> bytes:
    """The file's bytes, read to its end. `whole`: the file is one that /proc writes out in one read.

    /proc/<pid>/stat and status (one record each, generated whole into the
    reader's buffer) and cmdline and environ (copied until the buffer or the
    text ends) return everything in one read when it fits, so for them a short
    read is the end, and the read that would return nothing is not made: a
    quarter of the pass's syscalls. A record-by-record file such as maps
    returns about a page per read, short or not: it is read until a read
    returns nothing.
    """
    # os.open/os.read, not open(): a buffered file object costs more than the read itself.
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunk = os.read(fd, _CHUNK)
        if whole and len(chunk) < _CHUNK:
            return chunk
        chunks = [chunk]
        while chunk:
            chunk = os.read(fd, _CHUNK)
            chunks.append(chunk)
        return chunks[0] if len(chunks) == 2 else b"".join(chunks)
    finally:
        os.close(fd)


def _boot_time(proc_root: str) -> float:
    for line in _read(f"{proc_root}/stat").splitlines():
        if line.startswith(b"btime "):
            return float(line.split()[1])
    raise OSError("no btime in /proc/stat")


_CLK_TCK = os.sysconf("SC_CLK_TCK")


PF_KTHREAD = 0x00200000


def _parse_stat(raw: bytes, btime: float) -> tuple[str, int, int, float, bool, str]:
    """(comm, ppid, pgid, start time, gone, state letter); gone for kernel threads and zombies."""
    # comm may contain spaces and parentheses: split at the last ')'.
    lpar, rpar = raw.index(b"("), raw.rindex(b")")
    comm = raw[lpar + 1:rpar].decode(errors="replace")
    rest = raw[rpar + 2:].split()
    state, ppid, pgid, flags, start_ticks = rest[0], int(rest[1]), int(rest[2]), int(rest[6]), int(rest[19])
    # A zombie keeps its pid and pgid until reaped but holds nothing and will never
    # serve again: counting it would keep a dead group "alive".
    gone = bool(flags & PF_KTHREAD) or state in (b"Z", b"X", b"x")
    return comm, ppid, pgid, btime + start_ticks / _CLK_TCK, gone, state.decode(errors="replace")


def process_start_time(pid: int, proc_root: str = "/proc") -> float | None:
    """The start time `gather_facts` records for `pid` (same clock, same rounding); None when gone."""
    try:
        _, _, _, start, gone, _ = _parse_stat(_read(f"{proc_root}/{pid}/stat"), _boot_time(proc_root))
    except (OSError, ValueError, IndexError):
        return None
    return None if gone else start


def _env_ipc_name(raw: bytes) -> str | None:
    # One search rather than splitting the whole environment: a pass reads every
    # process's, and the first KVCACHED_IPC_NAME= item is the one getenv returns.
    if raw.startswith(_ENV_KEY):
        start = len(_ENV_KEY)
    else:
        at = raw.find(b"\0" + _ENV_KEY)
        if at < 0:
            return None
        start = at + 1 + len(_ENV_KEY)
    end = raw.find(b"\0", start)
    value = raw[start:end if end >= 0 else len(raw)].decode(errors="replace")
    return sanitize(value) if value else None


def _shm_maps(raw: bytes) -> set[tuple[int, int]]:
    out = set()
    # One search for the marker, not a split of every line: a Python process's maps has thousands of
    # lines and a handful under /dev/shm (bench/bench_engines.py measures the split; bench/README.md).
    at = raw.find(b"/dev/shm/")
    while at >= 0:
        start = raw.rfind(b"\n", 0, at) + 1
        end = raw.find(b"\n", at)
        if end < 0:
            end = len(raw)
        parts = raw[start:end].split(None, 5)
        if len(parts) >= 6:
            try:
                maj, mnr = parts[3].split(b":")
                out.add((os.makedev(int(maj, 16), int(mnr, 16)), int(parts[4])))
            except ValueError:
                pass
        at = raw.find(b"/dev/shm/", end)
    return out


def _device_maps(raw: bytes, needles: list[tuple[int, bytes]]) -> set[tuple[int, int]]:
    """(st_dev, st_ino) of each mapping in `raw` on one of the devices, each with its " MM:mm " field text.

    A line is "start-end perms offset MM:mm inode path": the device field
    is found with one search per device (a maps file has thousands of lines,
    few of them on a tmpfs), and a hit counts only as the line's fourth field.
    """
    out = set()
    for dev, needle in needles:
        at = raw.find(needle)
        while at >= 0:
            line_start = raw.rfind(b"\n", 0, at) + 1
            begin = at + len(needle)
            line_end = raw.find(b"\n", begin)
            line_end = len(raw) if line_end < 0 else line_end
            end = raw.find(b" ", begin, line_end)  # the inode ends at a space, or the line does (no path)
            if raw.count(b" ", line_start, at) == 2:
                try:
                    ino = int(raw[begin:line_end if end < 0 else end])
                except ValueError:
                    ino = 0
                if ino:
                    out.add((dev, ino))
            at = raw.find(needle, begin)
    return out


def _status_nspids(raw: bytes, pid: int) -> tuple[int, ...]:
    at = raw.find(b"\nNSpid:")
    if at < 0:
        return (pid,)  # a kernel before 4.1: one namespace as far as we can tell
    end = raw.find(b"\n", at + 7)
    try:
        return tuple(int(x) for x in raw[at + 7:end if end >= 0 else len(raw)].split())
    except ValueError:
        return (pid,)


def _scan_fds(fd_dir: str, held: set[tuple[int, int]], sockets: set[int],
              chars: list[tuple[str, int, int, int]]) -> None:
    dir_fd = os.open(fd_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for fd in os.listdir(dir_fd):
            try:
                st = fd_stat(dir_fd, fd)
            except PermissionError:
                # Root without CAP_SYS_PTRACE may list another user's fd directory (DAC override) but not
                # follow a link in it: the process is unread, not empty.
                raise
            except OSError:
                continue  # this file's filesystem failed the stat (a FUSE daemon gone): as a closed fd, unseen
            if st is None:
                continue  # closed between listdir and the stat
            kind = stat.S_IFMT(st.mode)
            if kind == stat.S_IFSOCK:
                sockets.add(st.ino)
                continue
            # Every identity, not only those under a path with /dev/shm/ in it: a pod's /dev/shm, a --root tree
            # and a renamed directory show other paths. Only a candidate's own identity is ever looked up.
            held.add((st.dev, st.ino))
            if kind == stat.S_IFCHR:
                chars.append((fd, st.rdev, st.dev, st.ino))  # a device node may sit at any path: its number tells
    finally:
        os.close(dir_fd)


def _read_process(proc_root: str, pid: int, btime: float) -> ProcessInfo | None:
    base = f"{proc_root}/{pid}"
    try:
        comm, ppid, pgid, start, gone, proc_state = _parse_stat(_read(f"{base}/stat", whole=True), btime)
        if gone:
            return None
        # One decode, then split: a NUL never continues a UTF-8 sequence, so this is the per-argument decode.
        cmdline = tuple(filter(None, _read(f"{base}/cmdline", whole=True).decode(errors="replace").split("\0")))
    except (OSError, ValueError, IndexError):
        return None  # exited during the pass, or not a process directory
    unreadable: set[str] = set()
    held: set[tuple[int, int]] = set()
    sockets: set[int] = set()
    chars: list[tuple[str, int, int, int]] = []
    # Straight-line reads, no helper closures: this runs once per process on the node.
    ipc_name = None
    try:
        ipc_name = _env_ipc_name(_read(f"{base}/environ", whole=True))
    except OSError as e:
        if _gone(e):
            return None
        unreadable.add("environ")  # EACCES/EPERM and anything unexpected: we could not see it
    try:
        _scan_fds(f"{base}/fd", held, sockets, chars)
    except OSError as e:
        if _gone(e):
            return None
        unreadable.add("fd")
    ns: dict[str, str | None] = {}
    for kind in ("mnt", "net"):
        try:
            ns[kind] = os.readlink(f"{base}/ns/{kind}")
        except OSError as e:
            if _gone(e):
                return None
            ns[kind] = None
            unreadable.add(f"ns/{kind}")
    # Last, one stat of /proc/<pid>, for two answers: it still exists (else it exited while we read it, and
    # what we read may be partial), and its owner is the effective uid, status's second Uid field. procfs
    # owns a process's directory by its euid even when the process is not dumpable (setuid, PR_SET_DUMPABLE
    # 0; only the files inside turn root's), the rule ps relies on. So status, the costliest file of the
    # pass, is not read (bench/bench_gc.py, the /proc pass against ss -xap). Only a process reaped inside
    # this very call shows root: it has exited, holding nothing, as one that exited a moment earlier and
    # would not be recorded at all.
    try:
        uid = os.stat(base).st_uid
    except OSError:
        return None
    return ProcessInfo(pid, start, ppid, pgid, uid, comm, cmdline, ipc_name,
                       frozenset(sockets), frozenset(held), ns["mnt"], ns["net"], frozenset(unreadable),
                       tuple(chars), proc_state)


def _gone(e: OSError) -> bool:
    """The process exited during the pass (ENOENT/ESRCH): gone, not hidden from us.

    Counting it as unreadable would make every candidate of its uid unknown this run.
    """
    return e.errno in (errno.ENOENT, errno.ESRCH)


def _listeners_of(netns_path: str | None) -> dict[tuple[int, int], set[int]]:
    from ..state.sockdiag import listening_sockets

    return listening_sockets(netns_path)


def listening_facts(proc_root: str = "/proc") -> Facts:
    """Only this network namespace's listening Unix sockets: what an engine owner needs to
    name who still serves its workers' nodes, without a full /proc pass."""
    facts = Facts(proc_root=proc_root, my_mnt_ns=None, my_net_ns=None)
    try:
        facts.listeners = _listeners_of(None)
    except OSError:
        facts.unreadable_netns.add("self")
    return facts


def gather_facts(proc_root: str = "/proc") -> Facts:
    """Read every process, and the listening Unix sockets of every network namespace we can enter, once."""
    def my_ns(kind: str) -> str | None:
        try:
            return os.readlink(f"{proc_root}/self/ns/{kind}")
        except OSError:
            return None

    facts = Facts(proc_root=proc_root, my_mnt_ns=my_ns("mnt"), my_net_ns=my_ns("net"))
    facts.hidepid = hidepid(proc_root)
    facts.hidden_users = facts.hidepid and hides_other_users(proc_root)
    try:
        btime = _boot_time(proc_root)
        pids = [int(n) for n in os.listdir(proc_root) if n.isdigit()]
    except OSError as e:
        facts.errors.append(f"{proc_root}: {e.strerror or e}")
        return facts
    holders: dict[int, set[int]] = defaultdict(set)
    netns_member: dict[str, int] = {}
    for pid in pids:
        info = _read_process(proc_root, pid, btime)
        if info is None:
            continue
        facts.processes[pid] = info
        if info.unreadable:
            facts.unreadable_pids[pid] = info.unreadable
        for ino in info.socket_inodes:
            holders[ino].add(pid)
        if info.net_ns is not None and info.net_ns != facts.my_net_ns:
            netns_member.setdefault(info.net_ns, pid)
    facts.socket_holders = dict(holders)
    listeners: dict[tuple[int, int], set[int]] = defaultdict(set)
    # Who serves a node only names PIDs; whether it is served at all is the
    # bind test's (sockdiag.bound), which sees every namespace. So a namespace
    # we cannot enter (not root) costs names, never safety.
    sources: list[tuple[str, str | None]] = [(facts.my_net_ns or "self", None)]
    sources += [(ns, f"{proc_root}/{pid}/ns/net") for ns, pid in sorted(netns_member.items())]
    for ns, path in sources:
        try:
            found = _listeners_of(path)
        except OSError:
            facts.unreadable_netns.add(ns)
            continue
        for ident, inodes in found.items():
            listeners[ident] |= inodes
    facts.listeners = dict(listeners)
    return facts
