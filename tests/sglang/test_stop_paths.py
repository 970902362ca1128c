"""Every way an SGLang 0.5.23 serve stops leaves no kvcached state: SGLang's own stop code, real children, signals.

Each serve is tests/sglang/serve_driver.py (SGLang's main-side launch and stop
code, its real `run_scheduler_process` with a model-free Scheduler class; see
its docstring for what is replaced and why), with kvcached's plugin loaded
through its `sglang.srt.plugins` entry point. Each path runs twice: with
kvcached, and with the patches that give state back reverted (`CLEANUP`:
the scheduler's and the owner's; `OWNER`: the owner's alone where the
schedulers are killed before they could), which is SGLang as it is without
them: there the same test finds the segment and sockets left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import KVCTL
from tests.sglang.serves import CLEANUP, OWNER, Serves, Spec, gone, sigterm_group
from tests.waiting import wait_for

pytestmark = pytest.mark.sglang

TERM_MAIN = Spec(detokenizer=True)
TERM_MAIN_OFF = Spec(off=CLEANUP)
GROUP = Spec(tp=2, dp=2, dp_attention=True)
# The owner-off twin runs on one scheduler: SIGTERM kills every scheduler before it could give anything back,
# whatever the shape, so what the twin shows (SGLang's main alone leaves the segment) needs no second rank.
GROUP_OFF = Spec(off=OWNER, tag="group")
# The other branch of the group SIGTERM's race, made certain: main's SubprocessWatchdog polls once an hour, so the
# drain's 5 s poll always finds the schedulers dead before the watchdog could. One scheduler: ShutdownReq goes to no
# one whatever the shape.
DRAIN = Spec(watchdog_s=3600.0, tag="drain")
DRAIN_OFF = Spec(watchdog_s=3600.0, off=OWNER, tag="drain")
CRASH = Spec(tp=2)
CRASH_OFF = Spec(tp=2, off=OWNER)
OFFLINE = Spec(mode="offline")
OFFLINE_OFF = Spec(mode="offline", off=OWNER)
CTRL_C = Spec(tag="ctrl-c")
CTRL_C_OFF = Spec(tag="ctrl-c", off=CLEANUP)
DP = Spec(dp=2)
DP_OFF = Spec(dp=2, off=CLEANUP)
ORDER = (TERM_MAIN, TERM_MAIN_OFF, GROUP, GROUP_OFF, DRAIN, DRAIN_OFF, CRASH, CRASH_OFF, OFFLINE, OFFLINE_OFF, CTRL_C,
         CTRL_C_OFF, DP, DP_OFF)


@pytest.fixture(scope="module")
def serves(zygote) -> Iterator[Serves]:
    # KVTEST_SGLANG_AHEAD=0 starts each serve only when its test asks (running one test alone).
    ahead = int(os.environ.get("KVTEST_SGLANG_AHEAD", "2"))
    # Under /tmp, short: pytest's base would push the serves' socket paths over 107 bytes.
    pool = Serves(zygote, Path(tempfile.mkdtemp(prefix="kvs", dir="/tmp")), ORDER, ahead=ahead)
    try:
        yield pool
    finally:
        pool.close()


def _made(serve, names: list[str], sockets: dict[str, list[str]]) -> None:
    """What the schedulers made by the time they answered ready: each DP rank's segment and worker sockets."""
    state = serve.report()["state"]
    for name in names:
        assert f"dev/shm/{name}" in state, (state, serve.tail())
        for sock in sockets[name]:
            assert any(p.startswith(f"tmp/kvcached-tp-{name}-") and p.endswith(f"/{sock}") for p in state), \
                (state, serve.tail())


def _ends(serve, cleaned: bool) -> None:
    """Every SGLang process gone; then nothing of kvcached left with the cleanup on, the segment left without it."""
    wait_for(lambda: all(gone(p) for p in serve.children()), timeout=60, interval=0.1,
             explain=lambda: [p for p in serve.children() if not gone(p)])
    if cleaned:
        assert serve.state() == [], serve.tail()
    else:
        assert any(p.startswith("dev/shm/kvcached_SGLang_") for p in serve.state()), serve.state()


def _name(serve, dp: int | None = None) -> str:
    base = f"kvcached_SGLang_{serve.report()['pgid']}"
    return base if dp is None else f"{base}_dp{dp}"


def kvctl_inspect(serve) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_")}
    r = subprocess.run([KVCTL, "--root", str(serve.root), "inspect", "--json"], capture_output=True, text=True,
                       env=env, timeout=120)
    return json.loads(r.stdout)


@pytest.mark.parametrize("spec", [TERM_MAIN, TERM_MAIN_OFF], ids=["kvcached", "cleanup-off"])
def test_sigterm_to_main_drains_then_schedulers_give_back_on_shutdown_req(serves, spec) -> None:
    """`kill <main>` (systemd's default): SignalHandler, the 5 s drain, ShutdownReq, then kill_process_tree.

    The scheduler gives its socket and segment back itself on ShutdownReq
    (rank 0 removes the segment): the owner finds nothing left to remove.
    Before that, kvctl inspect shows the serve as one: main (by its tree),
    detokenizer and scheduler.
    """
    serve = serves.get(spec)
    name = _name(serve)
    _made(serve, [name], {name: ["w0.sock"]})
    if spec is TERM_MAIN:
        view = kvctl_inspect(serve)
        (dep,) = view["deployments"]
        roles = {p["pid"]: (p["role"], p["title"]) for p in dep["processes"]}
        report = serve.report()
        assert roles[serve.pid] == ("api", "sglang main")
        detok = [pid for pid in report["children"] if pid not in report["procs"]]
        assert [roles[pid] for pid in detok] == [("api", "sglang::detokenizer")]
        assert [roles[pid] for pid in report["procs"]] == [("worker", "sglang::scheduler")]
        assert [s["name"] for s in view["serves"]] == [name]
    os.kill(serve.pid, signal.SIGTERM)
    assert serve.wait() == 0  # the watchdog's sys.exit(0): main ran on after its kill_process_tree
    _ends(serve, cleaned=spec is TERM_MAIN)
    if spec is TERM_MAIN:
        log = serve.tail()
        assert f"kvcached: engine {name} removed {serve.root}/dev/shm/{name}" in log
        assert "kvcached owner: removed" not in log


@pytest.mark.parametrize("spec", [GROUP, GROUP_OFF], ids=["kvcached", "owner-off"])
def test_sigterm_to_the_process_group_kills_the_schedulers_and_main_cleans_up(serves, spec) -> None:
    """`kill -TERM -<pgid>`: schedulers die at once (no handler of their own); main's kill_process_tree cleans up.

    Main's SubprocessWatchdog sees a scheduler exit by SIGTERM and SIGQUITs
    main, whose running-phase handler kills the tree and main itself (SIGKILL),
    unless the SIGTERM handler's drain (a 5 s poll) stopped that watchdog first
    (exit 0): both are SGLang's own paths, and both end in kill_process_tree.
    Which one a run takes is the race's (the next test takes the drain's for
    certain). DP attention, TP 2 × DP 2: main prelaunches both schedulers, one
    per DP rank, each claiming its rank's segment `<name>_dp<r>` and serving
    `w0.sock`.
    """
    serve = serves.get(spec)
    names = [_name(serve, 0), _name(serve, 1)] if spec.dp > 1 else [_name(serve)]
    _made(serve, names, {n: ["w0.sock"] for n in names})
    sigterm_group(serve)
    assert serve.wait() in (-signal.SIGKILL, 0)
    _ends(serve, cleaned=spec is GROUP)


@pytest.mark.parametrize("spec", [DRAIN, DRAIN_OFF], ids=["kvcached", "owner-off"])
def test_a_group_sigterm_the_drain_sees_first_sends_shutdown_req_to_no_one_and_main_cleans_up(serves, spec) -> None:
    """`kill -TERM -<pgid>`, the drain first: the schedulers are dead when `sigterm_watchdog` sends ShutdownReq.

    The drain stops main's SubprocessWatchdog before it saw the exits, sends
    ShutdownReq with no scheduler connected (on SGLang's zmq.asyncio socket the
    send only queues; on a blocking one it would hold main's one thread for
    good: issue 37), finds no scheduler by title, and kill_process_tree finds
    only the schedulers' zombies: the owner removes what they left, and main
    exits 0.
    """
    serve = serves.get(spec)
    name = _name(serve)
    _made(serve, [name], {name: ["w0.sock"]})
    sigterm_group(serve)
    assert serve.wait() == 0, serve.tail()
    _ends(serve, cleaned=spec is DRAIN)
    log = serve.tail()
    assert "Gracefully exiting" in log and "crashed with exit code" not in log, log
    if spec is DRAIN:
        assert f"kvcached owner: removed {serve.root}/dev/shm/{name}" in log, log


@pytest.mark.parametrize("spec", [CRASH, CRASH_OFF], ids=["kvcached", "owner-off"])
def test_a_crashed_scheduler_sigquits_main_which_cleans_up_before_killing_itself(serves, spec) -> None:
    """TP 2: scheduler 1's event loop raises; run_scheduler_process SIGQUITs main, whose running-phase handler
    kill_process_tree(os.getpid())s: children, then main itself. Nothing after that call runs in main."""
    serve = serves.get(spec)
    name = _name(serve)
    _made(serve, [name], {name: ["w0.sock", "w1.sock"]})
    rank1 = next(i["pid"] for i in serve.report()["sched"] if i["tp_rank"] == 1)
    os.kill(rank1, signal.SIGUSR1)
    assert serve.wait() == -signal.SIGKILL
    _ends(serve, cleaned=spec is CRASH)


@pytest.mark.parametrize("spec", [OFFLINE, OFFLINE_OFF], ids=["kvcached", "owner-off"])
def test_offline_engine_shutdown_sigkills_the_schedulers_and_cleans_up(serves, spec) -> None:
    """An Engine script's shutdown() (its atexit, or `with`): no ShutdownReq, kill_process_tree of its children."""
    serve = serves.get(spec)
    name = _name(serve)
    _made(serve, [name], {name: ["w0.sock"]})
    os.kill(serve.pid, signal.SIGUSR1)
    assert serve.wait() == 0
    assert serve.report("done")["state"] == ([] if spec is OFFLINE else serve.state())
    _ends(serve, cleaned=spec is OFFLINE)


@pytest.mark.parametrize("spec", [CTRL_C, CTRL_C_OFF], ids=["kvcached", "cleanup-off"])
def test_ctrl_c_reaches_every_process_and_main_cleans_up_in_its_finally(serves, spec) -> None:
    """SIGINT to the foreground group: KeyboardInterrupt everywhere; launch_server.py's finally kills the tree."""
    serve = serves.get(spec)
    name = _name(serve)
    _made(serve, [name], {name: ["w0.sock"]})
    os.killpg(serve.pid, signal.SIGINT)
    serve.wait()  # 1 (KeyboardInterrupt), or SIGKILL when main's watchdog saw a scheduler exit 1 first
    _ends(serve, cleaned=spec is CTRL_C)


@pytest.mark.parametrize("spec", [DP, DP_OFF], ids=["kvcached", "cleanup-off"])
def test_dp_ranks_each_have_a_name_and_stop_through_the_dp_controller(serves, spec) -> None:
    """DP 2 (no DP attention): the DP controller spawns each rank's scheduler (grandchildren of main); SIGTERM to
    main: ShutdownReq through the controller to both ranks, then main's kill_process_tree."""
    serve = serves.get(spec)
    names = [_name(serve, 0), _name(serve, 1)]
    _made(serve, names, {n: ["w0.sock"] for n in names})
    report = serve.report()
    assert len(report["procs"]) == 1 and len(report["all_child_pids"]) == 3  # the controller, then its two ranks
    if spec is DP:  # kvctl inspect: one serve of two DP ranks, each rank's scheduler a worker of its deployment
        view = kvctl_inspect(serve)
        base = _name(serve)
        assert view["serves"] == [{"name": base, "state": "live", "deployments": names, "dp_ranks": [0, 1]}]
        by_rank = {i["dp_rank"]: i["pid"] for i in report["sched"]}
        for dep in view["deployments"]:
            roles = {p["pid"]: (p["role"], p["title"]) for p in dep["processes"]}
            rank = dep["dp_rank"]
            assert roles[by_rank[rank]] == ("worker", f"sglang::scheduler_DP{rank}"), roles
    os.kill(serve.pid, signal.SIGTERM)
    assert serve.wait() == 0
    _ends(serve, cleaned=spec is DP)
