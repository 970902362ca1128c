"""The rows of `list` (and `watch`): upstream's keys first, ours added."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .render import Cell

if TYPE_CHECKING:
    from kvcached.node.view import DeploymentView, NodeView


def list_row(d: DeploymentView) -> dict[str, Any]:
    """One segment as `list --json` prints it (kvctl/schemas/list.json)."""
    seg = d.segment_entry()
    assert seg is not None
    info = d.segment
    ok = info is not None and info.valid
    return {"ipc": d.name,
            "limit_bytes": info.total if info else None, "used_bytes": info.used if info else None,
            "prealloc_bytes": info.prealloc if info else None,
            "free_bytes": max(0, info.total - info.used - info.prealloc) if info and ok else None,
            "state": str(seg.state), "reason": str(seg.decision.reason), "detail": seg.decision.detail,
            "pids": sorted(p.pid for p in d.processes), "path": seg.path, "mtime": seg.candidate.mtime,
            "uid": seg.candidate.uid, "problems": list(info.problems) if info else [],
            "error": d.segment_error}


def list_rows(view: NodeView) -> list[dict[str, Any]]:
    """A row per deployment that has a segment."""
    return [list_row(d) for d in view.deployments if d.segment_entry() is not None]


def size_cells(r: dict[str, Any]) -> list[Cell]:
    """LIMIT, USED, PREALLOC, FREE; a negative value is shown as the impossible value it is."""
    from kvcached.node.units import format_size

    def cell(v: int | None) -> Cell:
        return (f"{v}!", "bold red") if v is not None and v < 0 else format_size(v)

    return [cell(r["limit_bytes"]), cell(r["used_bytes"]), cell(r["prealloc_bytes"]), cell(r["free_bytes"])]
