"""The deployment names present on a node, from two directory listings: what shell completion offers.

A TAB press re-runs kvctl, so this reads no /proc, tests no lease and binds
nothing; it imports only the naming rules. It offers the names `scan.scan`
finds (a test holds the two to the same answer): socket directories whose
hash suffix matches their name, and the /dev/shm files scan takes for
segments (named by such a directory, of a default name, or a single-link
24-byte file marked by our runtime or carrying a positive limit).
"""

from __future__ import annotations

import os
import stat

from . import naming

# Kept equal to segment.SEGMENT_SIZE (a test compares them): importing segment.py
# costs a TAB press its dataclasses.
SEGMENT_SIZE = 24


def _open_dir(path: str) -> int | None:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None


def _segment_shaped(entry: str, shm_fd: int) -> bool:
    try:
        st = os.stat(entry, dir_fd=shm_fd, follow_symlinks=False)
    except OSError:
        return False
    if not (stat.S_ISREG(st.st_mode) and st.st_size == SEGMENT_SIZE and st.st_nlink == 1):
        return False
    # Rare on a node (a 24-byte file nothing names): only now pay for the segment module.
    from .segment import has_mark, peek_limit

    if has_mark(entry, shm_fd):
        return True
    limit = peek_limit(entry, shm_fd, st)
    return limit is not None and limit > 0


def node_dirs(root: str) -> tuple[str, str]:
    """(tmp, dev/shm) under `root`, as Layout(root) has them (a test compares the two)."""
    return os.path.normpath(os.path.join(root, "tmp")), os.path.normpath(os.path.join(root, "dev/shm"))


def may_hold_state(root: str = "/") -> bool:
    """False only when nothing under `root` can be kvcached state, whatever names processes carry.

    The scan takes a socket directory only by its `kvcached-tp-` name, and a file
    in /dev/shm only by a valid IPC name; with neither there (or a directory that
    cannot be listed, which the scan must report), there is nothing to judge.
    """
    tmp, shm = node_dirs(root)
    for path, ours in ((tmp, lambda e: e.startswith("kvcached-tp-")), (shm, naming.is_valid_name)):
        fd = _open_dir(path)
        if fd is None:
            if os.path.lexists(path):
                return True  # there but not listable: the scan says why
            continue
        try:
            if any(ours(entry) for entry in os.listdir(fd)):
                return True
        finally:
            os.close(fd)
    return False


def deployment_names(root: str = "/") -> set[str]:
    """The names of the kvcached deployments whose state is under `root` (its tmp/ and dev/shm/)."""
    names: set[str] = set()
    tmp, shm = node_dirs(root)
    tmp_fd = _open_dir(tmp)
    if tmp_fd is not None:
        try:
            for entry in os.listdir(tmp_fd):
                parsed = naming.parse_socket_dir_name(entry)
                if parsed is not None and parsed[1]:
                    names.add(parsed[0])
        finally:
            os.close(tmp_fd)
    dirs = set(names)
    shm_fd = _open_dir(shm)
    if shm_fd is not None:
        try:
            for entry in os.listdir(shm_fd):
                if entry in dirs or naming.DEFAULT_NAME_RE.match(entry) is not None:
                    names.add(entry)
                elif naming.is_valid_name(entry) and _segment_shaped(entry, shm_fd):
                    names.add(entry)
        finally:
            os.close(shm_fd)
    return names
