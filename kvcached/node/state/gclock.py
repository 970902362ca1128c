"""One garbage collection at a time per node (per `--root`): an exclusive `flock` on a lock file.

Two concurrent runs would not corrupt anything (every removal is identity-checked
and ENOENT is success), but they would report each other's removals as "already
gone" and double-count metrics, and cron overlapping a slow run is a sign an
operator wants to see. So the second run says who holds the lock and exits.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from types import TracebackType

from ... import settings
from ..base.enums import Category
from ..base.errors import KvcachedError
from ..base.layout import Layout
from .lease import read_proc_locks

ENV_LOCK = settings.KVCTL_LOCK.name
LOCK_NAME = "kvctl-gc.lock"


class LockBusy(KvcachedError):
    """Another gc holds the node's lock."""

    category = Category.BUSY

    def __init__(self, path: str, pids: tuple[int, ...]) -> None:
        who = f"PID {', '.join(map(str, pids))}" if pids else "another process"
        super().__init__(f"another kvctl gc is running ({who} holds {path})")
        self.path = path
        self.pids = pids


class LockUnavailable(KvcachedError):
    """The lock file could not be opened (permissions, a link planted at its path)."""


def lock_path(layout: Layout) -> str:
    """Where the node's gc lock lives.

    `$KVCTL_LOCK`; else, for root, `<root>/run/kvctl-gc.lock` when `<root>/run`
    is root's and nobody else may write there (no one can plant a file at the
    path); else `<root>/run/lock/kvctl-gc.lock` when that directory exists and
    we may write it; else `<root>/tmp/kvctl-gc.lock`.
    """
    env = settings.KVCTL_LOCK.get()
    if env:
        return env
    run = os.path.join(layout.root, "run")
    if os.geteuid() == 0:
        try:
            st = os.stat(run, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and not st.st_mode & 0o022:
                return os.path.join(run, LOCK_NAME)
        except OSError:
            pass
    run_lock = os.path.join(run, "lock")
    if os.path.isdir(run_lock) and os.access(run_lock, os.W_OK):
        return os.path.join(run_lock, LOCK_NAME)
    return os.path.join(layout.tmp_dir, LOCK_NAME)


class GcLock:
    """`with GcLock(layout):` holds the node's gc lock or raises LockBusy at once (never waits)."""

    def __init__(self, layout: Layout, path: str | None = None, proc_root: str = "/proc") -> None:
        self.path = path or lock_path(layout)
        self.proc_root = proc_root
        self._fd: int | None = None

    def _refuse(self, why: str) -> LockUnavailable:
        return LockUnavailable(f"{self.path}: cannot use it as the gc lock ({why}); another user may have "
                               f"planted it: remove it (rm -- {self.path}) or set {ENV_LOCK} to a file only you "
                               "can create")

    def acquire(self) -> None:
        try:
            # Anything may already sit at the path, planted by another user where the
            # directory is world-writable: O_NOFOLLOW (no link), O_NONBLOCK (a FIFO
            # must not block the open), and then we check what we opened.
            fd = os.open(self.path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except OSError as e:
            why = "a symbolic link" if e.errno == errno.ELOOP else (e.strerror or str(e))
            raise self._refuse(why) from None
        st = os.fstat(fd)
        problem = None
        if not stat.S_ISREG(st.st_mode):
            problem = "not a regular file"
        elif st.st_uid != os.geteuid():
            problem = f"owned by uid {st.st_uid}, not by us (uid {os.geteuid()})"
        elif st.st_nlink != 1:
            problem = f"{st.st_nlink} hard links"
        if problem:
            os.close(fd)
            raise self._refuse(problem)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holders = read_proc_locks(self.proc_root).get((st.st_dev, st.st_ino), [])
            raise LockBusy(self.path, tuple(sorted({h.pid for h in holders if h.pid > 0}))) from None
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # the file stays: removing it would race a waiter that opened it
            self._fd = None

    def __enter__(self) -> GcLock:
        self.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()
