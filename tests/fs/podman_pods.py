"""Real podman pods for tests/fs/test_podman.py: an infra that keeps the pod's /dev/shm, apps that die in it.

Podman lays a pod's /dev/shm out as CRI-O does: a tmpfs at
`<storage root>/overlay-containers/<infra id>/userdata/shm`, the infra's PID in
`<run root>/overlay-containers/<infra id>/userdata/pidfile`. Everything lives
under one scratch directory `base`, which stands for the node's `/`: the
storage root is `base/var/lib/containers/storage` and the run root
`base/run/containers/storage`, so kvctl finds them with
`KVCTL_SANDBOX_ROOT=base` at the paths a real node has under `/`.

What this machine kind needs, and why (found by running podman 4.3 here):
- crun refuses `setrlimit` for RLIMIT_NPROC and RLIMIT_NOFILE, and cgroups in
  hybrid mode: podman runs crun through tests/fs/crun_wrap.py (the bundle's
  `process.rlimits` dropped, `--cgroup-manager=disabled`) with
  `--cgroup-manager cgroupfs`, inside a mount namespace of its own where
  `/sys/fs/cgroup/unified` is unmounted;
- `--rootfs` on a private recursive bind of `/` (so that a container runs this
  venv's Python); `/` itself fails at pivot_root;
- `podman pod create` builds its infra image from catatonit;
- `--network none`: no bridge, nothing of the machine's network changes.

That mount namespace is the node's here: a keeper process (`sleep`) holds it,
every podman command and every kvctl run enters it (`nsenter -m`), and its
mounts (the pods' shm, the rootfs bind) go with it. The machine's own mount
table never changes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

WRAP = Path(__file__).with_name("crun_wrap.py")
KVCTL = str(Path(sys.executable).with_name("kvctl"))
NEEDED = ("podman", "crun", "catatonit", "conmon", "unshare", "nsenter")


def missing() -> list[str]:
    """The tools these pods need that this machine lacks (CI installs them: .ci/run)."""
    have = [t for t in NEEDED if shutil.which(t) or os.path.exists(f"/usr/libexec/podman/{t}")]
    return [t for t in NEEDED if t not in have]


@dataclass
class Pod:
    name: str
    infra_id: str
    infra_pid: int
    shm: str  # the pod's /dev/shm as the node sees it


# An app: makes its files in the pod's /dev/shm as SGLang and Python name them, then says so and waits.
# `closed`: made and closed (only a live creator keeps it); `mapped`: mapped, then the descriptor closed;
# `held`: open, never mapped.
APP = textwrap.dedent("""
    import json, mmap, os, sys, time, uuid
    ready, old = sys.argv[1], float(sys.argv[2])
    pid = os.getpid()
    out = {"pid": pid}
    keep = []
    for role in ("closed", "mapped", "held"):
        name = f"sgl_shm_{role[:2]}_{pid}_{uuid.uuid4().hex[:8]}"
        path = "/dev/shm/" + name
        with open(path, "wb") as f:
            f.write(b"x" * 65536)
        if old:
            os.utime(path, (time.time() - old, time.time() - old))
        if role == "mapped":
            f = open(path, "r+b")
            keep.append(mmap.mmap(f.fileno(), 65536))
            f.close()
        elif role == "held":
            keep.append(os.open(path, os.O_RDWR))
        out[role] = name
    tmp = ready + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f)
    os.rename(tmp, ready)
    while True:
        time.sleep(3600)
""")


class PodmanNode:
    """A scratch node with podman's storage and run roots under `base`, in a mount namespace of its own."""

    def __init__(self) -> None:
        # Short: podman's attach and control sockets live below it, and a socket path has 108 bytes at most.
        self.base = tempfile.mkdtemp(prefix="kvpod", dir="/tmp")
        self.rootfs = f"{self.base}/rootfs"
        self.ready = f"{self.base}/ready"
        os.makedirs(self.rootfs)
        os.makedirs(self.ready)
        self.wrap = f"{self.base}/crun-wrap"
        with open(self.wrap, "w") as f:
            f.write(f"#!/bin/sh\nexec {sys.executable} {WRAP} {self.base}/crun \"$@\"\n")
        os.chmod(self.wrap, 0o755)
        # Where podman writes outside its roots, a tmpfs of the namespace's own, gone with it: its locks
        # (/dev/shm/libpod_lock), the image build's scratch (/var/tmp) and its blob cache (/var/lib/containers).
        # /var/lib/containers needs a mount point: made here when the machine has none, removed again in close().
        self.made_var = not os.path.exists("/var/lib/containers")
        scratch = " && ".join(f"mount -t tmpfs -o mode=1777 kvpod {d}" for d in ("/dev/shm", "/var/tmp"))
        keeper = (f"umount /sys/fs/cgroup/unified 2>/dev/null; {scratch} && mkdir -p /var/lib/containers && "
                  f"mount -t tmpfs -o mode=0700 kvpod /var/lib/containers && "
                  f"mount --rbind / {self.rootfs} && "
                  f"mount --make-rprivate {self.rootfs} && echo ready && exec sleep 86400")
        self.keeper = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", keeper],
                                       stdout=subprocess.PIPE, text=True)
        assert self.keeper.stdout is not None
        line = self.keeper.stdout.readline().strip()
        if line != "ready":
            self.keeper.kill()
            self.keeper.wait()
            raise RuntimeError("the pods' mount namespace did not come up")
        self.flags = ["--root", f"{self.base}/var/lib/containers/storage",
                      "--runroot", f"{self.base}/run/containers/storage", "--tmpdir", f"{self.base}/run/libpod",
                      "--volumepath", f"{self.base}/volumes", "--network-config-dir", f"{self.base}/cni",
                      "--cgroup-manager", "cgroupfs",
                      "--events-backend", "file", "--runtime", self.wrap]

    def enter(self, argv: list[str], *, env: dict[str, str] | None = None, timeout: float = 120,
              check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run `argv` in the node's mount namespace."""
        r = subprocess.run(["nsenter", "-t", str(self.keeper.pid), "-m", *argv], capture_output=True, text=True,
                           timeout=timeout, env=env)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[:3])}: exit {r.returncode}: {r.stderr.strip()[-2000:]}")
        return r

    def podman(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.enter(["podman", *self.flags, *args], timeout=timeout, check=check)

    def kvctl(self, *args: str, json_out: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """The installed kvctl on this node: its sandbox roots under `base`, its host place an empty root."""
        host = f"{self.base}/host"
        os.makedirs(f"{host}/dev/shm", exist_ok=True)
        os.makedirs(f"{host}/tmp", exist_ok=True)
        env = {**os.environ, "KVCTL_SANDBOX_ROOT": self.base, "NO_COLOR": "1"}
        argv = [KVCTL, "--root", host, *args, "--kubelet-dir", f"{self.base}/kubelet"]
        return self.enter(argv + (["--json"] if json_out else []), env=env, timeout=timeout, check=False)

    def agent(self, *args: str) -> subprocess.Popen[str]:
        """`kvctl gc --every` on this node as the DaemonSet runs it (-A --engines --yes --json), until killed."""
        host = f"{self.base}/host"
        os.makedirs(f"{host}/dev/shm", exist_ok=True)
        os.makedirs(f"{host}/tmp", exist_ok=True)
        env = {**os.environ, "KVCTL_SANDBOX_ROOT": self.base, "NO_COLOR": "1"}
        # nsenter enters the mount namespace and execs kvctl (no fork): a signal to it is a signal to kvctl.
        return subprocess.Popen(["nsenter", "-t", str(self.keeper.pid), "-m", KVCTL, "--root", host, "gc", "-A",
                                 "--engines", "--yes", "--every", "10m", "--json", "--kubelet-dir",
                                 f"{self.base}/kubelet", *args], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def pod(self, name: str) -> Pod:
        self.podman("pod", "create", "--network", "none", "--name", name)
        self.podman("pod", "start", name)
        infra = self.podman("pod", "inspect", name, "--format", "{{.InfraContainerID}}").stdout.strip()
        pid = int(self.podman("inspect", infra, "--format", "{{.State.Pid}}").stdout.strip())
        shm = f"{self.base}/var/lib/containers/storage/overlay-containers/{infra}/userdata/shm"
        return Pod(name, infra, pid, shm)

    def app(self, pod: Pod, name: str, *, old: float = 3600.0, timeout: float = 60) -> dict[str, object]:
        """Start an app container in `pod`; wait until it has made its files; what it made, and its host PID."""
        ready = f"{self.ready}/{name}.json"
        self.podman("run", "-d", "--pod", pod.name, "--name", name, "--rootfs", self.rootfs,
                    sys.executable, "-c", APP, ready, str(old))
        deadline = time.monotonic() + timeout
        while not os.path.exists(ready):
            if time.monotonic() > deadline:
                logs = self.podman("logs", name, check=False)
                raise RuntimeError(f"app {name} made no files in {timeout}s: {logs.stdout}{logs.stderr}")
            time.sleep(0.05)
        with open(ready) as f:
            made: dict[str, object] = json.load(f)
        made["host_pid"] = int(self.podman("inspect", name, "--format", "{{.State.Pid}}").stdout.strip())
        return made

    def kill(self, name: str) -> None:
        """SIGKILL an app's main process, as the OOM killer or a failed probe would, and wait for its exit."""
        self.podman("kill", "-s", "KILL", name)
        self.podman("wait", name, timeout=60)

    def close(self) -> None:
        """Every pod and container gone, the namespace with them, the scratch directory removed."""
        try:
            self.podman("pod", "rm", "-f", "-t", "0", "-a", check=False, timeout=120)
            self.podman("rm", "-f", "-t", "0", "-a", check=False, timeout=120)
        finally:
            self.keeper.send_signal(signal.SIGKILL)
            self.keeper.wait()
            _reap_conmons(self.base)
            shutil.rmtree(self.base, ignore_errors=True)
            if self.made_var:
                try:
                    os.rmdir("/var/lib/containers")
                except OSError:
                    pass


def _reap_conmons(base: str) -> None:
    """Kill any conmon (and its container) that still names this node's roots: a failed rm must not leave one."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if cmd.startswith(b"/usr/bin/conmon") and base.encode() in cmd:
            try:
                os.killpg(int(d), signal.SIGKILL)
            except OSError:
                pass
            try:
                os.kill(int(d), signal.SIGKILL)
            except OSError:
                pass
