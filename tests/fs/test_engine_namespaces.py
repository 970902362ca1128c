"""Engine leftovers across PID namespaces, with real namespaces (root only: unshare needs CAP_SYS_ADMIN).

- A creator inside a container names itself by its inner PID: found from the host through NSpid.
- kvctl whose /proc is a container's own procfs cannot see sibling containers: buffers stay unknown,
  while a socket's bind test (which sees every namespace) still proves a dead one dead.
- kvctl in a PID namespace of its own that reads the host's procfs sees everything: nothing is lost.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator

import pytest

from kvcached.node.base.layout import Layout
from kvcached.node.clean.decide import Policy, State
from kvcached.node.clean.leftovers.act import plan_engines
from kvcached.node.clean.leftovers.decide import EngineReason

from ..waiting import wait_until

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="new PID and mount namespaces need root")

_ENTER = textwrap.dedent("""
    import ctypes, os, sys
    libc = ctypes.CDLL(None, use_errno=True)
    def check(rc, what):
        if rc != 0:
            sys.exit(f"{what}: {os.strerror(ctypes.get_errno())}")
""")

# PID 1 of a new namespace forks PID 2, which reports its PIDs (host, inner) and waits.
INNER_CREATOR = _ENTER + textwrap.dedent("""
    check(libc.unshare(0x20000000), "unshare")
    if os.fork() == 0:
        if os.fork() == 0:
            with open("/proc/self/status") as f:
                nspid = [line.split()[1:] for line in f if line.startswith("NSpid:")][0]
            print("ready", " ".join(nspid), flush=True)
            sys.stdin.read()
            os._exit(0)
        os.wait()
        os._exit(0)
    os.wait()
""")

# In new PID and mount namespaces, PID 1 mounts a procfs of its own and plans with it and with the host's.
PLAN_INSIDE = _ENTER + textwrap.dedent("""
    import json
    root, own_proc, names = sys.argv[1], sys.argv[2], sys.argv[3:]
    check(libc.unshare(0x20000000 | 0x00020000), "unshare")
    check(libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None), "make / private")  # MS_REC | MS_PRIVATE
    if os.fork() == 0:
        check(libc.mount(b"proc", own_proc.encode(), b"proc", 0, None), "mount proc")
        from kvcached.node.clean.decide import Policy
        from kvcached.node.clean.leftovers.act import plan_engines
        from kvcached.node.base.layout import Layout
        out = {}
        for key, proc_root, whole in ((own_proc, own_proc, False), ("/proc", "/proc", False),
                                      ("vouched", own_proc, True)):
            p = plan_engines(Layout(root), Policy(grace=60), names=names, proc_root=proc_root, whole_view=whole)
            out[key] = {c.path: [str(d.state), str(d.reason)] for c, d in p.entries()}
        print(json.dumps(out), flush=True)
        os._exit(0)
    _, status = os.wait()
    sys.exit(os.waitstatus_to_exitcode(status))
""")


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        if p.stdin is not None:
            p.stdin.close()  # what the namespace's PID 2 waits on: it exits, then their init
        if p.poll() is None:
            p.kill()
        p.wait()


def _old(path: str) -> None:
    t = time.time() - 3600
    os.utime(path, (t, t), follow_symlinks=False)


def _write(path: str) -> None:
    with open(path, "wb") as f:
        f.write(b"s" * 4096)
    _old(path)


def test_a_creator_inside_a_container_is_found_by_its_inner_pid(layout: Layout, procs) -> None:  # type: ignore[no-untyped-def]
    p = subprocess.Popen([sys.executable, "-c", INNER_CREATOR], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    procs.append(p)
    assert p.stdout is not None
    ready, host, inner = p.stdout.readline().split()
    assert ready == "ready" and inner == "2" and host != "2"  # the host's PID 2 is kthreadd: no process here
    alive = os.path.join(layout.shm_dir, f"sgl_shm_mm_{inner}_0a1b2c3d")
    _write(alive)
    ((c, d),) = plan_engines(layout, Policy(grace=60), names=[os.path.basename(alive)]).entries()
    assert (d.state, d.reason, d.pids) == (State.LIVE, EngineReason.CREATOR_ALIVE, (int(host),))
    assert p.stdin is not None
    p.stdin.close()  # PID 2 reads its end of file and exits, then the namespace's init
    p.wait(timeout=30)
    wait_until(lambda: not os.path.exists(f"/proc/{host}"), 30, interval=0.05)
    ((c, d),) = plan_engines(layout, Policy(grace=60), names=[os.path.basename(alive)]).entries()
    assert (d.state, d.reason) == (State.STALE, EngineReason.CREATOR_GONE), d


def test_a_containers_own_procfs_leaves_buffers_unknown_but_sockets_provable(layout: Layout, tmp_path) -> None:  # type: ignore[no-untyped-def]
    buffer = os.path.join(layout.shm_dir, "psm_0a1b2c3d")
    _write(buffer)
    dead_socket = os.path.join(layout.tmp_dir, str(uuid.uuid4()))
    s = socket.socket(socket.AF_UNIX)
    s.bind(dead_socket)
    s.close()
    _old(dead_socket)
    own_proc = tmp_path / "proc"
    own_proc.mkdir()
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", PLAN_INSIDE, layout.root, str(own_proc), "psm_0a1b2c3d",
                        os.path.basename(dead_socket)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": repo})
    if r.returncode != 0 and ("unshare" in r.stderr or "mount" in r.stderr):
        pytest.skip(f"this machine refuses new namespaces: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    # Its own procfs: PID 1 is the container's init; sibling containers are out of sight.
    assert seen[str(own_proc)][buffer] == ["unknown", "view_incomplete"]
    assert seen[str(own_proc)][dead_socket] == ["stale", "not_listening"]
    # The host's procfs, from inside the same PID namespace (a hostPID-like view): complete.
    assert seen["/proc"][buffer] == ["stale", "unused"]
    # Its own procfs again, with the caller vouching that nothing outside it can reach these directories.
    assert seen["vouched"][buffer] == ["stale", "unused"]
    assert not os.path.ismount(own_proc), "the procfs must not have leaked into the host's mounts"
