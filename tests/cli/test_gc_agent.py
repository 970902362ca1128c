"""`kvctl gc --every` as a node agent: its heartbeat and the probe that reads it, its /metrics endpoint.

The installed kvctl in a subprocess: a real loop, stopped and resumed by real
signals (SIGSTOP, SIGCONT), scraped over real HTTP on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvcached.node.base.layout import Layout
from kvcached.node.state.gclock import GcLock
from kvctl.exitcodes import Exit

from ..fs.helpers import backdate, stale_socket
from ..waiting import wait_for
from .conftest import KVCTL, assert_one_line_error, kvctl

FAST = {"KVCTL_EVERY_MIN_S": "0.001"}


class Agent:
    """`kvctl gc --every ...` in the background, its JSON lines as they come, always reaped."""

    def __init__(self, layout: Layout, tmp: Path, *args: str) -> None:
        env = {**os.environ, **FAST, "KVCTL_LOCK": str(tmp / "gc.lock")}
        env.pop("KVCTL_ROOT", None)
        self.p = subprocess.Popen([KVCTL, "--root", layout.root, "gc", *args], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env)

    def line(self) -> dict:
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        assert line, f"kvctl gc --every exited ({self.p.wait()}): {self.p.stderr.read() if self.p.stderr else ''}"
        return json.loads(line)

    def stop(self) -> tuple[int, str]:
        self.p.send_signal(signal.SIGCONT)  # a stopped loop would never see the SIGTERM
        self.p.send_signal(signal.SIGTERM)
        _, err = self.p.communicate(timeout=60)
        return self.p.returncode, err

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGCONT)
            self.p.kill()
        self.p.communicate()


@pytest.fixture
def agents():
    started: list[Agent] = []
    yield started
    for a in started:
        a.kill()


def _beat(path: Path) -> dict:
    return json.loads(path.read_text())


def _probe(path: Path, max_age: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([KVCTL, "gc", "--check-heartbeat", str(path), "--max-age", max_age],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


def _wait(cond, timeout: float = 30.0, what: str = "") -> None:
    wait_for(cond, timeout, interval=0.05, explain=lambda: f"waiting for {what}")


def test_the_heartbeat_follows_the_runs_and_the_probe_sees_a_stopped_loop(layout, tmp_path, agents) -> None:
    """Fresh while the loop runs; stale once it is SIGSTOPped past --max-age; fresh again after SIGCONT."""
    hb = tmp_path / "heartbeat"
    agent = Agent(layout, tmp_path, "--every", "0.2", "--dry-run", "--json", "--heartbeat", str(hb))
    agents.append(agent)
    agent.line()
    _wait(lambda: hb.exists() and _beat(hb)["runs"] >= 3, what="three beats")
    beat = _beat(hb)
    assert beat["kvctl_heartbeat"] == 1 and beat["pid"] == agent.p.pid and beat["exit_code"] == 0
    ok = _probe(hb, "3s")
    assert ok.returncode == 0 and ok.stdout.startswith("ok: ") and ok.stderr == "", ok
    assert f"PID {agent.p.pid}" in ok.stdout

    agent.p.send_signal(signal.SIGSTOP)
    stopped_at = _beat(hb)
    time.sleep(3.5)
    assert _beat(hb) == stopped_at, "a stopped loop wrote a beat"
    late = _probe(hb, "3s")
    assert late.returncode == Exit.UNHEALTHY, late
    assert "the loop makes no runs" in late.stderr and late.stdout == ""

    agent.p.send_signal(signal.SIGCONT)
    _wait(lambda: _beat(hb)["runs"] > stopped_at["runs"], what="a beat after SIGCONT")
    assert _probe(hb, "3s").returncode == 0
    code, err = agent.stop()
    assert code == Exit.OK, err
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")], "a half-written heartbeat was left"


def test_a_failed_run_beats_too_with_its_code(layout, tmp_path, agents) -> None:
    """The lock busy: every run fails (exit 5) and says so in its beat; the loop is alive, so the probe passes."""
    hb = tmp_path / "heartbeat"
    lock = GcLock(layout, path=str(tmp_path / "gc.lock"))
    lock.acquire()
    try:
        agent = Agent(layout, tmp_path, "--every", "0.1", "--yes", "--json", "--heartbeat", str(hb))
        agents.append(agent)
        assert agent.line()["exit_code"] == Exit.LOCK_BUSY
        _wait(lambda: hb.exists() and _beat(hb)["runs"] >= 2, what="two beats")
        assert _beat(hb)["exit_code"] == Exit.LOCK_BUSY
        assert _probe(hb, "1m").returncode == 0
    finally:
        lock.release()


def test_the_probe_fails_on_no_heartbeat_and_on_a_file_not_ours(tmp_path) -> None:
    r = kvctl("gc", "--check-heartbeat", str(tmp_path / "none"), "--max-age", "1m")
    assert_one_line_error(r, Exit.UNHEALTHY)
    assert "no heartbeat" in r.stderr
    (tmp_path / "junk").write_text("not a beat\n")
    r = kvctl("gc", "--check-heartbeat", str(tmp_path / "junk"), "--max-age", "1m")
    assert_one_line_error(r, Exit.UNHEALTHY)
    assert "not a kvctl heartbeat" in r.stderr


@pytest.mark.parametrize("argv", [
    ["gc", "--check-heartbeat", "HB"],                                   # no --max-age
    ["gc", "--check-heartbeat", "HB", "--max-age", "1m", "--yes"],       # a gc option: it runs no gc
    ["gc", "--check-heartbeat", "HB", "--max-age", "1m", "my-serve"],
    ["gc", "--yes", "--heartbeat", "HB"],                                # no --every
    ["gc", "--dry-run", "--metrics-port", "9407"],
    ["gc", "--dry-run", "--max-age", "1m"],
    ["gc", "--every", "10m", "--dry-run", "--metrics-port", "0"],        # not a port
], ids=lambda a: " ".join(a[1:]))
def test_what_the_agent_flags_refuse(argv: list[str], tmp_path) -> None:
    r = kvctl(*[str(tmp_path / "hb") if a == "HB" else a for a in argv])
    assert_one_line_error(r, Exit.USAGE)


def test_a_heartbeat_that_cannot_be_written_stops_the_loop_before_its_first_run(layout, tmp_path) -> None:
    r = kvctl("--root", layout.root, "gc", "--every", "10m", "--dry-run", "--heartbeat",
              str(tmp_path / "missing" / "hb"), env={**FAST, "KVCTL_LOCK": str(tmp_path / "gc.lock")})
    assert_one_line_error(r, Exit.ERROR)
    assert "no directory" in r.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, method: str = "GET") -> tuple[int, dict[str, str], str]:
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, dict(resp.headers), resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in the metrics")


def _dead_engine_buffer(layout: Layout) -> Path:
    path = Path(layout.root) / "dev/shm" / f"psm_{os.getpid() % 0xFFFFFFFF:08x}"
    path.write_bytes(b"\0" * 8192)
    backdate(str(path))
    return path


def test_the_endpoint_serves_each_runs_metrics_the_textfile_has(layout, tmp_path, agents) -> None:
    port = _free_port()
    prom = tmp_path / "kvctl.prom"
    buf = _dead_engine_buffer(layout)
    stale_socket(str(Path(layout.root) / "tmp" / "1b4e28ba-2fa1-4d3b-a3f5-ef19b5a7633b"))
    agent = Agent(layout, tmp_path, "--every", "0.3", "--dry-run", "--engines", "--json", "--prometheus", str(prom),
                  "--metrics-port", str(port))
    agents.append(agent)
    agent.line()
    url = f"http://127.0.0.1:{port}/metrics"
    status, headers, body = _get(url)
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    # The body is a whole run's, the one the textfile has (or the next run's, if one ended in between).
    assert body == prom.read_text() or _sample(body, "kvctl_gc_last_run_timestamp_seconds") > _sample(
        prom.read_text(), "kvctl_gc_last_run_timestamp_seconds")
    assert 'kvctl_gc_engine_bytes{engine="vllm",state="stale"} 8192' in body
    first = _sample(body, "kvctl_gc_last_run_timestamp_seconds")
    _wait(lambda: _sample(_get(url)[2], "kvctl_gc_last_run_timestamp_seconds") > first, what="the next run's metrics")
    status, headers, body = _get(url, "HEAD")
    assert status == 200 and body == "" and int(headers["Content-Length"]) > 0
    assert _get(f"http://127.0.0.1:{port}/")[0] == 404
    code, err = agent.stop()
    assert code == Exit.STALE_REMAIN, err  # a dry run leaves the dead buffer: exit 3, and it is still there
    assert buf.exists()
    assert "serving the last run's metrics on http://127.0.0.1:" in err
    with pytest.raises(OSError):  # the port went with the process
        socket.create_connection(("127.0.0.1", port), timeout=5)


def test_the_endpoint_alone_carries_the_last_success_and_says_a_busy_lock(layout, tmp_path, agents) -> None:
    """No textfile: the endpoint's own previous body keeps the last success across runs that found the lock busy."""
    port = _free_port()
    agent = Agent(layout, tmp_path, "--every", "0.2", "--yes", "--json", "--metrics-port", str(port))
    agents.append(agent)
    assert agent.line()["exit_code"] == 0
    url = f"http://127.0.0.1:{port}/metrics"
    success = _sample(_get(url)[2], "kvctl_gc_last_success_timestamp_seconds")
    lock = GcLock(layout, path=str(tmp_path / "gc.lock"))
    lock.acquire()
    try:
        while agent.line()["schema"] != "kvctl.error/1":
            pass
        _wait(lambda: _sample(_get(url)[2], "kvctl_gc_lock_busy") == 1, what="a busy run's metrics")
        body = _get(url)[2]
        assert _sample(body, "kvctl_gc_last_success_timestamp_seconds") == success
        assert "kvctl_gc_entries{" in body, "a busy run keeps the last real run's counts"
    finally:
        lock.release()


def test_a_port_in_use_is_said_before_any_run(layout, tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = kvctl("--root", layout.root, "gc", "--every", "10m", "--dry-run", "--json", "--metrics-port", str(port),
                  env={**FAST, "KVCTL_LOCK": str(tmp_path / "gc.lock")})
    assert r.code == Exit.ERROR and f"127.0.0.1:{port}" in r.stderr and "Traceback" not in r.stderr
    assert r.stdout.strip() == "" or json.loads(r.stdout)["schema"] == "kvctl.error/1"


def test_without_the_flags_no_http_code_is_loaded(layout, tmp_path) -> None:
    """A gc run without --metrics-port or --heartbeat imports neither http.server, the endpoint nor the heartbeat."""
    code = ("import sys; from kvctl.cli import main; sys.argv = ['kvctl', '--root', sys.argv[1], 'gc', '--dry-run'];\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m in ('http.server', 'kvcached.node.ops.metrics_http', "
            "'kvcached.node.ops.heartbeat')), file=sys.stderr)")
    r = subprocess.run([os.path.join(os.path.dirname(KVCTL), "python"), "-c", code, layout.root],
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "KVCTL_LOCK": str(tmp_path / "gc.lock")})
    assert r.stderr.strip().splitlines()[-1] == "[]", r.stderr
