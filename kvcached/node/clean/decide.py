"""The one decision function (docs/CLEANER.md §3): (candidate, facts, policy, now) → (state, reason).

Pure: it reads the candidate's recorded observations and the facts of one
/proc pass, and touches nothing. Every caller (runtime start-up, the engine
owner's shutdown cleanup, `kvctl gc`, `delete`, `inspect`, `doctor`) asks it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..base.enums import State, StrEnum
from ..base.name_rules import default_name_pgid
from ..base.units import entries
from . import rules
from .facts import START_SLACK, Facts
from .report import Decision
from .rules import DEFAULT_GRACE, GroupRule, Policy, SharedReason, decision, raise_groups, young
from .scan import Candidate, FileType, Kind

__all__ = ["DEFAULT_GRACE", "Decision", "Policy", "Reason", "State", "decide", "decide_tree", "settle"]


class Reason(StrEnum):
    """kvcached's own reasons (its entries' `reason`, with rules.SharedReason's): what only its evidence finds."""

    # live
    LEASE_HELD = "lease_held"
    OWNER_ALIVE = "owner_alive"
    GROUP_ALIVE = "group_alive"
    CHILD_LIVE = "child_live"
    DEPLOYMENT_LIVE = "deployment_live"
    # foreign
    BAD_SIZE = "bad_size"
    BAD_HASH = "bad_hash"
    OWNER_MISMATCH = "owner_mismatch"
    WORLD_WRITABLE = "world_writable"
    CONTAINS_FOREIGN = "contains_foreign"
    # unknown
    LEASE_UNTESTED = "lease_untested"
    PGID_AMBIGUOUS = "pgid_ambiguous"
    UNNAMED = "unnamed_segment"
    CHILD_UNKNOWN = "child_unknown"
    DEPLOYMENT_UNKNOWN = "deployment_unknown"
    # young
    CHILD_YOUNG = "child_young"
    DEPLOYMENT_YOUNG = "deployment_young"
    # stale
    NO_OWNER = "no_owner"
    PGID_REUSED = "pgid_reused"
    EMPTY_DIR = "empty_directory"
    ALL_STALE = "all_entries_stale"


# Every reason a kvcached entry can carry, shared ones first (docs/KVCTL.md lists them).
REASONS: tuple[StrEnum, ...] = (*SharedReason, *Reason)

_d = decision
# The outcomes of kvcached's own evidence whose wording never varies (rules.py has the shared ones).
_BAD_HASH = _d(State.FOREIGN, Reason.BAD_HASH, "hash suffix does not match the name")
_WORLD_WRITABLE = _d(State.FOREIGN, Reason.WORLD_WRITABLE, "writable by anyone: its entries may be planted")
_LEASE_UNTESTED = _d(State.UNKNOWN, Reason.LEASE_UNTESTED, "its lease could not be tested")
_UNNAMED = _d(State.UNKNOWN, Reason.UNNAMED,
              "only its shape (24 bytes, a positive limit) says kvcached: no socket directory, process or mark "
              "names it; name it to remove it (kvctl delete NAME)")
_PGID_REUSED = _d(State.STALE, Reason.PGID_REUSED,
                  "its process group id now belongs to a newer group with no engine-like process")
_HIDDEN_OWNER = _d(State.UNKNOWN, SharedReason.PROC_INCOMPLETE,
                   "/proc hides other users' processes (hidepid): whoever owns it may not be listed")
_NO_OWNER = _d(State.STALE, Reason.NO_OWNER, "no lease, holder, listener or process of its deployment")
_ALL_STALE = _d(State.STALE, Reason.ALL_STALE, "every entry inside is stale")
_EMPTY_DIR = _d(State.STALE, Reason.EMPTY_DIR, "empty, and no process of its deployment is alive")


_EXPECTED_TYPE = {Kind.SEGMENT: FileType.REGULAR, Kind.SOCKET: FileType.SOCKET, Kind.DIRECTORY: FileType.DIRECTORY}


def _foreign(c: Candidate, policy: Policy) -> Decision | None:
    kind = c.kind
    found = rules.wrong_type(c, _EXPECTED_TYPE[kind])
    if found is not None:
        return found
    if kind is Kind.SEGMENT:
        found = rules.hard_linked(c)
        if found is not None:
            return found
        if c.size not in (0, 24):
            return _d(State.FOREIGN, Reason.BAD_SIZE, f"{c.size} bytes, a segment has 24")
    elif kind is Kind.DIRECTORY:
        if not c.hash_ok:
            return _BAD_HASH
        if c.cross_mount:
            return rules.MOUNT_POINT
        if c.mode & 0o002:
            return _WORLD_WRITABLE
    found = rules.other_user(c, policy)
    if found is not None:
        return found
    if c.parent_uid is not None and c.uid != c.parent_uid:
        return _d(State.FOREIGN, Reason.OWNER_MISMATCH,
                  f"owned by uid {c.uid}, its directory by uid {c.parent_uid}")
    return None


def _deployment_alive(c: Candidate, facts: Facts) -> tuple[Decision | None, bool]:
    """What the deployment's processes say: (decision or None, pgid_reused).

    A process that carries the name is the deployment's whenever it started
    (a same-name successor joins the name). Only the PGID of a default name is
    ambiguous, because PGIDs are reused: a group that started after the entry
    last changed proves nothing, and while it holds anything that could be a
    serve of the same name the entry is unknown, never stale.
    """
    if c.deployment is None:
        return None, False
    named = [p.pid for p in facts.by_ipc_name(c.deployment)]
    if named:
        return _d(State.LIVE, Reason.OWNER_ALIVE, "a process carrying this deployment's name is alive", named), False
    pgid = default_name_pgid(c.deployment)
    if pgid is None:
        return None, False
    group = facts.by_pgid(pgid)
    if not group:
        return None, False
    before = c.mtime + START_SLACK
    older = [p.pid for p in group if p.start_time <= before]
    if older:
        return _d(State.LIVE, Reason.GROUP_ALIVE, f"process group {pgid} is alive", older), False
    engines = [p.pid for p in group if p.engine_like]
    if engines:
        return _d(State.UNKNOWN, Reason.PGID_AMBIGUOUS,
                  f"process group {pgid} started after this entry last changed, but may be a new serve of "
                  "the same name", engines), False
    return None, True


def decide(c: Candidate, facts: Facts, policy: Policy, now: float,
           children: Sequence[Decision] = ()) -> Decision:
    """Classify one candidate on its own evidence; for a directory, `children` are its entries' decisions.

    `settle` then lets the evidence of the candidate's deployment speak for it.
    """
    foreign = _foreign(c, policy)
    if foreign is not None:
        return foreign

    kind = c.kind
    if c.lease:
        pids = [e.pid for e in facts.locks.get(c.ident, ()) if e.pid > 0]
        return _d(State.LIVE, Reason.LEASE_HELD, "a process holds its lease or lock", pids)
    if kind is Kind.SOCKET:
        # A socket node stands on its own evidence: one that no socket is bound to
        # can never serve again, whichever processes of its deployment are alive.
        serving = facts.serving_pids(c.ident) if c.ident in facts.listeners else None
        return rules.socket(c, serving, policy, now)
    if kind is Kind.SEGMENT:
        holders = [p.pid for p in facts.holders_of_file(c.ident)]
        if holders:
            return _d(State.LIVE, SharedReason.HELD_OPEN, "held open or mapped", holders)
    else:
        live = [d for d in children if d.state is State.LIVE]
        if live:
            pids = sorted({p for d in live for p in d.pids})
            return _d(State.LIVE, Reason.CHILD_LIVE, f"{entries(len(live), 'live')} inside", pids)
    alive, pgid_reused = _deployment_alive(c, facts)
    if alive is not None:
        return alive

    if kind is Kind.SEGMENT and c.lease is None:
        return _LEASE_UNTESTED
    blind = facts.blind_spots(c.uid)
    if blind:
        return _d(State.UNKNOWN, SharedReason.PROC_INCOMPLETE, "processes that could own it could not be fully read",
                  blind)
    if facts.hidden_users and c.uid != policy.effective_uid:
        # hidepid lists no process of another user: its owner's would be missing, not dead.
        return _HIDDEN_OWNER
    if kind is Kind.DIRECTORY:
        for state, reason in ((State.UNKNOWN, Reason.CHILD_UNKNOWN), (State.YOUNG, Reason.CHILD_YOUNG)):
            hits = [d for d in children if d.state is state]
            if hits:
                return _d(state, reason, f"{entries(len(hits), str(state))} inside")
        if c.extras or any(d.state is State.FOREIGN for d in children):
            n = len(c.extras) + sum(d.state is State.FOREIGN for d in children)
            return _d(State.FOREIGN, Reason.CONTAINS_FOREIGN, f"holds {entries(n)} not ours")

    fresh = young(c, policy, now)
    if fresh is not None:
        return fresh
    if kind is Kind.SEGMENT:
        if c.by_shape:
            return _UNNAMED
        return _PGID_REUSED if pgid_reused else _NO_OWNER
    return _ALL_STALE if children else _EMPTY_DIR


def decide_tree(
    c: Candidate, facts: Facts, policy: Policy, now: float, out: dict[str, Decision] | None = None
) -> dict[str, Decision]:
    """Decide a candidate and everything below it, keyed by path (added to `out` when given)."""
    out = {} if out is None else out
    _decide_into(c, facts, policy, now, out)
    return out


def _decide_into(c: Candidate, facts: Facts, policy: Policy, now: float, out: dict[str, Decision]) -> Decision:
    children = [_decide_into(child, facts, policy, now, out) for child in c.children]
    d = out[c.path] = decide(c, facts, policy, now, children)
    return d


_DERIVED = frozenset({Reason.CHILD_LIVE, Reason.CHILD_UNKNOWN, Reason.CHILD_YOUNG})


def _raised_detail(best: Candidate, ev: Decision) -> str:
    what = "its socket" if best.kind is Kind.SOCKET else f"its {best.kind}"
    return f"{what} {best.name} is {ev.state} ({ev.reason}: {ev.detail})"


# A deployment is one thing: its segment and directories are kept as strongly as its most strongly kept
# entry. Sockets keep their own decision (a node no socket is bound to can never serve again, whoever else
# is alive); a directory's own "live/unknown/young entry inside" only repeats its children.
_DEPLOYMENT = GroupRule[Candidate](
    reasons={State.LIVE: Reason.DEPLOYMENT_LIVE, State.UNKNOWN: Reason.DEPLOYMENT_UNKNOWN,
             State.YOUNG: Reason.DEPLOYMENT_YOUNG},
    detail=_raised_detail,
    counts=lambda d: d.reason not in _DERIVED,
    raises=lambda m, d, rank: m.kind is not Kind.SOCKET and rules.KEEP_RANK.get(d.state, 4) < rank,
)


def settle(roots: Iterable[Candidate], decisions: dict[str, Decision]) -> None:
    """Let each deployment's strongest evidence keep its segment and directories (docs/CLEANER.md §3).

    A deployment is one thing: while any socket of it is bound, or any entry
    is held, leased or named by a live process, its segment and directories are
    live, however old their mtime; while any entry is unknown or young, they
    are not stale. Sockets keep their own decision: a node no socket is bound
    to can never serve again, whoever else is alive. Foreign entries are no
    evidence. Decisions in `decisions` are replaced in place (rules.raise_groups).
    """
    members: dict[str, list[Candidate]] = {}
    for root in roots:
        if root.deployment is not None and root.hash_ok:
            members.setdefault(root.deployment, []).extend(root.walk())
    raise_groups(members.values(), decisions, _DEPLOYMENT)
