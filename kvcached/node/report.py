"""What a cleanup run reports: an entry per piece of state (what it is, what was decided, what was done).

Apart from the engine (cleanup.py) that makes reports, so that what only reads
one (kvctl's output, the metrics, a gc on a node with nothing to judge, which
makes an empty one) imports no scan, /proc pass or decision.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from .enums import Action, Kind, State

if TYPE_CHECKING:
    from .decide import Decision
    from .scan import Candidate


class Entry(NamedTuple):
    """One reported piece of state: what it is, what we decided, what we did.

    Immutable, and a NamedTuple for the reason Candidate is one: a run reports
    every entry of the node.
    """

    candidate: Candidate
    decision: Decision
    action: Action
    note: str = ""  # why the act differed from the plan, or the error

    @property
    def kind(self) -> Kind:
        return self.candidate.kind

    @property
    def path(self) -> str:
        return self.candidate.path

    @property
    def state(self) -> State:
        return self.decision.state

    def to_dict(self) -> dict[str, object]:
        c, d = self.candidate, self.decision
        # _value_, not str(): str() of a member goes through Python-level enum code, five times an entry.
        return {
            "kind": c.kind._value_, "path": c.path, "deployment": c.deployment,
            "state": d.state._value_, "action": self.action._value_, "reason": d.reason._value_,
            "detail": d.detail + (f"; {self.note}" if self.note else ""),
            "pids": list(d.pids), "rank": c.rank, "stage": c.stage,
            "uid": c.uid, "mtime": c.mtime, "type": c.ftype._value_,
        }


@dataclass(kw_only=True)
class Report:
    dry_run: bool
    entries: list[Entry]
    errors: list[str]
    started: float
    finished: float
    timed_out: bool = False
    # (state, action, kind) -> entries, counted on the first question: summaries and metrics ask dozens
    _counts: Counter[tuple[State, Action, Kind]] | None = field(default=None, init=False, repr=False,
                                                              compare=False)

    def count(self, *, state: State | None = None, action: Action | None = None, kind: Kind | None = None) -> int:
        """How many entries have the given state, action and kind (None: any)."""
        counts = self._counts
        if counts is None:
            counts = self._counts = Counter((e.decision.state, e.action, e.candidate.kind) for e in self.entries)
        return sum(n for (s, a, k), n in counts.items()
                   if (state is None or s is state) and (action is None or a is action) and (kind is None or k is kind))

    @property
    def failures(self) -> list[Entry]:
        if not self.count(action=Action.FAILED):
            return []  # the usual answer, from the counts a summary takes anyway: no pass over every entry
        return [e for e in self.entries if e.action is Action.FAILED]

    @property
    def stale_remaining(self) -> list[Entry]:
        if self.count(state=State.STALE) == self.count(state=State.STALE, action=Action.REMOVED):
            return []  # as failures: a gc asks four times, and after a clean run every entry would be read
        return [e for e in self.entries if e.state is State.STALE and e.action is not Action.REMOVED]

    def summary(self) -> dict[str, object]:
        by_state = {str(s): self.count(state=s) for s in State}
        by_action = {str(a): self.count(action=a) for a in Action}
        return {"entries": len(self.entries), "states": by_state, "actions": by_action,
                "errors": len(self.errors), "timed_out": self.timed_out,
                "seconds": round(self.finished - self.started, 4)}
