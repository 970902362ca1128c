"""The engine owner's side of cleanup, independent of vLLM's classes.

The process that starts the engine processes (vLLM's API server, or the
supervisor with `--api-server-count > 1` and in headless mode) is the only
one that reliably outlives them. `EngineOwner` captures the deployment's
segment and worker sockets once the engines are READY and, once every engine
process has a confirmed exit code, removes what it captured and nobody serves
(kvcached.owner does the deciding and the removing). What a still-living
worker serves is kept and retried in the background until the worker exits.

Nothing here raises into the engine's shutdown: failures are logged.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

from ..layout import Layout
from ..owner import OwnerResult, SegmentCleanup, WorkerSocketCleanup

log = logging.getLogger("kvcached.integration.engine_owner")

# After the original shutdown has sent SIGKILL, the exit is normally reaped in
# milliseconds; an engine in uninterruptible sleep may take longer. Past this
# the exit is unconfirmed and everything is kept (the retry thread goes on).
EXIT_WAIT_S = float(os.environ.get("KVCACHED_OWNER_EXIT_WAIT_S", "2.0"))
# How long the background retry keeps trying after shutdown, and how often.
RETRY_WINDOW_S = float(os.environ.get("KVCACHED_OWNER_RETRY_S", "60"))
RETRY_INTERVAL_S = 0.2


class ProcLike(Protocol):
    """What we need of an engine process: a multiprocessing.Process started by this process."""

    pid: int | None

    @property
    def exitcode(self) -> int | None: ...

    def join(self, timeout: float | None = None) -> None: ...


class EngineOwner:
    """Cleanup duty of one owner of engine processes (one CoreEngineProcManager)."""

    def __init__(self, processes: Sequence[ProcLike], layout: Layout, name: str,
                 tp_size: int, pp_size: int, *, headless: bool = False) -> None:
        self.processes = processes
        self.headless = headless  # engines handshake elsewhere: no READY passes through this owner
        self.layout = layout
        self.name = name
        self.tp_size = tp_size
        self.pp_size = pp_size
        self.segment = SegmentCleanup(layout, name)
        self.sockets = WorkerSocketCleanup(layout, name, tp_size, pp_size)
        self.captured = False
        self.complete = False
        self._lock = threading.RLock()
        self._retry: threading.Thread | None = None
        self.results: list[OwnerResult] = []

    def capture(self) -> None:
        """Pin the segment and remember the worker nodes present now (engines READY). Once; never raises."""
        with self._lock:
            if self.captured:
                return
            try:
                seg = self.segment.capture()
                n = self.sockets.capture()
                self.captured = True
                log.info("kvcached owner: captured %s (segment: %s, worker sockets: %d)",
                         self.name, "yes" if seg else "none", n)
                _register_sigterm_owner(self)
            except Exception as e:
                log.warning("kvcached owner: capture of %s failed, nothing will be cleaned: %s", self.name, e)

    def exits_confirmed(self, wait: float = 0.0) -> bool:
        """True when every engine process has an exit code (reaped), waiting up to `wait` seconds in all."""
        deadline = time.monotonic() + wait
        for proc in self.processes:
            if getattr(proc, "pid", None) is None:
                continue  # never started: it cannot have left anything
            if proc.exitcode is None:
                try:
                    proc.join(max(0.0, deadline - time.monotonic()))
                except (AssertionError, ValueError, OSError) as e:
                    # Not our child (join asserts that) or already closed: no proof of exit.
                    log.debug("kvcached owner: cannot reap %r: %s", proc, e)
                    return False
            if proc.exitcode is None:
                return False
        return True

    def after_shutdown(self, wait: float | None = None) -> None:
        """Run after the original shutdown: clean up if every engine exit is confirmed, else keep all. Never raises."""
        try:
            with self._lock:
                if not self.captured or self.complete:
                    return
                if not self.exits_confirmed(EXIT_WAIT_S if wait is None else wait):
                    log.warning("kvcached owner: engine exit not confirmed for %s; keeping its segment and sockets "
                                "(will retry)", self.name)
                    self._start_retry()
                    return
                self._cleanup_once()
                if not self.complete:
                    self._start_retry()
        except Exception as e:
            log.warning("kvcached owner: cleanup of %s failed: %s", self.name, e)

    def _cleanup_once(self) -> None:
        results = (self.sockets.cleanup(), self.segment.cleanup())
        self.results.extend(results)
        for r in results:
            for path in r.removed:
                log.info("kvcached owner: removed %s", path)
            for path, why in r.kept:
                log.info("kvcached owner: kept %s (%s)", path, why)
            for err in r.errors:
                log.warning("kvcached owner: %s", err)
        self.complete = all(r.complete for r in results)

    def _start_retry(self) -> None:
        if self._retry is not None and self._retry.is_alive():
            return
        ref = weakref.ref(self)
        self._retry = threading.Thread(target=_retry_loop, args=(ref,), name="kvcached-owner-retry", daemon=True)
        self._retry.start()

    def retry(self) -> bool:
        """One retry step; True when nothing is left to do."""
        with self._lock:
            if self.complete or not self.captured:
                return True
            if not self.exits_confirmed(0.0):
                return False
            self._cleanup_once()
            return self.complete


def _retry_loop(ref: "weakref.ReferenceType[EngineOwner]") -> None:
    # A worker that outlives its engine (its own teardown is slow, or it is
    # stopped) keeps serving its socket; once it exits, the node is unserved
    # and this removes it. Daemon: it never holds the owner's exit up.
    deadline = time.monotonic() + RETRY_WINDOW_S
    while time.monotonic() < deadline:
        owner = ref()
        if owner is None:
            return
        try:
            if owner.retry():
                return
        except Exception as e:
            log.warning("kvcached owner: retry failed: %s", e)
            return
        del owner
        time.sleep(RETRY_INTERVAL_S)


# The owner's own SIGTERM ------------------------------------------------------
#
# vLLM's API server and supervisor install their own SIGTERM handlers; when an
# owner still has the default disposition (e.g. an offline LLM in a script),
# SIGTERM would kill it before any shutdown runs, and nothing would clean up.
# Then we run the same gated cleanup on the way out and die by the same signal.

_sigterm_owners: "weakref.WeakSet[EngineOwner]" = weakref.WeakSet()
_sigterm_lock = threading.Lock()
_sigterm_installed = False


def _register_sigterm_owner(owner: EngineOwner) -> None:
    global _sigterm_installed
    with _sigterm_lock:
        _sigterm_owners.add(owner)
        if _sigterm_installed:
            return
        if threading.current_thread() is not threading.main_thread():
            return  # signal.signal works only in the main thread
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return  # vLLM (or the application) handles SIGTERM: its shutdown path cleans up
        signal.signal(signal.SIGTERM, _on_sigterm)
        _sigterm_installed = True


def _on_sigterm(signum: int, _frame: Any) -> None:
    try:
        owners = list(_sigterm_owners)
        for owner in owners:
            owner.after_shutdown()
        # The same SIGTERM reached the workers (a process-group signal): give
        # them the exit wait to die before we do, since no retry outlives us.
        deadline = time.monotonic() + EXIT_WAIT_S
        while time.monotonic() < deadline and not all(o.retry() for o in owners):
            time.sleep(RETRY_INTERVAL_S)
    finally:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def sigterm_handler_installed() -> bool:
    """True when this process's SIGTERM disposition is the owner's gated-cleanup handler."""
    return signal.getsignal(signal.SIGTERM) is _on_sigterm
