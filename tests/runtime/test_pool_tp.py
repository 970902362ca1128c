"""TP = 2 across real processes: the owner's pool maps the same pages in both workers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import pytest

pytest.importorskip(
    "kvcached.runtime._kvpages",
    reason="kvcached.runtime._kvpages is not built (pip install -e . compiles it from csrc/)",
)

from kvcached.node.base.layout import Layout  # noqa: E402
from kvcached.node.state.segment import create_segment, read_segment  # noqa: E402
from kvcached.runtime.ipc.client import Client  # noqa: E402
from kvcached.runtime.pool import (  # noqa: E402
    BroadcastMapper,
    Geometry,
    KVPool,
    MapError,
    PoolExhausted,
    start_engine_pool,
)

from ..waiting import wait_for  # noqa: E402

pytestmark = pytest.mark.ext

PAGE = 256 * 1024
BLOCK = 64 * 1024
GEO = Geometry(num_pages=16, page_size=PAGE, num_tensors=2)


def _rss_shmem_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1])
    raise AssertionError("no RssShmem")


@pytest.fixture
def layout():
    # Short root: socket paths must stay under 108 bytes.
    root = tempfile.mkdtemp(prefix="kvp")
    os.makedirs(os.path.join(root, "tmp"))
    os.makedirs(os.path.join(root, "dev", "shm"))
    yield Layout(root)
    shutil.rmtree(root, ignore_errors=True)


_WORKER = """
import signal, sys
from kvcached.runtime.ipc.listener import WorkerListener
from kvcached.node.base.layout import Layout
from kvcached.runtime.pool import attach_worker
root, name, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
listener = WorkerListener(Layout(root), name, rank)
attach_worker(listener)
listener.start()
signal.signal(signal.SIGTERM, lambda *_: (listener.stop(), sys.exit(0)))
print("ready", flush=True)
while True:
    signal.pause()
"""


@dataclass
class Workers:
    name: str
    pids: list[int]
    segment: str


@pytest.fixture
def workers(layout):
    """Two TP worker processes serving the pool commands, and the deployment's segment."""
    name = f"t{os.getpid()}_pooltp"
    seg = layout.segment_path(name)
    create_segment(seg, 6 * GEO.page_bytes)
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, layout.root, name, str(rank)],
                              stdout=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        yield Workers(name, [p.pid for p in procs], seg)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)


def test_tp2_workers_map_the_same_pages(workers, layout):
    name, seg = workers.name, workers.segment   # limit: 6 pages
    mapper = BroadcastMapper(layout, name, tp_size=2, page_size=PAGE)
    mapper.create(GEO)
    base = [_rss_shmem_kib(p) for p in workers.pids]

    with KVPool(mapper, GEO, BLOCK, segment_path=seg) as pool:
        blocks = pool.alloc(10)            # 4 blocks per page: pages 0, 1, 2
        assert pool.mapped_pages() == [0, 1, 2]
        by_worker = mapper.mapped_pages()
        assert list(by_worker.values()) == [[0, 1, 2], [0, 1, 2]]
        # Each worker really holds the memory: 3 pages in each of its 2 tensors.
        grown = [_rss_shmem_kib(p) - b for p, b in zip(workers.pids, base)]
        assert all(g >= 3 * GEO.page_bytes // 1024 * 0.95 for g in grown), grown

        pool.free(blocks[:4])              # page 0 empties and is unmapped everywhere
        assert list(mapper.mapped_pages().values()) == [[1, 2], [1, 2]]

        pool.alloc(4 * 4 + 2)              # up to the limit of 6 pages
        with pytest.raises(PoolExhausted):
            pool.alloc(4)
        assert list(mapper.mapped_pages().values()) == [pool.mapped_pages()] * 2
        assert read_segment(seg).used == 6 * GEO.page_bytes

    assert list(mapper.mapped_pages().values()) == [[], []]


def test_worker_failure_rolls_back_the_others(workers, layout):
    mapper = BroadcastMapper(layout, workers.name, tp_size=2, page_size=PAGE)
    mapper.create(GEO)
    # Rank 1 already has page 3 mapped: mapping it again fails there, and rank 0
    # must not be left with a page the pool does not know about.
    Client(mapper.paths[1]).call("map_to_kv_tensors", offsets=[3 * PAGE], group_id=0)
    with pytest.raises(MapError, match="already mapped"):
        mapper.map([3])
    assert mapper.mapped_pages() == {mapper.paths[0]: [], mapper.paths[1]: [3]}


def test_mismatched_geometry_is_refused(workers, layout):
    mapper = BroadcastMapper(layout, workers.name, tp_size=2, page_size=PAGE)
    mapper.create(GEO)
    mapper.create(GEO)                     # idempotent
    with pytest.raises(MapError, match="KV tensors exist"):
        mapper.create(Geometry(num_pages=4, page_size=PAGE, num_tensors=2))


def test_engine_pool_follows_kvctl_limit_across_workers(workers, layout):
    pool = start_engine_pool(layout, workers.name, 2, page_size=PAGE, block_size=BLOCK, min_pages=16,
                             fill_pages=2, prealloc_pages=2, step_interval=0.05)
    pb = pool.geometry.page_bytes
    mapper = pool.mapper
    assert isinstance(mapper, BroadcastMapper)
    try:
        wait_for(lambda: read_segment(workers.segment).prealloc == 2 * pb)
        assert read_segment(workers.segment).used == 2 * pb
        assert list(mapper.mapped_pages().values()) == [pool.mapped_pages()] * 2
        assert len(pool.mapped_pages()) == 4

        # `kvctl limit` from another process: the background step releases the reserve.
        code = ("import sys; from kvcached.node.state.segment import write_segment; "
                "write_segment(sys.argv[1], total=int(sys.argv[2]))")
        subprocess.run([sys.executable, "-c", code, workers.segment, str(3 * pb)], check=True, timeout=30)
        wait_for(lambda: read_segment(workers.segment).prealloc == 1 * pb, timeout=5.0)
        assert len(pool.mapped_pages()) == 3
        assert list(mapper.mapped_pages().values()) == [pool.mapped_pages()] * 2
    finally:
        pool.close()
    assert list(mapper.mapped_pages().values()) == [[], []]
    info = read_segment(workers.segment)
    assert (info.used, info.prealloc) == (0, 0)


def test_owner_waits_for_workers_that_create_their_own_tensors(workers, layout):
    mapper = BroadcastMapper(layout, workers.name, tp_size=2, page_size=PAGE, timeout=5.0)
    with pytest.raises(MapError, match="not created within"):
        mapper.wait_created(timeout=0.2)
    for path in mapper.paths:  # stand-in for each worker creating its own tensors
        Client(path).call("create_kv_tensors", **GEO.to_dict())
    mapper.wait_created(timeout=5.0)
