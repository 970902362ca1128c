"""Owner-side cleanup: what the process that owns the engines removes after they exit.

The owner (vLLM's API server or supervisor, the harness's api process) captures
the deployment's state once the engines are READY and, after every engine has a
confirmed exit code, removes what it captured and no process serves. It only
ever removes what it captured: a node or segment re-created by a same-name
successor has another inode and is never ours.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import threading
import time
from dataclasses import dataclass

from ..base.enums import Action, State, StrEnum
from ..base.ident import fd_handle, file_handle, same_file
from ..base.layout import Layout
from ..clean.cleanup import Actor, act_segment
from ..clean.decide import Policy, decide
from ..clean.facts import listening_facts
from ..clean.report import Decision, Report
from ..clean.scan import Candidate, Kind, candidate_from_stat
from ..state.lease import ForkSafe, ofd_conflict
from ..state.sockdiag import bound

log = logging.getLogger(__name__)


class OwnerReason(StrEnum):
    """Why the owner acts on what it captured, or leaves it (its report's reasons besides decide's)."""

    CAPTURED = "captured_by_owner"    # captured at READY, and every engine has a confirmed exit
    SUCCESSOR = "successor"           # the name is a same-name successor's now


_EMPTY_DIR = Decision(State.STALE, OwnerReason.CAPTURED, "emptied of the worker sockets the owner captured")


class _Run:
    """One cleanup call: the one guarded act (cleanup.Actor) and what the call must come back for."""

    def __init__(self) -> None:
        self.started = time.time()
        self.actor = Actor(dry_run=False, deadline=None)
        self.pending: list[tuple[str, str]] = []
        self.errors: list[str] = []

    def report(self) -> Report:
        self.actor.close()
        failed = [f"{e.path}: {e.note}" for e in self.actor.entries if e.action is Action.FAILED]
        return Report(dry_run=False, entries=self.actor.entries, errors=self.errors + failed, started=self.started,
                      finished=time.time(), pending=tuple(self.pending))


def _failed(what: str, e: Exception) -> Report:
    now = time.time()
    return Report(dry_run=False, entries=[], errors=[f"{what}: {e}"], started=now, finished=now,
                  pending=((what, "cleanup failed; will retry"),))


def _done() -> Report:
    now = time.time()
    return Report(dry_run=False, entries=[], errors=[], started=now, finished=now)


@dataclass(kw_only=True)
class _Node:
    stage: int
    rank: int
    path: str
    ident: tuple[int, int]
    handle: bytes | None


class SegmentCleanup(ForkSafe):
    """Pin the segment's inode at capture; later unlink it only if the path still names that inode."""

    def __init__(self, layout: Layout, name: str) -> None:
        self.name = name
        self.path = layout.segment_path(name)
        self._fd: int | None = None
        self._lock = threading.Lock()
        self.done = False
        self._track()  # a forked child holding our pin would show as a holder of the segment to gc

    def capture(self) -> bool:
        """Open (and so pin) the segment; False when there is none to capture."""
        with self._lock:
            if self._fd is not None or self.done:
                return self._fd is not None
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as e:
                log.debug("segment %s not captured: %s", self.path, e.strerror)
                return False
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                os.close(fd)
                return False
            self._fd = fd
            return True

    def cleanup(self) -> Report:
        """Unlink the captured segment if unchanged and unleased (gc's own act on a segment); never raises."""
        with self._lock:
            if self.done or self._fd is None:
                return _done()
            try:
                return self._cleanup_locked()
            except Exception as e:  # never raise into the engine's shutdown
                log.warning("segment cleanup of %s failed: %s", self.path, e)
                return _failed(self.path, e)

    def _cleanup_locked(self) -> Report:
        assert self._fd is not None
        pinned = os.fstat(self._fd)
        run = _Run()
        c = candidate_from_stat(Kind.SEGMENT, self.path, os.path.basename(self.path), pinned,
                                handle=fd_handle(self._fd), deployment=self.name)
        try:
            cur = os.lstat(self.path)
        except FileNotFoundError:
            self._finish()
            return run.report()
        if (cur.st_dev, cur.st_ino) != c.ident:
            self._finish()
            run.actor.record(c, Decision(State.FOREIGN, OwnerReason.SUCCESSOR, "replaced by a successor"),
                             Action.KEPT)
            return run.report()
        if ofd_conflict(self._fd):
            # A same-name successor of ours joined this segment: it is theirs now.
            self._finish()
            run.actor.record(c, Decision(State.LIVE, OwnerReason.SUCCESSOR, "a successor holds its lease"),
                             Action.KEPT)
            return run.report()
        d = Decision(State.STALE, OwnerReason.CAPTURED, "captured at READY; every engine exited")
        try:
            dir_fd = os.open(os.path.dirname(self.path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            run.actor.record(c, d, Action.FAILED, f"open: {e.strerror}")
            run.pending.append((self.path, "its directory could not be opened; will retry"))
            return run.report()
        try:
            # The same act as gc's: re-opened by name as the pinned file, its lease and flock taken, the name
            # checked again through the directory before unlinkat.
            gone = act_segment(run.actor, dir_fd, c, d)
        finally:
            os.close(dir_fd)
        if gone:
            self._finish()
            log.info("removed segment %s", self.path)
        else:
            # Kept as the act says why (in use, leased or replaced since): the next call sees which.
            run.pending.append((self.path, "kept for now; will retry"))
        return run.report()

    def _finish(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.done = True


class WorkerSocketCleanup:
    """Remember the worker nodes present at capture; later remove those still unchanged and unserved."""

    def __init__(self, layout: Layout, name: str, tp_size: int, pp_size: int = 1) -> None:
        self.layout = layout
        self.name = name
        self.tp_size = tp_size
        self.pp_size = pp_size
        self._pending: dict[str, _Node] = {}
        self._dirs: dict[str, tuple[tuple[int, int], bytes | None]] = {}  # stage/root dir -> identity at capture
        self._captured = False
        self._lock = threading.Lock()
        self.done = False

    def capture(self) -> int:
        """Record (st_dev, st_ino) of every `[pp<k>/]w<r>.sock` present now; returns how many."""
        with self._lock:
            if self.done:
                return 0
            self._pending.clear()
            self._dirs.clear()
            for d in {self.layout.stage_dir(self.name, s) for s in range(self.pp_size)}:
                ident = _dir_identity(d)
                if ident is not None:
                    self._dirs[d] = ident
            for stage, rank, path in self.layout.socket_paths(self.name, self.tp_size, self.pp_size):
                try:
                    dir_fd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
                except OSError:
                    continue
                try:
                    st = os.stat(os.path.basename(path), dir_fd=dir_fd, follow_symlinks=False)
                    handle = file_handle(os.path.basename(path), dir_fd)
                except OSError:
                    continue  # absent at capture: never ours to claim
                finally:
                    os.close(dir_fd)
                if stat.S_ISSOCK(st.st_mode):
                    self._pending[path] = _Node(stage=stage, rank=rank, path=path, ident=(st.st_dev, st.st_ino),
                                                handle=handle)
            self._captured = True
            return len(self._pending)

    @property
    def pending(self) -> list[str]:
        with self._lock:
            return sorted(self._pending)

    def cleanup(self) -> Report:
        """Remove captured nodes nobody serves; directories only when this call emptied them. Never raises."""
        with self._lock:
            if self.done or not self._captured:
                return _done() if self.done else Report(dry_run=False, entries=[], errors=[], started=time.time(),
                                                        finished=time.time(), pending=((self.name, "not captured"),))
            try:
                return self._cleanup_locked()
            except Exception as e:
                log.warning("socket cleanup of %s failed: %s", self.name, e)
                return _failed(self.name, e)

    def _cleanup_locked(self) -> Report:
        facts = listening_facts()
        policy = Policy(grace=0.0)
        now = time.time()
        run = _Run()
        emptied_stages: set[int] = set()
        vanished_stages: set[int] = set()  # captured nodes their own worker removed (a graceful stop)
        for path, node in sorted(self._pending.items()):
            parent = os.path.dirname(path)
            try:
                dir_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                del self._pending[path]  # its directory is gone, so is the node
                continue
            try:
                name = os.path.basename(path)
                try:
                    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                except FileNotFoundError:
                    del self._pending[path]
                    vanished_stages.add(node.stage)
                    continue
                c = candidate_from_stat(Kind.SOCKET, path, name, st, handle=file_handle(name, dir_fd),
                                        deployment=self.name, rank=node.rank, stage=node.stage)
                if c.ident != node.ident or not same_file(node.handle, c.handle):
                    del self._pending[path]  # a successor's node: never ours
                    run.actor.record(c, Decision(State.FOREIGN, OwnerReason.SUCCESSOR, "replaced by a successor"),
                                     Action.KEPT)
                    continue
                if c.ident not in facts.listeners:
                    test, terr = bound(path, dir_fd)
                    c = c._replace(bind=test, bind_errno=terr)
                d = decide(c, facts, policy, now)
                if d.state is not State.STALE:
                    run.actor.record(c, d, Action.KEPT)
                    continue
                # The candidate is the node as captured: the act removes exactly that inode (one act for gc and
                # the owner: identity and file handle re-checked through the directory fd before unlinkat).
                c = c._replace(handle=node.handle)
                if run.actor.remove(dir_fd, c, d):
                    del self._pending[path]
                    emptied_stages.add(node.stage)
                elif run.actor.entries[-1].action is not Action.FAILED:
                    del self._pending[path]  # replaced while we tested it: a successor's
            finally:
                os.close(dir_fd)
        self._remove_dirs(run, emptied_stages, vanished_stages)
        self.done = not self._pending
        run.pending += [(p, "still served, or its removal failed; will retry") for p in sorted(self._pending)]
        return run.report()

    def _remove_dirs(self, run: _Run, emptied: set[int], vanished: set[int]) -> None:
        """rmdir the stage dirs (then the root) that this call emptied of captured nodes.

        Only in the call that saw a captured node go: either we removed it, or
        its worker did (workers stopping together may each leave the directory
        to the other). In the second case the directory must still be the one
        present at capture: a successor's re-created directory is not ours.
        """
        root = self.layout.socket_dir(self.name)

        def ours(d: str, we_removed: bool) -> bool:
            return (we_removed and d not in self._dirs) or (d in self._dirs and _dir_identity(d) == self._dirs[d])

        for stage in sorted(s for s in emptied | vanished if s > 0):
            d = self.layout.stage_dir(self.name, stage)
            if ours(d, stage in emptied):
                self._rmdir_if_unleased(run, d, root)
        if (emptied or vanished) and ours(root, bool(emptied)):
            self._rmdir_if_unleased(run, root, root)

    def _rmdir_if_unleased(self, run: _Run, path: str, lease_dir: str) -> None:
        # A same-name successor of ours holds LOCK_SH on the root directory from before
        # it binds until it exits; while it does, the directories are its own.
        try:
            fd = os.open(lease_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return
            c = self._dir_candidate(path)
            if c is None:
                return  # gone, not a directory, or not empty: nothing of this call's to remove
            parent_fd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                run.actor.remove(parent_fd, c, _EMPTY_DIR, rmdir=True)
            finally:
                os.close(parent_fd)
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.ENOTEMPTY, errno.EEXIST):
                log.warning("could not remove %s: %s", path, e.strerror)
        finally:
            os.close(fd)

    def _dir_candidate(self, path: str) -> Candidate | None:
        """The directory at `path` as a candidate of the act, when it is one and empty (None otherwise)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            if os.listdir(fd):
                return None  # a live peer's node, a successor's: the directory stays, and is no entry of ours
            st = os.fstat(fd)
            return candidate_from_stat(Kind.DIRECTORY, path, os.path.basename(path), st, handle=fd_handle(fd),
                                       deployment=self.name)
        finally:
            os.close(fd)


def _dir_identity(path: str) -> tuple[tuple[int, int], bytes | None] | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        return (st.st_dev, st.st_ino), fd_handle(fd)
    finally:
        os.close(fd)
