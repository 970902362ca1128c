"""The elastic core: which pages of a reserved range are mapped, under the segment's limit, engine-free.

Every elastic pool of kvcached (the harness's `KVPool`, vLLM's
`ElasticBlockPool`, SGLang's elastic allocators) hands out *units* (blocks,
token ids) that live in *pages* (one index per group of physical pages in
every KV tensor) and keeps the same books about those pages. They are kept
here, once:

- `ElasticPages`: each page's state (unmapped, mapped, releasing, draining),
  the unmapped pages as a heap (the lowest is mapped first, so that live
  units gather low and the high pages empty), pages released at a sequence
  number and unmapped once the engine says that sequence is done (a batch in
  flight may still write them), `grow` (pages being released taken back
  first, then new ones mapped, rolled back if the mapping fails), the limit
  turned into the pages it allows, and the usage published from the books.
- `SegmentLimit`: the deployment's segment as a pool sees it: the limit read
  once per step without a system call (`LimitWatch`), and ``used`` /
  ``prealloc`` written back when they changed.
- `due_for_release`: which idle pages are released now (past the reserve,
  idle for the release delay, at once when the engine is idle or over the
  limit), and `review_interval`, how often a busy engine looks.

What stays with each engine's adapter is what the engine knows: where its
free units are (vLLM's free block queue, SGLang's free-list tensor, the
harness's slot lists), how it tells an idle page (vLLM walks a page's
blocks, SGLang counts free ids per page), what it reports as free, and when
a step is done. The core neither locks nor calls back: the adapters use it
from the one thread their engine uses them from (the harness under its lock).
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, TypeVar

from kvcached.node import KvcachedError, LimitWatch, MappedReader, SegmentMissing, write_segment

log = logging.getLogger(__name__)

UNMAPPED, MAPPED, RELEASING, DRAINING = 0, 1, 2, 3

Clock = TypeVar("Clock", int, float)


class PageLink(Protocol):
    """Applies page changes wherever the KV tensors live (this process, or every worker), all or nothing."""

    def map(self, pages: Sequence[int]) -> None: ...

    def unmap(self, pages: Sequence[int]) -> None: ...


class SegmentLimit:
    """A deployment's segment for a pool: the limit, read once per step without a system call, and usage out.

    `path` None: `locate` names the segment, asked again at each read until one
    can be opened; until then `read` answers None (no limit known). A read that
    fails answers None too, warned once per outage (a segment gone is looked for
    again at the next read); what None means is the adapter's to decide (keep
    the last limit, or the engine's own capacity), and `fallback` says it in
    the warning. `interval`: usage that changed is written at most that often
    unless forced (a segment write costs several fast-path allocations).
    """

    def __init__(self, path: str | None = None, *, locate: Callable[[], str | None] | None = None,
                 mapper: Callable[[int], MappedReader] | None = None, interval: float = 0.0,
                 fallback: str = "the last limit stays", logger: logging.Logger | None = None) -> None:
        self.path = path
        self._locate = locate
        self._mapper = mapper
        self.interval = interval
        self._fallback = fallback
        self._log = logger or log
        self._watch: LimitWatch | None = None
        self._warned = False
        self.published: tuple[int, int] | None = None
        self._published_at = float("-inf")

    def read(self) -> int | None:
        """The limit in bytes per rank now, or None while no segment can be read."""
        watch = self._watch
        if watch is not None:
            try:
                value = watch.read()
            except (KvcachedError, OSError) as e:
                self._failed(self.path, e)
                return None
            if self._warned:
                self._warned = False
            return value
        path = self.path or (self._locate() if self._locate is not None else None)
        if path is None:
            return None
        watch = LimitWatch(path, mapper=self._mapper)
        try:
            value = watch.read()
        except (KvcachedError, OSError) as e:
            watch.close()  # a file that is no segment may have been opened before it was found out
            self._failed(path, e)
            return None
        self.path, self._watch, self._warned = path, watch, False
        return value

    @property
    def watching(self) -> bool:
        """Whether a segment is open (usage is written only to a segment the limit was read from)."""
        return self._watch is not None

    def _failed(self, path: str | None, e: BaseException) -> None:
        missing = isinstance(e, SegmentMissing)
        if missing and self._watch is not None:
            self._watch.close()
            self._watch = None
        if self._warned:
            return
        self._warned = True
        if missing:
            self._log.warning("kvcached: no limit segment at %s yet; %s until it appears", path, self._fallback)
        else:
            self._log.warning("kvcached: cannot read the limit from %s (%s); %s", path, e, self._fallback)

    def publish(self, used: int, prealloc: int, *, force: bool = False) -> None:
        """Write used/prealloc (bytes per rank) when they changed (`force`: now, changed or not). Never raises."""
        if self._watch is None or self.path is None:
            return
        if not force:
            if self.published == (used, prealloc):
                return
            if self.interval and time.monotonic() - self._published_at < self.interval:
                return  # the next forced publish (a step, a mapping change) writes it
        try:
            write_segment(self.path, used=used, prealloc=prealloc)
        except SegmentMissing:
            return  # warned by the next read, which looks for it again
        except (KvcachedError, OSError) as e:
            self._log.warning("kvcached: cannot publish usage to %s: %s", self.path, e)
            return
        self.published = (used, prealloc)
        if self.interval:
            self._published_at = time.monotonic()

    def close(self) -> None:
        """Close the limit's file (idempotent)."""
        if self._watch is not None:
            self._watch.close()
            self._watch = None


class ElasticPages:
    """The books of one elastic range: each page's state, what is mapped, released, allowed by the limit.

    `sizes[p]`: the units page `p` holds (0: it holds none and is never
    mapped on demand). `mapped_count` counts every page mapped on the link,
    those being released included; `kept` those not being released.
    """

    def __init__(self, link: PageLink, sizes: Sequence[int], page_bytes: int, mapped: Iterable[int] = (),
                 segment: SegmentLimit | None = None) -> None:
        if page_bytes <= 0:
            raise ValueError(f"page_bytes must be positive, got {page_bytes}")
        self.link = link
        self.sizes = list(sizes)
        self.num_pages = n = len(self.sizes)
        self.page_bytes = page_bytes
        self.segment = segment
        on = set(mapped)
        self.state = bytearray(MAPPED if p in on else UNMAPPED for p in range(n))
        self.unmapped = [p for p in range(n) if p not in on and self.sizes[p] > 0]  # a heap
        self.releasing: dict[int, int] = {}  # page -> the sequence after which it may be unmapped
        self.releasing_units = 0
        self.mapped_count = len(on)
        self.limit: int | None = None
        self.max_pages = n
        self.last = max((p for p in range(n) if self.sizes[p] > 0), default=-1)  # the last page holding units

    @property
    def kept(self) -> int:
        """Mapped pages not being released."""
        return self.mapped_count - len(self.releasing)

    # -- the limit ------------------------------------------------------------------------

    def set_limit(self, limit: int | None) -> bool:
        """Follow `limit` in bytes per rank (None: the whole range); whether the pages it allows changed."""
        self.limit = limit
        pages = self.num_pages if limit is None else min(self.num_pages, max(0, limit) // self.page_bytes)
        if pages == self.max_pages:
            return False
        self.max_pages = pages
        return True

    def mappable(self, inflight: int = 0) -> int:
        """Pages that may still be mapped: unmapped, and within the limit (`inflight` being mapped apart)."""
        return max(0, min(len(self.unmapped), self.max_pages - self.mapped_count - inflight))

    def spare_units(self, count: int, per_page: int, *, releasing: bool) -> int:
        """Units that `count` more pages surely hold, of those `grow` could bring: the unmapped, and with
        `releasing` the pages being released too. Each holds `per_page` units but the last page of the range,
        which may hold fewer (a cache rarely fills its last page), and is counted short while it could come."""
        count = min(count, len(self.unmapped) + (len(self.releasing) if releasing else 0))
        if count <= 0 or self.last < 0:
            return 0
        st = self.state[self.last]
        could_come = st == UNMAPPED or (releasing and st == RELEASING)
        return count * per_page - (per_page - self.sizes[self.last] if could_come else 0)

    # -- mapping ----------------------------------------------------------------------------

    def take_lowest(self, count: int) -> list[int]:
        """The `count` lowest unmapped pages, out of the heap, not mapped yet (`put_back` or `mark_mapped` them)."""
        return [heapq.heappop(self.unmapped) for _ in range(count)]

    def put_back(self, pages: Iterable[int]) -> None:
        """Pages taken and not mapped after all."""
        for p in pages:
            heapq.heappush(self.unmapped, p)

    def mark_mapped(self, pages: Sequence[int]) -> None:
        """Pages taken and mapped on the link."""
        state = self.state
        for p in pages:
            state[p] = MAPPED
        self.mapped_count += len(pages)

    def map_lowest(self, count: int) -> list[int]:
        """Map the `count` lowest unmapped pages; on a mapping failure none is taken."""
        pages = self.take_lowest(count)
        self._map(pages)
        self.mark_mapped(pages)
        return pages

    def _map(self, pages: list[int]) -> None:
        try:
            self.link.map(pages)
        except BaseException:
            self.put_back(pages)
            raise

    def grow(self, short: int, *, exact: bool = False) -> tuple[list[int], list[int]] | None:
        """Pages holding at least `short` more units, within the limit: (taken back, newly mapped).

        Pages being released are still mapped everywhere: the highest are taken
        back first (they were released last), then the lowest unmapped pages are
        mapped, all or nothing. Fewer units than `short` may come back when the
        limit or the range has no more; with `exact` nothing changes then (None).
        """
        kept = self.kept
        if kept >= self.max_pages:
            return None if exact else ([], [])
        sizes = self.sizes
        allowed = self.max_pages - kept
        back: list[int] = []
        got = 0
        for p in sorted(self.releasing, reverse=True):
            if got >= short or len(back) >= allowed:
                break
            back.append(p)
            got += sizes[p]
        new: list[int] = []
        room = self.max_pages - self.mapped_count
        while got < short and len(new) < room and self.unmapped:
            p = heapq.heappop(self.unmapped)
            new.append(p)
            got += sizes[p]
        if exact and got < short:
            self.put_back(new)
            return None
        if new:
            self._map(new)
        state, releasing = self.state, self.releasing
        for p in back:
            del releasing[p]
            self.releasing_units -= sizes[p]
            state[p] = MAPPED
        for p in new:
            state[p] = MAPPED
        self.mapped_count += len(new)
        return back, new

    # -- releasing ----------------------------------------------------------------------------

    def release(self, pages: Iterable[int], seq: int) -> None:
        """Pages that hold no unit any more, out of the adapter's free units: unmapped once `seq` is done."""
        state, releasing, sizes = self.state, self.releasing, self.sizes
        for p in pages:
            state[p] = RELEASING
            releasing[p] = seq
            self.releasing_units += sizes[p]

    def unmap_released(self, done: int | None) -> list[int]:
        """Unmap the released pages whose sequence is at most `done` (None: every one); returns them."""
        releasing = self.releasing
        if not releasing:
            return []
        due = sorted(p for p, seq in releasing.items() if done is None or seq <= done)
        if not due:
            return []
        self.link.unmap(due)
        state, sizes = self.state, self.sizes
        for p in due:
            del releasing[p]
            self.releasing_units -= sizes[p]
            state[p] = UNMAPPED
            heapq.heappush(self.unmapped, p)
        self.mapped_count -= len(due)
        return due

    def unmap_now(self, pages: Sequence[int]) -> None:
        """Unmap mapped pages that no batch can touch (the harness's pool frees a page's last block itself)."""
        self.link.unmap(pages)
        state = self.state
        for p in pages:
            state[p] = UNMAPPED
            heapq.heappush(self.unmapped, p)
        self.mapped_count -= len(pages)

    def forget_all(self) -> None:
        """Every page unmapped again (the adapter unmapped them itself, at close)."""
        n = self.num_pages
        self.state = bytearray(n)
        self.unmapped = [p for p in range(n) if self.sizes[p] > 0]
        self.releasing.clear()
        self.releasing_units = 0
        self.mapped_count = 0

    def keep_all(self) -> None:
        """Every page mapped for good (the adapter mapped them itself, standing aside): no limit from now on."""
        n = self.num_pages
        self.state = bytearray(MAPPED for _ in range(n))
        self.unmapped = []
        self.releasing.clear()
        self.releasing_units = 0
        self.mapped_count = self.max_pages = n
        self.limit = None

    # -- what the books say -------------------------------------------------------------------

    def mapped_pages(self) -> list[int]:
        """Pages mapped on the link now (those being released included), ascending."""
        return [p for p, st in enumerate(self.state) if st != UNMAPPED]

    def usage(self, idle_pages: int) -> tuple[int, int]:
        """(used, prealloc) in bytes per rank: pages holding a unit, and mapped pages holding none.

        `idle_pages`: mapped pages, not being released, that hold no unit (as
        the adapter last counted them); pages being released are idle too.
        """
        pb = self.page_bytes
        prealloc = (idle_pages + len(self.releasing)) * pb
        return self.mapped_count * pb - prealloc, prealloc

    def publish(self, idle_pages: int, force: bool = False) -> None:
        """Write the usage to the segment (when it changed, or `force`)."""
        segment = self.segment
        if segment is not None:
            used, prealloc = self.usage(idle_pages)
            segment.publish(used, prealloc, force=force)

    @property
    def mapped_bytes(self) -> int:
        """Memory mapped per rank (an upper bound: neighbouring pages may share physical pages)."""
        return self.mapped_count * self.page_bytes


def review_interval(delay: Clock) -> Clock:
    """How long a busy engine waits between two reviews of its idle pages: a quarter of the release `delay`.

    A page must stay idle `delay` before it is released, so reviewing more
    often buys nothing, and reviewing is most of what a step costs an
    adapter (bench/bench_elastic.py, bench/bench_sglang.py): a page is then
    released at most 1.25 delays after its last use.
    """
    return delay // 4 if isinstance(delay, int) else delay / 4


def due_for_release(idle_since: dict[int, Clock], now: Clock, *, reserve: int, delay: Clock, idle: bool,
                    over: bool) -> list[int]:
    """Idle pages to release now, ascending: all of them over the limit, else those past the `reserve` lowest
    that stayed idle `delay` (at once when the engine is `idle`: no later step would release them)."""
    pages = sorted(idle_since)
    if over:
        return pages
    # The lowest stay as the reserve: the heap hands the lowest out first anyway.
    return [p for p in pages[reserve:] if idle or now - idle_since[p] >= delay]
