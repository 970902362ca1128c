"""One place of a run, whatever the run: its plans, what was done there, and how inspect shows it (`PlaceResult`).

gc and inspect, with -A or without, see the node as a list of places, the
host's first (without -A, the host alone): gc's result (gcrun.GcResult) holds
each place's plans and report, inspect's (view.view_places) each place's plans
and view. `judge_place` plans and acts on ONE place: a round of gc is it over
every place (with the operator's question between the plans and the acts,
gcrun.run_gc), and a place alone (one an event touched) is one call.
`view_places` is inspect -A's list.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

from ..base.enums import Action, State

if TYPE_CHECKING:
    from ..base.place import Place
    from ..clean.cleanup import Plan
    from ..clean.report import Entry, Report
    from ..places.fill import Fill, WhatFills
    from ..places.run import PlacePlan, PlacesPlan, Scope
    from .view import NodeView


class PlaceResult(NamedTuple):
    """One place of a run: its plans (`plan`), what gc did there (`report`: None when nothing was asked there
    or nothing acted yet), and inspect's view of its deployments (`view`: None but for inspect).

    A NamedTuple, as places.run's types: a gc with nothing to judge builds the host's.
    """

    plan: PlacePlan
    report: Report | None = None
    view: NodeView | None = None
    errors: tuple[str, ...] = ()  # inspect's host: what could not be read while finding the places
    fill: Fill | None = None  # its filesystem's size and use, measured after the act (places/fill.py)

    @property
    def place(self) -> Place:
        return self.plan.place

    @property
    def failed(self) -> bool:
        return bool(self.report is not None and self.report.failures)

    @property
    def stale_left(self) -> bool:
        return bool(self.report is not None and self.report.stale_remaining)

    def engine_entries(self) -> list[Entry[Any]]:
        """The engines' leftovers here: as acted on (the report's), else as planned (inspect: would remove or kept)."""
        from ..clean.report import Source

        if self.report is not None:
            part = self.report.part(Source.ENGINES)
            return part.entries if part is not None else []
        if self.plan.engines is None:
            return []
        from ..clean.cleanup import preview

        return preview(self.plan.engines)

    def stale_bytes(self) -> int:
        """What the dead engine leftovers here hold (removed or not): what the place gets back."""
        if self.report is not None:
            return self.report.bytes(state=State.STALE)
        return sum(e.bytes for e in self.engine_entries() if e.state is State.STALE)

    def what_fills(self) -> WhatFills | None:
        """Its fill and what makes it up: the engines' leftovers still there, by kind, and the largest."""
        if self.fill is None:
            return None
        from ..places.fill import what_fills

        return what_fills(self.fill, self.engine_entries())

    def all_errors(self) -> list[str]:
        """What could not be read about the place and in what was done there, each once.

        gc: the place's, then its report's (every part's, the plans' own
        included). inspect: the place's, then its plans' (the host's plans
        speak in the host's own view), then `errors` (the host: finding places).
        """
        out = list(self.place.errors)
        if self.report is not None:
            more: Iterable[str] = self.report.errors
        elif self.place.is_host:
            more = ()
        else:
            more = [e for part in self.plan.sources() for e in part.errors]
        for e in (*more, *self.errors):
            if e not in out:
                out.append(e)
        return out

    def to_dict(self) -> dict[str, Any]:
        """The place as a document lists it: what could not be read in it, what it holds and what its dead ones
        hold; inspect's (no report: a view) also counts its deployments."""
        place = self.place
        out: dict[str, Any] = {**place.to_dict(), "label": place.label, "errors": self.all_errors()}
        fills = self.what_fills()
        out.update(fills.to_dict() if fills is not None else _UNMEASURED)
        report = self.report
        if report is not None:
            return {**out, "entries": len(report.entries), "stale_entries": report.count(state=State.STALE),
                    "stale_bytes": self.stale_bytes()}
        engines = self.engine_entries()
        deployments = self.view.deployments if self.view is not None else []
        stale = sum(e.state is State.STALE for e in engines)
        stale += sum(e.state is State.STALE for d in deployments for e in d.entries)
        return {**out, "deployments": len(deployments),
                "entries": len(engines) + sum(len(d.entries) for d in deployments), "stale_entries": stale,
                "stale_bytes": self.stale_bytes()}


# A place whose fill was not measured (gc's shortcut when nothing could be judged) says so with nulls.
_UNMEASURED: dict[str, Any] = {"capacity_bytes": None, "used_bytes": None, "used_percent": None,
                               "capacity_error": None, "fills": None}


def act(plan: PlacePlan, *, dry_run: bool, time_limit: float | None = None,
        progress: Callable[[Entry[Any]], None] | None = None) -> PlaceResult:
    """The guarded act inside one planned place (places.run.act_place), as that place's result."""
    from ..places.fill import measure
    from ..places.run import act_place

    report = act_place(plan, dry_run=dry_run, time_limit=time_limit, progress=progress)
    return PlaceResult(plan, report, fill=measure(plan.place))


def judge_place(place: Place, scope: Scope, *, dry_run: bool, time_limit: float | None = None,
                host_plan: Plan | None = None, progress: Callable[[Entry[Any]], None] | None = None) -> PlaceResult:
    """Plan and act on one place, as the scope asks: what a round does for each place, for one place alone."""
    from ..places.run import plan_place

    return act(plan_place(place, scope, host_plan), dry_run=dry_run, time_limit=time_limit, progress=progress)


def would_remove(results: Iterable[PlaceResult]) -> int:
    """How many entries of these places a run removed or would remove."""
    return sum(r.report.count(action=Action.REMOVED) + r.report.count(action=Action.WOULD_REMOVE)
               for r in results if r.report is not None)


def view_places(pp: PlacesPlan, host_view: NodeView) -> list[PlaceResult]:
    """inspect -A: every place's plans and view, the host's first (`host_view`: the host's NodeView, made from the
    plan every place's evidence came from)."""
    from ..places.fill import measure
    from .view import build_view

    out = []
    for plan in pp.plans:
        if plan.place.is_host:
            out.append(PlaceResult(plan, view=host_view, errors=tuple(pp.errors), fill=measure(plan.place)))
        else:
            view = build_view(plan.plan, namespaces=False) if plan.plan is not None else None
            out.append(PlaceResult(plan, view=view, fill=measure(plan.place)))
    return out
