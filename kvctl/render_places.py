"""kvctl -A's text: the host first, then each pod, container or volume, under a heading that names it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .render import Out, render_report, render_view


def _heading(out: Out, place: Any, stale_bytes: int, stale: int) -> None:
    from kvcached.node.units import format_size

    dead = f": {stale} stale" if stale else ""
    if stale_bytes:
        dead += f", {format_size(stale_bytes)} held by dead engine leftovers"
    out.line((f"== {place.label}", "bold"), dead)


def render_places_view(out: Out, places: Sequence[Any], *, now: float, hint: Callable[[str], str]) -> None:
    """inspect -A: each place (places.run.PlaceView), its deployments and engine leftovers, what could not be read."""
    from .render_engines import render_engine_view

    for i, pv in enumerate(places):
        if i:
            out.blank()
        d = pv.to_dict()
        _heading(out, pv.place, d["stale_bytes"], d["stale_entries"])
        # The hints name the command that reaches the place: -A for every place but the host's.
        here = hint if pv.place.is_host else _with_all(hint)
        if pv.view is not None and (pv.place.is_host or pv.view.deployments or pv.view.unowned):
            render_view(out, pv.view, now=now, hint=here)
        if pv.engines:
            out.blank()
            render_engine_view(out, pv.engines, hint=here)
        for err in pv.errors:
            out.line(("could not read: ", "yellow"), err)
    found = len(places) - 1
    out.blank()
    out.line(f"{found} place{'' if found == 1 else 's'} besides the host's")


def _with_all(hint: Callable[[str], str]) -> Callable[[str], str]:
    return lambda c: hint(c.replace("gc ", "gc -A ", 1) if c.startswith("gc ") else c)


def render_places_report(out: Out, result: Any, *, verbose: bool, terminal: bool) -> None:
    """gc -A: the host's report, then each other place's (kvcached's entries, then the engines')."""
    from kvcached.node.places.run import PlaceResult

    from .render_engines import render_engine_report

    host = PlaceResult(_host(), result.report, result.engines)
    for i, r in enumerate([host, *(result.places or ())]):
        if i:
            out.blank()
        d = r.to_dict()
        _heading(out, r.place, d["stale_bytes"], d["stale_entries"])
        if r.report is not None and (r.place.is_host or r.report.entries):
            render_report(out, r.report, verbose=verbose, by_deployment=terminal)
        if r.engines is not None and (r.place.is_host or r.engines.entries):
            render_engine_report(out, r.engines, verbose=verbose, by_engine=terminal)
    for err in result.place_errors:
        out.line(("could not read: ", "yellow"), err)


def _host() -> Any:
    from kvcached.node.places.discover import HOST

    return HOST
