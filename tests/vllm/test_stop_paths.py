"""Every executor shape of a vLLM 0.33 serve, started from vLLM's own classes and stopped the way vLLM stops it.

Each serve runs in its own session (see serves.py): vLLM's client, engine
launch, `EngineCoreProc` with its handshakes, signal handling and busy loop,
the real executors and worker processes; only what needs a GPU or a model is
replaced (fakes.py). For each shape, while it runs, the installed
`kvctl` must show it live with its processes and `kvctl gc --yes --min-age 0`
must remove nothing; once it has stopped, nothing of it may be left. The
unpatched runs are vLLM as installed: kvctl finds nothing to show at all.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
from typing import Any

import pytest

from ..waiting import wait_until

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed here (run scripts/install-vllm.sh in this venv)")
pytestmark = pytest.mark.vllm

from kvcached.node.base.layout import Layout  # noqa: E402
from kvcached.node.base.name_rules import dp_rank_name  # noqa: E402
from kvcached.node.state.gclock import LOCK_NAME  # noqa: E402

from .. import conftest  # noqa: E402
from ..conftest import KVCTL  # noqa: E402
from . import serves  # noqa: E402
from .fakes import KV_BYTES  # noqa: E402
from .serves import Serve, Shape, gone  # noqa: E402

LIMIT = 2 << 30
SERVE_ENV = {"KVCACHED_LIMIT": "2G", "KVCACHED_PUBLISH_INTERVAL_S": "0.05"}

both = conftest.both(indirect=False)


def kvctl(layout: Layout, *args: str) -> tuple[int, Any]:
    """The installed kvctl on the test's node root, as an operator runs it; (exit code, parsed JSON)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_")}
    r = subprocess.run([KVCTL, "--root", layout.root, *args], capture_output=True, text=True, env=env, timeout=120)
    return r.returncode, json.loads(r.stdout) if r.stdout.strip() else None


@pytest.fixture
def start(layout, uniq) -> Any:
    started: list[Serve] = []

    def run(shape: Shape, patched: bool) -> Serve:
        s = serves.start(shape, layout.root, uniq, patched, SERVE_ENV)
        started.append(s)
        return s

    yield run
    for s in started:
        s.kill()


@pytest.fixture
def start_env(layout, uniq) -> Any:
    """Start a patched serve with more environment than SERVE_ENV."""
    started: list[Serve] = []

    def run(shape: Shape, env: dict[str, str]) -> Serve:
        s = serves.start(shape, layout.root, uniq, True, {**SERVE_ENV, **env})
        started.append(s)
        return s

    yield run
    for s in started:
        s.kill()


def node_entries(layout: Layout) -> list[str]:
    """Everything under the node root's /tmp and /dev/shm but kvctl gc's lock (the serve writes nothing else there)."""
    return [n for n in sorted(os.listdir(layout.tmp_dir)) + sorted(os.listdir(layout.shm_dir)) if n != LOCK_NAME]


def expect_live(layout: Layout, s: Serve, ranks: dict[str, list[int]], tp: int = 1, pp: int = 1) -> dict[str, Any]:
    """kvctl inspect: each name live with its segment, sockets and processes; gc removes nothing. The view."""
    code, view = kvctl(layout, "inspect", "--json")
    assert code == 0, view
    deps = {d["name"]: d for d in view["deployments"]}
    assert set(deps) == set(ranks), view
    for name, pids in ranks.items():
        d = deps[name]
        assert d["state"] == "live", d
        assert d["segment"]["limit"] == LIMIT and d["segment"]["prealloc"] + d["segment"]["used"] == KV_BYTES, d
        sockets = sorted(e["path"] for e in d["entries"] if e["kind"] == "socket")
        assert sockets == sorted(p for _, _, p in layout.socket_paths(name, tp, pp)), d
        assert all(e["state"] == "live" for e in d["entries"]), d["entries"]
        shown = {p["pid"] for p in d["processes"]}
        assert set(pids) <= shown, (pids, d["processes"])
    before = node_entries(layout)
    code, gc = kvctl(layout, "gc", "--yes", "--min-age", "0", "--json")
    assert code == 0 and [e for e in gc["entries"] if e["action"] != "kept"] == [], gc
    assert node_entries(layout) == before
    return view


def expect_nothing_left(layout: Layout, s: Serve, timeout: float = 30.0) -> None:
    """Every process of the serve gone, and nothing of it left on the node."""
    wait_until(lambda: all(gone(p) for p in s.pids), timeout, interval=0.05)
    assert all(gone(p) for p in s.pids), [p for p in s.pids if not gone(p)]
    assert node_entries(layout) == []
    assert kvctl(layout, "inspect", "--json")[1]["deployments"] == []


def expect_nothing_made(layout: Layout) -> None:
    """vLLM as installed: no segment, no socket, nothing for kvctl to show."""
    assert kvctl(layout, "inspect", "--json")[1]["deployments"] == []
    assert node_entries(layout) == []


def stop_like_vllm_serve(s: Serve) -> None:
    """`vllm serve` gets a process-group SIGTERM; its API server shuts the engines down with timeout 0."""
    s.group_sigterm()
    assert s.wait_exit(60) == 0


@both
def test_tp1_engine_serves_its_rank_and_claims_the_segment(layout, uniq, start, patched) -> None:
    """TP=1 is UniProcExecutor: the engine process itself serves w0.sock, claims the segment, obeys `kvctl limit`."""
    s = start(Shape(owner="api", tp=1), patched)
    (engine,) = s.engines
    assert s.workers[engine] == []  # no worker process: the model runs in EngineCore
    if not patched:
        expect_nothing_made(layout)
        stop_like_vllm_serve(s)
        return
    expect_live(layout, s, {uniq: [s.owner, engine]})
    code, rows = kvctl(layout, "list", "--json")
    assert code == 0 and [(r["ipc"], r["limit_bytes"]) for r in rows] == [(uniq, LIMIT)], rows
    # Requests hold blocks of vLLM's block pool: the engine publishes them as used.
    usage = s.call("kvcached_test_take_blocks", 16)
    want = int(KV_BYTES * usage)
    assert serves_segment(layout, uniq, lambda seg: seg["used"] == want and seg["prealloc"] == KV_BYTES - want)
    s.call("kvcached_test_take_blocks", -16)
    assert serves_segment(layout, uniq, lambda seg: seg["used"] == 0)
    code, out = kvctl(layout, "limit", uniq, "1G", "--json")
    assert code == 0, out
    assert serves_segment(layout, uniq, lambda seg: seg["limit"] == 1 << 30)
    stop_like_vllm_serve(s)
    expect_nothing_left(layout, s)


def serves_segment(layout: Layout, name: str, pred: Any, timeout: float = 10.0) -> bool:
    """Wait until the segment of `name`, as kvctl inspect reads it, satisfies `pred`."""

    def served() -> bool:
        view = kvctl(layout, "inspect", name, "--json")[1]
        seg = view["deployments"][0]["segment"] if view and view.get("deployments") else None
        return seg is not None and bool(pred(seg))

    return wait_until(served, timeout, interval=0.1)


@both
def test_tp2_pp2_forked_workers(layout, uniq, start, patched) -> None:
    """MultiprocExecutor, TP x PP: each forked worker serves its `[pp<k>/]w<r>.sock`; the engine holds the segment."""
    s = start(Shape(owner="api", tp=2, pp=2), patched)
    (engine,) = s.engines
    assert len(s.workers[engine]) == 4
    if not patched:
        expect_nothing_made(layout)
        stop_like_vllm_serve(s)
        return
    expect_live(layout, s, {uniq: [s.owner, engine, *s.workers[engine]]}, tp=2, pp=2)
    stop_like_vllm_serve(s)
    expect_nothing_left(layout, s)


def test_a_serve_starts_from_a_test_process_that_ran_openmp(layout, uniq, start) -> None:
    """A parallel torch CPU op earlier in this process (another test, in the same xdist worker) leaves
    libgomp's pool up; the owner forked from it then hung in vLLM's pause of that pool before its own fork
    of the workers, until serves.start joined the pool first (a run under load lost three tests to it)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        m = torch.ones(256, 256)
        for _ in range(3):
            m @ m
    finally:
        torch.set_num_threads(threads)
    s = start(Shape(owner="api", tp=2), True)
    (engine,) = s.engines
    assert len(s.workers[engine]) == 2
    stop_like_vllm_serve(s)
    expect_nothing_left(layout, s)


def _arg_start(pid: int) -> int:
    """Where the process's argument block starts (fields after the command name, which may hold spaces)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[45])


@both
def test_spawned_worker(layout, uniq, start, patched) -> None:
    """A worker started by multiprocessing spawn (vLLM's way once CUDA is up) loads kvcached by the plugin loader."""
    s = start(Shape(owner="api", tp=1, backend="mp", worker_start="spawn"), patched)
    (engine,) = s.engines
    (worker,) = s.workers[engine]
    with open(f"/proc/{worker}/cmdline", "rb") as f:
        cmdline = f.read()
    if importlib.util.find_spec("setproctitle") is not None:
        # vLLM declares setproctitle (and scripts/install-sglang.sh installs it): vLLM titles its TP=1
        # worker `VLLM::Worker`, and the title replaces spawn's command line.
        assert cmdline.rstrip(b"\0").split(b"\0") == [b"VLLM::Worker"], cmdline
    else:
        assert b"multiprocessing.spawn" in cmdline, cmdline
    # A fresh interpreter, not a fork of the engine, whatever the title: the kernel placed its argument
    # block anew at exec (a fork inherits its parent's address, field 48 of /proc/<pid>/stat).
    if open("/proc/sys/kernel/randomize_va_space").read().strip() != "0":
        assert _arg_start(worker) != _arg_start(engine)
    if not patched:
        expect_nothing_made(layout)
        stop_like_vllm_serve(s)
        return
    expect_live(layout, s, {uniq: [s.owner, engine, worker]})
    stop_like_vllm_serve(s)
    expect_nothing_left(layout, s)


@pytest.mark.parametrize(
    "patched, dp_names", [(True, True), (False, True), (True, False)], ids=["patched", "unpatched", "dp-names-reverted"]
)
def test_data_parallel_ranks_each_get_a_name(layout, uniq, start, patched, dp_names) -> None:
    """DP=2, TP=1: two engines, each with one worker. One name per rank; kvctl groups them as one serve.

    With the per-rank names reverted, both ranks take the serve's one name: rank
    1's worker finds rank 0's socket at its path and serves nothing (issue 12).
    """
    s = start(Shape(owner="api", tp=1, dp=2, dp_names=dp_names), patched)
    assert len(s.engines) == 2 and all(len(s.workers[e]) == 1 for e in s.engines)
    if not patched:
        expect_nothing_made(layout)
        stop_like_vllm_serve(s)
        return
    if not dp_names:
        view = kvctl(layout, "inspect", "--json")[1]
        (dep,) = view["deployments"]
        served = {pid for e in dep["entries"] if e["kind"] == "socket" for pid in e["served_by"]}
        workers = [w for e in s.engines for w in s.workers[e]]
        assert len(served & set(workers)) == 1, dep  # one rank's worker has no socket
        stop_like_vllm_serve(s)
        return
    ranks = {dp_rank_name(uniq, r): [e, *s.workers[e]] for r, e in enumerate(s.engines)}
    view = expect_live(layout, s, ranks)
    assert view["serves"] == [{"name": uniq, "state": "live", "deployments": sorted(ranks), "dp_ranks": [0, 1]}]
    assert [(d["serve"], d["dp_rank"]) for d in view["deployments"]] == [(uniq, 0), (uniq, 1)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_")}
    text = subprocess.run(
        [KVCTL, "--root", layout.root, "inspect"], capture_output=True, text=True, env=env, timeout=120
    ).stdout
    assert f"Serve {uniq}  data parallel: 2 ranks here ({uniq}_dp0, {uniq}_dp1)" in text, text
    stop_like_vllm_serve(s)
    expect_nothing_left(layout, s)


@both
@pytest.mark.parametrize("tp", [1, 2])
def test_in_process_engine(layout, uniq, start, patched, tp) -> None:
    """VLLM_ENABLE_V1_MULTIPROCESSING=0 (InprocClient): the engine runs in the script; letting go of it cleans up."""
    s = start(Shape(owner="inproc", tp=tp), patched)
    assert s.engines == [] and s.sigterm_default
    workers = s.workers[s.owner]
    assert len(workers) == (0 if tp == 1 else 2)
    if not patched:
        expect_nothing_made(layout)
    else:
        expect_live(layout, s, {uniq: [s.owner, *workers]}, tp=tp)
    assert s.call("stop") == "stopped"
    assert s.wait_exit(30) == 0
    expect_nothing_left(layout, s)


@both
def test_offline_script_keeps_default_sigterm(layout, uniq, start, patched) -> None:
    """An offline LLM script never gets a SIGTERM handler from kvcached: a group SIGTERM kills it at once.

    Its engine and workers get the same SIGTERM, are not SIGKILLed by anyone
    (their owner is gone), and clean up after themselves.
    """
    s = start(Shape(owner="offline", tp=2), patched)
    assert s.sigterm_default
    (engine,) = s.engines
    if patched:
        expect_live(layout, s, {uniq: [s.owner, engine, *s.workers[engine]]}, tp=2)
    else:
        expect_nothing_made(layout)
    s.group_sigterm()
    assert s.wait_exit(10) == -signal.SIGTERM
    expect_nothing_left(layout, s, timeout=60)


@both
def test_executor_removes_the_socket_of_a_worker_that_died(layout, uniq, start, patched) -> None:
    """A worker SIGKILLed mid-serve leaves its socket; vLLM's monitor shuts the executor down, which removes it.

    The executor is the only owner a headless worker node has; here it is an
    in-process engine's, so nothing above it could clean up instead.
    """
    s = start(Shape(owner="inproc", tp=2), patched)
    dead, survivor = s.workers[s.owner]
    if patched:
        expect_live(layout, s, {uniq: [s.owner, dead, survivor]}, tp=2)
    else:
        expect_nothing_made(layout)
    os.kill(dead, signal.SIGKILL)  # no cleanup of its own: its node stays behind
    wait_until(lambda: gone(dead) and gone(survivor) and node_entries(layout) == [], 30, interval=0.05)
    assert gone(dead) and gone(survivor)  # vLLM's monitor shut the executor down, terminating the survivor
    assert node_entries(layout) == []
    assert s.call("stop") == "stopped"
    assert s.wait_exit(30) == 0
    expect_nothing_left(layout, s)


def test_a_starting_vllm_serve_sweeps_what_dead_serves_left(layout, uniq, start_env, deployments) -> None:
    """The real engine start (UniProcExecutor's claim) sweeps the node in the background: the dead serve goes,
    a live one (a harness serve of the same node) stays, and the new serve's own state is untouched."""
    from kvcached.runtime.harness import start_deployment

    from ..fs.helpers import dead_deployment, state_of

    dead = dead_deployment(layout, f"{uniq}dead")
    live = start_deployment(f"{uniq}live", 2, 1, layout=layout)  # the session's environment: its sweep is off
    deployments.append(live)
    s = start_env(Shape(owner="api", tp=1), {"KVCACHED_STARTUP_SWEEP": "1"})
    wait_until(lambda: not any(os.path.lexists(p) for p in dead), 60, interval=0.05)
    assert not any(os.path.lexists(p) for p in dead)
    assert all(os.path.lexists(p) for p in state_of(live))
    code, view = kvctl(layout, "inspect", "--json")
    assert code == 0 and {d["name"]: d["state"] for d in view["deployments"]} == {uniq: "live", live.name: "live"}
    stop_like_vllm_serve(s)


def test_a_release_whose_start_up_reads_more_stops_the_stand_in_at_one_place() -> None:
    """The stand-in engine builds the installed vLLM's own READY response at its start (fakes.check_ready_response).

    What that response reads and the stand-in lacks is named, in one error,
    before vLLM's input thread would die of it and leave only "Input socket
    thread died during startup" in every serve's log. Every serve above
    passing is the other half: this vLLM's response builds from the stand-in.
    """
    from types import SimpleNamespace

    from .fakes import StandInOutOfDate, check_ready_response

    with pytest.raises(StandInOutOfDate, match=r"vLLM \S+'s EngineCoreProc\._make_ready_response fails on the "
                                               r"stand-in engine \(AttributeError: .*vllm_config.*engine_core_init"):
        check_ready_response(SimpleNamespace())
