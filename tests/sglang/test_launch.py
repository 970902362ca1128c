"""SGLang 0.5.23's own launcher and process tree, with real spawned children and real signals.

tests/sglang/launch_driver.py is the main process (forked from the zygote,
tests/sglang/zygote.py, which imported SGLang's main-side modules once): SGLang's
`Engine._launch_scheduler_processes` with a stand-in scheduler function
(`run_scheduler_process_func`, the parameter SGLang offers for it), so the
children are SGLang's real spawn, titles, process group and parent-death
signal, without a model.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator

import psutil
import pytest

from tests.sglang.cpu_env import child_env
from tests.sglang.serves import READY_TIMEOUT, Zygote, gone
from tests.waiting import wait_for

pytestmark = pytest.mark.sglang


class Main:
    """A launch_driver main forked from the zygote (in its own session, as `sglang serve` in a shell is)."""

    count = 0

    def __init__(self, zygote: Zygote, scratch: str, tmp_path, scenario: str, *opts: str,
                 env: dict[str, str] | None = None) -> None:
        Main.count += 1
        self.zygote, self.key = zygote, f"launch-{Main.count}-{scenario}"
        self.report_path = str(tmp_path / "report.json")
        self.log = tmp_path / "main.log"
        self.pid = zygote.fork(self.key, ["launch_driver", self.report_path, scenario, *opts],
                               child_env(scratch, env), scratch, str(self.log), module="tests.sglang.launch_driver")
        self.returncode: int | None = None

    def report(self, timeout: float = READY_TIMEOUT) -> dict:
        """Wait for the report; fail with the driver's output if it exits first."""
        wait_for(lambda: os.path.exists(self.report_path) or self.zygote.status(self.key, 0) is not None,
                 timeout=timeout)
        if not os.path.exists(self.report_path):
            raise AssertionError(f"driver exited {self.zygote.status(self.key, 0)} without a report:\n"
                                 f"{self.log.read_text()[-6000:]}")
        with open(self.report_path) as f:
            return json.load(f)

    def wait(self, timeout: float = 120.0) -> int:
        """The driver's exit status (negative: the signal that ended it); its output kept in `out`."""
        status = self.zygote.status(self.key, timeout)
        assert status is not None, f"{self.key} still runs after {timeout:g}s"
        self.returncode, self.out = status, self.log.read_text()
        return status

    def kill(self) -> None:
        """SIGKILL the driver's whole session; nothing it spawned outlives the test."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.zygote.status(self.key, 30)


# The single-scheduler mains of the stop tests below, by test: the launch_driver scenario each runs.
SINGLES = {"kill-tree-and-self": "kill-tree-and-self", "sigkill": "wait", "sigquit": "wait"}


@pytest.fixture(scope="module")
def mains(zygote, sgl_scratch, tmp_path_factory) -> Iterator[dict[str, Main]]:
    """Every main of the module, forked together so their schedulers import SGLang at once; each test takes its own.

    `tree` is one TP = 2, PP = 2 launch whose main reports its tree, then
    kill_process_tree(include_parent=False)s it. kvcached is enabled in it, on
    a node root of its own (short, under /tmp: socket paths fit 107 bytes):
    SGLang's facts below hold with it, and the launch shows kvcached's names
    for a TP × PP serve. Every main is SIGKILLed with its group at the end.
    """
    root = tempfile.mkdtemp(prefix="kvl", dir="/tmp")
    for sub in ("dev/shm", "tmp"):
        os.makedirs(os.path.join(root, sub))
    env = {"KVCACHED_ROOT": root, "KVCACHED_ENABLE": "1", "KVCACHED_LIMIT": "64M"}
    started: dict[str, Main] = {}
    try:
        started["tree"] = Main(zygote, sgl_scratch, tmp_path_factory.mktemp("tree"), "kill-tree", "--tp", "2",
                               "--pp", "2", env=env)
        for name, scenario in SINGLES.items():
            started[name] = Main(zygote, sgl_scratch, tmp_path_factory.mktemp(name), scenario)
        yield started
    finally:
        for main in started.values():
            main.kill()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def tree(mains) -> dict:
    """The TP = 2, PP = 2 launch's report, once its main returned from kill_process_tree (its exit status in rc)."""
    main = mains["tree"]
    report = main.report()
    report["rc"] = main.wait()
    return report


def test_tp2_pp2_schedulers_are_spawned_titled_children_of_main_in_its_group(tree) -> None:
    """One scheduler per (PP, TP) rank: spawned children of main, in its group, `sglang::scheduler_PP<k>_TP<r>`."""
    infos = tree["infos"]
    assert tree["main"]["start_method"] == "spawn"
    assert sorted((i["pp_rank"], i["tp_rank"]) for i in infos) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for info in infos:
        assert info["title"] == f"sglang::scheduler_PP{info['pp_rank']}_TP{info['tp_rank']}"
        assert info["title_cmdline"] == info["title"]  # what ps and /proc/<pid>/cmdline show
        assert info["ppid"] == tree["main"]["pid"] and info["pgid"] == tree["main"]["pgid"]
        assert "from multiprocessing.spawn import spawn_main" in " ".join(info["cmdline"])
        assert info["published"]["tp_rank"] == info["tp_rank"] and info["published"]["pp_rank"] == info["pp_rank"]
        assert info["dp_rank"] is None
        assert info["sigterm_default"] is True, "SGLang's scheduler installs no SIGTERM handler"
    assert sorted(tree["all_child_pids"]) == sorted(tree["procs"]) == sorted(i["pid"] for i in infos)


def test_tp2_pp2_every_scheduler_serves_its_socket_and_stage0_rank0_claims_the_segment(tree) -> None:
    """kvcached's names: `w<r>.sock` for stage 0, `pp1/w<r>.sock` for stage 1, one segment (TP 0 of PP 0's).

    Main's owner patch removes them all once kill_process_tree confirmed the schedulers' exits.
    """
    name = f"kvcached_SGLang_{tree['main']['pgid']}"
    state = tree["state"]
    (sockdir,) = [p for p in state if p.startswith(f"tmp/kvcached-tp-{name}-") and "/" not in p[4:]]
    assert state == sorted([f"dev/shm/{name}", sockdir, f"{sockdir}/w0.sock", f"{sockdir}/w1.sock",
                            f"{sockdir}/pp1", f"{sockdir}/pp1/w0.sock", f"{sockdir}/pp1/w1.sock"]), state
    assert tree["state_after"] == []


def test_kill_process_tree_sigkills_every_descendant_and_waits_until_they_are_dead(tree) -> None:
    """include_parent=False: every descendant is SIGKILLed and dead (a zombie at most) when it returns; main lives on.

    Every descendant: multiprocessing's resource tracker (spawn starts one in
    main) is SIGKILLed with the schedulers, so it never unlinks what they leaked.
    """
    schedulers = set(tree["procs"])
    others = {p["pid"]: p["title"] for p in tree["tree"] if p["pid"] not in schedulers}
    assert all("resource_tracker" in title for title in others.values()), others
    # kill_process_tree never reaps: the resource tracker is left a zombie. The schedulers are reaped by the
    # time it returns only because kvcached's owner (enabled in this launch) confirmed their exits through
    # their Process objects' exit codes, which waitpid them.
    assert {p["pid"] for p in tree["after"]} == set(others)
    assert all(p["status"] == psutil.STATUS_ZOMBIE for p in tree["after"]), tree["after"]
    assert tree["rc"] == 0


def test_kill_process_tree_with_the_parent_sigkills_main_before_anything_after_it_runs(mains) -> None:
    """include_parent=True from main: the child, then main itself, by SIGKILL; the line after the call never runs.

    TP = PP = DP = 1 here: the one scheduler's title is plain `sglang::scheduler`.
    """
    main = mains["kill-tree-and-self"]
    report = main.report()
    assert [i["title"] for i in report["infos"]] == ["sglang::scheduler"]
    assert main.wait() == -signal.SIGKILL
    assert "still running" not in main.out
    wait_for(lambda: all(gone(pid) for pid in report["procs"]), timeout=20)


def test_a_scheduler_dies_with_its_parent(mains) -> None:
    """"Kill myself when my parent dies" (PR_SET_PDEATHSIG, SIGKILL): SIGKILL main alone and the scheduler follows."""
    main = mains["sigkill"]
    children = main.report()["procs"]
    assert not any(gone(pid) for pid in children)
    os.kill(main.pid, signal.SIGKILL)
    assert main.wait() == -signal.SIGKILL
    wait_for(lambda: all(gone(pid) for pid in children), timeout=20)


def test_main_arms_the_launch_phase_sigquit_handler(mains) -> None:
    """_set_envs_and_config installs main's SIGQUIT handler (what a failing child signals); it kills the tree."""
    main = mains["sigquit"]
    report = main.report()
    assert "launch_phase_sigquit_handler" in report["main"]["sigquit"]
    os.kill(main.pid, signal.SIGQUIT)
    assert main.wait() == -signal.SIGKILL
    wait_for(lambda: all(gone(pid) for pid in report["procs"]), timeout=20)
