"""The engine owner's cleanup of the engines' own buffers: what its engine and workers mapped at READY.

vLLM's engine and workers map Python shared memory (`psm_*`: the shm
broadcast ring, the tensor arena), NCCL its `nccl-*` transport files; a
creator unlinks them only on a clean exit, which vLLM's shutdown (SIGKILL)
never gives (docs/NODE.md §6). At READY the owner records each file of an
engine family (kvcached.node.clean.leftovers.families) in the layout's /dev/shm that
the engine processes or their descendants map or hold open, by identity:
(st_dev, st_ino) as the process's own mapping or fd names it, confirmed by
the entry in the directory, plus the kernel file handle. A file made after
READY, or by anyone else, is never captured.

After a confirmed engine exit, and once none of the processes seen at READY
is alive (a worker still dying maps its buffers for a moment more), the
captured files are judged once by the engine pass's own decision on a fresh
/proc pass (grace 0: they are known to be this serve's) and removed through
its guarded act, and only while the name still holds the captured inode. A
file that any live process maps or holds is kept, for good: `kvctl gc
--engines` judges it later. The owner vouches for a /proc view of its own
PID namespace (a pod without hostPID): the buffers are its serve's, made for
processes it started, and what it can see that maps them still keeps them.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace

from ..base.ident import file_handle, same_file
from ..base.layout import Layout
from ..clean.report import Report

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CapturedBuffer:
    name: str
    ident: tuple[int, int]
    handle: bytes | None


def _family_files(shm_fd: int) -> dict[tuple[int, int], str]:
    """(st_dev, st_ino) -> name of every single-link regular file in the directory whose name is an engine family's."""
    from ..clean.leftovers.families import Where, match_name

    out: dict[tuple[int, int], str] = {}
    for name in os.listdir(shm_fd):
        if match_name(Where.SHM, name) is None:
            continue
        try:
            st = os.stat(name, dir_fd=shm_fd, follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
            out[(st.st_dev, st.st_ino)] = name
    return out


def _used_by(pid: int, dev: int) -> set[tuple[int, int]]:
    """Files on device `dev` that process `pid` maps or holds open, by identity (empty when it cannot be read)."""
    out: set[tuple[int, int]] = set()
    field = f"{os.major(dev):02x}:{os.minor(dev):02x}".encode()
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) >= 5 and parts[3] == field and parts[4] != b"0":
                    out.add((dev, int(parts[4])))
    except (OSError, ValueError):
        pass
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            st = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if st.st_dev == dev:
            out.add((st.st_dev, st.st_ino))
    return out


def _serve_processes(pids: Iterable[int]) -> list[tuple[int, float]]:
    """(pid, start time) of each process and of all its descendants."""
    import psutil

    out: list[tuple[int, float]] = []
    for pid in pids:
        try:
            top = psutil.Process(pid)
            procs = [top, *top.children(recursive=True)]
        except psutil.Error:
            continue
        for p in procs:
            try:
                out.append((p.pid, p.create_time()))
            except psutil.Error:
                continue
    return out


def _still_maps(pid: int, start: float) -> bool:
    """The process of that identity is alive and still has an address space (a zombie has none)."""
    import psutil

    try:
        if psutil.Process(pid).create_time() != start:
            return False
        with open(f"/proc/{pid}/maps", "rb") as f:
            return bool(f.read(1))
    except (psutil.Error, OSError):
        return False


class BufferCleanup:
    """Capture the engine-family buffers a serve maps at READY; after its exit, remove the ones nobody uses."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.buffers: dict[str, CapturedBuffer] = {}
        self._procs: list[tuple[int, float]] = []
        self._lock = threading.Lock()
        self.captured = False
        self.done = False

    def capture(self, pids: Iterable[int]) -> int:
        """Record the family buffers that `pids` and their descendants map or hold now; how many."""
        with self._lock:
            if self.captured or self.done:
                return len(self.buffers)
            self._procs = _serve_processes(pids)
            try:
                shm_fd = os.open(self.layout.shm_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                self.captured = True
                return 0
            try:
                files = _family_files(shm_fd)
                dev = os.fstat(shm_fd).st_dev
                used = set().union(*(_used_by(pid, dev) for pid, _ in self._procs))
                for ident in used & files.keys():
                    name = files[ident]
                    self.buffers[name] = CapturedBuffer(name, ident, file_handle(name, shm_fd))
            finally:
                os.close(shm_fd)
            self.captured = True
            return len(self.buffers)

    def cleanup(self) -> Report:
        """Once the serve's processes are gone: remove the captured buffers no live process uses. Never raises."""
        with self._lock:
            now = time.time()
            if self.done or not self.captured or not self.buffers:
                self.done = self.done or self.captured
                return Report(dry_run=False, entries=[], errors=[], started=now, finished=now)
            alive = [pid for pid, start in self._procs if _still_maps(pid, start)]
            if alive:
                pending = tuple((os.path.join(self.layout.shm_dir, n), f"PID {alive[0]} of this serve still runs; "
                                 "will retry") for n in sorted(self.buffers))
                return Report(dry_run=False, entries=[], errors=[], started=now, finished=now, pending=pending)
            try:
                return self._judge_and_remove()
            except Exception as e:  # never raise into the engine's shutdown
                log.warning("buffer cleanup in %s failed: %s", self.layout.shm_dir, e)
                return Report(dry_run=False, entries=[], errors=[f"{self.layout.shm_dir}: {e}"], started=now,
                              finished=time.time())
            finally:
                self.done = True

    def _judge_and_remove(self) -> Report:
        from ..base.enums import Action
        from ..clean.cleanup import execute
        from ..clean.leftovers.act import plan_engines
        from ..clean.rules import Policy

        p = plan_engines(self.layout, Policy(grace=0.0), names=sorted(self.buffers), whole_view=True)
        mine = [c for c in p.candidates if (b := self.buffers.get(c.name)) is not None
                and c.ident == b.ident and same_file(b.handle, c.handle)]
        report = execute(replace(p, candidates=mine), dry_run=False)
        # What the owner says of its own act: each removal that failed (what the pass could not read, gc says).
        return replace(report, errors=[f"{e.path}: {e.note}" for e in report.entries if e.action is Action.FAILED])
