"""Stand-ins for vLLM's EngineCore and TP workers: real processes, real sockets, real signals.

`engine_main` replaces `EngineCoreProc.run_engine_core` as the target that the
real `CoreEngineProcManager.__init__` forks. Like EngineCore with kvcached, it
creates the deployment's segment (holding its lease), forks TP × PP workers
that serve `[pp<k>/]w<r>.sock` through kvcached's WorkerListener, and answers
vLLM's real start-up handshake (HELLO, then READY) on the handshake address
the manager gave it, through the installed vLLM's own engine-side handshake.
Like upstream workers under vLLM (0.33, 0.34), the workers do not get to
clean up: they die by signal and leave their nodes.

What each test wants differently comes through `SPEC`, a module global set
before the manager forks (a forked child sees the parent's globals).
No vLLM import at module level: children stay cheap (the handshake imports
the engine module, already loaded in the test process they fork from).
"""

from __future__ import annotations

import mmap
import os
import secrets
import signal
import socket
import string
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from kvcached.node.base.layout import Layout
from kvcached.node.state.lease import SegmentLease
from kvcached.node.state.segment import create_segment
from kvcached.runtime.ipc.listener import WorkerListener

from ..waiting import wait_until


@dataclass
class Spec:
    root: str
    name: str
    tp: int = 2
    pp: int = 1
    # engine on SIGTERM: "ignore" (slow teardown: vLLM's SIGKILL lands first) or "exit"
    engine_term: str = "ignore"
    # (stage, rank) of workers that escape the engine's process tree (a worker outliving
    # its engine): vLLM's kill_process_tree does not reach them.
    detached: tuple[tuple[int, int], ...] = ()
    # (stage, rank) of workers that bind only after READY
    late: tuple[tuple[int, int], ...] = ()
    segment: bool = True
    # Engine buffers, as vLLM and NCCL make them: the engine creates this many psm_* files and maps them
    # before it forks the workers (which so map them too, as the shm broadcast's readers do); each worker
    # then creates and maps an nccl-* file of its own.
    buffers: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def layout(self) -> Layout:
        return Layout(self.root)

    def pid_file(self, what: str) -> str:
        return os.path.join(self.root, f"pid-{what}")


SPEC: Spec | None = None
_keep: list[mmap.mmap] = []  # the buffers a stand-in maps, for its whole life


def _write_pid(spec: Spec, what: str, pid: int | None = None) -> None:
    tmp = spec.pid_file(what) + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(pid or os.getpid()))
    os.rename(tmp, spec.pid_file(what))


def read_pid(spec: Spec, what: str, timeout: float = 20.0) -> int:
    """The pid a stand-in published as `what`, waiting for it."""
    got: list[int] = []

    def published() -> bool:
        try:
            with open(spec.pid_file(what)) as f:
                got.append(int(f.read()))
        except (FileNotFoundError, ValueError):
            return False
        return True

    if not wait_until(published, timeout):
        raise TimeoutError(f"stand-in {what} did not start")
    return got[0]


def map_buffer(directory: str, name: str, size: int = 1 << 16) -> mmap.mmap:
    """Create `name` in `directory` and map it shared (what SharedMemory and ncclShmOpen do); the caller keeps it."""
    fd = os.open(os.path.join(directory, name), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _worker(spec: Spec, stage: int, rank: int, detached: bool) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if spec.buffers:
        alnum = string.ascii_letters + string.digits
        _keep.append(map_buffer(spec.layout.shm_dir, "nccl-" + "".join(secrets.choice(alnum) for _ in range(6))))
    if detached:
        # Double fork: the worker's parent exits, so it leaves the engine's tree.
        if os.fork() != 0:
            os._exit(0)
    if (stage, rank) in spec.late:
        while not os.path.exists(spec.pid_file("ready")):
            time.sleep(0.02)
    WorkerListener(spec.layout, spec.name, rank, stage).start()
    _write_pid(spec, f"w{stage}-{rank}")
    while True:
        signal.pause()


def engine_main(*_args: Any, **kwargs: Any) -> None:
    """Target of the forked engine process (in place of EngineCoreProc.run_engine_core)."""
    spec = SPEC
    assert spec is not None
    try:
        if spec.engine_term == "exit":
            signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
        else:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for _ in range(spec.buffers):
            _keep.append(map_buffer(spec.layout.shm_dir, f"psm_{secrets.token_hex(4)}"))
        for stage in range(spec.pp):
            for rank in range(spec.tp):
                pid = os.fork()
                if pid == 0:
                    try:
                        _worker(spec, stage, rank, (stage, rank) in spec.detached)
                    finally:
                        os._exit(0)
        # As in vLLM, the executor forks the workers before the KV cache (and so
        # the segment) exists: the workers never inherit the segment's lease.
        lease = None
        if spec.segment:
            path = spec.layout.segment_path(spec.name)
            create_segment(path, 1 << 30, exist_ok=True)
            lease = SegmentLease(path)
            lease.acquire()
        for stage in range(spec.pp):
            for rank in range(spec.tp):
                if (stage, rank) not in spec.late:
                    read_pid(spec, f"w{stage}-{rank}")
        if kwargs.get("handshake_address"):
            _handshake(kwargs["handshake_address"], int(kwargs.get("dp_rank", 0)))
        _write_pid(spec, "engine")
        del lease  # held by the open fd until this process dies
        while True:
            signal.pause()
    finally:
        os._exit(1)


def _handshake(address: str, index: int) -> None:
    # The engine side of wait_for_engine_startup, as the installed vLLM does it: its own
    # EngineCoreProc._perform_handshake (HELLO, the init message, then READY as this release
    # builds it), with a config that says what a DP = 1 engine's would. A release that changes
    # the handshake changes it here too; what it reads that the config lacks fails here, by name.
    import zmq
    from vllm.config import ParallelConfig
    from vllm.v1.engine.core import EngineCoreProc

    ctx = zmq.Context()
    config = SimpleNamespace(parallel_config=ParallelConfig())
    # `self` is only asked for startup_handshake, a staticmethod: the class answers it.
    with EngineCoreProc._perform_handshake(EngineCoreProc, ctx, address, index.to_bytes(2, "little"),
                                           True, False, config):
        pass  # where a real engine builds itself: ours is up already
    ctx.term()


def dead_node(path: str) -> None:
    """Leave a socket node at `path` that nobody serves (bound, then closed)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.close()
