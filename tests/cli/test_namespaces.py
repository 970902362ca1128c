"""`inspect --pid` reaches state that only another mount namespace sees (a container, PrivateTmp=)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from .conftest import kvctl

NS_CHILD = textwrap.dedent("""
    import subprocess, sys
    # Import first: the checkout itself may live under /tmp, which the mount hides.
    from kvcached.node.base.layout import Layout
    from kvcached.node.state.segment import create_segment
    from kvcached.runtime.ipc.listener import WorkerListener
    import kvcached.node.clean.facts, kvcached.node.clean.scan, kvcached.runtime.ipc.protocol  # noqa: F401
    # Private /tmp and /dev/shm, visible only inside this mount namespace.
    for d in ("/tmp", "/dev/shm"):
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=1777", "kvctest", d], check=True)
    name = sys.argv[1]
    layout = Layout()
    create_segment(layout.segment_path(name), 3 << 30)
    listener = WorkerListener(layout, name, 0)
    listener.start()
    print("ready", flush=True)
    sys.stdin.read()
""")


@pytest.fixture
def namespaced(uniq: str):
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) is not installed")
    name = f"{uniq}ns"
    p = subprocess.Popen(["unshare", "-m", "--propagation", "private", sys.executable, "-c", NS_CHILD, name],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "KVCACHED_IPC_NAME": name})
    line = p.stdout.readline().strip()
    if line != "ready":
        p.kill()
        err = p.stderr.read()
        if "Operation not permitted" in err or "cannot" in err:
            pytest.skip(f"cannot create a mount namespace here: {err.strip().splitlines()[-1]}")
        raise AssertionError(err)
    # `unshare` execs python, so p.pid is the namespaced process itself.
    yield p.pid, name
    p.kill()
    p.wait()


def test_inspect_pid_finds_state_only_its_namespace_sees(namespaced, root: str) -> None:
    pid, name = namespaced
    assert not os.path.exists(f"/dev/shm/{name}")  # the host does not see it

    doc = kvctl("inspect", "--pid", str(pid), "--json").json("inspect")
    deps = {d["name"]: d for d in doc["deployments"]}
    assert doc["pid"] == pid and name in deps
    dep = deps[name]
    assert dep["state"] == "live" and dep["segment"]["limit"] == 3 << 30
    sock = next(e for e in dep["entries"] if e["kind"] == "socket")
    assert sock["state"] == "live" and sock["served_by"] == [pid]
    assert sock["path"] == f"/proc/{pid}/root/tmp/kvcached-tp-{name}-" + sock["path"].split(f"{name}-")[1]
    # The namespaced process is the deployment's one process. Another test's `kvctl -A` reads every place
    # on the node, this namespace's /dev/shm too, and while it reads the segment it holds it: so a kvctl,
    # tied by that hold and nothing else, may be listed beside it.
    others = [p for p in dep["processes"] if p["pid"] != pid]
    assert pid in [p["pid"] for p in dep["processes"]], dep["processes"]
    assert all(p["via"] == "holds" and "kvctl" in " ".join(p.get("cmdline", [])) for p in others), others

    r = kvctl("inspect", "--pid", str(pid), name)
    assert r.code == 0 and "3G" in r.stdout and "live" in r.stdout

    # Plain inspect from the host says where else to look.
    doc = kvctl("--root", root, "inspect", "--json").json("inspect")
    ns = [n for n in doc["other_namespaces"] if pid in n["pids"]]
    assert ns and ns[0]["names"] == [name] and ns[0]["hint"] == f"kvctl inspect --pid {pid}"
    r = kvctl("--root", root, "inspect")
    assert f"kvctl --root {root} inspect --pid {pid}" in r.stdout  # pasted as printed: the same node
    r = kvctl("--root", root, "doctor", "namespaces")
    assert r.code == 0 and f"kvctl --root {root} inspect --pid {pid}" in r.stdout
