"""gc on a node that cannot hold kvcached state: the same answer, without the scan, the /proc pass or the decision.

(bench/bench_cli_start.py measures this run: a cron gc on an idle node.)
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import kvcached.node.ops.gcrun as gcrun
from kvcached.node.base.enums import Outcome
from kvcached.node.clean.present import may_hold_state, node_dirs
from kvcached.node.ops.gcrun import GcOptions, NoMatch, run_gc

from .conftest import kvctl

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_what_may_hold_state(layout) -> None:
    assert node_dirs(layout.root) == (layout.tmp_dir, layout.shm_dir)
    assert not may_hold_state(layout.root)
    open(os.path.join(layout.shm_dir, "sem.mp-1"), "w").close()  # no valid IPC name: never a candidate
    os.mkdir(os.path.join(layout.tmp_dir, "systemd-private-x"))
    assert not may_hold_state(layout.root)
    open(os.path.join(layout.shm_dir, "psm_abc"), "w").close()  # a valid name a process could carry
    assert may_hold_state(layout.root)
    os.unlink(os.path.join(layout.shm_dir, "psm_abc"))
    os.mkdir(os.path.join(layout.tmp_dir, "kvcached-tp-x-00000000"))  # the scan looks at every one
    assert may_hold_state(layout.root)
    os.rmdir(os.path.join(layout.tmp_dir, "kvcached-tp-x-00000000"))
    os.rename(layout.shm_dir, layout.shm_dir + ".away")  # a directory missing: nothing there
    assert not may_hold_state(layout.root)
    os.rename(layout.shm_dir + ".away", layout.shm_dir)
    os.rename(layout.tmp_dir, layout.tmp_dir + ".away")
    os.symlink("/etc", layout.tmp_dir)  # not a directory we may list (never followed): the scan reports it
    assert may_hold_state(layout.root)


@pytest.mark.parametrize("dry_run", [True, False])
def test_an_idle_node_gets_the_answer_of_a_full_run(layout, monkeypatch, dry_run: bool) -> None:
    open(os.path.join(layout.shm_dir, "sem.mp-1"), "w").close()
    opts = GcOptions(layout=layout, dry_run=dry_run, yes=True)
    monkeypatch.setenv("KVCTL_LOCK", os.path.join(layout.root, "gc.lock"))
    idle = run_gc(opts)
    monkeypatch.setattr(gcrun, "may_hold_state", lambda root: True)
    full = run_gc(opts)
    for r in (idle, full):
        assert r.report.entries == [] and r.report.errors == [] and r.outcome is Outcome.CLEAN
        assert r.report.dry_run is dry_run and r.orphans == [] and not r.declined
    assert idle.report.summary() | {"seconds": 0} == full.report.summary() | {"seconds": 0}
    with pytest.raises(NoMatch):
        run_gc(GcOptions(layout=layout, names=("nothing",), dry_run=True))
    monkeypatch.undo()
    with pytest.raises(NoMatch) as e:
        run_gc(GcOptions(layout=layout, names=("nothing",), dry_run=True))
    assert str(e.value) == f"no deployment matches nothing under {layout.root}"


def test_gc_on_an_idle_node_loads_no_scan_or_decision(layout) -> None:
    r = subprocess.run([sys.executable, "-X", "importtime", os.path.join(os.path.dirname(sys.executable), "kvctl"),
                        "--root", layout.root, "gc", "--dry-run"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "gc: would remove 0, kept 0", r.stderr[-2000:]
    mods = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "kvcached.node.ops.gcrun" in mods  # the measurement works
    assert not mods & {"kvcached.node.clean.scan", "kvcached.node.clean.facts", "kvcached.node.clean.decide",
                       "kvcached.node.clean.cleanup"}
    # hashlib loads OpenSSL (5-10 ms of a 100 ms run): only a socket directory's hash check needs it.
    assert "hashlib" not in mods
    assert kvctl("--root", layout.root, "gc", "nothing").code == 6


def test_every_gc_options_is_given_by_keyword() -> None:
    """GcOptions is a NamedTuple (cheap to define at a cold start), so nothing but this holds its call sites to
    keywords: two neighbouring flags swapped in a reorder would change what a run does, silently."""
    import ast

    positional = []
    for top in ("kvcached", "kvctl", "tests", "bench", "scripts"):
        for folder, _, names in os.walk(os.path.join(REPO, top)):
            for name in names:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read())
                positional += [f"{os.path.relpath(path, REPO)}:{node.lineno}" for node in ast.walk(tree)
                               if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "GcOptions"
                               and node.args]
    assert not positional, f"GcOptions given positional arguments: {positional}"
