"""Domain errors: every OS failure is translated at the boundary into one of these,
carrying the path, pid or name an operator needs to act on it, and its category.

The category (enums.Category) says what kind of failure it is; kvctl maps
categories to exit codes in one table (kvctl/exitcodes.py), so a new error
class only has to say which kind it is, and no caller tests error classes.
"""

from __future__ import annotations

from typing import ClassVar

from .enums import Category


class KvcachedError(Exception):
    """Base of every error the kvcached library raises on purpose."""

    category: ClassVar[Category] = Category.FAILED


class InvalidName(KvcachedError, ValueError):
    """An IPC name or path that the naming rules reject."""

    category = Category.BAD_INPUT


class NotASegment(KvcachedError):
    """A path that is not a kvcached limit segment (type, size or link count)."""

    category = Category.REFUSED

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"{path}: not a kvcached segment ({why})")
        self.path = path
        self.why = why


class SegmentMissing(KvcachedError, FileNotFoundError):
    """The segment named does not exist."""

    category = Category.NOT_FOUND

    def __init__(self, path: str) -> None:
        super().__init__(f"{path}: no such segment")
        self.path = path


class SegmentBusy(KvcachedError):
    """Another process held the segment's data lock for longer than we wait."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__(f"{path}: locked by another process for over {timeout:g}s")
        self.path = path


class UnsafeDirectory(KvcachedError):
    """A socket directory we may not use: not ours, a link, or writable by others."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"{path}: refusing to use socket directory ({why})")
        self.path = path
        self.why = why


class SocketInUse(KvcachedError):
    """A live listener (or one we cannot prove dead) already serves our socket path."""

    def __init__(self, path: str, pids: tuple[int, ...], why: str) -> None:
        who = ", ".join(str(p) for p in pids) if pids else "an unidentified process"
        super().__init__(f"{path}: already served by PID {who} ({why})")
        self.path = path
        self.pids = pids
        self.why = why


class PathTooLong(KvcachedError, ValueError):
    """A Unix socket path over the kernel's 108-byte sun_path limit."""

    category = Category.BAD_INPUT


class IpcError(KvcachedError):
    """A worker IPC request failed: transport, protocol or remote error."""


class ProtocolError(IpcError):
    """A peer sent a frame we do not accept."""
