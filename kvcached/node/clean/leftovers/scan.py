"""List /dev/shm and the RPC directories for engine leftovers, through directory fds, never following a link.

Records what each matching entry is (type, identity, file handle, owner, mode,
links, allocated bytes, mtime, ctime, whether it is a mount point) and, with
facts, the passive bind test of socket nodes no listing shows. Decides nothing.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from ...base import name_rules
from ...base.ident import file_handle
from ...base.layout import Layout
from ...state.segment import SEGMENT_SIZE, has_mark, peek_limit
from ...state.sockdiag import Bind, bound
from ..facts import Facts
from ..report import Origin, Source
from ..scan import FileType, file_type
from .families import FAMILIES, Engine, EngineKind, Evidence, Family, Where, match_name

if TYPE_CHECKING:
    from ...base.place import Place

# Each family's entries' origin: one per family, not one per entry.
_ORIGIN: dict[Family, Origin] = {f: Origin(Source.ENGINES, f) for f in FAMILIES}


class EngineCandidate(NamedTuple):
    """One entry whose name matches an engine family, as the scan found it (a NamedTuple: one per entry)."""

    family: Family
    path: str                  # where we reach it (under --root)
    name: str
    parent: str                # the directory it was listed in
    parent_ident: tuple[int, int]
    ftype: FileType
    ident: tuple[int, int]
    uid: int
    mode: int
    nlink: int
    size: int                  # apparent size (st_size)
    allocated: int             # memory or disk it really holds: st_blocks * 512 (what `bytes` reports)
    mtime: float
    ctime: float
    cross_mount: bool = False  # on another device than its directory: a mount point
    handle: bytes | None = None
    creator_pid: int | None = None
    group: str | None = None
    bind: Bind | None = None   # the bind test of a socket node (None: not tested)
    bind_errno: str | None = None
    place: Place | None = None  # kvctl -A: the place it is in; None: this node's own /tmp and /dev/shm

    @property
    def kind(self) -> EngineKind:
        return self.family.kind

    @property
    def origin(self) -> Origin:
        """Where it came from: the engine family whose name it carries (and, with -A, its place)."""
        origin = _ORIGIN[self.family]
        return origin if self.place is None else origin._replace(place=self.place)

    @property
    def engine(self) -> Engine:
        return self.family.engine

    @property
    def changed(self) -> float:
        """When the file last changed: utime can move its mtime back, nothing but the clock moves its ctime."""
        return max(self.mtime, self.ctime)


@dataclass
class EngineScan:
    candidates: list[EngineCandidate] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _open_dir(path: str) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def _candidate(fam: Family, creator: int | None, group: str | None, path: str, name: str, parent: str,
               pst: os.stat_result, st: os.stat_result, handle: bytes | None) -> EngineCandidate:
    return EngineCandidate(
        family=fam, path=path, name=name, parent=parent, parent_ident=(pst.st_dev, pst.st_ino),
        ftype=file_type(st.st_mode), ident=(st.st_dev, st.st_ino), uid=st.st_uid, mode=stat.S_IMODE(st.st_mode),
        nlink=st.st_nlink, size=st.st_size, allocated=st.st_blocks * 512, mtime=st.st_mtime, ctime=st.st_ctime,
        cross_mount=st.st_dev != pst.st_dev, handle=handle, creator_pid=creator, group=group)


def _entries(directory: str, where: Where, errors: list[str], seen: set[tuple[int, int]],
             dev: int | None = None) -> Iterator[tuple[int, os.stat_result, str, os.stat_result, Family,
                                                          int | None, str | None]]:
    """(dir fd, dir stat, name, lstat, family, creator pid, group) for each matching entry of `directory`."""
    try:
        fd = _open_dir(directory)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(directory):
            errors.append(f"{directory}: a symbolic link; not followed")
        elif e.errno != errno.ENOENT:
            errors.append(f"{directory}: {e.strerror}")
        return
    try:
        pst = os.fstat(fd)
        if dev is not None and pst.st_dev != dev:
            # A place is judged on its own filesystem's evidence: another one reached through its path (a link
            # swapped in on the way, a remount) is not the place that was found.
            errors.append(f"{directory}: no longer the filesystem found there; not judged")
            return
        if (pst.st_dev, pst.st_ino) in seen:
            return  # the same directory under two names (VLLM_RPC_BASE_PATH=/tmp)
        seen.add((pst.st_dev, pst.st_ino))
        for name in sorted(os.listdir(fd)):
            m = match_name(where, name)
            if m is None:
                continue
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            yield fd, pst, name, st, m.family, m.creator_pid, m.group
    finally:
        os.close(fd)


def kvcached_names(layout: Layout, facts: Facts | None) -> set[str]:
    """The deployment names kvcached's own scan ties to its state: a socket directory, a process's IPC name."""
    names = {p.ipc_name for p in facts.processes.values() if p.ipc_name} if facts is not None else set()
    try:
        entries = os.listdir(layout.tmp_dir)
    except OSError:
        return names
    for entry in entries:
        parsed = name_rules.parse_socket_dir_name(entry)
        if parsed is not None and parsed[1]:
            names.add(parsed[0])
    return names


def _kvcached_segment(name: str, fd: int, st: os.stat_result, kvcached: Collection[str]) -> bool:
    """Whether plain gc judges this /dev/shm file as a kvcached segment (then the engine pass never does).

    An explicit KVCACHED_IPC_NAME may look like an engine's name (psm_0a1b2c3d), and an upstream segment
    is never held or mapped between accesses: judged as an engine buffer, a live one would look unused.
    """
    if name in kvcached:
        return True
    if not (stat.S_ISREG(st.st_mode) and st.st_size == SEGMENT_SIZE):
        return False
    return has_mark(name, fd) or (peek_limit(name, fd, st) or 0) > 0


def scan_engine_state(layout: Layout, facts: Facts | None = None, rpc_dirs: Iterable[str] = (),
                      kvcached: Collection[str] | None = None, dev: int | None = None) -> EngineScan:
    """Every entry of /dev/shm and of the RPC directories (/tmp, then `rpc_dirs`) whose name is an engine family's.

    In /dev/shm every matching name is a candidate, whatever its type (a wrong
    type is reported as foreign), except kvcached's own segments (`kvcached`:
    the names kvcached_names() finds, by default; and 24-byte files that plain
    gc recognises by their mark or shape). In an RPC directory only socket
    nodes and symbolic links are: directories and files named by a uuid4 or
    by tempfile (tmp + 8) are made by many programs and are no engine's (an
    empty tmp* file SGLang made but zmq never bound carries no evidence
    either: a name only). With `facts`, a socket node
    that no listing shows gets the passive bind test. `dev`: every directory
    must be on that filesystem (one place of the node, kvcached.node.places),
    or it is not listed.
    """
    out = EngineScan()
    ours = kvcached_names(layout, facts) if kvcached is None else kvcached
    shm = layout.shm_dir
    for fd, pst, name, st, fam, creator, group in _entries(shm, Where.SHM, out.errors, set(), dev):
        if _kvcached_segment(name, fd, st, ours):
            continue
        out.candidates.append(_candidate(fam, creator, group, os.path.join(shm, name), name, shm, pst, st,
                                         file_handle(name, fd)))
    seen: set[tuple[int, int]] = set()
    for directory in (layout.tmp_dir, *rpc_dirs):
        for fd, pst, name, st, fam, creator, group in _entries(directory, Where.RPC, out.errors, seen, dev):
            if not (stat.S_ISSOCK(st.st_mode) or stat.S_ISLNK(st.st_mode)):
                continue
            c = _candidate(fam, creator, group, os.path.join(directory, name), name, directory, pst, st,
                           file_handle(name, fd))
            if facts is not None and stat.S_ISSOCK(st.st_mode) and c.ident not in facts.listeners:
                test, terr = bound(c.path, fd)
                c = c._replace(bind=test, bind_errno=terr)
            out.candidates.append(c)
    return out


def needs_creators(candidates: Iterable[EngineCandidate]) -> bool:
    """Whether any candidate's name carries a PID (then every process's namespace PIDs are read)."""
    return any(c.family.evidence is Evidence.CREATOR and c.creator_pid is not None for c in candidates)
