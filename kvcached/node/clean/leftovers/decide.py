"""The decision for engine leftovers: (candidate, evidence, policy, now) → (state, reason), pure.

Same states as decide.decide, same house rules; each entry on its own
evidence. A PID in a name counts only with its start time: a process that
started after the file last changed (its ctime, which utime cannot move
back) cannot have created it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ...base.enums import StrEnum
from ...base.units import format_age
from ...state.sockdiag import Bind
from ..decide import Policy, State
from ..facts import START_SLACK
from ..report import Decision
from ..scan import FileType
from .evidence import EngineEvidence
from .families import Evidence, Where
from .scan import EngineCandidate


class EngineReason(StrEnum):
    # live
    MAPPED = "mapped"
    HELD_OPEN = "held_open"
    CREATOR_ALIVE = "creator_alive"
    LISTENING = "listening"
    BOUND = "bound"
    GROUP_LIVE = "group_live"
    # foreign
    SYMLINK = "symlink"
    WRONG_TYPE = "wrong_type"
    HARD_LINKED = "hard_linked"
    MOUNT_POINT = "mount_point"
    OTHER_USER = "other_user"
    # unknown
    VIEW_INCOMPLETE = "view_incomplete"
    PROC_INCOMPLETE = "proc_incomplete"
    HIDDEN_PROCESSES = "hidden_processes"
    BIND_DENIED = "bind_test_denied"
    BIND_ERROR = "bind_test_failed"
    NOT_TESTED = "not_tested"
    GROUP_UNKNOWN = "group_unknown"
    # young
    YOUNG = "younger_than_grace"
    GROUP_YOUNG = "group_young"
    # stale
    UNUSED = "unused"
    CREATOR_GONE = "creator_gone"
    PID_REUSED = "pid_reused"
    NOT_LISTENING = "not_listening"


def _d(state: State, reason: EngineReason, detail: str, pids: Iterable[int] = ()) -> Decision:
    return Decision(state, reason, detail, tuple(sorted(set(pids))))


_SYMLINK = _d(State.FOREIGN, EngineReason.SYMLINK, "a symbolic link; never followed")
_MOUNT_POINT = _d(State.FOREIGN, EngineReason.MOUNT_POINT, "a mount point; never crossed")
_BOUND = _d(State.LIVE, EngineReason.BOUND, "a socket is bound to this file (a listener, or one about to listen)")
_NOT_TESTED = _d(State.UNKNOWN, EngineReason.NOT_TESTED, "no listing shows it and it was not tested")
_NOT_LISTENING = _d(State.STALE, EngineReason.NOT_LISTENING, "no socket is bound to it (connect refused)")
_UNUSED = _d(State.STALE, EngineReason.UNUSED, "no process maps it or holds it open, and every one could be read")


def _foreign(c: EngineCandidate, policy: Policy) -> Decision | None:
    if c.ftype is FileType.SYMLINK:
        return _SYMLINK
    expected = FileType.SOCKET if c.family.where is Where.RPC else FileType.REGULAR
    if c.ftype is not expected:
        return _d(State.FOREIGN, EngineReason.WRONG_TYPE, f"a {c.ftype} where a {expected} belongs")
    if c.ftype is FileType.REGULAR and c.nlink != 1:
        return _d(State.FOREIGN, EngineReason.HARD_LINKED, f"{c.nlink} hard links: may be another file's name")
    if c.cross_mount:
        return _MOUNT_POINT
    if c.uid != policy.effective_uid and not policy.is_root:
        return _d(State.FOREIGN, EngineReason.OTHER_USER,
                  f"owned by uid {c.uid}, we are uid {policy.effective_uid}")
    return None


def _young(c: EngineCandidate, policy: Policy, now: float) -> Decision | None:
    age = now - c.mtime
    if age < policy.grace:
        return _d(State.YOUNG, EngineReason.YOUNG,
                  f"changed {format_age(age)} ago, grace is {format_age(policy.grace)}")
    return None


def _socket(c: EngineCandidate, ev: EngineEvidence, policy: Policy, now: float) -> Decision:
    # Passive only: sock_diag's listing by file identity, else the datagram bind test. A stream
    # connect would be a connection a listener sees.
    if c.ident in ev.listeners:
        return _d(State.LIVE, EngineReason.LISTENING, "a listener is bound to this file", ev.listeners[c.ident])
    if c.bind is Bind.BOUND:
        return _BOUND
    if c.bind is None:
        return _NOT_TESTED
    if c.bind is not Bind.UNBOUND:
        reason = EngineReason.BIND_DENIED if c.bind is Bind.DENIED else EngineReason.BIND_ERROR
        return _d(State.UNKNOWN, reason, f"could not test whether a socket is bound to it ({c.bind_errno})")
    return _young(c, policy, now) or _NOT_LISTENING


def _creator(c: EngineCandidate, ev: EngineEvidence) -> tuple[Decision | None, bool]:
    """(live decision or None, whether the PID now belongs to a later process)."""
    pid = c.creator_pid
    if pid is None:
        return None, False
    procs = ev.by_any_pid.get(pid, ())
    before = c.changed + START_SLACK
    older = [p.pid for p in procs if p.start_time <= before]
    if older:
        return _d(State.LIVE, EngineReason.CREATOR_ALIVE,
                  f"its creator, PID {pid}, is alive and started before it", older), False
    return None, bool(procs)


def decide_engine(c: EngineCandidate, ev: EngineEvidence, policy: Policy, now: float) -> Decision:
    """Classify one engine entry on its own evidence."""
    foreign = _foreign(c, policy)
    if foreign is not None:
        return foreign
    evidence = c.family.evidence
    if evidence is Evidence.BINDING:
        return _socket(c, ev, policy, now)
    mappers, holders = ev.users(c)
    if mappers:
        how = "mapped" + (", and held open" if holders else "")
        return _d(State.LIVE, EngineReason.MAPPED, how, (*mappers, *holders))
    if holders:
        return _d(State.LIVE, EngineReason.HELD_OPEN, "held open", holders)
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
        return _d(State.UNKNOWN, EngineReason.PROC_INCOMPLETE,
                  "processes that could map or hold it could not be fully read", blind)
    young = _young(c, policy, now)
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


_KEEP_RANK = {State.STALE: 0, State.YOUNG: 1, State.UNKNOWN: 2, State.LIVE: 3}
_GROUP_REASON = {State.LIVE: EngineReason.GROUP_LIVE, State.UNKNOWN: EngineReason.GROUP_UNKNOWN,
                 State.YOUNG: EngineReason.GROUP_YOUNG}


def settle_groups(candidates: Sequence[EngineCandidate], decisions: dict[str, Decision]) -> None:
    """A region made of several files (vLLM's offload segments) is kept as strongly as its most strongly kept file.

    Only stale members are raised; foreign members are no evidence. Decisions are replaced in place.
    """
    groups: dict[str, list[EngineCandidate]] = {}
    for c in candidates:
        if c.group is not None:
            groups.setdefault(f"{c.parent}\0{c.group}", []).append(c)
    for members in groups.values():
        best = max(members, key=lambda m: _KEEP_RANK.get(decisions[m.path].state, -1))
        ev = decisions[best.path]
        rank = _KEEP_RANK.get(ev.state, -1)
        if rank <= 0:
            continue
        raised = _d(ev.state, _GROUP_REASON[ev.state], f"{best.name} of the same region is {ev.state} "
                    f"({ev.reason}: {ev.detail})", ev.pids)
        for m in members:
            if decisions[m.path].state is State.STALE:
                decisions[m.path] = raised
