"""Whole vLLM 0.33 serves, each in its own session, built from vLLM's own classes (see fakes.py).

A serve is a child forked from the test process (vLLM is imported once, so a
serve starts in about a second), made a session leader, so the test can send
the process-group SIGTERM a real serve gets. Inside it, vLLM's plugin loader
(`load_general_plugins`, through the installed entry point) loads kvcached,
or not: the unpatched case is vLLM as installed.

Owners, as vLLM has them:

- `api`: the API server. Its SIGTERM handler ends in the engine client's
  shutdown with `--shutdown-timeout 0` (`MPClient.shutdown(timeout=0)`).
- `offline`: an offline `LLM` script with the multiprocess engine
  (`SyncMPClient`): no SIGTERM handler of its own.
- `inproc`: an offline `LLM` with `VLLM_ENABLE_V1_MULTIPROCESSING=0`
  (`InprocClient`): the engine runs inside the script. It stops the way a
  script lets go of its `LLM`: the client is dropped and vLLM's finalizer
  shuts the engine down.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import sys
from dataclasses import dataclass, field
from typing import Any

import psutil

from ..waiting import wait_until

READY_TIMEOUT = 180.0  # a spawned worker imports vLLM and torch afresh: tens of seconds on a busy machine


@dataclass(frozen=True)
class Shape:
    """What to start: the owner, TP/PP/DP, the executor backend, how workers start."""

    owner: str = "api"  # api / offline / inproc
    tp: int = 1
    pp: int = 1
    dp: int = 1
    backend: str | None = None  # None: vLLM's choice (uni at world size 1, else mp)
    worker_start: str | None = None  # "spawn": the engine spawns its workers
    dp_names: bool = True  # False: kvcached's per-DP-rank names reverted (the collision of issue 12)


@dataclass
class Serve:
    """A running serve: its owner (session leader), engines and workers."""

    shape: Shape
    name: str
    proc: Any  # multiprocessing.Process of the owner
    conn: Any
    owner: int
    engines: list[int]
    workers: dict[int, list[int]]  # engine pid (or the owner, in-process) -> worker pids
    sigterm_default: bool
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def pids(self) -> list[int]:
        return [self.owner, *self.engines, *(p for ws in self.workers.values() for p in ws)]

    def group_sigterm(self) -> None:
        """What `kill -TERM -<pgid>` (systemd, docker stop, a pod's end) sends a whole serve."""
        os.killpg(self.owner, signal.SIGTERM)

    def call(self, cmd: str, *args: Any, timeout: float = 30.0) -> Any:
        """Ask the owner to do something in the serve (e.g. call an engine utility); its reply."""
        self.conn.send((cmd, args))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"serve owner did not answer {cmd!r}")
        ok, value = self.conn.recv()
        if not ok:
            raise RuntimeError(value)
        return value

    def wait_exit(self, timeout: float = 30.0) -> int | None:
        """Reap the owner; its exit code (negative: the signal that ended it)."""
        self.proc.join(timeout)
        return self.proc.exitcode

    def kill(self) -> None:
        """SIGKILL everything of the serve that is left (teardown of a failed test)."""
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.owner, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.join(10)


def gone(pid: int) -> bool:
    """Dead with every thread: a zombie leader's other threads may still hold its fds (and sockets)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                    return False
        except OSError:
            continue
    return True


def _workers_of(pid: int) -> list[int]:
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for k in kids:
        try:
            if any("resource_tracker" in a for a in k.cmdline()):
                continue  # multiprocessing's helper, not a vLLM worker
        except psutil.Error:
            continue
        out.append(k.pid)
    return sorted(out)


def _owner_main(conn: Any, shape: Shape, root: str, name: str, patched: bool, env: dict[str, str]) -> None:
    os.setsid()  # a serve is a process group of its own: the API server leads it
    # The owner waits KVCACHED_OWNER_EXIT_WAIT_S (2 s) for what a worker still serves, then exits and leaves
    # the segment to the next start's sweep (docs/VLLM.md). A spawned worker on a busy machine can take
    # longer than that to stop: these serves wait as SGLang's do, unless a test sets its own.
    os.environ.setdefault("KVCACHED_OWNER_EXIT_WAIT_S", "10")
    os.environ.update(env, KVCACHED_ROOT=root, KVCACHED_IPC_NAME=name)
    for var in ("ENABLE_KVCACHED", "KVCACHED_ENABLE"):
        os.environ.pop(var, None)
    if patched:
        os.environ["KVCACHED_ENABLE"] = "1"
    import vllm.plugins
    from vllm.v1.engine.core_client import InprocClient, SyncMPClient
    from vllm.v1.executor.abstract import Executor

    from kvcached.integration.vllm import common, plugin
    from kvcached.integration.vllm.patches import REGISTRY
    from kvcached.node.base import name_rules

    from . import fakes

    # Whatever the test process had applied: this serve loads kvcached as vLLM
    # does, through its plugin loader and the installed entry point.
    REGISTRY.revert()
    plugin._once.done = False
    vllm.plugins.plugins_loaded = False
    vllm.plugins.load_general_plugins()
    if not shape.dp_names:
        name_rules.dp_rank_name = common.dp_rank_name = lambda base, rank: base  # type: ignore[assignment]
    fakes.install_engine()
    cfg = fakes.ServeConfig(tp=shape.tp, pp=shape.pp, dp=shape.dp, backend=shape.backend,
                                 worker_start=shape.worker_start)
    executor = Executor.get_class(cfg)
    client: Any
    if shape.owner == "inproc":
        client = InprocClient(cfg, executor, False)
        engines: list[int] = []
        procs = getattr(client.engine_core.model_executor, "workers", None) or []
        workers = {os.getpid(): sorted(w.proc.pid for w in procs)}
    else:
        client = SyncMPClient(cfg, executor, False)
        engines = [p.pid for p in client.resources.engine_manager.processes]
        workers = {e: _workers_of(e) for e in engines}
    sigterm_default = signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    if shape.owner == "api":
        def on_term(_signum: int, _frame: Any) -> None:
            raise SystemExit(0)  # the API server's SIGTERM: the server stops, then its engine client

        signal.signal(signal.SIGTERM, on_term)
    conn.send({"owner": os.getpid(), "engines": engines, "workers": workers, "sigterm_default": sigterm_default})
    try:
        while True:
            cmd, args = conn.recv()
            if cmd == "stop":
                break
            try:
                conn.send((True, client.call_utility(cmd, *args) if shape.owner != "inproc"
                           else getattr(client.engine_core, cmd)(*args)))
            except Exception as e:
                conn.send((False, f"{type(e).__name__}: {e}"))
    finally:
        if shape.owner == "api":
            _shutdown_like_the_api_server(client)
    # What ends an offline script: its LLM goes away, vLLM's finalizer shuts the engine down.
    del client
    gc.collect()
    conn.send((True, "stopped"))


def _shutdown_like_the_api_server(client: Any) -> None:
    """client.shutdown(timeout=0): --shutdown-timeout 0, vLLM's default; vLLM's own race in it let through.

    With timeout 0, vLLM 0.33's shutdown() SIGTERMs the engines, lists those still alive, then runs
    kill_process_tree() on each. Meanwhile its engine monitor thread reads the exit code of an engine that
    has just exited, which reaps it; if that falls between kill_process_tree's psutil.Process(pid) and
    its .children(), NoSuchProcess leaves shutdown() (seen once in CI, DP=2). A real API server dies of that
    traceback too: it is vLLM's, not kvcached's, whose cleanup runs in the wrapper's finally either way and
    is what the tests judge. Only that error, for one of this client's engines that is indeed gone, passes;
    what shutdown() skipped after it (its ZMQ sockets and context) is then done as shutdown() does it.
    """
    try:
        client.shutdown(timeout=0)
    except psutil.NoSuchProcess as e:
        engines = {p.pid for p in client.resources.engine_manager.processes}
        if e.pid not in engines or psutil.pid_exists(e.pid):
            raise
        print(f"serves: vLLM's kill_process_tree lost engine {e.pid} to its monitor thread's reaping; "
              "its shutdown is finished here", file=sys.stderr, flush=True)
        client.resources()


def _join_openmp_pool() -> None:
    """Join this process's OpenMP worker threads before it forks an owner.

    libgomp has no fork handler. Once a test in this worker has run a
    parallel torch CPU op, a forked child inherits a pool whose threads it
    does not have, and hangs in its first parallel region, or in vLLM's own
    pause of the pool before it forks its engine (gomp_barrier_wait_end, seen
    under load when such a test ran earlier in the same xdist worker). Paused
    here (OpenMP 5.0, omp_pause_hard), the pool is rebuilt on this process's
    next parallel region.
    """
    import ctypes

    with open("/proc/self/maps") as f:
        libs = {line.split()[-1] for line in f if os.path.basename(line.rstrip()).startswith("libgomp")}
    for lib in libs:
        try:
            ctypes.CDLL(lib).omp_pause_resource_all(2)
        except (OSError, AttributeError):
            pass  # an OpenMP before 5.0: nothing to pause with


def start(shape: Shape, root: str, name: str, patched: bool, env: dict[str, str] | None = None) -> Serve:
    """Start a serve of `shape` under node root `root`; return once its engines answered READY."""
    _join_openmp_pool()
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_owner_main, args=(child, shape, root, name, patched, dict(env or {})), daemon=False)
    proc.start()
    child.close()
    # parent.poll blocks up to its interval itself: the wait sleeps no more on top of it.
    if not wait_until(lambda: parent.poll(0.2) or not proc.is_alive(), READY_TIMEOUT, interval=0) \
            or not parent.poll():
        proc.kill()
        proc.join(10)
        raise RuntimeError(f"serve {shape} did not start (owner exit {proc.exitcode})")
    info = parent.recv()
    return Serve(shape, name, proc, parent, info["owner"], info["engines"],
                 {int(k): v for k, v in info["workers"].items()}, info["sigterm_default"])
