"""What the TP ranks of one SGLang serve agree on at each step boundary, and where rank 0 reads the limit.

Every TP rank's scheduler runs the same loop on the same broadcast requests,
so every rank's allocator makes the same alloc and free calls. What could
still tell them apart is what each would read for itself: the segment's
limit (written by `kvctl limit` at any moment) and the clock (the release
delay). So at each step boundary TP rank 0 alone reads the limit (a load
from the mapped segment, `LimitWatch`) and its clock, and broadcasts them, with whether its
scheduler is idle, on the TP group's CPU (gloo) group, the group SGLang
broadcasts its requests on; every rank then decides from the same three
numbers and its own, identical, allocator state. The first exchange also
checks that every rank laid its pool out the same way (ids per group, groups,
bytes per group): ranks that differ cannot map the same pages, and the
allocator then stands aside on every rank alike.

No SGLang import here: torch.distributed only, imported by `Agreement`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ...runtime.elastic import SegmentLimit
from ..engine_elastic import segment_limit

log = logging.getLogger(__name__)


# What every rank decides a step from: (the limit in bytes per rank, None while no segment can be read;
# rank 0's monotonic clock in ns; whether rank 0's scheduler has nothing queued, running or in flight).
# A plain tuple: it is built at every step, and a NamedTuple's __new__ is one more Python frame there.
Agreed = tuple[int | None, int, bool]


class TPGroup(Protocol):
    """The TP group as SGLang's GroupCoordinator presents it (what `Agreement` uses of it)."""

    cpu_group: Any
    ranks: list[int]
    rank_in_group: int
    world_size: int


def _rank_segment() -> str | None:
    """This DP rank's segment: the one its rank 0 claimed (its usage handed over to the allocator, which knows the
    mapped pages), else the rank's by name, picked up once it exists."""
    from ..engine_elastic import segment_to_follow, take_over_usage
    from .common import engine_name

    try:
        from sglang.srt.runtime_context import get_parallel

        dp_rank = get_parallel().dp_rank
    except Exception:  # outside a scheduler (tests, tools): no DP rank
        dp_rank = None
    path = segment_to_follow(engine_name(None if dp_rank is None else int(dp_rank)))
    take_over_usage()
    return path


def limit_source(path: str | None = None, *, locate: Callable[[], str | None] = _rank_segment) -> SegmentLimit:
    """Rank 0's segment (the elastic core's `SegmentLimit`): the limit once per step, and the usage it publishes.

    `path` None: this DP rank's segment (`locate`), looked up again at each
    read until one can be opened; until then there is no limit but SGLang's
    own capacity.
    """
    return segment_limit(path, locate=locate, fallback="SGLang's capacity is the only limit", logger=log)


class Agreement:
    """One rank's side of the step boundary's exchange (TP = 1: no group, nothing is sent)."""

    def __init__(self, group: TPGroup | None, source: SegmentLimit | None, geometry: Sequence[int],
                 clock: Callable[[], int] = time.monotonic_ns) -> None:
        self.group = group if group is not None and group.world_size > 1 else None
        self.rank = 0 if self.group is None else self.group.rank_in_group
        if self.rank == 0 and source is None:
            source = limit_source()
        self.source = source if self.rank == 0 else None
        self.geometry = tuple(int(g) for g in geometry)
        self.clock = clock
        self._same: bool | None = True if self.group is None else None

    def exchange(self, idle: Callable[[], bool]) -> Agreed:
        """Rank 0's limit, clock and idleness, on every rank; `idle` is called on rank 0 only."""
        source = self.source
        if self.group is None:
            assert source is not None
            return source.read(), self.clock(), bool(idle())
        import torch
        import torch.distributed as dist

        limit = source.read() if source is not None else None
        mine = [-1, 0, 0] if self.rank != 0 else [-1 if limit is None else limit, self.clock(), int(bool(idle()))]
        values = torch.tensor(mine, dtype=torch.int64)
        dist.broadcast(values, src=self.group.ranks[0], group=self.group.cpu_group)
        limit, clock_ns, flag = (int(v) for v in values.tolist())
        return None if limit < 0 else limit, clock_ns, bool(flag)

    def same_geometry(self) -> bool:
        """Whether every rank laid its pool out as this one did (asked once, on the first boundary)."""
        if self._same is not None:
            return self._same
        import torch
        import torch.distributed as dist

        assert self.group is not None
        mine = torch.tensor(self.geometry, dtype=torch.int64)
        got = [torch.zeros_like(mine) for _ in range(self.group.world_size)]
        dist.all_gather(got, mine, group=self.group.cpu_group)
        layouts = {tuple(int(v) for v in g.tolist()) for g in got}
        self._same = len(layouts) == 1
        if not self._same:
            log.warning("kvcached: the TP ranks laid their KV pools out differently (%s)", sorted(layouts))
        return self._same
