"""Plan and guarded act for engine leftovers, and their report (the gc entry fields plus `engine` and `bytes`).

The plan has no side effect (every test it makes is passive); the act removes
stale entries only, exactly the planned inodes, and a dry run is the same
path with one guard at the removing syscall (ident.unlink_if_same).
"""

from __future__ import annotations

import fcntl
import os
import stat
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from ..cleanup import Action
from ..decide import Policy, State
from ..facts import Facts, gather_facts
from ..ident import Unlinked, fd_handle, same_file, unlink_if_same
from ..layout import Layout
from ..names import rpc_dirs
from .decide import EngineDecision, decide_engine, settle_groups
from .evidence import gather_engine_evidence
from .families import Engine, EngineKind, Where
from .scan import EngineCandidate, scan_engine_state

ENV_RPC_BASE = "VLLM_RPC_BASE_PATH"


def rpc_dirs_from_env(layout: Layout, environ: dict[str, str] | None = None) -> list[str]:
    """vLLM's RPC directory from VLLM_RPC_BASE_PATH (as vLLM reads it), re-based under the layout's root."""
    return list(rpc_dirs(layout.root, environ))


class EngineEntry(NamedTuple):
    """One reported engine entry: what it is, what we decided, what we did."""

    candidate: EngineCandidate
    decision: EngineDecision
    action: Action
    note: str = ""

    @property
    def kind(self) -> EngineKind:
        return self.candidate.kind

    @property
    def engine(self) -> Engine:
        return self.candidate.engine

    @property
    def state(self) -> State:
        return self.decision.state

    @property
    def path(self) -> str:
        return self.candidate.path

    @property
    def bytes(self) -> int:
        return self.candidate.allocated

    def to_dict(self) -> dict[str, object]:
        """The entry as JSON reports print it (kvctl/schemas/engine_entry.json)."""
        c, d = self.candidate, self.decision
        return {
            "kind": str(c.kind), "engine": str(c.engine), "path": c.path, "deployment": None,
            "state": str(d.state), "action": str(self.action), "reason": str(d.reason),
            "detail": d.detail + (f"; {self.note}" if self.note else ""),
            "pids": list(d.pids), "rank": None, "stage": None,
            "uid": c.uid, "mtime": c.mtime, "type": str(c.ftype),
            "bytes": c.allocated, "size": c.size, "creator_pid": c.creator_pid,
        }


@dataclass
class EnginePlan:
    """Every engine entry a run found and decided, before acting."""

    layout: Layout
    facts: Facts
    policy: Policy
    now: float
    candidates: list[EngineCandidate]
    decisions: dict[str, EngineDecision]
    errors: list[str] = field(default_factory=list)
    matched: int = 0  # entries found before the kind and name filters

    def entries(self) -> list[tuple[EngineCandidate, EngineDecision]]:
        return [(c, self.decisions[c.path]) for c in self.candidates]


@dataclass
class EngineReport:
    dry_run: bool
    entries: list[EngineEntry]
    errors: list[str]
    started: float
    finished: float
    timed_out: bool = False
    _counts: Counter[tuple[Engine, State, Action]] | None = field(default=None, init=False, repr=False,
                                                                 compare=False)
    _bytes: Counter[tuple[Engine, State, Action]] | None = field(default=None, init=False, repr=False,
                                                                compare=False)

    def _tally(self) -> tuple[Counter[tuple[Engine, State, Action]], Counter[tuple[Engine, State, Action]]]:
        if self._counts is None or self._bytes is None:
            self._counts, self._bytes = Counter(), Counter()
            for e in self.entries:
                key = (e.engine, e.state, e.action)
                self._counts[key] += 1
                self._bytes[key] += e.bytes
        return self._counts, self._bytes

    def _sum(self, table: Counter[tuple[Engine, State, Action]], engine: Engine | None, state: State | None,
             action: Action | None) -> int:
        return sum(n for (g, s, a), n in table.items()
                   if (engine is None or g is engine) and (state is None or s is state)
                   and (action is None or a is action))

    def count(self, *, engine: Engine | None = None, state: State | None = None, action: Action | None = None) -> int:
        """How many entries have the given engine, state and action (None: any)."""
        return self._sum(self._tally()[0], engine, state, action)

    def bytes(self, *, engine: Engine | None = None, state: State | None = None, action: Action | None = None) -> int:
        """How many bytes those entries hold."""
        return self._sum(self._tally()[1], engine, state, action)

    @property
    def failures(self) -> list[EngineEntry]:
        return [e for e in self.entries if e.action is Action.FAILED]

    @property
    def stale_remaining(self) -> list[EngineEntry]:
        return [e for e in self.entries if e.state is State.STALE and e.action is not Action.REMOVED]

    def summary(self) -> dict[str, object]:
        """Counts by state and action, and bytes by state (what the dead ones hold is what an operator gets back)."""
        return {"entries": len(self.entries), "states": {str(s): self.count(state=s) for s in State},
                "actions": {str(a): self.count(action=a) for a in Action},
                "bytes": {str(s): self.bytes(state=s) for s in State},
                "removed_bytes": self.bytes(action=Action.REMOVED), "errors": len(self.errors),
                "timed_out": self.timed_out, "seconds": round(self.finished - self.started, 4)}


def plan_engines(layout: Layout, policy: Policy | None = None, *, facts: Facts | None = None,
                 rpc_dirs: Iterable[str] = (), kinds: Iterable[EngineKind] = (), names: Iterable[str] = (),
                 now: float | None = None, proc_root: str = "/proc", whole_view: bool = False) -> EnginePlan:
    """Scan, gather evidence and decide every engine entry: no side effects.

    `facts` may be the ones a plain gc plan of the same run gathered (one
    /proc pass for both). Every entry is decided and groups settled before
    the `kinds` and `names` (exact file names) filters apply. `whole_view`:
    see gather_engine_evidence (the caller vouches for a container's /proc).
    """
    policy = policy or Policy()
    facts = facts if facts is not None else gather_facts(proc_root)
    found = scan_engine_state(layout, facts, rpc_dirs)
    ev = gather_engine_evidence(facts, found.candidates, is_root=policy.is_root, proc_root=proc_root,
                                whole_view=whole_view)
    t = time.time() if now is None else now
    decisions = {c.path: decide_engine(c, ev, policy, t) for c in found.candidates}
    settle_groups(found.candidates, decisions)
    kind_set, name_set = set(kinds), set(names)
    chosen = [c for c in found.candidates
              if (not kind_set or c.kind in kind_set) and (not name_set or c.name in name_set)]
    return EnginePlan(layout, facts, policy, t, chosen, decisions, found.errors + facts.errors,
                      len(found.candidates))


def preview_engines(p: EnginePlan) -> list[EngineEntry]:
    """What gc would do with each planned entry (would_remove when stale, else kept), touching nothing: inspect's."""
    return [EngineEntry(c, d, Action.WOULD_REMOVE if d.state is State.STALE else Action.KEPT)
            for c, d in p.entries()]


class _Actor:
    def __init__(self, dry_run: bool, deadline: float | None,
                 progress: Callable[[EngineEntry], None] | None) -> None:
        self.dry_run = dry_run
        self.deadline = deadline
        self.progress = progress
        self.entries: list[EngineEntry] = []
        self.timed_out = False
        # Each directory is opened once per run and its identity checked against the scan's: every act
        # in it goes through that fd, so a directory swapped under the path later is never acted in.
        self.dirs: dict[str, int | tuple[Action, str]] = {}

    def record(self, c: EngineCandidate, d: EngineDecision, action: Action, note: str = "") -> None:
        e = EngineEntry(c, d, action, note)
        self.entries.append(e)
        if self.progress is not None:
            self.progress(e)

    def parent_fd(self, c: EngineCandidate) -> int | tuple[Action, str]:
        """The fd of `c`'s directory as the scan saw it, or (action, note) when it cannot be acted in."""
        got = self.dirs.get(c.parent)
        if got is None:
            try:
                fd = os.open(c.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError as e:
                got = (Action.FAILED, f"{c.parent}: {e.strerror}")
            else:
                pst = os.fstat(fd)
                if (pst.st_dev, pst.st_ino) != c.parent_ident:
                    os.close(fd)
                    got = (Action.KEPT, f"{c.parent} replaced since the scan")
                else:
                    got = fd
            self.dirs[c.parent] = got
        return got

    def close(self) -> None:
        for got in self.dirs.values():
            if isinstance(got, int):
                os.close(got)
        self.dirs.clear()

    def act(self, c: EngineCandidate, d: EngineDecision) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline:
            self.timed_out = True
            self.record(c, d, Action.KEPT, "time limit reached")
            return
        dir_fd = self.parent_fd(c)
        if not isinstance(dir_fd, int):
            self.record(c, d, *dir_fd)
            return
        why = self._recheck_socket(dir_fd, c) if c.family.where is Where.RPC else None
        if why is not None:
            self.record(c, d, Action.KEPT, why)
        elif c.family.where is Where.SHM:
            self._remove_file(dir_fd, c, d)
        else:
            self._unlink(dir_fd, c, d)

    def _recheck_socket(self, dir_fd: int, c: EngineCandidate) -> str | None:
        """Why a planned socket node must stay after all (None: it may go)."""
        try:
            st = os.stat(c.name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None  # unlink_if_same reports it gone
        # No bind test again: only bind(2) creates a socket node, so a node of the planned identity that
        # nothing was bound to can never have a listener; a new serve's node is another inode (unlink_if_same).
        if st.st_uid != c.uid or not stat.S_ISSOCK(st.st_mode):
            return "changed owner or type since the scan"
        return None

    def _remove_file(self, dir_fd: int, c: EngineCandidate, d: EngineDecision) -> None:
        try:
            # O_NONBLOCK: whatever sits at the name now (a FIFO) must not block the open; O_NOFOLLOW: no link.
            fd = os.open(c.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC,
                         dir_fd=dir_fd)
        except FileNotFoundError:
            self.record(c, d, Action.REMOVED, "already gone")
            return
        except OSError as e:
            self.record(c, d, Action.FAILED, f"open: {e.strerror}")
            return
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != c.ident or not same_file(c.handle, fd_handle(fd)):
                self.record(c, d, Action.KEPT, "replaced since the scan")
                return
            if st.st_uid != c.uid or st.st_nlink != 1 or not stat.S_ISREG(st.st_mode):
                self.record(c, d, Action.KEPT, "changed owner or links since the scan")
                return
            try:
                # Someone holding a lock on it now is using it (SGLang's load snapshots lock while writing).
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self.record(c, d, Action.KEPT, "locked by a process since the scan")
                return
            self._unlink(dir_fd, c, d)
        finally:
            os.close(fd)

    def _unlink(self, dir_fd: int, c: EngineCandidate, d: EngineDecision) -> None:
        try:
            done = unlink_if_same(dir_fd, c.name, c.ident, c.handle, dry_run=self.dry_run)
        except OSError as e:
            self.record(c, d, Action.FAILED, f"unlink: {e.strerror}")
            return
        if done is Unlinked.REPLACED:
            self.record(c, d, Action.KEPT, "replaced since the scan")
        elif done is Unlinked.WOULD:
            self.record(c, d, Action.WOULD_REMOVE)
        else:
            self.record(c, d, Action.REMOVED, "already gone" if done is Unlinked.GONE else "")


def execute_engines(p: EnginePlan, *, dry_run: bool, time_limit: float | None = None,
                    progress: Callable[[EngineEntry], None] | None = None) -> EngineReport:
    """Act on the plan's stale entries only; everything else is reported as kept."""
    started = time.time()
    actor = _Actor(dry_run, time.monotonic() + time_limit if time_limit else None, progress)
    try:
        for c, d in p.entries():
            if d.state is State.STALE:
                actor.act(c, d)
            else:
                actor.record(c, d, Action.KEPT)
    finally:
        actor.close()
    return EngineReport(dry_run, actor.entries, list(p.errors), started, time.time(), actor.timed_out)
