"""Worker side: the IPC listener starts with vLLM's WorkerProc and stops in its shutdown.

`WorkerProc.__init__` and `.shutdown` run for real (patched); the parts of
`__init__` that need a GPU, a model or a torch.distributed world (the worker
itself, its message queues, the process title from the parallel groups) are
replaced on the class for the test.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import time
from types import SimpleNamespace
from typing import Any

import pytest

from ..waiting import wait_until

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed here (run scripts/install-vllm.sh in this venv)")
pytestmark = pytest.mark.vllm

from vllm.config import ParallelConfig  # noqa: E402
from vllm.v1.executor import multiproc_executor as mpe  # noqa: E402
from vllm.v1.executor.multiproc_executor import WorkerProc  # noqa: E402
from vllm.v1.worker.worker_base import WorkerWrapperBase  # noqa: E402

from kvcached.integration import running  # noqa: E402
from kvcached.integration.vllm.worker_listener import LISTENER_ATTR  # noqa: E402
from kvcached.runtime.ipc.client import Client  # noqa: E402

from .. import conftest  # noqa: E402

both = conftest.both()


class FakeQueue:
    """A message queue that is always ready and never delivers an RPC (the worker idles in its busy loop)."""

    def export_handle(self) -> None:
        return None

    def wait_until_ready(self) -> None:
        pass

    def dequeue(self, indefinite: bool = True) -> None:
        while True:
            time.sleep(1)

    def shutdown(self) -> None:
        pass


class FakeWorker:
    def __init__(self) -> None:
        self.shutdowns = 0

    def init_device(self) -> None:
        pass

    def load_model(self) -> None:
        pass

    def shutdown(self) -> None:
        self.shutdowns += 1


@pytest.fixture
def no_gpu_worker(monkeypatch) -> None:
    def init_worker(self: Any, all_kwargs: list[dict[str, Any]]) -> None:
        self.vllm_config = all_kwargs[self.rpc_rank]["vllm_config"]
        self.worker = FakeWorker()

    def init_queues(self: Any, *_a: Any) -> None:
        self.rpc_broadcast_mq = self.worker_response_mq = None
        self.peer_response_handles = []

    monkeypatch.setattr(WorkerWrapperBase, "init_worker", init_worker)
    monkeypatch.setattr(WorkerProc, "setup_proc_title_and_log_prefix", lambda self, enable_ep: None)
    monkeypatch.setattr(WorkerProc, "_init_message_queues", init_queues)
    monkeypatch.setattr(mpe.current_platform, "update_block_size_for_backend", lambda cfg: None, raising=False)
    monkeypatch.setattr(mpe, "enable_envs_cache", lambda: None)


def _config(tp: int, pp: int) -> SimpleNamespace:
    parallel = ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    return SimpleNamespace(parallel_config=parallel, scheduler_config=SimpleNamespace(async_scheduling=False),
                           watchdog_config=SimpleNamespace(dump_dir=None))


def _worker(tp: int, pp: int, rank: int) -> WorkerProc:
    return WorkerProc(vllm_config=_config(tp, pp), local_rank=rank, rank=rank,
                      distributed_init_method="tcp://127.0.0.1:1", input_shm_handle=None, shared_worker_lock=None,
                      is_driver_worker=rank % tp == 0)


@both
@pytest.mark.parametrize("tp, pp, rank, expect", [(1, 1, 0, (0, 0)), (2, 2, 3, (1, 1)), (4, 2, 5, (1, 1))])
def test_listener_lives_with_the_worker(no_gpu_worker, vllm_env, layout, patched, tp, pp, rank, expect) -> None:
    """Started at the worker's TP rank and PP stage; stopped in shutdown: node unlinked, empty dirs removed."""
    worker = _worker(tp, pp, rank)
    path = layout.socket_path(vllm_env, expect[0], expect[1])
    if not patched:
        assert not os.path.lexists(path)
        worker.shutdown()
        return
    assert os.path.exists(path)
    assert running.current_worker_listener() is getattr(worker, LISTENER_ATTR)
    reply = Client(path).ping()
    assert (reply["rank"], reply["stage"], reply["pid"]) == (expect[0], expect[1], os.getpid())
    wrapped = worker.worker.worker
    worker.shutdown()
    assert wrapped.shutdowns == 1  # vLLM's own teardown still ran
    assert not os.path.lexists(path)
    assert not os.path.exists(layout.socket_dir(vllm_env))
    assert running.current_worker_listener() is None


def test_directory_stays_while_a_sibling_serves(no_gpu_worker, vllm_env, layout, patched) -> None:
    """The first worker to stop leaves the directory its sibling still serves in."""
    sibling = _worker(2, 1, 1)
    listener = getattr(sibling, LISTENER_ATTR)
    running.clear_worker_listener(listener)  # two workers in one test process: keep them apart
    worker = _worker(2, 1, 0)
    worker.shutdown()
    assert not os.path.lexists(layout.socket_path(vllm_env, 0))
    assert os.path.exists(listener.path)
    sibling.shutdown()
    assert not os.path.exists(layout.socket_dir(vllm_env))


def test_listener_failure_does_not_stop_the_worker(no_gpu_worker, vllm_env, layout, patched, caplog) -> None:
    """A live node already at our path: the listener refuses, the worker still starts and stops."""
    os.makedirs(layout.socket_dir(vllm_env), mode=0o700)
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squatter.bind(layout.socket_path(vllm_env, 0))
    squatter.listen(1)
    try:
        worker = _worker(1, 1, 0)
        assert LISTENER_ATTR not in worker.__dict__
        assert "listener not started" in caplog.text
        worker.shutdown()
        assert os.path.exists(layout.socket_path(vllm_env, 0))
    finally:
        squatter.close()


@pytest.mark.parametrize("start", ["fork", "spawn-shaped"])
def test_sigterm_through_vllms_worker_main_stops_the_listener(no_gpu_worker, vllm_env, layout, monkeypatch,
                                                             start) -> None:
    """A real worker process running vLLM's WorkerProc.worker_main: SIGTERM ends it through WorkerProc.shutdown().

    fork: the patch predates the worker (inherited from EngineCore). spawn-shaped:
    the plugin loads inside WorkerProc.__init__ (as in a spawned worker), so the
    busy loop starts the listener.
    """
    from kvcached.integration.vllm.patches import REGISTRY as vp

    vp.revert()

    def init_queues(self, *_a) -> None:
        self.rpc_broadcast_mq, self.worker_response_mq = FakeQueue(), FakeQueue()
        self.peer_response_handles = []

    monkeypatch.setattr(WorkerProc, "_init_message_queues", init_queues)
    if start == "fork":
        vp.apply(("worker-listener",))
    else:
        plain_init_worker = WorkerWrapperBase.init_worker

        def init_worker(self, all_kwargs) -> None:
            vp.apply(("worker-listener",))  # what load_general_plugins() does in init_worker
            plain_init_worker(self, all_kwargs)

        monkeypatch.setattr(WorkerWrapperBase, "init_worker", init_worker)
    ctx = multiprocessing.get_context("fork")
    ready_r, ready_w = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=WorkerProc.worker_main, daemon=True, kwargs=dict(
        vllm_config=_config(2, 1), local_rank=1, rank=1, distributed_init_method="tcp://127.0.0.1:1",
        input_shm_handle=None, ready_pipe=ready_w, shared_worker_lock=None, is_driver_worker=False,
        inherited_fds=[]))
    try:
        proc.start()
        ready_w.close()
        assert ready_r.poll(30) and ready_r.recv()["status"] == "READY"
        path = layout.socket_path(vllm_env, 1)
        wait_until(lambda: os.path.exists(path), 60)
        assert Client(path).ping()["pid"] == proc.pid  # serving: the listener is fully up
        os.kill(proc.pid, signal.SIGTERM)
        proc.join(15)
        assert proc.exitcode is not None
        assert not os.path.lexists(path)
        assert not os.path.exists(layout.socket_dir(vllm_env))
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        vp.revert()
