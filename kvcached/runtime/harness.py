"""A real local deployment for tests, benchmarks and `kvctl demo`.

Three tiers in one new process group, shaped like a vLLM serve:

    api (owner of the engine; runs owner-side cleanup when enabled)
     └─ engine (creates the segment, holds its lease, starts the start-up sweep, spawns the workers)
         └─ worker × TP × PP (each serves `[pp<k>/]w<r>.sock`)

`stop_like_vllm()` stops it the way vLLM 0.33 does: SIGTERM to the process
group, then SIGKILL to the engine tree almost at once.

Run one by hand: `python -m kvcached.runtime.harness --name demo --tp 2 --pp 2`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import psutil  # imported up front: a lazy import inside a signal handler can be interrupted

from ..node import Layout

READY = "KVCACHED-READY "
DEFAULT_LIMIT = 1 << 30


@dataclass
class Deployment:
    """Handle on a running harness deployment; a context manager that always tears it down."""

    name: str
    layout: Layout
    tp: int
    pp: int
    api: subprocess.Popen
    api_pid: int
    engine_pid: int
    worker_pids: dict[tuple[int, int], int] = field(default_factory=dict)  # (stage, rank) -> pid

    @property
    def pgid(self) -> int:
        return self.api_pid

    @property
    def pids(self) -> list[int]:
        return [self.api_pid, self.engine_pid, *self.worker_pids.values()]

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:
            pass

    def signal(self, pid: int, sig: int) -> None:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    def stop_like_vllm(self, delay: float = 0.02) -> None:
        """Process-group SIGTERM, then SIGKILL to the engine tree almost at once (vLLM 0.33, shutdown timeout 0).

        The api (the engine owner) is not killed: like vLLM's API server it
        kills its engine tree itself, then exits (after its cleanup, if enabled).
        """
        self.signal_group(signal.SIGTERM)
        time.sleep(delay)
        for pid in (self.engine_pid, *self.worker_pids.values()):
            self.signal(pid, signal.SIGKILL)
        self.wait()

    def kill(self) -> None:
        """SIGKILL the whole group and reap what we can."""
        self.signal_group(signal.SIGCONT)
        self.signal_group(signal.SIGKILL)
        self.wait()

    def wait(self, timeout: float = 10.0) -> None:
        """Reap the api and wait until every process of the deployment is gone (or a zombie)."""
        try:
            self.api.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(_alive(p) for p in self.pids):
            time.sleep(0.01)

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


def _alive(pid: int) -> bool:
    """Running, or a zombie whose other threads are still exiting (and still hold its files)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        if state not in (b"Z", b"X"):
            return True
        return len(os.listdir(f"/proc/{pid}/task")) > 1
    except (OSError, IndexError):
        return False


def _base_cmd(role: str, name: str, layout: Layout, tp: int, pp: int) -> list[str]:
    return [sys.executable, "-m", "kvcached.runtime.harness", "--role", role, "--name", name,
            "--root", layout.root, "--tp", str(tp), "--pp", str(pp)]


def start_deployment(name: str, tp: int = 1, pp: int = 1, *, layout: Layout | None = None,
                     limit: int = DEFAULT_LIMIT, owner_cleanup: bool = False, pool: bool = False,
                     timeout: float = 30.0, env: dict[str, str] | None = None,
                     log: IO[Any] | None = None) -> Deployment:
    """Start api + engine + TP×PP workers in a new process group; return once every worker answers.

    `log`: where the deployment's stderr (the engine's log) goes; default: ours.
    """
    layout = layout or Layout()
    cmd = _base_cmd("api", name, layout, tp, pp) + ["--limit", str(limit)]
    if owner_cleanup:
        cmd.append("--owner-cleanup")
    if pool:
        cmd.append("--pool")
    child_env = {**os.environ, **(env or {}), "KVCACHED_IPC_NAME": name}
    api = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, stderr=log, env=child_env,
                           start_new_session=True, text=True)
    info = _read_ready(api, timeout)
    if info is None:
        try:
            os.killpg(api.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        api.wait()
        raise RuntimeError(f"harness deployment {name!r} did not become ready (api exit {api.returncode})")
    workers = {(w["stage"], w["rank"]): w["pid"] for w in info["workers"]}
    return Deployment(name, layout, tp, pp, api, api.pid, info["engine"], workers)


def _read_ready(proc: subprocess.Popen, timeout: float) -> dict[str, Any] | None:
    import selectors

    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                return None
            line = proc.stdout.readline()
            if not line:
                return None
            if line.startswith(READY):
                return json.loads(line[len(READY):])
    finally:
        sel.close()
    return None


def _wait_listening(paths: Sequence[str], procs: Sequence[subprocess.Popen], timeout: float) -> None:
    from .ipc.client import ping

    deadline = time.monotonic() + timeout
    for path, proc in zip(paths, procs):
        while True:
            try:
                ping(path, timeout=1.0)
                break
            except Exception:
                if proc.poll() is not None:
                    raise RuntimeError(f"worker for {path} exited with {proc.returncode}") from None
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)


def _run_worker(args: argparse.Namespace, layout: Layout) -> int:
    from .ipc.listener import WorkerListener

    listener = WorkerListener(layout, args.name, args.rank, args.stage)
    if args.pool:
        try:
            from .pool import attach_worker
            attach_worker(listener)
        except ImportError:
            pass
    stopping = started = False

    def on_term(signum: int, _frame: object) -> None:
        nonlocal stopping
        if stopping:
            return  # a second SIGTERM while the first one's stop() runs: let it finish
        stopping = True
        if started:
            listener.stop()  # graceful worker shutdown; vLLM's SIGKILL usually beats it
            os._exit(0)
        # Else start() is below us on this thread's stack: exiting here would leave its node
        # behind. It returns to the check after it, which stops.

    # Installed before the listener exists: a SIGTERM in between must still run stop().
    signal.signal(signal.SIGTERM, on_term)
    listener.start()
    started = True
    if stopping:
        listener.stop()
        os._exit(0)
    while True:
        signal.pause()


def _run_engine(args: argparse.Namespace, layout: Layout) -> int:
    import logging

    from ..node import claim_segment, start_sweep

    # The engine's log is its stderr, as a vLLM engine's is: the start-up sweep says there what it removed.
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    lease, _, how = claim_segment(layout, args.name, args.limit)
    start_sweep(layout)  # like a vLLM engine's claim: in the background, never before READY
    workers: list[tuple[int, int, subprocess.Popen]] = []
    stopping = False

    def on_term(signum: int, _frame: object) -> None:
        # Like EngineCore: stop the workers, then exit through os._exit, so the
        # segment's destructor never runs (upstream leaves the segment behind).
        nonlocal stopping
        if stopping:
            return  # re-entering Popen.wait() from a second SIGTERM would deadlock
        stopping = True
        for _, _, p in workers:
            p.terminate()
        for _, _, p in workers:
            # Not p.wait(): this handler may have interrupted a p.poll() on this thread that
            # holds the Popen's non-reentrant waitpid lock (the wait for the workers to listen).
            try:
                os.waitpid(p.pid, 0)
            except ChildProcessError:
                pass  # reaped already
        os._exit(0)

    # Before the first worker and long before READY: once the owner has seen
    # READY it may SIGTERM us at any moment, and a default SIGTERM would leave
    # the workers running.
    signal.signal(signal.SIGTERM, on_term)
    for stage in range(args.pp):
        for rank in range(args.tp):
            cmd = _base_cmd("worker", args.name, layout, args.tp, args.pp)
            cmd += ["--rank", str(rank), "--stage", str(stage)]
            if args.pool:
                cmd.append("--pool")
            workers.append((stage, rank, subprocess.Popen(cmd, stdin=subprocess.DEVNULL)))
    try:
        _wait_listening(
            [layout.socket_path(args.name, r, s) for s, r, _ in workers], [p for _, _, p in workers], timeout=30
        )
    except Exception as e:
        print(f"harness engine: {e}", file=sys.stderr)
        for _, _, p in workers:
            p.kill()
        return 1
    if args.pool:
        try:
            from .pool import start_engine_pool
        except ImportError:  # the extension is not built: the deployment runs without a pool
            pass
        else:
            # Bound for the engine's life (this frame never returns): the pool's
            # thread follows `kvctl limit` and keeps used/prealloc current.
            pool = start_engine_pool(layout, args.name, args.tp, args.pp)  # noqa: F841
    print(READY + json.dumps({"workers": [{"stage": s, "rank": r, "pid": p.pid} for s, r, p in workers]}), flush=True)

    while True:
        signal.pause()


def _run_api(args: argparse.Namespace, layout: Layout) -> int:
    from ..node import SegmentCleanup, WorkerSocketCleanup

    engine = subprocess.Popen(
        _base_cmd("engine", args.name, layout, args.tp, args.pp)
        + ["--limit", str(args.limit)]
        + (["--pool"] if args.pool else []),
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )

    def on_term(signum: int, _frame: object) -> None:
        # vLLM 0.33 with --shutdown-timeout 0: SIGTERM the engine, then kill its tree
        # at once. Only signals here: the main thread may be inside engine.wait(),
        # and Popen.wait() is not re-entrant (waiting here too would deadlock).
        try:
            engine.terminate()
        except OSError:
            pass
        _kill_tree(engine.pid)

    # Installed as soon as there is an engine to stop, long before READY: a
    # SIGTERM right after READY must reach this handler, not the default action.
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    info = _read_ready(engine, timeout=30)
    if info is None:
        engine.kill()
        return 1
    seg_cleanup = SegmentCleanup(layout, args.name)
    sock_cleanup = WorkerSocketCleanup(layout, args.name, args.tp, args.pp)
    if args.owner_cleanup:
        seg_cleanup.capture()
        sock_cleanup.capture()
    print(READY + json.dumps({"engine": engine.pid, **info}), flush=True)
    engine.wait()  # a confirmed exit code: only now may the owner clean up
    if args.owner_cleanup:
        # Stopped or orphaned workers keep their nodes served; retry a little,
        # then leave what is still live to them and to `kvctl gc`.
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            if sock_cleanup.cleanup().complete & seg_cleanup.cleanup().complete:
                break
            time.sleep(0.1)
    os._exit(0)


def _kill_tree(pid: int) -> None:
    try:
        procs = psutil.Process(pid).children(recursive=True) + [psutil.Process(pid)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def _event(kind: str, **fields: Any) -> None:
    print(json.dumps({"event": kind, **fields}), flush=True)


def _run_demo(args: argparse.Namespace, layout: Layout) -> int:
    """Start a deployment with the pool, report it, stop it like vLLM 0.33, report that everything died."""
    from .. import settings
    from .ipc.client import ping

    # `kvctl demo` touches nothing on the node but its own deployment: no start-up sweep of the rest.
    dep = start_deployment(args.name, args.tp, args.pp, layout=layout, limit=args.limit, pool=True,
                           env={settings.STARTUP_SWEEP.name: "0"})
    try:
        answers = {
            f"pp{s}/w{r}": ping(layout.socket_path(args.name, r, s))["pid"] for (s, r) in sorted(dep.worker_pids)
        }
        _event("ready", name=args.name, pgid=dep.pgid, api=dep.api_pid, engine=dep.engine_pid, answers=answers)
        dep.stop_like_vllm()
    finally:
        dep.kill()
    _event("stopped", alive=[p for p in dep.pids if _alive(p)])
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m kvcached.runtime.harness",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--role",
        choices=("launcher", "demo", "api", "engine", "worker"),
        default="launcher",
        help="launcher: start a deployment, print it, leave it running; demo: start one, then stop it "
        "like vLLM 0.33, printing one JSON line per step (what `kvctl demo` reads)",
    )
    ap.add_argument("--name", required=True, help="IPC name of the deployment")
    ap.add_argument("--root", default="/", help="re-base /tmp and /dev/shm under this directory")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--stage", type=int, default=0)
    ap.add_argument("--limit", type=int, default=DEFAULT_LIMIT)
    ap.add_argument("--owner-cleanup", action="store_true", help="the api cleans up after its engine exits")
    ap.add_argument("--pool", action="store_true", help="run the elastic KV pool (needs the extension)")
    args = ap.parse_args(argv)
    layout = Layout(args.root)
    if args.role == "launcher":
        dep = start_deployment(
            args.name,
            args.tp,
            args.pp,
            layout=layout,
            limit=args.limit,
            owner_cleanup=args.owner_cleanup,
            pool=args.pool,
        )
        print(
            json.dumps(
                {
                    "name": dep.name,
                    "pgid": dep.pgid,
                    "api": dep.api_pid,
                    "engine": dep.engine_pid,
                    "workers": {f"pp{s}/w{r}": p for (s, r), p in dep.worker_pids.items()},
                }
            )
        )
        return 0
    if args.role == "demo":
        return _run_demo(args, layout)
    if args.role == "worker":
        return _run_worker(args, layout)
    if args.role == "engine":
        return _run_engine(args, layout)
    return _run_api(args, layout)


if __name__ == "__main__":
    sys.exit(main())
