"""Every JSON document kvctl prints comes from one builder in kvctl/documents.py, valid against its schema.

The builders are fed what the node layer really returns for a planted node:
a dead deployment (stale segment, directory and socket), a directory with a
forged hash, a gc dry run and a real one, doctor's checks, the demo's pieces.
"""

from __future__ import annotations

import os
import re

import pytest

from kvcached.node.clean.cleanup import execute
from kvcached.node.ops import diagnostics as dx
from kvcached.node.ops.gcrun import GcOptions, make_plan, run_delete, run_gc
from kvcached.node.ops.view import build_view
from kvcached.node.state.segment import create_segment, read_segment, write_segment
from kvctl import documents
from kvctl.exitcodes import Exit

from ..fs.helpers import backdate, stale_socket
from .conftest import REPO, validate


@pytest.fixture
def node(layout, uniq: str):
    """A dead deployment of this test (segment, directory, one socket, all past the grace age), and a forged dir."""
    name = f"{uniq}dead"
    create_segment(layout.segment_path(name), 1 << 30)
    stale_socket(layout.socket_path(name, 0))
    for path in (layout.socket_path(name, 0), layout.socket_dir(name), layout.segment_path(name)):
        backdate(path)
    os.chmod(layout.socket_dir(name), 0o700)
    os.mkdir(os.path.join(layout.tmp_dir, f"kvcached-tp-{uniq}forged-00000000"))
    return layout, name


def test_list_limit_and_inspect_documents(node) -> None:
    layout, name = node
    view = build_view(make_plan(layout, (), 0.0), namespaces=True)
    rows = documents.list_document(view)
    validate(rows, "list")
    assert [r["ipc"] for r in rows] == [name] and list(rows[0])[:3] == ["ipc", "limit_bytes", "used_bytes"]
    doc = documents.inspect_document(view, None)
    validate(doc, "inspect")
    assert doc["schema"] == "kvctl.inspect/1" and doc["pid"] is None and doc["unowned"]
    path = layout.segment_path(name)
    before = read_segment(path)
    doc = documents.limit_document(name, path, before, write_segment(path, total=2 << 30))
    validate(doc, "limit")
    assert (doc["previous"], doc["limit"]) == (1 << 30, 2 << 30)


def test_gc_and_delete_documents_share_their_keys(node) -> None:
    layout, name = node
    dry = run_gc(GcOptions(layout=layout, grace=0.0, dry_run=True))
    doc = documents.gc_document(layout.root, dry, Exit.STALE_REMAIN)
    validate(doc, "gc")
    assert doc["dry_run"] is True and {e["action"] for e in doc["entries"]} >= {"would_remove"}
    assert list(doc) == ["schema", "root", "dry_run", "entries", "summary", "orphans", "killed", "blind",
                         "metrics_error", "errors", "exit_code"]  # the order docs/KVCTL.md §9 shows
    assert doc["blind"] is None or doc["blind"]["reasons"]
    assert doc["metrics_error"] is None  # no --prometheus asked for
    report = run_delete(layout, name, grace=0.0)
    deleted = documents.delete_document(layout.root, report, Exit.OK)
    validate(deleted, "gc")
    assert deleted["schema"] == "kvctl.delete/1" and deleted["dry_run"] is False
    assert {k for k in deleted} == {k for k in doc} - {"orphans", "killed", "blind", "metrics_error"}


def test_doctor_and_demo_documents(node) -> None:
    layout, name = node
    results = dx.run_checks(dx.Context(layout), dx.select(["environment", "node"]))
    doc = documents.doctor_document(layout.root, results, healthy=True, strict=False, code=Exit.OK)
    validate(doc, "doctor")
    assert sum(doc["summary"].values()) == len(doc["checks"]) == len(results)
    view = build_view(make_plan(layout, [name], 0.0))
    report = execute(make_plan(layout, [name], 0.0), dry_run=False)
    doc = documents.demo_document(layout.root, name, view, report, [], Exit.OK)
    validate(doc, "demo")
    assert doc["clean"] is True and doc["inspect"]["schema"] == "kvctl.inspect/1"


@pytest.mark.parametrize("code", [c for c in Exit if c is not Exit.OK])
def test_error_document_of_every_failing_code(code: Exit) -> None:
    doc = documents.error_document(code, "what happened")
    validate(doc, "error")
    assert doc["exit_code"] == doc["error"]["code"] == int(code) and doc["error"]["name"] == code.name.lower()
    assert documents.error_document(code, None)["error"]["message"] == code.name.lower().replace("_", " ")


def test_no_other_module_builds_a_document() -> None:
    """A kvctl schema name (`kvctl.gc/1`) anywhere else in kvctl or the node layer is a document built elsewhere."""
    offenders = []
    for base in ("kvctl", os.path.join("kvcached", "node")):
        for d, _, files in os.walk(REPO / base):
            for f in files:
                path = os.path.join(d, f)
                if f.endswith(".py") and not path.endswith(os.path.join("kvctl", "documents.py")):
                    text = open(path, encoding="utf-8").read()
                    offenders += [f"{path}: {m}" for m in re.findall(r"[\"']kvctl\.[a-z]+/[0-9]+[\"']", text)]
    assert offenders == []


def test_entry_rows_write_what_json_dumps_writes(node, uniq: str) -> None:
    """documents.EntryRows' own encoder against json.dumps over Entry.to_dict, entry for entry."""
    import json

    from kvcached.node.clean.report import Entry

    layout, name = node
    os.mkdir(os.path.join(layout.tmp_dir, f"kvcached-tp-{uniq}é-00000000"))  # a path json must escape
    report = run_gc(GcOptions(layout=layout, grace=0.0, dry_run=True)).report
    entries = list(report.entries)
    assert len({e.decision.state for e in entries}) > 1
    # The same decision with and without a note, and a float json spells its own way.
    e0 = entries[0]
    entries += [e0._replace(note="kept: a note"), Entry(e0.candidate._replace(mtime=float("nan")), e0.decision,
                                                           e0.action, "")]
    rows = documents.EntryRows(entries)
    plain = [e.to_dict() for e in entries]
    assert list(rows) == plain  # the same NaN object on both sides: equal as list items
    assert rows.json() == json.dumps(plain, separators=(",", ":"))
    rows += [{"kind": "vllm_rpc", "path": "/tmp/x", "pids": []}]  # what gc --engines appends
    plain += [{"kind": "vllm_rpc", "path": "/tmp/x", "pids": []}]
    assert isinstance(rows, documents.EntryRows) and rows.json() == json.dumps(plain, separators=(",", ":"))
    doc = {"a": 1, "entries": rows, "nested": {"gc": {"entries": rows}}, "x": [1.5, None]}
    plain_doc = {"a": 1, "entries": plain, "nested": {"gc": {"entries": plain}}, "x": [1.5, None]}
    assert documents.json_text(doc) == json.dumps(plain_doc, separators=(",", ":"))


def test_entry_rows_are_the_rows_whichever_way_they_are_read(node) -> None:
    """EntryRows makes its dicts only when read as a list: every way of reading it, the first, sees them all."""
    import copy
    import json
    import pickle

    layout, _ = node
    report = run_gc(GcOptions(layout=layout, grace=0.0, dry_run=True)).report
    plain = [e.to_dict() for e in report.entries]
    assert len(plain) > 2
    reads = {
        "json.dumps, C encoder": lambda r: json.loads(json.dumps(r)),
        "json.dumps, indented (the terminal's)": lambda r: json.loads(json.dumps(r, indent=2)),
        "list()": list, "sorted()": lambda r: sorted(r, key=plain.index),
        "index": lambda r: [r[i] for i in range(len(plain))], "slice": lambda r: r[:],
        "==": lambda r: plain if r == plain and plain == r and not r != plain else [],
        "in": lambda r: [row for row in plain if row in r], "reversed()": lambda r: list(reversed(r))[::-1],
        "copy.deepcopy": lambda r: list(copy.deepcopy(r)), "copy()": lambda r: r.copy(),
        "pickle": lambda r: list(pickle.loads(pickle.dumps(r))),
        "+": lambda r: r + [], "append": lambda r: (r.append({"x": 1}), list(r)[:-1])[1],
    }
    for what, read in reads.items():
        assert read(documents.EntryRows(report.entries)) == plain, what
    assert len(documents.EntryRows(report.entries)) == len(plain) and bool(documents.EntryRows(report.entries))
    rows = documents.EntryRows(report.entries)
    rows += [{"kind": "vllm_rpc"}]
    assert rows.json() == json.dumps(plain + [{"kind": "vllm_rpc"}], separators=(",", ":"))
    assert len(rows) == len(plain) + 1
    empty = documents.EntryRows([])
    assert (empty.json(), json.dumps(empty), len(empty), bool(empty)) == ("[]", "[]", 0, False)
