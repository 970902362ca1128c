"""The harness's worker and the engines' worker serve the page commands through one server, with one set of checks.

The harness's worker is the real `python -m kvcached.runtime.harness --role
worker --pool` process; the engines' worker is a `KVBuffer` registered on a
`WorkerListener`, as vLLM's worker listener and SGLang's scheduler register
theirs. Both serve 8 indices of 64 KiB, so every bad request must be refused
with the same words by both, and change nothing on either.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

pytest.importorskip(
    "kvcached.runtime._kvpages",
    reason="kvcached.runtime._kvpages is not built (pip install -e . compiles it from csrc/)",
)

from kvcached.node import IpcError  # noqa: E402
from kvcached.runtime.ipc.client import Client, ping  # noqa: E402
from kvcached.runtime.ipc.listener import WorkerListener  # noqa: E402
from kvcached.runtime.ipc.page_server import PageServer  # noqa: E402
from kvcached.runtime.ipc.protocol import CMD_CREATE, CMD_MAP, CMD_MAPPED, CMD_UNMAP  # noqa: E402
from kvcached.runtime.kvbuffer import KVBuffer  # noqa: E402
from kvcached.runtime.kvplan import Footprint  # noqa: E402
from kvcached.runtime.pool import Geometry, attach_worker  # noqa: E402

from ..waiting import wait_for  # noqa: E402

pytestmark = pytest.mark.ext

P = 64 * 1024
PAGES = 8


@pytest.fixture
def harness_worker(layout, uniq):
    """The harness's own worker process (rank 0 of `uniq`), its tensors created by the owner's command."""
    name = f"{uniq}h"
    proc = subprocess.Popen([sys.executable, "-m", "kvcached.runtime.harness", "--role", "worker", "--name", name,
                             "--root", layout.root, "--pool"], stdin=subprocess.DEVNULL)
    path = layout.socket_path(name, 0)
    try:
        wait_for(lambda: _answers(path), timeout=30.0)
        Client(path).call(CMD_CREATE, **Geometry(PAGES, P, num_tensors=2).to_dict())
        yield path
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def _answers(path: str) -> bool:
    try:
        ping(path, timeout=1.0)
        return True
    except (IpcError, OSError):
        return False


@pytest.fixture
def engine_worker(layout, uniq):
    """An engine's worker: a KVBuffer of 8 groups of 64 KiB in each of 2 layers, configured, on its listener."""
    blocks, block = 64, 8 * 1024
    region = blocks * block
    buf = KVBuffer(Footprint.build(2 * region, blocks, [(block, layer * region, block) for layer in range(2)]), P)
    buf.configure(8)  # 8 blocks a group: the buffer's 64 blocks make 8 groups
    listener = WorkerListener(layout, f"{uniq}e", 0)
    server = buf.register(listener)
    listener.start()
    try:
        yield listener.path, server, buf
    finally:
        listener.stop()
        buf.pages.close()


BAD = [
    pytest.param([-P], id="negative"),
    pytest.param([PAGES * P], id="one-past-the-end"),
    pytest.param([P, 100 * P], id="far-past-the-end"),
    pytest.param([P // 2], id="not-a-whole-page"),
    pytest.param([P, "2"], id="not-an-int"),
    pytest.param(P, id="not-a-list"),
]


def _refusal(path: str, command: str, offsets: object) -> str:
    with pytest.raises(IpcError) as e:
        Client(path).call(command, offsets=offsets, group_id=0)
    return str(e.value).removeprefix(f"{path}: ")


@pytest.mark.parametrize("command", [CMD_MAP, CMD_UNMAP])
@pytest.mark.parametrize("offsets", BAD)
def test_both_workers_refuse_a_bad_offset_in_the_same_words_and_change_nothing(harness_worker, engine_worker,
                                                                             command, offsets) -> None:
    engine_path, _, buf = engine_worker
    Client(harness_worker).call(CMD_MAP, offsets=[0, 3 * P], group_id=0)
    before = [Client(p).call(CMD_MAPPED) for p in (harness_worker, engine_path)]
    assert [b["pages"] for b in before] == [[0, 3], [0]]

    said = {_refusal(p, command, offsets) for p in (harness_worker, engine_path)}
    assert len(said) == 1, said
    assert "ValueError: offsets" in said.pop()
    assert [Client(p).call(CMD_MAPPED) for p in (harness_worker, engine_path)] == before
    assert buf.mapped_groups() == [0]


def test_both_workers_take_the_same_good_request(harness_worker, engine_worker) -> None:
    engine_path, _, buf = engine_worker
    for path in (harness_worker, engine_path):
        Client(path).call(CMD_MAP, offsets=[(PAGES - 1) * P, 2 * P], group_id=0)
    assert Client(harness_worker).call(CMD_MAPPED)["pages"] == [2, PAGES - 1]
    assert buf.mapped_groups() == [0, 2, PAGES - 1]
    # Each reports the memory it holds: 2 pages in each of the harness's 2 tensors; 3 groups of 2 pages.
    assert Client(harness_worker).call(CMD_MAPPED)["mapped_bytes"] == 4 * P
    assert Client(engine_path).call(CMD_MAPPED)["mapped_bytes"] == buf.mapped_bytes == 6 * P


def test_the_harness_and_the_engines_register_one_server(layout, uniq, engine_worker) -> None:
    """The same code path, not two that agree today: both listeners' page commands are PageServer's methods."""
    _, engine_server, _ = engine_worker
    listener = WorkerListener(layout, f"{uniq}x", 0)
    harness_server = attach_worker(listener)
    for server in (engine_server, harness_server):
        assert type(server) is PageServer
    for command in (CMD_MAP, CMD_UNMAP, CMD_MAPPED):
        handler = listener._handlers[command]
        assert getattr(handler, "__func__", None) is getattr(PageServer, handler.__name__)
    with pytest.raises(ValueError, match="not created yet"):
        harness_server.map({"offsets": [0]})
