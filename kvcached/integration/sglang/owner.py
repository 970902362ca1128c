"""The owner side: the process that launched SGLang's schedulers cleans up after their confirmed exit.

Main (`sglang serve`, `python -m sglang.launch_server`, a script's `Engine`)
launches the schedulers (`Engine._launch_scheduler_processes`) and is the one
process every stop path passes through with its children dead: it ends each of
them in `kill_process_tree`, which SIGKILLs every descendant and waits until
each is dead (docs/SGLANG.md, "Stop paths"):

- after a SIGTERM to main alone, to the process group, after Ctrl-C and in
  the offline `Engine.shutdown`: `kill_process_tree(os.getpid(),
  include_parent=False)`, then main goes on;
- after a crash (a scheduler's SIGQUIT, or main's watchdog seeing a child
  die): `kill_process_tree(os.getpid())`, which SIGKILLs main itself right
  after its children. Nothing in main runs afterwards, so the wrapper first
  kills and waits for the children alone, cleans up, then lets SGLang kill main.

`sglang-owner-cleanup` wraps both: once the schedulers are ready
(`wait_for_ready`) main captures every DP rank's segment and worker sockets
(`kvcached.integration.engine_owner.EngineOwner`, the decision path vLLM's
owner takes too); after `kill_process_tree` it confirms each scheduler's exit
(its own children by exit code, a DP controller's by PID and start time) and
removes what no live process serves. `sglang-offline-shutdown` runs the same
cleanup after `Engine.shutdown` (idempotent), should its kill not go through
our wrapper. Main is the owner for every shape: with a DP controller its
`kill_process_tree` reaches the controller's schedulers too.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass
from typing import Any

from ... import settings
from ..patchkit import Changes, Patch, ShapeError, argument, params, source
from .common import M_COMMON, M_ENGINE, M_RUNTIME, module, serve_names, stand_aside

log = logging.getLogger(__name__)

# The owners of this process (an offline script may start several Engines, one after another); a container.
_OWNERS: list[Any] = []


class Descendant:
    """A scheduler this process did not start itself (a DP controller's), known by PID and start time.

    Its exit code is its parent's to read; what the owner needs is that it
    exited: `exitcode` is 0 once no process runs under that PID and start
    time (gone, a zombie, or the PID reused), None while it runs.
    """

    def __init__(self, pid: int) -> None:
        self.pid: int | None = pid
        self._started = _start_time(pid)

    @property
    def exitcode(self) -> int | None:
        """None while it runs; 0 once it has exited."""
        return 0 if self._started is None or not _runs(self.pid or 0, self._started) else None

    def join(self, timeout: float | None = None) -> None:
        """Wait until it exits, up to `timeout` seconds."""
        deadline = time.monotonic() + (timeout or 0.0)
        while self.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.02)


def _start_time(pid: int) -> float | None:
    import psutil

    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


def _runs(pid: int, started: float) -> bool:
    import psutil

    try:
        p = psutil.Process(pid)
        return p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@dataclass
class ServeOwner:
    """The schedulers one launch started and the cleanup duty over their names, from the launch to the last kill."""

    procs: list[Any]  # the multiprocessing.Process objects main started (schedulers or the DP controller)
    names: list[str]
    tp_size: int  # worker sockets per PP stage of one DP rank
    pp_size: int
    owner: Any = None  # the EngineOwner, made once the schedulers' PIDs are known (at ready, or at the kill)

    def duty(self, child_pids: list[int] | None = None) -> Any:
        """The EngineOwner over every scheduler of this launch (made once); never raises."""
        if self.owner is None:
            from .. import layout_from_env
            from ..engine_owner import EngineOwner

            mine = {p.pid for p in self.procs}
            procs = list(self.procs) + [Descendant(pid) for pid in child_pids or () if pid not in mine]
            self.owner = EngineOwner(procs, layout_from_env(), self.names, self.tp_size, self.pp_size)
        return self.owner

    def ready(self, child_pids: list[int]) -> None:
        """Every scheduler answered ready: capture what they made (segments, sockets)."""
        self.duty(child_pids).capture()

    def after_kill(self) -> None:
        """The children were SIGKILLed: confirm their exits, remove what nobody serves. Never raises."""
        try:
            owner = self.duty()
            # Killed during launch (a scheduler failed before the others were ready): capture now. What a
            # live process still serves or leases is kept by the decision all the same.
            owner.capture()
            owner.after_shutdown()
        except Exception as e:
            log.warning("kvcached owner: SGLang cleanup of %s failed: %s", ", ".join(self.names), e)


def owners() -> list[Any]:
    """The owners of this process whose cleanup is not complete."""
    return [o for o in _OWNERS if o.owner is None or not o.owner.complete]


def _launch(wrapped: Any, cls: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    launched = wrapped(*args, **kwargs)
    try:
        result, procs = launched
        if procs is None:
            log.info("kvcached: SGLang %s launched no scheduler processes (Ray actors): not covered",
                     getattr(cls, "__name__", cls))
            return launched
        if stand_aside("main") is not None:
            return launched
        parallel = module(M_RUNTIME).get_parallel()
        dp = int(parallel.num_dp_ranks)
        tp = int(parallel.tp_size)
        tp = max(1, tp // int(parallel.attn_dp_size)) if parallel.attn_dp_enabled else tp
        serve = ServeOwner(list(procs), serve_names(dp), tp, int(parallel.pp_size))
        _OWNERS.append(serve)
        wait = result.wait_for_ready

        def wait_for_ready() -> Any:
            out = wait()
            serve.ready(list(getattr(result, "all_child_pids", None) or []))
            return out

        result.wait_for_ready = wait_for_ready
    except Exception as e:
        log.warning("kvcached: SGLang owner cleanup not set up: %s", e)
    return launched


def _after_kill() -> None:
    for serve in owners():
        serve.after_kill()


def _kill_tree(wrapped: Any, _instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    parent = argument(wrapped, args, kwargs, "parent_pid")
    if not owners() or parent not in (None, os.getpid()):
        return wrapped(*args, **kwargs)  # not an owner, or not its own tree: SGLang's own kill, untouched
    include_parent = argument(wrapped, args, kwargs, "include_parent")
    if parent is not None and include_parent is not False:
        # SGLang would SIGKILL this very process right after its children: kill and wait for them alone,
        # clean up, and only then let it.
        wait = argument(wrapped, args, kwargs, "wait_timeout")
        wait = settings.OWNER_EXIT_WAIT_S.get() if wait is None else min(float(wait), 60.0)
        try:
            wrapped(parent, include_parent=False, skip_pid=argument(wrapped, args, kwargs, "skip_pid"),
                    wait_timeout=max(wait, 0.1))
        except Exception as e:  # some child outlived the wait: its exit is unconfirmed, and its state is kept
            log.warning("kvcached owner: %s", e)
        _after_kill()
        return wrapped(*args, **kwargs)
    try:
        return wrapped(*args, **kwargs)
    finally:
        _after_kill()


def _shutdown(wrapped: Any, _engine: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    try:
        return wrapped(*args, **kwargs)
    finally:
        _after_kill()


_SELF_KILL = re.compile(r"parent_pid\s*==\s*os\.getpid\(\)")
_WAITS = re.compile(r"if\s+wait_timeout\s+is\s+not\s+None")


def probe_owner() -> tuple[Any, Any]:
    """(sglang.srt.utils.common, Engine) when kill_process_tree and the scheduler launch have the known shapes."""
    common = module(M_COMMON)
    kill = getattr(common, "kill_process_tree", None)
    if params(kill)[:4] != ["parent_pid", "include_parent", "skip_pid", "wait_timeout"]:
        raise ShapeError("kill_process_tree(parent_pid, include_parent, skip_pid, wait_timeout) is missing or changed")
    src = source(kill) or ""
    if not _SELF_KILL.search(src) or not _WAITS.search(src):
        raise ShapeError("kill_process_tree no longer kills its caller itself, or no longer waits for the killed")
    engine = getattr(module(M_ENGINE), "Engine", None)
    launch = None if engine is None else engine.__dict__.get("_launch_scheduler_processes")
    if not isinstance(launch, classmethod):
        raise ShapeError("Engine._launch_scheduler_processes is no longer a classmethod")
    if params(launch.__func__)[:4] != ["cls", "server_args", "port_args", "run_scheduler_process_func"]:
        raise ShapeError("Engine._launch_scheduler_processes(server_args, port_args, run_scheduler_process_func) "
                         "changed")
    if "wait_for_ready" not in (source(launch.__func__) or ""):
        raise ShapeError("Engine._launch_scheduler_processes no longer hands back a wait_for_ready")
    return common, engine


def install_owner(changes: Changes, found: tuple[Any, Any]) -> None:
    """Wrap kill_process_tree (and SGLang's from-imports of it) and the scheduler launch."""
    common, engine = found
    changes.wrap_everywhere(common, "kill_process_tree", _kill_tree)
    changes.wrap(engine, "_launch_scheduler_processes", _launch)
    changes.on_undo(_OWNERS.clear)


_OWN_KILL = re.compile(r"kill_process_tree\(\s*os\.getpid\(\),\s*include_parent=False")


def probe_shutdown() -> Any:
    """Engine, when its `shutdown(self)` ends in SIGKILLing this process's children."""
    engine = getattr(module(M_ENGINE), "Engine", None)
    if engine is None or params(engine.__dict__.get("shutdown")) != ["self"]:
        raise ShapeError("Engine.shutdown() is missing or takes arguments")
    if not _OWN_KILL.search(source(engine.shutdown) or ""):
        raise ShapeError("Engine.shutdown no longer ends in kill_process_tree(os.getpid(), include_parent=False)")
    return engine


def install_shutdown(changes: Changes, engine: Any) -> None:
    """Clean up after Engine.shutdown."""
    changes.wrap(engine, "shutdown", _shutdown)


OWNER = Patch(
    name="sglang-owner-cleanup",
    does="main captures its schedulers' state once they are ready and, after kill_process_tree confirmed "
         "their exits, removes what nobody serves (before SGLang kills main itself)",
    targets=(f"{M_ENGINE}:Engine._launch_scheduler_processes", f"{M_COMMON}:kill_process_tree"),
    probe=probe_owner,
    install=install_owner,
)
SHUTDOWN = Patch(
    name="sglang-offline-shutdown",
    does="the offline Engine.shutdown() cleans up after SIGKILLing the schedulers",
    targets=(f"{M_ENGINE}:Engine.shutdown",),
    probe=probe_shutdown,
    install=install_shutdown,
    requires=("sglang-owner-cleanup",),
)

PATCHES = (OWNER, SHUTDOWN)
