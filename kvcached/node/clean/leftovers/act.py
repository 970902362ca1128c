"""The engines' plan (`plan_engines`, `EnginePlan`) and the re-checks their entries add to the one guarded act.

The plan has no side effect (every test it makes is passive). cleanup.execute
acts on it as on kvcached's (report.py: one entry, decision and report type):
stale entries only, exactly the planned inodes, a dry run the same path with
one guard at the removing syscall.
"""

from __future__ import annotations

import fcntl
import os
import stat
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from ...base.enums import Action
from ...base.layout import Layout
from ..cleanup import Actor, SourcePlan
from ..facts import Facts, gather_facts
from ..report import Decision, Source
from ..rules import Policy, State
from .decide import decide_engine, settle_groups
from .evidence import EngineEvidence, gather_engine_evidence
from .families import EngineKind, Where
from .scan import EngineCandidate, EngineScan, scan_engine_state


@dataclass(kw_only=True)
class EnginePlan(SourcePlan):
    """Every engine entry a run found and decided, before acting."""

    source: ClassVar[Source] = Source.ENGINES
    candidates: list[EngineCandidate]

    def entries(self) -> list[tuple[EngineCandidate, Decision]]:
        return [(c, self.decisions[c.path]) for c in self.candidates]

    def act(self, actor: Actor) -> None:
        """Each stale entry on its own, in scan order; everything else is recorded as kept."""
        for c, d in self.entries():
            if d.state is State.STALE:
                _act(actor, c, d)
            else:
                actor.record(c, d, Action.KEPT)


def plan_engines(layout: Layout, policy: Policy | None = None, *, facts: Facts | None = None,
                 rpc_dirs: Iterable[str] = (), kinds: Iterable[EngineKind] = (), names: Iterable[str] = (),
                 now: float | None = None, proc_root: str = "/proc", whole_view: bool = False) -> EnginePlan:
    """Scan, gather evidence and decide every engine entry: no side effects.

    `facts` may be the ones a plain gc plan of the same run gathered (one
    /proc pass for both). `whole_view`: see gather_engine_evidence (the
    caller vouches for a container's /proc). The decision and its filters
    are decide_engines', which every place of kvctl -A goes through too.
    """
    policy = policy or Policy()
    facts = facts if facts is not None else gather_facts(proc_root)
    found = scan_engine_state(layout, facts, rpc_dirs)
    ev = gather_engine_evidence(facts, found.candidates, is_root=policy.is_root, proc_root=proc_root,
                                whole_view=whole_view)
    return decide_engines(layout, found, ev, facts, policy, time.time() if now is None else now, kinds=kinds,
                          names=names, errors=facts.errors)


def decide_engines(layout: Layout, found: EngineScan, ev: EngineEvidence, facts: Facts, policy: Policy, now: float,
                   *, kinds: Iterable[EngineKind] = (), names: Iterable[str] = (),
                   errors: Sequence[str] = ()) -> EnginePlan:
    """The plan of what one scan found: every entry decided and its regions settled, then the `kinds` and
    `names` (exact file names) filters; `errors`: what else the plan reports (the /proc pass's, once)."""
    decisions = {c.path: decide_engine(c, ev, policy, now) for c in found.candidates}
    settle_groups(found.candidates, decisions)
    kind_set, name_set = set(kinds), set(names)
    chosen = [c for c in found.candidates
              if (not kind_set or c.kind in kind_set) and (not name_set or c.name in name_set)]
    return EnginePlan(layout=layout, facts=facts, policy=policy, now=now, candidates=chosen, decisions=decisions,
                      errors=found.errors + list(errors), matched=len(found.candidates))


def _act(actor: Actor, c: EngineCandidate, d: Decision) -> None:
    """The guarded act on one stale entry: its directory as the scan saw it, then the re-checks of its kind."""
    if actor.out_of_time():
        actor.record(c, d, Action.KEPT, "time limit reached")
        return
    dir_fd = actor.directory(c.parent, c.parent_ident)
    if not isinstance(dir_fd, int):
        actor.record(c, d, *dir_fd)
        return
    if c.family.where is Where.SHM:
        _remove_file(actor, dir_fd, c, d)
        return
    why = _recheck_socket(dir_fd, c)
    if why is not None:
        actor.record(c, d, Action.KEPT, why)
    else:
        actor.remove(dir_fd, c, d)


def _recheck_socket(dir_fd: int, c: EngineCandidate) -> str | None:
    """Why a planned socket node must stay after all (None: it may go)."""
    try:
        st = os.stat(c.name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None  # Actor.remove reports it gone
    # No bind test again: only bind(2) creates a socket node, so a node of the planned identity that
    # nothing was bound to can never have a listener; a new serve's node is another inode (unlink_if_same).
    if st.st_uid != c.uid or not stat.S_ISSOCK(st.st_mode):
        return "changed owner or type since the scan"
    return None


def _remove_file(actor: Actor, dir_fd: int, c: EngineCandidate, d: Decision) -> None:
    # O_NONBLOCK (Actor.reopen): whatever sits at the name now (a FIFO) must not block the open.
    got = actor.reopen(dir_fd, c, d, os.O_RDONLY | os.O_NOCTTY)
    if isinstance(got, bool):
        return
    fd, st = got
    try:
        if st.st_uid != c.uid or st.st_nlink != 1 or not stat.S_ISREG(st.st_mode):
            actor.record(c, d, Action.KEPT, "changed owner or links since the scan")
            return
        try:
            # Someone holding a lock on it now is using it (SGLang's load snapshots lock while writing).
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            actor.record(c, d, Action.KEPT, "locked by a process since the scan")
            return
        actor.remove(dir_fd, c, d)
    finally:
        os.close(fd)
