"""`kvctl gc --every`: runs until SIGTERM or SIGINT, one line per run, metrics per run, jitter, no growth.

The installed kvctl in a subprocess, stopped by real signals; KVCTL_EVERY_MIN_S
lets the tests run it every few hundredths of a second (the public floor is 10s).
"""

from __future__ import annotations

import gc as pygc
import json
import os
import random
import re
import signal
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from kvcached.node.base.layout import Layout
from kvcached.node.state.gclock import GcLock
from kvcached.node.state.segment import create_segment
from kvctl import gcloop
from kvctl.exitcodes import Exit

from ..fs.helpers import backdate, stale_socket
from .conftest import KVCTL, assert_one_line_error, kvctl, validate

FAST = {"KVCTL_EVERY_MIN_S": "0.001"}


class Loop:
    """`kvctl gc --every ...` running in the background: its lines as they come, stopped by a signal."""

    def __init__(self, layout: Layout, tmp: Path, *args: str) -> None:
        self.lock = str(tmp / "gc.lock")
        env = {**os.environ, **FAST, "KVCTL_LOCK": self.lock}
        env.pop("KVCTL_ROOT", None)
        self.p = subprocess.Popen([KVCTL, "--root", layout.root, "gc", *args], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env)

    def line(self, stream: str = "stdout") -> str:
        f = self.p.stdout if stream == "stdout" else self.p.stderr
        assert f is not None
        line = f.readline()
        assert line, f"kvctl gc --every exited ({self.p.wait()}): {self.p.stderr.read() if self.p.stderr else ''}"
        return line

    def stop(self, sig: int = signal.SIGTERM) -> tuple[int, str, str]:
        self.p.send_signal(sig)
        out, err = self.p.communicate(timeout=60)
        return self.p.returncode, out, err

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.communicate()


@pytest.fixture
def loops():
    started: list[Loop] = []
    yield started
    for loop in started:
        loop.kill()


def _dead_deployment(layout: Layout, name: str) -> list[str]:
    create_segment(layout.segment_path(name), 1 << 20)
    stale_socket(layout.socket_path(name, 0))
    paths = [layout.socket_path(name, 0), layout.socket_dir(name), layout.segment_path(name)]
    for p in paths:
        backdate(p)
    os.chmod(layout.socket_dir(name), 0o700)
    return paths


def test_one_json_line_per_run_and_the_last_runs_code_on_sigterm(layout, tmp_path, uniq, loops) -> None:
    """A dry run loop: every run finds the dead deployment (exit 3); SIGTERM ends it with 3."""
    _dead_deployment(layout, uniq)
    loop = Loop(layout, tmp_path, "--every", "0.05", "--dry-run", "--json")
    loops.append(loop)
    docs = [json.loads(loop.line()) for _ in range(3)]
    for doc in docs:
        validate(doc, "gc")
        assert doc["exit_code"] == 3 and doc["dry_run"] is True
        assert {e["action"] for e in doc["entries"]} == {"would_remove"}
    code, out, err = loop.stop()
    assert code == Exit.STALE_REMAIN, err
    for line in out.splitlines():  # every line a whole document: none cut short by the signal
        validate(json.loads(line), "gc")
    assert err == ""


def test_removing_loop_exits_with_the_clean_runs_code(layout, tmp_path, uniq, loops) -> None:
    paths = _dead_deployment(layout, uniq)
    prom = tmp_path / "kvctl.prom"
    loop = Loop(layout, tmp_path, "--every", "0.05", "--yes", "--json", "--prometheus", str(prom))
    loops.append(loop)
    first = json.loads(loop.line())
    assert first["exit_code"] == 0 and {e["action"] for e in first["entries"]} == {"removed"}
    assert not any(os.path.lexists(p) for p in paths)
    stamps = []
    for _ in range(3):  # each later run: nothing to do, and the metrics file rewritten
        assert json.loads(loop.line())["entries"] == []
        stamps.append(_metric(prom, "kvctl_gc_last_run_timestamp_seconds"))
    assert stamps == sorted(stamps) and len(set(stamps)) == 3
    code, _, _ = loop.stop(signal.SIGINT)
    assert code == Exit.OK
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]  # no half-written metrics file


def _metric(path: Path, name: str) -> float:
    for line in path.read_text().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in {path}")


def test_text_mode_logs_one_line_per_run(layout, tmp_path, uniq, loops) -> None:
    _dead_deployment(layout, uniq)
    loop = Loop(layout, tmp_path, "--every", "0.05", "--dry-run", "--engines")
    loops.append(loop)
    lines = [loop.line("stderr") for _ in range(3)]
    pattern = re.compile(r"^\S+ kvctl gc: would remove 3, kept 0; engine leftovers: would remove 0, kept 0 "
                         r"\(exit 3\)$")
    assert all(pattern.match(line.rstrip("\n")) for line in lines), lines
    code, out, _ = loop.stop()
    assert code == 3 and out == ""


def test_a_busy_lock_is_logged_and_the_loop_goes_on(layout, tmp_path, uniq, loops) -> None:
    _dead_deployment(layout, uniq)
    prom = tmp_path / "kvctl.prom"
    lock = GcLock(layout, path=str(tmp_path / "gc.lock"))
    lock.acquire()
    try:
        loop = Loop(layout, tmp_path, "--every", "0.05", "--yes", "--json", "--prometheus", str(prom))
        loops.append(loop)
        for _ in range(2):
            doc = json.loads(loop.line())
            validate(doc, "error")
            assert doc["exit_code"] == Exit.LOCK_BUSY and str(os.getpid()) in doc["error"]["message"]
        assert _metric(prom, "kvctl_gc_lock_busy") == 1
    finally:
        lock.release()
    while (doc := json.loads(loop.line()))["schema"] == "kvctl.error/1":
        pass  # runs that started before the release
    assert doc["exit_code"] == 0 and _metric(prom, "kvctl_gc_lock_busy") == 0
    assert loop.stop()[0] == 0


def test_sigterm_between_runs_exits_at_once(layout, tmp_path, loops) -> None:
    """The pause is 10 minutes; SIGTERM right after the first run ends it now, with that run's code."""
    loop = Loop(layout, tmp_path, "--every", "10m", "--yes", "--json")
    loops.append(loop)
    assert json.loads(loop.line())["exit_code"] == 0
    code, _, _ = loop.stop()  # communicate(timeout=60) would raise if it slept on
    assert code == 0


@pytest.mark.parametrize("args, says", [
    (["--every", "1m"], "--every runs unattended: give --yes"),
    (["--every", "5s", "--yes"], "--every 5s: at least 10s"),
    (["--every", "0", "--dry-run"], "at least 10s"),
    (["--every", "1m", "--yes", "--engines", "a-serve"], "take no NAME"),
    (["--every", "soon", "--yes"], "--every"),
])
def test_refusals_before_any_run(layout, args: list[str], says: str) -> None:
    r = kvctl("--root", layout.root, "gc", *args)
    assert_one_line_error(r, Exit.USAGE)
    assert says in r.stderr


def test_the_tiny_floor_is_only_the_tests(layout) -> None:
    """The setting, not a hidden flag, lowers the floor; unset it is 10s."""
    r = kvctl("--root", layout.root, "gc", "--every", "9.9s", "--dry-run", env={"KVCTL_EVERY_MIN_S": ""})
    assert r.code == 2 and "at least 10s" in r.stderr


# The loop itself, in process: jitter, first run at once, signals during a run, memory. ---------------------


def test_jitter_stays_within_ten_percent_and_is_real() -> None:
    rng = random.Random(20)
    waits = [gcloop.next_wait(600.0, rng) for _ in range(20000)]
    assert 540.0 <= min(waits) < 545.0 and 655.0 < max(waits) <= 660.0
    assert 598.0 < sum(waits) / len(waits) < 602.0


class RecordingStop(gcloop.Stop):
    """A Stop whose pauses are recorded instead of slept (the loop's schedule, without the wall clock)."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float] = []
        self.events: list[str] = []

    def wait(self, seconds: float) -> bool:
        self.waits.append(seconds)
        self.events.append("wait")
        return self.requested.is_set()


def test_the_first_run_is_at_once_and_every_pause_is_jittered() -> None:
    stop = RecordingStop()

    def once() -> int:
        stop.events.append("run")
        return 3

    assert gcloop.run_every(60.0, once, stop, runs=50) == 3
    assert stop.events[0] == "run" and stop.events.count("run") == 50 and len(stop.waits) == 49
    assert all(54.0 <= w <= 66.0 for w in stop.waits) and len(set(stop.waits)) > 40


def test_a_signal_during_a_run_lets_it_finish_and_a_second_abandons_it() -> None:
    """SIGTERM inside a run: the run goes on to its end, its code is the loop's. A second signal interrupts."""
    finished: list[int] = []

    def once() -> int:
        os.kill(os.getpid(), signal.SIGTERM)  # a real signal, delivered to this thread's next bytecode
        for _ in range(1000):
            pass
        finished.append(1)
        return 4

    before = signal.getsignal(signal.SIGTERM)
    with gcloop.Stop() as stop:
        assert gcloop.run_every(0.001, once, stop) == 4
    assert finished == [1] and stop.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before  # handlers given back

    def twice() -> int:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):
            pass
        finished.append(2)
        return 0

    with pytest.raises(KeyboardInterrupt), gcloop.Stop() as stop:
        gcloop.run_every(0.001, twice, stop)
    assert finished == [1]


def test_memory_does_not_grow_across_runs(layout, tmp_path, uniq, monkeypatch) -> None:
    """Hundreds of real gc runs (the CLI's own per-run function, output to /dev/null): no growth past warm-up."""
    from kvcached.node.ops.gcrun import GcOptions
    from kvctl.commands.gc import _one_run
    from kvctl.params import Globals

    _dead_deployment(layout, uniq)  # a dry run judges it every time
    monkeypatch.setenv("KVCTL_LOCK", str(tmp_path / "gc.lock"))
    devnull = open(os.devnull, "w")
    monkeypatch.setattr(sys, "stdout", devnull)
    monkeypatch.setattr(sys, "stderr", devnull)
    opts = GcOptions(layout=layout, dry_run=True, engines=True, prometheus=str(tmp_path / "kvctl.prom"))
    run = Globals(root=layout.root)
    sizes: list[int] = []
    stop = RecordingStop()

    def once() -> int:
        code, _ = _one_run(opts, run, json_out=True)
        n = len(stop.waits)
        if n == 60:
            tracemalloc.start()
        if n >= 60 and n % 60 == 0:
            pygc.collect()
            sizes.append(tracemalloc.get_traced_memory()[0])
        return code

    try:
        assert gcloop.run_every(0.001, once, stop, runs=301) == 3
    finally:
        tracemalloc.stop()
        devnull.close()
    # sizes at runs 60, 120, ..., 300: what the first measured run allocated and kept is the warm-up's.
    assert len(sizes) == 5
    growth = sizes[-1] - sizes[1]
    assert growth < 64 * 1024, f"grew {growth} bytes over 180 runs: {sizes}"


def test_no_events_goes_with_every(tmp_path: Path) -> None:
    r = kvctl("--root", str(tmp_path), "gc", "--dry-run", "--no-events")
    assert_one_line_error(r, Exit.USAGE)
    assert "--no-events goes with --every -A" in r.stderr
