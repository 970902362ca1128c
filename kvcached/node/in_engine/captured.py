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

from ..base.ident import Unlinked, fd_handle, file_handle, same_file, unlink_if_same
from ..base.layout import Layout
from ..clean.decide import Policy, State, decide
from ..clean.facts import listening_facts
from ..clean.scan import Kind, candidate_from_stat
from ..state.lease import ForkSafe, ofd_conflict
from ..state.sockdiag import bound

log = logging.getLogger("kvcached.node.owner")


@dataclass(frozen=True)
class OwnerResult:
    """What one cleanup call did."""

    removed: tuple[str, ...] = ()
    kept: tuple[tuple[str, str], ...] = ()  # (path, why)
    errors: tuple[str, ...] = ()
    complete: bool = False


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

    def cleanup(self) -> OwnerResult:
        """Unlink the captured segment if unchanged and unleased; never raises."""
        with self._lock:
            if self.done or self._fd is None:
                return OwnerResult(complete=True)
            try:
                return self._cleanup_locked()
            except Exception as e:  # never raise into the engine's shutdown
                log.warning("segment cleanup of %s failed: %s", self.path, e)
                return OwnerResult(errors=(f"{self.path}: {e}",))

    def _cleanup_locked(self) -> OwnerResult:
        assert self._fd is not None
        pinned = os.fstat(self._fd)
        try:
            cur = os.lstat(self.path)
        except FileNotFoundError:
            self._finish()
            return OwnerResult(complete=True)
        if (cur.st_dev, cur.st_ino) != (pinned.st_dev, pinned.st_ino):
            self._finish()
            return OwnerResult(kept=((self.path, "replaced by a successor"),), complete=True)
        if ofd_conflict(self._fd):
            # A same-name successor of ours joined this segment: it is theirs now.
            self._finish()
            return OwnerResult(kept=((self.path, "a successor holds its lease"),), complete=True)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return OwnerResult(kept=((self.path, "in use; will retry"),))
        # The name is checked again (through the directory) after taking the lock.
        parent = os.open(os.path.dirname(self.path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            done = unlink_if_same(parent, os.path.basename(self.path), (pinned.st_dev, pinned.st_ino),
                                  fd_handle(self._fd))
        finally:
            os.close(parent)
        self._finish()
        if done is Unlinked.REPLACED:
            return OwnerResult(kept=((self.path, "replaced by a successor"),), complete=True)
        log.info("removed segment %s", self.path)
        return OwnerResult(removed=(self.path,), complete=True)

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

    def cleanup(self) -> OwnerResult:
        """Remove captured nodes nobody serves; directories only when this call emptied them. Never raises."""
        with self._lock:
            if self.done or not self._captured:
                return OwnerResult(complete=self.done)
            try:
                return self._cleanup_locked()
            except Exception as e:
                log.warning("socket cleanup of %s failed: %s", self.name, e)
                return OwnerResult(errors=(f"{self.name}: {e}",))

    def _cleanup_locked(self) -> OwnerResult:
        facts = listening_facts()
        policy = Policy(grace=0.0)
        now = time.time()
        removed: list[str] = []
        kept: list[tuple[str, str]] = []
        errors: list[str] = []
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
                try:
                    st = os.stat(os.path.basename(path), dir_fd=dir_fd, follow_symlinks=False)
                except FileNotFoundError:
                    del self._pending[path]
                    vanished_stages.add(node.stage)
                    continue
                if (st.st_dev, st.st_ino) != node.ident or not same_file(
                        node.handle, file_handle(os.path.basename(path), dir_fd)):
                    del self._pending[path]  # a successor's node: never ours
                    kept.append((path, "replaced by a successor"))
                    continue
                c = candidate_from_stat(Kind.SOCKET, path, os.path.basename(path), st,
                               deployment=self.name, rank=node.rank, stage=node.stage)
                if c.ident not in facts.listeners:
                    test, terr = bound(path, dir_fd)
                    c = c._replace(bind=test, bind_errno=terr)
                d = decide(c, facts, policy, now)
                if d.state is not State.STALE:
                    kept.append((path, f"{d.state}: {d.detail}"))
                    continue
                try:
                    done = unlink_if_same(dir_fd, os.path.basename(path), node.ident, node.handle)
                except OSError as e:
                    errors.append(f"{path}: {e.strerror}")
                    continue
                del self._pending[path]
                if done is Unlinked.REPLACED:
                    continue  # replaced while we tested it: a successor's
                removed.append(path)
                emptied_stages.add(node.stage)
            finally:
                os.close(dir_fd)
        removed += self._remove_dirs(emptied_stages, vanished_stages)
        self.done = not self._pending
        return OwnerResult(tuple(removed), tuple(kept), tuple(errors), self.done)

    def _remove_dirs(self, emptied: set[int], vanished: set[int]) -> list[str]:
        """rmdir the stage dirs (then the root) that this call emptied of captured nodes.

        Only in the call that saw a captured node go: either we removed it, or
        its worker did (workers stopping together may each leave the directory
        to the other). In the second case the directory must still be the one
        present at capture: a successor's re-created directory is not ours.
        """
        out: list[str] = []
        root = self.layout.socket_dir(self.name)

        def ours(d: str, we_removed: bool) -> bool:
            return (we_removed and d not in self._dirs) or (d in self._dirs and _dir_identity(d) == self._dirs[d])

        for stage in sorted(s for s in emptied | vanished if s > 0):
            d = self.layout.stage_dir(self.name, stage)
            if ours(d, stage in emptied) and _rmdir_if_unleased(d, root):
                out.append(d)
        if (emptied or vanished) and ours(root, bool(emptied)) and _rmdir_if_unleased(root, root):
            out.append(root)
        return out


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


def _rmdir_if_unleased(path: str, lease_dir: str) -> bool:
    # A same-name successor of ours holds LOCK_SH on the root directory from before
    # it binds until it exits; while it does, the directories are its own.
    try:
        fd = os.open(lease_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        os.rmdir(path)
        return True
    except OSError as e:
        if e.errno not in (errno.ENOENT, errno.ENOTEMPTY, errno.EEXIST):
            log.warning("could not remove %s: %s", path, e.strerror)
        return False
    finally:
        os.close(fd)
