"""Never harm live state (issue 10): an upstream-like runtime, every way its evidence can hide.

Each test runs kvctl (the installed program, as an operator does) against a
running stand-in of upstream kvcached's runtime (tests/fs/helpers.py
UPSTREAM_RUNTIME): the IPC name set through os.environ (invisible in
/proc/<pid>/environ), a segment nobody holds between writes, and listeners
that die on a bare connect-and-close exactly as upstream's do. After every
command the listeners must still answer and nothing of the deployment may be
gone; each test first shows, as a control, that an impolite connect does kill
a listener, so "still answers" can fail.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest

from kvcached.node.base import name_rules
from kvcached.node.base.layout import Layout

from ..conftest import KVCTL
from ..fs.helpers import UpstreamRuntime, backdate, kill_listener_like_a_bare_probe
from ..waiting import wait_for
from .kit import make_root, uniq

READ_ONLY = (["inspect"], ["inspect", "--json"], ["list"], ["list", "--json"], ["gc", "--dry-run"],
             ["gc", "--dry-run", "--min-age", "0", "--json"], ["doctor", "stale"], ["top", "--count", "1"])
REMOVING = (["gc", "--yes"], ["gc", "--yes", "--min-age", "0"], ["gc", "--yes", "--min-age", "0", "--kind", "segment"])


def run(root: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("KVCTL_ROOT", "KVCTL_LOCK")}
    return subprocess.run([KVCTL, "--root", root, *args], capture_output=True, text=True, timeout=120, env=env,
                          stdin=subprocess.DEVNULL)


def age_everything(layout: Layout, name: str, seconds: float = 600) -> None:
    """Ten minutes old: past any grace age; only evidence of life may keep it."""
    d = layout.socket_dir(name)
    for entry in os.listdir(d):
        backdate(os.path.join(d, entry), seconds)
    backdate(d, seconds)
    backdate(layout.segment_path(name), seconds)


def snapshot(layout: Layout, name: str) -> dict[str, tuple[int, int]]:
    d = layout.socket_dir(name)
    paths = [layout.segment_path(name), d] + [os.path.join(d, e) for e in os.listdir(d)]
    return {p: (os.lstat(p).st_dev, os.lstat(p).st_ino) for p in paths}


def assert_untouched(kvctl_root: str, layout: Layout, rt: UpstreamRuntime, before: dict[str, tuple[int, int]],
                     commands: tuple[list[str], ...]) -> None:
    for args in commands:
        r = run(kvctl_root, *args, rt.name) if args[0] in ("gc", "inspect", "list") else run(kvctl_root, *args)
        assert "Traceback" not in r.stderr, r.stderr
        for path, ident in before.items():
            assert os.path.lexists(path), f"`kvctl {' '.join(args)}` removed live {path}: {r.stdout}{r.stderr}"
            st = os.lstat(path)
            assert (st.st_dev, st.st_ino) == ident, f"`kvctl {' '.join(args)}` replaced {path}"
        assert rt.answering(layout.socket_dir(rt.name)) == list(range(rt.ranks)), \
            f"`kvctl {' '.join(args)}` killed an upstream listener: {r.stdout}{r.stderr}"


@pytest.fixture
def runtime(node: Layout) -> Iterator[UpstreamRuntime]:
    rt = UpstreamRuntime(node.root, uniq("up"), ranks=2)
    yield rt
    rt.stop()


def test_the_upstream_stand_in_dies_on_a_bare_connect(node: Layout, runtime: UpstreamRuntime) -> None:
    """The control for every test below: an impolite probe kills the listener it touches."""
    d = node.socket_dir(runtime.name)
    assert runtime.answering(d) == [0, 1]
    kill_listener_like_a_bare_probe(os.path.join(d, "w1.sock"))
    wait_for(lambda: runtime.answering(d) == [0])


def test_a_deployment_named_through_os_environ_keeps_its_segment(node: Layout, runtime: UpstreamRuntime) -> None:
    """Issue 10 §1: two answering listeners, an old unheld segment, no name in /proc: all of it is live."""
    name = runtime.name
    age_everything(node, name)
    with open(f"/proc/{runtime.proc.pid}/environ", "rb") as f:
        assert name_rules.ENV_NAME.encode() not in f.read(), "the stand-in must hide its name like os.environ does"
    before = snapshot(node, name)
    assert_untouched(node.root, node, runtime, before, READ_ONLY + REMOVING)
    doc = json.loads(run(node.root, "inspect", name, "--json").stdout)
    dep = doc["deployments"][0]
    assert dep["state"] == "live"
    seg = next(e for e in dep["entries"] if e["kind"] == "segment")
    assert (seg["state"], seg["reason"]) == ("live", "deployment_live"), seg
    assert runtime.proc.pid in [p["pid"] for p in dep["processes"]], "inspect must show who serves it"
    assert "no processes of this deployment are alive" not in run(node.root, "inspect", name).stdout
    # Still the engine's segment: its next write lands in the same file, with the limit it had.
    runtime.write(2 << 30)
    assert os.lstat(node.segment_path(name)).st_ino == before[node.segment_path(name)][1]


def test_a_pods_tmp_bind_mounted_elsewhere(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Issue 10 §2: --root R where R/tmp is a bind mount of the directory the listener bound in.

    /proc/net/unix names the node by the path the listener bound (D/...),
    kvctl reaches it as R/tmp/...: only the file's identity ties the two.
    """
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("bind mounts need root and mount(8)")
    base = str(tmp_path_factory.mktemp("pod"))
    pod = make_root(os.path.join(base, "pod"))      # where the pod's processes bind
    host = make_root(os.path.join(base, "host"))    # how the operator's --root reaches it
    r = subprocess.run(["mount", "--bind", pod.tmp_dir, host.tmp_dir], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {r.stderr.strip()}")
    try:
        subprocess.run(["mount", "--bind", pod.shm_dir, host.shm_dir], check=True)
        try:
            rt = UpstreamRuntime(pod.root, uniq("pod"), ranks=2)
            try:
                age_everything(pod, rt.name)
                before = snapshot(host, rt.name)
                assert_untouched(host.root, host, rt, before, READ_ONLY + REMOVING)
            finally:
                rt.stop()
        finally:
            subprocess.run(["umount", host.shm_dir], check=True)
    finally:
        subprocess.run(["umount", host.tmp_dir], check=True)


def test_a_symlinked_root(node: Layout, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Issue 10 §2: --root L where L is a symbolic link to the node root."""
    link = os.path.join(str(tmp_path_factory.mktemp("ln")), "r")
    os.symlink(node.root, link)
    rt = UpstreamRuntime(node.root, uniq("sl"), ranks=2)
    try:
        age_everything(node, rt.name)
        before = snapshot(node, rt.name)
        assert_untouched(link, node, rt, before, READ_ONLY + REMOVING)
        doc = json.loads(run(link, "inspect", rt.name, "--json").stdout)
        assert doc["root"] == os.path.realpath(link)
    finally:
        rt.stop()


def test_a_listener_whose_network_namespace_has_no_process(node: Layout) -> None:
    """Issue 10 §2: the sockets live in a network namespace no process is in: no listing shows them."""
    try:
        rt = UpstreamRuntime(node.root, uniq("ns"), ranks=2, netns=True)
    except OSError as e:
        if "unshare" in str(e) or "setns" in str(e):
            pytest.skip(f"cannot create a network namespace here: {e}")
        raise
    try:
        age_everything(node, rt.name)
        with open(f"/proc/{rt.proc.pid}/net/unix") as f:
            assert rt.name not in f.read(), "the listeners must be invisible to /proc/*/net/unix"
        before = snapshot(node, rt.name)
        assert_untouched(node.root, node, rt, before, READ_ONLY + REMOVING)
        doc = json.loads(run(node.root, "inspect", rt.name, "--json").stdout)
        socks = [e for e in doc["deployments"][0]["entries"] if e["kind"] == "socket"]
        assert {(e["state"], e["reason"]) for e in socks} == {("live", "bound")}
    finally:
        rt.stop()


@pytest.fixture
def elsewhere(node: Layout, tmp_path_factory: pytest.TempPathFactory) -> Layout:
    """The same node reached through another path (a symlink): what a listing names differs from ours."""
    link = os.path.join(str(tmp_path_factory.mktemp("via")), "r")
    os.symlink(node.root, link)
    return Layout(link)


def test_our_listener_refuses_an_upstream_nodes_path_without_killing_it(node: Layout, elsewhere: Layout) -> None:
    """Our worker starting under a live upstream deployment's name must neither take over nor kill it."""
    from kvcached.node.base.errors import SocketInUse
    from kvcached.runtime.ipc.listener import WorkerListener

    rt = UpstreamRuntime(node.root, uniq("ov"), ranks=1)
    try:
        with pytest.raises(SocketInUse, match="bound") as e:
            WorkerListener(elsewhere, rt.name, 0).start()
        assert rt.proc.pid in e.value.pids
        assert rt.answering(node.socket_dir(rt.name)) == [0]
    finally:
        rt.stop()


def test_owner_cleanup_leaves_an_upstream_listener_alone(node: Layout, elsewhere: Layout) -> None:
    """An engine owner whose captured node is now served by an upstream listener keeps it, politely."""
    from kvcached.node.in_engine.captured import WorkerSocketCleanup

    rt = UpstreamRuntime(node.root, uniq("ow"), ranks=2)
    try:
        cleanup = WorkerSocketCleanup(elsewhere, rt.name, 2)
        assert cleanup.capture() == 2
        result = cleanup.cleanup()
        assert not result.removed and len(result.kept) == 2
        assert rt.answering(node.socket_dir(rt.name)) == [0, 1]
    finally:
        rt.stop()
