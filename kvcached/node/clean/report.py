"""The cleaner's one pipeline and its types: where an entry came from, what was decided, what was done, the report.

Every piece of state the cleaner judges, kvcached's own or an engine's
leftover, goes through the same types and the same code (docs/CLEANER.md §3);
what differs is where it came from (`Origin`, data on every entry) and which
evidence applies (each source's scan, facts and reasons).

Sources (`Source`), each a scan and a pure decision behind one plan type:

- kvcached: scan.py (segments, socket directories) → facts.py (one /proc
  pass) → decide.py (`decide_tree`, then `settle`: a deployment's evidence is
  shared) → cleanup.plan, a `Plan`.
- engines: leftovers/scan.py (the families' names in /dev/shm and the RPC
  directories) → leftovers/evidence.py (the same Facts, plus the maps pass)
  → leftovers/decide.py (`decide_engine`, then `settle_groups`: each entry on
  its own evidence) → leftovers/act.plan_engines, an `EnginePlan`.

What both decisions share (the foreign checks, the socket decision, the
grace age, raising a group) is rules.py's. Both plans are
cleanup.SourcePlan's: `source`, `facts`, `policy`, `errors`, `entries()`
(each judged candidate with its `Decision`), and `act(actor)`, which walks
the plan in its own order (kvcached: segments before the socket directories
that name them; engines: each entry alone) and hands every entry to the one
guarded act. A run that wants both passes one Facts to both plans.

The one guarded act is cleanup.Actor, driven by cleanup.execute(*plans):
each directory opened once per run (its identity compared with the scan's
where the scan recorded one), each entry re-opened without following and its
identity re-checked before unlinkat through the directory fd
(ident.unlink_if_same); dry run is one guard at that syscall; ENOENT is
success ("already gone"); it keeps going and reports every entry, the first
error included, as kept or failed. A source adds only its own re-checks
(kvcached: the segment's lease and flock, the directory lease; engines: owner,
link count and type, an flock).

The types, here so that what only reads a report (kvctl's output, metrics,
gc on a node with nothing to judge, which makes an empty one) imports no
scan, /proc pass or decision:

- `Origin(source, family)`: where an entry came from; kvcached's entries all
  share `KVCACHED`, an engine entry's names its family
  (leftovers/families.Family). `place` (kvctl -A, base/place.Place: a mount
  namespace, a pod volume, a sandbox shm) is where the entry is, None
  meaning this node's own /tmp and /dev/shm; a candidate carries it, and
  each place's plans are acted on into a report of their own
  (places/run.py).
- `Decision(state, reason, detail, pids)`: the one decision type; `reason`
  is rules.SharedReason or the source's own vocabulary (decide.Reason,
  leftovers.decide.EngineReason), which the JSON schemas list per entry type.
- `Entry(candidate, decision, action, note)`: the one entry type, whatever
  the candidate (scan.Candidate, leftovers.scan.EngineCandidate: both carry
  `origin`, `kind`, `path`); `to_dict` writes the fields of its source's
  schema (kvctl/schemas/gc.json's entry, engine_entry.json).
- `Report`: one run's entries, each source's in one contiguous `Part`
  (errors, timing, time limit), so that `part(source)` is a slice, and
  `summary()` is gc.json's summary: the counts of all, each further source's
  own summary under its name (`engines`). The engine owner's cleanup reports
  in it too, with what it must come back for (`pending`).

Callers: gcrun (kvctl gc and delete), sweep (the runtime's start-up sweep),
startup, captured and captured_buffers (the engine owner's cleanup), view
(inspect: cleanup.preview), metrics and diagnostics read plans and reports;
kvctl renders one report, section by section (kvctl/render_sources.py).
"""

# No `from __future__ import annotations`: a NamedTuple's string annotations are each compiled at
# class creation (typing.ForwardRef), a cost every kvctl start pays (bench/bench_cli_start.py).
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, Protocol, TypeVar

from ..base.enums import ENGINE_OF, Action, Engine, EngineKind, Kind, State, StrEnum
from ..base.place import Place

if TYPE_CHECKING:  # it imports nothing of the pipeline: report.py stays below the scans, decisions and act
    from .leftovers.families import Family


class Source(StrEnum):
    """Which scan and decision judged an entry."""

    KVCACHED = "kvcached"  # kvcached's own segments and socket directories
    ENGINES = "engines"    # the engines' leftovers, by family (vLLM, SGLang, NCCL, CUDA)


class Origin(NamedTuple):
    """Where an entry came from: its source, for an engine's leftover the family whose name it carries, and
    with kvctl -A the place it is in (None: this node's own /tmp and /dev/shm)."""

    source: Source
    family: "Family | None" = None
    place: Place | None = None

    @property
    def engine(self) -> Engine | None:
        return None if self.family is None else self.family.engine


KVCACHED = Origin(Source.KVCACHED)

# Every kind to the source that makes it: a count by source is a count by kinds.
SOURCE_OF: dict[Kind | EngineKind, Source] = {**{k: Source.KVCACHED for k in Kind},
                                               **{k: Source.ENGINES for k in EngineKind}}


class Decision(NamedTuple):
    """What a decision found: a state, the reason (the source's own vocabulary), its detail, the PIDs it rests on.

    Immutable, and a NamedTuple for the reason Candidate is one: a frozen dataclass is slow to build, and slow
    to define at a cold start (bench/README.md).
    """

    state: State
    reason: StrEnum
    detail: str
    pids: tuple[int, ...] = ()


class Judged(Protocol):
    """What the pipeline reads of any source's candidate."""

    @property
    def origin(self) -> Origin: ...
    @property
    def kind(self) -> Kind | EngineKind: ...
    @property
    def path(self) -> str: ...
    @property
    def name(self) -> str: ...


C = TypeVar("C", bound=Judged)


class Entry(NamedTuple, Generic[C]):
    """One reported piece of state: what it is, what we decided, what we did.

    Immutable, and a NamedTuple for the reason Candidate is one: a run reports
    every entry of the node.
    """

    candidate: C
    decision: Decision
    action: Action
    note: str = ""  # why the act differed from the plan, or the error

    @property
    def kind(self) -> Kind | EngineKind:
        return self.candidate.kind

    @property
    def path(self) -> str:
        return self.candidate.path

    @property
    def state(self) -> State:
        return self.decision.state

    @property
    def origin(self) -> Origin:
        return self.candidate.origin

    @property
    def engine(self) -> Engine | None:
        """Whose leftover it is (None: kvcached's own)."""
        return ENGINE_OF.get(self.candidate.kind)

    @property
    def bytes(self) -> int:
        """The memory or disk an engine's leftover really holds (kvcached's entries: 0, none is counted)."""
        return getattr(self.candidate, "allocated", 0)

    def to_dict(self) -> dict[str, object]:
        """The entry as JSON reports print it: gc.json's entry, or engine_entry.json for an engine's leftover."""
        c: Any = self.candidate
        d = self.decision
        detail = d.detail + (f"; {self.note}" if self.note else "")
        if c.origin.source is Source.KVCACHED:
            # _value_, not str(): str() of a member goes through Python-level enum code, five times an entry.
            return {
                "kind": c.kind._value_, "path": c.path, "deployment": c.deployment,
                "state": d.state._value_, "action": self.action._value_, "reason": d.reason._value_,
                "detail": detail, "pids": list(d.pids), "rank": c.rank, "stage": c.stage,
                "uid": c.uid, "mtime": c.mtime, "type": c.ftype._value_,
            }
        return {
            "kind": str(c.kind), "engine": str(c.engine), "path": c.path, "deployment": None,
            "state": str(d.state), "action": str(self.action), "reason": str(d.reason), "detail": detail,
            "pids": list(d.pids), "rank": None, "stage": None, "uid": c.uid, "mtime": c.mtime, "type": str(c.ftype),
            "bytes": c.allocated, "size": c.size, "creator_pid": c.creator_pid,
        }


class Part(NamedTuple):
    """One source's share of a report: its entries are `Report.entries[start:end]`."""

    source: Source
    start: int
    end: int
    errors: tuple[str, ...]
    started: float
    finished: float
    timed_out: bool = False


_Key = tuple[State, Action, "Kind | EngineKind"]


@dataclass(kw_only=True)
class Report:
    """One run's entries of every source it judged, in the order acted on, and how the run went."""

    dry_run: bool
    entries: list[Entry[Any]]
    errors: list[str]
    started: float
    finished: float
    timed_out: bool = False
    parts: tuple[Part, ...] = ()  # none: every entry is kvcached's (a report made by hand, delete's, an empty one)
    # What the caller must come back for, and why (the engine owner's cleanup: a captured entry still served)
    pending: tuple[tuple[str, str], ...] = ()
    # (state, action, kind) -> entries, counted on the first question: summaries and metrics ask dozens
    _counts: Counter[_Key] | None = field(default=None, init=False, repr=False, compare=False)

    @cached_property
    def _parts(self) -> tuple[Part, ...]:
        return self.parts or (Part(Source.KVCACHED, 0, len(self.entries), tuple(self.errors), self.started,
                                   self.finished, self.timed_out),)

    @property
    def sources(self) -> tuple[Source, ...]:
        """The sources this run judged, in order (a source that found nothing is still one: it looked)."""
        return tuple(p.source for p in self._parts)

    def part(self, source: Source) -> "Report | None":
        """The entries of one source as a report of their own (None: the run did not judge that source)."""
        for p in self._parts:
            if p.source is source:
                if len(self._parts) == 1:
                    return self
                return Report(dry_run=self.dry_run, entries=self.entries[p.start:p.end], errors=list(p.errors),
                              started=p.started, finished=p.finished, timed_out=p.timed_out,
                              parts=(p._replace(start=0, end=p.end - p.start),))
        return None

    def _tally(self) -> Counter[_Key]:
        counts = self._counts
        if counts is None:
            counts = self._counts = Counter((e.decision.state, e.action, e.candidate.kind) for e in self.entries)
        return counts

    def count(self, *, state: State | None = None, action: Action | None = None,
              kind: Kind | EngineKind | None = None, source: Source | None = None,
              engine: Engine | None = None) -> int:
        """How many entries have the given state, action, kind, source and engine (None: any)."""
        return sum(n for (s, a, k), n in self._tally().items()
                   if (state is None or s is state) and (action is None or a is action) and (kind is None or k is kind)
                   and (source is None or SOURCE_OF[k] is source) and (engine is None or ENGINE_OF.get(k) is engine))

    @cached_property
    def _byte_counts(self) -> Counter[tuple[State, Action, Engine]]:
        out: Counter[tuple[State, Action, Engine]] = Counter()
        for p in self._parts:
            if p.source is Source.KVCACHED:
                continue  # kvcached's entries hold 24 bytes or nothing: no source of ours counts them
            for e in self.entries[p.start:p.end]:
                out[e.decision.state, e.action, e.candidate.engine] += e.candidate.allocated
        return out

    def bytes(self, *, state: State | None = None, action: Action | None = None, engine: Engine | None = None) -> int:
        """How many bytes the engines' leftovers among those entries hold."""
        return sum(n for (s, a, g), n in self._byte_counts.items()
                   if (state is None or s is state) and (action is None or a is action)
                   and (engine is None or g is engine))

    @property
    def complete(self) -> bool:
        """Nothing is left to come back for (`pending`)."""
        return not self.pending

    @property
    def removed(self) -> tuple[str, ...]:
        """The paths removed (or found already gone), in the order acted on."""
        return tuple(e.path for e in self.entries if e.action is Action.REMOVED)

    @property
    def kept(self) -> tuple[tuple[str, str], ...]:
        """(path, why) of everything kept: each entry kept (its state, the decision's detail, the act's note),
        then what is pending without an entry of its own."""
        out = [(e.path, f"{e.state}: {e.decision.detail}" + (f"; {e.note}" if e.note else ""))
               for e in self.entries if e.action is Action.KEPT]
        if self.pending:
            seen = {e.path for e in self.entries}
            out += [(path, why) for path, why in self.pending if path not in seen]
        return tuple(out)

    @property
    def failures(self) -> list[Entry[Any]]:
        if not self.count(action=Action.FAILED):
            return []  # the usual answer, from the counts a summary takes anyway: no pass over every entry
        return [e for e in self.entries if e.action is Action.FAILED]

    @property
    def stale_remaining(self) -> list[Entry[Any]]:
        if self.count(state=State.STALE) == self.count(state=State.STALE, action=Action.REMOVED):
            return []  # as failures: a gc asks four times, and after a clean run every entry would be read
        return [e for e in self.entries if e.state is State.STALE and e.action is not Action.REMOVED]

    def summary(self) -> dict[str, object]:
        """Counts by state and action (and bytes, for the engines' alone); each further source's under its name."""
        out: dict[str, object] = {"entries": len(self.entries), "states": {str(s): self.count(state=s) for s in State},
                                  "actions": {str(a): self.count(action=a) for a in Action}}
        if self.sources == (Source.ENGINES,):
            # What the dead ones hold is what an operator gets back.
            out.update(bytes={str(s): self.bytes(state=s) for s in State},
                       removed_bytes=self.bytes(action=Action.REMOVED))
        out.update(errors=len(self.errors), timed_out=self.timed_out, seconds=round(self.finished - self.started, 4))
        if len(self._parts) > 1:
            for p in self._parts:
                sub = self.part(p.source)
                if p.source is not Source.KVCACHED and sub is not None:
                    out[str(p.source)] = sub.summary()
        return out


def merged_errors(parts: Iterable[Part]) -> list[str]:
    """Every part's errors once: sources that read one /proc pass report its errors each."""
    return list(dict.fromkeys(err for p in parts for err in p.errors))
