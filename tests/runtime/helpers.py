"""Helpers shared by the runtime tests."""

from __future__ import annotations

import time
from typing import Callable


def wait_for(cond: Callable[[], object], timeout: float = 5.0) -> None:
    """Poll `cond` until it is true; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)
