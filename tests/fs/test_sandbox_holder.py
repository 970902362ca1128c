"""A sandbox's holder from each runtime's state (kvcached/node/places/sandbox.py), on planted state files (root).

The holder is a real process that is PID 1 of its own PID namespace
(`unshare --pid --fork`), as a pause or catatonit process is; the runtime's
files are planted under a scratch root laid out as the node's `/`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcached.node.clean.facts import gather_facts
from kvcached.node.places.sandbox import holder_of

from ..waiting import wait_until

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                reason="a process that is PID 1 of its own PID namespace needs root and unshare(1)")

SID = "ab" * 32
OTHER = "cd" * 32


@pytest.fixture
def init() -> Iterator[int]:
    """The host PID of a process that is PID 1 of a new PID namespace."""
    p = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "sleep", "600"])
    children = f"/proc/{p.pid}/task/{p.pid}/children"
    assert wait_until(lambda: os.path.exists(children) and open(children).read().split(), timeout=10)
    child = int(open(children).read().split()[0])
    try:
        yield child
    finally:
        p.kill()
        p.wait()


def _write(path: Path, text: str, mode: int = 0o644) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)
    return path


def _crio(root: Path, pid: int, *, kind: str | None = "sandbox", mode: int = 0o644) -> Path:
    ann = {} if kind is None else {"io.kubernetes.cri-o.ContainerType": kind}
    ann |= {"io.kubernetes.pod.name": "web-0", "io.kubernetes.pod.namespace": "serving",
            "io.kubernetes.pod.uid": "0f0e0d0c-0b0a-0908-0706-050403020100"}
    _write(root / "var/lib/containers/storage/overlay-containers" / SID / "userdata/config.json",
           json.dumps({"annotations": ann}))
    return _write(root / "run/containers/storage/overlay-containers" / SID / "userdata/pidfile", f"{pid}", mode)


def test_cri_o_names_its_sandbox_init_and_the_pod(tmp_path: Path, init: int) -> None:
    _crio(tmp_path, init)
    h = holder_of("cri-o", SID, gather_facts(), (init,), str(tmp_path))
    assert h is not None and h.pid == init and h.why is None
    assert (h.pod, h.namespace, h.pod_uid) == ("web-0", "serving", "0f0e0d0c-0b0a-0908-0706-050403020100")


def test_a_container_that_is_no_sandbox_has_no_holder(tmp_path: Path, init: int) -> None:
    _crio(tmp_path, init, kind="container")
    h = holder_of("cri-o", SID, gather_facts(), (init,), str(tmp_path))
    assert h is not None and h.pid is None and "not a sandbox" in (h.why or "")


def test_podmans_infra_is_a_sandbox_because_a_container_names_it(tmp_path: Path, init: int) -> None:
    _crio(tmp_path, init, kind=None)
    h = holder_of("cri-o", SID, gather_facts(), (init,), str(tmp_path))
    assert h is not None and h.pid is None and "names" in (h.why or "")
    _write(tmp_path / "var/lib/containers/storage/overlay-containers" / OTHER / "userdata/config.json",
           json.dumps({"annotations": {"io.kubernetes.cri-o.SandboxID": SID}}))
    h = holder_of("cri-o", SID, gather_facts(), (init,), str(tmp_path))
    assert h is not None and h.pid == init


@pytest.mark.parametrize("how", ["writable", "symlink", "not_init", "not_viewer", "reused", "gone"])
def test_a_pidfile_that_cannot_be_trusted_names_no_holder(tmp_path: Path, init: int, how: str) -> None:
    pid = os.getpid() if how == "not_init" else init
    pidfile = _crio(tmp_path, pid, mode=0o664 if how == "writable" else 0o644)
    if how == "symlink":
        real = _write(tmp_path / "elsewhere", f"{init}")
        pidfile.unlink()
        pidfile.symlink_to(real)
    if how == "reused":  # written before its process started: it named an earlier process of that PID
        old = time.time() - 3600
        os.utime(pidfile, (old, old))
    facts = gather_facts()
    viewers = () if how == "not_viewer" else (pid,)
    if how == "gone":
        facts.processes.pop(init)  # as if it had exited between the pass and the read
    h = holder_of("cri-o", SID, facts, viewers, str(tmp_path))
    assert h is not None and h.pid is None, h
    expected = {"writable": "not the runtime's", "symlink": "symbolic links", "not_init": "not PID 1",
                "not_viewer": "does not see", "reused": "started after", "gone": "not alive"}[how]
    assert expected in (h.why or ""), h


def test_containerd_names_the_pause_by_its_tasks_init_pid(tmp_path: Path, init: int) -> None:
    _write(tmp_path / "run/containerd/io.containerd.runtime.v2.task/k8s.io" / SID / "init.pid", f"{init}\n")
    h = holder_of("containerd", SID, gather_facts(), (init,), str(tmp_path))
    assert h is not None and h.pid == init
    assert holder_of("containerd", OTHER, gather_facts(), (init,), str(tmp_path)).pid is None  # type: ignore[union-attr]


@pytest.mark.parametrize("sandbox", [True, False])
def test_docker_only_a_pod_sandbox_has_a_holder(tmp_path: Path, init: int, sandbox: bool) -> None:
    labels = {"io.kubernetes.docker.type": "podsandbox", "io.kubernetes.pod.name": "web-0"} if sandbox else {}
    _write(tmp_path / "var/lib/docker/containers" / SID / "config.v2.json",
           json.dumps({"Config": {"Labels": labels}, "State": {"Pid": init, "Running": True}}))
    h = holder_of("docker", SID, gather_facts(), (init,), str(tmp_path))
    assert h is not None
    if sandbox:
        assert h.pid == init and h.pod == "web-0"
    else:  # a container's own /dev/shm: its main process is its engine, a creator like any other
        assert h.pid is None and "no pod sandbox" in (h.why or "")


def test_a_place_that_is_no_sandbox_asks_nothing(tmp_path: Path) -> None:
    assert holder_of(None, SID, gather_facts(), (), str(tmp_path)) is None
