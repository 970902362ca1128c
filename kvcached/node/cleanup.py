"""The cleanup engine: scan → facts → decide → guarded act, and its report (report.py).

Dry run is this same path with one guard at the removing syscall, so the plan a
dry run prints is what a real run in a quiet state removes.
"""

from __future__ import annotations

import fcntl
import fnmatch
import gc
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from .decide import Decision, Policy, State, decide_tree, settle
from .enums import Action
from .facts import Facts, gather_facts
from .ident import Unlinked, fd_handle, handle_reader, same_file, unlink_if_same
from .layout import Layout
from .lease import ofd_lock
from .report import Entry, Report
from .scan import Candidate, Kind, scan


@dataclass
class Plan:
    """Everything a run found and decided, before acting."""

    layout: Layout
    facts: Facts
    policy: Policy
    now: float
    roots: list[Candidate]
    decisions: dict[str, Decision]
    errors: list[str] = field(default_factory=list)
    # deployment -> its segment, also when a --kind filter leaves it out of `roots`:
    # a directory must not outlive the segment whose name it is the only record of
    segments: dict[str, Candidate] = field(default_factory=dict)
    matched: int = 0  # top-level entries that matched the names, before any kind filter

    def entries(self) -> list[tuple[Candidate, Decision]]:
        return [(c, self.decisions[c.path]) for root in self.roots for c in root.walk()]


def _matches(c: Candidate, globs: Sequence[str]) -> bool:
    return not globs or (c.deployment is not None and any(fnmatch.fnmatchcase(c.deployment, g) for g in globs))


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for one pass over the node, if it was running.

    A pass makes a few objects per entry and no reference cycles; with the
    collector running, each collection walks everything made so far, a
    measurable share of a gc over a full node (bench/README.md). Reference counting
    still frees everything as usual.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def plan(layout: Layout, policy: Policy | None = None, *, facts: Facts | None = None,
         names: Iterable[str] = (), globs: Sequence[str] = (), kinds: Iterable[Kind] = (),
         now: float | None = None, proc_root: str = "/proc") -> Plan:
    """Scan, gather facts, observe and decide: no side effects (every test it makes is passive)."""
    with collector_paused():
        return _plan(layout, policy, facts, names, globs, kinds, now, proc_root)


def _plan(layout: Layout, policy: Policy | None, facts: Facts | None, names: Iterable[str], globs: Sequence[str],
          kinds: Iterable[Kind], now: float | None, proc_root: str) -> Plan:
    policy = policy or Policy()
    facts = facts if facts is not None else gather_facts(proc_root)
    extra = set(names) | {p.ipc_name for p in facts.processes.values() if p.ipc_name}
    found = scan(layout, extra, facts)
    roots = [c for c in found.candidates if _matches(c, globs)]
    t = time.time() if now is None else now
    decisions: dict[str, Decision] = {}
    for c in roots:
        decide_tree(c, facts, policy, t, decisions)
    # Whole deployments are decided before any kind filter: a segment's life may
    # be proven only by a socket that `--kind segment` does not act on.
    settle(roots, decisions)
    segments = {c.deployment: c for c in roots if c.kind is Kind.SEGMENT and c.deployment is not None}
    matched = len(roots)
    kinds = set(kinds)
    if kinds:
        roots = [c for c in roots if c.kind in kinds or (Kind.SOCKET in kinds and c.kind is Kind.DIRECTORY)]
    return Plan(layout, facts, policy, t, roots, decisions, found.errors + facts.errors, segments, matched)


_new_entry = tuple.__new__


class _Actor:
    """The guarded act; `dry_run` is the one guard, at the removing syscall."""

    def __init__(self, dry_run: bool, deadline: float | None,
                 progress: Callable[[Entry], None] | None = None) -> None:
        self.dry_run = dry_run
        self.deadline = deadline
        self.entries: list[Entry] = []
        self.timed_out = False
        self.progress = progress
        self.handle_of = handle_reader()
        # /tmp and /dev/shm, each opened once per run (an fd, or why it could not be opened):
        # every entry is still identified through the fd before it is removed.
        self._tops: dict[str, int | OSError] = {}

    def top(self, path: str) -> int:
        """The run's fd of a top directory (the layout's /tmp or /dev/shm); raises OSError as its open did."""
        got = self._tops.get(path)
        if got is None:
            try:
                got = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError as e:
                got = e
            self._tops[path] = got
        if isinstance(got, OSError):
            raise OSError(got.errno, got.strerror, path)
        return got

    def close(self) -> None:
        for got in self._tops.values():
            if not isinstance(got, OSError):
                os.close(got)
        self._tops.clear()

    def out_of_time(self) -> bool:
        if self.deadline is not None and time.monotonic() > self.deadline:
            self.timed_out = True
        return self.timed_out

    def record(self, c: Candidate, d: Decision, action: Action, note: str = "") -> None:
        e = _new_entry(Entry, (c, d, action, note))  # Entry(...) through its Python-level __new__: once per entry
        self.entries.append(e)
        if self.progress is not None:
            self.progress(e)

    def keep_all(self, c: Candidate, decisions: dict[str, Decision], note: str = "") -> None:
        for sub in c.walk():
            d = decisions[sub.path]
            self.record(sub, d, Action.KEPT, note if d.state is State.STALE else "")

    def remove(self, dir_fd: int, c: Candidate, d: Decision, rmdir: bool = False) -> bool:
        """Unlink `c` through `dir_fd` if it still has the planned identity; True when gone."""
        if self.timed_out or (self.deadline is not None and self.out_of_time()):
            self.record(c, d, Action.KEPT, "time limit reached")
            return False
        try:
            done = unlink_if_same(dir_fd, c.name, c.ident, c.handle, rmdir=rmdir, dry_run=self.dry_run,
                                  handle_of=self.handle_of)
        except OSError as e:
            self.record(c, d, Action.FAILED, f"{'rmdir' if rmdir else 'unlink'}: {e.strerror}")
            return False
        if done is Unlinked.REPLACED:
            # A successor re-created this name between scan and act: it is not what we decided on.
            self.record(c, d, Action.KEPT, "replaced since the scan")
            return False
        if done is Unlinked.NOT_EMPTY:
            self.record(c, d, Action.KEPT, "no longer empty")
            return False
        self.record(c, d, Action.WOULD_REMOVE if done is Unlinked.WOULD else Action.REMOVED,
                    "already gone" if done is Unlinked.GONE else "")
        return True

    def act_segment(self, shm_dir: str, c: Candidate, d: Decision) -> bool:
        """Remove one stale segment under its exclusive lease and flock; True when it is (or would be) gone."""
        try:
            dir_fd = self.top(shm_dir)
        except OSError as e:
            self.record(c, d, Action.FAILED, f"{shm_dir}: {e.strerror}")
            return False
        try:
            fd = os.open(c.name, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError:
            self.record(c, d, Action.REMOVED, "already gone")
            return True
        except OSError as e:
            self.record(c, d, Action.FAILED, f"open: {e.strerror}")
            return False
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != c.ident or not same_file(c.handle, fd_handle(fd)):
                self.record(c, d, Action.KEPT, "replaced since the scan")
                return False
            # The exclusive lease proves no engine of ours took it since the scan;
            # the flock proves no upstream reader or writer is inside it right now.
            if not ofd_lock(fd, fcntl.F_WRLCK):
                self.record(c, d, Action.KEPT, "a process took its lease since the scan")
                return False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self.record(c, d, Action.KEPT, "in use since the scan")
                return False
            return self.remove(dir_fd, c, d)
        finally:
            os.close(fd)

    def act_dir(self, parent_fd: int, c: Candidate, decisions: dict[str, Decision], locked: bool,
                keep_note: str = "") -> bool:
        """Remove the stale entries of one socket directory; True when it was removed too.

        With `keep_note`, the directory itself stays (its entries may go): it is
        the only record of a segment that remains.
        """
        d = decisions[c.path]
        # Any stale entry below, not only a direct child: a dead worker's node in a
        # stage directory that a live peer still serves from must go too.
        if d.state is not State.STALE and not _stale_below(c, decisions):
            self.keep_all(c, decisions)
            return False
        try:
            fd = os.open(c.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
        except FileNotFoundError:
            for sub in c.walk():
                self.record(
                    sub,
                    decisions[sub.path],
                    Action.REMOVED if decisions[sub.path].state is State.STALE else Action.KEPT,
                    "already gone",
                )
            return True
        except OSError as e:
            for sub in c.walk():
                self.record(
                    sub,
                    decisions[sub.path],
                    Action.FAILED if decisions[sub.path].state is State.STALE else Action.KEPT,
                    f"open: {e.strerror}",
                )
            return False
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != c.ident or not same_file(c.handle, fd_handle(fd)):
                self.keep_all(c, decisions, "directory replaced since the scan")
                return False
            if not locked:
                try:
                    # Exclusive lease: a process of ours that starts now blocks on
                    # its shared lease until we are done, then re-checks the inode.
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    self.keep_all(c, decisions, "a process took the directory lease since the scan")
                    return False
            emptied = False
            for ch in c.children:
                cd = decisions[ch.path]
                if ch.kind is Kind.DIRECTORY:
                    emptied |= self.act_dir(fd, ch, decisions, locked=True)
                elif cd.state is State.STALE:
                    emptied |= self.remove(fd, ch, cd)
                else:
                    self.record(ch, cd, Action.KEPT)
            if d.state is State.STALE and not keep_note:
                return self.remove(parent_fd, c, d, rmdir=True)
            self.record(c, d, Action.KEPT, keep_note if d.state is State.STALE else "")
            return False
        finally:
            os.close(fd)

    def act_root_dir(self, tmp_dir: str, c: Candidate, decisions: dict[str, Decision], keep_note: str = "") -> None:
        try:
            tmp_fd = self.top(tmp_dir)
        except OSError as e:
            for sub in c.walk():
                self.record(sub, decisions[sub.path], Action.FAILED, f"{tmp_dir}: {e.strerror}")
            return
        self.act_dir(tmp_fd, c, decisions, locked=False, keep_note=keep_note)


def _stale_below(c: Candidate, decisions: dict[str, Decision]) -> bool:
    """Whether any entry below `c` (not `c` itself) is stale."""
    for ch in c.children:
        if decisions[ch.path].state is State.STALE or (ch.children and _stale_below(ch, decisions)):
            return True
    return False


def execute(
    p: Plan, *, dry_run: bool, time_limit: float | None = None, progress: Callable[[Entry], None] | None = None
) -> Report:
    """Act on the plan's stale entries only; everything else is reported as kept.

    Segments go first: a socket directory may be the only thing that names its
    segment (an explicit name on upstream's unmarked file), so a run stopped
    between the two (killed, `--time-limit`) must leave the directory, never the
    segment alone. A directory whose segment remains stays for the same reason.
    `progress` sees every entry as it is recorded.
    """
    started = time.time()
    deadline = time.monotonic() + time_limit if time_limit else None
    actor = _Actor(dry_run, deadline, progress)
    gone: set[str] = set()
    shm_dir, tmp_dir = p.layout.shm_dir, p.layout.tmp_dir  # properties that normalise a path: once per run
    with collector_paused():
        _act(p, actor, gone, shm_dir, tmp_dir)
    return Report(dry_run=dry_run, entries=actor.entries, errors=list(p.errors), started=started,
                  finished=time.time(), timed_out=actor.timed_out)


def _act(p: Plan, actor: _Actor, gone: set[str], shm_dir: str, tmp_dir: str) -> None:
    try:
        for c in p.roots:
            if c.kind is not Kind.SEGMENT:
                continue
            d = p.decisions[c.path]
            if d.state is not State.STALE:
                actor.record(c, d, Action.KEPT)
            elif actor.act_segment(shm_dir, c, d):
                gone.add(c.path)
        for c in p.roots:
            if c.kind is Kind.SEGMENT:
                continue
            seg = p.segments.get(c.deployment) if c.deployment is not None else None
            note = ""
            if seg is not None and seg.path not in gone and p.decisions[seg.path].state is State.STALE:
                note = f"kept: it names segment {seg.path}, which remains"
            actor.act_root_dir(tmp_dir, c, p.decisions, note)
    finally:
        actor.close()


def run_cleanup(
    layout: Layout,
    policy: Policy | None = None,
    *,
    dry_run: bool = False,
    time_limit: float | None = None,
    names: Iterable[str] = (),
    globs: Sequence[str] = (),
    kinds: Iterable[Kind] = (),
) -> Report:
    """Plan and act in one call, for library users; `kvctl gc` adds the lock and metrics on top (gcrun.py)."""
    return execute(plan(layout, policy, names=names, globs=globs, kinds=kinds), dry_run=dry_run, time_limit=time_limit)
