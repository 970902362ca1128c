"""File identity that survives inode-number reuse.

(st_dev, st_ino) is not enough on disk filesystems: ext4 and xfs hand a freed
inode number to the next file created, so a successor that removes a stale
socket and binds its own within microseconds gets the *same* number (we saw it
in the tests). The kernel's file handle (`name_to_handle_at`, no open, no
privileges, works on sockets) carries the inode's generation on ext4, xfs,
btrfs and tmpfs, which differs between the two.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
import threading
from collections.abc import Callable
from enum import Enum
from typing import Any

AT_EMPTY_PATH = 0x1000
MAX_HANDLE_SZ = 128
# struct file_handle: u32 handle_bytes, i32 handle_type, then the opaque bytes.
_HEADER = 8
_CAPACITY = MAX_HANDLE_SZ.to_bytes(4, "little")

_local = threading.local()
_api: dict[str, Any] = {}


def _load() -> Callable[..., int] | None:
    """Bind name_to_handle_at on first use: ctypes costs start-up time kvctl rarely needs."""
    if "fn" in _api:
        return _api["fn"]
    import ctypes

    fn: Any = None
    try:
        # CDLL(None): the symbols already linked into this process, libc among them
        # (ctypes.util.find_library would run ldconfig in a subprocess).
        fn = ctypes.CDLL(None).name_to_handle_at
        # No argtypes: every argument is already an int, bytes or a ctypes buffer,
        # which ctypes passes as they are; declared argtypes double the call's cost,
        # and a scan takes a handle per entry.
        fn.restype = ctypes.c_int
    except (OSError, AttributeError):
        fn = None
    _api.update(fn=fn, ctypes=ctypes)
    return fn


def _buffers() -> tuple[Any, Any]:
    # One handle buffer per thread, reused: building ctypes objects per call
    # costs more than the syscall itself.
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        ctypes = _api["ctypes"]
        bufs = _local.bufs = ((ctypes.c_char * (_HEADER + MAX_HANDLE_SZ))(), ctypes.byref(ctypes.c_int()))
    return bufs


def _handle(fn: Callable[..., int], dir_fd: int, name: bytes, flags: int) -> bytes | None:
    buf, mount_id = _buffers()
    buf[0:4] = _CAPACITY
    if fn(dir_fd, name, buf, mount_id, flags) != 0:
        return None
    raw = buf.raw
    # handle_type and the opaque bytes: together they name the inode and its generation.
    return raw[4:_HEADER + int.from_bytes(raw[0:4], "little")]


def file_handle(name: str, dir_fd: int) -> bytes | None:
    """The kernel file handle of `name` in `dir_fd`, not following links; None where unsupported."""
    fn = _load()
    # Without AT_SYMLINK_FOLLOW, name_to_handle_at does not follow a final symlink.
    return None if fn is None else _handle(fn, dir_fd, os.fsencode(name), 0)


def fd_handle(fd: int) -> bytes | None:
    """The file handle of an open fd (AT_EMPTY_PATH)."""
    fn = _load()
    return None if fn is None else _handle(fn, fd, b"", AT_EMPTY_PATH)


HandleOf = Callable[[str, int], "bytes | None"]

_FS_ENCODING, _FS_ERRORS = sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()


def handle_reader() -> HandleOf:
    """`file_handle` for one thread's loop over many names: the same syscall and answer, bound once.

    A gc takes two handles per node (at the scan, and again before the act):
    binding the call, this thread's buffer and the encoding once saves the
    lookups file_handle repeats per call (bench/bench_gc.py prints the split).
    Only for the thread that made it: the buffer is that thread's.
    """
    fn = _load()
    if fn is None:
        return _no_handle
    buf, mount_id = _buffers()
    size = _api["ctypes"].c_uint32.from_buffer(buf)  # struct file_handle's handle_bytes, in place

    def handle_of(name: str, dir_fd: int) -> bytes | None:
        size.value = MAX_HANDLE_SZ
        # Without AT_SYMLINK_FOLLOW, name_to_handle_at does not follow a final symlink.
        if fn(dir_fd, name.encode(_FS_ENCODING, _FS_ERRORS), buf, mount_id, 0) != 0:
            return None
        return buf[4:_HEADER + size.value]  # handle_type and the opaque bytes, as file_handle returns them

    return handle_of


def _no_handle(name: str, dir_fd: int) -> bytes | None:
    return None


def same_file(a: bytes | None, b: bytes | None) -> bool:
    """Handles agree, or one side could not be taken (then (st_dev, st_ino) alone decides)."""
    return a is None or b is None or a == b


class Unlinked(Enum):
    """What `unlink_if_same` found and did."""

    DONE = "done"            # removed
    GONE = "gone"            # not there (before or during): the goal is met
    REPLACED = "replaced"    # another file has the name now: never ours to remove
    WOULD = "would"          # a dry run: it would have been removed
    NOT_EMPTY = "not_empty"  # a directory that gained an entry since it was judged


def unlink_if_same(dir_fd: int, name: str, ident: tuple[int, int], handle: bytes | None, *,
                   rmdir: bool = False, dry_run: bool = False, handle_of: HandleOf = file_handle) -> Unlinked:
    """Remove `name` in `dir_fd` only while it is still the file we decided on.

    unlink(2) has no inode guard: a successor may have re-created the name
    since it was judged, so (st_dev, st_ino) and the file handle are checked
    again, through the same directory fd, right before the removal. Other
    errors (EACCES, EBUSY) are raised as OSError. `handle_of` takes the
    handle (a loop passes its `handle_reader()`).
    """
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return Unlinked.GONE
    if (st.st_dev, st.st_ino) != ident:
        return Unlinked.REPLACED
    # same_file, inline (once per removal): a handle taken at the scan must still be the name's.
    if handle is not None and (now := handle_of(name, dir_fd)) is not None and now != handle:
        return Unlinked.REPLACED
    if dry_run:
        return Unlinked.WOULD
    try:
        if rmdir:
            os.rmdir(name, dir_fd=dir_fd)
        else:
            os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return Unlinked.GONE  # someone else removed it meanwhile
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
            return Unlinked.NOT_EMPTY
        raise
    return Unlinked.DONE


def open_if_same(name: str, dir_fd: int, ident: tuple[int, int], *, regular: bool = False) -> int | None:
    """`name` in `dir_fd` opened read-only (never following a link, never blocking), only while it is still
    the file `ident` (and, with `regular`, a regular file); None otherwise. The caller closes the fd.

    Through the directory fd a scan listed: the file it just saw, not whatever a path resolves to now.
    """
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
    except OSError:
        st = None
    if st is None or (st.st_dev, st.st_ino) != ident or (regular and not stat.S_ISREG(st.st_mode)):
        os.close(fd)
        return None
    return fd
