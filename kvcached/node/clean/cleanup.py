"""The one guarded act (`Actor`, `execute`) for every source's plan, the plans' shape (`SourcePlan`), and
kvcached's own plan (`plan`, `Plan`).

The pipeline and its types are report.py's. Dry run is this same path with
one guard at the removing syscall, so the plan a dry run prints is what a
real run in a quiet state removes. Every caller that removes anything goes
through `Actor`: gc and delete, the start-up sweep and claim, and the engine
owner's cleanup of what it captured (in_engine/captured.py).
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
from typing import Any, ClassVar, Protocol

from ..base.enums import Action
from ..base.ident import Unlinked, fd_handle, handle_reader, same_file, unlink_if_same
from ..base.layout import Layout
from ..state.lease import ofd_lock
from .decide import Decision, Policy, State, decide_tree, settle
from .facts import Facts, gather_facts
from .report import Entry, Judged, Part, Report, Source, merged_errors
from .scan import Candidate, Kind, scan


class Acted(Judged, Protocol):
    """What the one guarded act reads of any source's candidate: where it is, and the identity it was judged by."""

    @property
    def ident(self) -> tuple[int, int]: ...
    @property
    def handle(self) -> bytes | None: ...


@dataclass(kw_only=True)
class SourcePlan:
    """One source's plan: everything it found and decided, before acting (kvcached's `Plan`, the engines'
    leftovers.act.EnginePlan). No side effect made it; `act` hands its entries to the one guarded act."""

    source: ClassVar[Source]
    layout: Layout
    facts: Facts
    policy: Policy
    now: float
    decisions: dict[str, Decision]
    errors: list[str] = field(default_factory=list)
    matched: int = 0  # entries that matched the names, before any kind filter

    def entries(self) -> Sequence[tuple[Acted, Decision]]:
        """Each planned candidate with its decision, in the order the act meets them."""
        raise NotImplementedError

    def act(self, actor: Actor) -> None:
        """Hand every planned entry to `actor`, stale ones to its guarded act (the source's own order)."""
        raise NotImplementedError


def preview(*plans: SourcePlan) -> list[Entry[Any]]:
    """What gc would do with each planned entry (would_remove when stale, else kept), touching nothing: inspect's."""
    return [Entry(c, d, Action.WOULD_REMOVE if d.state is State.STALE else Action.KEPT)
            for p in plans for c, d in p.entries()]


@dataclass(kw_only=True)
class Plan(SourcePlan):
    """kvcached's own plan: every segment and socket directory a run found and decided, before acting."""

    source: ClassVar[Source] = Source.KVCACHED
    roots: list[Candidate]
    # deployment -> its segment, also when a --kind filter leaves it out of `roots`:
    # a directory must not outlive the segment whose name it is the only record of
    segments: dict[str, Candidate] = field(default_factory=dict)

    def entries(self) -> list[tuple[Candidate, Decision]]:
        return [(c, self.decisions[c.path]) for root in self.roots for c in root.walk()]

    def act(self, actor: Actor) -> None:
        """Segments first: a socket directory may be the only thing that names its segment.

        (An explicit name on upstream's unmarked file.) A run stopped between
        the two (killed, `--time-limit`) must leave the directory, never the
        segment alone; a directory whose segment remains stays for the same reason.
        """
        _act(self, actor)


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
    return Plan(layout=layout, facts=facts, policy=policy, now=t, roots=roots, decisions=decisions,
                errors=found.errors + facts.errors, segments=segments, matched=matched)


_new_entry = tuple.__new__


class Actor:
    """The one guarded act, for every source's plan; `dry_run` is the one guard, at the removing syscall.

    Keeps going whatever fails: every entry is recorded (removed, would
    remove, kept with why, failed with the error), in the order acted on.
    """

    def __init__(self, dry_run: bool, deadline: float | None,
                 progress: Callable[[Entry[Any]], None] | None = None) -> None:
        self.dry_run = dry_run
        self.deadline = deadline
        self.entries: list[Entry[Any]] = []
        self.timed_out = False
        self.progress = progress
        self.handle_of = handle_reader()
        # Each directory opened once per run (an fd, or how its entries are recorded when it cannot be acted in):
        # every entry is still identified through the fd before it is removed.
        self._dirs: dict[tuple[str, tuple[int, int] | None], int | tuple[Action, str]] = {}

    def directory(self, path: str, ident: tuple[int, int] | None = None) -> int | tuple[Action, str]:
        """The run's fd of a directory, or (action, note) for its entries when it cannot be acted in.

        With `ident` (the scan's identity of a directory it listed), a link is
        not followed and a directory swapped under the path since is never
        acted in; without it, the layout's own /tmp and /dev/shm, as the scan opened them.
        """
        key = (path, ident)
        got = self._dirs.get(key)
        if got is None:
            flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (os.O_NOFOLLOW if ident is not None else 0)
            try:
                fd = os.open(path, flags)
            except OSError as e:
                got = (Action.FAILED, f"{path}: {e.strerror}")
            else:
                got = fd
                if ident is not None:
                    st = os.fstat(fd)
                    if (st.st_dev, st.st_ino) != ident:
                        os.close(fd)
                        got = (Action.KEPT, f"{path} replaced since the scan")
            self._dirs[key] = got
        return got

    def close(self) -> None:
        for got in self._dirs.values():
            if isinstance(got, int):
                os.close(got)
        self._dirs.clear()

    def out_of_time(self) -> bool:
        if self.deadline is not None and time.monotonic() > self.deadline:
            self.timed_out = True
        return self.timed_out

    def record(self, c: Acted, d: Decision, action: Action, note: str = "") -> None:
        e = _new_entry(Entry, (c, d, action, note))  # Entry(...) through its Python-level __new__: once per entry
        self.entries.append(e)
        if self.progress is not None:
            self.progress(e)

    def reopen(self, dir_fd: int, c: Acted, d: Decision, flags: int) -> tuple[int, os.stat_result] | bool:
        """Open `c` again through `dir_fd`, never following, as the file the scan saw: (fd, its stat).

        Otherwise the entry is recorded and the answer is whether it is gone:
        True (already gone: success), False (replaced since the scan, or the open failed).
        """
        try:
            fd = os.open(c.name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError:
            self.record(c, d, Action.REMOVED, "already gone")
            return True
        except OSError as e:
            self.record(c, d, Action.FAILED, f"open: {e.strerror}")
            return False
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != c.ident or not same_file(c.handle, fd_handle(fd)):
            os.close(fd)
            self.record(c, d, Action.KEPT, "replaced since the scan")
            return False
        return fd, st

    def remove(self, dir_fd: int, c: Acted, d: Decision, rmdir: bool = False) -> bool:
        """Unlink `c` through `dir_fd` if it still has the planned identity; True when gone (or, dry, would be)."""
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


def _record_all(actor: Actor, c: Candidate, decisions: dict[str, Decision], stale: Action, note: str) -> None:
    """Record `c` and everything below it: stale entries as `stale`, the rest kept, all with `note`."""
    for sub in c.walk():
        d = decisions[sub.path]
        actor.record(sub, d, stale if d.state is State.STALE else Action.KEPT, note)


def _keep_all(actor: Actor, c: Candidate, decisions: dict[str, Decision], note: str = "") -> None:
    for sub in c.walk():
        d = decisions[sub.path]
        actor.record(sub, d, Action.KEPT, note if d.state is State.STALE else "")


def act_segment(actor: Actor, dir_fd: int | tuple[Action, str], c: Candidate, d: Decision) -> bool:
    """Remove one stale segment under its exclusive lease and flock; True when it is (or would be) gone.

    gc's act on a segment, and the engine owner's on the one it captured (in_engine/captured.py)."""
    if not isinstance(dir_fd, int):
        actor.record(c, d, Action.FAILED, dir_fd[1])
        return False
    got = actor.reopen(dir_fd, c, d, os.O_RDWR)
    if isinstance(got, bool):
        return got
    fd = got[0]
    try:
        # The exclusive lease proves no engine of ours took it since the scan;
        # the flock proves no upstream reader or writer is inside it right now.
        if not ofd_lock(fd, fcntl.F_WRLCK):
            actor.record(c, d, Action.KEPT, "a process took its lease since the scan")
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            actor.record(c, d, Action.KEPT, "in use since the scan")
            return False
        return actor.remove(dir_fd, c, d)
    finally:
        os.close(fd)


def _act_dir(actor: Actor, parent_fd: int, c: Candidate, decisions: dict[str, Decision], locked: bool,
             keep_note: str = "") -> bool:
    """Remove the stale entries of one socket directory; True when it was removed too.

    With `keep_note`, the directory itself stays (its entries may go): it is
    the only record of a segment that remains.
    """
    d = decisions[c.path]
    # Any stale entry below, not only a direct child: a dead worker's node in a
    # stage directory that a live peer still serves from must go too.
    if d.state is not State.STALE and not _stale_below(c, decisions):
        _keep_all(actor, c, decisions)
        return False
    try:
        fd = os.open(c.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
    except FileNotFoundError:
        _record_all(actor, c, decisions, Action.REMOVED, "already gone")
        return True
    except OSError as e:
        _record_all(actor, c, decisions, Action.FAILED, f"open: {e.strerror}")
        return False
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != c.ident or not same_file(c.handle, fd_handle(fd)):
            _keep_all(actor, c, decisions, "directory replaced since the scan")
            return False
        if not locked:
            try:
                # Exclusive lease: a process of ours that starts now blocks on
                # its shared lease until we are done, then re-checks the inode.
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                _keep_all(actor, c, decisions, "a process took the directory lease since the scan")
                return False
        emptied = False
        for ch in c.children:
            cd = decisions[ch.path]
            if ch.kind is Kind.DIRECTORY:
                emptied |= _act_dir(actor, fd, ch, decisions, locked=True)
            elif cd.state is State.STALE:
                emptied |= actor.remove(fd, ch, cd)
            else:
                actor.record(ch, cd, Action.KEPT)
        if d.state is State.STALE and not keep_note:
            return actor.remove(parent_fd, c, d, rmdir=True)
        actor.record(c, d, Action.KEPT, keep_note if d.state is State.STALE else "")
        return False
    finally:
        os.close(fd)


def _stale_below(c: Candidate, decisions: dict[str, Decision]) -> bool:
    """Whether any entry below `c` (not `c` itself) is stale."""
    for ch in c.children:
        if decisions[ch.path].state is State.STALE or (ch.children and _stale_below(ch, decisions)):
            return True
    return False


def _act(p: Plan, actor: Actor) -> None:
    """kvcached's order: segments first, then the socket directories (Plan.act)."""
    # Each top directory asked for once, when a first entry needs it: a run with nothing stale opens neither.
    shm_fd: int | tuple[Action, str] | None = None
    tmp_fd: int | tuple[Action, str] | None = None
    gone: set[str] = set()
    for c in p.roots:
        if c.kind is not Kind.SEGMENT:
            continue
        d = p.decisions[c.path]
        if d.state is not State.STALE:
            actor.record(c, d, Action.KEPT)
            continue
        if shm_fd is None:
            shm_fd = actor.directory(p.layout.shm_dir)
        if act_segment(actor, shm_fd, c, d):
            gone.add(c.path)
    for c in p.roots:
        if c.kind is Kind.SEGMENT:
            continue
        seg = p.segments.get(c.deployment) if c.deployment is not None else None
        note = ""
        if seg is not None and seg.path not in gone and p.decisions[seg.path].state is State.STALE:
            note = f"kept: it names segment {seg.path}, which remains"
        if tmp_fd is None:
            tmp_fd = actor.directory(p.layout.tmp_dir)
        if isinstance(tmp_fd, int):
            _act_dir(actor, tmp_fd, c, p.decisions, locked=False, keep_note=note)
        else:
            for sub in c.walk():
                actor.record(sub, p.decisions[sub.path], Action.FAILED, tmp_fd[1])


def execute(*plans: SourcePlan, dry_run: bool, time_limit: float | None = None,
            progress: Callable[[Entry[Any]], None] | None = None) -> Report:
    """Act on the plans' stale entries only, one source after the other; everything else is reported as kept.

    One actor, one time budget and one report for every plan: each source's
    entries form one part of it, in the order given (gc: kvcached's, then the
    engines'). `progress` sees every entry as it is recorded.
    """
    started = time.time()
    deadline = time.monotonic() + time_limit if time_limit else None
    actor = Actor(dry_run, deadline, progress)
    parts: list[Part] = []
    with collector_paused():
        try:
            for p in plans:
                begun, first = time.time(), len(actor.entries)
                p.act(actor)
                parts.append(Part(p.source, first, len(actor.entries), tuple(p.errors), begun, time.time(),
                                  actor.timed_out))
        finally:
            actor.close()
    return Report(dry_run=dry_run, entries=actor.entries, errors=merged_errors(parts), started=started,
                  finished=time.time(), timed_out=actor.timed_out, parts=tuple(parts))


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
