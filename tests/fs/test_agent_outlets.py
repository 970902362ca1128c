"""The agent's outlets besides the textfile: the heartbeat file, and the metrics endpoint as a metrics sink.

Real files on tmp_path and a real HTTP server on 127.0.0.1; the loop that
drives them is tested in tests/cli/test_gc_agent.py.
"""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.error
import urllib.request

import pytest

from kvcached.node.clean.report import Report
from kvcached.node.ops import heartbeat, metrics
from kvcached.node.ops.metrics_http import CONTENT_TYPE, MetricsServer


def test_a_beat_is_written_whole_and_read_back(tmp_path) -> None:
    path = str(tmp_path / "hb")
    rec = heartbeat.Recorder(path)
    rec.record(3, finished=1000.0)
    rec.record(0, finished=1600.5)
    beat = heartbeat.read(path)
    assert beat == heartbeat.Beat(pid=os.getpid(), runs=2, finished=1600.5, exit_code=0)
    assert json.loads((tmp_path / "hb").read_text())[heartbeat.MARKER] == heartbeat.VERSION
    assert os.listdir(tmp_path) == ["hb"], "no temp file left behind"
    assert oct(os.stat(path).st_mode & 0o777) == "0o644"


def test_the_check_is_the_age_of_the_last_run(tmp_path) -> None:
    path = str(tmp_path / "hb")
    heartbeat.write(path, heartbeat.Beat(pid=1, runs=7, finished=1000.0, exit_code=0))
    fresh = heartbeat.check(path, max_age=60, now=1059.0)
    assert fresh.fresh and fresh.age == 59.0 and "#7, PID 1" in fresh.reason
    late = heartbeat.check(path, max_age=60, now=1061.0)
    assert not late.fresh and late.age == 61.0 and "makes no runs" in late.reason
    # The clock stepped back past the beat: as fresh as a beat can be, not an error.
    assert heartbeat.check(path, max_age=60, now=900.0) == heartbeat.Verdict(True, 0.0, fresh.reason.replace(
        "59 s", "0 s"))


@pytest.mark.parametrize("content", [b"", b"{}", b'{"kvctl_heartbeat": 2}', b"[1]", b"x" * 5000,
                                     b'{"kvctl_heartbeat": 1, "pid": "one"}'])
def test_anything_else_is_no_beat(tmp_path, content: bytes) -> None:
    path = tmp_path / "hb"
    path.write_bytes(content)
    verdict = heartbeat.check(str(path), max_age=1e9)
    assert not verdict.fresh and verdict.age is None and "not a kvctl heartbeat" in verdict.reason


def test_a_link_or_a_directory_is_neither_read_nor_written_over(tmp_path) -> None:
    target = tmp_path / "precious"
    target.write_text("keep me\n")
    link = tmp_path / "hb"
    link.symlink_to(target)
    with pytest.raises(heartbeat.HeartbeatError):
        heartbeat.write(str(link), heartbeat.Beat(pid=1, runs=1, finished=time.time(), exit_code=0))
    with pytest.raises(heartbeat.HeartbeatError):
        heartbeat.check_target(str(link))
    assert target.read_text() == "keep me\n"
    assert not heartbeat.check(str(link), max_age=1e9).fresh
    (tmp_path / "d").mkdir()
    with pytest.raises(heartbeat.HeartbeatError):
        heartbeat.check_target(str(tmp_path / "d"))
    with pytest.raises(heartbeat.HeartbeatError, match="no directory"):
        heartbeat.check_target(str(tmp_path / "nowhere" / "hb"))


def _empty_report(finished: float) -> Report:
    return Report(dry_run=False, entries=[], errors=[], started=finished - 1, finished=finished)


def _get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


def test_the_endpoint_serves_what_was_published_and_503_before(tmp_path) -> None:
    with MetricsServer("127.0.0.1", 0) as server:
        host, port = server.address
        url = f"http://{host}:{port}/metrics"
        assert _get(url)[0] == 503
        metrics.write_report(None, _empty_report(2000.0), success=True, sink=server)
        status, ctype, body = _get(url)
        assert (status, ctype) == (200, CONTENT_TYPE)
        assert body == server.previous() and "kvctl_gc_last_success_timestamp_seconds 2000" in body
        # A failed run: the last success is carried from what the endpoint served.
        metrics.write_report(None, _empty_report(2600.0), success=False, sink=server)
        body = _get(url)[2]
        assert "kvctl_gc_last_run_timestamp_seconds 2600" in body
        assert "kvctl_gc_last_success_timestamp_seconds 2000" in body
        assert _get(url + "?x=1")[0] == 200 and _get(f"http://{host}:{port}/other")[0] == 404


def test_with_a_textfile_too_both_get_the_same_body(tmp_path) -> None:
    prom = tmp_path / "kvctl.prom"
    with MetricsServer("127.0.0.1", 0) as server:
        metrics.write_report(str(prom), _empty_report(3000.0), success=True, sink=server)
        metrics.write_lock_busy(str(prom), 3100.0, 3100.5, sink=server)
        assert prom.read_text() == server.previous()
        assert "kvctl_gc_lock_busy 1" in server.previous()


def test_a_new_endpoint_carries_the_last_success_of_the_textfile_before_it(tmp_path) -> None:
    """A restarted agent: its endpoint has served nothing yet, the textfile holds the last loop's success."""
    prom = tmp_path / "kvctl.prom"
    metrics.write_report(str(prom), _empty_report(3000.0), success=True)
    with MetricsServer("127.0.0.1", 0) as server:
        metrics.write_report(str(prom), _empty_report(3600.0), success=False, sink=server)
        assert "kvctl_gc_last_success_timestamp_seconds 3000" in server.previous()
        assert prom.read_text() == server.previous()


def test_a_port_taken_is_a_metrics_error() -> None:
    with MetricsServer("127.0.0.1", 0) as first:
        with pytest.raises(metrics.MetricsError, match=f"127.0.0.1:{first.address[1]}"):
            MetricsServer("127.0.0.1", first.address[1])


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_an_ipv6_address_is_served_too() -> None:
    with MetricsServer("::1", 0) as server:
        server.publish("kvctl_gc_failures 0\n")
        host, port = server.address
        assert host == "::1"
        assert _get(f"http://[::1]:{port}/metrics")[2] == "kvctl_gc_failures 0\n"
