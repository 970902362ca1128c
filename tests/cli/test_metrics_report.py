"""Issue 38: metrics are a report, not a condition. A `--prometheus` file gc cannot write (no node_exporter on
the node, so no textfile directory) costs nothing of the run: the plan, the removals and the report come
first, then one line, and exit 9 where the run would have exited 0 or 3.

Every case is the installed kvctl in a child process on a private root, with a textfile path whose directory
does not exist, as on a node without node_exporter (or with Debian's, which reads another directory).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from kvcached.node import Outcome
from kvctl.exitcodes import Exit, exit_of

from ..waiting import wait_until
from .conftest import KVCTL, kvctl
from .test_safety import dead_deployment, leftovers, lock_env

UNWRITTEN = 9


def _missing(tmp_path) -> str:
    return os.path.join(str(tmp_path), "no-node-exporter", "textfile", "kvctl.prom")


def test_the_code_is_the_enums_and_replaces_only_0_and_3() -> None:
    assert Exit.METRICS_UNWRITTEN == UNWRITTEN
    assert exit_of(Outcome.CLEAN, "why") is Exit.METRICS_UNWRITTEN
    assert exit_of(Outcome.STALE_REMAIN, "why") is Exit.METRICS_UNWRITTEN
    assert exit_of(Outcome.PARTIAL_FAILURE, "why") is Exit.PARTIAL_FAILURE  # the work's own failure comes first
    assert [exit_of(o) for o in Outcome] == [exit_of(o, None) for o in Outcome]


def test_gc_yes_removes_reports_then_says_the_metrics_in_one_line(layout, uniq, tmp_path) -> None:
    """The cron line's shape (stdout to /dev/null): the removals happen and the log keeps their summary."""
    dead_deployment(layout, f"{uniq}m")
    target = _missing(tmp_path)
    p = subprocess.run(f"{KVCTL} --root {layout.root} gc --yes --prometheus {target} >/dev/null", shell=True,
                       capture_output=True, text=True, env={**os.environ, **lock_env(layout)}, timeout=60)
    assert p.returncode == UNWRITTEN, p.stderr
    assert leftovers(layout) == [], "the run's work is done whatever the metrics"
    lines = p.stderr.strip().splitlines()
    assert "kvctl gc: removed 4, kept 0" in lines[-2], p.stderr  # the run's own summary, then the metrics line, last
    assert "metrics not written (exit 9; the report above stands)" in lines[-1] and target in lines[-1], lines[-1]
    assert [ln for ln in lines if "metrics" in ln] == [lines[-1]], "one line, not one per part"
    assert not os.path.exists(os.path.dirname(target)), "gc makes no directory of its own for it"


def test_a_dry_run_prints_its_plan_and_json_carries_the_reason(layout, uniq, tmp_path) -> None:
    name = f"{uniq}d"
    dead_deployment(layout, name)
    target = _missing(tmp_path)
    r = kvctl("--root", layout.root, "gc", "--dry-run", "--prometheus", target)
    assert r.code == UNWRITTEN and f"{name}" in r.stdout and "gc: would remove 4" in r.stdout, r
    r = kvctl("--root", layout.root, "gc", "--dry-run", "--prometheus", target, "--json")
    doc = r.json("gc")
    assert r.code == doc["exit_code"] == UNWRITTEN
    assert doc["summary"]["actions"]["would_remove"] == 4 and target in doc["metrics_error"]
    assert "does not exist" in doc["metrics_error"] and target in r.stderr
    written = os.path.join(layout.root, "kvctl.prom")
    r = kvctl("--root", layout.root, "gc", "--dry-run", "--prometheus", written, "--json")
    assert r.code == 3 and r.json("gc")["metrics_error"] is None and os.path.exists(written)


def test_a_file_that_is_no_regular_file_is_still_refused_before_any_work(layout, uniq) -> None:
    """`--prometheus DIR` is a mistake in the command line: said before the run, which removes nothing (exit 1)."""
    dead_deployment(layout, f"{uniq}r")
    r = kvctl("--root", layout.root, "gc", "--yes", "--prometheus", layout.root, env=lock_env(layout))
    assert r.code == 1 and "is a directory, not a regular file" in r.stderr and r.stdout == "", r
    assert leftovers(layout)


def test_the_agent_loop_says_it_each_run_and_goes_on(layout, uniq, tmp_path) -> None:
    """gc --every: each run's line says the metrics were not written (exit 9), the heartbeat records 9, and the
    endpoint still serves the run (it is published before the textfile is tried)."""
    dead_deployment(layout, f"{uniq}e")
    hb = tmp_path / "hb"
    env = {**os.environ, **lock_env(layout), "KVCTL_EVERY_MIN_S": "0.01"}
    p = subprocess.Popen([KVCTL, "--root", layout.root, "gc", "--yes", "--every", "0.2", "--prometheus",
                          _missing(tmp_path), "--heartbeat", str(hb)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, env=env)
    try:
        wait_until(lambda: hb.exists() and json.loads(hb.read_text())["runs"] >= 2, timeout=60)
        assert json.loads(hb.read_text())["exit_code"] == UNWRITTEN
    finally:
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    assert p.returncode == UNWRITTEN, err
    runs = [ln for ln in err.splitlines() if "(exit 9)" in ln]
    assert len(runs) >= 2 and all("metrics not written: " in ln for ln in runs), err
    assert "removed 4" in runs[0] and leftovers(layout) == []


@pytest.mark.parametrize("json_out", [False, True])
def test_a_busy_lock_keeps_its_code_and_says_the_metrics_beside_it(layout, tmp_path, json_out: bool) -> None:
    from kvcached.node.state.gclock import GcLock

    lock = GcLock(layout, path=os.path.join(layout.root, "gc.lock"))
    lock.acquire()
    try:
        r = kvctl("--root", layout.root, "gc", "--yes", "--prometheus", _missing(tmp_path),
                  *(["--json"] if json_out else []), env=lock_env(layout))
    finally:
        lock.release()
    assert r.code == 5 and "another kvctl gc is running" in r.stderr and "metrics not written" in r.stderr, r


def test_only_the_agents_runs_write_their_period(layout, tmp_path) -> None:
    """kvctl_gc_every_seconds tells the agent (gc --every) from cron's and systemd's single runs (the alerts)."""
    prom = tmp_path / "kvctl.prom"
    assert kvctl("--root", layout.root, "gc", "--yes", "--prometheus", str(prom), env=lock_env(layout)).code == 0
    assert "kvctl_gc_last_run_timestamp_seconds " in prom.read_text()
    assert "kvctl_gc_every_seconds" not in prom.read_text()
    env = {**os.environ, **lock_env(layout), "KVCTL_EVERY_MIN_S": "0.01"}
    p = subprocess.Popen([KVCTL, "--root", layout.root, "gc", "--yes", "--every", "0.25", "--prometheus",
                          str(prom), "--json"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        assert p.stdout is not None and json.loads(p.stdout.readline())["exit_code"] == 0
        assert "\nkvctl_gc_every_seconds 0.25\n" in prom.read_text()
    finally:
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=60)
