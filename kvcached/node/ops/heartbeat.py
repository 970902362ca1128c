"""The heartbeat of `kvctl gc --every`: a small file rewritten after every run, and the check of its age.

A loop that stops making runs (a run stuck on a hung filesystem, the process
stopped, a deadlock) keeps its process alive, so a liveness probe cannot
look at the process: it looks at when the last run finished. The file is
replaced by rename (temp file in the same directory, synced first:
base/files.replace_file), so a probe reads the previous beat or the new one,
never half of one. The time in it is the wall clock's, as a probe on the same
node reads it.
"""

from __future__ import annotations

import json
import os
import stat
import time
from dataclasses import dataclass

from ..base.errors import KvcachedError
from ..base.units import format_age

# The file's own marker and version (not a kvctl document: nothing prints it, kvctl gc --check-heartbeat reads it).
MARKER = "kvctl_heartbeat"
VERSION = 1
_MAX_BYTES = 4096  # a beat is one short line; anything longer was not written by us


class HeartbeatError(KvcachedError):
    """The heartbeat file cannot be written where the operator asked."""


@dataclass(frozen=True)
class Beat:
    """One heartbeat: which loop wrote it, after how many runs, when the last one finished and how it ended."""

    pid: int
    runs: int
    finished: float
    exit_code: int


@dataclass(frozen=True)
class Verdict:
    """What the check found: fresh or not, the age of the last run (None: no beat could be read), and why."""

    fresh: bool
    age: float | None
    reason: str


def write(path: str, beat: Beat) -> None:
    """Replace `path` with `beat` atomically (a regular file or absent; never written through a link)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise HeartbeatError(f"{path}: cannot write the heartbeat ({e.strerror})") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise HeartbeatError(f"{path} is not a regular file: the heartbeat is not written over it")
    body = json.dumps({MARKER: VERSION, "pid": beat.pid, "runs": beat.runs,
                       "finished": round(beat.finished, 3), "exit_code": beat.exit_code}) + "\n"
    from ..base.files import replace_file

    try:
        replace_file(path, body)  # 0644: a probe may run as another user than the loop
    except OSError as e:
        raise HeartbeatError(f"{path}: cannot write the heartbeat ({e.strerror})") from None


def check_target(path: str) -> None:
    """Raise HeartbeatError unless `path` can be a heartbeat: absent or a regular file, in a directory that is."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise HeartbeatError(f"{path}: no directory {directory} to write the heartbeat in")
    if os.path.lexists(path) and not stat.S_ISREG(os.lstat(path).st_mode):
        raise HeartbeatError(f"{path} is not a regular file: the heartbeat is not written over it")


class Recorder:
    """The loop's side: one beat after each run, counting the runs."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.runs = 0

    def record(self, exit_code: int, finished: float | None = None) -> None:
        """A run has just ended with `exit_code`: say so in the file (HeartbeatError when it cannot be written)."""
        self.runs += 1
        write(self.path, Beat(pid=os.getpid(), runs=self.runs,
                              finished=time.time() if finished is None else finished, exit_code=exit_code))


def read(path: str) -> Beat:
    """The beat in `path`; HeartbeatError when there is none or it is not one of ours."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise HeartbeatError(f"{path}: no heartbeat (the loop has not finished a run, or writes elsewhere)") from None
    except OSError as e:
        raise HeartbeatError(f"{path}: cannot read the heartbeat ({e.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise HeartbeatError(f"{path} is not a regular file")
        raw = os.read(fd, _MAX_BYTES + 1)
    finally:
        os.close(fd)
    try:
        doc = json.loads(raw) if len(raw) <= _MAX_BYTES else None
        if not isinstance(doc, dict) or doc.get(MARKER) != VERSION:
            raise ValueError
        return Beat(pid=int(doc["pid"]), runs=int(doc["runs"]), finished=float(doc["finished"]),
                    exit_code=int(doc["exit_code"]))
    except (ValueError, KeyError, TypeError):
        raise HeartbeatError(f"{path}: not a kvctl heartbeat (version {VERSION})") from None


def check(path: str, max_age: float, now: float | None = None) -> Verdict:
    """Whether the last run recorded in `path` finished at most `max_age` seconds before `now`."""
    try:
        beat = read(path)
    except HeartbeatError as e:
        return Verdict(fresh=False, age=None, reason=str(e))
    # A clock stepped back makes the age negative: that beat is as fresh as one can be, not a failure.
    age = max(0.0, (time.time() if now is None else now) - beat.finished)
    what = f"last run (#{beat.runs}, PID {beat.pid}, exit {beat.exit_code}) finished {format_age(age)} ago"
    if age > max_age:
        return Verdict(fresh=False, age=age,
                       reason=f"{path}: {what}, more than {format_age(max_age)}: the loop makes no runs")
    return Verdict(fresh=True, age=age, reason=f"{path}: {what}")
