"""The start-up sweep: a serve that starts on a node removes what dead serves left there, in the background.

Real harness deployments (api, engine, workers: real child processes that
claim their segment as a vLLM engine does) on a private root, their engine's
log read from a file. The session turns the sweep off for every other test's
engines (tests/conftest.py); these turn it on for the engines they start.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from kvcached import settings
from kvcached.integration.engine_claim import EngineState
from kvcached.integration.limits import Limit
from kvcached.node.base.layout import Layout
from kvcached.node.in_engine import sweep as sweep_mod
from kvcached.node.state.gclock import GcLock
from kvcached.runtime.harness import start_deployment
from kvcached.runtime.ipc.client import ping

from ..waiting import wait_for
from .engine_plant import MAPPER, Node
from .helpers import dead_deployment, state_of

ON = {settings.STARTUP_SWEEP.name: "1"}


class Serve:
    """A harness serve started with the sweep's environment, its engine's log in a file."""

    def __init__(self, layout: Layout, name: str, log: Path, env: dict[str, str]) -> None:
        self.log_path = log
        with open(log, "w") as f:
            self.d = start_deployment(name, 1, 1, layout=layout, env=env, log=f)

    def log(self) -> str:
        return self.log_path.read_text()


@pytest.fixture
def serves(deployments, layout, tmp_path):  # type: ignore[no-untyped-def]
    def start(name: str, env: dict[str, str] | None = None) -> Serve:
        s = Serve(layout, name, tmp_path / f"{name}.log", env if env is not None else ON)
        deployments.append(s.d)
        return s

    return start


def test_a_starting_serve_removes_the_dead_and_leaves_the_live(layout, uniq, deployments, serves) -> None:
    live = start_deployment(f"{uniq}live", 2, 1, layout=layout)  # started with the sweep off (the session's)
    deployments.append(live)
    dead = dead_deployment(layout, f"{uniq}dead")
    buffer = Node(layout).file("psm_0a1b2c3d")  # an engine's dead buffer: not the sweep's unless asked
    s = serves(f"{uniq}new")
    wait_for(lambda: not any(os.path.lexists(p) for p in dead), timeout=30, explain=s.log)
    wait_for(lambda: "start-up sweep of" in s.log() and " removed 4 in " in s.log(), explain=s.log)
    for p in dead:
        assert f"start-up sweep removed {p}\n" in s.log()
    assert all(os.path.lexists(p) for p in state_of(live)), "the live serve lost state"
    assert ping(layout.socket_path(live.name, 1))["pid"] == live.worker_pids[(0, 1)]
    assert all(os.path.lexists(p) for p in state_of(s.d))
    assert os.path.exists(buffer)


def test_switched_off_it_touches_nothing(layout, uniq, serves) -> None:
    dead = dead_deployment(layout, f"{uniq}dead")
    s = serves(f"{uniq}new", {settings.STARTUP_SWEEP.name: "0"})
    assert "start-up sweep off (KVCACHED_STARTUP_SWEEP=0)" in s.log()
    assert "start-up sweep of /" not in s.log()
    assert ping(layout.socket_path(s.d.name, 0))  # well past READY
    s.d.kill()
    assert all(os.path.lexists(p) for p in dead)


def test_a_busy_gc_lock_means_skip(layout, uniq, serves) -> None:
    dead = dead_deployment(layout, f"{uniq}dead")
    with GcLock(layout):
        s = serves(f"{uniq}new")
        wait_for(lambda: "skipped" in s.log(), explain=s.log)
    assert f"skipped: another kvctl gc is running (PID {os.getpid()} holds" in s.log()
    assert all(os.path.lexists(p) for p in dead)


def test_two_serves_starting_at_once_do_not_fight(layout, uniq, serves) -> None:
    dead = dead_deployment(layout, f"{uniq}dead")
    started: list[Serve] = []
    threads = [threading.Thread(target=lambda n=n: started.append(serves(f"{uniq}s{n}"))) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(started) == 2
    wait_for(lambda: not any(os.path.lexists(p) for p in dead), timeout=30,
             explain=lambda: [s.log() for s in started])
    for s in started:
        wait_for(lambda s=s: " removed " in s.log() or "skipped" in s.log(), explain=s.log)
        assert "failed" not in s.log() and "Traceback" not in s.log()
    swept = [s for s in started if " removed 4 in " in s.log()]
    assert len(swept) <= 2 and sum(s.log().count("start-up sweep removed ") for s in started) == 4
    for s in started:
        assert all(os.path.lexists(p) for p in state_of(s.d))


def test_engine_leftovers_only_when_asked(layout, uniq, serves, children) -> None:
    n = Node(layout)
    dead_buffer, live_buffer = n.file("psm_0a1b2c3d"), n.file("nccl-Ab3dE9")
    children.spawn(MAPPER, live_buffer)
    dead = dead_deployment(layout, f"{uniq}dead")
    s = serves(f"{uniq}new", {**ON, settings.STARTUP_SWEEP_ENGINES.name: "1"})
    wait_for(lambda: not os.path.exists(dead_buffer) and not any(os.path.lexists(p) for p in dead), timeout=30,
             explain=s.log)
    assert "(engine leftovers too)" in s.log()
    wait_for(lambda: " removed 5 in " in s.log(), explain=s.log)
    assert f"start-up sweep removed {dead_buffer}\n" in s.log()
    assert os.path.exists(live_buffer)


def test_it_keeps_to_its_own_uid(layout, uniq, serves, unpriv_user) -> None:  # type: ignore[no-untyped-def]
    """A root engine's sweep leaves another user's dead serve alone (root's kvctl gc would take it)."""
    theirs = dead_deployment(layout, f"{uniq}theirs")
    for p in theirs:
        os.chown(p, unpriv_user.pw_uid, unpriv_user.pw_gid, follow_symlinks=False)
    mine = dead_deployment(layout, f"{uniq}mine")
    s = serves(f"{uniq}new")
    wait_for(lambda: not any(os.path.lexists(p) for p in mine), timeout=30, explain=s.log)
    wait_for(lambda: " removed 4 in " in s.log(), explain=s.log)
    assert all(os.path.lexists(p) for p in theirs)


# In process: the real EngineState, and the sweep's thread. ---------------------------------------------------


def test_claiming_never_waits_on_the_sweep(layout, uniq, monkeypatch) -> None:
    """The engine's claim returns (and so its start-up goes on to READY) while the sweep is still at work."""
    monkeypatch.setenv(settings.STARTUP_SWEEP.name, "1")
    release = threading.Event()
    entered = threading.Event()

    def slow_sweep(layout: Layout, **_: object) -> sweep_mod.SweepResult:
        entered.set()
        release.wait(60)  # a sweep of a huge node
        return sweep_mod.SweepResult()

    monkeypatch.setattr(sweep_mod, "sweep", slow_sweep)
    engine = EngineState(layout, uniq)
    try:
        assert engine.claim(Limit(1 << 20, "test")) is not None
        assert entered.wait(10)  # the sweep runs...
        sweeper = next(t for t in threading.enumerate() if t.name == "kvcached-startup-sweep")
        assert sweeper.daemon and sweeper.is_alive()  # ...and the claim has returned all the same
        assert engine.segment is not None and os.path.exists(engine.segment.path)
        assert sweep_mod.start_sweep(layout) is None  # once per start
    finally:
        release.set()
        engine.release()
    for t in threading.enumerate():
        if t.name == "kvcached-startup-sweep":
            t.join(10)
