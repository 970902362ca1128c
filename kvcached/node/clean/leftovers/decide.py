"""The decision for engine leftovers: (candidate, evidence, policy, now) → (state, reason), pure.

Same states as decide.decide, same house rules; each entry on its own
evidence. A PID in a name counts only with its start time: a process that
started after the file last changed (its ctime, which utime cannot move
back) cannot have created it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ...base.enums import State, StrEnum
from .. import rules
from ..facts import START_SLACK
from ..report import Decision
from ..rules import GroupRule, Policy, SharedReason, raise_groups
from ..scan import FileType
from .evidence import EngineEvidence
from .families import Evidence, Where
from .scan import EngineCandidate


class EngineReason(StrEnum):
    """The engines' own reasons (their entries' `reason`, with rules.SharedReason's): what only their evidence finds."""

    # live
    MAPPED = "mapped"
    CREATOR_ALIVE = "creator_alive"
    GROUP_LIVE = "group_live"
    # unknown
    VIEW_INCOMPLETE = "view_incomplete"
    HIDDEN_PROCESSES = "hidden_processes"
    GROUP_UNKNOWN = "group_unknown"
    # young
    GROUP_YOUNG = "group_young"
    # stale
    UNUSED = "unused"
    CREATOR_GONE = "creator_gone"
    PID_REUSED = "pid_reused"


# Every reason an engine entry can carry, shared ones first (kvctl/schemas/engine_entry.json lists them so).
REASONS: tuple[StrEnum, ...] = (*SharedReason, *EngineReason)


def _d(state: State, reason: StrEnum, detail: str, pids: Iterable[int] = ()) -> Decision:
    # A process both maps and holds a buffer: it is named once.
    return rules.decision(state, reason, detail, set(pids))


_UNUSED = _d(State.STALE, EngineReason.UNUSED, "no process maps it or holds it open, and every one could be read")


def _foreign(c: EngineCandidate, policy: Policy) -> Decision | None:
    expected = FileType.SOCKET if c.family.where is Where.RPC else FileType.REGULAR
    found = rules.wrong_type(c, expected) or rules.hard_linked(c)
    if found is not None:
        return found
    if c.cross_mount:
        return rules.MOUNT_POINT
    return rules.other_user(c, policy)


def _creator(c: EngineCandidate, ev: EngineEvidence) -> tuple[Decision | None, bool]:
    """(live decision or None, whether the PID now belongs to a later process)."""
    pid = c.creator_pid
    if pid is None:
        return None, False
    procs = ev.by_any_pid.get(pid, ())
    before = c.changed + START_SLACK
    older = [p.pid for p in procs if p.start_time <= before]
    if older:
        note = f" (it may be the sandbox's own holder: {ev.creator_note})" if ev.creator_note else ""
        return _d(State.LIVE, EngineReason.CREATOR_ALIVE,
                  f"its creator, PID {pid}, is alive and started before it{note}", older), False
    return None, bool(procs)


def decide_engine(c: EngineCandidate, ev: EngineEvidence, policy: Policy, now: float) -> Decision:
    """Classify one engine entry on its own evidence."""
    foreign = _foreign(c, policy)
    if foreign is not None:
        return foreign
    evidence = c.family.evidence
    if evidence is Evidence.BINDING:
        return rules.socket(c, ev.listeners.get(c.ident), policy, now)
    mappers, holders = ev.users(c)
    if mappers:
        how = "mapped" + (", and held open" if holders else "")
        return _d(State.LIVE, EngineReason.MAPPED, how, (*mappers, *holders))
    if holders:
        return _d(State.LIVE, SharedReason.HELD_OPEN, "held open", holders)
    reused = False
    if evidence is Evidence.CREATOR:
        alive, reused = _creator(c, ev)
        if alive is not None:
            return alive
    if ev.view_gap is not None:
        return _d(State.UNKNOWN, EngineReason.VIEW_INCOMPLETE, ev.view_gap)
    if ev.hidden_users and c.mode & 0o066:
        return _d(State.UNKNOWN, EngineReason.HIDDEN_PROCESSES,
                  "/proc hides other users' processes (hidepid), and its mode lets them open it")
    blind = ev.blind_for(c)
    if blind:
        return _d(State.UNKNOWN, SharedReason.PROC_INCOMPLETE,
                  "processes that could map or hold it could not be fully read", blind)
    young = rules.young(c, policy, now)
    if young is not None:
        return young
    if evidence is Evidence.CREATOR and c.creator_pid is not None:
        if reused:
            return _d(State.STALE, EngineReason.PID_REUSED,
                      f"nothing maps or holds it; PID {c.creator_pid} now belongs to a process that started "
                      "after it last changed")
        return _d(State.STALE, EngineReason.CREATOR_GONE,
                  f"nothing maps or holds it, and its creator, PID {c.creator_pid}, is gone")
    return _UNUSED


# A region made of several files (vLLM's offload segments) is kept as strongly as its most strongly kept
# file: only its stale members are raised.
_REGION = GroupRule[EngineCandidate](
    reasons={State.LIVE: EngineReason.GROUP_LIVE, State.UNKNOWN: EngineReason.GROUP_UNKNOWN,
             State.YOUNG: EngineReason.GROUP_YOUNG},
    detail=lambda best, ev: f"{best.name} of the same region is {ev.state} ({ev.reason}: {ev.detail})",
    counts=lambda d: True,
    raises=lambda m, d, rank: d.state is State.STALE,
)


def settle_groups(candidates: Sequence[EngineCandidate], decisions: dict[str, Decision]) -> None:
    """A region made of several files (vLLM's offload segments) is kept as strongly as its most strongly kept file.

    Only stale members are raised; foreign members are no evidence. Decisions are replaced in place
    (rules.raise_groups, the same mechanism as kvcached's deployments).
    """
    groups: dict[str, list[EngineCandidate]] = {}
    for c in candidates:
        if c.group is not None:
            groups.setdefault(f"{c.parent}\0{c.group}", []).append(c)
    raise_groups(groups.values(), decisions, _REGION)
