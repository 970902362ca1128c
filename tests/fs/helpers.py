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
from typing import Any

from kvcached.node.base.layout import Layout
from kvcached.node.state.segment import create_segment


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


# Upstream's serial listener: one thread per rank, 4-byte big-endian framed requests. Its
# error path replies to the peer inside the exception handler; a peer that connected and
# closed without a request makes that reply raise EPIPE there, nothing catches it, and
# the thread dies (docs/NODE.md §3). The node stays; later clients queue up unanswered.
UPSTREAM_LISTENER = textwrap.dedent(r"""
    import json, struct


    def recv_exact(conn, n):
        buf = b""
        while len(buf) < n:
            chunk = conn.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("peer closed")
            buf += chunk
        return buf


    def send_msg(conn, obj):
        data = json.dumps(obj).encode()
        conn.sendall(struct.pack(">I", len(data)) + data)


    def serve(srv, rank):
        while True:
            conn, _ = srv.accept()
            try:
                body = recv_exact(conn, struct.unpack(">I", recv_exact(conn, 4))[0])
                send_msg(conn, {"status": "success", "rank": rank, "echo": body.decode()})
            except Exception as e:
                send_msg(conn, {"status": "error", "message": str(e)})  # EPIPE here kills the thread
            finally:
                conn.close()
""")

UPSTREAM_RUNTIME = UPSTREAM_LISTENER + textwrap.dedent(r"""
    # A stand-in for upstream kvcached's runtime, as strict as the real one (docs/CONTRIBUTING.md §12):
    #
    # - The IPC name is set through os.environ in Python, as an offline-inference
    #   launcher does: it never shows in /proc/<pid>/environ.
    # - The engine writes the 24-byte segment the way upstream does: open, flock,
    #   write, close. Between writes nothing holds it open or mapped.
    # - Each TP rank has one UPSTREAM_LISTENER thread, dying as upstream's does.
    #
    # argv: root, name, ranks, netns ("" or "private": bind in a network
    # namespace that no process is left in). stdin commands: "write N\n".
    import ctypes, fcntl, os, socket, sys, threading, uuid
    root, name, ranks, netns = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    os.environ["KVCACHED_IPC_NAME"] = name
    seg = os.path.join(root, "dev/shm", name)
    sdir = os.path.join(root, "tmp", f"kvcached-tp-{name}-{uuid.uuid5(uuid.NAMESPACE_DNS, name).hex[:8]}")

    def write_segment(total):
        fd = os.open(seg, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.ftruncate(fd, 24)
            os.pwrite(fd, struct.pack("=qqq", total, 0, 0), 0)
        finally:
            os.close(fd)

    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open("/proc/self/ns/net", os.O_RDONLY) if netns else -1
    if netns and libc.unshare(0x40000000) != 0:
        print("error unshare: " + os.strerror(ctypes.get_errno()), flush=True)
        sys.exit(1)
    os.makedirs(sdir, exist_ok=True)
    servers = []
    for rank in range(ranks):
        path = os.path.join(sdir, f"w{rank}.sock")
        if os.path.exists(path):
            os.remove(path)  # upstream's blind remove before bind
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(path)
        srv.listen(8)
        servers.append(srv)
    if netns and libc.setns(home, 0x40000000) != 0:
        print("error setns: " + os.strerror(ctypes.get_errno()), flush=True)
        sys.exit(1)
    write_segment(1 << 30)
    threads = [threading.Thread(target=serve, args=(srv, r), daemon=True) for r, srv in enumerate(servers)]
    for t in threads:
        t.start()
    print("ready", flush=True)
    for line in sys.stdin:
        if line.startswith("write "):
            write_segment(int(line.split()[1]))
            print("written", flush=True)
""")


class UpstreamRuntime:
    """A running upstream-like deployment (UPSTREAM_RUNTIME): segment, socket directory, `ranks` listeners."""

    def __init__(self, root: str, name: str, ranks: int = 2, *, netns: bool = False) -> None:
        env = {k: v for k, v in os.environ.items() if k != "KVCACHED_IPC_NAME"}
        self.proc = subprocess.Popen([sys.executable, "-c", UPSTREAM_RUNTIME, root, name, str(ranks),
                                      "private" if netns else ""], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            self.stop()
            raise OSError(f"upstream stand-in did not start: {line!r}")
        self.root, self.name, self.ranks = root, name, ranks

    def write(self, total: int) -> None:
        """Rewrite the segment the way upstream's engine does (it re-creates a missing one)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"write {total}\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "written"

    def answering(self, socket_dir: str) -> list[int]:
        """The ranks whose listener still answers a proper request."""
        ok = []
        for r in range(self.ranks):
            try:
                if upstream_request(os.path.join(socket_dir, f"w{r}.sock"), timeout=3.0)["status"] == "success":
                    ok.append(r)
            except OSError:
                pass
        return ok

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def start_upstream_listener(path: str) -> subprocess.Popen:
    """One upstream-like listener (one rank) at an arbitrary `path`, in its own process."""
    p = subprocess.Popen([sys.executable, "-c", UPSTREAM_ONE, path], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


# The same listener as UPSTREAM_RUNTIME's, alone, for a node at any path.
UPSTREAM_ONE = UPSTREAM_LISTENER + textwrap.dedent(r"""
    import os, socket, sys, threading
    path = sys.argv[1]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.exists(path):
        os.remove(path)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(8)

    t = threading.Thread(target=serve, args=(srv, 0), daemon=True)
    t.start()
    print("ready", flush=True)
    t.join()
    print("listener thread died", flush=True)
    sys.stdin.read()
""")


def upstream_request(path: str, payload: str = "hi", timeout: float = 2.0) -> dict:
    import json

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
        s.sendall(struct.pack(">I", len(payload)) + payload.encode())
        head = b""
        while len(head) < 4:
            chunk = s.recv(4 - len(head))
            if not chunk:
                raise ConnectionError("listener closed without a reply")
            head += chunk
        n = struct.unpack(">I", head)[0]
        body = b""
        while len(body) < n:
            chunk = s.recv(n - len(body))
            if not chunk:
                raise ConnectionError("short reply")
            body += chunk
        return json.loads(body)
    finally:
        s.close()


def kill_listener_like_a_bare_probe(path: str) -> None:
    """What an impolite probe does: connect and close at once (kills an upstream listener thread)."""
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
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
    from kvcached.node.clean.cleanup import run_cleanup
    from kvcached.node.clean.decide import Policy
    from kvcached.node.base.layout import Layout
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


def dead_deployment(layout: Layout, name: str, tp: int = 2) -> list[str]:
    """What a SIGKILLed serve leaves: its segment, its socket directory and nodes nobody serves, all old."""
    create_segment(layout.segment_path(name), 1 << 30)
    for rank in range(tp):
        stale_socket(layout.socket_path(name, rank))
    os.chmod(layout.socket_dir(name), 0o700)
    paths = [layout.socket_path(name, r) for r in range(tp)] + [layout.socket_dir(name), layout.segment_path(name)]
    for p in paths:
        backdate(p)
    return paths


def state_of(d: Any) -> list[str]:
    """Every path of a running harness deployment (a Deployment): segment, socket directory, each rank's node."""
    lay = d.layout
    return [lay.segment_path(d.name), lay.socket_dir(d.name)] + [p for _, _, p in lay.socket_paths(d.name, d.tp, d.pp)]
