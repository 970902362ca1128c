"""vLLM's BlockPool, elastic: blocks come from mapped pages, pages are mapped on demand under the limit.

The `elastic-kv` patch builds it. Being a subclass of vLLM's BlockPool, this
module imports vLLM at import (the only one of kvcached.integration that does).

The KV cache's blocks are grouped into logical *pages* of `blocks_per_page`
consecutive blocks; a page is mapped in every worker's buffer or in none
(`kvcached.runtime.kvbuffer`). vLLM's free block queue holds only the free
blocks of mapped pages, so everything vLLM does with it (LIFO reuse of plain
blocks, LRU eviction of prefix-cached ones, touching a cached block back into
use) stays as it is; the pool adds:

- `get_num_free_blocks` counts the free blocks of mapped pages plus the
  blocks of the pages the limit still allows to map, and 0 while more is
  mapped than the limit allows (after `kvctl limit` lowered it), so that the
  scheduler waits or preempts, as it does when a full cache is full.
- `get_new_blocks` maps pages first when the queue cannot serve the request.
  Cached blocks in the queue count as free, as in vLLM: they are evicted
  (LRU) before more memory is mapped, so a prefix cache never grows the
  mapping on its own.
- Once per scheduler step (`end_step` after ``update_from_output``,
  `begin_step` before ``schedule``), the pages that got blocks back are
  judged: a page whose blocks are all free, none cached and none still
  being read (`unpin_blocks`) is released when more than `reserve` such
  pages exist and it stayed free `release_delay` seconds, or at once when
  the scheduler has nothing left to run (no later step would release it).
  Judging per step, not per freed block, keeps vLLM's hot path almost as it
  is; the delay keeps a load that swings by a few pages from unmapping and
  mapping them again every few steps. Neither raises the peak: allocation
  takes the free blocks of mapped pages before it maps another.
  Its blocks leave the queue at once, and its memory is unmapped once every
  batch scheduled before the release has finished (`InFlight`): with async
  scheduling and pipeline parallelism the workers may still be running a
  batch that writes those blocks (vLLM defers its own frees for the same
  reason when a KV connector could refill them). Over the limit, the reserve
  and pages holding only cached blocks go too (those blocks are evicted).
- `begin_step` also re-reads the limit from the segment, and both publish
  ``used`` (pages holding an allocated or cached block) and ``prealloc``
  (mapped pages holding none) to it.

A mapping failure (a worker died, the device is out of memory) raises
`MapError` out of the scheduler, which ends the engine with that error; the
link undoes partial changes first, so no worker keeps half a page set.
"""

from __future__ import annotations

import heapq
import logging
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

from kvcached.integration.limits import limit_mapper
from kvcached.node.errors import KvcachedError, SegmentMissing
from kvcached.node.segment import LimitWatch, write_segment
from kvcached.runtime.kvbuffer import LinkSetup, WorkerLink

log = logging.getLogger("kvcached.integration.vllm.blockpool")

UNMAPPED, MAPPED, RELEASING = 0, 1, 2

# vLLM's own, for the overrides that add a check around them (called once or a few times per step).
_vllm_get_new_blocks = BlockPool.get_new_blocks
_vllm_free_blocks = BlockPool.free_blocks


class InFlight:
    """Which scheduled batches may still be running on the workers (the scheduler's thread only)."""

    def __init__(self) -> None:
        self.issued = 0
        # seq -> the batch's scheduler output, weakly: a batch dropped without its
        # output being processed (an engine reset) must not hold back every release.
        self._open: dict[int, Any] = {}

    def issue(self, output: object) -> None:
        """A batch was scheduled (its workers may run it from now on)."""
        seq = self.issued = self.issued + 1
        try:
            self._open[seq] = weakref.ref(output)
        except TypeError:  # not weakly referenceable: then only its output closes it
            self._open[seq] = lambda output=output: output

    def complete(self, output: object) -> None:
        """The batch's output came back: its workers are done with it."""
        for seq, ref in self._open.items():
            if ref() is output:
                del self._open[seq]
                return

    def finished_through(self) -> int:
        """Every batch up to this sequence number has finished."""
        for seq in [s for s, ref in self._open.items() if ref() is None]:
            del self._open[seq]
        return min(self._open) - 1 if self._open else self.issued


@dataclass(frozen=True)
class ElasticSetup:
    """What the engine hands the pool: the link to the workers and what they agreed."""

    link: WorkerLink
    agreed: LinkSetup
    segment_path: str | None
    reserve_pages: int = 1
    release_delay: float = 1.0  # seconds a page stays all free before it is released (while busy)


def _take_over_usage() -> None:
    """From now on this pool publishes used/prealloc: the engine's own (whole-cache) figures would contradict it."""
    try:
        from ..engine_state import current_engine

        engine = current_engine()
        if engine is not None:
            engine.defer_usage()
    except Exception as e:  # the figures are informational: never fail the engine for them
        log.debug("kvcached: engine usage not handed over: %s", e)


class ElasticBlockPool(BlockPool):
    """A BlockPool whose blocks live in pages mapped on demand, under the segment's limit.

    Like vLLM's BlockPool it is used from the scheduler's thread only, so it
    takes no lock.
    """

    def __init__(self, *args: Any, elastic: ElasticSetup, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        agreed = elastic.agreed
        self.link = elastic.link
        self.segment_path = elastic.segment_path
        self._limit_watch = LimitWatch(elastic.segment_path, mapper=limit_mapper()) \
            if elastic.segment_path else None
        self.reserve = max(0, elastic.reserve_pages)
        self.release_delay = max(0.0, elastic.release_delay)
        self.clock = time.monotonic
        self._judged_at = float("-inf")
        self.blocks_per_page = g = agreed.blocks_per_page
        self.page_bytes = agreed.group_bytes
        n = self.num_gpu_blocks
        self.num_pages = -(-n // g)
        if self.num_pages != agreed.num_groups:
            raise KvcachedError(f"the workers' KV buffers have {agreed.num_groups} pages of {g} blocks, "
                                f"the engine's {n} blocks make {self.num_pages}")
        self.sizes = [g] * self.num_pages
        self.sizes[-1] = n - g * (self.num_pages - 1)
        self.state = bytearray(self.num_pages)
        self._releasing: dict[int, int] = {}  # page -> InFlight sequence it waits for
        self._clean: dict[int, float] = {}    # all-free pages still mapped -> since when (as last judged)
        self._cached: set[int] = set()        # all-free pages that hold prefix-cached blocks
        self.inflight = InFlight()
        self._reporting_all = False
        self._spare = 0
        mapped = sorted(agreed.mapped_groups)
        for b in self.blocks:
            b.prev_free_block = b.next_free_block = None
        # vLLM's queue, over the blocks of mapped pages only: a block out of the queue
        # has no links, which is how _page_state tells free blocks from taken ones.
        self.free_block_queue = FreeKVCacheBlockQueue(
            [b for p in mapped for b in self._blocks_of(p) if not b.is_null])
        for p in mapped:
            self.state[p] = MAPPED
        self.mapped_count = len(mapped)
        self._unmapped = [p for p in range(self.num_pages) if not self.state[p]]  # a heap
        self.limit = self.num_pages * self.page_bytes
        self.max_pages = self.num_pages
        self._published: tuple[int, int] | None = None
        self._missing_warned = False
        self._refresh_limit()
        self._recount()
        _take_over_usage()
        self._publish(force=True)
        log.info("kvcached: elastic block pool: %d blocks in %d pages of %d blocks (%d bytes each per rank), "
                 "limit %d bytes", n, self.num_pages, g, self.page_bytes, self.limit)

    def _blocks_of(self, page: int) -> list[KVCacheBlock]:
        g = self.blocks_per_page
        return self.blocks[page * g: page * g + self.sizes[page]]

    # -- what vLLM asks ---------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """Free blocks of mapped pages, plus what the limit still lets us map; 0 while over it."""
        # Called for every request the scheduler looks at: _spare is kept by _recount.
        spare = self._spare
        return 0 if spare < 0 else self.free_block_queue.num_free_blocks + spare

    def _recount(self) -> None:
        """Blocks the pages the limit still allows would add (-1: over the limit); after every change."""
        if self._reporting_all:
            self._spare = sum(self.sizes[p] for p in range(self.num_pages) if self.state[p] != MAPPED)
            return
        extra = self.max_pages - self.mapped_count
        self._spare = -1 if extra < 0 else self._blocks_in_pages(extra)

    def _blocks_in_pages(self, k: int) -> int:
        """Blocks that `k` more pages surely hold: the last page of the cache may be short."""
        k = min(k, len(self._releasing) + len(self._unmapped))
        if k <= 0:
            return 0
        last = self.num_pages - 1
        short = self.blocks_per_page - self.sizes[last] if self.state[last] != MAPPED else 0
        return k * self.blocks_per_page - short

    def get_usage(self) -> float:
        """Blocks in use over blocks in use plus those `get_num_free_blocks` offers."""
        last = self.num_pages - 1
        mapped = self.mapped_count * self.blocks_per_page - (
            self.blocks_per_page - self.sizes[last] if self.state[last] == MAPPED else 0)
        held = max(0, mapped - self.free_block_queue.num_free_blocks - 1)
        total = held + self.get_num_free_blocks()
        return held / total if total > 0 else 1.0

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Map pages first when the free blocks of mapped pages do not suffice."""
        short = num_blocks - self.free_block_queue.num_free_blocks
        if short > 0:
            self._grow(short)
        # BlockPool's own, bound once at import: a zero-argument super() costs a block's worth here
        # (bench_elastic.py).
        return _vllm_get_new_blocks(self, num_blocks)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """vLLM's free; over the limit, the pages it empties are released at once."""
        # Nothing per block (bench_elastic.py): pages are judged by _trim, a few times a second.
        _vllm_free_blocks(self, ordered_blocks)
        if self.mapped_count > self.max_pages:
            self._trim()

    def reset_prefix_cache(self) -> bool:
        """vLLM's reset, counting unmapped blocks as the free blocks they are."""
        self._reporting_all = True
        self._recount()
        try:
            ok = super().reset_prefix_cache()
        finally:
            self._reporting_all = False
            self._recount()
        return ok

    # -- mapping -----------------------------------------------------------------------

    def _grow(self, short: int) -> None:
        """Bring `short` more blocks into the queue: pages being released first, then new ones."""
        if self.mapped_count >= self.max_pages:
            return
        allowed = self.max_pages - self.mapped_count
        back: list[int] = []
        got = 0
        # Pages waiting to be unmapped are still mapped everywhere: take them back.
        for p in sorted(self._releasing, reverse=True):
            if got >= short or len(back) >= allowed:
                break
            back.append(p)
            got += self.sizes[p]
        for p in back:
            del self._releasing[p]
        new: list[int] = []
        room = self.max_pages - self.mapped_count - len(self._releasing) - len(back)
        while got < short and len(new) < room and self._unmapped:
            p = heapq.heappop(self._unmapped)
            new.append(p)
            got += self.sizes[p]
        if new:
            try:
                self.link.map(new)
            except BaseException:
                for p in new:
                    heapq.heappush(self._unmapped, p)
                for p in back:
                    self._releasing[p] = self.inflight.issued
                raise
        for p in back + new:
            self.state[p] = MAPPED
            self.free_block_queue.prepend_n(self._blocks_of(p))
        self.mapped_count += len(back) + len(new)
        self._recount()
        if new:
            self._publish(force=True)

    def _page_state(self, page: int) -> int:
        """0: a block is taken; 1: all free, none cached or being read; 2: all free, some cached or read."""
        cached = False
        watchers = self._reuse_watchers
        blocks = self.blocks
        lo = page * self.blocks_per_page
        for i in range(lo, lo + self.sizes[page]):
            b = blocks[i]
            if b.prev_free_block is None:  # not in the queue: allocated (or the null block)
                return 0
            if b._block_hash is not None or (watchers and i in watchers):
                cached = True
        return 2 if cached else 1

    def _trim(self, idle: bool = False) -> None:
        """Release all-free pages beyond the reserve that stayed free `release_delay` (at once if `idle`).

        Over the limit, every all-free page goes at once, the reserve too, and
        then pages holding only cached blocks (evicted) until the mapping fits.
        Every mapped page is judged: a page in use is told by its first taken
        block, so this costs about a block's check per busy page, and nothing
        on vLLM's per-block paths.
        """
        now = self._judged_at = self.clock()
        over = self.mapped_count - self.max_pages
        clean = self._clean
        for p, st in enumerate(self.state):
            if st != MAPPED:
                continue
            judged = self._page_state(p)
            if judged == 1:
                clean.setdefault(p, now)
            else:
                clean.pop(p, None)
            if judged == 2:
                self._cached.add(p)
            else:
                self._cached.discard(p)
        for p in [p for p in clean if self.state[p] != MAPPED]:
            del clean[p]
        if over > 0:
            victims = sorted(clean)
        else:
            # Keep the lowest pages as the reserve: the heap hands the lowest out first anyway.
            victims = [p for p in sorted(clean)[self.reserve:] if idle or now - clean[p] >= self.release_delay]
        forced: list[int] = []
        if over > len(victims):
            forced = [p for p in sorted(self._cached, reverse=True)
                      if self.state[p] == MAPPED and self._page_state(p) == 2][: over - len(victims)]
        if not victims and not forced:
            return
        q = self.free_block_queue
        for p in victims + forced:
            blocks = self._blocks_of(p)
            self._clean.pop(p, None)
            if p in self._cached:
                self._cached.discard(p)
                # Readers of unpinned blocks are told, as when vLLM reuses a block.
                self._notify_reuse([b for b in blocks if b.block_id in self._reuse_watchers])
                for b in blocks:
                    if b.block_hash is not None:
                        self._maybe_evict_cached_block(b)
            for b in blocks:
                q.remove(b)
            self.state[p] = RELEASING
            self._releasing[p] = self.inflight.issued
        self.mapped_count -= len(victims) + len(forced)
        self._recount()
        self.release_finished()

    def release_finished(self) -> None:
        """Unmap released pages that no running batch can touch any more."""
        if not self._releasing:
            return
        done = self.inflight.finished_through()
        pages = sorted(p for p, seq in self._releasing.items() if seq <= done)
        if not pages:
            return
        self.link.unmap(pages)
        for p in pages:
            del self._releasing[p]
            self.state[p] = UNMAPPED
            heapq.heappush(self._unmapped, p)
        self._recount()
        self._publish(force=True)

    # -- the step and the segment ------------------------------------------------------

    def begin_step(self) -> None:
        """Before the scheduler runs: follow the limit (releasing at once what it no longer allows)."""
        # Once per step, on every serve's path (bench_elastic.py, "scheduler step"): the limit
        # read is a load from the mapped segment (one pread without the extension); the rest
        # is done only when the limit moved or pages are waiting.
        watch = self._limit_watch
        if watch is not None:
            try:
                limit = watch.read()
            except (KvcachedError, OSError) as e:
                self._unreadable(e)
            else:
                if self._missing_warned:
                    self._missing_warned = False
                if limit != self.limit:
                    self._set_limit(limit)
        if self.mapped_count > self.max_pages:
            self.end_step()
        elif self._releasing:
            self.release_finished()

    def end_step(self, idle: bool = False) -> None:
        """After a step's frees (and at the next step's start): release what is due, publish.

        `idle`: the scheduler has no request left, so no step will come to
        release pages later: release everything beyond the reserve now.
        """
        if self._releasing:
            self.release_finished()
        # While requests run, judging pages more often than a quarter of the delay buys
        # nothing (a page must stay free that long) and judging is most of a step's cost
        # (bench_elastic.py): judge at that pace, at once when idle or over the limit.
        if idle or self.mapped_count > self.max_pages or \
                self.clock() - self._judged_at >= self.release_delay * 0.25:
            self._trim(idle)
            self._publish()  # the used/prealloc split moves only when pages are judged

    def _refresh_limit(self) -> None:
        """Read the limit from the segment now and follow it."""
        if self._limit_watch is None:
            return
        try:
            limit = self._limit_watch.read()
        except (KvcachedError, OSError) as e:
            self._unreadable(e)
            return
        self._missing_warned = False
        self._set_limit(limit)

    def _unreadable(self, e: Exception) -> None:
        """The limit could not be read: keep the last one (guessing a bigger one could take memory an operator
        withdrew), and say so (once while the segment is missing)."""
        if isinstance(e, SegmentMissing):
            if not self._missing_warned:
                log.warning("kvcached: no limit segment at %s; keeping the limit of %d bytes until it appears",
                            self.segment_path, self.limit)
                self._missing_warned = True
            return
        log.warning("kvcached: cannot read the limit from %s (%s); keeping %d", self.segment_path, e, self.limit)

    def _set_limit(self, limit: int) -> None:
        self.limit = limit
        max_pages = min(self.num_pages, max(0, limit) // self.page_bytes)
        if max_pages != self.max_pages:
            self.max_pages = max_pages
            self._recount()

    def _publish(self, force: bool = False) -> None:
        if self.segment_path is None:
            return
        prealloc = (len(self._clean) + len(self._releasing)) * self.page_bytes
        used = (self.mapped_count + len(self._releasing)) * self.page_bytes - prealloc
        if not force and self._published == (used, prealloc):
            return
        try:
            write_segment(self.segment_path, used=used, prealloc=prealloc)
            self._published = (used, prealloc)
        except SegmentMissing:
            pass  # warned when the limit was read
        except (KvcachedError, OSError) as e:
            log.warning("kvcached: cannot publish usage to %s: %s", self.segment_path, e)

    # -- for checks --------------------------------------------------------------------

    def mapped_pages(self) -> list[int]:
        """Pages mapped on the workers now (including those waiting to be unmapped)."""
        return [p for p in range(self.num_pages) if self.state[p] != UNMAPPED]

    @property
    def mapped_bytes(self) -> int:
        """Memory mapped per rank (an upper bound: neighbouring pages may share memory)."""
        return (self.mapped_count + len(self._releasing)) * self.page_bytes
