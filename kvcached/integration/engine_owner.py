"""The engine owner's side of cleanup, independent of vLLM's classes.

The process that starts the engine processes (vLLM's API server, or the
supervisor with `--api-server-count > 1` and in headless mode) is the only
one that reliably outlives them. `EngineOwner` captures the deployment's
segment and worker sockets once the engines are READY and, once every engine
process has a confirmed exit code, removes what it captured and nobody serves
(kvcached.node.in_engine.captured does the deciding and the removing). What a still-living
worker serves is kept and retried in the background until the worker exits.

The same duty serves one level down: an executor owns its worker processes
(`names` with one name, `segments=False`: the engine's own segment is the
engine's to give back), which matters where no engine owner is above it
(headless worker nodes) or where the engine outlives a worker it killed.

The engines' own buffers go the same way (kvcached.node.in_engine.captured_buffers): the
`psm_*` and `nccl-*` files (any engine family's) that the engine processes
and their workers map at READY are captured by identity and, after the
confirmed exit, removed unless a live process still maps or holds them. Only
the owner of the engines does this (the engine itself maps its buffers for
as long as an executor's workers could).

The owner never installs a signal handler: a process that did not ask for one
(an offline `LLM` script) keeps the default SIGTERM action. On a process-group
SIGTERM its engine and workers clean up after themselves (they are not
SIGKILLed when their owner is gone); what a SIGTERM to that process alone
leaves behind is unleased and unserved, so the next start (`claim_segment`)
or `kvctl gc` removes it.

Nothing here raises into the engine's shutdown: failures are logged.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Protocol

from .. import settings
from ..node import BufferCleanup, Layout, Report, SegmentCleanup, WorkerSocketCleanup

log = logging.getLogger(__name__)

# How often the owner retries what is still served. The two windows are
# settings (read at each shutdown): OWNER_EXIT_WAIT_S, how long it waits for
# confirmed engine exits after the original shutdown sent SIGKILL (normally
# reaped in milliseconds; an engine in uninterruptible sleep may take longer,
# and past it the exit is unconfirmed and everything is kept), and
# OWNER_RETRY_S, how long the background retry goes on after shutdown.
RETRY_INTERVAL_S = 0.2


class ProcLike(Protocol):
    """What we need of an engine process: a multiprocessing.Process started by this process."""

    pid: int | None

    @property
    def exitcode(self) -> int | None: ...

    def join(self, timeout: float | None = None) -> None: ...


class EngineOwner:
    """Cleanup duty of one owner of engine processes (a CoreEngineProcManager) or of worker processes (an executor).

    `names` has one IPC name per engine: a DP serve's engines each have their own.
    """

    def __init__(self, processes: Sequence[ProcLike], layout: Layout, names: Sequence[str],
                 tp_size: int, pp_size: int, *, headless: bool = False, segments: bool = True) -> None:
        self.processes = processes
        self.headless = headless  # engines handshake elsewhere: no READY passes through this owner
        self.layout = layout
        self.names = tuple(names)
        self.name = ", ".join(self.names)  # for log lines
        self.tp_size = tp_size
        self.pp_size = pp_size
        self.segments = [SegmentCleanup(layout, n) for n in self.names] if segments else []
        self.sockets = [WorkerSocketCleanup(layout, n, tp_size, pp_size) for n in self.names]
        self.buffers = BufferCleanup(layout) if segments else None
        self.captured = False
        self.complete = False
        self._lock = threading.RLock()
        self._retry: threading.Thread | None = None
        self.results: list[Report] = []
        self.retries = 0  # retry steps taken after the shutdown (for logs and tests)

    def capture(self) -> None:
        """Pin the segment and remember the worker nodes present now (engines READY). Once; never raises."""
        with self._lock:
            if self.captured:
                return
            try:
                segs = sum(s.capture() for s in self.segments)
                n = sum(s.capture() for s in self.sockets)
                bufs = self.buffers.capture(p.pid for p in self.processes if p.pid) if self.buffers else 0
                self.captured = True
                log.info("kvcached owner: captured %s (segments: %d, worker sockets: %d, engine buffers: %d)",
                         self.name, segs, n, bufs)
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
        """Run after the original shutdown: clean up if every engine exit is confirmed, else keep all. Never raises.

        Within the same wait, what is still served is retried here: workers hit
        by the same SIGKILL die within milliseconds of their engine, and an owner
        that exits right after its shutdown (an API server) takes its background
        retry with it.
        """
        wait = settings.OWNER_EXIT_WAIT_S.get() if wait is None else wait
        deadline = time.monotonic() + wait
        try:
            with self._lock:
                if not self.captured or self.complete:
                    return
                if not self.exits_confirmed(wait):
                    log.warning("kvcached owner: engine exit not confirmed for %s; keeping its segment and sockets "
                                "(will retry)", self.name)
                    self._start_retry()
                    return
                while True:
                    last = time.monotonic() + RETRY_INTERVAL_S >= deadline
                    self._cleanup_once(log_kept=last)
                    if self.complete or last:
                        break
                    time.sleep(RETRY_INTERVAL_S)
                if not self.complete:
                    self._start_retry()
        except Exception as e:
            log.warning("kvcached owner: cleanup of %s failed: %s", self.name, e)

    def _cleanup_once(self, log_kept: bool = True) -> None:
        # Sockets first: a worker socket still served keeps its deployment, and so its segment, live.
        results = [s.cleanup() for s in self.sockets] + [s.cleanup() for s in self.segments]
        if self.buffers is not None:
            results.append(self.buffers.cleanup())
        self.results.extend(results)
        for r in results:
            for path in r.removed:
                log.info("kvcached owner: removed %s", path)
            for path, why in r.kept if log_kept else ():
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
            self.retries += 1
            if self.complete or not self.captured:
                return True
            if not self.exits_confirmed(0.0):
                return False
            self._cleanup_once()
            return self.complete


def _retry_loop(ref: weakref.ReferenceType[EngineOwner]) -> None:
    # A worker that outlives its engine (its own teardown is slow, or it is
    # stopped) keeps serving its socket; once it exits, the node is unserved
    # and this removes it. Daemon: it never holds the owner's exit up.
    deadline = time.monotonic() + settings.OWNER_RETRY_S.get()
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
