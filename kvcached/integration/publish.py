"""What kvcached's plugin did in this engine process, published where kvctl reads it passively (docs/NODE.md §7).

`kvctl doctor engine` answers for the running serves from what each of
their processes says of itself: whether kvcached is active in it, and which
patches it applied. The process says so in a sealed memfd named
`kvcached-published` (kvcached.node.base.published: the record), which kvctl
finds among its descriptors and reads through /proc/PID/fd. Why a memfd:

- it is nothing on the node: no file in /dev/shm or /tmp for a cleaner to
  judge, none left behind by a killed serve (it goes with the process);
- it is read passively, with the /proc access kvctl's pass already needs: no
  socket is connected to, no request made of a worker;
- each process has its own, so a serve's processes are told apart.

Each update writes a whole new record into a new memfd, seals it (no one,
root included, can change it) and only then closes the previous one,
identity-checked: a reader sees an old record or a new one, never half of
one (of two seen at once, the higher `seq` is current). A forked child
inherits its parent's descriptor, so the child replaces it at once with its
own record (register_at_fork). Nothing here may raise into the engine: a
failure is one debug line, and the serve runs on.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Protocol

from kvcached.node import PUBLISHED_MEMFD, Published

log = logging.getLogger(__name__)

_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


class _Registry(Protocol):
    """What is published of a patch kit's Registry (kvcached.integration.patchkit)."""

    engine: str

    def applied(self) -> tuple[str, ...]: ...


_lock = threading.Lock()
_record: Published | None = None
_held: tuple[int, int, int] | None = None  # (fd, st_dev, st_ino) of the memfd that holds the record now
_versions: dict[str, str | None] = {}
_forks_watched = False


def publish(registry: _Registry, statuses: Mapping[str, Any] | None = None) -> None:
    """Say what `registry` applied in this process (and how each patch in `statuses` ended); never raises."""
    global _record, _forks_watched
    try:
        with _lock:
            _record = _next(registry, statuses)
            _hold(_record)
            if not _forks_watched:
                os.register_at_fork(after_in_child=_in_child)
                _forks_watched = True
    except Exception as e:  # a record kvctl cannot read is no reason to disturb the engine
        log.debug("kvcached: could not publish what the plugin did in this process: %s", e)


def published() -> Published | None:
    """The record this process publishes now (None: nothing)."""
    return _record


def withdraw() -> None:
    """Publish nothing from now on in this process, nor in the children it forks (its patches were reverted).

    Tests that fork serves from a process which loaded the plugin itself use it, so that a serve says only
    what its own plugin did.
    """
    global _record, _held
    with _lock:
        if _held is not None:
            _let_go(_held)
        _record = _held = None


def _next(registry: _Registry, statuses: Mapping[str, Any] | None) -> Published:
    from kvcached import settings

    engine = registry.engine.lower()
    merged = dict(_record.statuses) if _record is not None else {}
    merged.update({name: str(status) for name, status in (statuses or {}).items()})
    return Published(pid=os.getpid(), engine=engine, label=registry.engine, engine_version=_version(engine),
                     kvcached_version=_version("kvcached") or "0+unknown", root=settings.ROOT.get(),
                     applied=tuple(registry.applied()), statuses=merged,
                     seq=(_record.seq + 1) if _record is not None else 1, updated=time.time())


def _version(distribution: str) -> str | None:
    if distribution not in _versions:
        from importlib.metadata import PackageNotFoundError, version

        try:
            _versions[distribution] = version(distribution)
        except PackageNotFoundError:
            _versions[distribution] = None
    return _versions[distribution]


def _hold(record: Published) -> None:
    """Put `record` in a new sealed memfd, then let the previous one go."""
    global _held
    data = record.encode()
    fd = os.memfd_create(PUBLISHED_MEMFD, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    previous, _held = _held, (fd, st.st_dev, st.st_ino)
    if previous is not None:
        _let_go(previous)


def _let_go(held: tuple[int, int, int]) -> None:
    """Close the descriptor of an earlier record, only while it still is that record's memfd.

    Engine code may have closed it (a close_range before an exec) and the
    number been reused for a file of its own: closing that would break the
    engine, so a descriptor that is no longer our memfd is left alone.
    """
    fd, dev, ino = held
    try:
        st = os.fstat(fd)
    except OSError:
        return
    if (st.st_dev, st.st_ino) == (dev, ino):
        os.close(fd)


def _in_child() -> None:
    """A forked child: its own record (its pid), in its own memfd; the inherited descriptor closed.

    Runs right after fork, before any other thread of the child exists. The
    lock may have been held by a parent's thread at the fork: it is replaced,
    not taken.
    """
    global _lock, _record
    _lock = threading.Lock()
    try:
        if _record is not None:
            _record = replace(_record, pid=os.getpid(), seq=_record.seq + 1, updated=time.time())
            _hold(_record)
    except Exception as e:
        log.debug("kvcached: could not publish for a forked child: %s", e)
