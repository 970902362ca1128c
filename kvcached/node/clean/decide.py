"""The one decision function (docs/CLEANER.md §3): (candidate, facts, policy, now) → (state, reason).

Pure: it reads the candidate's recorded observations and the facts of one
/proc pass, and touches nothing. Every caller (runtime start-up, the engine
owner's shutdown cleanup, `kvctl gc`, `delete`, `inspect`, `doctor`) asks it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

from ..base.enums import State, StrEnum
from ..base.name_rules import default_name_pgid
from ..base.units import entries, format_age
from ..state.sockdiag import Bind
from .facts import START_SLACK, Facts
from .report import Decision
from .scan import Candidate, FileType, Kind

DEFAULT_GRACE = 60.0


class Reason(StrEnum):
    # live
    LEASE_HELD = "lease_held"
    LISTENING = "listening"
    BOUND = "bound"
    HELD_OPEN = "held_open"
    OWNER_ALIVE = "owner_alive"
    GROUP_ALIVE = "group_alive"
    CHILD_LIVE = "child_live"
    DEPLOYMENT_LIVE = "deployment_live"
    # foreign
    SYMLINK = "symlink"
    WRONG_TYPE = "wrong_type"
    HARD_LINKED = "hard_linked"
    BAD_SIZE = "bad_size"
    BAD_HASH = "bad_hash"
    MOUNT_POINT = "mount_point"
    OTHER_USER = "other_user"
    OWNER_MISMATCH = "owner_mismatch"
    WORLD_WRITABLE = "world_writable"
    CONTAINS_FOREIGN = "contains_foreign"
    # unknown
    PROC_INCOMPLETE = "proc_incomplete"
    BIND_DENIED = "bind_test_denied"
    BIND_ERROR = "bind_test_failed"
    NOT_TESTED = "not_tested"
    LEASE_UNTESTED = "lease_untested"
    PGID_AMBIGUOUS = "pgid_ambiguous"
    UNNAMED = "unnamed_segment"
    CHILD_UNKNOWN = "child_unknown"
    DEPLOYMENT_UNKNOWN = "deployment_unknown"
    # young
    YOUNG = "younger_than_grace"
    CHILD_YOUNG = "child_young"
    DEPLOYMENT_YOUNG = "deployment_young"
    # stale
    NOT_LISTENING = "not_listening"
    NO_OWNER = "no_owner"
    PGID_REUSED = "pgid_reused"
    EMPTY_DIR = "empty_directory"
    ALL_STALE = "all_entries_stale"


@dataclass(frozen=True)
class Policy:
    """What a run may remove: grace age, and who we are."""

    grace: float = DEFAULT_GRACE
    uid: int = -1  # -1: this process's effective uid

    @cached_property
    def effective_uid(self) -> int:
        return os.geteuid() if self.uid < 0 else self.uid

    @cached_property
    def is_root(self) -> bool:
        return self.effective_uid == 0


def _d(state: State, reason: Reason, detail: str, pids: Sequence[int] = ()) -> Decision:
    return Decision(state, reason, detail, tuple(sorted(pids)))


# The outcomes whose wording never varies, built once: most of a full node's
# entries end in one of these, and a frozen dataclass is slow to build (bench/README.md).
_SYMLINK = _d(State.FOREIGN, Reason.SYMLINK, "a symbolic link; never followed")
_BAD_HASH = _d(State.FOREIGN, Reason.BAD_HASH, "hash suffix does not match the name")
_MOUNT_POINT = _d(State.FOREIGN, Reason.MOUNT_POINT, "a mount point; never crossed")
_WORLD_WRITABLE = _d(State.FOREIGN, Reason.WORLD_WRITABLE, "writable by anyone: its entries may be planted")
_BOUND = _d(State.LIVE, Reason.BOUND, "a socket is bound to this file (a listener, or one about to listen)")
_NOT_TESTED = _d(State.UNKNOWN, Reason.NOT_TESTED, "no listing shows it and it was not tested")
_LEASE_UNTESTED = _d(State.UNKNOWN, Reason.LEASE_UNTESTED, "its lease could not be tested")
_UNNAMED = _d(State.UNKNOWN, Reason.UNNAMED,
              "only its shape (24 bytes, a positive limit) says kvcached: no socket directory, process or mark "
              "names it; name it to remove it (kvctl delete NAME)")
_NOT_LISTENING = _d(State.STALE, Reason.NOT_LISTENING, "no socket is bound to it (connect refused)")
_PGID_REUSED = _d(State.STALE, Reason.PGID_REUSED,
                  "its process group id now belongs to a newer group with no engine-like process")
_HIDDEN_OWNER = _d(State.UNKNOWN, Reason.PROC_INCOMPLETE,
                   "/proc hides other users' processes (hidepid): whoever owns it may not be listed")
_NO_OWNER = _d(State.STALE, Reason.NO_OWNER, "no lease, holder, listener or process of its deployment")
_ALL_STALE = _d(State.STALE, Reason.ALL_STALE, "every entry inside is stale")
_EMPTY_DIR = _d(State.STALE, Reason.EMPTY_DIR, "empty, and no process of its deployment is alive")


_EXPECTED_TYPE = {Kind.SEGMENT: FileType.REGULAR, Kind.SOCKET: FileType.SOCKET, Kind.DIRECTORY: FileType.DIRECTORY}



def _foreign(c: Candidate, policy: Policy) -> Decision | None:
    if c.ftype is FileType.SYMLINK:
        return _SYMLINK
    kind = c.kind
    expected = _EXPECTED_TYPE[kind]
    if c.ftype is not expected:
        return _d(State.FOREIGN, Reason.WRONG_TYPE, f"a {c.ftype} where a {expected} belongs")
    if kind is Kind.SEGMENT:
        if c.nlink != 1:
            return _d(State.FOREIGN, Reason.HARD_LINKED, f"{c.nlink} hard links: may be another file's name")
        if c.size not in (0, 24):
            return _d(State.FOREIGN, Reason.BAD_SIZE, f"{c.size} bytes, a segment has 24")
    elif kind is Kind.DIRECTORY:
        if not c.hash_ok:
            return _BAD_HASH
        if c.cross_mount:
            return _MOUNT_POINT
        if c.mode & 0o002:
            return _WORLD_WRITABLE
    if c.uid != policy.effective_uid and not policy.is_root:
        return _d(State.FOREIGN, Reason.OTHER_USER, f"owned by uid {c.uid}, we are uid {policy.effective_uid}")
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
        if c.ident in facts.listeners:
            return _d(State.LIVE, Reason.LISTENING, "a listener is bound to this file", facts.serving_pids(c.ident))
        if c.bind is Bind.BOUND:
            return _BOUND
        if c.bind is None:
            return _NOT_TESTED
        if c.bind is not Bind.UNBOUND:
            reason = Reason.BIND_DENIED if c.bind is Bind.DENIED else Reason.BIND_ERROR
            return _d(State.UNKNOWN, reason, f"could not test whether a socket is bound to it ({c.bind_errno})")
        age = now - c.mtime
        if age < policy.grace:
            return _d(State.YOUNG, Reason.YOUNG, f"changed {format_age(age)} ago, grace is {format_age(policy.grace)}")
        return _NOT_LISTENING
    if kind is Kind.SEGMENT:
        holders = [p.pid for p in facts.holders_of_file(c.ident)]
        if holders:
            return _d(State.LIVE, Reason.HELD_OPEN, "held open or mapped", holders)
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
        return _d(State.UNKNOWN, Reason.PROC_INCOMPLETE, "processes that could own it could not be fully read", blind)
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

    age = now - c.mtime
    if age < policy.grace:
        return _d(State.YOUNG, Reason.YOUNG, f"changed {format_age(age)} ago, grace is {format_age(policy.grace)}")
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


# How strongly a state keeps an entry: a deployment's segment and directories
# are kept as strongly as its most strongly kept entry.
_KEEP_RANK = {State.STALE: 0, State.YOUNG: 1, State.UNKNOWN: 2, State.LIVE: 3}
_RAISED_REASON = {
    State.LIVE: Reason.DEPLOYMENT_LIVE,
    State.UNKNOWN: Reason.DEPLOYMENT_UNKNOWN,
    State.YOUNG: Reason.DEPLOYMENT_YOUNG,
}


def settle(roots: Iterable[Candidate], decisions: dict[str, Decision]) -> None:
    """Let each deployment's strongest evidence keep its segment and directories (docs/CLEANER.md §3).

    A deployment is one thing: while any socket of it is bound, or any entry
    is held, leased or named by a live process, its segment and directories are
    live, however old their mtime; while any entry is unknown or young, they
    are not stale. Sockets keep their own decision: a node no socket is bound
    to can never serve again, whoever else is alive. Foreign entries are no
    evidence. Decisions in `decisions` are replaced in place.
    """
    members: dict[str, list[Candidate]] = {}
    for root in roots:
        if root.deployment is not None and root.hash_ok:
            members.setdefault(root.deployment, []).extend(root.walk())
    for cands in members.values():
        best: Candidate | None = None
        best_rank = 0
        for c in cands:
            rank = _KEEP_RANK.get(decisions[c.path].state, -1)
            # A directory's own "live/unknown/young entry inside" only repeats its children.
            if rank > best_rank and decisions[c.path].reason not in _DERIVED:
                best, best_rank = c, rank
        if best is None:
            continue
        ev = decisions[best.path]
        what = "its socket" if best.kind is Kind.SOCKET else f"its {best.kind}"
        raised = _d(
            ev.state, _RAISED_REASON[ev.state], f"{what} {best.name} is {ev.state} ({ev.reason}: {ev.detail})", ev.pids
        )
        for c in cands:
            if c.kind is Kind.SOCKET:
                continue
            d = decisions[c.path]
            if _KEEP_RANK.get(d.state, 4) < best_rank:
                decisions[c.path] = raised


_DERIVED = frozenset({Reason.CHILD_LIVE, Reason.CHILD_UNKNOWN, Reason.CHILD_YOUNG})
