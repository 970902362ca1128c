"""Scan /tmp and /dev/shm for kvcached state through directory fds, never following a link.

The scan records what is there (type, identity, owner, mode, links, size,
mtime); with facts it also takes the per-candidate signals that need a
syscall (lease tests, the passive bind test of socket nodes). It decides
nothing.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from ..base import name_rules
from ..base.enums import Kind, StrEnum
from ..base.ident import handle_reader
from ..base.layout import Layout
from ..state.lease import segment_lease_held
from ..state.segment import SEGMENT_SIZE, has_mark, peek_limit
from ..state.sockdiag import Bind, BindProbe
from .facts import Facts
from .report import KVCACHED, Origin, Source

if TYPE_CHECKING:
    from ..base.place import Place

class FileType(StrEnum):
    """What the scan found at a name (an entry's `type` in JSON): the first foreign check of every source."""

    REGULAR = "regular"
    SOCKET = "socket"
    DIRECTORY = "directory"
    SYMLINK = "symlink"
    FIFO = "fifo"
    DEVICE = "device"
    OTHER = "other"


_FILE_TYPES = {stat.S_IFLNK: FileType.SYMLINK, stat.S_IFREG: FileType.REGULAR, stat.S_IFSOCK: FileType.SOCKET,
               stat.S_IFDIR: FileType.DIRECTORY, stat.S_IFIFO: FileType.FIFO, stat.S_IFCHR: FileType.DEVICE,
               stat.S_IFBLK: FileType.DEVICE}


def file_type(mode: int) -> FileType:
    return _FILE_TYPES.get(stat.S_IFMT(mode), FileType.OTHER)


class Candidate(NamedTuple):
    """One piece of possibly-kvcached state, as the scan found it.

    An immutable NamedTuple rather than a frozen dataclass: a scan builds one per
    node, and a frozen dataclass's __init__ (one object.__setattr__ per field)
    costs several times a NamedTuple's (bench/README.md).
    """

    kind: Kind
    path: str                    # where we reach it (under --root / /proc/PID/root)
    name: str                    # last path component
    deployment: str | None
    ftype: FileType
    ident: tuple[int, int]
    uid: int
    mode: int
    nlink: int
    size: int
    mtime: float
    rank: int | None = None
    stage: int | None = None
    handle: bytes | None = None  # kernel file handle: tells a reused inode number apart (ident.py)
    hash_ok: bool = True
    parent_uid: int | None = None
    cross_mount: bool = False
    children: tuple[Candidate, ...] = ()
    extras: tuple[str, ...] = ()   # names inside a socket directory that are not ours
    lease: bool | None = None      # a lease or lock observed on it (None: not tested)
    bind: Bind | None = None       # bind test of a socket node no listing shows (None: not tested)
    bind_errno: str | None = None
    by_shape: bool = False         # a segment found only by its shape: nothing names it
    place: Place | None = None     # kvctl -A: the place it is in; None: this node's own /tmp and /dev/shm

    @property
    def origin(self) -> Origin:
        """Where it came from: kvcached's own state, on this node's own /tmp and /dev/shm or in `place`."""
        return KVCACHED if self.place is None else Origin(Source.KVCACHED, None, self.place)

    def walk(self) -> list[Candidate]:
        """This candidate and every candidate below it, children first.

        A list, not a generator: a gc walks every tree two or three times, and
        resuming a chain of nested generators per entry cost more than the list.
        """
        out: list[Candidate] = []
        for child in self.children:
            if child.children:
                out += child.walk()
            else:
                out.append(child)
        out.append(self)
        return out


@dataclass
class ScanResult:
    candidates: list[Candidate] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _open_dir(path: str, dir_fd: int | None = None) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)


def candidate_from_stat(kind: Kind, path: str, name: str, st: os.stat_result, *,
                        handle: bytes | None = None, **kw: object) -> Candidate:
    """A candidate of `kind` at `path` as `st` (an lstat of it) describes it."""
    return Candidate(kind=kind, path=path, name=name,
                     ftype=file_type(st.st_mode), ident=(st.st_dev, st.st_ino), handle=handle, uid=st.st_uid,
                     mode=stat.S_IMODE(st.st_mode), nlink=st.st_nlink, size=st.st_size,
                     mtime=st.st_mtime, **kw)  # type: ignore[arg-type]


_new_tuple = tuple.__new__


def socket_candidate(path: str, name: str, deployment: str, st: os.stat_result, rank: int, stage: int,
                     handle: bytes | None, parent_uid: int, lease: bool | None, bind: Bind | None,
                     bind_errno: str | None) -> Candidate:
    """The candidate of one socket node in a socket directory: what `candidate_from_stat` builds, positionally.

    A full node has eight of these per deployment, and building a 24-field
    NamedTuple by keyword cost several times building it from a tuple (bench/bench_gc.py's
    scan share; bench/README.md); tests/fs/test_scan_fast.py checks that both build the same value.
    """
    mode = st.st_mode
    ftype = _FILE_TYPES.get(stat.S_IFMT(mode), FileType.OTHER)
    return _new_tuple(Candidate, (Kind.SOCKET, path, name, deployment, ftype, (st.st_dev, st.st_ino), st.st_uid,
                                  stat.S_IMODE(mode), st.st_nlink, st.st_size, st.st_mtime, rank, stage, handle,
                                  True, parent_uid, False, (), (), lease, bind, bind_errno, False, None))


class _Observer:
    """Signals that need a syscall, taken while the scan builds each candidate (no second pass).

    It also holds what the scan's loop reuses: one file-handle reader and one
    bind-test socket (ident.handle_reader, sockdiag.BindProbe).
    """

    def __init__(self, facts: Facts | None) -> None:
        self.facts = facts
        self.handle_of = handle_reader()
        self.probe = BindProbe()

    def dir_lease(self, ident: tuple[int, int], inherited: bool) -> bool | None:
        if self.facts is None:
            return None
        return inherited or ident in self.facts.locks

    def socket(self, dir_fd: int, name: str, st: os.stat_result) -> tuple[Bind | None, str | None]:
        f = self.facts
        if f is None or not stat.S_ISSOCK(st.st_mode) or (st.st_dev, st.st_ino) in f.listeners:
            return None, None
        return self.probe.test(dir_fd, name)


def _scan_socket_dir(parent_fd: int, parent_st: os.stat_result, name: str, path: str,
                     deployment: str, hash_ok: bool, stage: int | None, errors: list[str],
                     obs: _Observer, inherited: bool = False) -> Candidate:
    st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    lease = obs.dir_lease((st.st_dev, st.st_ino), inherited) if stat.S_ISDIR(st.st_mode) else None
    common: dict[str, Any] = dict(
        deployment=deployment,
        hash_ok=hash_ok,
        stage=stage,
        handle=obs.handle_of(name, parent_fd),
        parent_uid=parent_st.st_uid if stage is not None else None,
        cross_mount=st.st_dev != parent_st.st_dev,
        lease=lease,
    )
    if not stat.S_ISDIR(st.st_mode) or st.st_dev != parent_st.st_dev or not hash_ok:
        return candidate_from_stat(Kind.DIRECTORY, path, name, st, **common)
    try:
        fd = _open_dir(name, parent_fd)
    except OSError as e:
        errors.append(f"{path}: {e.strerror}")
        return candidate_from_stat(Kind.DIRECTORY, path, name, st, **common)
    try:
        fst = os.fstat(fd)
        if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
            errors.append(f"{path}: replaced during the scan")
            return candidate_from_stat(Kind.DIRECTORY, path, name, st, **common)
        children: list[Candidate] = []
        extras: list[str] = []
        handle_of, parent_uid, node_stage = obs.handle_of, fst.st_uid, stage or 0
        for entry in sorted(os.listdir(fd)):
            try:
                cst = os.stat(entry, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            rank = name_rules.parse_socket_name(entry)
            if rank is not None:
                test, terr = (None, None) if lease else obs.socket(fd, entry, cst)
                # path never ends in "/", and entry is one component: no os.path.join (a
                # socket directory's loop is the hot path of a gc over a full node).
                children.append(socket_candidate(f"{path}/{entry}", entry, deployment, cst, rank, node_stage,
                                                 handle_of(entry, fd), parent_uid, True if lease else None,
                                                 test, terr))
                continue
            sub_stage = name_rules.parse_stage_name(entry) if stage is None else None
            if sub_stage is not None:
                children.append(_scan_socket_dir(fd, fst, entry, f"{path}/{entry}", deployment, True, sub_stage,
                                                 errors, obs, bool(lease)))
            else:
                extras.append(entry)
        return candidate_from_stat(
            Kind.DIRECTORY, path, name, st, children=tuple(children), extras=tuple(extras), **common
        )
    finally:
        os.close(fd)


def scan(layout: Layout, names: Iterable[str] = (), facts: Facts | None = None) -> ScanResult:
    """Find every socket directory and every segment that the naming rules or `names` tie to kvcached.

    Also every segment-shaped file in /dev/shm that nothing names (24 bytes,
    a positive limit: what upstream's `kvctl list` shows), marked `by_shape`,
    so that a segment whose socket directory is gone stays visible.
    With `facts`, each candidate is observed as it is found (leases, and the
    bind test of socket nodes that no listing shows).
    """
    result = ScanResult()
    obs = _Observer(facts)
    wanted = {n for n in names if name_rules.is_valid_name(n)}
    try:
        _scan_tmp(layout, result, obs, wanted)
        _scan_shm(layout, result, obs, wanted)
    finally:
        obs.probe.close()
    return result


def _open_listed(path: str, errors: list[str]) -> int | None:
    """The directory the scan lists, opened without following; None (and why, unless absent) when it cannot be."""
    try:
        return _open_dir(path)
    except OSError as e:
        if e.errno != errno.ENOENT:
            errors.append(f"{path}: {e.strerror}")
        return None


def _scan_tmp(layout: Layout, result: ScanResult, obs: _Observer, wanted: set[str]) -> None:
    tmp_dir = layout.tmp_dir  # a property that normalises a path: once, not per entry
    tmp_fd = _open_listed(tmp_dir, result.errors)
    if tmp_fd is None:
        return
    try:
        tmp_st = os.fstat(tmp_fd)
        for entry in sorted(os.listdir(tmp_fd)):
            parsed = name_rules.parse_socket_dir_name(entry)
            if parsed is None:
                continue
            dep, hash_ok = parsed
            try:
                result.candidates.append(_scan_socket_dir(tmp_fd, tmp_st, entry, os.path.join(tmp_dir, entry),
                                                          dep, hash_ok, None, result.errors, obs))
            except FileNotFoundError:
                continue
            if hash_ok:
                wanted.add(dep)
    finally:
        os.close(tmp_fd)


def _scan_shm(layout: Layout, result: ScanResult, obs: _Observer, wanted: set[str]) -> None:
    shm_dir = layout.shm_dir
    shm_fd = _open_listed(shm_dir, result.errors)
    if shm_fd is None:
        return
    try:
        for entry in sorted(os.listdir(shm_fd)):
            named = entry in wanted or name_rules.DEFAULT_NAME_RE.match(entry) is not None
            if not named and not name_rules.is_valid_name(entry):
                continue
            try:
                st = os.stat(entry, dir_fd=shm_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            by_shape = False
            if not named:
                if not (stat.S_ISREG(st.st_mode) and st.st_size == SEGMENT_SIZE and st.st_nlink == 1):
                    continue  # a file of someone else's with an innocent name
                if not has_mark(entry, shm_fd):
                    # Upstream's segments carry no mark: one whose socket directory is
                    # gone (a gc cut short, systemd-tmpfiles) is known by its shape alone.
                    limit = peek_limit(entry, shm_fd, st)
                    if limit is None or limit <= 0:
                        continue
                    by_shape = True
            handle = obs.handle_of(entry, shm_fd)
            lease = None
            if obs.facts is not None and stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
                lease = _segment_lease(shm_fd, entry, (st.st_dev, st.st_ino), obs.facts)
            result.candidates.append(candidate_from_stat(Kind.SEGMENT, os.path.join(shm_dir, entry), entry,
                                                         st, deployment=entry, handle=handle, by_shape=by_shape,
                                                         lease=lease))
    finally:
        os.close(shm_fd)


def _segment_lease(shm_fd: int, name: str, ident: tuple[int, int], facts: Facts) -> bool | None:
    if ident in facts.locks:
        return True  # an OFD lease, or upstream's flock held right now: someone is using it
    return segment_lease_held(name, dir_fd=shm_fd, ident=ident)
