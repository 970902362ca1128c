"""File identity that survives inode-number reuse.

(st_dev, st_ino) is not enough on disk filesystems: ext4 and xfs hand a freed
inode number to the next file created, so a successor that removes a stale
socket and binds its own within microseconds gets the *same* number (we saw it
in the tests). The kernel's file handle (`name_to_handle_at`, no open, no
privileges, works on sockets) carries the inode's generation on ext4, xfs,
btrfs and tmpfs, which differs between the two.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable

AT_EMPTY_PATH = 0x1000
MAX_HANDLE_SZ = 128

_local = threading.local()
_api: dict[str, Any] = {}


def _load() -> Callable[..., int] | None:
    """Bind name_to_handle_at on first use: ctypes costs start-up time kvctl rarely needs."""
    if "fn" in _api:
        return _api["fn"]  # type: ignore[no-any-return]
    import ctypes

    class FileHandle(ctypes.Structure):
        _fields_ = [("handle_bytes", ctypes.c_uint), ("handle_type", ctypes.c_int),
                    ("f_handle", ctypes.c_ubyte * MAX_HANDLE_SZ)]

    fn: Any = None
    try:
        # CDLL(None): the symbols already linked into this process, libc among them
        # (ctypes.util.find_library would run ldconfig in a subprocess).
        fn = ctypes.CDLL(None, use_errno=True).name_to_handle_at
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        fn.restype = ctypes.c_int
    except (OSError, AttributeError):
        fn = None
    _api.update(fn=fn, ctypes=ctypes, FileHandle=FileHandle)
    return fn  # type: ignore[no-any-return]


def _buffers() -> tuple[Any, Any, Any, Any]:
    # One handle buffer per thread, reused: scans take a handle per entry, and
    # building ctypes objects per call costs more than the syscall itself.
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        ctypes = _api["ctypes"]
        fh, mount_id = _api["FileHandle"](), ctypes.c_int()
        bufs = _local.bufs = (fh, ctypes.byref(fh), ctypes.byref(mount_id),
                              ctypes.cast(ctypes.byref(fh, 8), ctypes.POINTER(ctypes.c_char)))
    return bufs


def file_handle(name: str, dir_fd: int) -> bytes | None:
    """The kernel file handle of `name` in `dir_fd`, not following links; None where unsupported."""
    fn = _load()
    if fn is None:
        return None
    fh, fh_ref, mount_ref, data = _buffers()
    fh.handle_bytes = MAX_HANDLE_SZ
    # Without AT_SYMLINK_FOLLOW, name_to_handle_at does not follow a final symlink.
    if fn(dir_fd, os.fsencode(name), fh_ref, mount_ref, 0) != 0:
        return None
    return fh.handle_type.to_bytes(4, "little", signed=True) + data[:fh.handle_bytes]  # type: ignore[no-any-return]


def fd_handle(fd: int) -> bytes | None:
    """The file handle of an open fd (AT_EMPTY_PATH)."""
    fn = _load()
    if fn is None:
        return None
    fh, fh_ref, mount_ref, data = _buffers()
    fh.handle_bytes = MAX_HANDLE_SZ
    if fn(fd, b"", fh_ref, mount_ref, AT_EMPTY_PATH) != 0:
        return None
    return fh.handle_type.to_bytes(4, "little", signed=True) + data[:fh.handle_bytes]  # type: ignore[no-any-return]


def same_file(a: bytes | None, b: bytes | None) -> bool:
    """Handles agree, or one side could not be taken (then (st_dev, st_ino) alone decides)."""
    return a is None or b is None or a == b
