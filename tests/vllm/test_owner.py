"""Owner-side cleanup through the real, patched vLLM 0.33 classes, with stand-in engines and workers.

The real `CoreEngineProcManager.__init__` forks the engine (our stand-in in
place of `EngineCoreProc.run_engine_core`), the real `wait_for_engine_startup`
sees it answer READY over vLLM's handshake, and the real `MPClient.shutdown`
/ `CoreEngineProcManager.shutdown(0)` SIGTERM and SIGKILL it as vLLM does.
Cases whose outcome differs with the patch run twice, patched and unpatched,
to show that each fails on vLLM as installed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import weakref
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed here (run scripts/install-vllm.sh in this venv)")
pytestmark = pytest.mark.vllm

import zmq  # noqa: E402  (a vLLM dependency)
from vllm.v1.engine import utils as vutils  # noqa: E402
from vllm.v1.engine.core import EngineCoreProc  # noqa: E402
from vllm.v1.engine.core_client import BackgroundResources, MPClient  # noqa: E402
from vllm.v1.executor.multiproc_executor import MultiprocExecutor  # noqa: E402

from kvcached.integration import engine_owner as owner_mod  # noqa: E402
from kvcached.integration.vllm.owner import OWNER_ATTR  # noqa: E402
from kvcached.node.base.layout import Layout  # noqa: E402
from kvcached.runtime.ipc.listener import WorkerListener  # noqa: E402

from .. import conftest  # noqa: E402
from ..fs.engine_plant import MAPPER  # noqa: E402
from ..waiting import wait_for, wait_until  # noqa: E402
from . import standins  # noqa: E402
from .fakes import ServeConfig  # noqa: E402
from .serves import gone  # noqa: E402
from .standins import Spec, dead_node, map_buffer, read_pid  # noqa: E402

both = conftest.both()


class Serve:
    """One stand-in serve: a real CoreEngineProcManager whose engine answered READY.

    With a handshake, the engines start as the API server and the supervisor of
    `--api-server-count > 1` start them: through vLLM's `launch_core_engines`,
    which creates the manager and, on leaving its `with`, waits for READY in
    `wait_for_engine_startup` (the owner captures there). Without one, as
    `run_headless` does: a bare `CoreEngineProcManager(local_client=False)`.
    """

    def __init__(self, spec: Spec, *, handshake: bool = True, local_client: bool = True,
                 parallel: Any = None) -> None:
        self.spec = spec
        standins.SPEC = spec
        cfg = ServeConfig(tp=spec.tp, pp=spec.pp)
        if parallel is not None:
            cfg.parallel_config = parallel
        self.ctx = zmq.Context()
        if handshake and local_client:
            # MPClient binds these; the stand-in engine never connects to them.
            addresses = vutils.EngineZmqAddresses([f"ipc://{spec.root}/in"], [f"ipc://{spec.root}/out"])
            with vutils.launch_core_engines(cfg, MultiprocExecutor, False, addresses) as launch:
                self.manager = launch.engine_manager
        else:
            self.manager = vutils.CoreEngineProcManager(
                local_engine_count=1, start_index=0, local_start_index=0, vllm_config=cfg,
                local_client=local_client, handshake_address="", executor_class=MultiprocExecutor, log_stats=False)
        with open(spec.pid_file("ready"), "w"):
            pass
        self.engine = read_pid(spec, "engine")
        self.workers = {(s, r): read_pid(spec, f"w{s}-{r}") for s in range(spec.pp) for r in range(spec.tp)}

    def client(self, *, owns: bool = True) -> MPClient:
        """An MPClient as the API server has it: owning the engine manager, or a frontend owning none."""
        client = object.__new__(MPClient)
        client.resources = BackgroundResources(ctx=zmq.Context())
        client.resources.engine_manager = self.manager if owns else None
        client._finalizer = weakref.finalize(client, client.resources)
        return client

    def group_sigterm(self) -> None:
        """What a process-group SIGTERM does to everyone but the owner (this test process)."""
        for pid in (self.engine, *self.workers.values()):
            _kill(pid, signal.SIGTERM)

    def close(self) -> None:
        self.ctx.term()


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


@pytest.fixture
def serve(vllm_env, layout, monkeypatch, patched) -> Any:
    monkeypatch.setattr(EngineCoreProc, "run_engine_core", staticmethod(standins.engine_main))
    monkeypatch.setenv("KVCACHED_OWNER_EXIT_WAIT_S", "2")
    monkeypatch.setattr(owner_mod, "RETRY_INTERVAL_S", 0.05)
    made: list[Serve] = []

    def make(**kw: Any) -> Serve:
        opts = {k: kw.pop(k) for k in ("handshake", "local_client", "parallel") if k in kw}
        s = Serve(Spec(layout.root, vllm_env, **kw), **opts)
        made.append(s)
        return s

    yield make
    for s in made:
        _kill(s.engine, signal.SIGKILL)
        for pid in s.workers.values():
            _kill(pid, signal.SIGCONT)
            _kill(pid, signal.SIGKILL)
        s.manager.shutdown(timeout=0)
        s.close()


def _state(layout: Layout, name: str, tp: int, pp: int = 1) -> dict[str, bool]:
    out = {"segment": os.path.exists(layout.segment_path(name)), "dir": os.path.exists(layout.socket_dir(name))}
    for stage, rank, path in layout.socket_paths(name, tp, pp):
        out[f"pp{stage}/w{rank}"] = os.path.lexists(path)
    return out


# The process-group SIGTERM shape ------------------------------------------------


@both
@pytest.mark.parametrize("owner", ["mpclient", "supervisor", "headless"])
def test_group_sigterm_leaves_nothing(serve, layout, vllm_env, patched, owner) -> None:
    """Engines SIGKILLed by vLLM's shutdown(0), nodes unserved: patched, no directory and no segment remain."""
    s = serve(tp=2, pp=2, handshake=owner != "headless", local_client=owner != "headless")
    assert all(_state(layout, vllm_env, 2, 2).values())
    s.group_sigterm()
    if owner == "mpclient":
        s.client().shutdown(timeout=0)
    else:
        s.manager.shutdown(timeout=0)  # run_multi_api_server / run_headless call this
    wait_for(lambda: gone(s.engine))
    if patched:
        # The owner's cleanup runs once it has seen the engine exit: the sockets, then the directory. A look at
        # the moment the engine is gone can fall between the two (it did once in a fresh-clone .ci/run).
        wait_until(lambda: not any(_state(layout, vllm_env, 2, 2).values()), 10.0, interval=0.05)
    state = _state(layout, vllm_env, 2, 2)
    if patched:
        assert not any(state.values()), state
    else:
        assert all(state.values()), state  # vLLM as installed leaks every piece


@both
def test_delayed_and_stopped_workers_keep_sockets_until_exit(serve, layout, vllm_env, patched) -> None:
    """A worker that outlives its engine (slow, or stopped) keeps its node; once it exits, a retry removes it."""
    s = serve(tp=3, detached=((0, 1), (0, 2)))
    slow, stopped = s.workers[(0, 1)], s.workers[(0, 2)]
    _kill(stopped, signal.SIGSTOP)
    s.client().shutdown(timeout=0)
    wait_for(lambda: gone(s.engine))
    state = _state(layout, vllm_env, 3)
    assert state["pp0/w1"] and state["pp0/w2"] and state["dir"], state
    assert state["pp0/w0"] is (not patched) and state["segment"] is (not patched), state
    if patched:  # two retries later, what is still served (even by a stopped process) is still there
        owner = s.manager._kvcached_owner
        tried = owner.retries
        wait_for(lambda: owner.retries >= tried + 2)
    assert _state(layout, vllm_env, 3)["pp0/w2"]
    _kill(slow, signal.SIGKILL)
    _kill(stopped, signal.SIGKILL)
    wait_for(lambda: gone(slow) and gone(stopped))
    if patched:
        wait_for(lambda: not any(_state(layout, vllm_env, 3).values()), timeout=10,
                 explain=lambda: _state(layout, vllm_env, 3))
    else:  # no kvcached code runs here: nothing can remove anything
        assert all(_state(layout, vllm_env, 3).values())


def test_retry_on_repeated_shutdown(serve, layout, vllm_env, patched, monkeypatch) -> None:
    """Without the background retry, the next owner shutdown call is the retry."""
    monkeypatch.setattr(owner_mod.EngineOwner, "_start_retry", lambda self: None)
    s = serve(tp=2, detached=((0, 1),))
    client = s.client()
    client.shutdown(timeout=0)
    assert _state(layout, vllm_env, 2)["pp0/w1"]
    _kill(s.workers[(0, 1)], signal.SIGKILL)
    wait_for(lambda: gone(s.workers[(0, 1)]))
    s.manager.shutdown(timeout=0)  # e.g. BackgroundResources, or the supervisor's finally
    assert not any(_state(layout, vllm_env, 2).values()), getattr(s.manager, OWNER_ATTR).results


# What is never ours ------------------------------------------------------------------


def test_same_name_replacements_stay(serve, layout, vllm_env, patched) -> None:
    """Nodes and a segment re-created under our names after READY are a successor's: kept, live or dead."""
    s = serve(tp=2)
    for pid in s.workers.values():
        _kill(pid, signal.SIGKILL)
    wait_for(lambda: all(gone(p) for p in s.workers.values()))
    w0, w1 = layout.socket_path(vllm_env, 0), layout.socket_path(vllm_env, 1)
    os.unlink(w0)
    dead_node(w0)
    os.unlink(w1)
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(w1)
    live.listen(1)
    seg = layout.segment_path(vllm_env)
    os.unlink(seg)
    with open(seg, "wb") as f:
        f.write(bytes(24))
    try:
        s.client().shutdown(timeout=0)
        wait_for(lambda: gone(s.engine))
        assert all(_state(layout, vllm_env, 2).values()), _state(layout, vllm_env, 2)
    finally:
        live.close()


def test_unconfirmed_engine_exit_keeps_everything(serve, layout, vllm_env, patched, monkeypatch) -> None:
    """While an engine has no confirmed exit code, nothing is removed; once it has, the retry cleans up."""
    monkeypatch.setenv("KVCACHED_OWNER_EXIT_WAIT_S", "0.2")
    s = serve(tp=2)
    for pid in s.workers.values():
        _kill(pid, signal.SIGKILL)  # every node is unserved: only the engine gate holds
    s.manager._finalizer.detach()  # vLLM's own shutdown already ran (or failed) and left the engine alive
    s.client().shutdown(timeout=0)
    owner = s.manager._kvcached_owner
    wait_for(lambda: owner.retries >= 2)  # the retry ran, and found no confirmed exit
    assert not gone(s.engine)
    assert all(_state(layout, vllm_env, 2).values()), _state(layout, vllm_env, 2)
    _kill(s.engine, signal.SIGKILL)
    wait_for(lambda: not any(_state(layout, vllm_env, 2).values()), timeout=10,
             explain=lambda: _state(layout, vllm_env, 2))


@both
def test_nodes_absent_at_ready_are_never_claimed(serve, layout, vllm_env, patched) -> None:
    """A node bound after READY was not captured: kept even when unserved."""
    s = serve(tp=2, late=((0, 1),))
    s.group_sigterm()
    s.client().shutdown(timeout=0)
    wait_for(lambda: gone(s.engine))
    state = _state(layout, vllm_env, 2)
    assert state["pp0/w1"] and state["dir"], state
    assert state["pp0/w0"] is (not patched) and state["segment"] is (not patched), state


def test_non_owning_frontend_touches_nothing(vllm_env, layout, patched) -> None:
    """An MPClient without an engine manager (extra API servers) removes nothing, even stale state of its name."""
    os.makedirs(layout.socket_dir(vllm_env), mode=0o700)
    dead_node(layout.socket_path(vllm_env, 0))
    with open(layout.segment_path(vllm_env), "wb") as f:
        f.write(bytes(24))
    client = object.__new__(MPClient)
    client.resources = BackgroundResources(ctx=zmq.Context())
    client._finalizer = weakref.finalize(client, client.resources)
    client.shutdown(timeout=0)
    assert all(_state(layout, vllm_env, 1).values())


def test_owner_without_parallel_config_touches_nothing(serve, layout, vllm_env, patched) -> None:
    """A manager built without a parallel config we understand gets no owner duty and removes nothing."""
    parallel = SimpleNamespace(data_parallel_size=1, assigned_physical_gpu_ids=None, numa_bind=False)
    s = serve(tp=2, handshake=False, parallel=parallel)
    assert OWNER_ATTR not in s.manager.__dict__
    s.group_sigterm()
    s.manager.shutdown(timeout=0)
    wait_for(lambda: gone(s.engine))
    assert all(_state(layout, vllm_env, 2).values())


def test_repeated_shutdowns_keep_a_successors_directory(serve, layout, vllm_env, patched) -> None:
    """After the first cleanup, later owner shutdown calls leave a same-name successor's directory alone."""
    s = serve(tp=2)
    s.group_sigterm()
    client = s.client()
    client.shutdown(timeout=0)
    assert not any(_state(layout, vllm_env, 2).values()), getattr(s.manager, OWNER_ATTR).results
    successor = WorkerListener(layout, vllm_env, 0).start()
    try:
        os.makedirs(layout.stage_dir(vllm_env, 1), mode=0o700)  # an empty one too
        client.shutdown(timeout=0)
        s.manager.shutdown(timeout=0)
        s.manager.shutdown()
        assert os.path.isdir(layout.stage_dir(vllm_env, 1))
        assert os.path.exists(successor.path)
    finally:
        successor.stop()


# The engines' own buffers ---------------------------------------------------------------


def _buffers(layout: Layout) -> set[str]:
    return {n for n in os.listdir(layout.shm_dir) if n.startswith(("psm_", "nccl-"))}


@both
def test_the_serves_buffers_go_after_a_confirmed_exit_and_a_live_mapper_keeps_its(serve, layout, vllm_env,
                                                                                  patched) -> None:
    """psm_ buffers the engine and its workers map, and each worker's nccl- file: gone once the serve is.

    One of them is still mapped by a process outside the serve (a debugger, a sidecar): that one stays.
    A dead buffer made after READY was never captured: it stays too (kvctl gc --engines judges it).
    """
    s = serve(tp=2, buffers=2)
    at_ready = _buffers(layout)
    assert len([n for n in at_ready if n.startswith("psm_")]) == 2 and len(at_ready) == 4, at_ready
    kept = sorted(n for n in at_ready if n.startswith("psm_"))[0]
    outsider = subprocess.Popen([sys.executable, "-c", MAPPER, os.path.join(layout.shm_dir, kept)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert outsider.stdout is not None and outsider.stdout.readline().strip() == "ready"
        late = map_buffer(layout.shm_dir, "psm_0a0b0c0d")  # after READY, then unmapped: dead, never captured
        late.close()
        s.group_sigterm()
        s.client().shutdown(timeout=0)
        wait_for(lambda: gone(s.engine) and all(gone(p) for p in s.workers.values()))
        if patched:
            wait_for(lambda: _buffers(layout) == {kept, "psm_0a0b0c0d"}, timeout=10,
                     explain=lambda: (_buffers(layout), getattr(s.manager, OWNER_ATTR).results))
            results = getattr(s.manager, OWNER_ATTR).results
            assert any(os.path.join(layout.shm_dir, kept) == path and why.startswith("live: mapped")
                       for r in results for path, why in r.kept), results
        else:
            assert _buffers(layout) == at_ready | {"psm_0a0b0c0d"}  # vLLM as installed leaks every one
    finally:
        outsider.kill()
        outsider.wait()
