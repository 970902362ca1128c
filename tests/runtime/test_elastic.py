"""The elastic core's books over real pages (the extension's CPU backend), under a real limit segment."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import pytest

pytest.importorskip(
    "kvcached.runtime._kvpages",
    reason="kvcached.runtime._kvpages is not built (pip install -e . compiles it from csrc/)",
)

from kvcached.node.state.segment import create_segment, read_segment, write_segment  # noqa: E402
from kvcached.runtime.elastic import (  # noqa: E402
    DRAINING,
    MAPPED,
    RELEASING,
    UNMAPPED,
    ElasticPages,
    SegmentLimit,
    due_for_release,
    review_interval,
)
from kvcached.runtime.pages import Pages  # noqa: E402

from ..waiting import wait_for

pytestmark = pytest.mark.ext

PAGE = 64 * 1024
NUM = 8


class RangeLink:
    """Two real ranges (K and V, say) mapped in step, as the engines' links do; counts what it was asked."""

    def __init__(self, num: int = NUM) -> None:
        self.ranges = [Pages(num, PAGE), Pages(num, PAGE)]
        self.calls: list[tuple[str, list[int]]] = []

    def map(self, pages: Sequence[int]) -> None:
        self.calls.append(("map", list(pages)))
        done: list[Pages] = []
        try:
            for r in self.ranges:
                r.map(pages)  # the extension refuses a page mapped already, all or nothing per range
                done.append(r)
        except ValueError:
            for r in done:
                r.unmap(pages)
            raise

    def unmap(self, pages: Sequence[int]) -> None:
        self.calls.append(("unmap", list(pages)))
        for r in self.ranges:
            r.unmap(pages)

    def mapped(self) -> list[int]:
        got = [r.mapped_pages() for r in self.ranges]
        assert got[0] == got[1], got
        return got[0]

    def close(self) -> None:
        for r in self.ranges:
            r.close()


@pytest.fixture
def link():
    lk = RangeLink()
    yield lk
    lk.close()


@pytest.fixture
def seg(tmp_path):
    path = str(tmp_path / f"kve{os.getpid()}_seg")
    create_segment(path, NUM * PAGE)
    return path


def _book(link: RangeLink, mapped: Sequence[int] = (), sizes: Sequence[int] | None = None,
          segment: SegmentLimit | None = None) -> ElasticPages:
    if mapped:
        link.map(mapped)
    return ElasticPages(link, sizes or [4] * NUM, PAGE, mapped, segment=segment)


def test_grow_maps_the_lowest_pages_first_within_the_limit(link) -> None:
    book = _book(link, [0])
    assert book.set_limit(3 * PAGE) and book.max_pages == 3
    assert not book.set_limit(3 * PAGE + 1)  # the same pages allowed: nothing to recount
    assert book.grow(6) == ([], [1, 2])
    assert link.mapped() == [0, 1, 2] and book.mapped_count == 3
    assert book.grow(4) == ([], [])  # at the limit: nothing more, nothing mapped
    assert book.grow(4, exact=True) is None
    assert link.mapped() == [0, 1, 2] and book.mappable() == 0
    book.set_limit(None)
    assert book.max_pages == NUM and book.mappable() == NUM - 3
    assert book.mappable(inflight=2) == NUM - 5


def test_exact_grow_that_cannot_be_met_changes_nothing(link) -> None:
    book = _book(link, [0], sizes=[4, 4, 4, 1, 0, 0, 0, 0])  # pages past 3 hold nothing: never mapped
    assert book.unmapped == [1, 2, 3]
    assert book.grow(100, exact=True) is None
    assert link.mapped() == [0] and sorted(book.unmapped) == [1, 2, 3] and book.mapped_count == 1
    assert book.grow(100) == ([], [1, 2, 3])  # without exact: what there is
    assert book.mapped_pages() == [0, 1, 2, 3]


def test_a_failed_mapping_takes_no_page(link) -> None:
    book = _book(link, [0])
    link.ranges[1].map([2])  # page 2 taken behind the book's back: the second range refuses it
    with pytest.raises(ValueError):
        book.grow(8)
    assert link.ranges[0].mapped_pages() == [0] and link.ranges[1].mapped_pages() == [0, 2]  # rolled back
    assert sorted(book.unmapped) == list(range(1, NUM)) and book.mapped_count == 1
    assert bytes(book.state) == bytes([MAPPED] + [UNMAPPED] * (NUM - 1))
    link.ranges[1].unmap([2])
    assert book.grow(8) == ([], [1, 2]) and link.mapped() == [0, 1, 2]


def test_released_pages_stay_mapped_until_their_sequence_is_done(link) -> None:
    book = _book(link, [0, 1, 2, 3])
    book.release([3], seq=5)
    book.release([2], seq=7)
    assert book.state[2] == book.state[3] == RELEASING
    assert book.kept == 2 and book.mapped_count == 4 and book.releasing_units == 8
    assert book.unmap_released(4) == [] and link.mapped() == [0, 1, 2, 3]  # batch 5 may still write page 3
    assert book.unmap_released(6) == [3] and link.mapped() == [0, 1, 2]
    assert book.state[3] == UNMAPPED and book.mapped_count == 3 and book.releasing_units == 4
    assert book.unmap_released(None) == [2] and link.mapped() == [0, 1]  # idle: every one
    assert book.unmap_released(None) == [] and book.unmapped[0] == 2  # the heap hands the lowest out next


def test_grow_takes_released_pages_back_first_highest_first(link) -> None:
    book = _book(link, [0, 1, 2, 3])
    book.release([1, 2, 3], seq=1)
    calls = len(link.calls)
    assert book.grow(6) == ([3, 2], [])  # still mapped everywhere: no mapping at all
    assert len(link.calls) == calls and book.releasing == {1: 1} and book.kept == 3
    assert book.grow(8) == ([1], [4])  # then the lowest unmapped page
    assert link.mapped() == [0, 1, 2, 3, 4] and book.releasing_units == 0


def test_taking_back_respects_a_lowered_limit(link) -> None:
    book = _book(link, [0, 1, 2, 3])
    book.release([2, 3], seq=1)
    book.set_limit(3 * PAGE)  # 2 kept, 2 releasing: one more may be kept
    assert book.grow(8) == ([3], [])
    assert book.kept == 3 and book.releasing == {2: 1}


def test_the_harness_side_maps_apart_and_unmaps_at_once(link) -> None:
    book = _book(link)
    pages = book.take_lowest(2)  # mapped outside the pool's lock
    assert pages == [0, 1] and book.mappable(inflight=2) == NUM - 2  # out of the heap, counted once
    link.map(pages)
    book.mark_mapped(pages)
    assert book.map_lowest(1) == [2] and link.mapped() == [0, 1, 2]
    book.unmap_now([1])
    assert link.mapped() == [0, 2] and book.mapped_count == 2 and book.unmapped[0] == 1
    back = book.take_lowest(1)
    book.put_back(back)
    assert book.unmapped[0] == 1


def test_keep_all_and_forget_all(link) -> None:
    book = _book(link, [0])
    book.set_limit(2 * PAGE)
    book.state[0] = DRAINING
    link.map(list(range(1, NUM)))  # what standing aside does: every page mapped for good
    book.keep_all()
    assert book.mapped_pages() == list(range(NUM)) and book.max_pages == NUM and book.limit is None
    assert book.unmapped == [] and book.grow(4) == ([], [])
    link.unmap(list(range(NUM)))
    book.forget_all()
    assert book.mapped_count == 0 and sorted(book.unmapped) == list(range(NUM))


def test_usage_is_published_from_the_books(link, seg) -> None:
    segment = SegmentLimit(seg)
    book = _book(link, [0, 1, 2], segment=segment)
    assert segment.read() == NUM * PAGE
    book.release([2], seq=0)
    assert book.usage(idle_pages=1) == (1 * PAGE, 2 * PAGE)  # page 0 used; 1 idle, 2 releasing
    book.publish(idle_pages=1)
    info = read_segment(seg)
    assert (info.used, info.prealloc) == (PAGE, 2 * PAGE)
    write_segment(seg, used=0, prealloc=0)  # someone else wrote it: unchanged books are not written again
    book.publish(idle_pages=1)
    assert read_segment(seg).used == 0
    book.publish(idle_pages=1, force=True)
    assert read_segment(seg).used == PAGE
    assert book.mapped_bytes == 3 * PAGE
    segment.close()


def test_publishing_waits_for_the_interval_unless_forced(seg) -> None:
    segment = SegmentLimit(seg, interval=3600.0)
    segment.publish(1, 2)  # nothing read yet: no segment is known to write to
    assert read_segment(seg).used == 0 and not segment.watching
    assert segment.read() == NUM * PAGE and segment.watching
    segment.publish(1, 2)
    assert (read_segment(seg).used, read_segment(seg).prealloc) == (1, 2)
    segment.publish(3, 4)  # within the interval: left for a forced publish
    assert read_segment(seg).used == 1
    segment.publish(3, 4, force=True)
    assert read_segment(seg).used == 3
    segment.close()


def test_the_limit_follows_the_segment_and_warns_once_per_outage(tmp_path, caplog) -> None:
    path = str(tmp_path / f"kve{os.getpid()}_late")
    where: list[str | None] = [None]
    segment = SegmentLimit(locate=lambda: where[0], fallback="the test's fallback")
    assert segment.read() is None  # nothing to look at yet
    where[0] = path
    with caplog.at_level(logging.WARNING, logger="kvcached.runtime.elastic"):
        assert segment.read() is None and segment.read() is None
        create_segment(path, 4096)
        assert segment.read() == 4096
        write_segment(path, total=8192)
        assert segment.read() == 8192  # kvctl limit, seen at the next read
        os.unlink(path)
        wait_for(lambda: segment.read() is None)  # seen gone at the watch's next look at the path
    warned = [r.getMessage() for r in caplog.records if "no limit segment" in r.getMessage()]
    assert len(warned) == 2 and all("the test's fallback" in w for w in warned), warned
    segment.close()
    segment.close()


@pytest.mark.parametrize(("since", "now", "reserve", "idle", "over", "due"), [
    ({}, 10, 1, False, False, []),
    ({3: 0, 1: 0, 2: 9}, 10, 1, False, False, [3]),        # 1 is the reserve; 2 idle too briefly
    ({3: 0, 1: 0, 2: 9}, 10, 1, True, False, [2, 3]),      # idle engine: no delay, the reserve stays
    ({3: 0, 1: 0, 2: 9}, 10, 1, False, True, [1, 2, 3]),   # over the limit: every idle page, the reserve too
    ({3: 0, 1: 0, 2: 9}, 10, 0, False, False, [1, 3]),
    ({5: 0}, 4, 1, False, False, []),
])
def test_due_for_release(since, now, reserve, idle, over, due) -> None:
    assert due_for_release(since, now, reserve=reserve, delay=5, idle=idle, over=over) == due


def test_review_interval_is_a_quarter_of_the_delay_in_the_delays_own_unit() -> None:
    assert review_interval(1.0) == 0.25 and isinstance(review_interval(1.0), float)  # vLLM: seconds
    assert review_interval(10**9 + 3) == 250_000_000 and isinstance(review_interval(10**9), int)  # SGLang: ns


def test_spare_units_count_whole_pages_and_the_last_one_short_only_while_it_could_come(link) -> None:
    # Pages of 4 units, the last holding 1: what vLLM's block pool has for a cache of 29 blocks.
    book = _book(link, [0, 1], sizes=[4] * (NUM - 1) + [1])
    assert book.last == NUM - 1
    assert book.spare_units(2, 4, releasing=False) == 8 - 3  # the last page could be among the 2: count it short
    assert book.spare_units(99, 4, releasing=False) == 6 * 4 - 3  # at most the 6 unmapped pages
    assert book.spare_units(0, 4, releasing=False) == 0 and book.spare_units(-1, 4, releasing=False) == 0
    assert book.grow(6 * 4 - 3, exact=True) == ([], [2, 3, 4, 5, 6, 7])
    assert book.spare_units(3, 4, releasing=False) == 0  # nothing unmapped is left
    book.release([7, 6], seq=1)
    # Pages being released come back first (vLLM counts them): 6 whole, and the last, short while it is one.
    assert book.spare_units(2, 4, releasing=True) == 8 - 3
    assert book.spare_units(2, 4, releasing=False) == 0  # SGLang counts releasing units apart: none unmapped
    book.unmap_released(1)
    assert book.spare_units(1, 4, releasing=False) == 4 - 3  # the last page is unmapped again: still short


def test_spare_units_of_a_range_whose_first_page_holds_fewer(link) -> None:
    # SGLang's groups: the first holds one id fewer (its padding slot), the last is short, past it none.
    book = _book(link, [0], sizes=[3, 4, 4, 2, 0, 0, 0, 0])
    assert book.last == 3
    assert book.spare_units(2, 4, releasing=False) == 8 - 2  # the short last page is among what could come
    assert book.spare_units(3, 4, releasing=False) == 4 + 4 + 2  # every unmapped page holding units: exact
    assert sorted(book.unmapped) == [1, 2, 3]  # pages holding no unit are never offered
