"""What `kvctl gc --every` waits on between its rounds: the exits and new files that touch a place (docs/PLACES.md §5).

One poll loop, no threads and no signal handling of its own:

- a pidfd for every process that sees a place other than the host's (the
  place's viewers, its holder included): readable when the process exits.
  A pidfd names one process, never a PID reused after it, and is opened
  only after the process's start time is checked again: a viewer already
  gone by then counts as an exit at once;
- an inotify watch on every such place's directory (base/inotify.py): a
  new name or a file closed after writing;
- kvctl's own mount table (`/proc/self/mountinfo`, which poll reports
  changed with POLLPRI): a new pod's emptyDir or sandbox shm is mounted
  there, and is watched from the next pass on, not from the next round;
- the loop's stop pipe (gcloop.Stop): SIGTERM and SIGINT end the wait.

An event is a hint, not evidence: it names the places to judge again, and
the judgement (ops/react.py) goes through the whole guarded path. So the
watch may miss nothing that a round would not catch later, and its
degraded modes only make reclaim slower, never wrong. Each is said once
(`Watch.degraded`, doctor's `events` check):

- no pidfd (a kernel below 5.3, or refused by seccomp): exits are seen by
  rounds only;
- a pidfd refused for the open-files limit: those processes' places by
  rounds only;
- no inotify instance, or its watches exhausted (max_user_watches): those
  places' new files by rounds only.

A place is keyed by its directory's identity `(st_dev, st_ino)`, as the act
re-identifies it.
"""

from __future__ import annotations

import errno
import os
import select
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, NamedTuple

from ..clean.facts import process_start_time

if TYPE_CHECKING:
    from ..base.inotify import Inotify
    from ..base.place import Place

Key = tuple[int, int]  # a place's directory: (st_dev, st_ino)


def key_of(place: Place) -> Key | None:
    """The identity an event names a place by; None for the host (whose rules stay a round's)."""
    if place.is_host or place.dev is None or place.ino is None:
        return None
    return place.dev, place.ino


class Changed(NamedTuple):
    """What one wait saw: the places touched, how many watched processes exited, whether a stop was asked."""

    places: frozenset[Key] = frozenset()
    exited: int = 0
    files: int = 0             # places whose directory got a new entry
    stop: bool = False
    overflow: bool = False     # inotify's queue overflowed: every watched place is touched
    orphaned: frozenset[Key] = frozenset()  # places whose last watched viewer (besides the holder) exited
    mounts: bool = False       # kvctl's mount table changed: places may have come (a pass arms them)


class Degraded(NamedTuple):
    """One degraded mode of the event path: what falls back to rounds, and why (said once)."""

    what: str   # "pidfd", "pidfd-limit", "inotify", "inotify-limit"
    why: str


class Watch:
    """The event path's poll loop over pidfds, one inotify instance and the stop pipe."""

    def __init__(self, stop_fd: int | None = None, *, proc_root: str = "/proc", pidfds: bool = True,
                 inotify: bool = True) -> None:
        self.proc_root = proc_root
        self.stop_fd = stop_fd
        self._pids: dict[int, tuple[int, float]] = {}      # pid -> (its pidfd, its start time)
        self._fd_pid: dict[int, int] = {}                  # pidfd -> pid
        self._sees: dict[int, set[Key]] = {}                # pid -> the places it sees
        self._viewers: dict[Key, set[int]] = {}             # place -> its watched viewers, the holder left out
        self._wds: dict[Key, int] = {}
        self._wd_key: dict[int, Key] = {}
        self._pending: set[Key] = set()                    # touched while arming (a viewer gone already)
        self._pending_exits = 0
        self.degraded: dict[str, Degraded] = {}
        self._new_degraded: list[Degraded] = []
        self._pidfd_ok = pidfds and hasattr(os, "pidfd_open")
        if pidfds and not self._pidfd_ok:
            self._degrade("pidfd", "os.pidfd_open is not available in this Python: exits are seen by rounds only")
        self._mounts: int | None = None
        try:
            self._mounts = os.open(f"{proc_root}/self/mountinfo", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            self._degrade("mounts", f"{proc_root}/self/mountinfo: {e.strerror}: new places are found by rounds only")
        self._inotify: Inotify | None = None
        if inotify:
            from ..base.inotify import Inotify

            try:
                self._inotify = Inotify()
            except OSError as e:
                self._degrade("inotify", f"no inotify instance ({e.strerror}; fs.inotify.max_user_instances?): "
                              "new files are seen by rounds only")

    def _degrade(self, what: str, why: str) -> None:
        if what not in self.degraded:
            d = Degraded(what, why)
            self.degraded[what] = d
            self._new_degraded.append(d)

    def news(self) -> list[Degraded]:
        """The degraded modes met since the last call: each is said once."""
        out, self._new_degraded = self._new_degraded, []
        return out

    @property
    def watched_pids(self) -> int:
        return len(self._pids)

    @property
    def watched_places(self) -> int:
        return len(self._wds)

    def arm(self, places: Iterable[Place], start_times: Mapping[int, float]) -> None:
        """Watch these places (every one but the host's) and their viewers, dropping what no longer needs it.

        `start_times`: each viewer's start time from the /proc pass that
        found it. A viewer whose start time differs when its pidfd is open
        (gone, its PID reused) is an exit now: its places are touched.
        """
        wanted: dict[Key, Place] = {}
        for pl in places:
            k = key_of(pl)
            if k is not None:
                wanted[k] = pl
        sees: dict[int, set[Key]] = {}
        viewers: dict[Key, set[int]] = {}
        for k, pl in wanted.items():
            viewers[k] = {p for p in pl.pids if p != pl.holder}
            for pid in pl.pids:
                sees.setdefault(pid, set()).add(k)
            if pl.holder is not None:
                sees.setdefault(pl.holder, set()).add(k)
        for pid in [p for p in self._pids if p not in sees or self._pids[p][1] != start_times.get(p)]:
            self._close_pid(pid)
        self._sees, self._viewers = sees, viewers
        if self._pidfd_ok:
            for pid in list(sees):  # a viewer already gone leaves `sees` (_gone)
                if pid not in self._pids and not self._open_pid(pid, start_times.get(pid)):
                    break
        self._arm_inotify(wanted)

    def _open_pid(self, pid: int, started: float | None) -> bool:
        """A pidfd for `pid` if it is still the process the pass saw; False: stop trying (pidfds unavailable)."""
        try:
            fd = os.pidfd_open(pid)
        except OSError as e:
            if e.errno == errno.ESRCH:
                self._exit_of(pid)
                return True
            if e.errno in (errno.EMFILE, errno.ENFILE):
                self._degrade("pidfd-limit", f"pidfd_open: {e.strerror} (the open-files limit): the places of "
                              f"processes beyond {len(self._pids)} are judged by rounds only")
                return False
            # ENOSYS (a kernel below 5.3), EPERM (a seccomp filter): no pidfd for anyone.
            self._pidfd_ok = False
            self._degrade("pidfd", f"pidfd_open: {e.strerror}: exits are seen by rounds only")
            return False
        # The pidfd names whatever has the PID now: it must still be the process the pass saw.
        now = process_start_time(pid, self.proc_root)
        if started is None or now is None or now != started:
            os.close(fd)
            self._exit_of(pid)
            return True
        self._pids[pid] = (fd, started)
        self._fd_pid[fd] = pid
        return True

    def _exit_of(self, pid: int) -> None:
        """A viewer gone before its pidfd opened: its places are touched, for the next wait to return at once."""
        self._pending |= self._gone(pid)
        self._pending_exits += 1

    def _gone(self, pid: int) -> set[Key]:
        """A watched process exited: the places it saw, each with one viewer less."""
        places = self._sees.pop(pid, set())
        for k in places:
            self._viewers.get(k, set()).discard(pid)
        return places

    def _close_pid(self, pid: int) -> None:
        fd, _ = self._pids.pop(pid)
        self._fd_pid.pop(fd, None)
        os.close(fd)

    def _arm_inotify(self, wanted: Mapping[Key, Place]) -> None:
        ino = self._inotify
        if ino is None:
            return
        for k in [k for k in self._wds if k not in wanted]:
            wd = self._wds.pop(k)
            self._wd_key.pop(wd, None)
            try:
                ino.remove(wd)
            except OSError:
                pass  # the kernel dropped it with its directory
        for k, pl in wanted.items():
            if k in self._wds:
                continue
            try:
                wd = ino.add(pl.path)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.ENOMEM):
                    self._degrade("inotify-limit", f"inotify_add_watch: {e.strerror} (fs.inotify.max_user_watches "
                                  "exhausted): new files in the places beyond "
                                  f"{len(self._wds)} are seen by rounds only")
                    return
                continue  # the place is gone or no directory now: the next pass says so
            # A watch names an inode: two paths may reach one directory, and the kernel gives the same wd.
            self._wds[k] = wd
            self._wd_key[wd] = k

    def wait(self, timeout: float | None) -> Changed:
        """Block until an exit, a new file or a stop, or `timeout` seconds (None: no bound); what was seen."""
        if self._pending:
            return self._take(set(), 0, 0, False, False)
        poller = select.poll()
        if self.stop_fd is not None:
            poller.register(self.stop_fd, select.POLLIN)
        if self._inotify is not None:
            poller.register(self._inotify.fileno(), select.POLLIN)
        if self._mounts is not None:
            poller.register(self._mounts, select.POLLPRI)
        for fd in self._fd_pid:
            poller.register(fd, select.POLLIN)
        # Milliseconds rounded up: a wait rounded down to 0 would spin until a due time.
        ready = poller.poll(None if timeout is None else max(0, int(timeout * 1000 + 0.999)))
        fds = {fd for fd, _ in ready}
        mounts = self._mounts is not None and self._mounts in fds
        stop = self.stop_fd is not None and self.stop_fd in fds
        touched: set[Key] = set()
        exited = files = 0
        overflow = False
        for fd in fds:
            pid = self._fd_pid.get(fd)
            if pid is None:
                continue
            self._close_pid(pid)
            touched |= self._gone(pid)
            exited += 1
        if self._inotify is not None and self._inotify.fileno() in fds:
            wds, overflow = self._inotify.drain()
            by_file = {self._wd_key[w] for w in wds if w in self._wd_key}
            files = len(by_file)
            touched |= by_file
            if overflow:
                touched |= set(self._wds)
        return self._take(touched, exited, files, stop, overflow, mounts)

    def _take(self, touched: set[Key], exited: int, files: int, stop: bool, overflow: bool,
              mounts: bool = False) -> Changed:
        touched |= self._pending
        exited += self._pending_exits
        self._pending, self._pending_exits = set(), 0
        orphaned = frozenset(k for k in touched if not self._viewers.get(k))
        return Changed(frozenset(touched), exited, files, stop, overflow, orphaned, mounts)

    def close(self) -> None:
        for pid in list(self._pids):
            self._close_pid(pid)
        if self._inotify is not None:
            self._inotify.close()
            self._inotify = None
        if self._mounts is not None:
            os.close(self._mounts)
            self._mounts = None

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
