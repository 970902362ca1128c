"""The /metrics endpoint of `kvctl gc --every --metrics-port`: the last run's metrics over HTTP.

For clusters whose node_exporter has no textfile collector (or no
node_exporter): Prometheus scrapes the agent itself. The body is exactly the
textfile a run writes (kvcached.node.ops.metrics), held in memory and replaced
whole after each run, so a scrape sees one run's metrics, never a mix. A
thread of the standard library's http.server answers; it never runs a gc
and reads nothing on the node, so a scrape costs the node nothing and
cannot make a run late. Imported only when the flag is given.
"""

from __future__ import annotations

import http.server
import socket
import threading
from typing import Any

from .metrics import MetricsError

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus' text exposition format
PATH = "/metrics"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server
    timeout = 10  # a client that sends nothing must not hold a thread and a descriptor for ever
    server_version = "kvctl"
    sys_version = ""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self._answer(body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(body=False)

    def _answer(self, *, body: bool) -> None:
        if self.path.split("?", 1)[0] != PATH:
            self._send(404, f"not found: kvctl serves {PATH} only\n", body)
            return
        text = self.server.owner.previous()
        if not text:  # before the first run: no metrics is not "zero stale bytes"
            self._send(503, "no gc run has finished yet\n", body)
            return
        self._send(200, text, body, CONTENT_TYPE)

    def _send(self, code: int, text: str, body: bool, ctype: str = "text/plain; charset=utf-8") -> None:
        data = text.encode("utf-8")
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # stderr carries the loop's one line per run; a line per scrape would bury it


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True  # a scrape in flight must not keep the process from exiting on SIGTERM
    owner: MetricsServer


class _Server6(_Server):
    address_family = socket.AF_INET6  # an IPv6 address (`::` on an IPv6-only pod network)


class MetricsServer:
    """An HTTP endpoint serving the latest published metrics at /metrics (a metrics.Sink)."""

    def __init__(self, address: str, port: int) -> None:
        try:
            server = _Server6 if ":" in address else _Server
            self._http = server((address, port), _Handler, bind_and_activate=True)
        except OSError as e:
            raise MetricsError(f"--metrics-port: cannot listen on {address}:{port} ({e.strerror or e})") from None
        self._http.owner = self
        self._body = ""
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._http.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="kvctl-metrics", daemon=True)
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) it listens on: the port the kernel chose when 0 was asked for."""
        host, port = self._http.server_address[:2]
        return str(host), int(port)

    def previous(self) -> str:
        """The body served now ('' before the first run)."""
        with self._lock:
            return self._body

    def publish(self, body: str) -> None:
        """Serve `body` from now on."""
        with self._lock:
            self._body = body

    def close(self) -> None:
        """Stop answering and release the port."""
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
