"""The worker listener: our replacement for upstream's fragile serial pickle thread."""

from __future__ import annotations

import errno
import logging
import os
import selectors
import socket
import stat
import struct
import threading
from collections.abc import Callable
from typing import Any

from ...node import (
    Bind,
    DirLease,
    KvcachedError,
    Layout,
    ProtocolError,
    SocketInUse,
    UnsafeDirectory,
    bound,
    gather_facts,
)
from .protocol import REPLY, REQUEST, VERSION, encode, recv_frame

log = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any]], dict[str, Any]]
_UCRED = struct.Struct("3i")


def ensure_private_dir(path: str) -> None:
    """Create `path` 0700, or accept it only if it is a real directory of ours that others cannot write."""
    try:
        os.mkdir(path, 0o700)
        return
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectory(path, "not a directory" if not stat.S_ISLNK(st.st_mode) else "a symbolic link")
    if st.st_uid != os.geteuid():
        raise UnsafeDirectory(path, f"owned by uid {st.st_uid}, we are uid {os.geteuid()}")
    if st.st_mode & 0o022:
        raise UnsafeDirectory(path, f"mode {stat.S_IMODE(st.st_mode):o} lets others write to it")


class WorkerListener:
    """Serve one worker's socket: `[pp<k>/]w<rank>.sock` of deployment `name`."""

    def __init__(self, layout: Layout, name: str, rank: int, stage: int = 0, *,
                 timeout: float = 5.0, max_clients: int = 16) -> None:
        self.layout = layout
        self.name = name
        self.rank = rank
        self.stage = stage
        self.timeout = timeout
        self.path = layout.socket_path(name, rank, stage)
        self._handlers: dict[str, Handler] = {"ping": self._ping}
        self._slots = threading.BoundedSemaphore(max_clients)
        self._sock: socket.socket | None = None
        self._ident: tuple[int, int] | None = None
        self._lease: DirLease | None = None
        self._thread: threading.Thread | None = None
        self._stop_r, self._stop_w = -1, -1
        self._lock = threading.Lock()
        self._stopping = False
        # Whether this thread is inside start() (and may hold _lock), and a stop() that had to
        # wait for it: a signal handler runs on the main thread, possibly inside its start().
        self._tls = threading.local()
        self._stop_pending = False

    def register(self, command: str, handler: Handler) -> None:
        """Add a command (the runtime adds map / unmap / created)."""
        self._handlers[command] = handler

    def _ping(self, _args: dict[str, Any]) -> dict[str, Any]:
        return {"pid": os.getpid(), "rank": self.rank, "stage": self.stage, "version": VERSION, "name": self.name}

    def _take_lease(self) -> None:
        root = self.layout.socket_dir(self.name)
        for _ in range(5):
            ensure_private_dir(root)
            lease = DirLease(root)
            try:
                lease.acquire()  # blocks while a cleaner holds LOCK_EX
            except FileNotFoundError:
                continue
            # A cleaner may have removed the directory before we locked it: our lock
            # would then guard an unlinked inode. Only the inode at the path counts.
            st = os.fstat(lease.fd)  # type: ignore[arg-type]
            try:
                cur = os.lstat(root)
            except FileNotFoundError:
                lease.release()
                continue
            if (cur.st_dev, cur.st_ino) == (st.st_dev, st.st_ino):
                self._lease = lease
                if self.stage:
                    ensure_private_dir(self.layout.stage_dir(self.name, self.stage))
                return
            lease.release()
        raise KvcachedError(f"{root}: directory keeps changing under us; is a cleaner looping?")

    def _clear_path(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise SocketInUse(self.path, (), "something that is not a socket occupies the path; left alone")
        # The passive bind test, never a connect: a same-name upstream worker's
        # listener dies on a bare connect-and-close (docs/NODE.md §3).
        result, err = bound(self.path)
        if result is Bind.BOUND:
            # A full /proc pass only here, to name who serves it in the error.
            raise SocketInUse(self.path, gather_facts().serving_pids((st.st_dev, st.st_ino)),
                              "a socket is bound there")
        if result is Bind.UNBOUND:
            try:
                cur = os.lstat(self.path)
                if (cur.st_dev, cur.st_ino) == (st.st_dev, st.st_ino):
                    os.unlink(self.path)
                    log.info("removed stale socket %s", self.path)
            except FileNotFoundError:
                pass
            return
        if result is not Bind.GONE:
            raise SocketInUse(self.path, (), f"cannot prove it dead (bind test: {err})")

    def start(self) -> WorkerListener:
        """Create the directory, take the lease, clear a stale node, bind and serve.

        A stop() asked for on this thread meanwhile (a SIGTERM handler) runs as start() returns.
        """
        # Marked before the lock is taken and cleared after it is let go, so that a handler
        # interrupting this thread anywhere in between defers instead of waiting for the lock.
        self._tls.starting = True
        try:
            with self._lock:
                self._start()
        except BaseException:
            self._stop_pending = False  # nothing was started: nothing left to stop
            raise
        finally:
            self._tls.starting = False
        if self._stop_pending:
            self._stop_pending = False
            self.stop()
        return self

    def _start(self) -> None:
        if self._sock is not None:
            return
        self.layout.check_socket_path(self.path)
        self._take_lease()
        try:
            self._clear_path()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            bound = False
            try:
                sock.bind(self.path)
                bound = True
                st = os.lstat(self.path)
                os.chmod(self.path, 0o600)
                sock.listen(64)
            except BaseException as e:
                # Anything between bind and serving (an OSError, or SystemExit
                # from a SIGTERM handler) must not leave our node behind.
                sock.close()
                if bound:
                    _unlink_if_same(self.path, st if "st" in locals() else None)
                if isinstance(e, OSError) and e.errno == errno.EADDRINUSE:
                    raise SocketInUse(self.path, (), "another process bound it first") from None
                raise
        except BaseException:
            self._lease.release()  # type: ignore[union-attr]
            self._lease = None
            raise
        self._sock, self._ident = sock, (st.st_dev, st.st_ino)
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._serve, name=f"kvcached-ipc-{self.stage}-{self.rank}",
                                        daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        assert self._sock is not None
        sel.register(self._sock, selectors.EVENT_READ)
        sel.register(self._stop_r, selectors.EVENT_READ)
        try:
            while True:
                for key, _ in sel.select():
                    if key.fileobj == self._stop_r:
                        return
                    try:
                        conn, _ = self._sock.accept()
                    except OSError:
                        continue  # e.g. ECONNABORTED: the peer gave up; keep serving
                    if not self._slots.acquire(blocking=False):
                        conn.close()  # too many slow peers: shed this one, never stall the rest
                        continue
                    threading.Thread(target=self._handle, args=(conn,), daemon=True).start()
        finally:
            sel.close()

    def _peer_allowed(self, conn: socket.socket) -> bool:
        _pid, uid, _gid = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        return uid in (os.geteuid(), 0)

    def _handle(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(self.timeout)
            if not self._peer_allowed(conn):
                return
            reply = self._dispatch(conn)
            if reply is not None:
                conn.sendall(encode(REPLY, reply))
        except Exception as e:  # the listener never dies on a client's error
            log.debug("ipc client error on %s: %s", self.path, e)
        finally:
            conn.close()
            self._slots.release()

    def _dispatch(self, conn: socket.socket) -> dict[str, Any] | None:
        try:
            version, req = recv_frame(conn, REQUEST)
        except ProtocolError as e:
            if "closed after 0 of" in str(e):
                return None  # a bare connect (a liveness probe): nothing to answer
            return {"ok": False, "error": f"protocol error: {e}", "version": VERSION}
        if version != VERSION:
            return {"ok": False, "error": f"protocol version {version} not supported (we speak {VERSION})",
                    "version": VERSION}
        cmd, args = req.get("cmd"), req.get("args", {})
        handler = self._handlers.get(cmd) if isinstance(cmd, str) else None
        if handler is None or not isinstance(args, dict):
            return {"ok": False, "error": f"unknown command {cmd!r}", "version": VERSION}
        try:
            return {"ok": True, "result": handler(args), "version": VERSION}
        except Exception as e:
            return {"ok": False, "error": f"{cmd}: {type(e).__name__}: {e}", "version": VERSION}

    def stop(self) -> None:
        """Close, unlink our own node, remove directories we leave empty, release the lease.

        Re-entrant: a SIGTERM handler that calls stop() while a stop() is already
        running in the same thread returns at once instead of deadlocking; one that
        interrupts start() on its thread (which holds the lock) leaves the stop to
        start(), which stops before it returns.
        """
        if self._stopping:
            return
        if getattr(self._tls, "starting", False):
            self._stop_pending = True
            return
        self._stopping = True
        try:
            self._stop()
        finally:
            self._stopping = False

    def _stop(self) -> None:
        with self._lock:
            if self._sock is None:
                return
            os.write(self._stop_w, b"x")
            if self._thread is not None:
                self._thread.join(timeout=5)
            self._sock.close()
            for fd in (self._stop_r, self._stop_w):
                os.close(fd)
            self._sock = None
            try:
                st = os.lstat(self.path)
                if (st.st_dev, st.st_ino) == self._ident:
                    os.unlink(self.path)
            except FileNotFoundError:
                pass
            lease = self._lease
            self._lease = None
            if lease is None:
                return
            try:
                # Only the last process of the deployment may remove directories: an
                # exclusive lock proves nobody else holds the lease (or is binding).
                if lease.try_upgrade():
                    if self.stage:
                        _rmdir_quiet(self.layout.stage_dir(self.name, self.stage))
                    _rmdir_quiet(self.layout.socket_dir(self.name))
            finally:
                lease.release()

    def __enter__(self) -> WorkerListener:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _unlink_if_same(path: str, st: os.stat_result | None) -> None:
    try:
        cur = os.lstat(path)
        if st is None or (cur.st_dev, cur.st_ino) == (st.st_dev, st.st_ino):
            os.unlink(path)
    except OSError:
        pass


def _rmdir_quiet(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError as e:
        if e.errno not in (errno.ENOENT, errno.ENOTEMPTY, errno.EEXIST):
            log.warning("could not remove %s: %s", path, e.strerror)
