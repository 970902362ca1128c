"""The elastic KV pool over real pages, under a real limit segment."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading

import pytest

pytest.importorskip(
    "kvcached.runtime._kvpages",
    reason="kvcached.runtime._kvpages is not built (pip install -e . compiles it from csrc/)",
)

from kvcached.node.state.segment import create_segment, read_segment  # noqa: E402
from kvcached.runtime.pool import (  # noqa: E402
    Geometry,
    KVPool,
    LocalMapper,
    PoolExhausted,
)

from ..waiting import wait_for

pytestmark = pytest.mark.ext

PAGE = 64 * 1024
BLOCK = 16 * 1024            # 4 blocks per page
GEO = Geometry(num_pages=8, page_size=PAGE, num_tensors=2)
PB = GEO.page_bytes          # 128 KiB per page index (2 tensors)


@pytest.fixture
def seg(tmp_path):
    path = str(tmp_path / f"kvp{os.getpid()}_seg")
    create_segment(path, 5 * PB)
    return path


@pytest.fixture
def mapper():
    m = LocalMapper(GEO)
    yield m
    m.close()


def _set_limit_from_another_process(path: str, total: int) -> None:
    """What `kvctl limit` does: another process rewrites total under the segment lock."""
    code = ("import sys; from kvcached.node.state.segment import write_segment; "
                "write_segment(sys.argv[1], total=int(sys.argv[2]))")
    subprocess.run([sys.executable, "-c", code, path, str(total)], check=True, timeout=30)


def _assert_consistent(pool: KVPool, mapper: LocalMapper, seg: str) -> None:
    st = pool.stats()
    info = read_segment(seg)
    assert (info.used, info.prealloc) == (st.used_bytes, st.prealloc_bytes)
    assert st.mapped_pages * PB == st.used_bytes + st.prealloc_bytes
    for r in mapper.ranges:
        assert r.mapped_pages() == pool.mapped_pages()


def test_allocates_up_to_the_limit_then_reports_exhaustion(seg, mapper):
    with KVPool(mapper, GEO, BLOCK, segment_path=seg) as pool:
        blocks = pool.alloc(20)  # 5 pages × 4 blocks: exactly the limit
        assert sorted(blocks) == list(range(20))
        assert pool.mapped_pages() == [0, 1, 2, 3, 4]
        assert pool.available_blocks() == 0
        with pytest.raises(PoolExhausted, match="pool exhausted") as info:
            pool.alloc(1)
        assert f"limit {5 * PB} bytes" in str(info.value)
        assert pool.mapped_pages() == [0, 1, 2, 3, 4]  # never mapped past the limit
        _assert_consistent(pool, mapper, seg)
        assert read_segment(seg).used == 5 * PB


def test_allocation_is_all_or_nothing(seg, mapper):
    with KVPool(mapper, GEO, BLOCK, segment_path=seg) as pool:
        pool.alloc(18)
        with pytest.raises(PoolExhausted):
            pool.alloc(3)
        assert pool.stats().used_blocks == 18
        assert len(pool.alloc(2)) == 2


def test_exhaustion_without_a_segment_is_the_range(mapper):
    with KVPool(mapper, GEO, BLOCK) as pool:
        pool.alloc(GEO.num_pages * 4)
        with pytest.raises(PoolExhausted, match="0 more pages mappable"):
            pool.alloc(1)


def test_pages_are_mapped_on_demand_and_unmapped_when_empty(seg, mapper):
    with KVPool(mapper, GEO, BLOCK, segment_path=seg) as pool:
        assert pool.mapped_pages() == []
        a = pool.alloc(1)
        assert pool.mapped_pages() == [0]
        b = pool.alloc(3)  # fills page 0 before mapping another
        assert pool.mapped_pages() == [0]
        c = pool.alloc(1)
        assert pool.mapped_pages() == [0, 1]
        pool.free(c)
        assert pool.mapped_pages() == [0]
        pool.free(a + b)
        assert pool.mapped_pages() == []
        assert all(r.num_mapped == 0 for r in mapper.ranges)
        _assert_consistent(pool, mapper, seg)


def test_block_data_lives_in_the_mapped_page(mapper):
    with KVPool(mapper, GEO, BLOCK) as pool:
        (blk,) = pool.alloc(1)
        off = pool.block_offset(blk)
        view = mapper.ranges[1].buffer()
        view[off : off + 4] = b"kvkv"
        assert bytes(view[off : off + 4]) == b"kvkv"
        view.release()


def test_lowering_the_limit_releases_free_pages_within_one_step(seg, mapper):
    with KVPool(mapper, GEO, BLOCK, segment_path=seg, prealloc_pages=3, publish_interval=0) as pool:
        used = pool.alloc(6)  # pages 0, 1 in use
        pool.step()  # pre-maps 3 free pages: 5 mapped = the limit
        assert pool.stats().prealloc_pages == 3
        assert pool.mapped_pages() == [0, 1, 2, 3, 4]
        _assert_consistent(pool, mapper, seg)

        _set_limit_from_another_process(seg, 3 * PB)
        st = pool.step()
        assert st.limit == 3 * PB
        assert st.mapped_pages == 3 and st.used_pages == 2 and st.prealloc_pages == 1
        assert all(r.num_mapped == 3 for r in mapper.ranges)
        _assert_consistent(pool, mapper, seg)

        # Below what is in use: every free page goes, used pages stay, nothing new maps.
        _set_limit_from_another_process(seg, 1 * PB)
        st = pool.step()
        assert st.mapped_pages == 2 and st.prealloc_pages == 0
        with pytest.raises(PoolExhausted):
            pool.alloc(3)
        pool.free(used[4:])  # page 1 empties: over the limit, so unmapped
        assert pool.mapped_pages() == [0]
        _assert_consistent(pool, mapper, seg)


def test_raising_the_limit_is_seen_by_the_next_allocation(seg, mapper):
    with KVPool(mapper, GEO, BLOCK, segment_path=seg) as pool:
        pool.alloc(20)
        _set_limit_from_another_process(seg, 8 * PB)
        assert len(pool.alloc(12)) == 12
        assert pool.stats().mapped_pages == 8


def test_background_thread_premaps_and_follows_the_limit(seg, mapper):
    with KVPool(mapper, GEO, BLOCK, segment_path=seg, prealloc_pages=2, step_interval=0.05) as pool:
        wait_for(lambda: pool.stats().prealloc_pages == 2)
        pool.alloc(4)  # takes a pre-mapped page; the thread tops up
        wait_for(lambda: pool.stats().prealloc_pages == 2 and pool.stats().mapped_pages == 3)
        _set_limit_from_another_process(seg, 2 * PB)
        wait_for(lambda: pool.stats().mapped_pages == 2, timeout=3.0)
        _assert_consistent(pool, mapper, seg)


@pytest.mark.parametrize("publish_interval", [0.0, 60.0])
def test_used_and_prealloc_in_the_segment_match_the_pool(seg, mapper, publish_interval):
    rnd = random.Random(5)
    live: list[int] = []
    with KVPool(mapper, GEO, BLOCK, segment_path=seg, prealloc_pages=1, publish_interval=publish_interval) as pool:
        for i in range(300):
            if live and (rnd.random() < 0.45 or pool.available_blocks() == 0):
                k = rnd.randint(1, len(live))
                rnd.shuffle(live)
                pool.free(live[:k])
                del live[:k]
            else:
                live += pool.alloc(rnd.randint(1, min(6, pool.available_blocks())))
            if i % 50 == 0:
                pool.step()
            assert pool.stats().used_blocks == len(live)
            if publish_interval == 0:
                _assert_consistent(pool, mapper, seg)
            else:
                # The mapped total is published with every map and unmap; the
                # used/prealloc split may lag until the next step.
                info, st = read_segment(seg), pool.stats()
                assert info.used + info.prealloc == st.mapped_bytes
                pool.step()
                _assert_consistent(pool, mapper, seg)
    info = read_segment(seg)
    assert (info.used, info.prealloc) == (0, 0)
    assert all(r.num_mapped == 0 for r in mapper.ranges)


def test_bad_frees_raise(mapper):
    with KVPool(mapper, GEO, BLOCK) as pool:
        (b,) = pool.alloc(1)
        with pytest.raises(IndexError):
            pool.free([GEO.num_pages * 4])
        with pytest.raises(ValueError, match="more than once"):
            pool.free([b, b])
        with pytest.raises(IndexError):
            pool.free([b, -1])
        assert pool.stats().used_blocks == 1  # all or nothing: b is still allocated
        pool.free([b])
        with pytest.raises(ValueError, match="not allocated"):
            pool.free([b])


def test_bad_configuration_raises(mapper):
    with pytest.raises(ValueError):
        KVPool(mapper, GEO, PAGE + 1)
    with pytest.raises(ValueError):
        Geometry(num_pages=0)


def test_close_unmaps_everything_and_publishes_zero(seg, mapper):
    pool = KVPool(mapper, GEO, BLOCK, segment_path=seg, prealloc_pages=1)
    pool.alloc(5)
    pool.step()
    assert read_segment(seg).used > 0 and read_segment(seg).prealloc > 0
    pool.close()
    pool.close()
    info = read_segment(seg)
    assert (info.used, info.prealloc) == (0, 0)
    assert all(r.num_mapped == 0 for r in mapper.ranges)


def test_threads_and_background_premapping_keep_the_books(seg, mapper):
    errors: list[BaseException] = []
    with KVPool(
        mapper, GEO, BLOCK, segment_path=seg, prealloc_pages=2, step_interval=0.005, publish_interval=0
    ) as pool:

        def churn(seed: int) -> None:
            rnd = random.Random(seed)
            held: list[int] = []
            try:
                for _ in range(300):
                    if held and rnd.random() < 0.5:
                        pool.free([held.pop(rnd.randrange(len(held)))])
                    else:
                        try:
                            held += pool.alloc(rnd.randint(1, 3))
                        except PoolExhausted:
                            pass
                    assert all(r.num_mapped <= 5 for r in mapper.ranges)  # never past the limit
                pool.free(held)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=churn, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        # Quiescent once the reserve is back to 2 pages and no background mapping is in flight: pages it
        # maps outside the lock are in the mapper before they are in the books (a busy machine catches that).
        def quiescent() -> bool:
            with pool._lock:
                return pool.stats().prealloc_pages == 2 and pool._inflight == 0

        wait_for(quiescent)
        st = pool.step()
        assert st.used_blocks == 0 and st.used_pages == 0 and st.mapped_pages == 2
        _assert_consistent(pool, mapper, seg)
