"""gc's GPU step: find the holders from the run's /proc pass and, with --kill-orphans, end the orphans."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..clean.facts import Facts
from .holders import GpuReport, find_holders


def gpu_step(facts: Facts, *, kill: bool, yes: bool, dry_run: bool,
             confirm: Callable[[list[Any]], bool] | None, time_limit: float | None,
             proc_root: str = "/proc", grace: float = 5.0) -> tuple[GpuReport, list[Any]]:
    """(the holders, the kill results); orphans are ended only with `kill`, not in a dry run, and when the
    operator said yes (`yes`, or `confirm` on a terminal). An incomplete view ends nothing."""
    report = find_holders(facts, maps=None)  # the engine pass's read of the maps, if it made one
    targets = report.orphans
    if not (kill and targets and not dry_run and report.complete):
        return report, []
    if not (yes or (confirm is not None and confirm(targets))):
        return report, []
    from .kill import terminate_holders

    return report, list(terminate_holders(targets, grace=grace, time_limit=time_limit, proc_root=proc_root))
