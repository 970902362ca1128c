"""SGLang 0.5.23's own launcher and process tree, with real spawned children and real signals.

tests/sglang/launch_driver.py is the main process: SGLang's
`Engine._launch_scheduler_processes` with a stand-in scheduler function
(`run_scheduler_process_func`, the parameter SGLang offers for it), so the
children are SGLang's real spawn, titles, process group and parent-death
signal, without a model.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import psutil
import pytest

from tests.sglang.cpu_env import child_env
from tests.waiting import wait_for

pytestmark = pytest.mark.sglang


class Main:
    """A launch_driver process (its own process group, as `sglang serve` in a shell is) and the report it writes."""

    def __init__(self, scratch: str, tmp_path, scenario: str, *opts: str) -> None:
        self.report_path = str(tmp_path / "report.json")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.sglang.launch_driver", self.report_path, scenario, *opts],
            env=child_env(scratch), cwd=scratch, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True)

    def report(self, timeout: float = 180.0) -> dict:
        """Wait for the report; fail with the driver's output if it exits first."""
        wait_for(lambda: os.path.exists(self.report_path) or self.proc.poll() is not None, timeout=timeout)
        if not os.path.exists(self.report_path):
            out, err = self.proc.communicate()
            raise AssertionError(f"driver exited {self.proc.returncode} without a report:\n{out}\n{err[-6000:]}")
        with open(self.report_path) as f:
            return json.load(f)

    def wait(self, timeout: float = 120.0) -> int:
        """The driver's exit status (negative: the signal that ended it); its stdout kept in `out`."""
        self.out, self.err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the driver's whole process group; nothing it spawned outlives the test."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.proc.returncode is None:
            self.proc.communicate()


@pytest.fixture
def launch(sgl_scratch, tmp_path) -> Iterator:
    """Start launch_driver mains; each is SIGKILLed with its group at teardown."""
    started: list[Main] = []

    def start(scenario: str, *opts: str) -> Main:
        main = Main(sgl_scratch, tmp_path, scenario, *opts)
        started.append(main)
        return main

    yield start
    for main in started:
        main.kill()


def _gone(pid: int) -> bool:
    """Dead: no such process, or a zombie (SGLang's own test of "released", _still_holding_resources)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture(scope="module")
def tree(sgl_scratch, tmp_path_factory) -> Iterator[dict]:
    """One TP = 2, PP = 2 launch whose main reports its tree, then kill_process_tree(include_parent=False)s it."""
    main = Main(sgl_scratch, tmp_path_factory.mktemp("tree"), "kill-tree", "--tp", "2", "--pp", "2")
    try:
        report = main.report()
        report["rc"] = main.wait()
        yield report
    finally:
        main.kill()


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


def test_kill_process_tree_sigkills_every_descendant_and_waits_until_they_are_dead(tree) -> None:
    """include_parent=False: every descendant is SIGKILLed and dead (a zombie at most) when it returns; main lives on.

    Every descendant: multiprocessing's resource tracker (spawn starts one in
    main) is SIGKILLed with the schedulers, so it never unlinks what they leaked.
    """
    schedulers = set(tree["procs"])
    others = {p["pid"]: p["title"] for p in tree["tree"] if p["pid"] not in schedulers}
    assert all("resource_tracker" in title for title in others.values()), others
    assert {p["pid"] for p in tree["after"]} == schedulers | set(others)
    assert all(p["status"] == psutil.STATUS_ZOMBIE for p in tree["after"]), tree["after"]
    assert tree["rc"] == 0


def test_kill_process_tree_with_the_parent_sigkills_main_before_anything_after_it_runs(launch) -> None:
    """include_parent=True from main: the child, then main itself, by SIGKILL; the line after the call never runs.

    TP = PP = DP = 1 here: the one scheduler's title is plain `sglang::scheduler`.
    """
    main = launch("kill-tree-and-self")
    report = main.report()
    assert [i["title"] for i in report["infos"]] == ["sglang::scheduler"]
    assert main.wait() == -signal.SIGKILL
    assert "still running" not in main.out
    wait_for(lambda: all(_gone(pid) for pid in report["procs"]), timeout=20)


def test_a_scheduler_dies_with_its_parent(launch) -> None:
    """"Kill myself when my parent dies" (PR_SET_PDEATHSIG, SIGKILL): SIGKILL main alone and the scheduler follows."""
    main = launch("wait")
    children = main.report()["procs"]
    assert not any(_gone(pid) for pid in children)
    os.kill(main.proc.pid, signal.SIGKILL)
    assert main.wait() == -signal.SIGKILL
    wait_for(lambda: all(_gone(pid) for pid in children), timeout=20)


def test_main_arms_the_launch_phase_sigquit_handler(launch) -> None:
    """_set_envs_and_config installs main's SIGQUIT handler (what a failing child signals); it kills the tree."""
    main = launch("wait")
    report = main.report()
    assert "launch_phase_sigquit_handler" in report["main"]["sigquit"]
    os.kill(main.proc.pid, signal.SIGQUIT)
    assert main.wait() == -signal.SIGKILL
    wait_for(lambda: all(_gone(pid) for pid in report["procs"]), timeout=20)
