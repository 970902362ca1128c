"""`kvctl doctor engine` answers for a running vLLM serve from what each of its processes published (issue 38).

The serves are real vLLM 0.33 serves (serves.py: vLLM's client, engine launch and executors, kvcached loaded
through vLLM's plugin loader and the installed entry point). With kvcached on, every engine process publishes
its record and doctor names the serve, kvcached active in each process, and the patches applied; with it
off, doctor says the serve has kvcached off and gives the switch, whatever this shell's environment says.
"""

from __future__ import annotations

import json
import os
import subprocess
from importlib.metadata import version
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed here (run scripts/install-vllm.sh in this venv)")
pytestmark = pytest.mark.vllm

from kvcached.integration.vllm.patches import REGISTRY  # noqa: E402

from ..conftest import KVCTL  # noqa: E402
from . import serves  # noqa: E402
from .serves import Serve, Shape  # noqa: E402

SERVE_ENV = {"KVCACHED_LIMIT": "2G"}


@pytest.fixture(autouse=True)
def _nothing_inherited() -> None:
    """A serve here is forked from this test process, which other tests may have had publish (they load vLLM's
    plugin in it): it withdraws, so that each serve's processes say only what their own plugin did."""
    from kvcached.integration.publish import withdraw

    withdraw()


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


def doctor(root: str, **env: str) -> dict[str, list[dict[str, Any]]]:
    """`kvctl --root ROOT doctor engine --json`, with this shell's environment as given: checks by name."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("KVCACHED_", "ENABLE_KVCACHED"))}
    r = subprocess.run([KVCTL, "--root", root, "doctor", "engine", "--json"], capture_output=True, text=True,
                       env={**full, **env}, timeout=300, stdin=subprocess.DEVNULL)
    assert r.returncode in (0, 8), r.stderr[-3000:]
    out: dict[str, list[dict[str, Any]]] = {}
    for c in json.loads(r.stdout)["checks"]:
        out.setdefault(c["name"], []).append(c)
    return out


def test_a_patched_serve_says_kvcached_is_active_in_each_process_and_what_it_applied(layout, start) -> None:
    s = start(Shape(owner="api", tp=2), True)
    (engine,) = s.engines
    checks = doctor(layout.root)  # the shell has kvcached off: it is no evidence of the serve's
    (line,) = checks["vllm-serve"]
    assert line["status"] == "ok", line
    serve = line["details"]["serve"]
    assert serve["pid"] == engine and serve["engine"] == "vllm", serve
    pids = {p["pid"] for p in serve["processes"]}
    assert {engine, *s.workers[engine]} <= pids, (s.workers, serve["processes"])
    assert all(p["published"] is not None for p in serve["processes"]), serve["processes"]
    assert "kvcached active in every process" in line["summary"] and f"serve PID {engine}" in line["summary"]
    applied = set(serve["applied"])
    assert applied and applied <= set(REGISTRY.names()) and "elastic-kv" not in applied, serve
    for p in serve["processes"]:
        record = p["published"]
        assert record["engine"] == "vllm" and record["root"] == layout.root
        assert record["engine_version"] == version("vllm")
        assert record["statuses"]["elastic-kv"] == "disabled", record  # its own switch, off here
    # The serve's word replaces the shell's view: no detect subprocess, no per-patch lines of this shell.
    assert not [n for n in checks if n.startswith("vllm-patch:") or n == "vllm"], sorted(checks)
    s.group_sigterm()
    assert s.wait_exit(60) == 0


def test_a_serve_with_kvcached_off_is_said_so_with_the_switch_whatever_the_shell_has(layout, start,
                                                                                     monkeypatch) -> None:
    """kvcached on in this shell, off in the serve: the serve's line says it is off, and gives the switch.

    A serve that published nothing belongs to the node's `/`, where other serves of this machine may run too:
    this serve's line is picked by its engine's PID, from the same functions doctor calls.
    """
    from kvcached.node.clean.facts import gather_facts
    from kvcached.node.ops.serves import find_serves, serve_lines

    s = start(Shape(owner="api", tp=1), False)
    (engine,) = s.engines
    monkeypatch.setenv("ENABLE_KVCACHED", "true")
    mine = [v for v in find_serves(gather_facts(), root="/") if engine in {p.pid for p in v.processes}]
    (line,) = [ln for ln in serve_lines(mine) if ln.under is None]
    assert line.status == "warn" and "kvcached not active" in line.summary, line
    assert "kvcached was not switched on in its environment" in line.summary, line
    assert line.fix is not None and line.fix.startswith("export ENABLE_KVCACHED=true in the serve's environment")
    s.group_sigterm()
    assert s.wait_exit(60) == 0
