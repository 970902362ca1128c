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
- With -A (and without --no-events), the pauses are not idle: the event path
  (kvcached.node.ops.react) judges again, between rounds, only the places
  whose viewers exited or that got new files, one line each (`event_line`).
  A SIGTERM during such a judgement finishes the place in hand, then exits
  with the last round's code.
"""

from __future__ import annotations

import os
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
        # The event path's poll wakes on this pipe's read end: the handler writes a byte to it.
        self._r, self._w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def fileno(self) -> int:
        """A descriptor that turns readable when a stop is asked (for poll)."""
        return self._r

    def __enter__(self) -> Stop:
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        os.close(self._r)
        os.close(self._w)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self.requested.is_set():
            raise KeyboardInterrupt  # the second one: abandon the run (exit 130, the lock released on the way out)
        self.signum = signum
        self.requested.set()
        try:
            os.write(self._w, b"x")
        except OSError:
            pass  # the pipe is full: it is readable already

    def wait(self, seconds: float) -> bool:
        """Sleep `seconds`, or less when a stop is asked for; True when it was."""
        return self.requested.wait(seconds)


def run_every(every: float, once: Callable[[], int], stop: Stop, *, runs: int | None = None,
              rng: random.Random | None = None, after: Callable[[int], None] | None = None,
              between: Callable[[float], bool] | None = None) -> int:
    """Call `once` (a whole gc run, returning its exit code) until `stop`; the last run's code.

    `after` is called with each run's code when it ends (the heartbeat);
    `between(seconds)` spends each pause (the event path), True when a stop
    was asked, instead of sleeping; `runs` bounds the number of runs (tests);
    `rng` draws the jitter.
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
        pause = next_wait(every, draw)
        if between(pause) if between is not None else stop.wait(pause):
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


def event_line(reaction: Any) -> tuple[str, str]:
    """One event judgement as the log says it, and its level."""
    from kvcached.node import Action, format_size

    if reaction.busy:
        return (f"kvctl gc: event: {reaction.exited} exited, {reaction.files} place(s) with new files; the lock is "
                "busy (another gc): judged again later"), "warning"
    if reaction.error is not None:
        return f"kvctl gc: event: {reaction.error}; judged again later", "error"
    removed = kept = size = failed = 0
    for r in reaction.places:
        if r.report is None:
            continue
        gone = [e for e in r.report.entries if e.action in (Action.REMOVED, Action.WOULD_REMOVE)]
        removed += len(gone)
        size += sum(e.bytes for e in gone)
        failed += len(r.report.failures)
        kept += len(r.report.entries) - len(gone)
    verb = "would remove" if any(r.report is not None and r.report.dry_run for r in reaction.places) else "removed"
    labels = ", ".join(r.place.label for r in reaction.places[:3]) + (" ..." if len(reaction.places) > 3 else "")
    line = (f"kvctl gc: event: {reaction.exited} exited, {reaction.files} place(s) with new files; judged "
            f"{len(reaction.places)} place(s) in {reaction.took:.2f}s: {verb} {removed} entr"
            f"{'y' if removed == 1 else 'ies'} ({format_size(size)}), kept {kept}"
            + (f", {failed} failed" if failed else "") + (f" [{labels}]" if labels else ""))
    return line, "error" if failed else "info"


class _Between:
    """The event path as run_every's `between`: a Reactor, its lines said as the loop says its runs'."""

    def __init__(self, reactor: Any, root: str, json_out: bool) -> None:
        self.reactor = reactor
        self.root = root
        self.json_out = json_out

    def after_round(self, result: Any) -> None:
        self.reactor.after_round(result)
        self._degraded()

    def _degraded(self) -> None:
        from .render import log_line

        for d in self.reactor.news():  # each degraded mode once, in the log (doctor's `events` check says why)
            log_line(f"kvctl gc: event path degraded ({d.what}): {d.why}", "warning")

    def _said(self, reaction: Any) -> None:
        if self.json_out:
            from .documents import event_document
            from .render import emit_json

            emit_json(event_document(self.root, reaction), one_line=True)
        else:
            from .render import log_line

            log_line(*event_line(reaction))
        self._degraded()

    def between(self, seconds: float) -> bool:
        return bool(self.reactor.run_for(seconds, self._said))


def react_between(opts: Any, stop: Stop, root: str, json_out: bool, stack: Any) -> _Between:
    """gc --every -A's event path (kvcached.node.ops.react), closed with the loop's `stack`."""
    from kvcached.node import Reactor

    reactor = Reactor(opts, stop.fileno(), stopping=stop.requested.is_set)
    stack.callback(reactor.close)
    return _Between(reactor, root, json_out)
