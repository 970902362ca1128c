"""Terminate orphaned processes of a deployment whose engine is confirmed gone, through pidfds.

A PID can be reused between the /proc pass and the kill. A pidfd pins the
process it was opened for: once we have one and have checked that the process
behind it started when the facts say, every signal goes to that process or
fails with ESRCH, never to a newcomer with the same number.
"""

from __future__ import annotations

import errno
import os
import select
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ..base.enums import KillOutcome as Outcome
from .facts import START_SLACK, ProcessInfo, process_start_time


@dataclass(frozen=True)
class KillResult:
    pid: int
    outcome: Outcome
    detail: str = ""

    def to_dict(self) -> dict[str, object]:
        return {"pid": self.pid, "outcome": str(self.outcome), "detail": self.detail}


def _wait_exit(pidfd: int, timeout: float) -> bool:
    # A pidfd polls readable once the process has exited (a zombie counts).
    p = select.poll()
    p.register(pidfd, select.POLLIN)
    return bool(p.poll(max(0, int(timeout * 1000))))


def _pidfd(proc: ProcessInfo, proc_root: str) -> tuple[int | None, KillResult | None]:
    try:
        fd = os.pidfd_open(proc.pid)
    except ProcessLookupError:
        return None, KillResult(proc.pid, Outcome.GONE)
    except OSError as e:
        return None, KillResult(proc.pid, Outcome.FAILED, f"pidfd_open: {e.strerror}")
    # Checked after opening: from here on the pidfd names exactly the process we compared.
    started = process_start_time(proc.pid, proc_root)
    if started is None:
        os.close(fd)
        return None, KillResult(proc.pid, Outcome.GONE)
    if abs(started - proc.start_time) > START_SLACK:
        os.close(fd)
        return None, KillResult(proc.pid, Outcome.REPLACED, "PID reused since the scan")
    return fd, None


def pidfd_checked(proc: ProcessInfo, proc_root: str = "/proc") -> tuple[int | None, KillResult | None]:
    """A pidfd for `proc` checked against its start time, or the result that says why there is none."""
    return _pidfd(proc, proc_root)


def terminate(procs: Sequence[ProcessInfo], *, grace: float = 5.0, proc_root: str = "/proc") -> list[KillResult]:
    """SIGTERM each process, wait up to `grace` seconds for all, SIGKILL the rest; never a reused PID."""
    results: dict[int, KillResult] = {}
    fds: dict[int, int] = {}
    try:
        for proc in procs:
            fd, early = _pidfd(proc, proc_root)
            if early is not None:
                results[proc.pid] = early
                continue
            assert fd is not None
            try:
                signal.pidfd_send_signal(fd, signal.SIGTERM)
                fds[proc.pid] = fd
            except ProcessLookupError:
                os.close(fd)
                results[proc.pid] = KillResult(proc.pid, Outcome.GONE)
            except OSError as e:
                os.close(fd)
                results[proc.pid] = KillResult(proc.pid, Outcome.FAILED, f"SIGTERM: {e.strerror}")
        deadline = time.monotonic() + grace
        for pid, fd in fds.items():
            if _wait_exit(fd, deadline - time.monotonic()):
                results[pid] = KillResult(pid, Outcome.TERMINATED)
                continue
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            except OSError as e:
                if e.errno != errno.ESRCH:
                    results[pid] = KillResult(pid, Outcome.FAILED, f"SIGKILL: {e.strerror}")
                    continue
            exited = _wait_exit(fd, 5.0)
            results[pid] = KillResult(pid, Outcome.KILLED if exited else Outcome.FAILED,
                                      "did not exit on SIGTERM" if exited else "still running after SIGKILL")
    finally:
        for fd in fds.values():
            os.close(fd)
    return [results[p.pid] for p in procs if p.pid in results]
