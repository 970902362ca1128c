"""inotify on a few directories, without a dependency: which watched directories got new entries.

Python has no inotify binding, so libc's three calls go through ctypes
(loaded only by `kvctl gc --every`'s event path, never by a plain gc). The
watch is a hint, never evidence: an event only asks for a judgement of the
place, which then goes through the whole guarded path. So what the kernel
drops (IN_Q_OVERFLOW) or cannot watch only means a later judgement, never
a wrong one.

- `Inotify()`: one non-blocking, close-on-exec instance; `fileno()` for poll.
- `add(path)`: a watch on a directory, the last component not followed
  (IN_DONT_FOLLOW, IN_ONLYDIR); raises OSError as the kernel refuses it
  (ENOSPC: max_user_watches exhausted; EMFILE: max_user_instances).
- `drain()`: the watch descriptors whose directories changed since the last
  call, and whether the queue overflowed (then every watch may have changed).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import struct

IN_CLOSE_WRITE = 0x00000008
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE_SELF = 0x00000400
IN_UNMOUNT = 0x00002000
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC

# A new name (made, or moved in) and a file closed after writing: what a creator does. The directory's own end
# (deleted, unmounted: a pod's volume torn down) is news too: its place is gone.
WANTED = IN_CREATE | IN_MOVED_TO | IN_CLOSE_WRITE | IN_DELETE_SELF | IN_UNMOUNT
_HEADER = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (the name follows, NUL-padded)


def _libc() -> ctypes.CDLL:
    lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    lib.inotify_init1.argtypes = [ctypes.c_int]
    lib.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
    lib.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
    return lib


class Inotify:
    """One inotify instance: watches on directories, and which of them changed."""

    def __init__(self) -> None:
        self._lib = _libc()
        fd = self._lib.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"inotify_init1: {os.strerror(e)}")
        self._fd = fd

    def fileno(self) -> int:
        return self._fd

    def add(self, path: str, mask: int = WANTED) -> int:
        """A watch on the directory `path` (its last component not followed); its watch descriptor."""
        wd = self._lib.inotify_add_watch(self._fd, os.fsencode(path), mask | IN_ONLYDIR | IN_DONT_FOLLOW)
        if wd < 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e), path)
        return int(wd)

    def remove(self, wd: int) -> None:
        """Drop a watch; one the kernel dropped already (its directory gone) is no error."""
        if self._lib.inotify_rm_watch(self._fd, wd) < 0 and ctypes.get_errno() != errno.EINVAL:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))

    def drain(self) -> tuple[set[int], bool]:
        """(watch descriptors whose directory changed, whether the kernel's queue overflowed), reading all queued."""
        changed: set[int] = set()
        overflow = False
        while True:
            try:
                buf = os.read(self._fd, 65536)
            except BlockingIOError:
                return changed, overflow
            if not buf:
                return changed, overflow
            at = 0
            while at + _HEADER.size <= len(buf):
                wd, mask, _cookie, length = _HEADER.unpack_from(buf, at)
                at += _HEADER.size + length
                if mask & IN_Q_OVERFLOW:
                    overflow = True
                else:  # a new entry, or the watch gone with its directory (IN_IGNORED): the place is news either way
                    changed.add(wd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Inotify:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
