"""Plan and act on every place of the node (kvctl -A): one /proc pass, one maps pass, a plan per place.

Each place is judged by the same scans and decisions as the host (cleanup.plan
for kvcached's own state, the engines' scan and decide_engine for theirs),
with the facts and evidence as that place sees them (places/evidence.py),
and acted on by the one guarded act (cleanup.execute), inside that place
alone: every directory is re-opened through the path it was judged by and
must still be the directory judged, every entry re-identified before it goes.
Every candidate outside the host carries its place (`origin.place`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..base.enums import Action, EngineKind, State
from ..base.layout import Layout
from ..clean.decide import Policy
from ..clean.facts import Facts
from ..clean.report import Decision, Entry, Report, SourcePlan
from .discover import Place, Places, Seen, discover

if TYPE_CHECKING:
    from ..clean.cleanup import Plan
    from ..clean.leftovers import EnginePlan
    from ..clean.scan import Candidate


@dataclass
class PlacePlan:
    """One place's plans: kvcached's own state in it, the engines' leftovers in it (each None when not asked)."""

    place: Place
    plan: Plan | None = None
    engines: EnginePlan | None = None

    def sources(self) -> list[SourcePlan]:
        return [x for x in (self.plan, self.engines) if x is not None]

    def any_stale(self) -> bool:
        return any(d.state is State.STALE for x in self.sources() for _, d in x.entries())


@dataclass
class PlaceResult:
    """What a run did in one place: its report (every source's entries), None when nothing was asked there."""

    place: Place
    report: Report | None = None

    @property
    def failed(self) -> bool:
        return bool(self.report is not None and self.report.failures)

    @property
    def stale_left(self) -> bool:
        return bool(self.report is not None and self.report.stale_remaining)

    def stale_bytes(self) -> int:
        """What the dead engine leftovers here hold (removed or not): what the place gets back."""
        return 0 if self.report is None else self.report.bytes(state=State.STALE)

    def to_dict(self) -> dict[str, Any]:
        """The place as a document lists it, with what could not be read in it and what its dead ones hold."""
        errors = list(self.place.errors)
        if self.report is not None:
            errors += [e for e in self.report.errors if e not in errors]
        return {**self.place.to_dict(), "label": self.place.label, "errors": errors,
                "entries": len(self.report.entries) if self.report else 0,
                "stale_entries": self.report.count(state=State.STALE) if self.report else 0,
                "stale_bytes": self.stale_bytes()}


@dataclass
class PlacesPlan:
    """Every place's plan, the host's first, from one /proc pass."""

    places: Places
    plans: list[PlacePlan] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def any_stale(self) -> bool:
        return any(pp.any_stale() for pp in self.plans)

    @property
    def host(self) -> PlacePlan:
        return self.plans[0]


def _kvcached_names(layout: Layout, places: Places, facts: Facts) -> set[str]:
    """Every name kvcached ties to its state anywhere on the node: processes' IPC names, every /tmp's socket dirs."""
    from ..clean.leftovers.scan import kvcached_names

    names = kvcached_names(layout, facts)
    for pl in places.others:
        if pl.seen is Seen.TMP:
            names |= kvcached_names(pl.layout(layout), None)
    return names


def _in_place(c: Candidate, place: Place) -> Candidate:
    """The candidate, and everything below it, tagged with its place (`origin.place`)."""
    return c._replace(place=place, children=tuple(_in_place(x, place) for x in c.children))


def _plan_kvcached(place: Place, layout: Layout, places: Places, facts: Facts, policy: Policy,
                   names: Sequence[str], now: float, globs: Sequence[str] = (), kinds: Iterable[Any] = ()) -> Plan:
    """cleanup.plan of one place, with the facts as the place sees them; only entries on its own filesystem."""
    from ..clean.cleanup import plan
    from .evidence import place_facts

    here = place.layout(layout)
    if place.is_host:
        return plan(here, policy, facts=facts, names=names, globs=globs, kinds=kinds, now=now)
    p = plan(here, policy, facts=place_facts(facts, places, place), names=names, globs=globs, kinds=kinds, now=now)
    kept = [_in_place(c, place) for c in p.roots if c.ident[0] == place.dev]
    dropped = [f"{c.path}: not on the filesystem of {place.path}; not judged" for c in p.roots
               if c.ident[0] != place.dev]
    segments = {k: _in_place(c, place) for k, c in p.segments.items()}
    return replace(p, roots=kept, segments=segments, errors=p.errors + dropped)


def _plan_engines(plans: list[PlacePlan], layout: Layout, places: Places, facts: Facts, policy: Policy,
                  kinds: Iterable[EngineKind], rpc_dirs: Sequence[str], names: set[str], now: float,
                  proc_root: str) -> None:
    """Every place's engine plan: one scan each, the evidence gathered once for all of them, a decision per entry."""
    from ..clean.leftovers import EnginePlan, decide_engine, gather_engine_evidence, scan_engine_state, settle_groups
    from ..clean.leftovers.families import Evidence
    from .evidence import creators, for_place

    scans = []
    for pp in plans:
        pl = pp.place
        found = scan_engine_state(pl.layout(layout), facts, rpc_dirs if pl.is_host else (), kvcached=names,
                                  dev=pl.dev)
        if not pl.is_host:
            found.candidates = [c._replace(place=pl) for c in found.candidates]
        scans.append(found)
    everything = [c for s in scans for c in s.candidates]
    base = gather_engine_evidence(facts, everything, is_root=policy.is_root, proc_root=proc_root)
    named = {c.creator_pid for c in everything if c.family.evidence is Evidence.CREATOR and c.creator_pid is not None}
    by_place = creators(facts, places, named)
    kind_set = set(kinds)
    for pp, found in zip(plans, scans):
        ev = for_place(base, pp.place, by_place)
        decisions = {c.path: decide_engine(c, ev, policy, now) for c in found.candidates}
        settle_groups(found.candidates, decisions)
        chosen = [c for c in found.candidates if not kind_set or c.kind in kind_set]
        errors = found.errors + (facts.errors if pp.place.is_host else [])
        pp.engines = EnginePlan(pp.place.layout(layout), facts, policy, now, chosen, decisions, errors,
                                len(found.candidates))


def plan_places(layout: Layout, policy: Policy, facts: Facts, *, kvcached: bool = True, engines: bool = False,
                engine_kinds: Iterable[EngineKind] = (), rpc_dirs: Sequence[str] = (), kubelet_dir: str | None = None,
                host_plan: Plan | None = None, now: float | None = None, proc_root: str = "/proc",
                names: Sequence[str] = (), kinds: Iterable[Any] = ()) -> PlacesPlan:
    """Find every place (discover) and plan each, host first; no side effects.

    `host_plan`: the host's kvcached plan the caller already made from the
    same facts (gc's, which also finds orphans), used as it is. `names`
    (exact names or globs) and `kinds` filter kvcached's entries as gc's do.
    """
    t = time.time() if now is None else now
    places = discover(facts, layout, kubelet_dir=kubelet_dir)
    out = PlacesPlan(places, [PlacePlan(pl) for pl in places.all()], list(places.errors))
    every = _kvcached_names(layout, places, facts)
    if kvcached:
        exact = [n for n in names if not any(ch in n for ch in "*?[")]
        # A segment's name is tied to kvcached by a socket directory that may sit in another place (a
        # container's /tmp and /dev/shm are two filesystems): every place's names count in every place.
        extra = sorted(every | set(exact))
        kinds = tuple(kinds)
        for pp in out.plans:
            pp.plan = host_plan if (pp.place.is_host and host_plan is not None) else \
                _plan_kvcached(pp.place, layout, places, facts, policy, extra, t, list(names), kinds)
    if engines:
        _plan_engines(out.plans, layout, places, facts, policy, engine_kinds, rpc_dirs, every, t, proc_root)
    return out


def _same_directory(place: Place) -> str | None:
    """Why the place may not be acted in now (its directory is gone or another one), None: it may."""
    if place.is_host:
        return None
    try:
        st = os.stat(place.path, follow_symlinks=False)
    except OSError as e:
        return f"{place.path}: {e.strerror}"
    if st.st_dev != place.dev or (place.ino is not None and st.st_ino != place.ino):
        return f"{place.path}: no longer the filesystem judged"
    return None


def _kept(p: Any, why: str) -> Any:
    """The plan with nothing stale left to act on: its place moved since the judgement (unknown: kept)."""
    from ..clean.rules import SharedReason

    decisions = {k: Decision(State.UNKNOWN, SharedReason.NOT_TESTED, f"{d.detail}; {why}", d.pids)
                 if d.state is State.STALE
                 else d for k, d in p.decisions.items()}
    return replace(p, decisions=decisions, errors=p.errors + [why])


def execute_places(pp: PlacesPlan, *, dry_run: bool, deadline: Callable[[], float | None] = lambda: None,
                   progress: Callable[[Any], None] | None = None, skip_host: bool = False) -> list[PlaceResult]:
    """Act on every place's stale entries, each inside its place; `skip_host`: the caller acts on the host's."""
    from ..clean.cleanup import execute

    out = []
    for plan in pp.plans:
        if skip_host and plan.place.is_host:
            continue
        res = PlaceResult(plan.place)
        sources = plan.sources()
        if sources:
            moved = _same_directory(plan.place)
            if moved is not None:
                sources = [_kept(x, moved) for x in sources]
            res.report = execute(*sources, dry_run=dry_run, time_limit=deadline(), progress=progress)
        out.append(res)
    return out


def would_remove(results: Iterable[PlaceResult]) -> int:
    """How many entries of these places a run removed or would remove."""
    return sum(r.report.count(action=Action.REMOVED) + r.report.count(action=Action.WOULD_REMOVE)
               for r in results if r.report is not None)


@dataclass
class PlaceView:
    """One place as inspect -A shows it: its deployments (a NodeView of its own plan) and its engine leftovers."""

    place: Place
    view: Any = None                      # view.NodeView, or None when kvcached's state was not asked for
    engines: list[Entry[Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def stale_bytes(self) -> int:
        """What the dead engine leftovers here hold."""
        return sum(e.bytes for e in self.engines if e.state is State.STALE)

    def to_dict(self) -> dict[str, Any]:
        stale = sum(e.state is State.STALE for e in self.engines)
        deployments = self.view.deployments if self.view is not None else []
        if self.view is not None:
            stale += sum(e.state is State.STALE for d in deployments for e in d.entries)
        return {**self.place.to_dict(), "label": self.place.label, "errors": list(self.errors),
                "deployments": len(deployments), "entries": len(self.engines)
                + sum(len(d.entries) for d in deployments), "stale_entries": stale, "stale_bytes": self.stale_bytes()}


def view_places(pp: PlacesPlan, host_view: Any, build_view: Callable[[Plan], Any]) -> list[PlaceView]:
    """inspect -A: every place's view, host first (`host_view`: the host's NodeView; `build_view`: how the
    caller groups a plan into deployments, ops.view's, which sits a room above this one)."""
    from ..clean.report import preview

    out = []
    for plan in pp.plans:
        if plan.place.is_host:
            view = host_view
        else:
            view = build_view(plan.plan) if plan.plan is not None else None
        errors = list(plan.place.errors)
        for part in plan.sources():
            if not plan.place.is_host:
                errors += [e for e in part.errors if e not in errors]
        if plan.place.is_host:
            errors += [e for e in pp.errors if e not in errors]
        out.append(PlaceView(plan.place, view, preview(plan.engines) if plan.engines is not None else [], errors))
    return out
