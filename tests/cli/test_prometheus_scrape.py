"""A real Prometheus on the loopback scrapes `kvctl gc --every ... --metrics-port`, and loads the shipped alerts.

The prometheus binary is Debian's `prometheus` package's (.ci/run installs it); the test starts its own on a free
loopback port, with a config and a storage directory of its own, and kills it after. Where the binary is absent
the test skips, saying so. Its query API must show the target up, the gc metrics present, and the shipped rules
loaded and evaluated against them: the agent runs here without --engines, so KvctlGcEngineMetricsAbsent is
pending for it (its `for:` is half an hour) while no other alert is.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from .conftest import KVCTL, REPO

RULES = REPO / "contrib/prometheus/kvctl-gc-rules.yml"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _api(port: int, path: str, **query: str) -> Any:
    url = f"http://127.0.0.1:{port}/api/v1/{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
    with urllib.request.urlopen(url, timeout=10) as resp:
        doc = json.loads(resp.read())
    assert doc["status"] == "success", doc
    return doc["data"]


def _until(what: str, probe: Any, timeout: float = 60.0) -> Any:
    """Poll `probe` (which returns a value or None) every 0.2 s until it gives one; fail naming `what`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            got = probe()
        except OSError as e:  # not listening yet
            last = e
        else:
            if got:
                return got
            last = got
        time.sleep(0.2)
    pytest.fail(f"{what} within {timeout:g}s (last: {last!r})")


def _stop(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=30)


def test_prometheus_scrapes_the_agent_and_evaluates_the_alerts(layout, tmp_path: Path) -> None:
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip("prometheus is not installed (Debian: apt-get install prometheus; .ci/run does)")
    agent_port, web_port = _free_port(), _free_port()
    env = {**os.environ, "KVCTL_LOCK": os.path.join(layout.root, "gc.lock"), "KVCTL_EVERY_MIN_S": "0.01"}
    agent = subprocess.Popen([KVCTL, "--root", layout.root, "gc", "--yes", "--every", "1s", "--metrics-port",
                              str(agent_port), "--metrics-address", "127.0.0.1"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    config = tmp_path / "prometheus.yml"
    # The node label as the ServiceMonitor's relabelling gives it; honor_labels as the ServiceMonitor sets it.
    config.write_text(f"""
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
rule_files: ["{RULES}"]
scrape_configs:
  - job_name: kvctl-gc
    honor_labels: true
    static_configs:
      - targets: ["127.0.0.1:{agent_port}"]
        labels: {{node: test-node}}
""")
    log = open(tmp_path / "prometheus.log", "wb")
    server = subprocess.Popen([prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                               f"--web.listen-address=127.0.0.1:{web_port}", "--log.level=warn"],
                              stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        up = _until("the kvctl-gc target up", lambda: [
            r for r in _api(web_port, "query", query='up{job="kvctl-gc",node="test-node"}')["result"]
            if r["value"][1] == "1"])
        assert up[0]["metric"]["instance"] == f"127.0.0.1:{agent_port}"
        for metric in ("kvctl_gc_last_run_timestamp_seconds", "kvctl_gc_every_seconds", "kvctl_gc_entries"):
            series = _until(f"{metric} scraped", lambda m=metric: _api(web_port, "query", query=m)["result"])
            assert all(s["metric"]["node"] == "test-node" for s in series), series
        last_run = float(_api(web_port, "query", query="kvctl_gc_last_run_timestamp_seconds")["result"][0]["value"][1])
        assert abs(last_run - time.time()) < 60
        groups = _api(web_port, "rules")["groups"]
        loaded = {r["name"]: r for g in groups for r in g["rules"]}
        assert len(loaded) == len([ln for ln in RULES.read_text().splitlines() if "- alert:" in ln])
        pending = _until("KvctlGcEngineMetricsAbsent pending", lambda: [
            a for a in _api(web_port, "alerts")["alerts"] if a["labels"]["alertname"] == "KvctlGcEngineMetricsAbsent"])
        assert pending[0]["state"] == "pending" and pending[0]["labels"]["node"] == "test-node"
        assert pending[0]["annotations"]["summary"].startswith("kvctl gc agent on test-node does not judge")
        others = [a["labels"]["alertname"] for a in _api(web_port, "alerts")["alerts"]
                  if a["labels"]["alertname"] != "KvctlGcEngineMetricsAbsent"]
        assert others == [], others
        assert all(r["health"] == "ok" for r in loaded.values()), {n: r.get("lastError") for n, r in loaded.items()}
    finally:
        _stop(server)
        _stop(agent)
        log.close()
    assert server.returncode is not None and agent.returncode in (0, 3), agent.returncode
