"""doctor `small-shm`: a tensor-parallel serve whose ranks see a /dev/shm smaller than it needs (docs/PLACES.md §7).

The serve is a stand-in, as strict as the real one where doctor looks: an EngineCore and its workers by vLLM
0.33's titles (`VLLM::EngineCore`, `VllmWorker-<rank>`), the workers its children, in a private mount
namespace whose /dev/shm is a real tmpfs of Docker's default 64 MiB, or of 2 GiB (enough). No ring is made:
what the rings and NCCL need are the engines' own figures, which the last test holds.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcached.node.ops import small_shm

KVCTL = str(Path(sys.executable).with_name("kvctl"))
MIB = 1 << 20
PY = os.path.realpath(sys.executable)  # the binary itself: a launcher script would lose the title exec -a sets

SERVE = textwrap.dedent("""
    mount -t tmpfs -o size=$1,mode=1777 kvctest /dev/shm || exit 1
    exec -a VLLM::EngineCore "$2" -c '
    import subprocess, sys
    kids = [subprocess.Popen([f"VllmWorker-{i}", "-c", "import sys; sys.stdin.read()"], executable=sys.argv[1],
                             stdin=subprocess.PIPE) for i in range(int(sys.argv[2]))]
    print(" ".join(str(k.pid) for k in kids), flush=True)
    sys.stdin.read()
    for k in kids:
        k.stdin.close()
        k.wait()
    ' "$2" "$3"
""")

needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                reason="a tmpfs at /dev/shm in a private mount namespace needs root and unshare(1)")
Start = Callable[[str, int], tuple[int, list[int]]]


@pytest.fixture
def serve() -> Iterator[Start]:
    made: list[subprocess.Popen[str]] = []

    def start(size: str, workers: int) -> tuple[int, list[int]]:
        p = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "bash", "-c", SERVE, "serve", size,
                              PY, str(workers)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        made.append(p)
        assert p.stdout is not None
        kids = [int(x) for x in p.stdout.readline().split()]
        assert len(kids) == workers, p.poll()
        return p.pid, kids  # unshare without --fork execs bash, which execs the EngineCore: one PID

    yield start
    for p in made:
        assert p.stdin is not None
        p.stdin.close()
        p.wait(timeout=30)


def _line(serve_pid: int) -> dict[str, Any] | None:
    r = subprocess.run([KVCTL, "doctor", "small-shm", "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode in (0, 8), r.stderr
    mine = [c for c in json.loads(r.stdout)["checks"] if c["details"].get("serve") == serve_pid]
    assert len(mine) <= 1
    return mine[0] if mine else None


@needs_root
def test_a_tp2_serve_on_dockers_64_mib_shm_is_told_its_size_and_the_fix(serve: Start) -> None:
    pid, workers = serve("64m", 2)
    line = _line(pid)
    assert line is not None and line["status"] == "warn"
    d = line["details"]
    assert (d["engine"], d["ranks"], d["stages"], d["capacity_bytes"]) == ("vllm", 2, 1, 64 * MIB)
    assert d["need_bytes"] == small_shm.need_bytes("vllm", 2, 1)
    assert d["shm"] == f"/proc/{workers[0]}/root/dev/shm"
    assert "has 64M (Docker's and containerd's default)" in line["summary"]
    assert "emptyDir: {medium: Memory, sizeLimit: 1Gi}" in line["fix"] and "--shm-size=1G" in line["fix"]


@needs_root
def test_a_large_enough_shm_is_ok_and_one_rank_is_no_parallel_serve(serve: Start) -> None:
    pid, _ = serve("2g", 2)
    line = _line(pid)
    assert line is not None and line["status"] == "ok" and line["details"]["capacity_bytes"] == 2 << 30
    single, _ = serve("64m", 1)
    assert _line(single) is None


def test_the_figures_are_the_engines_and_nccls() -> None:
    # vLLM 0.33: EngineCore's ring (10 x 16 MiB), each worker's (10 x 24 MiB), each TP group's (6 x 4 MiB);
    # NCCL: 9637888 bytes per receiving SHM connection, four per rank.
    assert small_shm.need_bytes("vllm", 2, 1) == 160 * MIB + 2 * 240 * MIB + 24 * MIB + 2 * 4 * 9637888
    assert small_shm.need_bytes("vllm", 4, 2) == 160 * MIB + 4 * 240 * MIB + 2 * 24 * MIB + 4 * 4 * 9637888
    assert small_shm.need_bytes("sglang", 2, 1) == 2 * 4 * 9637888 > 64 * MIB
