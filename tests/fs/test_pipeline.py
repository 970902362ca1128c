"""One pipeline for every source: kvcached's state and the engines' leftovers in one act and one report.

Real files on a private root: a SIGKILLed serve's state (segment, socket
directory, nodes) beside dead engine buffers, both planned from one /proc
pass and acted on by one cleanup.execute.
"""

from __future__ import annotations

import os
import time

from kvcached.node.base.enums import Engine
from kvcached.node.base.layout import Layout
from kvcached.node.clean.cleanup import Action, execute, plan
from kvcached.node.clean.decide import Policy, State
from kvcached.node.clean.leftovers.act import plan_engines
from kvcached.node.clean.report import KVCACHED, Source

from .engine_plant import needs_whole_view
from .helpers import dead_deployment


def _buffer(layout: Layout, name: str, nbytes: int = 8192) -> str:
    """A dead engine buffer in the layout's /dev/shm: written once, nobody maps it, an hour old."""
    path = os.path.join(layout.shm_dir, name)
    with open(path, "wb") as f:
        f.write(b"x" * nbytes)
    t = time.time() - 3600
    os.utime(path, (t, t))
    return path


def _plans(layout: Layout) -> list:  # type: ignore[type-arg]
    p = plan(layout, Policy(grace=60))
    return [p, plan_engines(layout, Policy(grace=60), facts=p.facts)]  # one /proc pass for both


@needs_whole_view
def test_both_sources_are_one_report_with_one_part_each(layout: Layout, uniq: str) -> None:
    ours = dead_deployment(layout, uniq)
    theirs = [_buffer(layout, "psm_0a1b2c3d"), _buffer(layout, "nccl-Ab3dE9", 4096)]
    report = execute(*_plans(layout), dry_run=False)
    assert report.sources == (Source.KVCACHED, Source.ENGINES)
    kv, eng = report.part(Source.KVCACHED), report.part(Source.ENGINES)
    assert kv is not None and eng is not None
    assert kv.entries + eng.entries == report.entries
    assert {e.path for e in kv.entries} == set(ours) and all(e.origin is KVCACHED for e in kv.entries)
    assert {e.path for e in eng.entries} == set(theirs)
    assert {e.origin.engine for e in eng.entries} == {Engine.VLLM, Engine.NCCL}
    assert all(e.action is Action.REMOVED for e in report.entries) and not report.failures
    assert not any(os.path.lexists(p) for p in ours + theirs)
    # The summary counts every source; the engines' own (with the bytes they held) is under its name.
    s, ks, es = report.summary(), kv.summary(), eng.summary()
    assert s["entries"] == ks["entries"] + es["entries"] == len(ours) + len(theirs)
    for key in ("states", "actions"):
        assert s[key] == {k: n + es[key][k] for k, n in ks[key].items()}  # type: ignore[index]
    assert s["engines"] == es and "engines" not in ks and "bytes" not in s and "bytes" not in ks
    assert es["removed_bytes"] == report.bytes(action=Action.REMOVED) >= 8192 + 4096
    assert report.count(source=Source.ENGINES, engine=Engine.NCCL) == 1
    rows = [e.to_dict() for e in report.entries]
    assert all("bytes" not in r for r in rows[:len(ours)]) and all("bytes" in r for r in rows[len(ours):])


@needs_whole_view
def test_dry_run_is_one_guard_for_both_sources(layout: Layout, uniq: str) -> None:
    planted = dead_deployment(layout, uniq) + [_buffer(layout, "psm_0a1b2c3d")]
    report = execute(*_plans(layout), dry_run=True)
    assert {e.path for e in report.entries if e.action is Action.WOULD_REMOVE} == set(planted)
    assert all(os.path.lexists(p) for p in planted)


@needs_whole_view
def test_the_identity_recheck_keeps_what_was_replaced_since_the_scan_in_either_source(layout: Layout,
                                                                                      uniq: str) -> None:
    seg = dead_deployment(layout, uniq)[-1]
    buf = _buffer(layout, "psm_0a1b2c3d")
    plans = _plans(layout)
    for path in (seg, buf):  # a successor re-creates each name between the scan and the act
        os.unlink(path)
        with open(path, "wb") as f:
            f.write(b"\0" * 24)
    report = execute(*plans, dry_run=False)
    kept = {e.path: e.note for e in report.entries if e.action is Action.KEPT}
    assert kept[seg] == kept[buf] == "replaced since the scan"
    assert os.path.exists(seg) and os.path.exists(buf)


@needs_whole_view
def test_one_time_budget_spans_every_source(layout: Layout, uniq: str) -> None:
    seg = dead_deployment(layout, uniq)[-1]
    buf = _buffer(layout, "psm_0a1b2c3d")
    report = execute(*_plans(layout), dry_run=False, time_limit=1e-9)
    assert report.timed_out and all(p.timed_out for p in report.parts)
    stale = [e for e in report.entries if e.state is State.STALE]
    assert stale and all(e.action is Action.KEPT for e in stale)  # the directory: kept for its segment
    notes = {e.path: e.note for e in stale}
    assert notes[seg] == notes[buf] == "time limit reached"
