"""Which physical pages of a KV cache buffer each group of blocks needs: pure arithmetic.

An engine lays its KV cache out in one backing buffer, every layer's block
`b` at a fixed stride from block 0 (vLLM 0.33: ``offset + l * layer_stride +
b * block_stride``, with the heads, tokens and bytes of a block inside in
the layout's order). A `Footprint` records, per block stride, where block 0's
bytes lie (its *runs*); block `b`'s bytes are those runs shifted by
``b * stride``. The elastic pool maps memory for groups of consecutive blocks
(a *logical page*), and `PagePlan` says which physical pages of the buffer a
group needs.

Groups need not fall on page boundaries (a block of 73,728 bytes never
does): neighbouring groups may then share a physical page, so whoever maps
counts references per physical page (`kvcached.runtime.kvbuffer`). When the
strides allow it, `min_blocks_per_page` picks a group size whose groups own
their pages outright, so no page is shared and none is mapped for nothing.

No torch, no vLLM, no extension: the same plan is computed on both sides of
the engine/worker split and tested as tables.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

#: Above this many physical pages per run, an exact (page-owning) group size is
#: too coarse to be worth it, and groups share boundary pages instead.
MAX_EXACT_PAGES_PER_RUN = 4


def merge_runs(runs: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Sort (start, length) runs and merge those that overlap or touch."""
    out: list[list[int]] = []
    for start, length in sorted(r for r in runs if r[1] > 0):
        if out and start <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], start + length - out[-1][0])
        else:
            out.append([start, length])
    return tuple((s, n) for s, n in out)


@dataclass(frozen=True)
class Footprint:
    """Where block 0's bytes lie in a buffer of `size` bytes, per block stride; `num_blocks` blocks."""

    size: int
    num_blocks: int
    runs: Mapping[int, tuple[tuple[int, int], ...]]  # block stride -> merged runs of block 0

    @classmethod
    def build(cls, size: int, num_blocks: int, runs: Iterable[tuple[int, int, int]]) -> Footprint:
        """From (block_stride, start, length) triples, in any order, overlapping or not."""
        by_stride: dict[int, list[tuple[int, int]]] = {}
        for stride, start, length in runs:
            if stride <= 0 or start < 0 or length <= 0:
                raise ValueError(f"bad run: stride {stride}, start {start}, length {length}")
            by_stride.setdefault(stride, []).append((start, length))
        fp = cls(size, num_blocks, {s: merge_runs(r) for s, r in sorted(by_stride.items())})
        fp.check()
        return fp

    def check(self) -> None:
        """Raise ValueError unless every block's bytes lie inside the buffer."""
        if self.num_blocks <= 0 or not self.runs:
            raise ValueError("a footprint needs blocks and runs")
        last = self.num_blocks - 1
        for stride, runs in self.runs.items():
            end = runs[-1][0] + runs[-1][1] + last * stride
            if end > self.size:
                raise ValueError(f"block {last} ends at byte {end}, past the buffer's {self.size}")

    def to_dict(self) -> dict[str, object]:
        """JSON-ready (the worker protocol carries it)."""
        return {"size": self.size, "num_blocks": self.num_blocks,
                "runs": [[s, a, n] for s, runs in self.runs.items() for a, n in runs]}

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> Footprint:
        """Inverse of `to_dict`."""
        runs = d["runs"]
        assert isinstance(runs, list)
        return cls.build(int(d["size"]), int(d["num_blocks"]),  # type: ignore[call-overload]
                         ((int(s), int(a), int(n)) for s, a, n in runs))


def min_blocks_per_page(fp: Footprint, page_size: int) -> int:
    """The smallest group size whose groups own whole pages, unless that is too coarse.

    A group of G blocks shifts every run by ``G * stride``: when that is a
    multiple of the page size for every stride, group g's pages are group 0's
    pages shifted, and no two groups share one (given page-aligned runs).
    When that G would make each run span more than a few pages (odd strides,
    e.g. MLA's 576-byte rows), take the smallest G whose runs span a page
    instead, and let neighbours share boundary pages.
    """
    exact = 1
    for stride in fp.runs:
        exact = math.lcm(exact, page_size // math.gcd(page_size, stride))
    widest = max(fp.runs)
    if exact * widest <= MAX_EXACT_PAGES_PER_RUN * page_size:
        return exact
    return max(1, -(-page_size // widest))


def agree_blocks_per_page(minimums: Sequence[int]) -> int:
    """One group size for several workers: a common multiple when it stays small, else the largest."""
    g = 1
    for m in minimums:
        g = math.lcm(g, m)
    return g if g <= 4 * max(minimums) else max(minimums)


class PagePlan:
    """The physical pages (of `page_size` bytes) that each group of `blocks_per_page` blocks needs."""

    def __init__(self, fp: Footprint, page_size: int, blocks_per_page: int) -> None:
        if page_size <= 0 or blocks_per_page <= 0:
            raise ValueError("page_size and blocks_per_page must be positive")
        self.footprint = fp
        self.page_size = page_size
        self.blocks_per_page = blocks_per_page
        self.num_groups = -(-fp.num_blocks // blocks_per_page)
        self.num_pages = -(-fp.size // page_size)  # pages the buffer's range reserves
        # (stride, run start, run length), flattened once: pages_of() is on the map path.
        self._runs = [(s, a, n) for s, runs in fp.runs.items() for a, n in runs]

    def block_range(self, group: int) -> range:
        """The blocks of `group`."""
        self._check(group)
        g = self.blocks_per_page
        return range(group * g, min(self.footprint.num_blocks, (group + 1) * g))

    def group_of(self, block: int) -> int:
        """The group that holds `block`."""
        return block // self.blocks_per_page

    def pages_of(self, group: int) -> list[int]:
        """Physical pages group `group` needs, ascending."""
        return self.pages_of_blocks(self.block_range(group))

    def pages_of_blocks(self, blocks: range) -> list[int]:
        """Physical pages the consecutive `blocks` need, ascending."""
        if not blocks:
            return []
        first, last, ps = blocks[0], blocks[-1], self.page_size
        pages: set[int] = set()
        for stride, start, length in self._runs:
            lo = start + first * stride
            # The hull of the run over these blocks: a superset of their bytes when a run is
            # shorter than its stride, harmless since mapped pages are reference-counted.
            hi = start + last * stride + length
            pages.update(range(lo // ps, (hi - 1) // ps + 1))
        return sorted(pages)

    def max_pages_per_group(self) -> int:
        """The most physical pages any group needs: what mapping one group can cost."""
        if all((self.blocks_per_page * s) % self.page_size == 0 for s in self.footprint.runs):
            # Every group is group 0 shifted by whole pages; only the last may be smaller.
            return len(self.pages_of(0))
        return max(len(self.pages_of(g)) for g in range(self.num_groups))

    def _check(self, group: int) -> None:
        if not 0 <= group < self.num_groups:
            raise IndexError(f"group {group} out of range for {self.num_groups} groups")
