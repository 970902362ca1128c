"""The one way tests wait for something to happen: poll a condition, then fail with a message."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


def wait_until(cond: Callable[[], object], timeout: float = 10.0, interval: float = 0.02) -> bool:
    """Poll `cond` until it is true or `timeout` seconds passed; whether it became true.

    For a wait whose caller asserts on what it finds after it (the state may
    tell more than "not met"); `cond` may do work between its checks (read a
    terminal) and may raise to stop the wait early.
    """
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        if interval:
            time.sleep(interval)
    return True


def wait_for(cond: Callable[[], object], timeout: float = 10.0, interval: float = 0.02,
             explain: Callable[[], object] | None = None) -> None:
    """Poll `cond` until it is true; fail the test (AssertionError) after `timeout` seconds.

    `explain` is called only on failure, for what the state was then.
    """
    if not wait_until(cond, timeout, interval):
        raise AssertionError(f"not met within {timeout:g}s" + (f": {explain()}" if explain else ""))


def wait_notified(cv: threading.Condition, cond: Callable[[], object], timeout: float = 10.0,
                  explain: Callable[[], object] | None = None) -> None:
    """wait_for for a condition another thread announces through `cv` (held by the caller): woken at once.

    Checked at least once a second even without a notify, so a `cond` that
    raises when the thread's source died (its process exited) stops the wait.
    """
    deadline = time.monotonic() + timeout
    while not cond():
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"not met within {timeout:g}s" + (f": {explain()}" if explain else ""))
        cv.wait(min(left, 1.0))


def proc_state(pid: int, proc_root: str = "/proc") -> str | None:
    """The state letter of `/proc/<pid>/stat` (R, S, D, T stopped, t traced, Z zombie, ...); None once it is gone."""
    try:
        with open(f"{proc_root}/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold anything, ")" and spaces included.
    fields = raw.rsplit(b")", 1)[-1].split()
    return fields[0].decode() if fields else None


def wait_for_state(pid: int, states: str, timeout: float = 10.0) -> str:
    """Wait until process `pid` is in one of `states` (letters of /proc/<pid>/stat, e.g. "T"); return it.

    Fails (AssertionError) after `timeout` seconds, or at once when the process is gone.
    """
    seen: list[str | None] = [None]

    def reached() -> bool:
        seen[0] = proc_state(pid)
        if seen[0] is None:
            raise AssertionError(f"process {pid} is gone; it never reached state {states!r}")
        return seen[0] in states

    wait_for(reached, timeout, interval=0.002,
             explain=lambda: f"process {pid} is in state {seen[0]!r}, not one of {states!r}")
    return seen[0]  # type: ignore[return-value]
