"""Shared helpers of the proof suite (imported by the tests; fixtures live in conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys

from kvcached.node.base.layout import Layout

from ..conftest import KVCTL
from ..waiting import wait_until

PID = os.getpid()


def uniq(tag: str) -> str:
    """A deployment name no other test run (or parallel worker) uses."""
    return f"p{PID}{tag}"


def make_root(base: str) -> Layout:
    """A node root with tmp/ and dev/shm/ (1777 like the real ones)."""
    for sub in ("tmp", "dev/shm"):
        os.makedirs(os.path.join(base, sub), exist_ok=True)
        os.chmod(os.path.join(base, sub), 0o1777)
    return Layout(base)


class Helper:
    """A long-lived idle process in its own process group, optionally carrying an IPC name."""

    def __init__(self, ipc_name: str | None = None) -> None:
        env = dict(os.environ)
        env.pop("KVCACHED_IPC_NAME", None)
        if ipc_name:
            env["KVCACHED_IPC_NAME"] = ipc_name
        self.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(86400)"], env=env,
                                     start_new_session=True, stdin=subprocess.DEVNULL)
        self.pid = self.proc.pid
        self.ipc_name = ipc_name

        def execd() -> bool:
            try:
                with open(f"/proc/{self.pid}/cmdline", "rb") as f:
                    return b"time.sleep" in f.read()
            except OSError:
                return False

        # Wait until /proc shows the exec'd python (environ is only the new one after exec).
        wait_until(execd, 60, interval=0.01)
        with open(f"/proc/{self.pid}/stat", "rb") as f:
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/stat", "rb") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
        self.start_time = btime + ticks / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def kvctl_available() -> bool:
    """True once the kvctl entry point imports (another helper is writing it)."""
    if not os.path.exists(KVCTL):
        return False
    r = subprocess.run([KVCTL, "--help"], capture_output=True, timeout=60)
    return r.returncode == 0
