"""Leases (docs/CLEANER.md §4): how our processes prove they are alive without a heartbeat.

- Segment lease: an open-file-description read lock on one byte far past the
  24 data bytes, held by the owning engine for its life. OFD locks belong to the
  open file, not the process, so they survive fork-free threads, do not vanish
  when some unrelated fd to the same file is closed (the POSIX-lock trap), and
  never conflict with the whole-file `flock` data locks upstream tools take.
- Directory lease: `flock(LOCK_SH)` on the socket directory, held by every
  process of the deployment; a cleaner needs `LOCK_EX|LOCK_NB` to remove.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import threading
import weakref
from collections import defaultdict
from dataclasses import dataclass

from ..base.ident import open_if_same

LEASE_OFFSET = 1 << 40
LEASE_LEN = 1

F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)
F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
_FLOCK_FMT = "@hhqqi4x"  # struct flock on LP64 Linux: type, whence, start, len, pid


class ForkSafe:
    """Objects whose fd must not outlive them in a forked child.

    flock and OFD locks belong to the open file description, which fork()
    shares: a child forked after we took a lease (an LMCache helper, a
    multiprocessing worker) would keep holding it after we die, and our dead
    deployment would look alive for as long as the child runs. Each child drops
    its copy at once.
    """

    _instances: weakref.WeakSet[ForkSafe] = weakref.WeakSet()
    _fd: int | None = None
    _lock: threading.Lock

    def _track(self) -> None:
        ForkSafe._instances.add(self)

    def _after_fork_in_child(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        # A fresh lock, never acquired: another parent thread may have held the old one at fork time.
        self._lock = threading.Lock()


def _drop_inherited_fds() -> None:
    for obj in list(ForkSafe._instances):
        obj._after_fork_in_child()


os.register_at_fork(after_in_child=_drop_inherited_fds)


def _flock_struct(kind: int) -> bytes:
    return struct.pack(_FLOCK_FMT, kind, os.SEEK_SET, LEASE_OFFSET, LEASE_LEN, 0)


# The three lease requests, packed once: a gc tests or takes one per segment.
_LEASE_REQUEST = {kind: _flock_struct(kind) for kind in (fcntl.F_RDLCK, fcntl.F_WRLCK, fcntl.F_UNLCK)}
_CONFLICT_TEST = _LEASE_REQUEST[fcntl.F_WRLCK]
_TYPE = struct.Struct("@h")


def ofd_lock(fd: int, kind: int) -> bool:
    """Take an OFD lock of `kind` (F_RDLCK/F_WRLCK/F_UNLCK) on the lease byte; False if held elsewhere."""
    try:
        fcntl.fcntl(fd, F_OFD_SETLK, _LEASE_REQUEST.get(kind) or _flock_struct(kind))
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def ofd_conflict(fd: int) -> bool:
    """True when some other open file description holds a lease on this file (F_OFD_GETLK, no side effect)."""
    res = fcntl.fcntl(fd, F_OFD_GETLK, _CONFLICT_TEST)
    return _TYPE.unpack_from(res)[0] != fcntl.F_UNLCK  # l_type, the struct's first field


def segment_lease_held(path: str, *, dir_fd: int | None = None,
                       ident: tuple[int, int] | None = None) -> bool | None:
    """Whether any process holds the segment's lease; None when the file cannot be opened to test.

    With `dir_fd` and `ident` (a scan's), `path` is a name in that directory, tested only while it is still
    the file the scan saw.
    """
    if dir_fd is not None and ident is not None:
        fd = open_if_same(path, dir_fd, ident)
    else:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            fd = None
    if fd is None:
        return None
    try:
        return ofd_conflict(fd)
    except OSError:
        return None
    finally:
        os.close(fd)


class SegmentLease(ForkSafe):
    """Hold the segment's lease for the life of this object (the owning engine)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None
        self._lock = threading.Lock()
        self._track()

    def acquire(self) -> None:
        with self._lock:
            if self._fd is not None:
                return
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            if not ofd_lock(fd, fcntl.F_RDLCK):
                os.close(fd)
                raise BlockingIOError(errno.EAGAIN, "a cleaner holds the segment lease exclusively", self.path)
            self._fd = fd

    @property
    def identity(self) -> tuple[int, int] | None:
        with self._lock:
            if self._fd is None:
                return None
            st = os.fstat(self._fd)
            return (st.st_dev, st.st_ino)

    def release(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)  # closing the last fd of the description drops the OFD lock
                self._fd = None

    def __enter__(self) -> SegmentLease:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class DirLease(ForkSafe):
    """Hold `flock(LOCK_SH)` on a socket directory (opened without following links)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd: int | None = None
        self._track()

    def _after_fork_in_child(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def acquire(self, *, blocking: bool = True) -> None:
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | (0 if blocking else fcntl.LOCK_NB))
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    def try_upgrade(self) -> bool:
        """Convert to LOCK_EX without blocking: True only when no other process holds the lease."""
        if self.fd is None:
            return False
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


@dataclass(frozen=True, kw_only=True)
class LockEntry:
    kind: str  # FLOCK, OFDLCK, POSIX
    mode: str  # READ, WRITE
    pid: int   # -1 for OFD locks on kernels that do not record one


def read_proc_locks(proc_root: str = "/proc") -> dict[tuple[int, int], list[LockEntry]]:
    """Every lock the kernel lists in /proc/locks, by (st_dev, st_ino): a side-effect-free lease test."""
    out: dict[tuple[int, int], list[LockEntry]] = defaultdict(list)
    try:
        # Bytes through os.read: a text-mode open costs more than the read (codec set-up).
        fd = os.open(f"{proc_root}/locks", os.O_RDONLY | os.O_CLOEXEC)
        try:
            chunks = []
            while chunk := os.read(fd, 65536):
                chunks.append(chunk)
        finally:
            os.close(fd)
    except OSError:
        return {}
    for line in b"".join(chunks).splitlines():
        parts = line.split()
        if len(parts) < 6 or parts[1] == b"->":
            continue  # "->" lines are waiters, not holders
        try:
            maj, mnr, ino = parts[5].split(b":")
            key = (os.makedev(int(maj, 16), int(mnr, 16)), int(ino))
            out[key].append(LockEntry(kind=parts[1].decode(), mode=parts[3].decode(), pid=int(parts[4])))
        except ValueError:
            continue
    return dict(out)
