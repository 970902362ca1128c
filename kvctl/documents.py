"""kvctl's JSON documents: one builder per schema in kvctl/schemas/ (docs/KVCTL.md §9).

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
    from kvcached.node import (
        CheckResult,
        DeploymentView,
        Entry,
        GcResult,
        GpuReport,
        NodeView,
        PlaceResult,
        Report,
        SegmentInfo,
    )


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


class EntryRows(list):  # list[dict[str, Any]]: the rows of Entry.to_dict
    """A report's entries as the schema has them (one dict each, `Entry.to_dict`), and as JSON text, fast.

    A gc over a full node reports every entry (11,000 for 1,000 dead
    deployments), and `kvctl gc --json` only writes them: `json()` writes the
    array from fragments encoded once per distinct decision, far cheaper than
    json.dumps over the dicts, and the dicts themselves are made only when
    the list is read as a list (building them was a visible share of `kvctl gc --dry-run
    --json` end to end, bench/bench_gc.py; bench/README.md). Every list operation makes them
    first (json.dumps' C encoder, too, reads a list subclass through
    `__iter__`). It takes kvcached's entries (their fields are the fast
    path's); rows appended later (`+=`, as a report's other sources append
    theirs, `Entry.to_dict`) are written by json.dumps.
    tests/cli/test_documents.py checks that both say the same.
    """

    # A list made without __init__ (unpickled: the rows come in before the attributes) is a plain list of rows.
    entries: Sequence[Entry[Any]] = ()
    _made = True

    def __init__(self, entries: Sequence[Entry[Any]]) -> None:
        super().__init__()
        self.entries = entries
        self._made = False

    def _make(self) -> None:
        """The rows, once, ahead of anything appended to the list before."""
        if self._made:
            return
        self._made = True
        parts: dict[tuple[int, str, str], tuple[str, str, str, str, tuple[int, ...]]] = {}
        rows = []
        for e in self.entries:
            c, d = e.candidate, e.decision
            key = (id(d), e.action, e.note)  # the decisions live as long as the entries that hold them
            part = parts.get(key)
            if part is None:
                part = parts[key] = (d.state._value_, e.action._value_, d.reason._value_,
                                     d.detail + (f"; {e.note}" if e.note else ""), d.pids)
            state, action, reason, detail, pids = part
            # _value_, not str() or .value: both go through Python-level enum code, five times an entry.
            rows.append({"kind": c.kind._value_, "path": c.path, "deployment": c.deployment, "state": state,
                         "action": action, "reason": reason, "detail": detail, "pids": list(pids), "rank": c.rank,
                         "stage": c.stage, "uid": c.uid, "mtime": c.mtime, "type": c.ftype._value_})
        list.__setitem__(self, slice(0, 0), rows)

    def json(self) -> str:
        """The array as compact JSON: what json.dumps(self, separators=(",", ":")) gives."""
        import json
        from json.encoder import encode_basestring_ascii as text

        middles: dict[tuple[int, str, str, int | None, int | None, int], str] = {}
        out = []
        for e in self.entries:
            c, d = e.candidate, e.decision
            key = (id(d), e.action, e.note, c.rank, c.stage, c.uid)
            middle = middles.get(key)
            if middle is None:
                fields = {"state": d.state._value_, "action": e.action._value_, "reason": d.reason._value_,
                          "detail": d.detail + (f"; {e.note}" if e.note else ""), "pids": list(d.pids),
                          "rank": c.rank, "stage": c.stage, "uid": c.uid}
                middle = middles[key] = json.dumps(fields, separators=(",", ":"))[1:-1]
            dep = "null" if c.deployment is None else text(c.deployment)
            out.append(f'{{"kind":"{c.kind._value_}","path":{text(c.path)},"deployment":{dep},{middle},'
                       f'"mtime":{_number(c.mtime)},"type":"{c.ftype._value_}"}}')
        # Rows appended after the report's (gc --engines adds the engines' own): as json.dumps writes them.
        # Anything appended made the rows first, so an unmade list has none.
        later = list.__getitem__(self, slice(len(self.entries), None)) if self._made else []
        out += (json.dumps(row, separators=(",", ":"), default=str) for row in later)
        return "[" + ",".join(out) + "]"


def _made_first(name: str) -> Any:
    """list's method `name`, run on EntryRows after its rows are made."""
    method = getattr(list, name)

    def run(self: EntryRows, *args: Any, **kw: Any) -> Any:
        self._make()
        return method(self, *args, **kw)

    run.__name__ = name
    return run


# Every way to read or change a list (C code that takes a list subclass, json's encoder and list() among
# them, goes through these too), so that nothing sees the list before its rows are made.
for _name in ("__iter__", "__len__", "__getitem__", "__setitem__", "__delitem__", "__contains__", "__reversed__",
              "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__add__", "__iadd__", "__mul__",
              "__imul__", "__rmul__", "__repr__", "__reduce_ex__", "append", "extend", "insert", "pop", "remove",
              "index", "count", "sort", "reverse", "copy", "clear"):
    setattr(EntryRows, _name, _made_first(_name))
del _name


def _number(x: float) -> str:
    # json.dumps' own spelling: repr for finite floats, NaN and Infinity otherwise.
    if x == x and x not in (float("inf"), float("-inf")):
        return repr(x)
    import json

    return json.dumps(x)


def json_text(obj: Any) -> str:
    """`obj` as compact JSON (json.dumps with separators), an EntryRows inside it written by its own `json()`."""
    import json

    if isinstance(obj, EntryRows):
        return obj.json()
    if _holds_rows(obj):
        from json.encoder import encode_basestring_ascii as text

        return "{" + ",".join(f"{text(k)}:{json_text(v)}" for k, v in obj.items()) + "}"
    return json.dumps(obj, separators=(",", ":"), default=str)


def _holds_rows(obj: Any) -> bool:
    return isinstance(obj, dict) and all(isinstance(k, str) for k in obj) and \
        any(isinstance(v, EntryRows) or _holds_rows(v) for v in obj.values())


def entry_rows(report: Report) -> EntryRows:
    """A report's entries as its documents list them: kvcached's (the fast rows), then every other source's."""
    from kvcached.node import Source

    ours = report.part(Source.KVCACHED)
    rows = EntryRows(ours.entries if ours is not None else ())
    for source in report.sources:
        theirs = report.part(source) if source is not Source.KVCACHED else None
        if theirs is not None:
            rows += [e.to_dict() for e in theirs.entries]
    return rows


def _report(schema: str, root: str, report: Report, dry_run: bool, code: IntEnum, **extra: Any) -> dict[str, Any]:
    # What gc and delete documents share, in the order docs/KVCTL.md §9 shows them; gc adds its orphans before errors.
    # The summary counts every source's entries, and each further source's alone under its name (`engines`).
    return {"schema": schema, "root": root, "dry_run": dry_run,
            "entries": entry_rows(report), "summary": report.summary(), **extra,
            "errors": report.errors, "exit_code": int(code)}


def gc_document(root: str, result: GcResult, code: IntEnum) -> dict[str, Any]:
    """`gc --json` (gc.json, schema kvctl.gc/1); with --engines, the engine leftovers' entries follow kvcached's."""
    # blind: null when the run saw every process; else each reason it did not (kvcached.node.clean.sight)
    doc = _report("kvctl.gc/1", root, result.report, result.dry_run, code,
                  orphans=[{"deployment": d.name, **o.to_dict()} for d, o in result.orphans],
                  killed=[k.to_dict() for k in result.killed],
                  blind=result.sight.to_dict() if result.sight is not None else None,
                  metrics_error=result.metrics_error)
    if result.all_places:
        _add_places(doc, result)
    return doc


def _add_counts(mine: dict[str, Any], theirs: dict[str, Any]) -> None:
    """Another place's summary counted into this one's (states, actions and bytes by key; entries)."""
    for key in ("states", "actions", "bytes"):
        if key in mine and key in theirs:
            mine[key] = {k: n + theirs[key].get(k, 0) for k, n in mine[key].items()}
    for key in ("entries", "removed_bytes"):
        if key in mine and key in theirs:
            mine[key] += theirs[key]
    mine["timed_out"] = mine["timed_out"] or theirs["timed_out"]


def _add_places(doc: dict[str, Any], result: GcResult) -> None:
    """gc -A: every entry carries its place; the other places' entries follow the host's; the places are listed.

    The summary counts every place's entries (and `summary.engines` every place's engine leftovers).
    """
    from kvcached.node import Source

    host = {**result.places[0].place.to_dict(), "path": doc["root"]}
    rows = [{**row, "place": host} for row in doc["entries"]]
    summary: dict[str, Any] = doc["summary"]
    errors: list[str] = doc["errors"]
    listed = [result.places[0].to_dict() | {"path": doc["root"]}]
    for r in result.others:
        listed.append(r.to_dict())
        if r.report is None:
            continue
        where = r.place.to_dict()
        rows += [{**e.to_dict(), "place": where} for e in r.report.entries]
        _add_counts(summary, r.report.summary())
        engines = r.report.part(Source.ENGINES) if "engines" in summary else None
        if engines is not None:
            _add_counts(summary["engines"], engines.summary())
        errors += [e for e in r.report.errors if e not in errors]
    errors += [e for e in result.place_errors if e not in errors]
    summary["errors"] = len(errors)
    doc["entries"] = rows
    doc["places"] = listed


def event_document(root: str, reaction: Any) -> dict[str, Any]:
    """One judgement of gc --every's event path (gc_event.json, schema kvctl.gc-event/1): each place judged, with
    its entries."""
    places, entries = [], []
    for r in reaction.places:
        places.append(r.to_dict())
        if r.report is not None:
            where = r.place.to_dict()
            entries += [{**e.to_dict(), "place": where} for e in r.report.entries]
    return {"schema": "kvctl.gc-event/1", "root": root, "started": round(reaction.started, 3),
            "took_seconds": round(reaction.took, 6), "exited": reaction.exited, "files": reaction.files,
            "busy": reaction.busy, "error": reaction.error, "places": places, "entries": entries}


def delete_document(root: str, report: Report, code: IntEnum) -> dict[str, Any]:
    """`delete --json` (gc.json, schema kvctl.delete/1): gc's document of one deployment."""
    return _report("kvctl.delete/1", root, report, False, code)


def _inspect(view: NodeView) -> dict[str, Any]:
    return {"schema": "kvctl.inspect/1", **view.to_dict()}


def inspect_document(view: NodeView, pid: int | None, engines: Sequence[Entry[Any]] = (), gpu: GpuReport | None = None,
                     places: Sequence[PlaceResult] | None = None) -> dict[str, Any]:
    """`inspect --json` (inspect.json): the node's view, the `--pid` it was seen through, the engines' leftovers,
    the GPU holders (kvcached.node.gpu.GpuReport).

    With `places` (inspect -A: the face's PlaceResult of every place, host first), every deployment and
    engine entry carries its place, and the document lists the places.
    """
    doc = {**_inspect(view), "pid": pid, "engine_state": [e.to_dict() for e in engines],
           "gpu_holders": [] if gpu is None else gpu.to_list(),
           "gpu_memory_note": None if gpu is None else gpu.memory_note}
    if places is None:
        return doc
    host = places[0].place.to_dict() | {"path": view.layout.root}
    doc["deployments"] = [{**d, "place": host} for d in doc["deployments"]]
    doc["engine_state"] = [{**e, "place": host} for e in doc["engine_state"]]
    for pv in places[1:]:
        where = pv.place.to_dict()
        if pv.view is not None:
            doc["deployments"] += [{**d.to_dict(), "place": where} for d in pv.view.deployments]
            doc["unowned"] += [e.to_dict() for e in pv.view.unowned]
        doc["engine_state"] += [{**e.to_dict(), "place": where} for e in pv.engine_entries()]
    doc["places"] = [pv.to_dict() for pv in places]
    doc["places"][0]["path"] = view.layout.root
    return doc


def doctor_document(root: str, results: Sequence[CheckResult], *, healthy: bool, strict: bool,
                    code: IntEnum) -> dict[str, Any]:
    """`doctor --json` (doctor.json): every check's result and the count of each status."""
    from kvcached.node import Status

    counts = {str(s): sum(r.status is s for r in results) for s in Status}
    return {"schema": "kvctl.doctor/1", "root": root, "healthy": healthy, "strict": strict,
            "checks": [r.to_dict() for r in results], "summary": counts, "exit_code": int(code)}


def demo_document(root: str, name: str, view: NodeView, report: Report, left: Sequence[str],
                  code: IntEnum) -> dict[str, Any]:
    """`demo --json` (demo.json): what inspect saw after the crash, what gc did, and what is left."""
    return {"schema": "kvctl.demo/1", "root": root, "name": name, "inspect": _inspect(view),
            "gc": {"entries": entry_rows(report), "summary": report.summary()},
            "left": list(left), "clean": not left, "exit_code": int(code)}


def error_document(code: IntEnum, message: str | None) -> dict[str, Any]:
    """What `--json` prints on stdout when a command fails (error.json)."""
    name = code.name.lower()
    return {"schema": "kvctl.error/1", "error": {"code": int(code), "name": name,
                                                 "message": message or name.replace("_", " ")},
            "exit_code": int(code)}
