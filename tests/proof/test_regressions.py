"""Core bugs found by the proof suite, each as the smallest real repro.

Each failed before its fix landed and guards against its return.
"""

from __future__ import annotations

import os
import socket

from kvcached.node.base.layout import Layout
from kvcached.node.clean.cleanup import Action, run_cleanup
from kvcached.node.clean.decide import Policy, State
from kvcached.node.clean.facts import gather_facts

from ..waiting import wait_until


def test_stale_socket_in_stage_dir_of_live_deployment_is_removed(node: Layout) -> None:
    """A PP stage-1 worker died (its node is stale) while another worker of the stage serves.

    cleanup._Actor.act_dir only enters a directory when it or a *direct* child is
    stale; the root's direct children here are the live stage dir only, so
    pp1/w1.sock is reported stale every run and never removed ("stale remain").
    """
    name = "demo"
    os.makedirs(node.stage_dir(name, 1), 0o700)
    live = socket.socket(socket.AF_UNIX)
    live.bind(node.socket_path(name, 0, 1))
    live.listen()
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(node.socket_path(name, 1, 1))
    dead.close()
    try:
        report = run_cleanup(node, Policy(grace=0))
        by_path = {e.path: e for e in report.entries}
        stale = by_path[node.socket_path(name, 1, 1)]
        assert stale.state is State.STALE
        assert stale.action is Action.REMOVED, f"kept: {stale.note or stale.decision.detail}"
        assert by_path[node.socket_path(name, 0, 1)].action is Action.KEPT
    finally:
        live.close()


def _fake_proc(tmp: str, pid: int, state: bytes) -> str:
    """A /proc with one python process whose per-process files vanish like an exiting process's."""
    proc = os.path.join(tmp, "proc")
    os.makedirs(os.path.join(proc, str(pid)))
    with open("/proc/stat", "rb") as src, open(os.path.join(proc, "stat"), "wb") as dst:
        dst.write(src.read())
    with open(os.path.join(proc, str(pid), "stat"), "wb") as f:
        f.write(b"%d (python3) %s 1 %d %d 0 -1 4194304 0 0 0 0 0 0 0 0 20 0 1 0 100 0 0" % (pid, state, pid, pid))
    with open(os.path.join(proc, str(pid), "status"), "wb") as f:
        f.write(b"Name:\tpython3\nUid:\t0\t0\t0\t0\n")
    with open(os.path.join(proc, str(pid), "cmdline"), "wb") as f:
        f.write(b"python3\0-m\0vllm\0")
    # environ, fd, maps and ns are missing: what a process that exited after we read
    # its stat shows (ESRCH / ENOENT; a permission problem is EACCES).
    return proc


def test_process_exiting_during_the_pass_is_not_a_blind_spot(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """facts._read_process counts a process that exits mid-read as unreadable.

    Its `os.path.exists(base)` guard misses a zombie (the /proc/<pid> directory
    stays until it is reaped), so Facts.blind_spots names it and every candidate
    of that uid turns `unknown` for this run. Seen in the property test when
    other sessions' processes exited during a pass. ENOENT/ESRCH from a
    per-process file means "gone", not "hidden from us".
    """
    proc = _fake_proc(str(tmp_path), 4242, b"S")
    facts = gather_facts(proc)
    assert 4242 not in facts.unreadable_pids, facts.unreadable_pids


def test_owner_exits_and_cleans_after_group_sigterm(node: Layout, deployments) -> None:  # type: ignore[no-untyped-def]
    """vLLM's stop: SIGTERM to the group, the engine tree SIGKILLed at once; the owner must clean up and exit.

    harness._run_api installs `shutdown` as the SIGTERM handler; it runs while
    the main thread sits in `engine.wait()` and calls `engine.wait()` again.
    Popen._wait holds the non-reentrant `_waitpid_lock` around its blocking
    waitpid, so the handler deadlocks (futex_do_wait): the owner never runs its
    cleanup and never exits; everything is left behind and looks live (the
    api still carries KVCACHED_IPC_NAME).
    """
    import signal
    import time

    from .kit import uniq

    d = deployments(uniq("own"), 2, 1, layout=node, owner_cleanup=True)
    d.signal_group(signal.SIGTERM)
    time.sleep(0.02)
    for pid in [d.engine_pid, *d.worker_pids.values()]:
        d.signal(pid, signal.SIGKILL)
    try:
        d.api.wait(timeout=10)
    except Exception:
        pass
    assert d.api.returncode is not None, "the owner hung after SIGTERM (deadlock in its signal handler)"
    left = [os.path.join(dp, n) for top in (node.tmp_dir, node.shm_dir) for dp, dn, fn in os.walk(top)
            for n in dn + fn]
    assert left == [], f"the owner's cleanup left {left}"


def test_names_with_a_trailing_newline_are_not_ours() -> None:
    """naming's regexes end in `$`, which also matches before a trailing newline.

    So a file "w0.sock\\n" is classified as rank 0's socket, "pp1\\n" as stage 1,
    "kvcached_proc_1\\n" as a default-named segment, and "kvcached-tp-x-<hash>\\n"
    as deployment x's directory: planted names that gc, delete and inspect then
    treat as kvcached state (the hostile suite saw `kvctl delete` remove a
    user's "w0.sock\\n"). `\\Z` (or re.fullmatch) is the fix.
    """
    from kvcached.node.base import name_rules

    assert name_rules.parse_socket_name("w0.sock\n") is None
    assert name_rules.parse_stage_name("pp1\n") is None
    assert name_rules.DEFAULT_NAME_RE.match("kvcached_proc_1\n") is None
    assert name_rules.parse_socket_dir_name(f"kvcached-tp-x-{name_rules.socket_hash('x')}\n") is None


def test_explicit_named_segment_left_without_its_socket_dir_is_found(node: Layout, deployments) -> None:  # type: ignore[no-untyped-def]
    """The harness's vLLM-like stop often leaves only the segment: gc must still find it.

    With an explicit KVCACHED_IPC_NAME, scan.scan() takes /dev/shm/<name> as a
    candidate only when a socket directory of a valid hash (or a live process's
    environment) names it. The workers' SIGTERM handlers remove their sockets
    and the directory, the owner is SIGKILLed before its segment cleanup, so the
    dead segment is tied to nothing and `kvctl gc` never sees it: it leaks for
    good (crash matrix, 2×2 harness_stop_like_vllm and double_sigterm rows).
    """
    from kvcached.node.state.segment import create_segment

    name = "explicit-left"
    create_segment(node.segment_path(name), 1 << 30)  # what the dead engine left; no dir, no process
    os.utime(node.segment_path(name), (1, 1))
    report = run_cleanup(node, Policy(grace=0))
    assert [e.path for e in report.entries] == [node.segment_path(name)], "the dead segment is not even reported"


def test_worker_exits_on_a_second_sigterm_during_teardown(node: Layout) -> None:
    """vLLM delivers SIGTERM twice in teardown (docs/NODE.md §4); a worker must still exit.

    The harness worker's SIGTERM handler calls WorkerListener.stop(), which holds
    the listener's non-reentrant threading.Lock while it joins the serving
    thread; a second SIGTERM re-enters stop() from the handler and blocks on
    that lock for ever (futex_do_wait). The engine's handler has the same shape
    (Popen.wait inside Popen.wait). Crash matrix: every double_sigterm cell.
    """
    import signal
    import subprocess
    import sys
    import time

    from kvcached.runtime.ipc.client import ping

    hung = 0
    tries = [0.0, 0.0002, 0.0005, 0.001, 0.002] * 2
    for i, gap in enumerate(tries):
        name = f"dbl{i}"
        p = subprocess.Popen([sys.executable, "-m", "kvcached.runtime.harness", "--role", "worker", "--name", name,
                              "--root", node.root, "--rank", "0"], stdin=subprocess.DEVNULL)
        try:
            def serving(name: str = name) -> bool:
                try:
                    ping(node.socket_path(name, 0), timeout=1.0)
                except Exception:
                    return False
                return True

            assert wait_until(serving, 60), "worker did not start"  # generous: a loaded machine starts Python slowly
            p.send_signal(signal.SIGTERM)
            time.sleep(gap)
            p.send_signal(signal.SIGTERM)
            p.send_signal(signal.SIGTERM)  # the engine's handler terminates its workers too
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                hung += 1
        finally:
            p.kill()
            p.wait()
    assert hung == 0, f"{hung} of {len(tries)} workers hung after repeated SIGTERMs"
