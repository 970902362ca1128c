"""What one engine process holds of its deployment, independent of any engine's classes.

The engine (vLLM's EngineCore, in its own process or, with
`VLLM_ENABLE_V1_MULTIPROCESSING=0`, inside the caller) claims the deployment's
limit segment once its executor is up (docs/NODE.md §2: the engine creates it,
never a worker), holds the segment's lease for its life (docs/CLEANER.md §4),
publishes the KV cache memory it holds as used/prealloc, and at TP=1 serves
`w0.sock` itself, since the model runs in this process (upstream does the
same). Its executor's shutdown gives everything back: the socket first, then
the lease, then the segment if nobody else holds a lease on it. Claiming also
starts the start-up sweep (kvcached.node.in_engine.sweep): in the background, what dead
serves of this uid left on the node goes.

`claimed_segment()` is the API the runtime's block pool uses to find the
segment and limit this process claimed. Nothing here raises into the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import settings
from ..node import Layout, SegmentCleanup, SegmentInfo, SegmentLease, write_segment
from . import running
from .limits import Limit

log = logging.getLogger(__name__)

# Upstream readers hold the segment's flock for microseconds; retry that long.
_REMOVE_TRIES = 20


@dataclass(frozen=True)
class ClaimedSegment:
    """The segment this engine claimed: where it is, the limit it started with, and the lease it holds."""

    name: str
    path: str
    limit: int
    how: str  # created / joined / replaced (kvcached.node.in_engine.startup.claim_segment)
    lease: SegmentLease


class EngineState:
    """One engine's claimed segment, its TP=1 socket, and its usage publisher."""

    def __init__(self, layout: Layout, name: str) -> None:
        self.layout = layout
        self.name = name
        self.segment: ClaimedSegment | None = None
        self.listener: Any = None
        self.kv_bytes = 0
        self._pin: SegmentCleanup | None = None
        self._usage: Callable[[], float] | None = None
        self._published: tuple[int, int] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.released = False
        self._deferred = False  # the elastic block pool publishes used/prealloc instead

    def claim(self, limit: Limit) -> ClaimedSegment | None:
        """Create, join or replace the segment with `limit`, hold its lease, start the start-up sweep. Never raises."""
        from ..node import claim_segment, start_sweep

        try:
            lease, info, how = claim_segment(self.layout, self.name, limit.total)
        except Exception as e:
            log.warning("kvcached: engine %s claimed no segment: %s", self.name, e)
            return None
        finally:
            start_sweep(self.layout)  # in the background: what the node's dead serves left (once per start)
        # Pinned by inode now: at release only this very file may be removed.
        pin = SegmentCleanup(self.layout, self.name)
        pin.capture()
        with self._lock:
            self._pin = pin
            self.segment = ClaimedSegment(self.name, lease.path, info.total, how, lease)
        log.info("kvcached: engine %s %s segment %s, limit %d bytes (%s)", self.name, how, lease.path,
                 info.total, limit.source if how != "joined" else "the live segment's own")
        return self.segment

    def serve(self, rank: int = 0, stage: int = 0) -> Any:
        """Serve `[pp<stage>/]w<rank>.sock` from this process (TP = 1: the model runs here). Never raises."""
        from ..runtime.ipc.listener import WorkerListener

        listener = WorkerListener(self.layout, self.name, rank, stage)
        try:
            listener.start()
        except Exception as e:
            log.warning("kvcached: engine %s serves no worker socket: %s", self.name, e)
            return None
        self.listener = listener
        running.set_worker_listener(listener)  # the runtime registers its commands on it (current_worker_listener)
        log.info("kvcached: engine %s serves %s", self.name, listener.path)
        return listener

    def track_kv_cache(self, kv_bytes: int) -> None:
        """vLLM allocated `kv_bytes` of KV cache per rank: publish it as prealloc (nothing used yet)."""
        self.kv_bytes = max(0, kv_bytes)
        seg = self.segment
        if seg is not None and self.kv_bytes > seg.limit:
            log.warning("kvcached: vLLM allocated %d bytes of KV cache per rank for %s, over its kvcached limit of "
                        "%d bytes", self.kv_bytes, self.name, seg.limit)
        self.publish(0, self.kv_bytes)

    def follow_usage(self, usage: Callable[[], float]) -> None:
        """Publish used/prealloc from `usage` (vLLM's KV cache usage, 0..1) every few seconds, for the engine's life."""
        with self._lock:
            self._usage = usage
            if self._thread is not None or self.released:
                return
            self._thread = threading.Thread(target=self._follow, name="kvcached-usage", daemon=True)
            self._thread.start()

    def _follow(self) -> None:
        interval = settings.PUBLISH_INTERVAL_S.get()
        while not self._stop.wait(interval):
            self.publish_usage()

    def publish_usage(self) -> None:
        """Publish the KV cache split by vLLM's current usage. Never raises."""
        usage = self._usage
        if usage is None:
            return
        try:
            share = min(1.0, max(0.0, float(usage())))
        except Exception as e:  # the KV cache manager went away with its engine
            log.debug("kvcached: KV cache usage unreadable: %s", e)
            return
        used = int(self.kv_bytes * share)
        self.publish(used, self.kv_bytes - used)

    def defer_usage(self) -> None:
        """Another publisher owns used/prealloc from now on (the elastic block pool, which knows the mapped pages)."""
        self._deferred = True

    def publish(self, used: int, prealloc: int) -> None:
        """Write used/prealloc to the claimed segment when they changed. Never raises."""
        seg = self.segment
        if seg is None or self.released or self._deferred or self._published == (used, prealloc):
            return
        try:
            write_segment(seg.path, used=used, prealloc=prealloc)
            self._published = (used, prealloc)
        except Exception as e:
            log.warning("kvcached: cannot publish usage to %s: %s", seg.path, e)

    def values(self) -> SegmentInfo | None:
        """What the segment holds now (None without one)."""
        from ..node import read_segment

        seg = self.segment
        return None if seg is None else read_segment(seg.path)

    def release(self) -> None:
        """Stop serving, drop the lease, remove the segment unless another holds its lease; idempotent, never raises."""
        with self._lock:
            if self.released:
                return
            self.released = True
        self._stop.set()
        self.stop_serving()
        seg, pin = self.segment, self._pin
        if seg is None or pin is None:
            return
        try:
            seg.lease.release()
            for _ in range(_REMOVE_TRIES):
                result = pin.cleanup()
                if result.complete:
                    break
                time.sleep(0.005)  # an upstream reader's flock: held for microseconds
            for path in result.removed:
                log.info("kvcached: engine %s removed %s", self.name, path)
            for path, why in result.kept:
                log.info("kvcached: engine %s kept %s (%s)", self.name, path, why)
        except Exception as e:
            log.warning("kvcached: engine %s could not give back its segment: %s", self.name, e)
        finally:
            _forget(self)

    def stop_serving(self) -> None:
        """Stop the TP=1 socket (its node unlinked, empty directories removed). Never raises."""
        listener, self.listener = self.listener, None
        if listener is None:
            return
        try:
            listener.stop()
        except Exception as e:
            log.warning("kvcached: engine %s could not stop its worker socket: %s", self.name, e)
        running.clear_worker_listener(listener)


def register(engine: EngineState) -> None:
    """Record `engine` as an engine of this process (several in-process engines may come and go)."""
    running.add_engine(engine)


def _forget(engine: EngineState) -> None:
    running.remove_engine(engine)


def current_engine() -> EngineState | None:
    """The engine of this process started last and not yet shut down, if any."""
    engine = running.latest_engine()
    return engine if isinstance(engine, EngineState) else None


def claimed_segment() -> ClaimedSegment | None:
    """The segment this process's engine claimed (path, limit, lease), or None: what the block pool maps under."""
    engine = current_engine()
    return None if engine is None else engine.segment
