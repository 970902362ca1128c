"""The 24-byte limit segment of docs/NODE.md §2, with upstream's flock data locks."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..base.errors import NotASegment, SegmentBusy, SegmentMissing
from ..base.ident import open_if_same
from ..base.layout import SEGMENT_SIZE

# Our runtime marks the segments it creates, so that one with an explicit name
# is still recognisable once its socket directory and processes are gone (the
# name alone says nothing: any file in /dev/shm could carry it). Upstream's
# segments carry no mark; filesystems without user xattrs simply go unmarked.
MARK_XATTR = "user.kvcached"
MARK_VALUE = b"segment/1"
_FMT = "=qqq"  # total_size, used_size, prealloc_size; native byte order like upstream


@dataclass(frozen=True, kw_only=True)
class SegmentInfo:
    """The three numbers a segment carries, in bytes."""

    total: int
    used: int
    prealloc: int

    def to_dict(self) -> dict[str, int]:
        return {"limit": self.total, "used": self.used, "prealloc": self.prealloc}

    @property
    def problems(self) -> tuple[str, ...]:
        """What no kvcached runtime writes (negative values), and usage above the limit.

        Usage above the limit is possible for a moment (the limit was just
        lowered below it), so it is reported, not rejected.
        """
        out = [f"{label} is negative ({value})" for label, value in
               (("limit", self.total), ("used", self.used), ("prealloc", self.prealloc)) if value < 0]
        if not out and self.used + self.prealloc > self.total:
            out.append(f"used + prealloc ({self.used + self.prealloc}) is over the limit ({self.total})")
        return tuple(out)

    @property
    def valid(self) -> bool:
        """False when a value is negative: not written by a kvcached runtime."""
        return min(self.total, self.used, self.prealloc) >= 0


def _open_checked(path: str, flags: int) -> int:
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise SegmentMissing(path) from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NotASegment(path, "a symbolic link") from None
        raise
    try:
        check_segment_stat(path, os.fstat(fd))
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_segment_stat(path: str, st: os.stat_result, *, allow_empty: bool = False) -> None:
    """Raise NotASegment unless `st` is a single-link regular file of 24 bytes."""
    if not stat.S_ISREG(st.st_mode):
        raise NotASegment(path, "not a regular file")
    if st.st_nlink != 1:
        # A hard link into /dev/shm could make us write through to a file elsewhere.
        raise NotASegment(path, f"{st.st_nlink} hard links")
    if st.st_size != SEGMENT_SIZE and not (allow_empty and st.st_size == 0):
        raise NotASegment(path, f"{st.st_size} bytes, expected {SEGMENT_SIZE}")


def _flock(fd: int, path: str, kind: int, timeout: float | None) -> None:
    """flock with a bound: a process stuck inside its critical section must not hang kvctl."""
    if timeout is None:
        fcntl.flock(fd, kind)
        return
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise SegmentBusy(path, timeout) from None
            time.sleep(0.005)


def _unpack(data: bytes) -> SegmentInfo:
    total, used, prealloc = struct.unpack(_FMT, data)
    return SegmentInfo(total=total, used=used, prealloc=prealloc)


def read_segment(path: str, timeout: float | None = 2.0) -> SegmentInfo:
    """Read under LOCK_SH; never creates the file (unlike upstream's readers)."""
    fd = _open_checked(path, os.O_RDONLY)
    try:
        _flock(fd, path, fcntl.LOCK_SH, timeout)
        data = os.pread(fd, SEGMENT_SIZE, 0)
    finally:
        os.close(fd)
    if len(data) != SEGMENT_SIZE:
        raise NotASegment(path, "truncated while reading")
    return _unpack(data)


def write_segment(path: str, *, total: int | None = None, used: int | None = None,
                  prealloc: int | None = None, timeout: float | None = 5.0) -> SegmentInfo:
    """Update the given fields under LOCK_EX; returns the values now stored."""
    for label, value in (("total", total), ("used", used), ("prealloc", prealloc)):
        if value is not None and value < 0:
            raise ValueError(f"{label} must be ≥ 0, got {value}")
    fd = _open_checked(path, os.O_RDWR)
    try:
        _flock(fd, path, fcntl.LOCK_EX, timeout)
        old = _unpack(os.pread(fd, SEGMENT_SIZE, 0))
        new = SegmentInfo(
            total=old.total if total is None else total,
            used=old.used if used is None else used,
            prealloc=old.prealloc if prealloc is None else prealloc,
        )
        os.pwrite(fd, struct.pack(_FMT, new.total, new.used, new.prealloc), 0)
    finally:
        os.close(fd)
    return new


def create_segment(path: str, total: int, *, exist_ok: bool = False) -> SegmentInfo:
    """Create a segment with limit `total` (used = prealloc = 0); mode 0666 & ~umask like upstream."""
    if total < 0:
        raise ValueError(f"total must be ≥ 0, got {total}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except FileExistsError:
        if not exist_ok:
            raise
        return read_segment(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, SEGMENT_SIZE)
        os.pwrite(fd, struct.pack(_FMT, total, 0, 0), 0)
        try:
            os.setxattr(fd, MARK_XATTR, MARK_VALUE)
        except OSError:
            pass  # no user xattrs here (ENOTSUP) or not allowed: the segment is merely unmarked
    finally:
        os.close(fd)
    return SegmentInfo(total=total, used=0, prealloc=0)


def peek_limit(name: str, dir_fd: int, st: os.stat_result) -> int | None:
    """The limit field of the 24-byte file `name` in `dir_fd`, read without a lock; None when unreadable.

    Only to recognise a segment by its shape: a torn read of a value being
    rewritten costs nothing here, and a lock could make a scan wait.
    """
    fd = open_if_same(name, dir_fd, (st.st_dev, st.st_ino), regular=True)
    if fd is None:
        return None
    try:
        data = os.pread(fd, 8, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    return struct.unpack("=q", data)[0] if len(data) == 8 else None


def has_mark(name: str, dir_fd: int) -> bool:
    """True when `name` (in `dir_fd`, not followed) carries our runtime's segment mark."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        return os.getxattr(fd, MARK_XATTR) == MARK_VALUE
    except OSError:
        return False
    finally:
        os.close(fd)


class MappedReader(Protocol):
    """A file's first 8 bytes read through a mapping (the extension's MappedWord)."""

    @property
    def guarded(self) -> bool:
        """Whether a truncated file would still be survived (False: stop reading)."""

    def read(self) -> int | None:
        """The value now; None when the mapping cannot answer (truncated, or never settled)."""

    def close(self) -> None:
        """Unmap."""


class LimitWatch:
    """A segment's limit for a loop that reads it every step (an engine's scheduler).

    `read_segment` opens, locks, reads and closes: most of a
    block pool's per-step cost (bench/README.md). This keeps the file open and reads the limit
    without the lock: a value being rewritten under the writer's lock could be
    read torn, so a value that changed is taken only once two reads in a row
    agree. The path is stat'ed at most every `recheck` seconds, so a segment
    replaced under the same name (a relaunch, upstream's recreate-on-open) is
    followed to its new inode within that time.

    With `mapper` (the extension's MappedWord, which engines pass) a read is a
    load from a shared mapping of the file, no system call; without it, or
    once the mapping cannot answer or its SIGBUS guard was replaced, one
    ``pread``. A mapping that could not answer is made again at the next
    recheck, from the file then open.
    """

    def __init__(self, path: str, recheck: float = 0.1, *,
                 mapper: Callable[[int], MappedReader] | None = None) -> None:
        self.path = path
        self.recheck = recheck
        self._mapper = mapper
        self._word: MappedReader | None = None
        self._fd: int | None = None
        self._ident: tuple[int, int] | None = None
        self._recheck_at = float("-inf")  # when the path is stat'ed next (at once while no file is open)
        self._last: bytes | None = None  # the 8 bytes the last pread took the value from
        self._value = 0

    @property
    def mapped(self) -> bool:
        """Whether the next read is a load from the mapping (no system call)."""
        return self._word is not None

    def read(self) -> int:
        """The limit (total) now; raises SegmentMissing / NotASegment like `read_segment`."""
        now = time.monotonic()
        if now >= self._recheck_at:
            self._recheck(now)
        word = self._word
        if word is not None:
            value = word.read()
            if value is not None:
                return value
            self._unmap()  # truncated, or rewritten all along: pread decides, as without a mapping
        return self._pread()

    def _recheck(self, now: float) -> None:
        """Stat the path: follow a replaced segment, and (re)map or stop mapping."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            self.close()
            raise SegmentMissing(self.path) from None
        if (st.st_dev, st.st_ino) != self._ident:
            self.close()
            self._fd = _open_checked(self.path, os.O_RDONLY)
            self._ident = (st.st_dev, st.st_ino)
        self._recheck_at = now + self.recheck
        if self._mapper is None:
            return
        if self._word is not None:
            if not self._word.guarded:
                # A later SIGBUS handler took over: a truncated file would now kill the engine.
                self._unmap()
                self._mapper = None
            return
        if st.st_size == SEGMENT_SIZE and self._fd is not None:
            try:
                self._word = self._mapper(self._fd)
            except OSError:
                self._mapper = None  # cannot map here (or the guard was replaced): pread from now on

    def _pread(self) -> int:
        assert self._fd is not None
        raw = os.pread(self._fd, 8, 0)
        if raw == self._last:
            return self._value
        # Changed (or first read): a torn value cannot be read the same way twice in a row.
        for _ in range(100):
            again = os.pread(self._fd, 8, 0)
            if len(again) != 8:
                raise NotASegment(self.path, "truncated while reading")
            if again == raw:
                self._last, self._value = raw, int(struct.unpack("=q", raw)[0])
                return self._value
            raw = again
        return read_segment(self.path).total  # rewritten all along: take the lock after all

    def _unmap(self) -> None:
        if self._word is not None:
            self._word.close()
            self._word = None

    def close(self) -> None:
        """Close the file and its mapping (idempotent)."""
        self._unmap()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self._ident = None
        self._recheck_at = float("-inf")
