"""`kvctl gc --every DURATION`: one gc after another until SIGTERM or SIGINT (a DaemonSet's, a service's loop).

- The first run starts at once; each next one DURATION ± 10% (uniform) after
  the previous one ended, so runs never overlap and a fleet started together
  drifts apart.
- Each run is a whole `kvctl gc` (its lock, confirmation rule, time limit and
  metrics file); it says one line: a log line on stderr, or with --json one
  compact gc document (or error document) on stdout. A run that finds the
  lock busy, or fails, says so in its line and the loop goes on.
- The first SIGTERM or SIGINT lets the current run finish (its removals, its
  metrics file, the lock's release) and then exits with that run's exit
  code; between runs it exits at once with the last run's code. A second
  signal abandons the run in progress (exit 130): the lock goes with the
  process, and the metrics file is the last complete one (it is replaced by
  rename, never written in place).
- With --heartbeat FILE, FILE is rewritten after every run, failed or not
  (kvcached.node.ops.heartbeat): `kvctl gc --check-heartbeat FILE --max-age AGE`
  fails when the loop has stopped making runs. With --metrics-port, an HTTP
  thread serves the last run's metrics (kvcached.node.ops.metrics_http).
"""

from __future__ import annotations

import random
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

JITTER = 0.10  # each pause is DURATION x (1 +/- JITTER)


def next_wait(every: float, rng: random.Random) -> float:
    """The pause before the next run: `every` ± JITTER, uniformly."""
    return every * (1.0 + rng.uniform(-JITTER, JITTER))


class Stop:
    """SIGTERM and SIGINT as the loop sees them: the first asks it to stop after the run, a second abandons it."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.requested = threading.Event()
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Stop:
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self.requested.is_set():
            raise KeyboardInterrupt  # the second one: abandon the run (exit 130, the lock released on the way out)
        self.signum = signum
        self.requested.set()

    def wait(self, seconds: float) -> bool:
        """Sleep `seconds`, or less when a stop is asked for; True when it was."""
        return self.requested.wait(seconds)


def run_every(every: float, once: Callable[[], int], stop: Stop, *, runs: int | None = None,
              rng: random.Random | None = None, after: Callable[[int], None] | None = None) -> int:
    """Call `once` (a whole gc run, returning its exit code) until `stop`; the last run's code.

    `after` is called with each run's code when it ends (the heartbeat);
    `runs` bounds the number of runs (tests); `rng` draws the jitter.
    """
    draw = rng or random.Random()
    done = 0
    while True:
        code = once()
        done += 1
        if after is not None:
            after(code)
        if stop.requested.is_set() or (runs is not None and done >= runs):
            return code
        if stop.wait(next_wait(every, draw)):
            return code


def heartbeat_after(heartbeat: str | None) -> Callable[[int], None] | None:
    """--every's heartbeat after each run: written, or the failure said and the loop goes on (the probe decides)."""
    if heartbeat is None:
        return None
    from kvcached.node import HeartbeatError, Recorder

    from .render import log_line

    recorder = Recorder(heartbeat)

    def after(code: int) -> None:
        try:
            recorder.record(code)
        except HeartbeatError as e:
            log_line(f"kvctl gc: {e}", "error")

    return after
