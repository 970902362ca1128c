"""TP = 2: the engine's elastic block pool maps and unmaps pages in two worker processes in step.

The engine is vLLM's real Scheduler in this process; each worker is a real
process with its own KV buffer (the footprint vLLM's config gives, after the
same padding the patched allocation applies) serving our worker listener, as
a vLLM ``mp`` worker does once the worker-listener patch runs. The workers
need no vLLM: what they do with a config is tested in
test_elastic_buffers.py. After every step the pages the engine's pool has
mapped must be exactly each worker's mapped pages, and each worker must hold
that memory; a worker that dies fails the engine's next mapping loudly and
leaves the other worker as it was.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed here (run scripts/install-vllm.sh in this venv)")
pytest.importorskip("kvcached.runtime._kvpages", reason="kvcached.runtime._kvpages is not built (pip install -e .)")
pytestmark = [pytest.mark.vllm, pytest.mark.ext]

from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvcached.integration.vllm import elastic as vllm_elastic  # noqa: E402
from kvcached.integration.vllm import elastic_buffers  # noqa: E402
from kvcached.node.in_engine.startup import claim_segment  # noqa: E402
from kvcached.runtime.ipc.client import Client  # noqa: E402
from kvcached.runtime.ipc.protocol import CMD_MAPPED  # noqa: E402
from kvcached.runtime.pool import MapError  # noqa: E402

from . import elastic_support as es  # noqa: E402

PAGE = es.PAGE
REPO = str(Path(__file__).resolve().parents[2])  # the workers import this checkout's kvcached
BPP = 8
PB = 2 * PAGE

_WORKER = """
import json, signal, sys
from kvcached.runtime.ipc.listener import WorkerListener
from kvcached.node.base.layout import Layout
from kvcached.runtime.kvbuffer import KVBuffer
from kvcached.runtime.kvplan import Footprint
root, name, rank, fp, page = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]), int(sys.argv[5])
listener = WorkerListener(Layout(root), name, rank)
buf = KVBuffer(Footprint.from_dict(fp), page)
buf.register(listener)
listener.start()
signal.signal(signal.SIGTERM, lambda *_: (listener.stop(), sys.exit(0)))
print("ready", flush=True)
while True:
    signal.pause()
"""


@pytest.fixture
def tp2(tmp_path, layout, uniq, elastic):
    """A TP = 2 engine: segment claimed, two worker processes up, the scheduler built over them."""
    lease, _, _ = claim_segment(layout, uniq, 64 * PB)
    vc = es.vllm_config(str(tmp_path), tp=2, prefix_caching=False)
    cfg = es.kv_cache_config(vc, 256)
    vllm_elastic.prepare_engine([cfg], "sockets", tp_size=2)  # the executor hook, as for the mp executor
    elastic_buffers.pad_layer_regions(cfg, PAGE)                     # what each worker's allocation does first
    fp = json.dumps(elastic_buffers.footprint(cfg, KVCacheLayout[cfg.kv_cache_layout]).to_dict())
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, layout.root, uniq, str(rank), fp, str(PAGE)],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": REPO})
             for rank in (0, 1)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        sched = es.scheduler(vc, cfg)
        yield sched, procs, [layout.socket_path(uniq, rank) for rank in (0, 1)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(timeout=30)
        lease.release()


def worker_pages(paths: list[str]) -> list[tuple[list[int], int]]:
    """Each worker's (mapped pages, mapped bytes), from its listener."""
    out = []
    for path in paths:
        r = Client(path, 10).call(CMD_MAPPED)
        out.append((r["pages"], r.get("mapped_bytes", 0)))
    return out


@es.both
def test_workers_map_and_unmap_in_step_with_the_engines_pool(tp2, elastic) -> None:
    sched, _procs, paths = tp2
    pool = sched.kv_cache_manager.block_pool
    driver = es.Driver(sched)

    def check() -> None:
        sizes: set[int] = set()

        def each(d) -> None:
            engine = getattr(pool, "mapped_pages", lambda: list(range(pool.num_gpu_blocks // BPP)))()
            for pages, mapped in worker_pages(paths):
                assert pages == engine, f"step {d.steps}: a worker maps {pages}, the engine's pool {engine}"
                assert mapped == len(engine) * PB  # and it holds exactly that memory
            sizes.add(len(engine))

        for wave in range(2):
            driver.add(es.request(f"w{wave}r{i}", list(range(10**4 * wave + 100 * i, 10**4 * wave + 100 * i + 80)),
                                  30) for i in range(6))
            for _ in range(6):
                driver.step()
                each(driver)
        driver.run(each=each)
        assert max(sizes) >= 6 and min(sizes) <= 2  # pages went up and came back

    es.check_or_fail(elastic, check)


def test_a_dead_worker_fails_the_engine_loudly_and_never_half_maps(tp2) -> None:
    sched, procs, paths = tp2
    driver = es.Driver(sched)
    driver.add([es.request("a", list(range(40)), 4)])
    driver.step()
    before = worker_pages(paths[:1])
    procs[1].kill()
    procs[1].wait(timeout=30)
    driver.add([es.request("big", list(range(1000, 1000 + 700)), 4)])  # needs pages the pool must map
    with pytest.raises(MapError, match="w1.sock"):
        driver.step()
    assert worker_pages(paths[:1]) == before  # the live worker was rolled back, not left with half a set
