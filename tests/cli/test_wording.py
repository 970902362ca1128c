"""Issue 38's small wording: what kvctl says reads as an operator would say it, once.

Each case is the installed kvctl in a child process (off a terminal, as cron and scripts run it).
"""

from __future__ import annotations

import os
import subprocess

from ..fs.helpers import backdate
from .conftest import KVCTL, kvctl
from .test_safety import dead_deployment, lock_env


def test_a_root_that_does_not_exist_is_said_so(tmp_path) -> None:
    missing = str(tmp_path / "nowhere")
    r = kvctl("--root", missing, "inspect")
    assert r.code == 2 and r.stderr.strip() == f"kvctl: --root {missing}: the directory does not exist", r.stderr
    (tmp_path / "file").write_text("")
    r = kvctl("--root", str(tmp_path / "file"), "inspect")
    assert r.code == 2 and r.stderr.strip().endswith(": not a directory"), r.stderr


def test_json_before_the_command_says_where_it_goes(layout) -> None:
    r = kvctl("--root", layout.root, "--json", "inspect")
    assert r.code == 2, r
    assert "--json goes after the command's name: kvctl inspect --json" in r.stderr, r.stderr
    doc = r.json("error")  # --json was asked for: the refusal is a document too
    assert doc["error"]["name"] == "usage" and "kvctl inspect --json" in doc["error"]["message"]
    r = kvctl("--root", layout.root, "--bogus", "inspect")  # any other unknown option: click's own words
    assert r.code == 2 and "No such option: --bogus" in r.stderr


def test_one_stale_entry_remains(layout, uniq) -> None:
    """Off a terminal without --yes gc removes nothing and says how many remain, in agreement with the count."""
    name = f"{uniq}w"
    seg = layout.segment_path(name)
    from kvcached.node.state.segment import create_segment

    create_segment(seg, 1 << 20)
    os.makedirs(layout.socket_dir(name), mode=0o700)  # ties the explicit name to kvcached; empty: stale with it
    backdate(layout.socket_dir(name), 600)
    backdate(seg, 600)
    r = kvctl("--root", layout.root, "gc", "--kind", "segment", env=lock_env(layout))
    assert r.code == 3 and "nothing removed: 1 stale entry remains;" in r.stderr, r.stderr
    r = kvctl("--root", layout.root, "gc", env=lock_env(layout))
    assert r.code == 3 and "nothing removed: 2 stale entries remain;" in r.stderr, r.stderr


def test_ages_read_as_durations(layout, uniq) -> None:
    name = f"{uniq}y"
    dead_deployment(layout, name, seconds=5)  # dead, but inside a grace of 1 h 2 min 5 s
    r = kvctl("--root", layout.root, "gc", "--dry-run", "--min-age", "3725", "--json")
    details = {e["detail"] for e in r.json("gc")["entries"] if e["reason"] == "younger_than_grace"}
    assert details and all(d.endswith("ago, grace is 1 h 2 min") for d in details), details
    assert all("s ago" in d and "5s" not in d for d in details), details


def test_gc_off_a_terminal_says_its_summary_once(layout, uniq, tmp_path) -> None:
    """stdout and stderr into one file (a journal, a pod's log, `2>&1`): the summary once, as the log line."""
    dead_deployment(layout, f"{uniq}o")
    log = tmp_path / "log"
    with open(log, "w") as both:
        r = subprocess.run([KVCTL, "--root", layout.root, "gc", "--yes"], stdout=both, stderr=subprocess.STDOUT,
                           env={**os.environ, **lock_env(layout)}, timeout=60, stdin=subprocess.DEVNULL)
    text = log.read_text()
    assert r.returncode == 0 and "REMOVED" in text.upper(), text
    assert text.count("removed 4, kept 0") == 1, text
    (line,) = [ln for ln in text.splitlines() if "removed 4, kept 0" in ln]
    assert line.endswith("kvctl gc: removed 4, kept 0"), line  # the timestamped log line, not the report's
    dead_deployment(layout, f"{uniq}p")
    r = kvctl("--root", layout.root, "gc", "--dry-run")  # a dry run logs nothing: its summary stays on stdout
    assert r.stdout.count("would remove 4, kept 0") == 1 and "would remove" not in r.stderr, r
