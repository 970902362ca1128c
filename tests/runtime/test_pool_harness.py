"""A real local deployment running the pool (harness --pool), steered by the real `kvctl limit`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

pytest.importorskip(
    "kvcached.runtime._kvpages",
    reason="kvcached.runtime._kvpages is not built (pip install -e . compiles it from csrc/)",
)

from kvcached.node.base.layout import Layout  # noqa: E402
from kvcached.node.state.segment import read_segment  # noqa: E402
from kvcached.runtime.harness import start_deployment  # noqa: E402
from kvcached.runtime.pool import BroadcastMapper  # noqa: E402

from ..waiting import wait_for

pytestmark = pytest.mark.ext

MiB = 1 << 20
PAGE_BYTES = 4 * MiB        # start_engine_pool's defaults: 2 MiB pages, K and V
KVCTL = "import sys; from kvctl.cli import main; sys.argv[0] = 'kvctl'; sys.exit(main())"


@pytest.fixture
def layout():
    root = tempfile.mkdtemp(prefix="kvh")   # short: socket paths stay under 108 bytes
    os.makedirs(os.path.join(root, "tmp"))
    os.makedirs(os.path.join(root, "dev", "shm"))
    yield Layout(root)
    shutil.rmtree(root, ignore_errors=True)



def _rss_shmem_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssShmem:"))


def test_deployment_pool_shows_real_use_and_obeys_kvctl_limit(layout):
    name = f"t{os.getpid()}_hpool"
    seg = layout.segment_path(name)
    with start_deployment(name, tp=2, layout=layout, pool=True, limit=64 * MiB) as dep:
        # The engine's pool fills 4 pages and keeps 1 pre-mapped, on both workers.
        wait_for(lambda: read_segment(seg).prealloc == PAGE_BYTES)
        assert read_segment(seg).used == 4 * PAGE_BYTES
        mapper = BroadcastMapper(layout, name, tp_size=2)
        maps = list(mapper.mapped_pages().values())
        assert maps[0] == maps[1] and len(maps[0]) == 5
        for pid in dep.worker_pids.values():
            assert _rss_shmem_kib(pid) >= 5 * PAGE_BYTES // 1024 * 0.95

        res = subprocess.run([sys.executable, "-c", KVCTL, "--root", layout.root, "limit", name, "16M"],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        assert read_segment(seg).total == 16 * MiB
        # Within one pool step (0.1 s), the pre-mapped page goes on both workers.
        wait_for(lambda: read_segment(seg).prealloc == 0, timeout=5.0)
        maps = list(mapper.mapped_pages().values())
        assert maps[0] == maps[1] and len(maps[0]) == 4
        assert read_segment(seg).used == 4 * PAGE_BYTES
