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
from collections.abc import Iterable
from dataclasses import dataclass, field

from ...base.enums import Action
from ...base.layout import Layout
from ..cleanup import Actor
from ..decide import Policy, State
from ..facts import Facts, gather_facts
from ..present import rpc_dirs
from ..report import Decision, Source
from .decide import decide_engine, settle_groups
from .evidence import gather_engine_evidence
from .families import EngineKind, Where
from .scan import EngineCandidate, scan_engine_state

ENV_RPC_BASE = "VLLM_RPC_BASE_PATH"


def rpc_dirs_from_env(layout: Layout, environ: dict[str, str] | None = None) -> list[str]:
    """vLLM's RPC directory from VLLM_RPC_BASE_PATH (as vLLM reads it), re-based under the layout's root."""
    return list(rpc_dirs(layout.root, environ))


@dataclass
class EnginePlan:
    """Every engine entry a run found and decided, before acting."""

    layout: Layout
    facts: Facts
    policy: Policy
    now: float
    candidates: list[EngineCandidate]
    decisions: dict[str, Decision]
    errors: list[str] = field(default_factory=list)
    matched: int = 0  # entries found before the kind and name filters

    @property
    def source(self) -> Source:
        return Source.ENGINES

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
