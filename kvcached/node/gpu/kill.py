"""End orphaned GPU holders: pidfd checked against the start time, SIGTERM, SIGKILL after the grace, then wait.

The wait is for what frees the GPU, not for the signal: SIGKILL returns
before the process's device descriptors close, so it lasts until the process
has exited (its pidfd polls readable), no descriptor of a GPU device is left
in its fd table and, where NVML answers, its memory is no longer listed; all of
it bounded by the run's time limit. A process in uninterruptible sleep (D) is
signalled once and reported; it is never waited on past the grace.
"""

from __future__ import annotations

import os
import signal
import stat
import time
from collections.abc import Callable, Sequence

from ..base.enums import KillOutcome as Outcome
from ..base.fdstat import fd_stat
from ..clean.orphans import KillResult, _wait_exit, pidfd_checked
from .devices import DeviceTable, device_table
from .holders import GpuHolder, _proc_state
from .judge import HolderState
from .nvml import GpuMemory

STUCK = "cannot be killed: the device holds it (uninterruptible sleep, D); the node needs a reset"
_POLL = 0.05


def gpu_fds_left(proc_root: str, pid: int, table: DeviceTable) -> bool:
    """Whether `pid` still has a descriptor of a GPU device open (False once its fd table is gone)."""
    try:
        dir_fd = os.open(f"{proc_root}/{pid}/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False  # exited (a zombie's fd table is gone) or reaped
    try:
        for fd in os.listdir(dir_fd):
            try:
                st = fd_stat(dir_fd, fd)  # as the /proc pass reads it: no wait on a dead NFS server
            except OSError:
                continue
            if st is not None and stat.S_ISCHR(st.mode) and table.device(st.rdev) is not None:
                return True
    except OSError:
        return False
    finally:
        os.close(dir_fd)
    return False


def _signal(fd: int, sig: int) -> str | None:
    """None on success or when the process is gone; else the error."""
    try:
        signal.pidfd_send_signal(fd, sig)
    except ProcessLookupError:
        return None
    except OSError as e:
        return e.strerror or str(e)
    return None


def _freed(h: GpuHolder, deadline: float, proc_root: str, table: DeviceTable,
           nvml: Callable[[], GpuMemory] | None) -> str:
    """Wait (to `deadline`) until `h` is reaped with no GPU descriptor left and NVML no longer lists it."""
    while gpu_fds_left(proc_root, h.pid, table) and time.monotonic() < deadline:
        time.sleep(_POLL)
    if gpu_fds_left(proc_root, h.pid, table):
        return "exited, but a GPU descriptor is still open in its fd table at the time limit"
    reaped = True
    while _proc_state(proc_root, h.pid) == "Z":
        if time.monotonic() >= deadline:
            reaped = False
            break
        time.sleep(_POLL)
    detail = "reaped" if reaped else "exited, not yet reaped by its parent"
    if nvml is not None and h.gpu_memory_bytes is not None:
        while True:
            mem = nvml()
            if not mem.known or not mem.per_gpu(h.pid):
                detail += "; GPU memory back" if mem.known else f"; {mem.note}"
                break
            if time.monotonic() >= deadline:
                detail += "; NVML still lists its memory at the time limit"
                break
            time.sleep(_POLL * 4)
    return detail


def terminate_holders(holders: Sequence[GpuHolder], *, grace: float = 5.0, time_limit: float | None = None,
                      proc_root: str = "/proc", table: DeviceTable | None = None,
                      nvml: Callable[[], GpuMemory] | None = None) -> list[KillResult]:
    """End each orphan holder (others are refused), never a process that reused its PID; one result each."""
    table = table or device_table(proc_root)
    if nvml is None and any(h.gpu_memory_bytes is not None for h in holders):
        from .nvml import query as nvml
    deadline = time.monotonic() + (time_limit if time_limit else 3600.0)
    results: dict[int, KillResult] = {}
    fds: dict[int, tuple[int, GpuHolder]] = {}
    try:
        for h in holders:
            if h.state is not HolderState.ORPHAN:
                results[h.pid] = KillResult(h.pid, Outcome.FAILED, f"not an orphan ({h.state}): never killed")
                continue
            fd, early = pidfd_checked(h.info, proc_root)
            if early is not None:
                results[h.pid] = early
                continue
            assert fd is not None
            fds[h.pid] = (fd, h)
            stuck = _proc_state(proc_root, h.pid) == "D"
            # SIGKILL at once for a D holder (TERM would wait for a handler it cannot run); SIGCONT lets a stopped
            # one act on the TERM.
            err = _signal(fd, signal.SIGKILL if stuck else signal.SIGTERM) or (
                None if stuck else _signal(fd, signal.SIGCONT))
            if err:
                results[h.pid] = KillResult(h.pid, Outcome.FAILED, f"signal: {err}")
        grace_end = min(deadline, time.monotonic() + grace)
        for pid, (fd, h) in fds.items():
            if pid in results:
                continue
            if _wait_exit(fd, grace_end - time.monotonic()):
                results[pid] = KillResult(pid, Outcome.TERMINATED, _freed(h, deadline, proc_root, table, nvml))
                continue
            if _proc_state(proc_root, pid) == "D":
                _signal(fd, signal.SIGKILL)
                results[pid] = KillResult(pid, Outcome.FAILED, STUCK)
                continue
            err = _signal(fd, signal.SIGKILL)
            if err:
                results[pid] = KillResult(pid, Outcome.FAILED, f"SIGKILL: {err}")
                continue
            # Bounded by the run's limit, and by the grace again for one the device holds in D after SIGKILL.
            if _wait_exit(fd, min(deadline, time.monotonic() + grace) - time.monotonic()):
                results[pid] = KillResult(pid, Outcome.KILLED,
                                          "did not exit on SIGTERM; " + _freed(h, deadline, proc_root, table, nvml))
            elif _proc_state(proc_root, pid) == "D":
                results[pid] = KillResult(pid, Outcome.FAILED, STUCK)
            else:
                results[pid] = KillResult(pid, Outcome.FAILED, "still running after SIGKILL at the time limit")
    finally:
        for fd, _ in fds.values():
            os.close(fd)
    return [results[h.pid] for h in holders if h.pid in results]
