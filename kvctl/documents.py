"""kvctl's JSON documents: one builder per schema in kvctl/schemas/ (README.md, "JSON").

The node layer gives each piece its dictionary (an entry, a process, a
deployment: `to_dict`); these builders put the pieces into the documents
scripts read, and nothing else prints JSON. tests/cli/test_documents.py
validates every builder's output against its schema. Exit codes come in as
kvctl.exitcodes.Exit, typed by its base class: exitcodes prints error_document,
and the two modules must not import each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvcached.node.cleanup import Report
    from kvcached.node.diagnostics import CheckResult
    from kvcached.node.engines import EngineEntry, EngineReport
    from kvcached.node.gcrun import GcResult
    from kvcached.node.segment import SegmentInfo
    from kvcached.node.view import DeploymentView, NodeView


def list_row(d: DeploymentView) -> dict[str, Any]:
    """One segment as `list --json` prints it: upstream's keys first (ipc, limit_bytes, used_bytes), ours added."""
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


def list_document(view: NodeView) -> list[dict[str, Any]]:
    """`list --json` (list.json): upstream's array, a row per deployment that has a segment."""
    return [list_row(d) for d in view.deployments if d.segment_entry() is not None]


def limit_document(name: str, path: str, before: SegmentInfo, after: SegmentInfo) -> dict[str, Any]:
    """`limit --json`, `limit-percent --json` (limit.json)."""
    return {"schema": "kvctl.limit/1", "name": name, "path": path, "previous": before.total, **after.to_dict()}


def _report(schema: str, root: str, report: Report, dry_run: bool, code: IntEnum, **extra: Any) -> dict[str, Any]:
    # What gc and delete documents share, in the order README shows them; gc adds its orphans before errors.
    return {"schema": schema, "root": root, "dry_run": dry_run,
            "entries": [e.to_dict() for e in report.entries], "summary": report.summary(), **extra,
            "errors": report.errors, "exit_code": int(code)}


def gc_document(root: str, result: GcResult, code: IntEnum) -> dict[str, Any]:
    """`gc --json` (gc.json, schema kvctl.gc/1); with --engines, the engine leftovers' entries follow kvcached's."""
    doc = _report("kvctl.gc/1", root, result.report, result.dry_run, code,
                  orphans=[{"deployment": d.name, **o.to_dict()} for d, o in result.orphans],
                  killed=[k.to_dict() for k in result.killed])
    if result.engines is not None:
        _add_engines(doc, result.report, result.engines)
    return doc


def _add_engines(doc: dict[str, Any], report: Report, engines: EngineReport) -> None:
    """Engine entries after kvcached's; the summary counts both, and `summary.engines` the engines' alone."""
    doc["entries"] += [e.to_dict() for e in engines.entries]
    # Both plans read one /proc pass, so its errors are in both lists: each is reported once.
    doc["errors"] = list(dict.fromkeys(report.errors + engines.errors))
    mine: dict[str, Any] = doc["summary"]
    theirs: dict[str, Any] = engines.summary()
    for key in ("states", "actions"):
        mine[key] = {k: n + theirs[key][k] for k, n in mine[key].items()}
    mine.update(entries=mine["entries"] + theirs["entries"], errors=len(doc["errors"]),
                timed_out=mine["timed_out"] or theirs["timed_out"],
                seconds=round(max(report.finished, engines.finished) - report.started, 4), engines=theirs)


def delete_document(root: str, report: Report, code: IntEnum) -> dict[str, Any]:
    """`delete --json` (gc.json, schema kvctl.delete/1): gc's document of one deployment."""
    return _report("kvctl.delete/1", root, report, False, code)


def _inspect(view: NodeView) -> dict[str, Any]:
    return {"schema": "kvctl.inspect/1", **view.to_dict()}


def inspect_document(view: NodeView, pid: int | None,
                     engines: Sequence[EngineEntry] = ()) -> dict[str, Any]:
    """`inspect --json` (inspect.json): the node's view, the `--pid` it was seen through, the engines' leftovers."""
    return {**_inspect(view), "pid": pid, "engine_state": [e.to_dict() for e in engines]}


def doctor_document(root: str, results: Sequence[CheckResult], *, healthy: bool, strict: bool,
                    code: IntEnum) -> dict[str, Any]:
    """`doctor --json` (doctor.json): every check's result and the count of each status."""
    from kvcached.node.diagnostics import Status

    counts = {str(s): sum(r.status is s for r in results) for s in Status}
    return {"schema": "kvctl.doctor/1", "root": root, "healthy": healthy, "strict": strict,
            "checks": [r.to_dict() for r in results], "summary": counts, "exit_code": int(code)}


def demo_document(root: str, name: str, view: NodeView, report: Report, left: Sequence[str],
                  code: IntEnum) -> dict[str, Any]:
    """`demo --json` (demo.json): what inspect saw after the crash, what gc did, and what is left."""
    return {"schema": "kvctl.demo/1", "root": root, "name": name, "inspect": _inspect(view),
            "gc": {"entries": [e.to_dict() for e in report.entries], "summary": report.summary()},
            "left": list(left), "clean": not left, "exit_code": int(code)}


def error_document(code: IntEnum, message: str | None) -> dict[str, Any]:
    """What `--json` prints on stdout when a command fails (error.json)."""
    name = code.name.lower()
    return {"schema": "kvctl.error/1", "error": {"code": int(code), "name": name,
                                                 "message": message or name.replace("_", " ")},
            "exit_code": int(code)}
