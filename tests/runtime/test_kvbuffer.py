"""A worker's elastic KV buffer over real memfd pages, and the engine's links to it."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "kvcached.runtime._kvpages",
    reason="kvcached.runtime._kvpages is not built (pip install -e . compiles it from csrc/)",
)

from kvcached.runtime.ipc.listener import WorkerListener  # noqa: E402
from kvcached.runtime.ipc.protocol import CMD_INFO  # noqa: E402
from kvcached.runtime.kvbuffer import KVBuffer, LocalLink, SocketLink  # noqa: E402
from kvcached.runtime.kvplan import Footprint  # noqa: E402
from kvcached.runtime.pool import MapError  # noqa: E402

pytestmark = pytest.mark.ext

P = 64 * 1024


def layer_outer(layers: int = 2, blocks: int = 64, page: int = 8 * 1024) -> Footprint:
    region = blocks * page
    return Footprint.build(layers * region, blocks, [(page, layer * region, page) for layer in range(layers)])


def odd_rows() -> Footprint:
    """Rows of 18,432 bytes: groups of 4 blocks share boundary pages."""
    return Footprint.build(2 * 40 * 18_432, 40, [(18_432, layer * 40 * 18_432, 18_432) for layer in range(2)])


@pytest.fixture
def buf():
    b = KVBuffer(layer_outer(), P)
    yield b
    b.pages.close()


def test_block_zero_is_mapped_from_the_start_and_nothing_else(buf) -> None:
    assert buf.pages.mapped_pages() == buf.plan.pages_of_blocks(range(0, 1)) == [0, 8]
    with pytest.raises(ValueError, match="not configured"):
        buf.map_groups([1])
    r = buf.configure(8)
    assert r == {"pages_per_group": 2, "num_groups": 8, "mapped_groups": [0]}
    assert buf.pages.mapped_pages() == [0, 8]  # group 0 took over block 0's pages
    with pytest.raises(ValueError, match="already configured"):
        buf.configure(16)


def test_groups_map_all_or_nothing_and_the_data_is_theirs(buf) -> None:
    buf.configure(8)
    buf.map_groups([2, 5])
    assert buf.mapped_groups() == [0, 2, 5] and buf.mapped_bytes == 6 * P
    view = buf.pages.buffer()
    view[2 * P:2 * P + 4] = b"kvkv"           # layer 0, group 2
    assert bytes(view[2 * P:2 * P + 4]) == b"kvkv"
    view.release()
    for bad in ([2], [3, 3], [9]):
        with pytest.raises((ValueError, IndexError)):
            buf.map_groups(bad)
    assert buf.mapped_groups() == [0, 2, 5] and buf.mapped_bytes == 6 * P
    with pytest.raises(ValueError, match="not mapped"):
        buf.unmap_groups([3])
    buf.unmap_groups([2])
    buf.map_groups([2])
    view = buf.pages.buffer()
    assert bytes(view[2 * P:2 * P + 4]) == b"\0\0\0\0"  # a page mapped again reads as zeros
    view.release()


def test_shared_pages_are_counted_per_reference() -> None:
    b = KVBuffer(odd_rows(), P)
    try:
        b.configure(4)
        shared = set(b.plan.pages_of(1)) & set(b.plan.pages_of(2))
        assert shared
        b.map_groups([1, 2])
        b.unmap_groups([1])
        assert shared <= set(b.pages.mapped_pages())  # group 2 still needs it
        b.unmap_groups([2])
        assert not shared & set(b.pages.mapped_pages()) - set(b.plan.pages_of(0))
    finally:
        b.pages.close()


def test_local_link_turns_errors_into_map_errors(buf) -> None:
    link = LocalLink(buf)
    agreed = link.setup(64)
    assert (agreed.blocks_per_page, agreed.pages_per_group, agreed.group_bytes) == (8, 2, 2 * P)
    with pytest.raises(MapError, match="mapped already"):
        link.map([0])
    with pytest.raises(MapError, match="engine 65"):
        LocalLink(KVBuffer(layer_outer(), P)).setup(65)


def test_socket_link_reaches_workers_and_agrees_one_geometry(layout, uniq) -> None:
    bufs = [KVBuffer(layer_outer(), P), KVBuffer(layer_outer(), P)]
    listeners = [WorkerListener(layout, uniq, rank) for rank in range(2)]
    try:
        for b, lst in zip(bufs, listeners):
            b.register(lst)
            lst.start()
        link = SocketLink(layout, uniq, 2, page_size=P)
        agreed = link.setup(64)
        assert agreed.mapped_groups == (0,)
        link.map([3, 4])
        assert list(link.mapped().values()) == [[0, 3, 4], [0, 3, 4]]
        assert [b.mapped_bytes for b in bufs] == [6 * P, 6 * P]
        link.unmap([3])
        assert [b.mapped_groups() for b in bufs] == [[0, 4], [0, 4]]
        # Rank 1 cannot map group 5 (it has it already): rank 0 must not keep it either.
        bufs[1].map_groups([5])
        with pytest.raises(MapError, match="mapped already"):
            link.map([5])
        assert bufs[0].mapped_groups() == [0, 4]
        # A worker that kept vLLM's allocation says so, and the engine hears why.
        listeners[1].register(CMD_INFO, lambda _a: {"elastic": False, "why": "host-resident tensors"})
        with pytest.raises(MapError, match="not elastic.*host-resident"):
            SocketLink(layout, uniq, 2, page_size=P).setup(64)
        bufs[1].register(listeners[1])
        with pytest.raises(MapError, match="page sizes"):
            SocketLink(layout, uniq, 2, page_size=2 * P).setup(64)
    finally:
        for lst in listeners:
            lst.stop()
        for b in bufs:
            b.pages.close()
