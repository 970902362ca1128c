"""What doctor's `pods` check reads: each place other than the host's with dead leftovers, and what they hold."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from ..base.enums import State
from ..base.layout import Layout
from ..clean.decide import Policy
from ..clean.facts import Facts
from .discover import Place

if TYPE_CHECKING:
    from ..clean.cleanup import Plan


class DeadPlace(NamedTuple):
    """A place whose dead leftovers gc -A would remove."""

    place: Place
    entries: int
    bytes: int  # what the dead engine leftovers hold (allocated blocks)


def dead_places(layout: Layout, policy: Policy, facts: Facts, *, host_plan: Plan | None = None,
                kubelet_dir: str | None = None, proc_root: str = "/proc") -> tuple[list[DeadPlace], int, list[str]]:
    """(places with dead leftovers, how many places besides the host's, what could not be read)."""
    from .run import plan_places

    pp = plan_places(layout, policy, facts, kvcached=True, engines=True, kubelet_dir=kubelet_dir,
                     host_plan=host_plan, proc_root=proc_root)
    out = []
    for plan in pp.plans[1:]:
        stale = [c for part in (plan.plan, plan.engines) if part is not None
                 for c, d in part.entries() if d.state is State.STALE]
        if stale:
            out.append(DeadPlace(plan.place, len(stale), sum(getattr(c, "allocated", 0) for c in stale)))
    return out, len(pp.plans) - 1, list(pp.errors)
