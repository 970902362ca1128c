"""Small real-world actors for filesystem tests: listeners, stale nodes, planted files."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time


def stale_socket(path: str) -> tuple[int, int]:
    """Bind and close a socket at `path`: a node nobody serves (what SIGKILL leaves)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.close()
    st = os.lstat(path)
    return st.st_dev, st.st_ino


def live_socket(path: str) -> socket.socket:
    """A listening socket at `path` (the caller closes it)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.listen(8)
    return s


def backdate(path: str, seconds: float = 3600) -> None:
    """Age an entry past the grace period without following links."""
    t = time.time() - seconds
    os.utime(path, (t, t), follow_symlinks=False)


UPSTREAM_LISTENER = textwrap.dedent(r"""
    # An upstream-style worker listener (LAYOUT.md §3): one serial thread, 4-byte
    # big-endian length frames. Like upstream, a peer that connects and closes
    # without sending makes its error path raise, and the thread dies.
    import os, socket, struct, sys, threading, json
    path = sys.argv[1]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.exists(path):
        os.remove(path)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    def serve():
        while True:
            conn, _ = srv.accept()
            head = conn.recv(4)
            if len(head) < 4:
                raise ConnectionError("peer closed before a request")  # kills the thread
            body = conn.recv(struct.unpack(">I", head)[0])
            reply = json.dumps({"status": "success", "echo": body.decode()}).encode()
            conn.sendall(struct.pack(">I", len(reply)) + reply)
            conn.close()
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    print("ready", flush=True)
    t.join()
    print("listener thread died", flush=True)
    sys.stdin.read()
""")


def start_upstream_listener(path: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", UPSTREAM_LISTENER, path], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def upstream_request(path: str, payload: str = "hi", timeout: float = 2.0) -> dict:
    import json

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
        s.sendall(struct.pack(">I", len(payload)) + payload.encode())
        n = struct.unpack(">I", s.recv(4))[0]
        return json.loads(s.recv(n))
    finally:
        s.close()


def run_as(user, code: str, *args: str) -> subprocess.CompletedProcess:
    """Run Python `code` as an unprivileged user, with this checkout importable."""
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))}

    def drop() -> None:
        os.setgroups([])
        os.setgid(user.pw_gid)
        os.setuid(user.pw_uid)

    # The system interpreter: ours may live under /root, which other users cannot enter.
    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    return subprocess.run([python, "-c", code, *args], capture_output=True, text=True, env=env,
                          preexec_fn=drop, timeout=60)


def in_thread(fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


CLEANUP_AS_USER = textwrap.dedent("""
    import json, sys
    from kvcached.cleanup import run_cleanup
    from kvcached.decide import Policy
    from kvcached.layout import Layout
    r = run_cleanup(Layout(sys.argv[1]), Policy(grace=0))
    print(json.dumps([e.to_dict() for e in r.entries]))
""")


def cleanup_as(user, root: str) -> dict[str, dict]:
    """Run a real cleanup (grace 0) as `user` on `root`; its report entries by path."""
    import json

    out = run_as(user, CLEANUP_AS_USER, root)
    assert out.returncode == 0, out.stderr
    return {e["path"]: e for e in json.loads(out.stdout)}


def stop_one_kill_rest(dep, stage: int = 0, rank: int = 1) -> int:
    """SIGSTOP one worker of `dep` and SIGKILL every other process; returns the stopped pid."""
    import signal

    stopped = dep.worker_pids[(stage, rank)]
    os.kill(stopped, signal.SIGSTOP)
    for pid in dep.pids:
        if pid != stopped:
            dep.signal(pid, signal.SIGKILL)
    dep.wait(timeout=2)
    return stopped
