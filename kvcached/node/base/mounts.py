"""The mount table (/proc/self/mountinfo), parsed in one place."""

from __future__ import annotations

import os
import re
from typing import NamedTuple

_OCTAL = re.compile(r"\\([0-7]{3})")


class Mount(NamedTuple):
    """One mount: where, which filesystem, its superblock options (hidepid=, size=, ...), and its device."""

    point: str
    fstype: str
    options: str
    dev: int = 0  # the st_dev of the files on it (the "major:minor" field; tmpfs: an anonymous device)


def read_mountinfo(proc_root: str = "/proc", pid: int | str = "self") -> list[Mount] | None:
    """Every mount process `pid` sees (its mount namespace, points as its root shows them); None: unreadable."""
    try:
        with open(f"{proc_root}/{pid}/mountinfo", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    out = []
    for line in text.splitlines():
        pre, sep, post = line.partition(" - ")
        fields = pre.split()
        if not sep or len(fields) < 5:
            continue
        # Spaces, tabs and backslashes in a mount point are written as octal escapes.
        point = _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), fields[4])
        fstype, _, options = (post.split() + ["", "", ""])[:3]
        major, _, minor = fields[2].partition(":")
        try:
            dev = os.makedev(int(major), int(minor))
        except ValueError:
            dev = 0
        out.append(Mount(point, fstype, options, dev))
    return out


def mount_of(path: str, proc_root: str = "/proc") -> Mount | None:
    """The mount holding `path` (the longest mount point above its real path), or None."""
    mounts = read_mountinfo(proc_root)
    if mounts is None:
        return None
    real = os.path.realpath(path)
    best: Mount | None = None
    for m in mounts:
        if (real == m.point or real.startswith(m.point.rstrip("/") + "/")) and \
                (best is None or len(m.point) >= len(best.point)):
            best = m
    return best


def hidepid(proc_root: str = "/proc") -> bool:
    """Whether /proc (at `proc_root`) is mounted with hidepid: other users' processes are hidden from us."""
    for m in read_mountinfo(proc_root) or ():
        if m.point == proc_root and "hidepid=" in m.options:
            return not ("hidepid=0" in m.options or "hidepid=off" in m.options)
    return False
