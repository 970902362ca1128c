"""`kvctl doctor engine` answers for a running SGLang serve from what each of its processes published (issue 38).

One real serve (tests/sglang/serve_driver.py: SGLang's main-side launch, its real scheduler process and
detokenizer, kvcached loaded through the `sglang.srt.plugins` entry point) with kvcached on, under a node
root of its own: doctor names it by its main, kvcached active in every process (the detokenizer too, which
applies no patch: it never imports what they hook), and the patches its scheduler applied; the shell kvctl
runs in has kvcached off, which changes nothing of that.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import KVCTL
from tests.sglang.serves import Serves, Spec, gone, sigterm_group
from tests.waiting import wait_for

pytestmark = pytest.mark.sglang

SERVE = Spec(detokenizer=True, tag="published")


@pytest.fixture(scope="module")
def serves(zygote) -> Iterator[Serves]:
    pool = Serves(zygote, Path(tempfile.mkdtemp(prefix="kvp", dir="/tmp")), (SERVE,), ahead=0)
    try:
        yield pool
    finally:
        pool.close()


def test_a_serve_says_kvcached_is_active_in_each_process_and_what_its_scheduler_applied(serves) -> None:
    from kvcached.integration.sglang.patches import REGISTRY

    serve = serves.get(SERVE)
    report = serve.report()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCACHED_", "ENABLE_KVCACHED"))}
    r = subprocess.run([KVCTL, "--root", str(serve.root), "doctor", "engine", "--json"], capture_output=True,
                       text=True, env=env, timeout=300, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-3000:]
    checks = json.loads(r.stdout)["checks"]
    (line,) = [c for c in checks if c["name"] == "sglang-serve"]
    assert line["status"] == "ok" and "kvcached active in every process" in line["summary"], line
    got = line["details"]["serve"]
    assert got["pid"] == serve.pid and got["engine"] == "sglang", got
    by_pid = {p["pid"]: p for p in got["processes"]}
    (scheduler,) = report["procs"]
    (detokenizer,) = [pid for pid in report["children"] if pid not in report["procs"]]
    assert {serve.pid, scheduler, detokenizer} <= set(by_pid), (report, got)
    assert by_pid[serve.pid]["title"] == "sglang main" and all(p["published"] for p in by_pid.values())
    applied = set(by_pid[scheduler]["published"]["applied"])
    assert {"sglang-listener", "sglang-segment", "sglang-scheduler-stop"} <= applied <= set(REGISTRY.names())
    assert by_pid[detokenizer]["published"]["applied"] == []  # active, and nothing it hooks was imported there
    assert "sglang-owner-cleanup" in by_pid[serve.pid]["published"]["applied"]
    assert all(p["published"]["root"] == str(serve.root) for p in by_pid.values())
    assert not [c for c in checks if c["name"] == "sglang" or c["name"].startswith("sglang-patch:")], checks
    sigterm_group(serve)
    wait_for(lambda: all(gone(p) for p in serve.children()), timeout=60, interval=0.1)
