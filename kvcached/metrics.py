"""node_exporter textfile metrics for a gc run, written atomically (temp file in the same directory + rename).

node_exporter reads `*.prom` files in its textfile directory at every scrape; a
half-written file would be read as garbage, so we never write in place.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterable

from .cleanup import Action, Report
from .decide import State
from .scan import Kind

PREFIX = "kvctl_gc"
_SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def previous_value(path: str, metric: str) -> float | None:
    """The value of an unlabelled `metric` in an existing textfile (to carry the last success across failed runs)."""
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                m = _SAMPLE_RE.match(line)
                if m and m.group(1) == metric and not m.group(2):
                    return float(m.group(3))
    except (OSError, ValueError):
        return None
    return None


def render(report: Report, *, success: bool, orphans: int = 0, lock_busy: bool = False,
           last_success: float | None = None) -> str:
    """The textfile body for one run."""
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: Iterable[tuple[dict[str, str], float]]) -> None:
        full = f"{PREFIX}_{name}"
        lines.append(f"# HELP {full} {help_}")
        lines.append(f"# TYPE {full} {kind}")
        for labels, value in samples:
            lab = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
            text = str(int(value)) if float(value).is_integer() and abs(value) < 1e15 else repr(float(value))
            lines.append(f"{full}{{{lab}}} {text}" if lab else f"{full} {text}")

    kinds = [str(k) for k in Kind]
    metric("entries", "gauge", "Entries found by the last run, by kind and state.",
           [({"kind": k, "state": str(s)}, report.count(state=s, kind=Kind(k))) for k in kinds for s in State])
    metric("stale_entries", "gauge", "Stale entries left after the last run, by kind (0 when clean).",
           [({"kind": k}, sum(1 for e in report.stale_remaining if e.kind is Kind(k))) for k in kinds])
    metric("removed", "gauge", "Entries removed by the last run, by kind.",
           [({"kind": k}, report.count(action=Action.REMOVED, kind=Kind(k))) for k in kinds])
    metric("failures", "gauge", "Removals that failed in the last run.", [({}, len(report.failures))])
    metric("orphaned_processes", "gauge", "Orphaned kvcached processes seen by the last run.", [({}, orphans)])
    metric("lock_busy", "gauge", "1 when the last run found another gc holding the lock.", [({}, int(lock_busy))])
    metric("timed_out", "gauge", "1 when the last run hit its time limit.", [({}, int(report.timed_out))])
    metric("duration_seconds", "gauge", "Wall time of the last run.", [({}, round(report.finished - report.started, 6))])
    metric("last_run_timestamp_seconds", "gauge", "When the last run finished.", [({}, round(report.finished, 3))])
    if success:
        last_success = report.finished
    if last_success is not None:
        metric("last_success_timestamp_seconds", "gauge",
               "When a run last finished with no failures and no stale entries left.", [({}, round(last_success, 3))])
    return "\n".join(lines) + "\n"


def write_textfile(path: str, body: str) -> None:
    """Replace `path` with `body` atomically; readers see the old file or the new one, never a mix."""
    directory = os.path.dirname(os.path.abspath(path)) or "."
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; node_exporter often runs as another user
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_report(path: str, report: Report, *, success: bool, orphans: int = 0, lock_busy: bool = False) -> None:
    """Render and write one run's metrics, keeping the previous last-success time when this run failed."""
    last = previous_value(path, f"{PREFIX}_last_success_timestamp_seconds")
    write_textfile(path, render(report, success=success, orphans=orphans, lock_busy=lock_busy, last_success=last))
