"""What doctor's `pods` and `capacity` checks read: each place with dead leftovers, and each place's fill."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from ..base.enums import State
from ..base.layout import Layout
from ..clean.decide import Policy
from ..clean.facts import Facts
from .discover import Place

if TYPE_CHECKING:
    from ..clean.cleanup import Plan
    from .fill import WhatFills
    from .run import PlacesPlan

# (status, summary, fix, details): diagnostics.py makes each a CheckResult (as gpu/doctor.py's).
Finding = tuple[str, str, "str | None", dict[str, Any]]


class Measured(Protocol):
    """A place whose fill was measured: what the capacity check reads of one (ops.rounds.PlaceResult is one)."""

    @property
    def place(self) -> Place: ...

    def what_fills(self) -> WhatFills | None: ...


class DeadPlace(NamedTuple):
    """A place whose dead leftovers gc -A would remove."""

    place: Place
    entries: int
    bytes: int  # what the dead engine leftovers hold (allocated blocks)


def dead_places(layout: Layout, policy: Policy, facts: Facts, *, host_plan: Plan | None = None,
                kubelet_dir: str | None = None, proc_root: str = "/proc",
                pp: PlacesPlan | None = None) -> tuple[list[DeadPlace], int, list[str]]:
    """(places with dead leftovers, how many places besides the host's, what could not be read).

    `pp`: every place's plan, already made from the same facts (doctor's, which its capacity check shares)."""
    from .run import plan_places

    if pp is None:
        pp = plan_places(layout, policy, facts, kvcached=True, engines=True, kubelet_dir=kubelet_dir,
                         host_plan=host_plan, proc_root=proc_root)
    out = []
    for plan in pp.plans[1:]:
        stale = [c for part in (plan.plan, plan.engines) if part is not None
                 for c, d in part.entries() if d.state is State.STALE]
        if stale:
            out.append(DeadPlace(plan.place, len(stale), sum(getattr(c, "allocated", 0) for c in stale)))
    return out, len(pp.plans) - 1, list(pp.errors)


def capacity_findings(places: Sequence[Measured], *, warn: float, fail: float,
                      kvctl: str = "kvctl") -> list[Finding]:
    """A warning for each place at least `warn` percent full, a failure at `fail`; one line when none is.

    Each names the place (its pod, volume or container), how full it is, what
    fills it (live and stale bytes by kind, the largest entries) and the fix:
    gc for what is dead, a larger volume for what is alive.
    """
    from ..base.units import format_size
    from .fill import fill_summary, largest_summary

    out: list[Finding] = []
    fullest: tuple[float, str] | None = None
    unknown = []
    for r in places:
        w = r.what_fills()
        pct = w.fill.percent if w is not None else None
        if w is None or pct is None:
            unknown.append(f"{r.place.label}: {w.fill.error if w is not None else 'not measured'}")
            continue
        if fullest is None or pct > fullest[0]:
            fullest = (pct, r.place.label)
        if pct < warn:
            continue
        f = w.fill
        summary = (f"{r.place.label} is {pct:.0f}% full ({format_size(f.used_bytes)} of "
                   f"{format_size(f.capacity_bytes)}): {fill_summary(w)}")
        if w.largest:
            summary += f"; largest: {largest_summary(w.largest)}"
        details = {"place": r.place.to_dict(), **w.to_dict()}
        out.append(("fail" if pct >= fail else "warn", summary, _fix(r.place, w.stale_bytes, kvctl), details))
    if out:
        return out
    if fullest is None:
        return [("warn", "no place's fill could be measured: " + "; ".join(unknown[:3]), None,
                 {"errors": unknown})]
    return [("ok", f"{len(places)} place(s), none {warn:g}% full; the fullest: {fullest[1]} at {fullest[0]:.0f}%"
             + (f"; not measured: {'; '.join(unknown[:3])}" if unknown else ""), None,
             {"places": len(places), "errors": unknown})]


def _fix(place: Place, stale_bytes: int, kvctl: str) -> str:
    from ..base.units import format_size

    room = ("give the pod's volume a larger sizeLimit (emptyDir: {medium: Memory, sizeLimit: ...})"
            if place.volume else "give the container a larger /dev/shm (--shm-size; in Kubernetes a memory-backed "
            "emptyDir at /dev/shm: emptyDir: {medium: Memory, sizeLimit: ...})"
            if not place.is_host else "give the node's /dev/shm more room (mount -o remount,size=... /dev/shm)")
    if stale_bytes:
        every = " -A" if not place.is_host else ""
        return (f"{kvctl} gc{every} --engines --yes frees the {format_size(stale_bytes)} the dead hold; if the "
                f"live alone fill it, {room}")
    return f"what fills it is alive: {room}"
