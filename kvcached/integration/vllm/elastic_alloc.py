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
  reviewed: a page whose blocks are all free, none cached and none still
  being read (`unpin_blocks`) is released when more than `reserve` such
  pages exist and it stayed free `release_delay` seconds, or at once when
  the scheduler has nothing left to run (no later step would release it).
  Reviewing per step, not per freed block, keeps vLLM's hot path almost as it
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

The pages' books (states, grow with rollback, release and delayed unmap,
the limit, the usage) are the elastic core's, `kvcached.runtime.elastic`
(docs/ELASTIC.md), as for SGLang's allocators and the harness's pool.

A mapping failure (a worker died, the device is out of memory) raises
`MapError` out of the scheduler, which ends the engine with that error; the
link undoes partial changes first, so no worker keeps half a page set.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

from kvcached.integration.engine_elastic import segment_limit, take_over_usage
from kvcached.integration.patchkit import which_field
from kvcached.integration.vllm.common import BLOCK_HASH_FIELD
from kvcached.node import KvcachedError
from kvcached.runtime.elastic import MAPPED, ElasticPages, PageLink, due_for_release, review_interval
from kvcached.runtime.kvbuffer import LinkSetup

log = logging.getLogger(__name__)

# vLLM's own, for the overrides that add a check around them (called once or a few times per step).
_vllm_get_new_blocks = BlockPool.get_new_blocks
_vllm_free_blocks = BlockPool.free_blocks
# A block's own hash field, read for every block of a page under review: the field itself, not 0.33's
# property over it (the probe checked that one of them is there).
_hash_of = attrgetter(BLOCK_HASH_FIELD[which_field(KVCacheBlock, "KVCacheBlock", BLOCK_HASH_FIELD)])


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

    link: PageLink  # set up already (LocalLink or SocketLink): `agreed` is what its setup() answered
    agreed: LinkSetup
    segment_path: str | None
    reserve_pages: int = 1
    release_delay: float = 1.0  # seconds a page stays all free before it is released (while busy)


class ElasticBlockPool(BlockPool):
    """A BlockPool whose blocks live in pages mapped on demand, under the segment's limit.

    The pages' books are the elastic core's (`kvcached.runtime.elastic`,
    `self.pages`); this adapter keeps what only vLLM knows: which blocks of a
    page are free (vLLM's free block queue), cached or read, and which batches
    are in flight. Like vLLM's BlockPool it is used from the scheduler's
    thread only, so it takes no lock.
    """

    def __init__(self, *args: Any, elastic: ElasticSetup, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        agreed = elastic.agreed
        self.link = elastic.link
        self.segment_path = elastic.segment_path
        self.segment = segment_limit(elastic.segment_path, logger=log, fallback="the last limit read stays") \
            if elastic.segment_path else None
        self.reserve = max(0, elastic.reserve_pages)
        self.release_delay = max(0.0, elastic.release_delay)
        self.review_every = review_interval(self.release_delay)  # read at every step: computed once
        self.clock = time.monotonic
        self._reviewed_at = float("-inf")
        self.blocks_per_page = g = agreed.blocks_per_page
        self.page_bytes = agreed.group_bytes
        n = self.num_gpu_blocks
        self.num_pages = -(-n // g)
        if self.num_pages != agreed.num_groups:
            raise KvcachedError(f"the workers' KV buffers have {agreed.num_groups} pages of {g} blocks, "
                                f"the engine's {n} blocks make {self.num_pages}")
        self.sizes = [g] * self.num_pages
        self.sizes[-1] = n - g * (self.num_pages - 1)
        mapped = sorted(agreed.mapped_groups)
        self.pages = ElasticPages(self.link, self.sizes, self.page_bytes, mapped, segment=self.segment)
        self.state = self.pages.state  # the core's, never replaced for this pool
        self._idle_since: dict[int, float] = {}  # all-free pages still mapped -> since when (as last reviewed)
        self._cached: set[int] = set()           # all-free pages that hold prefix-cached blocks
        self.inflight = InFlight()
        self._reporting_all = False
        self._spare = 0
        self._over = False  # more pages kept than the limit allows
        for b in self.blocks:
            b.prev_free_block = b.next_free_block = None
        # vLLM's queue, over the blocks of mapped pages only: a block out of the queue
        # has no links, which is how _page_state tells free blocks from taken ones.
        self.free_block_queue = FreeKVCacheBlockQueue(
            [b for p in mapped for b in self._blocks_of(p) if not b.is_null])
        self.pages.set_limit(self.num_pages * self.page_bytes)
        self._refresh_limit()
        self._recount()
        take_over_usage()
        self._publish(force=True)
        log.info("kvcached: elastic block pool: %d blocks in %d pages of %d blocks (%d bytes each per rank), "
                 "limit %d bytes", n, self.num_pages, g, self.page_bytes, self.limit)

    def _blocks_of(self, page: int) -> list[KVCacheBlock]:
        g = self.blocks_per_page
        return self.blocks[page * g: page * g + self.sizes[page]]

    @property
    def mapped_count(self) -> int:
        """Pages mapped and not being released."""
        return self.pages.kept

    @property
    def limit(self) -> int:
        """The limit followed, in bytes per rank."""
        limit = self.pages.limit
        return 0 if limit is None else limit

    @property
    def max_pages(self) -> int:
        """Pages the limit allows."""
        return self.pages.max_pages

    # -- what vLLM asks ---------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """Free blocks of mapped pages, plus what the limit still lets us map; 0 while over it."""
        # Called for every request the scheduler looks at: _spare is kept by _recount.
        spare = self._spare
        return 0 if spare < 0 else self.free_block_queue.num_free_blocks + spare

    def _recount(self) -> None:
        """Blocks the pages the limit still allows would add (-1: over the limit); after every change."""
        pages = self.pages
        extra = pages.max_pages - pages.kept
        self._over = extra < 0
        if self._reporting_all:
            state = pages.state
            self._spare = sum(self.sizes[p] for p in range(self.num_pages) if state[p] != MAPPED)
            return
        # Pages being released come back first (grow), so they count among the `extra`.
        self._spare = -1 if extra < 0 else pages.spare_units(extra, self.blocks_per_page, releasing=True)

    def get_usage(self) -> float:
        """Blocks in use over blocks in use plus those `get_num_free_blocks` offers."""
        last = self.num_pages - 1
        mapped = self.pages.kept * self.blocks_per_page - (
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

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock], *args: Any, **kwargs: Any) -> None:
        """vLLM's free; over the limit, the pages it empties are released at once.

        `ordered_blocks` may hold other pools' blocks (a deferred free): vLLM
        hands those to their own pool (`KVCacheBlock.pool`), which may be this
        one, with 0.34's `evict_first` passed along. This pool's pages are
        judged by its own blocks only (`_page_state`), so another pool's block
        with the same id never makes one of our pages look free.
        """
        # Nothing per block (bench_elastic.py): pages are reviewed by _trim, a few times a second.
        _vllm_free_blocks(self, ordered_blocks, *args, **kwargs)
        if self._over:
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
        """Bring `short` more blocks into the queue: pages being released first, then new ones (the core's)."""
        grown = self.pages.grow(short)
        if grown is None:
            return
        back, new = grown
        for p in back + new:
            self.free_block_queue.prepend_n(self._blocks_of(p))
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
            if _hash_of(b) is not None or (watchers and i in watchers):
                cached = True
        return 2 if cached else 1

    def _review(self) -> None:
        """Which mapped pages are all free (since when), and which of those hold cached blocks."""
        now = self._reviewed_at = self.clock()
        idle_since, cached = self._idle_since, self._cached
        state = self.state
        for p, st in enumerate(state):
            if st != MAPPED:
                continue
            page_state = self._page_state(p)
            if page_state == 1:
                idle_since.setdefault(p, now)
            else:
                idle_since.pop(p, None)
            if page_state == 2:
                cached.add(p)
            else:
                cached.discard(p)
        for p in [p for p in idle_since if state[p] != MAPPED]:
            del idle_since[p]

    def _trim(self, idle: bool = False) -> None:
        """Release all-free pages beyond the reserve that stayed free `release_delay` (at once if `idle`).

        Over the limit, every all-free page goes at once, the reserve too, and
        then pages holding only cached blocks (evicted) until the mapping fits.
        Every mapped page is reviewed: a page in use is told by its first taken
        block, so this costs about a block's check per busy page, and nothing
        on vLLM's per-block paths.
        """
        self._review()
        over = self.pages.kept - self.pages.max_pages
        victims = due_for_release(self._idle_since, self._reviewed_at, reserve=self.reserve,
                                  delay=self.release_delay, idle=idle, over=over > 0)
        forced: list[int] = []
        state = self.state
        if over > len(victims):
            forced = [p for p in sorted(self._cached, reverse=True)
                      if state[p] == MAPPED and self._page_state(p) == 2][: over - len(victims)]
        if not victims and not forced:
            return
        q = self.free_block_queue
        for p in victims + forced:
            blocks = self._blocks_of(p)
            self._idle_since.pop(p, None)
            if p in self._cached:
                self._cached.discard(p)
                # Readers of unpinned blocks are told, as when vLLM reuses a block.
                self._notify_reuse([b for b in blocks if b.block_id in self._reuse_watchers])
                for b in blocks:
                    if b.block_hash is not None:
                        self._maybe_evict_cached_block(b)
            for b in blocks:
                q.remove(b)
        self.pages.release(victims + forced, self.inflight.issued)
        self._recount()
        self.release_finished()

    def release_finished(self) -> None:
        """Unmap released pages that no running batch can touch any more."""
        if not self.pages.releasing:
            return
        if self.pages.unmap_released(self.inflight.finished_through()):
            self._recount()
            self._publish(force=True)

    # -- the step and the segment ------------------------------------------------------

    def begin_step(self) -> None:
        """Before the scheduler runs: follow the limit (releasing at once what it no longer allows)."""
        # Once per step, on every serve's path (bench_elastic.py, "scheduler step"): the limit
        # read is a load from the mapped segment (one pread without the extension); the rest
        # is done only when the limit moved or pages are waiting.
        segment = self.segment
        if segment is not None:
            limit = segment.read()
            if limit is not None and limit != self.pages.limit:
                self._set_limit(limit)
        if self._over:
            self.end_step()
        elif self.pages.releasing:
            self.release_finished()

    def end_step(self, idle: bool = False) -> None:
        """After a step's frees (and at the next step's start): release what is due, publish.

        `idle`: the scheduler has no request left, so no step will come to
        release pages later: release everything beyond the reserve now.
        """
        if self.pages.releasing:
            self.release_finished()
        # While requests run, review at the core's pace (review_interval), at once when idle or
        # over the limit.
        if idle or self._over or self.clock() - self._reviewed_at >= self.review_every:
            self._trim(idle)
            self._publish()  # the used/prealloc split moves only when pages are reviewed

    def _refresh_limit(self) -> None:
        """Read the limit from the segment now and follow it (an unreadable one keeps the last: guessing a
        bigger one could take memory an operator withdrew)."""
        if self.segment is None:
            return
        limit = self.segment.read()
        if limit is not None:
            self._set_limit(limit)

    def _set_limit(self, limit: int) -> None:
        if self.pages.set_limit(limit):
            self._recount()

    def _publish(self, force: bool = False) -> None:
        self.pages.publish(len(self._idle_since), force)

    # -- for checks --------------------------------------------------------------------

    def mapped_pages(self) -> list[int]:
        """Pages mapped on the workers now (including those waiting to be unmapped)."""
        return self.pages.mapped_pages()

    @property
    def mapped_bytes(self) -> int:
        """Memory mapped per rank (an upper bound: neighbouring pages may share memory)."""
        return self.pages.mapped_bytes
