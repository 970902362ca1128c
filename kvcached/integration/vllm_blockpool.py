"""vLLM's BlockPool, elastic: blocks come from mapped pages, pages are mapped on demand under the limit.

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
- A page whose blocks are all free, none cached and none still being read
  (`unpin_blocks`) is released once more than `reserve` such pages exist:
  its blocks leave the queue at once, and its memory is unmapped once every
  batch scheduled before the release has finished (`InFlight`), because
  with async scheduling and pipeline parallelism the workers may still be
  running a batch that writes those blocks. Over the limit, the reserve and
  pages holding only cached blocks go too (those blocks are evicted).
- `begin_step` (called by the patched `Scheduler.schedule`) re-reads the
  limit from the segment, releases what it must, and publishes ``used``
  (pages holding an allocated or cached block) and ``prealloc`` (mapped
  pages holding none) to it.

A mapping failure (a worker died, the device is out of memory) raises
`MapError` out of the scheduler, which ends the engine with that error; the
link undoes partial changes first, so no worker keeps half a page set.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

from kvcached.errors import KvcachedError, SegmentMissing
from kvcached.runtime.kvbuffer import LinkSetup, WorkerLink
from kvcached.segment import read_segment, write_segment

log = logging.getLogger("kvcached.integration.vllm.blockpool")

UNMAPPED, MAPPED, RELEASING = 0, 1, 2


class InFlight:
    """Which scheduled batches may still be running on the workers."""

    def __init__(self) -> None:
        self.issued = 0
        self._open: dict[int, int] = {}  # seq -> id(scheduler output)
        self._lock = threading.Lock()

    def issue(self, output: object) -> None:
        """A batch was scheduled (its workers may run it from now on)."""
        with self._lock:
            self.issued += 1
            seq = self.issued
            self._open[seq] = id(output)
        try:
            # A batch dropped without its output being processed (an engine
            # reset) must not hold back every later release.
            weakref.finalize(output, self._close, seq)
        except TypeError:
            pass

    def complete(self, output: object) -> None:
        """The batch's output came back: its workers are done with it."""
        key = id(output)
        with self._lock:
            for seq, k in list(self._open.items()):
                if k == key:
                    del self._open[seq]
                    break

    def _close(self, seq: int) -> None:
        with self._lock:
            self._open.pop(seq, None)

    def finished_through(self) -> int:
        """Every batch up to this sequence number has finished."""
        with self._lock:
            return min(self._open) - 1 if self._open else self.issued


@dataclass(frozen=True)
class ElasticSetup:
    """What the engine hands the pool: the link to the workers and what they agreed."""

    link: WorkerLink
    agreed: LinkSetup
    segment_path: str | None
    reserve_pages: int = 1


class PageQueue(FreeKVCacheBlockQueue):
    """vLLM's free block queue over the blocks of mapped pages, counting free blocks per page."""

    def __init__(self, blocks: list[KVCacheBlock], blocks_per_page: int, nfree: list[int],
                 sizes: list[int], empty: dict[int, None]) -> None:
        super().__init__(blocks)
        self.bpp = blocks_per_page
        self.nfree = nfree  # free blocks of each page in the queue
        self.sizes = sizes  # blocks of each page (the null block counts, so page 0 never empties)
        self.empty = empty  # pages that became all free (checked lazily: entries may be stale)

    def _left(self, blocks: Iterable[KVCacheBlock]) -> None:
        nfree, bpp = self.nfree, self.bpp
        for b in blocks:
            nfree[b.block_id // bpp] -= 1

    def _entered(self, blocks: Iterable[KVCacheBlock]) -> None:
        nfree, sizes, bpp = self.nfree, self.sizes, self.bpp
        for b in blocks:
            p = b.block_id // bpp
            n = nfree[p] + 1
            nfree[p] = n
            if n == sizes[p]:
                self.empty[p] = None

    def popleft(self) -> KVCacheBlock:
        b = super().popleft()
        self.nfree[b.block_id // self.bpp] -= 1
        return b

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        out = super().popleft_n(n)
        self._left(out)
        return out

    def remove(self, block: KVCacheBlock) -> None:
        super().remove(block)
        self.nfree[block.block_id // self.bpp] -= 1

    def append(self, block: KVCacheBlock) -> None:
        super().append(block)
        self._entered((block,))

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        super().append_n(blocks)
        self._entered(blocks)

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        super().prepend_n(blocks)
        self._entered(blocks)

    def take_page(self, blocks: Iterable[KVCacheBlock], page: int) -> None:
        """Take a whole free page's blocks out of the queue (it is being released)."""
        for b in blocks:
            FreeKVCacheBlockQueue.remove(self, b)
        self.nfree[page] = 0


class ElasticBlockPool(BlockPool):
    """A BlockPool whose blocks live in pages mapped on demand, under the segment's limit."""

    def __init__(self, *args: Any, elastic: ElasticSetup, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        agreed = elastic.agreed
        self.link = elastic.link
        self.segment_path = elastic.segment_path
        self.reserve = max(0, elastic.reserve_pages)
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
        self._cached_empty: dict[int, None] = {}  # all-free pages that hold cached blocks
        self._empty: dict[int, None] = {}
        self.inflight = InFlight()
        self._reporting_all = False
        self._lock = threading.RLock()  # the scheduler's thread, and GC finalizers of InFlight
        mapped = sorted(agreed.mapped_groups)
        for b in self.blocks:
            b.prev_free_block = b.next_free_block = None
        free = [b for p in mapped for b in self._blocks_of(p) if not b.is_null]
        nfree = [0] * self.num_pages
        for b in free:
            nfree[b.block_id // g] += 1
        self.free_block_queue = PageQueue(free, g, nfree, self.sizes, self._empty)
        for p in mapped:
            self.state[p] = MAPPED
        self.mapped_count = len(mapped)
        self._unmapped = [p for p in range(self.num_pages) if not self.state[p]]  # a heap
        self.limit = self.num_pages * self.page_bytes
        self.max_pages = self.num_pages
        self._published: tuple[int, int] | None = None
        self._missing_warned = False
        self._refresh_limit()
        self._publish(force=True)
        log.info("kvcached: elastic block pool: %d blocks in %d pages of %d blocks (%d bytes each per rank), "
                 "limit %d bytes", n, self.num_pages, g, self.page_bytes, self.limit)

    def _blocks_of(self, page: int) -> list[KVCacheBlock]:
        g = self.blocks_per_page
        return self.blocks[page * g: page * g + self.sizes[page]]

    # -- what vLLM asks ---------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """Free blocks of mapped pages, plus what the limit still lets us map; 0 while over it."""
        queued = self.free_block_queue.num_free_blocks
        if self._reporting_all:
            return queued + sum(self.sizes[p] for p in range(self.num_pages) if self.state[p] != MAPPED)
        extra = self.max_pages - self.mapped_count
        if extra < 0:
            return 0
        return queued + self._blocks_in_pages(extra)

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
            with self._lock:
                self._grow(short)
        return super().get_new_blocks(num_blocks)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """vLLM's free, then release pages left empty beyond the reserve."""
        super().free_blocks(ordered_blocks)
        if len(self._empty) > self.reserve or self.mapped_count > self.max_pages:
            with self._lock:
                self._trim()

    def evict_blocks(self, block_ids: set[int]) -> None:
        """vLLM's eviction; a page left holding no cached block may now be released."""
        super().evict_blocks(block_ids)
        with self._lock:
            g = self.blocks_per_page
            for page in {bid // g for bid in block_ids}:
                if page in self._cached_empty:
                    del self._cached_empty[page]
                    self._empty[page] = None  # checked again by _trim
            self._trim()

    def reset_prefix_cache(self) -> bool:
        """vLLM's reset, counting unmapped blocks as the free blocks they are."""
        self._reporting_all = True
        try:
            ok = super().reset_prefix_cache()
        finally:
            self._reporting_all = False
        if ok:
            with self._lock:
                self._empty.update(self._cached_empty)
                self._cached_empty.clear()
                self._trim()
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
        if new:
            self._publish(force=True)

    def _trim(self) -> None:
        """Release empty pages beyond the reserve; over the limit, cached-only pages and the reserve too."""
        over = self.mapped_count - self.max_pages
        clean = self._clean_empty_pages()
        # Over the limit the reserve goes too; else keep the lowest pages as the reserve.
        victims = clean if over > 0 else clean[self.reserve:]
        forced: list[int] = []
        if over > len(victims):
            forced = [p for p in sorted(self._cached_empty, reverse=True) if self._all_free(p)]
            forced = forced[: over - len(victims)]
        if not victims and not forced:
            return
        q = self.free_block_queue
        assert isinstance(q, PageQueue)
        for p in victims + forced:
            blocks = self._blocks_of(p)
            if p in forced:
                self._cached_empty.pop(p, None)
                # Readers of unpinned blocks are told, as when vLLM reuses a block.
                self._notify_reuse(b for b in blocks if b.block_id in self._reuse_watchers)
                for b in blocks:
                    if b.block_hash is not None:
                        self._maybe_evict_cached_block(b)
            self._empty.pop(p, None)
            q.take_page(blocks, p)
            self.state[p] = RELEASING
            self._releasing[p] = self.inflight.issued
        self.mapped_count -= len(victims) + len(forced)
        self.release_finished()

    def _all_free(self, page: int) -> bool:
        return self.state[page] == MAPPED and self.free_block_queue.nfree[page] == self.sizes[page]

    def _clean_empty_pages(self) -> list[int]:
        """Mapped pages whose blocks are all free, none cached or being read, ascending."""
        out = []
        for p in list(self._empty):
            if not self._all_free(p):
                del self._empty[p]
            elif any(b.block_hash is not None or b.block_id in self._reuse_watchers
                     for b in self._blocks_of(p)):
                del self._empty[p]
                self._cached_empty[p] = None
            else:
                out.append(p)
        out.sort()
        return out

    def release_finished(self) -> None:
        """Unmap released pages that no running batch can touch any more."""
        with self._lock:
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
            self._publish(force=True)

    # -- the step and the segment ------------------------------------------------------

    def begin_step(self) -> None:
        """Before the scheduler runs: follow the limit, release what is due, publish."""
        with self._lock:
            self._refresh_limit()
            self.release_finished()
            if self.mapped_count > self.max_pages or len(self._empty) > self.reserve:
                self._trim()
            self._publish()

    def _refresh_limit(self) -> None:
        if self.segment_path is None:
            return
        try:
            self.limit = read_segment(self.segment_path).total
            self._missing_warned = False
        except SegmentMissing:
            if not self._missing_warned:
                log.warning("kvcached: no limit segment at %s; keeping the limit of %d bytes until it appears",
                            self.segment_path, self.limit)
                self._missing_warned = True
        except (KvcachedError, OSError) as e:
            # Keep the last limit: guessing a bigger one could take memory an operator withdrew.
            log.warning("kvcached: cannot read the limit from %s (%s); keeping %d", self.segment_path, e,
                        self.limit)
        self.max_pages = min(self.num_pages, max(0, self.limit) // self.page_bytes)

    def _publish(self, force: bool = False) -> None:
        if self.segment_path is None:
            return
        empty = len(self._clean_empty_pages()) + len(self._releasing)
        prealloc = empty * self.page_bytes
        used = (self.mapped_count + len(self._releasing)) * self.page_bytes - prealloc
        if not force and self._published == (used, prealloc):
            return
        try:
            write_segment(self.segment_path, used=used, prealloc=prealloc)
            self._published = (used, prealloc)
        except SegmentMissing:
            pass  # warned by _refresh_limit
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

    def stats(self) -> dict[str, int]:
        """Pages, blocks and bytes now, for logs and tests."""
        return {"mapped_pages": self.mapped_count, "releasing_pages": len(self._releasing),
                "free_blocks": self.free_block_queue.num_free_blocks, "max_pages": self.max_pages,
                "limit": self.limit, "mapped_bytes": self.mapped_bytes, "time": int(time.time())}
