"""SGLang's token allocators over an elastic pool: ids of mapped groups first, groups mapped on demand, under the limit.

The `sglang-elastic-kv` patch builds them for the elastic pools of
`elastic_buffers` (the paged allocator through the platform hook
`get_paged_allocator_cls`, page size 1 where SGLang's configurator builds
`TokenToKVPoolAllocator` by name). Being subclasses of SGLang's allocators,
this module imports SGLang at import.

An *id* is what SGLang's allocator hands out: a token slot at page size 1, a
page of `page_size` slots otherwise. A *group* is `ids_per_group` consecutive
ids whose bytes own whole physical pages in every layer (the pool's
`KVBuffer` maps and unmaps by group). SGLang's free list (`free_pages`)
holds the free ids of mapped groups only, so SGLang's own alloc and free run
unchanged; this adds:

- when the free list is short, whole groups are mapped (or groups waiting to
  be unmapped taken back) as long as the limit allows, before SGLang's own
  code hands the ids out; past the limit the allocation returns None, as
  SGLang's allocator does when full;
- ``available_size()`` keeps counting every free id, mapped or not, so that
  SGLang's accounting identity (available + evictable + protected +
  session-held + uncached = total) holds at every step, while the capacity
  hooks SGLang's scheduler asks before allocating (`create_prefill_budget`,
  `check_decode_capacity`, `evict_to_free_tokens`) answer with what can be
  allocated under the limit (`schedulable_size`): the scheduler waits,
  evicts or retracts as it does in front of a full pool, and never reaches
  an allocation that would fail;
- at each step boundary (`step`, before the scheduler picks its next batch):
  the limit agreed across the TP group (`elastic_ranks`), groups with no live
  token released once they stayed free `release_delay` (at once when the
  scheduler is idle or over the limit; the lowest `reserve` free groups stay
  mapped), their ids taken out of the free list, and their memory unmapped
  once no batch in flight can still write it (one step later with the
  overlap scheduler); over a lowered limit, the highest groups are drained
  (their free ids parked, so that they empty) and the prefix cache is evicted
  by the excess, until the mapping fits.

The groups' books (states, grow with rollback, release at a boundary and
the delayed unmap, the limit, the usage) are the elastic core's,
`kvcached.runtime.elastic` (docs/ELASTIC.md), as for vLLM's block pool and
the harness's pool.

Per id, nothing is added to SGLang's hot paths; the per-group census (one
``bincount`` over the free list) runs at the boundary, at most four times per
release delay while requests run (`bench/bench_sglang.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from time import monotonic_ns
from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.prefill_budget import PrefillBudget
from sglang.srt.utils import get_num_new_pages

from ...runtime.elastic import DRAINING, MAPPED, RELEASING, UNMAPPED, ElasticPages, due_for_release, review_interval
from ...runtime.kvbuffer import LocalLink
from ..engine_elastic import release_settings
from .elastic_buffers import _ElasticBuffers
from .elastic_ranks import Agreed, Agreement, TPGroup

if TYPE_CHECKING:
    from ...runtime.elastic import SegmentLimit

log = logging.getLogger(__name__)


def _never() -> bool:
    return False


def adoptable(kvcache: Any, need_sort: bool = False) -> bool:
    """Whether an elastic allocator can take `kvcache`: an elastic pool no allocator took yet, no PD staging."""
    if not isinstance(kvcache, _ElasticBuffers) or kvcache.elastic is None or kvcache.adopted:
        return False
    if need_sort:
        log.warning("kvcached: PD disaggregation stages freed KV (need_sort); the pool stands aside")
        return False
    return True


def _kvcache_of(args: tuple[Any, ...], kwargs: dict[str, Any], position: int) -> tuple[Any, bool]:
    kvcache = kwargs.get("kvcache", args[position] if len(args) > position else None)
    need_sort = kwargs.get("need_sort", args[position + 1] if len(args) > position + 1 else False)
    return kvcache, bool(need_sort)


@dataclass(frozen=True)
class ElasticStats:
    """The allocator's books at one moment, in ids and groups (for checks and the bench)."""

    mapped_groups: tuple[int, ...]  # what the pool's range has mapped
    releasing: tuple[int, ...]  # mapped, no live id, unmapped at a later boundary
    draining: tuple[int, ...]  # mapped over the limit, left to empty
    max_groups: int  # what the limit allows
    group_bytes: int  # what one group costs per rank
    mapped_bytes: int  # the extension's count of mapped memory
    available: int  # SGLang's available_size()
    schedulable: int  # what can be allocated now, under the limit (tokens)


class ElasticPrefillBudget(PrefillBudget):
    """SGLang's prefill budget with the room under the limit in place of every free slot."""

    def _available_and_evictable(self) -> int:
        return int(self.allocator.schedulable_size() + self.tree_cache.evictable_size())


class _ElasticIds:
    """The mechanics both allocators share. Used from the scheduler's thread only, like SGLang's allocators."""

    free_pages: Any
    device: Any
    page_size: int
    _plain: type  # SGLang's class, built instead for a pool that is not ours to map

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        kvcache, need_sort = _kvcache_of(args, kwargs, cls._kvcache_position)
        if not adoptable(kvcache, need_sort):
            return cls._plain(*args, **kwargs)  # not an instance of cls: Python skips our __init__
        return super().__new__(cls)

    _kvcache_position = 3

    def _elastic_setup(self, kvcache: Any, size: int, page_size: int, device: Any) -> None:
        buf = kvcache.elastic
        kvcache.adopted = True
        self.elastic_pool, self.elastic_buf = kvcache, buf
        plan = buf.plan
        self.ids_per_group = g = plan.blocks_per_page
        self.num_groups = n = plan.num_groups
        top = size // page_size  # the highest id SGLang hands out
        # Id 0 (the padding slot) and ids past `top` (rows the pool has beyond the allocator's) are never free.
        self.group_len = [max(0, min((i + 1) * g, top + 1) - max(i * g, 1)) for i in range(n)]
        self.group_bytes = plan.max_pages_per_group() * buf.page_size
        # The groups' books (states, mapped, released at a boundary, the limit) are the elastic core's.
        self.groups = ElasticPages(LocalLink(buf), self.group_len, self.group_bytes, buf.mapped_groups())
        self._empty_since: dict[int, int] = {}  # mapped groups with no live id -> since (agreed clock)
        self._draining: set[int] = set()
        self._outside = 0  # free ids of unmapped and releasing groups (in no list)
        self._parked = torch.empty((0,), dtype=torch.int64, device=device)  # free ids of draining groups
        release = release_settings()
        self.reserve = release.reserve
        self.release_delay_ns = int(release.delay_s * 1e9)  # the agreed clock counts nanoseconds
        self._review_at = 0  # the agreed clock at which the next review is due (0: at the first boundary)
        self._was_idle = False
        self.step_seq = 0
        self.lag = 0
        self.agreement: Agreement | None = None
        self._solo: SegmentLimit | None = None  # the agreement's source when it has nothing to exchange
        self.frozen = False  # stood aside at run time: every group mapped for good
        self._spare = 0

    @property
    def max_groups(self) -> int:
        """Groups the limit allows."""
        return self.groups.max_pages

    @property
    def limit(self) -> int | None:
        """The agreed limit in bytes per rank (None: none known)."""
        return self.groups.limit

    @property
    def mapped_count(self) -> int:
        """Groups mapped, those being released included."""
        return self.groups.mapped_count

    # -- what SGLang asks -----------------------------------------------------------------

    def _staged(self) -> int:
        raise NotImplementedError

    def _free_ids(self) -> int:
        return len(self.free_pages) + self._staged()

    def available_ids(self) -> int:
        """Every free id, mapped or not: what SGLang's accounting counts as available."""
        return self._free_ids() + self._outside + len(self._parked)

    def schedulable_size(self) -> int:
        """Tokens that can be allocated now: free ids of mapped groups, and what the limit still lets us map."""
        return (self._free_ids() + self._spare) * self.page_size

    def create_prefill_budget(self, tree_cache: Any, *, num_mixed_decode_tokens: int = 0) -> Any:
        """SGLang's prefill budget over `schedulable_size`."""
        return ElasticPrefillBudget(self, tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens)

    def evict_to_free_tokens(self, tree_cache: Any, num_tokens: int) -> bool | None:
        """Evict unlocked prefix-cache entries until `num_tokens` can be allocated under the limit."""
        if tree_cache is None or not tree_cache.supports_prefix_sharing():
            return None
        shortfall = num_tokens - self.schedulable_size()
        if shortfall > 0:
            tree_cache.evict_for_alloc(EvictParams(num_tokens=shortfall))
        return None

    def check_decode_capacity(self, *, num_tokens: int, tree_cache: Any, requests: Any = None,
                              spec_algorithm: Any = None) -> bool:
        """Whether the next decode step fits under the limit, after evicting what can be."""
        self.evict_to_free_tokens(tree_cache, num_tokens)
        return self.schedulable_size() >= num_tokens

    def get_all_free_pages(self) -> Any:
        """Every free id (debug census): the free list, staged, parked, and the ids of groups not mapped."""
        outside = self._ids_of(self._outside_groups())
        return torch.cat((super().get_all_free_pages(), self._parked, outside))  # type: ignore[misc]

    def _outside_groups(self) -> list[int]:
        """Groups whose free ids are in no list: unmapped, or being released."""
        state = self.groups.state
        return [i for i in range(self.num_groups) if state[i] in (UNMAPPED, RELEASING)]

    def clear(self) -> None:
        """SGLang's clear (every id free), over the groups mapped now."""
        super().clear()  # type: ignore[misc]
        self._empty_since.clear()
        state = self.groups.state
        self.free_pages = self._ids_of(i for i in range(self.num_groups) if state[i] == MAPPED)
        self._parked = self._ids_of(sorted(self._draining))
        self._outside = sum(self.group_len[i] for i in self._outside_groups())
        self._recount()

    def resize(self, config: Any) -> None:
        """Post-capture resizing: never reached (post-capture pools are not elastic), refused loudly if it were."""
        raise NotImplementedError("kvcached's elastic KV allocator cannot be resized (post-capture sizing)")

    # -- mapping ----------------------------------------------------------------------------

    def _ids_of(self, groups: Iterable[int]) -> Any:
        g = self.ids_per_group
        parts = [torch.arange(max(i * g, 1), max(i * g, 1) + self.group_len[i], dtype=torch.int64,
                              device=self.device) for i in groups if self.group_len[i] > 0]
        if not parts:
            return torch.empty((0,), dtype=torch.int64, device=self.device)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _recount(self) -> None:
        """What the limit still lets us add to the free list (0 while over it); after every change."""
        groups = self.groups
        allowed = groups.max_pages - groups.mapped_count
        if allowed < 0 or self.frozen:
            self._spare = 0
            return
        # Groups being released are mapped already: all of theirs come back, and `allowed` new ones on top.
        self._spare = groups.releasing_units + groups.spare_units(allowed, self.ids_per_group, releasing=False)

    def _grow(self, short: int) -> bool:
        """Add at least `short` ids to the free list: released groups taken back first, then new ones mapped."""
        if short > self._spare:
            return False
        # exact: the spare count promising more than there is would be a bug, but never a wrong mapping
        grown = self.groups.grow(short, exact=True)
        if grown is None:
            return False
        back, new = grown
        self._outside -= sum(self.group_len[i] for i in back) + sum(self.group_len[i] for i in new)
        self.free_pages = torch.cat((self.free_pages, self._ids_of(back + new)))
        self._recount()
        if new:
            self._publish(force=True)
        return True

    # -- the step boundary -------------------------------------------------------------------

    def attach(self, group: TPGroup | None, source: SegmentLimit | None = None, *, overlap: bool = False) -> None:
        """Join the TP group whose ranks must map the same pages; `overlap`: a batch may run past the boundary."""
        self.agreement = Agreement(group, source, (self.ids_per_group, self.num_groups, self.group_bytes))
        self.groups.segment = self.agreement.source  # rank 0 publishes the usage; the others have none
        solo = self.agreement.group is None and self.agreement.clock is monotonic_ns
        self._solo = self.agreement.source if solo else None
        self.lag = 1 if overlap else 0
        if not self.agreement.same_geometry():
            self._freeze("the TP ranks' KV pools are laid out differently")

    def step(self, idle: Callable[[], bool] = _never, tree_cache: Any = None) -> Agreed:
        """The step boundary (every TP rank, same order): follow the limit, release what no live id holds."""
        solo = self._solo
        if solo is not None:  # TP = 1: nothing to agree on, rank 0's own reads (Agreement.exchange, inlined)
            agreed = solo.read(), monotonic_ns(), bool(idle())
        else:
            if self.agreement is None:
                self.attach(None)
                return self.step(idle, tree_cache)
            agreed = self.agreement.exchange(idle)
        if self.frozen:
            return agreed
        limit, now, is_idle = agreed
        self.step_seq += 1
        # Every step pays for this method, and pays it cold: the scheduler's own work between two boundaries
        # leaves no cache warm (bench/bench_sglang.py). So the common step reads few attributes and calls
        # nothing it can skip: the same limit, nothing released, no review due.
        groups = self.groups
        if limit != groups.limit:
            self._apply_limit(limit)
        releasing = groups.releasing
        if releasing:
            self._release_due(is_idle)
        over = groups.mapped_count - len(releasing) > groups.max_pages
        if over and tree_cache is not None:
            self._evict_for_limit(tree_cache)
        if over or now >= self._review_at or self._draining or (is_idle and not self._was_idle):
            self._review(now, is_idle)
            self._release_due(is_idle)
            self._publish()
        self._was_idle = is_idle
        return agreed

    def _apply_limit(self, limit: int | None) -> None:
        if self.groups.set_limit(limit):
            self._recount()

    def _evict_for_limit(self, tree_cache: Any) -> None:
        """Over the limit: evict the prefix cache by the excess, so that draining groups can empty."""
        excess = self.groups.kept - self.groups.max_pages
        evictable = int(tree_cache.evictable_size())
        if excess > 0 and evictable > 0:
            tree_cache.evict(EvictParams(num_tokens=min(evictable, excess * self.ids_per_group * self.page_size)))

    def _group_mask(self, groups: Iterable[int]) -> Any:
        mask = torch.zeros(self.num_groups, dtype=torch.bool, device=self.device)
        idx = list(groups)
        if idx:
            mask[torch.tensor(idx, dtype=torch.int64, device=self.device)] = True
        return mask

    def _census(self) -> list[int]:
        """Free ids per group, in the free list and parked (one device sync on CUDA)."""
        ids = torch.cat((self.free_pages, self._parked)) if len(self._parked) else self.free_pages
        return torch.bincount(ids // self.ids_per_group, minlength=self.num_groups).tolist()

    def _review(self, now: int, idle: bool) -> None:
        """Release the groups that hold no live id and are due; drain the excess over the limit."""
        self._review_at = now + review_interval(self.release_delay_ns)
        if self._draining:
            self._park(self._draining)
        counts = self._census()
        state = self.groups.state
        empty_draining: list[int] = []
        for i in range(1, self.num_groups):  # group 0 holds the padding slot: always mapped
            st = state[i]
            if st in (MAPPED, DRAINING) and counts[i] == self.group_len[i]:
                if st == MAPPED:
                    self._empty_since.setdefault(i, now)
                else:
                    empty_draining.append(i)
            else:
                self._empty_since.pop(i, None)
        victims = empty_draining + due_for_release(self._empty_since, now, reserve=self.reserve,
                                                   delay=self.release_delay_ns, idle=idle,
                                                   over=self.groups.kept > self.groups.max_pages)
        if victims:
            self._release(victims)
        self._plan_drain()
        # Lowest ids first: live tokens gather in the low groups, the high ones empty and go.
        self.free_pages = torch.sort(self.free_pages).values
        self._recount()

    def _release(self, groups: list[int]) -> None:
        mask = self._group_mask(groups)
        g = self.ids_per_group
        self.free_pages = self.free_pages[~mask[self.free_pages // g]]
        if len(self._parked):
            self._parked = self._parked[~mask[self._parked // g]]
        self.groups.release(groups, self.step_seq)
        for i in groups:
            self._outside += self.group_len[i]
            self._empty_since.pop(i, None)
            self._draining.discard(i)

    def _plan_drain(self) -> None:
        """Keep the lowest groups the limit allows; the others take no new ids until they empty."""
        state = self.groups.state
        kept = [i for i in range(self.num_groups) if state[i] in (MAPPED, DRAINING)]
        excess = len(kept) - self.groups.max_pages
        drain = set(kept[::-1][:max(0, excess)]) - {0}
        back = self._draining - drain
        if back:
            mask = self._group_mask(back)
            moving = mask[self._parked // self.ids_per_group]
            self.free_pages = torch.cat((self.free_pages, self._parked[moving]))
            self._parked = self._parked[~moving]
            for i in back:
                state[i] = MAPPED
        for i in drain - self._draining:
            state[i] = DRAINING
            self._empty_since.pop(i, None)
        self._draining = drain
        if drain:
            self._park(drain)

    def _park(self, groups: Iterable[int]) -> None:
        mask = self._group_mask(groups)
        moving = mask[self.free_pages // self.ids_per_group]
        if bool(moving.any()):
            self._parked = torch.cat((self._parked, self.free_pages[moving]))
            self.free_pages = self.free_pages[~moving]

    def _release_due(self, idle: bool) -> None:
        """Unmap the released groups no batch in flight can touch (all of them when nothing runs)."""
        if self.groups.unmap_released(None if idle else self.step_seq - self.lag):
            self._recount()
            self._publish(force=True)

    def _freeze(self, why: str) -> None:
        """Stand aside at run time (on every rank alike): map every group for good, no limit."""
        outside = self._outside_groups()
        self.elastic_pool.stand_aside(why)
        self.frozen = True
        self.free_pages = torch.cat((self.free_pages, self._parked, self._ids_of(outside)))
        self._parked = self._parked[:0]
        self.groups.keep_all()
        self._draining = set()
        self._outside = 0
        self._empty_since.clear()
        self._recount()

    def _publish(self, force: bool = False) -> None:
        """Used and preallocated memory to the segment (rank 0): groups holding an id, and free mapped ones."""
        self.groups.publish(len(self._empty_since), force)

    # -- for checks ---------------------------------------------------------------------------

    def stats(self) -> ElasticStats:
        """A snapshot of the books."""
        buf = self.elastic_buf
        return ElasticStats(tuple(buf.mapped_groups()), tuple(sorted(self.groups.releasing)),
                            tuple(sorted(self._draining)),
                            self.max_groups, self.group_bytes, buf.mapped_bytes,
                            self.available_ids() * self.page_size, self.schedulable_size())


class ElasticTokenAllocator(_ElasticIds, TokenToKVPoolAllocator):
    """SGLang's page-size-1 allocator (token slots) over an elastic pool."""

    _plain = TokenToKVPoolAllocator
    _kvcache_position = 3  # (size, dtype, device, kvcache, need_sort)

    def __init__(self, size: int, dtype: Any, device: Any, kvcache: Any, need_sort: bool) -> None:
        self._elastic_setup(kvcache, size, 1, device)
        super().__init__(size, dtype, device, kvcache, need_sort)

    def _staged(self) -> int:
        return len(self.release_pages)

    def available_size(self) -> int:
        """Every free slot, mapped or not (SGLang's accounting identity counts them all)."""
        return self.available_ids()

    def alloc(self, need_size: int) -> Any:
        """SGLang's alloc; when the free list is short, groups are mapped first (None past the limit)."""
        free = self.free_pages
        if need_size <= len(free):
            self.free_pages = free[need_size:]
            return free[:need_size]
        if not self._grow(need_size - len(free)):
            return None
        return TokenToKVPoolAllocator.alloc(self, need_size)


class ElasticPagedAllocator(_ElasticIds, PagedTokenToKVPoolAllocator):
    """SGLang's paged allocator over an elastic pool."""

    _plain = PagedTokenToKVPoolAllocator
    _kvcache_position = 4  # (size, page_size, dtype, device, kvcache, need_sort)

    def __init__(self, size: int, page_size: int, dtype: Any, device: Any, kvcache: Any, need_sort: bool) -> None:
        self._elastic_setup(kvcache, size, page_size, device)
        super().__init__(size, page_size, dtype, device, kvcache, need_sort)

    def _staged(self) -> int:
        return int(self.num_staged_pages)

    def available_size(self) -> int:
        """Every free slot, mapped or not, in tokens."""
        return self.available_ids() * self.page_size

    def _ensure(self, pages: int) -> bool:
        short = pages - len(self.free_pages)
        return short <= 0 or self._grow(short)

    def alloc(self, need_size: int) -> Any:
        """SGLang's page-aligned alloc, groups mapped first when short."""
        if not self._ensure(need_size // self.page_size):
            return None
        return super().alloc(need_size)

    def alloc_extend(self, prefix_lens: Any, prefix_lens_cpu: Any, seq_lens: Any, seq_lens_cpu: Any,
                     last_loc: Any, extend_num_tokens: int, num_new_pages: int | None = None) -> Any:
        """SGLang's extend; when its bound on new pages exceeds the free list, the exact count is mapped first."""
        if extend_num_tokens // self.page_size + len(prefix_lens) + 1 > len(self.free_pages):
            if num_new_pages is None:
                num_new_pages = get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size,
                                                  prefix_lens=prefix_lens_cpu)
            if not self._ensure(int(num_new_pages)):
                return None
        return super().alloc_extend(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                                    extend_num_tokens, num_new_pages)

    def alloc_decode(self, seq_lens: Any, seq_lens_cpu: Any, last_loc: Any) -> Any:
        """SGLang's decode step, new pages mapped first when the free list may be short."""
        if len(seq_lens) > len(self.free_pages):
            need = get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size, decode=True)
            if not self._ensure(int(need)):
                return None
        return super().alloc_decode(seq_lens, seq_lens_cpu, last_loc)

