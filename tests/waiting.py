"""The one way tests wait for something to happen: poll, then fail with a message."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(cond: Callable[[], object], timeout: float = 10.0, interval: float = 0.02,
             explain: Callable[[], object] | None = None) -> None:
    """Poll `cond` until it is true; fail the test (AssertionError) after `timeout` seconds.

    `explain` is called only on failure, for what the state was then.
    """
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not met within {timeout:g}s" + (f": {explain()}" if explain else ""))
        time.sleep(interval)
