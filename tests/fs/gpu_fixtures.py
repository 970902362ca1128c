"""Device nodes and stand-in serves for the GPU-holder tests, reaped at teardown."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvcached.node.clean.facts import process_start_time
from tests.waiting import wait_for

STANDIN = str(Path(__file__).with_name("gpu_standin.py"))
# NVIDIA's and DRM's majors are fixed in the kernel's device list; minor N of 195 is /dev/nvidia<N>, 255 nvidiactl.
NODES = {"nvidia0": (195, 0), "nvidia1": (195, 1), "nvidiactl": (195, 255), "renderD128": (226, 128)}


def make_nodes(directory: Path) -> dict[str, str]:
    """GPU device nodes in a private directory, made with mknod (root, CAP_MKNOD); skip where the kernel refuses.

    No driver is loaded here: opening such a node for I/O fails with ENXIO, but O_PATH resolves it without
    the driver, and a descriptor opened that way shows the node's device number through fstat like any other.
    """
    out = {}
    for name, (major, minor) in NODES.items():
        path = directory / name
        try:
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(major, minor))
        except PermissionError as e:
            pytest.skip(f"mknod of a character device needs CAP_MKNOD ({e.strerror})")
        out[name] = str(path)
    return out


def node(title: str, name: str, *, comm: str | None = None, hold: tuple[str, ...] = (), children: tuple = ()
         ) -> dict:
    """One stand-in process's spec (gpu_standin.py)."""
    return {"title": title, "name": name, "comm": comm if comm is not None else title[:15], "hold": list(hold),
            "children": list(children)}


@dataclass
class Standins:
    """Stand-in processes started by one test; every one still alive is SIGKILLed and reaped at teardown."""

    ready: Path
    procs: list[subprocess.Popen] = field(default_factory=list)
    seen: dict[str, tuple[int, float]] = field(default_factory=dict)

    def start(self, spec: dict, *, shell: bool = False) -> subprocess.Popen:
        """Start `spec`'s tree in a process group of its own; `shell`: under `bash -c` that stays alive."""
        def fill(s: dict) -> dict:
            return {**s, "ready": str(self.ready), "python": sys.executable,
                    "children": [fill(c) for c in s["children"]]}

        arg = json.dumps(fill(spec))
        if shell:
            # `exec -a` sets argv[0] as setproctitle would; the shell outlives the serve (`sh -c "vllm serve; ..."`).
            script = f'exec -a "$0" {sys.executable} {STANDIN} "$1" & wait; exec sleep 3600'
            p = subprocess.Popen(["bash", "-c", script, spec["title"], arg], start_new_session=True)
        else:
            p = subprocess.Popen([spec["title"], STANDIN, arg], executable=sys.executable, start_new_session=True)
        self.procs.append(p)
        return p

    def pids(self, *names: str, timeout: float = 20.0) -> list[int]:
        """The PIDs of the named stand-ins, once each is ready."""
        wait_for(lambda: all((self.ready / n).exists() for n in names), timeout=timeout,
                 explain=lambda: sorted(os.listdir(self.ready)))
        out = []
        for n in names:
            pid = int((self.ready / n).read_text())
            self.seen.setdefault(n, (pid, process_start_time(pid) or 0.0))
            out.append(pid)
        return out

    def close(self) -> None:
        for n in os.listdir(self.ready):
            if not n.startswith("."):
                self.pids(n)
        for pid, started in self.seen.values():
            _kill(pid, started)
        for p in self.procs:
            p.kill()
            p.wait(timeout=10)
        # A stand-in still starting (its parent was killed before it wrote its ready file) is in no list: each
        # carries this test's ready directory in its command line, so every one is found, until none is left.
        wait_for(lambda: not self._kill_unlisted(), timeout=20, explain=lambda: self._unlisted())
        # Orphans are reaped by init (or a subreaper): wait until none of ours is left, zombies included.
        wait_for(lambda: all(_gone(pid, started) for pid, started in self.seen.values()), timeout=20,
                 explain=lambda: {n: p for n, (p, s) in self.seen.items() if not _gone(p, s)})


    def _unlisted(self) -> dict[int, float]:
        mark = os.fsencode(self.ready)
        out: dict[int, float] = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if mark not in f.read():
                        continue
            except OSError:
                continue
            if (started := process_start_time(int(name))) is not None:
                out[int(name)] = started
        return out

    def _kill_unlisted(self) -> bool:
        """SIGKILL every stand-in of this test still running; whether there was one."""
        found = self._unlisted()
        for pid, started in found.items():
            self.seen.setdefault(f"unlisted-{pid}", (pid, started))
            _kill(pid, started)
        return bool(found)


def _kill(pid: int, started: float) -> None:
    if not started or process_start_time(pid) != started:
        return
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        if process_start_time(pid) == started:  # the pidfd names it now: no newcomer is hit
            signal.pidfd_send_signal(fd, signal.SIGKILL)
    finally:
        os.close(fd)


def _gone(pid: int, started: float) -> bool:
    """Reaped, or its PID already another process's; a zombie (no start time for us) is not gone yet."""
    if not os.path.exists(f"/proc/{pid}"):
        return True
    now = process_start_time(pid)
    return now is not None and abs(now - started) > 1.0


@pytest.fixture
def gpu_nodes(tmp_path: Path) -> dict[str, str]:
    d = tmp_path / "dev"
    d.mkdir()
    return make_nodes(d)


@pytest.fixture
def standins(tmp_path: Path) -> Iterator[Standins]:
    ready = tmp_path / "ready"
    ready.mkdir()
    s = Standins(ready)
    try:
        yield s
    finally:
        s.close()
