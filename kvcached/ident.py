"""File identity that survives inode-number reuse.

(st_dev, st_ino) is not enough on disk filesystems: ext4 and xfs hand a freed
inode number to the next file created, so a successor that removes a stale
socket and binds its own within microseconds gets the *same* number (we saw it
in the tests). The kernel's file handle (`name_to_handle_at`, no open, no
privileges, works on sockets) carries the inode's generation on ext4, xfs,
btrfs and tmpfs, which differs between the two.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

AT_EMPTY_PATH = 0x1000
MAX_HANDLE_SZ = 128


class _FileHandle(ctypes.Structure):
    _fields_ = [("handle_bytes", ctypes.c_uint), ("handle_type", ctypes.c_int),
                ("f_handle", ctypes.c_ubyte * MAX_HANDLE_SZ)]


def _load() -> object | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.name_to_handle_at
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_name_to_handle_at = _load()


_local = threading.local()


def _buffers() -> tuple[_FileHandle, object, object, object]:
    # One handle buffer per thread, reused: scans take a handle per entry, and
    # building ctypes objects per call costs more than the syscall itself.
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        fh, mount_id = _FileHandle(), ctypes.c_int()
        bufs = _local.bufs = (fh, ctypes.byref(fh), ctypes.byref(mount_id),
                              ctypes.cast(ctypes.byref(fh, 8), ctypes.POINTER(ctypes.c_char)))
    return bufs


def file_handle(name: str, dir_fd: int) -> bytes | None:
    """The kernel file handle of `name` in `dir_fd`, not following links; None where unsupported."""
    if _name_to_handle_at is None:
        return None
    fh, fh_ref, mount_ref, data = _buffers()
    fh.handle_bytes = MAX_HANDLE_SZ
    # Without AT_SYMLINK_FOLLOW, name_to_handle_at does not follow a final symlink.
    if _name_to_handle_at(dir_fd, os.fsencode(name), fh_ref, mount_ref, 0) != 0:  # type: ignore[operator]
        return None
    return fh.handle_type.to_bytes(4, "little", signed=True) + data[:fh.handle_bytes]  # type: ignore[index]


def fd_handle(fd: int) -> bytes | None:
    """The file handle of an open fd (AT_EMPTY_PATH)."""
    if _name_to_handle_at is None:
        return None
    fh = _FileHandle()
    fh.handle_bytes = MAX_HANDLE_SZ
    mount_id = ctypes.c_int()
    if _name_to_handle_at(fd, b"", ctypes.addressof(fh), ctypes.addressof(mount_id), AT_EMPTY_PATH) != 0:  # type: ignore[operator]
        return None
    return fh.handle_type.to_bytes(4, "little", signed=True) + bytes(fh.f_handle[:fh.handle_bytes])


def same_file(a: bytes | None, b: bytes | None) -> bool:
    """Handles agree, or one side could not be taken (then (st_dev, st_ino) alone decides)."""
    return a is None or b is None or a == b
