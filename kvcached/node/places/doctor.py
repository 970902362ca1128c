"""doctor's `pods` check: a pod volume or a container's shm holding dead leftovers, named with its pod and bytes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..enums import State

if TYPE_CHECKING:
    from ..diagnostics import CheckResult, Context


def check_pods(ctx: Context) -> list[CheckResult]:
    """Warn for each place other than the host's whose dead leftovers `kvctl gc -A --engines` would remove."""
    from ..diagnostics import CheckResult, Group, Status
    from ..units import format_size
    from .run import plan_places

    g = Group.NODE
    if not ctx.all_places:
        return [CheckResult("pods", g, Status.SKIP, "the pods' volumes and containers' shm were not looked at",
                            f"{ctx.kvctl} doctor -A pods")]
    pp = plan_places(ctx.layout, ctx.policy, ctx.plan.facts, kvcached=True, engines=True,
                     kubelet_dir=ctx.kubelet_dir, host_plan=ctx.plan, proc_root=ctx.proc_root)
    out: list[CheckResult] = []
    for plan in pp.plans[1:]:
        stale = [(c, d) for part in (plan.plan, plan.engines) if part is not None
                 for c, d in part.entries() if d.state is State.STALE]
        if not stale:
            continue
        held = sum(getattr(c, "allocated", 0) for c, _ in stale)
        place = plan.place
        details: dict[str, Any] = {"place": place.to_dict(), "stale_entries": len(stale), "stale_bytes": held}
        out.append(CheckResult(
            "pods", g, Status.WARN,
            f"{place.label}: {len(stale)} dead leftover(s) holding {format_size(held)}; the next start there may "
            "fail on a full /dev/shm",
            f"{ctx.kvctl} gc -A --engines --yes (removes only what is provably dead)", details))
    if not out:
        n = len(pp.plans) - 1
        summary = f"{n} place(s) besides the host's, none with dead leftovers"
        if pp.errors:
            summary += f"; could not read: {'; '.join(pp.errors[:3])}"
        out.append(CheckResult("pods", g, Status.OK, summary, None, {"places": n, "errors": list(pp.errors)}))
    return out
