"""What an open descriptor refers to, read through /proc/<pid>/fd without waiting on a filesystem.

The /proc pass needs, for every descriptor on the node, its type and identity:
a socket's inode (for sock_diag), a held file's (st_dev, st_ino) (a segment's
evidence of life), a character device's number (the GPU holders). One
statx(2) through the fd's link answers all three, where readlink(2) answered
only the first and a stat(2) per path was still owed for the others.

AT_STATX_DONT_SYNC: a file on NFS or FUSE answers from the attributes the
kernel has cached, instead of asking a server that may be gone (stat(2) then
waits in D state, out of reach of --time-limit, as lsof does on a dead mount).
Without statx (libc or kernel too old, or a seccomp profile refusing it), the
fallback is os.stat, which may so wait.
"""

from __future__ import annotations

import errno
import os
import struct
from typing import Any, NamedTuple

AT_FDCWD = -100
AT_STATX_DONT_SYNC = 0x2000
STATX_TYPE, STATX_INO = 0x1, 0x100
STATX_SIZE = 256  # sizeof(struct statx)
# stx_mode at 28, stx_ino at 32; stx_rdev_major/minor and stx_dev_major/minor at 128 (struct statx, linux/stat.h).
_FIELDS = struct.Struct("=28xH2xQ88xIIII")

_api: dict[str, Any] = {}


class FdStat(NamedTuple):
    mode: int
    ino: int
    dev: int    # as os.stat's st_dev
    rdev: int   # as os.stat's st_rdev: a device node's number, else 0


def _load() -> Any:
    """Bind statx on first use, and prove it answers here (seccomp may refuse it with EPERM for every path)."""
    if "fn" in _api:
        return _api["fn"]
    import ctypes

    fn: Any = None
    buf = None
    try:
        fn = ctypes.CDLL(None, use_errno=True).statx
        fn.restype = ctypes.c_int  # no argtypes: every argument is an int, bytes or the buffer (base/ident.py)
        buf = ctypes.create_string_buffer(STATX_SIZE)
        if fn(AT_FDCWD, b"/", AT_STATX_DONT_SYNC, STATX_TYPE | STATX_INO, buf) != 0:
            fn = None
    except (OSError, AttributeError):
        fn = None
    _api.update(fn=fn, ctypes=ctypes, buf=buf if fn else None)
    return fn


def fd_stat(dir_fd: int, name: str) -> FdStat | None:
    """What descriptor `name` of the fd directory `dir_fd` refers to; None if it closed since it was listed.

    Raises PermissionError where the link may be listed but not followed (no ptrace access to the process).
    Not thread-safe (one buffer): the /proc pass runs in one thread.
    """
    fn = _load()
    if fn is None:
        try:
            st = os.stat(name, dir_fd=dir_fd)
        except (FileNotFoundError, ProcessLookupError):
            return None
        return FdStat(st.st_mode, st.st_ino, st.st_dev, st.st_rdev)
    buf = _api["buf"]
    if fn(dir_fd, name.encode(), AT_STATX_DONT_SYNC, STATX_TYPE | STATX_INO, buf) != 0:
        err = _api["ctypes"].get_errno()
        if err in (errno.ENOENT, errno.ESRCH):
            return None
        raise OSError(err, os.strerror(err), name)  # OSError picks the subclass (PermissionError) from errno
    mode, ino, rmaj, rmin, dmaj, dmin = _FIELDS.unpack_from(buf)
    return FdStat(mode, ino, os.makedev(dmaj, dmin), os.makedev(rmaj, rmin))
