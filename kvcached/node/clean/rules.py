"""What every source's decision shares (docs/CLEANER.md §3): the house rules, their fixed outcomes, group raising.

The pipeline has one decision per source, each a pure function of (candidate,
evidence, policy, now): decide.py for kvcached's own segments and socket
directories, leftovers/decide.py for the engines' leftovers. What does not
depend on where an entry came from is here, once:

- `Policy` (the grace age, who we are) and the reasons every source gives
  (`SharedReason`), with the outcomes whose wording never varies;
- the foreign checks on the entry itself: a symbolic link, the wrong type,
  a hard link, a mount point, another user's (`wrong_type`, `hard_linked`,
  `other_user`), each source adding its own between them;
- the socket decision: a listener bound to the file, else the passive bind
  test, else inside the grace age young, else not listening (`socket`);
- the grace age (`young`);
- raising a group (`raise_groups`): members that stand or fall together (a
  kvcached deployment, a region of several engine files) are kept as
  strongly as the strongest member's evidence (`KEEP_RANK`); each source
  says which members count as evidence and which are raised (`GroupRule`).

A source keeps only its own evidence: leases, the deployment's processes
and a directory's children for kvcached's state (decide.py); the users,
the creator PID in a name and the view's completeness for the engines'
(leftovers/decide.py). Its own reasons (decide.Reason,
leftovers.decide.EngineReason) name only what it alone can find.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Generic, Protocol, TypeVar

from ..base.enums import State, StrEnum
from ..base.units import format_age
from ..state.sockdiag import Bind
from .report import Decision
from .scan import FileType

DEFAULT_GRACE = 60.0


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


class SharedReason(StrEnum):
    """The reasons every source gives, for the evidence every source reads the same way."""

    # live
    HELD_OPEN = "held_open"
    LISTENING = "listening"
    BOUND = "bound"
    # foreign
    SYMLINK = "symlink"
    WRONG_TYPE = "wrong_type"
    HARD_LINKED = "hard_linked"
    MOUNT_POINT = "mount_point"
    OTHER_USER = "other_user"
    # unknown
    PROC_INCOMPLETE = "proc_incomplete"
    BIND_DENIED = "bind_test_denied"
    BIND_ERROR = "bind_test_failed"
    NOT_TESTED = "not_tested"
    # young
    YOUNG = "younger_than_grace"
    # stale
    NOT_LISTENING = "not_listening"


def decision(state: State, reason: StrEnum, detail: str, pids: Iterable[int] = ()) -> Decision:
    """A decision, its PIDs in order (what reports print)."""
    return Decision(state, reason, detail, tuple(sorted(pids)))


# The outcomes whose wording never varies, built once: most of a full node's
# entries end in one of these, and a frozen dataclass is slow to build (bench/README.md).
SYMLINK = decision(State.FOREIGN, SharedReason.SYMLINK, "a symbolic link; never followed")
MOUNT_POINT = decision(State.FOREIGN, SharedReason.MOUNT_POINT, "a mount point; never crossed")
BOUND = decision(State.LIVE, SharedReason.BOUND, "a socket is bound to this file (a listener, or one about to listen)")
NOT_TESTED = decision(State.UNKNOWN, SharedReason.NOT_TESTED, "no listing shows it and it was not tested")
NOT_LISTENING = decision(State.STALE, SharedReason.NOT_LISTENING, "no socket is bound to it (connect refused)")


class Observed(Protocol):
    """What the shared rules read of any source's candidate (scan.Candidate, leftovers.scan.EngineCandidate)."""

    @property
    def ftype(self) -> FileType: ...
    @property
    def nlink(self) -> int: ...
    @property
    def uid(self) -> int: ...
    @property
    def mtime(self) -> float: ...
    @property
    def ident(self) -> tuple[int, int]: ...
    @property
    def bind(self) -> Bind | None: ...
    @property
    def bind_errno(self) -> str | None: ...


def wrong_type(c: Observed, expected: FileType) -> Decision | None:
    """Foreign when it is a symbolic link (never followed) or not the type its name promises."""
    if c.ftype is FileType.SYMLINK:
        return SYMLINK
    if c.ftype is not expected:
        return decision(State.FOREIGN, SharedReason.WRONG_TYPE, f"a {c.ftype} where a {expected} belongs")
    return None


def hard_linked(c: Observed) -> Decision | None:
    """Foreign when a regular file has another name too: removing this one would be deciding for that one."""
    if c.ftype is FileType.REGULAR and c.nlink != 1:
        return decision(State.FOREIGN, SharedReason.HARD_LINKED, f"{c.nlink} hard links: may be another file's name")
    return None


def other_user(c: Observed, policy: Policy) -> Decision | None:
    """Foreign when it is another user's and we are not root."""
    if c.uid != policy.effective_uid and not policy.is_root:
        return decision(State.FOREIGN, SharedReason.OTHER_USER,
                        f"owned by uid {c.uid}, we are uid {policy.effective_uid}")
    return None


def young(c: Observed, policy: Policy, now: float) -> Decision | None:
    """Young while it changed less than the grace age ago: a starting serve's state looks dead for a moment."""
    age = now - c.mtime
    if age < policy.grace:
        return decision(State.YOUNG, SharedReason.YOUNG,
                        f"changed {format_age(age)} ago, grace is {format_age(policy.grace)}")
    return None


def socket(c: Observed, serving: Sequence[int] | None, policy: Policy, now: float) -> Decision:
    """A socket node on its own evidence, passive only; `serving`: the PIDs of the listener a listing shows bound
    to this very file (by identity), None when no listing shows one.

    A stream connect would be a connection the listener sees (and kills
    upstream's, docs/NODE.md §3): sock_diag's listing, else the datagram bind
    test (sockdiag.bound), decides. A node that no socket is bound to can never
    serve again, whichever processes are alive.
    """
    if serving is not None:
        return decision(State.LIVE, SharedReason.LISTENING, "a listener is bound to this file", serving)
    if c.bind is Bind.BOUND:
        return BOUND
    if c.bind is None:
        return NOT_TESTED
    if c.bind is not Bind.UNBOUND:
        reason = SharedReason.BIND_DENIED if c.bind is Bind.DENIED else SharedReason.BIND_ERROR
        return decision(State.UNKNOWN, reason, f"could not test whether a socket is bound to it ({c.bind_errno})")
    return young(c, policy, now) or NOT_LISTENING


# How strongly a state keeps an entry: a group is kept as strongly as its most strongly kept member.
# Foreign is no evidence (and never raised): it has no rank.
KEEP_RANK = {State.STALE: 0, State.YOUNG: 1, State.UNKNOWN: 2, State.LIVE: 3}


class Member(Protocol):
    """What raising a group reads of a member: its path (the decisions' key) and its name (the detail)."""

    @property
    def path(self) -> str: ...
    @property
    def name(self) -> str: ...


M = TypeVar("M", bound=Member)


@dataclass(frozen=True)
class GroupRule(Generic[M]):
    """How one source keeps a group together.

    `reasons`: the raised decision's reason by the evidence's state; `detail`:
    its wording, from the strongest member and its decision; `counts`: whether
    a member's decision is evidence for the group (a directory's "live entry
    inside" only repeats its children); `raises`: whether a member's decision
    gives way to the group's evidence of rank `rank`.
    """

    reasons: Mapping[State, StrEnum]
    detail: Callable[[M, Decision], str]
    counts: Callable[[Decision], bool]
    raises: Callable[[M, Decision, int], bool]


def raise_groups(groups: Iterable[Sequence[M]], decisions: MutableMapping[str, Decision], rule: GroupRule[M]) -> None:
    """Let each group's strongest evidence keep its members (the first of the strongest, when several tie).

    A group with nothing stronger than stale evidence is left as it is.
    Decisions are replaced in place; every member raised shares one decision.
    """
    for members in groups:
        best: M | None = None
        best_rank = 0
        for m in members:
            d = decisions[m.path]
            rank = KEEP_RANK.get(d.state, -1)
            if rank > best_rank and rule.counts(d):
                best, best_rank = m, rank
        if best is None:
            continue
        ev = decisions[best.path]
        raised = decision(ev.state, rule.reasons[ev.state], rule.detail(best, ev), ev.pids)
        for m in members:
            if rule.raises(m, decisions[m.path], best_rank):
                decisions[m.path] = raised
