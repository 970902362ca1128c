"""The GPU holders' metrics, written by gc runs that judged them (gc --engines), in the textfile's format."""

from __future__ import annotations

from collections.abc import Iterable

from .holders import GpuReport
from .judge import HolderState


def _metric(lines: list[str], name: str, help_: str, samples: Iterable[tuple[dict[str, str], int]]) -> None:
    # Named kvctl_gpu_*, not kvctl_gc_*: they say what holds the node's GPUs, not what the cleaner removed.
    full = f"kvctl_gpu_{name}"
    lines += [f"# HELP {full} {help_}", f"# TYPE {full} gauge"]
    for labels, value in samples:
        lab = ",".join(f'{k}="{v}"' for k, v in labels.items())
        lines.append(f"{full}{{{lab}}} {value}" if lab else f"{full} {value}")


def render_gpu(report: GpuReport) -> str:
    """kvctl_gpu_orphan_processes, kvctl_gpu_orphan_bytes{gpu} and kvctl_gpu_holders{state}."""
    lines: list[str] = []
    _metric(lines, "orphan_processes", "Orphaned engine processes holding a GPU, seen by the last run.",
            [({}, len(report.orphans))])
    _metric(lines, "orphan_bytes", "GPU memory orphaned engine processes hold, by GPU (NVML or fdinfo; "
            "no sample where unknown).", [({"gpu": g}, n) for g, n in sorted(report.orphan_bytes_by_gpu().items())])
    _metric(lines, "holders", "Processes holding a GPU device, by state.",
            [({"state": str(s)}, len(report.with_state(s))) for s in HolderState])
    return "\n".join(lines) + "\n"
