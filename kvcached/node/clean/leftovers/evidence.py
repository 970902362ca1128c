"""What the /proc facts say about engine leftovers, gathered once per run so that the decision stays pure."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from ..facts import Facts
from ..scan import FileType
from ..sight import pid_view_gap
from .families import Evidence, Where
from .scan import EngineCandidate, needs_creators


class Proc(NamedTuple):
    """A process as one of its namespace PIDs names it: its PID here and when it started."""

    pid: int
    start_time: float


class Blind(NamedTuple):
    """A process that might use an entry but whose maps or fds we could not read."""

    pid: int
    uid: int


@dataclass(frozen=True)
class EngineEvidence:
    """Everything `decide_engine` may ask, read-only (built by `gather_engine_evidence`, or by hand in tests)."""

    mapped: Mapping[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)
    held: Mapping[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)
    # (st_dev, st_ino) of a socket node -> PIDs serving it (empty when listed but the holders are unknown)
    listeners: Mapping[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)
    # a PID as seen in any PID namespace -> the processes that have it
    by_any_pid: Mapping[int, tuple[Proc, ...]] = field(default_factory=dict)
    blind: tuple[Blind, ...] = ()
    # why no view of processes here can be complete (None: it can be): another PID namespace, or unreadable /proc
    view_gap: str | None = None
    # /proc hides other users' processes from us (hidepid, not root)
    hidden_users: bool = False
    # why a live creator may be a sandbox's holder after all (its runtime's state named none): said with it
    creator_note: str | None = None

    def users(self, c: EngineCandidate) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(PIDs mapping it, PIDs holding it open)."""
        return self.mapped.get(c.ident, ()), self.held.get(c.ident, ())

    def blind_for(self, c: EngineCandidate) -> list[int]:
        """Unread processes that could open `c`: its owner's, or anyone's when its mode lets others in."""
        shared = bool(c.mode & 0o066)
        return [b.pid for b in self.blind if shared or b.uid == c.uid]


def gather_engine_evidence(facts: Facts, candidates: Sequence[EngineCandidate], *, is_root: bool | None = None,
                           proc_root: str | None = None, whole_view: bool = False) -> EngineEvidence:
    """Read what only engine entries need from /proc (maps, fds by name, namespace PIDs), once for all candidates.

    `whole_view`: the caller vouches that this /proc shows every process that
    can reach the scanned directories although it is a container's own (a
    pod's entrypoint, before its serve starts, with a /dev/shm only that pod
    mounts); without it such a view keeps every buffer unknown.
    """
    root = proc_root or facts.proc_root
    files = [c for c in candidates if c.family.where is Where.SHM and c.ftype is FileType.REGULAR]
    mapped: dict[tuple[int, int], tuple[int, ...]] = {}
    held: dict[tuple[int, int], set[int]] = {}
    if files:
        for ident, pids in facts.map_users({c.ident[0] for c in files}).items():
            mapped[ident] = tuple(sorted(set(pids)))
        idents = {c.ident for c in files}
        for p in facts.processes.values():
            for ident in p.held_files & idents:
                held.setdefault(ident, set()).add(p.pid)
    by_any_pid: dict[int, list[Proc]] = {}
    if needs_creators(files):
        wanted = {c.creator_pid for c in files if c.family.evidence is Evidence.CREATOR}
        for pid, nspids in facts.namespace_pids().items():
            info = facts.processes.get(pid)
            if info is None:
                continue
            for n in set(nspids) | {pid}:
                if n in wanted:
                    by_any_pid.setdefault(n, []).append(Proc(pid, info.start_time))
    sockets = {c.ident for c in candidates if c.family.where is Where.RPC and c.ftype is FileType.SOCKET}
    listeners = {ident: facts.serving_pids(ident) for ident in sockets & facts.listeners.keys()}
    blind = tuple(Blind(pid, q.uid) for pid, what in sorted(facts.unreadable_pids.items())
                  if what & {"fd", "maps"} and (q := facts.processes.get(pid)) is not None and q.engine_like)
    gap = None if whole_view else pid_view_gap(root)
    if gap is None and facts.errors and not facts.processes:
        gap = f"/proc could not be read ({'; '.join(facts.errors)})"
    root_user = os.geteuid() == 0 if is_root is None else is_root
    return EngineEvidence(
        mapped=mapped, held={k: tuple(sorted(v)) for k, v in held.items()}, listeners=listeners,
        by_any_pid={k: tuple(v) for k, v in by_any_pid.items()}, blind=blind, view_gap=gap,
        hidden_users=facts.hidepid and not root_user)
