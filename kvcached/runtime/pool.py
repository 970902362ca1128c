"""The elastic KV pool: blocks over pages, pages mapped on demand, under the segment limit.

One page index means the same page in every KV tensor of the deployment (each
layer's K and V, on every TP rank and PP stage), so the pool keeps one block
table and a *mapper* (a `kvcached.runtime.elastic.PageLink`) applies page
changes where the tensors live:

- `LocalMapper`: the tensors are in this process (TP = 1, or a worker).
- `BroadcastMapper`: the engine owner with TP > 1 sends ``map_to_kv_tensors``
  / ``unmap_from_kv_tensors`` (byte offsets, like upstream) to every worker
  listener; `attach_worker` makes a worker serve them over its own tensors,
  through the page server the engines' workers serve too
  (`kvcached.runtime.ipc.page_server`).

The pool obeys the deployment's limit segment (``kvctl limit``): it never maps
a page that would take the mapped memory past ``total``, and `KVPool.step`
unmaps free pages until the mapped memory is back under a lowered limit. It
publishes ``used`` (pages holding at least one allocated block) and
``prealloc`` (mapped pages holding none) to the segment: at once when pages
are mapped or unmapped, and within `KVPool.publish_interval` or the next
step when only the split between the two moves. Both are bytes per rank:
``page_size * num_tensors`` per page, the memory one GPU holds, which is the
quantity the limit is set in.

Workers either have their tensors created by the owner (``create_kv_tensors``,
what the harness does) or create them themselves, as an engine's model runner
would, and the owner waits for ``kv_tensors_created`` on every rank.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvcached.node import IpcError, KvcachedError, Layout, read_segment
from kvcached.runtime.ipc.client import Client
from kvcached.runtime.ipc.listener import WorkerListener
from kvcached.runtime.ipc.page_server import PageServer, ServedPages
from kvcached.runtime.ipc.protocol import CMD_CREATE, CMD_CREATED, CMD_MAP, CMD_MAPPED, CMD_UNMAP

from .elastic import ElasticPages, PageLink, SegmentLimit
from .pages import DEFAULT_PAGE_SIZE, Pages

log = logging.getLogger(__name__)


class PoolExhausted(KvcachedError):
    """No free block within the limit (or within the reserved range)."""


class MapError(KvcachedError):
    """Mapping or unmapping pages failed somewhere (a backend, or a worker)."""


@dataclass(frozen=True)
class Geometry:
    """The shape of every KV tensor: `num_pages` pages of `page_size` bytes, `num_tensors` of them."""

    num_pages: int
    page_size: int = DEFAULT_PAGE_SIZE
    num_tensors: int = 1
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.num_pages <= 0 or self.page_size <= 0 or self.num_tensors <= 0:
            raise ValueError(f"geometry needs positive sizes, got {self}")

    @property
    def page_bytes(self) -> int:
        """Memory one page index costs on one rank: the page in every tensor."""
        return self.page_size * self.num_tensors

    def to_dict(self) -> dict[str, Any]:
        return {"num_pages": self.num_pages, "page_size": self.page_size,
                "num_tensors": self.num_tensors, "device": self.device}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Geometry:
        return cls(int(d["num_pages"]), int(d["page_size"]), int(d["num_tensors"]), str(d["device"]))


class LocalMapper:
    """The KV tensors of this process: one `Pages` range per tensor, mapped in step."""

    def __init__(self, geometry: Geometry) -> None:
        self.geometry = geometry
        self._lock = threading.Lock()
        self.ranges: list[Pages] = []
        try:
            for _ in range(geometry.num_tensors):
                self.ranges.append(Pages(geometry.num_pages, geometry.page_size, device=geometry.device))
        except BaseException:
            self.close()
            raise

    def map(self, pages: Sequence[int]) -> None:
        """Map `pages` in every tensor, all or nothing."""
        self._apply(pages, mapping=True)

    def unmap(self, pages: Sequence[int]) -> None:
        """Unmap `pages` in every tensor, all or nothing."""
        self._apply(pages, mapping=False)

    def _apply(self, pages: Sequence[int], *, mapping: bool) -> None:
        with self._lock:
            done: list[Pages] = []
            try:
                for r in self.ranges:
                    (r.map if mapping else r.unmap)(pages)
                    done.append(r)
            except (OSError, RuntimeError, ValueError, IndexError) as e:
                # Put the tensors already changed back, so they all agree again.
                for r in done:
                    try:
                        (r.unmap if mapping else r.map)(pages)
                    except (OSError, RuntimeError, ValueError):
                        log.exception("could not roll back pages %s", list(pages))
                verb = "map" if mapping else "unmap"
                raise MapError(f"{verb} pages {list(pages)[:8]}: {e}") from e

    def mapped_pages(self) -> list[int]:
        """Mapped page indices (the same in every tensor)."""
        with self._lock:
            return self.ranges[0].mapped_pages() if self.ranges else []

    # What the worker's page server reads (kvcached.runtime.ipc.page_server.ServedPages).

    @property
    def unit(self) -> int:
        """Bytes one page index stands for in an offset: a page of one tensor."""
        return self.geometry.page_size

    @property
    def extent(self) -> int:
        """Page indices the tensors have."""
        return self.geometry.num_pages

    @property
    def mapped_bytes(self) -> int:
        """Memory mapped now, in every tensor together."""
        with self._lock:
            return sum(r.mapped_bytes for r in self.ranges)

    def mapped_indices(self) -> list[int]:
        """Mapped page indices."""
        return self.mapped_pages()

    def close(self) -> None:
        """Release every range (and the memory still mapped in it)."""
        with self._lock:
            for r in self.ranges:
                r.close()
            self.ranges = []


class BroadcastMapper:
    """The owner's side with TP > 1: apply page changes on every worker, over its socket."""

    def __init__(self, layout: Layout, name: str, tp_size: int, pp_size: int = 1, *,
                 page_size: int = DEFAULT_PAGE_SIZE, timeout: float = 10.0) -> None:
        self.page_size = page_size
        self.paths = [layout.socket_path(name, rank, stage)
                      for stage in range(pp_size) for rank in range(tp_size)]
        self.timeout = timeout

    def _call_all(self, command: str, **args: Any) -> list[dict[str, Any]]:
        return [Client(p, self.timeout).call(command, **args) for p in self.paths]

    def create(self, geometry: Geometry) -> None:
        """Have every worker create its KV tensors, then confirm they all exist."""
        try:
            self._call_all(CMD_CREATE, **geometry.to_dict())
            missing = [p for p, r in zip(self.paths, self._call_all(CMD_CREATED)) if not r.get("created")]
        except IpcError as e:
            raise MapError(f"creating KV tensors: {e}") from e
        if missing:
            raise MapError(f"KV tensors not created on {missing}")

    def wait_created(self, timeout: float = 60.0, poll: float = 0.05) -> None:
        """Wait until every worker reports its KV tensors created (they made them themselves)."""
        deadline = time.monotonic() + timeout
        pending = list(self.paths)
        while pending:
            try:
                pending = [p for p in pending if not Client(p, self.timeout).call(CMD_CREATED).get("created")]
            except IpcError as e:
                raise MapError(f"waiting for KV tensors: {e}") from e
            if pending and time.monotonic() > deadline:
                raise MapError(f"KV tensors not created within {timeout}s on {pending}")
            if pending:
                time.sleep(poll)

    def map(self, pages: Sequence[int]) -> None:
        """Map on every worker; on a failure, unmap from those that already did."""
        self._broadcast(CMD_MAP, CMD_UNMAP, pages)

    def unmap(self, pages: Sequence[int]) -> None:
        """Unmap on every worker; on a failure, map back on those that already did."""
        self._broadcast(CMD_UNMAP, CMD_MAP, pages)

    def _broadcast(self, command: str, undo: str, pages: Sequence[int]) -> None:
        offsets = [p * self.page_size for p in pages]
        done: list[str] = []
        for path in self.paths:
            try:
                Client(path, self.timeout).call(command, offsets=offsets, group_id=0)
            except IpcError as e:
                for back in done:
                    try:
                        Client(back, self.timeout).call(undo, offsets=offsets, group_id=0)
                    except IpcError:
                        log.exception("could not roll back %s on %s", undo, back)
                raise MapError(str(e)) from e
            done.append(path)

    def mapped_pages(self) -> dict[str, list[int]]:
        """Each worker's mapped pages, by socket path (for checks and `kvctl inspect`)."""
        return {p: list(r["pages"]) for p, r in zip(self.paths, self._call_all(CMD_MAPPED))}


def attach_worker(listener: WorkerListener) -> PageServer:
    """Make a worker's listener serve the owner's pool commands over KV tensors the owner has it create."""
    return PageServer(listener, create=_create_tensors)


def _create_tensors(args: dict[str, Any], current: ServedPages | None) -> LocalMapper:
    geometry = Geometry.from_dict(args)
    if current is None:
        return LocalMapper(geometry)
    if not isinstance(current, LocalMapper) or current.geometry != geometry:
        have = getattr(current, "geometry", current)
        raise ValueError(f"KV tensors exist with {have}, asked for {geometry}")
    return current  # created again with the same geometry: nothing to do


@dataclass(frozen=True)
class PoolStats:
    """A consistent snapshot of the pool, in blocks, pages and bytes (per rank)."""

    num_blocks: int
    used_blocks: int
    mapped_pages: int
    used_pages: int
    prealloc_pages: int
    limit: int
    used_bytes: int
    prealloc_bytes: int

    @property
    def mapped_bytes(self) -> int:
        return self.used_bytes + self.prealloc_bytes


class KVPool:
    """Fixed-size KV blocks over a reserved range of pages, elastic under the segment limit.

    Blocks of one page are allocated before a new page is mapped, so memory
    stays packed; a page is unmapped as soon as its last block is freed,
    unless it is kept as one of `prealloc_pages` pre-mapped pages (and the
    limit allows). Thread-safe; background pre-mapping (``step_interval``)
    maps pages outside the lock.

    The pages' books (what is mapped, the limit, the segment) are the elastic
    core's (`kvcached.runtime.elastic`); the pool keeps each mapped page's
    free blocks. The segment is written whenever pages are mapped or
    unmapped, so the mapped total (``used + prealloc``) there is always
    exact. A block moving the split between ``used`` and ``prealloc``
    without any mapping is published at most every ``publish_interval``
    seconds and at every `step`: a segment write costs several times a
    fast-path alloc (bench/README.md).
    """

    def __init__(self, mapper: PageLink, geometry: Geometry, block_size: int, *,
                 segment_path: str | None = None, prealloc_pages: int = 0,
                 step_interval: float | None = None, publish_interval: float = 0.01) -> None:
        if not 0 < block_size <= geometry.page_size:
            raise ValueError(f"block_size {block_size} must be in (0, page_size={geometry.page_size}]")
        if prealloc_pages < 0:
            raise ValueError("prealloc_pages must be ≥ 0")
        self.mapper = mapper
        self.geometry = geometry
        self.block_size = block_size
        self.blocks_per_page = geometry.page_size // block_size
        self.num_blocks = geometry.num_pages * self.blocks_per_page
        self.segment_path = segment_path
        self.prealloc_target = prealloc_pages
        self.publish_interval = publish_interval
        self._lock = threading.RLock()
        segment = SegmentLimit(segment_path, interval=publish_interval, logger=log) if segment_path else None
        self._segment = segment
        self.pages = ElasticPages(mapper, [self.blocks_per_page] * geometry.num_pages, geometry.page_bytes,
                                  segment=segment)
        self._free_slots: dict[int, list[int]] = {}   # mapped page -> its free block ids
        self._partial: dict[int, None] = {}           # mapped pages with used and free blocks
        self._empty: dict[int, None] = {}             # mapped pages with no used block (prealloc)
        self._free_mapped = 0                         # free blocks in mapped pages
        self._allocated = bytearray(self.num_blocks)
        self._used_blocks = 0
        self._inflight = 0                            # pages being pre-mapped outside the lock
        self.pages.set_limit(geometry.num_pages * geometry.page_bytes)
        self._refresh_limit()
        self._closed = False
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._publish(force=True)
        if step_interval is not None:
            self._thread = threading.Thread(target=self._background, args=(step_interval,),
                                            name="kvcached-pool", daemon=True)
            self._thread.start()

    # -- the limit and the segment ------------------------------------------------

    @property
    def _limit(self) -> int:
        limit = self.pages.limit
        return 0 if limit is None else limit

    def _refresh_limit(self) -> int:
        """Re-read the limit; an unreadable segment keeps the last one (guessing a bigger one could take memory
        an operator withdrew; recreating the segment is its owner's job)."""
        if self._segment is not None:
            limit = self._segment.read()
            if limit is not None:
                self.pages.set_limit(limit)
        return self._limit

    def _mappable(self) -> int:
        """Pages that may still be mapped: unreserved, and within the limit."""
        return self.pages.mappable(self._inflight)

    def _publish(self, force: bool = False) -> None:
        segment = self._segment
        if segment is None:
            return
        used, prealloc = self.pages.usage(len(self._empty))
        if segment.published != (used, prealloc):
            segment.publish(used, prealloc, force=force)

    # -- page bookkeeping (lock held) ------------------------------------------------

    def _add_mapped(self, pages: Iterable[int]) -> None:
        bpp = self.blocks_per_page
        for p in pages:
            # Reversed so that pop() hands out the lowest block of the page first.
            self._free_slots[p] = list(range((p + 1) * bpp - 1, p * bpp - 1, -1))
            self._empty[p] = None
            self._free_mapped += bpp

    def _map_new(self, count: int) -> None:
        self._add_mapped(self.pages.map_lowest(count))

    def _trim(self, keep_empty: int) -> None:
        """Unmap empty pages beyond `keep_empty`, and any past the limit."""
        over = self.pages.mapped_count + self._inflight - self.pages.max_pages
        excess = max(len(self._empty) - keep_empty, over)
        if excess <= 0 or not self._empty:
            return
        # Highest pages first: they are the last to be handed out again.
        victims = sorted(self._empty, reverse=True)[:excess]
        self.pages.unmap_now(victims)
        for p in victims:
            del self._free_slots[p]
            del self._empty[p]
        self._free_mapped -= len(victims) * self.blocks_per_page
        self._publish(force=True)

    # -- the public operations -------------------------------------------------------

    def alloc(self, n: int = 1) -> list[int]:
        """Allocate `n` blocks, all or nothing; raises PoolExhausted past the limit."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        with self._lock:
            self._check_open()
            have = self._free_mapped
            if have < n:
                need_pages = -(-(n - have) // self.blocks_per_page)
                if need_pages > self._mappable():
                    # The limit may have been raised since we last looked.
                    self._refresh_limit()
                mappable = self._mappable()
                if need_pages > mappable:
                    raise PoolExhausted(
                        f"pool exhausted: {n} blocks requested, {have} free in mapped pages and "
                        f"{mappable} more pages mappable (limit {self._limit} bytes, "
                        f"{self.pages.mapped_count} of {self.geometry.num_pages} pages of "
                        f"{self.geometry.page_bytes} bytes mapped)")
                self._map_new(need_pages)
            blocks = self._take(n)
            # Mapping changed the total: publish now, not after the interval.
            self._publish(force=have < n)
            low = len(self._empty) < self.prealloc_target
        if low and self._thread is not None:
            self._wake.set()
        return blocks

    def _take(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            if self._partial:
                page = next(iter(self._partial))
            else:
                page = min(self._empty)  # lowest first; few pages are ever empty and mapped
                del self._empty[page]
                self._partial[page] = None
            slots = self._free_slots[page]
            while slots and len(out) < n:
                out.append(slots.pop())
            if not slots:
                del self._partial[page]
        allocated = self._allocated
        for b in out:
            allocated[b] = 1
        self._used_blocks += n
        self._free_mapped -= n
        return out

    def free(self, blocks: Iterable[int]) -> None:
        """Return blocks; pages left empty are unmapped (beyond the pre-mapped reserve)."""
        blocks = list(blocks)
        with self._lock:
            self._check_open()
            allocated = self._allocated
            for i, b in enumerate(blocks):
                bad: Exception | None = None
                if not 0 <= b < self.num_blocks:
                    bad = IndexError(f"block {b} out of range for {self.num_blocks} blocks")
                elif not allocated[b]:
                    bad = ValueError(f"block {b} is listed more than once" if b in blocks[:i]
                                     else f"block {b} is not allocated")
                if bad is not None:
                    for prev in blocks[:i]:  # all or nothing: undo the marks made so far
                        allocated[prev] = 1
                    raise bad
                allocated[b] = 0  # marking as we go also catches a repeat later in the list
            bpp = self.blocks_per_page
            for b in blocks:
                page = b // bpp
                slots = self._free_slots[page]
                slots.append(b)
                if len(slots) == bpp:
                    self._partial.pop(page, None)
                    self._empty[page] = None
                elif len(slots) == 1:
                    self._partial[page] = None
            self._used_blocks -= len(blocks)
            self._free_mapped += len(blocks)
            self._trim(self.prealloc_target)
            self._publish()

    def step(self) -> PoolStats:
        """Re-read the limit, release free pages past it, pre-map up to the reserve, publish."""
        with self._lock:
            self._check_open()
            self._refresh_limit()
            self._trim(self.prealloc_target)
            if self._thread is None:
                # Without a background thread the reserve is topped up here;
                # with one, _premap does it outside the lock.
                top_up = min(self.prealloc_target - len(self._empty), self._mappable())
                if top_up > 0:
                    self._map_new(top_up)
            self._publish(force=True)
            return self._stats()

    def _premap(self) -> None:
        with self._lock:
            if self._closed:
                return
            want = min(self.prealloc_target - len(self._empty) - self._inflight, self._mappable())
            if want <= 0:
                return
            pages = self.pages.take_lowest(want)
            self._inflight += want
        # Mapping a page is slow next to alloc/free (bench/bench_pages.py): do it without
        # holding up alloc/free, which never count these pages as free.
        ok = True
        try:
            self.mapper.map(pages)
        except MapError:
            log.exception("background pre-mapping of pages %s failed", pages)
            ok = False
        with self._lock:
            self._inflight -= want
            if ok and not self._closed:
                self.pages.mark_mapped(pages)
                self._add_mapped(pages)
                # The limit may have dropped meanwhile.
                self._trim(self.prealloc_target)
                self._publish(force=True)
            elif ok:
                # close() began meanwhile and is waiting for us; it resets the free list.
                self.mapper.unmap(pages)
            else:
                self.pages.put_back(pages)

    def _background(self, interval: float) -> None:
        while not self._closed:
            try:
                self.step()
                self._premap()
            except KvcachedError:
                if self._closed:
                    return
                log.exception("pool step failed")
            self._wake.wait(interval)
            self._wake.clear()

    # -- state ---------------------------------------------------------------------

    def _stats(self) -> PoolStats:
        pb = self.geometry.page_bytes
        mapped = self.pages.mapped_count
        used_pages = mapped - len(self._empty)
        return PoolStats(
            num_blocks=self.num_blocks,
            used_blocks=self._used_blocks,
            mapped_pages=mapped,
            used_pages=used_pages,
            prealloc_pages=len(self._empty),
            limit=self._limit,
            used_bytes=used_pages * pb,
            prealloc_bytes=len(self._empty) * pb,
        )

    def stats(self) -> PoolStats:
        """A consistent snapshot of the pool."""
        with self._lock:
            return self._stats()

    def available_blocks(self) -> int:
        """Blocks `alloc` could hand out now without exceeding the last limit read."""
        with self._lock:
            return self._free_mapped + self._mappable() * self.blocks_per_page

    def mapped_pages(self) -> list[int]:
        """Pages the pool has mapped, ascending."""
        with self._lock:
            return sorted(self._free_slots)

    def block_offset(self, block: int) -> int:
        """Byte offset of `block` in each KV tensor."""
        if not 0 <= block < self.num_blocks:
            raise IndexError(f"block {block} out of range for {self.num_blocks} blocks")
        page, slot = divmod(block, self.blocks_per_page)
        return page * self.geometry.page_size + slot * self.block_size

    def _check_open(self) -> None:
        if self._closed:
            raise KvcachedError("the KV pool is closed")

    def close(self) -> None:
        """Stop the background thread, unmap every page, publish zero usage. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._lock:
            pages = sorted(self._free_slots)
            if pages:
                try:
                    self.mapper.unmap(pages)
                except MapError:
                    log.exception("unmapping pages at close failed")
            self._free_slots.clear()
            self._partial.clear()
            self._empty.clear()
            self._free_mapped = 0
            self.pages.forget_all()
            self._publish(force=True)
            if self._segment is not None:
                self._segment.close()

    def __enter__(self) -> KVPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_engine_pool(layout: Layout, name: str, tp_size: int, pp_size: int = 1, *,
                      page_size: int = DEFAULT_PAGE_SIZE, num_tensors: int = 2,
                      block_size: int = 256 * 1024, min_pages: int = 1024, fill_pages: int = 4,
                      prealloc_pages: int = 1, step_interval: float = 0.1) -> KVPool:
    """The engine side of a local deployment (the harness): a pool over its workers' tensors.

    Reserves `min_pages` pages or as many as the segment's limit allows,
    whichever is more (the range is virtual; only mapped pages cost memory),
    has every worker create its tensors, allocates `fill_pages` pages' worth
    of blocks so that `kvctl list` shows real use, and follows `kvctl limit`
    from a background step every `step_interval` seconds.
    """
    seg = layout.segment_path(name)
    page_bytes = page_size * num_tensors
    geometry = Geometry(max(min_pages, read_segment(seg).total // page_bytes, 1),
                        page_size, num_tensors)
    mapper = BroadcastMapper(layout, name, tp_size, pp_size, page_size=page_size)
    mapper.create(geometry)
    pool = KVPool(mapper, geometry, block_size, segment_path=seg, prealloc_pages=prealloc_pages,
                  step_interval=step_interval)
    want = min(fill_pages * pool.blocks_per_page, pool.available_blocks())
    if want:
        pool.alloc(want)
    return pool
