"""doctor's `gpu-orphans` check: fail while an orphan holds a GPU, warn on a holder the device keeps in D."""

from __future__ import annotations

from typing import Any, Optional

from .holders import find_holders

Finding = tuple[str, str, Optional[str], dict[str, Any]]  # (status: ok/warn/fail, summary, fix, details)


def gpu_orphan_findings(facts: Any, kvctl: str = "kvctl") -> list[Finding]:
    """The check's findings from the run's /proc facts (diagnostics.py makes them CheckResults)."""
    from ..base.units import format_size

    report = find_holders(facts)

    def result(status: str, summary: str, fix: str | None = None, **details: Any) -> Finding:
        return status, summary, fix, details

    out = []
    orphans = report.orphans
    if orphans:
        sized = [h.gpu_memory_bytes for h in orphans if h.gpu_memory_bytes is not None]
        held = f", holding {format_size(sum(sized))}" if sized else ""
        desc = ", ".join(f"PID {h.pid} ({h.title})" for h in orphans[:5])
        out.append(result("fail", f"{len(orphans)} orphaned engine process(es) hold a GPU{held}: {desc}",
                          f"{kvctl} gc --engines --kill-orphans", pids=[h.pid for h in orphans],
                          gpu_memory_bytes=sum(sized) if sized else None, memory_note=report.memory_note))
    stuck = report.stuck
    if stuck:
        out.append(result("warn", f"{len(stuck)} GPU holder(s) in uninterruptible sleep (D): "
                          + ", ".join(f"PID {h.pid} ({h.title})" for h in stuck[:5]),
                          "no signal ends a process the device holds in D: drain the node and reset it",
                          pids=[h.pid for h in stuck]))
    if not out:
        out.append(result("ok", f"no orphaned GPU holders ({len(report.holders)} holder(s) seen)"))
    return out
