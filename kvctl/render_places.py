"""kvctl -A's text: the host first, then each pod, container or volume, under a heading that names it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .render import Out, render_view

if TYPE_CHECKING:
    from kvcached.node import GcResult, Place, PlaceResult


def _heading(out: Out, place: Place, stale_bytes: int, stale: int, result: PlaceResult | None = None) -> None:
    from kvcached.node import format_size

    dead = f": {stale} stale" if stale else ""
    if stale_bytes:
        dead += f", {format_size(stale_bytes)} held by dead engine leftovers"
    out.line((f"== {place.label}", "bold"), dead)
    if result is not None:
        _fill_lines(out, result)


def _fill_lines(out: Out, result: PlaceResult) -> None:
    """The place's use as a percentage of its size, what fills it by kind, and its largest entries."""
    from kvcached.node import fill_summary, format_size, largest_summary

    w = result.what_fills()
    if w is None:
        return
    f = w.fill
    pct = f.percent
    if pct is None:
        out.line("fill: ", ("unknown", "yellow"), f" ({f.error})" if f.error else "", indent=3)
        return
    from kvcached import settings

    style = ("red" if pct >= settings.KVCTL_CAPACITY_FAIL.get() else
             "yellow" if pct >= settings.KVCTL_CAPACITY_WARN.get() else "green")
    out.line("fill: ", (f"{pct:.0f}%", style), f" of {format_size(f.capacity_bytes)} used "
             f"({format_size(f.used_bytes)}): {fill_summary(w)}", indent=3)
    if w.largest:
        out.line("largest: ", largest_summary(w.largest), indent=3)


def _with_all(hint: Callable[[str], str]) -> Callable[[str], str]:
    """The hints name the command that reaches the place: -A for every place but the host's."""
    return lambda c: hint(c.replace("gc ", "gc -A ", 1) if c.startswith("gc ") else c)


def render_places_view(out: Out, places: Sequence[PlaceResult], *, now: float, hint: Callable[[str], str]) -> None:
    """inspect -A: each place (the face's PlaceResult), its deployments and engine leftovers, what could not be
    read."""
    from .render_sources import render_engine_view

    for i, pv in enumerate(places):
        if i:
            out.blank()
        d = pv.to_dict()
        _heading(out, pv.place, d["stale_bytes"], d["stale_entries"], pv)
        here = hint if pv.place.is_host else _with_all(hint)
        if pv.view is not None and (pv.place.is_host or pv.view.deployments or pv.view.unowned):
            render_view(out, pv.view, now=now, hint=here)
        engines = pv.engine_entries()
        if engines:
            out.blank()
            render_engine_view(out, engines, hint=here)
        for err in pv.all_errors():
            out.line(("could not read: ", "yellow"), err)
    found = len(places) - 1
    out.blank()
    out.line(f"{found} place{'' if found == 1 else 's'} besides the host's")


def render_places_report(out: Out, result: GcResult, *, verbose: bool, terminal: bool, summary: bool = True) -> None:
    """gc -A: the host's report, then each other place's (kvcached's entries, then the engines')."""
    from .render_sources import render_run

    for i, r in enumerate(result.places):
        if i:
            out.blank()
        d = r.to_dict()
        _heading(out, r.place, d["stale_bytes"], d["stale_entries"])
        if r.report is not None and (r.place.is_host or r.report.entries):
            render_run(out, r.report, verbose=verbose, grouped=terminal, summary=summary)
    for err in result.place_errors:
        out.line(("could not read: ", "yellow"), err)


def render_places_preview(out: Out, places: Sequence[PlaceResult], *, verbose: bool) -> None:
    """gc -A's question: what each other place's dry run would remove, under its heading."""
    from .render_sources import render_run

    for r in places:
        if r.report is None or not r.report.entries:
            continue
        out.blank()
        d = r.to_dict()
        _heading(out, r.place, d["stale_bytes"], d["stale_entries"])
        render_run(out, r.report, verbose=verbose, grouped=True)


def places_summary_line(result: GcResult) -> str:
    """`places: 6 besides the host's, removed 7 (260K) in 4`: gc -A's other places in one line (--every)."""
    from kvcached.node import Action, format_size

    gone = Action.WOULD_REMOVE if result.dry_run else Action.REMOVED
    places = result.others
    n = acted = held = 0
    for r in places:
        here = r.report.count(action=gone) if r.report is not None else 0
        n += here
        acted += bool(here)
        held += r.report.bytes(action=gone) if r.report is not None else 0
    verb = "would remove" if result.dry_run else "removed"
    return f"places: {len(places)} besides the host's, {verb} {n}" + (
        f" ({format_size(held)}) in {acted}" if n else "")


def log_places(result: GcResult) -> None:
    """What cron must see of gc -A's other places: each one's failures and summary, where it had entries."""
    from .render_sources import log_run

    for r in result.others:
        if r.report is not None and r.report.entries:
            log_run(r.report, f"kvctl gc -A [{r.place.label}]")
