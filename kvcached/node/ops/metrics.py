"""node_exporter textfile metrics for a gc run, written atomically (temp file in the same directory + rename).

node_exporter reads `*.prom` files in its textfile directory at every scrape; a
half-written file would be read as garbage, so we never write in place.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ..base.enums import Action, Engine, Kind, State
from ..base.errors import KvcachedError
from ..clean.report import Report, Source

if TYPE_CHECKING:  # -A's places are imported only by runs that judge them
    from .rounds import PlaceResult

PREFIX = "kvctl_gc"
_SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class MetricsError(KvcachedError):
    """The metrics file cannot be written where the operator asked."""


def _read_previous(path: str) -> str:
    """The current textfile's text ('' when there is none or it is not a file we may replace)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        with os.fdopen(os.dup(fd), encoding="utf-8", errors="replace") as f:
            return f.read(1 << 20)
    finally:
        os.close(fd)


class Sink(Protocol):
    """Somewhere besides the textfile that serves each run's metrics (kvcached.node.ops.metrics_http's endpoint)."""

    def previous(self) -> str:
        """The body it serves now ('' before the first run)."""

    def publish(self, body: str) -> None:
        """Serve `body` from now on."""


def previous_value(path: str, metric: str) -> float | None:
    """The value of an unlabelled `metric` in an existing textfile (to carry the last success across failed runs)."""
    return _value_in(_read_previous(path), metric)


def _value_in(text: str, metric: str) -> float | None:
    for line in text.splitlines():
        m = _SAMPLE_RE.match(line)
        if m and m.group(1) == metric and not m.group(2):
            try:
                return float(m.group(3))
            except ValueError:
                return None
    return None


Samples = Iterable[tuple[dict[str, str], float]]


def _metric(lines: list[str], name: str, kind: str, help_: str, samples: Samples, *, prefix: str = PREFIX) -> None:
    full = f"{prefix}_{name}"
    lines.append(f"# HELP {full} {help_}")
    lines.append(f"# TYPE {full} {kind}")
    for labels, value in samples:
        lab = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
        text = _number(value)
        lines.append(f"{full}{{{lab}}} {text}" if lab else f"{full} {text}")


def render(report: Report, *, success: bool, orphans: int = 0, last_success: float | None = None,
           started: float | None = None, blind: bool | None = None,
           places: Sequence[PlaceResult] | None = None, every: float | None = None) -> str:
    """The textfile body for one run; `started` (default: the report's) times the whole run.

    The entry metrics count kvcached's part of the report; a run that also
    judged the engines' leftovers adds their counts and bytes by engine and
    state (render_engines). Failures and the time limit are the whole run's. `blind`:
    whether the run could not see every process (sight.py); None writes no
    `kvctl_gc_blind` (a caller that did not ask). With `places` (gc -A:
    every place, the host's first), what is left by place kind
    (render_places); the counts above stay the host's. `every`: gc --every's
    DURATION, written as `kvctl_gc_every_seconds` by the agent's runs only, so
    that an alert can tell the agent (which must judge the engines) from a
    cron or systemd run.
    """
    lines: list[str] = []
    whole = report
    report = whole.part(Source.KVCACHED) or whole

    def metric(name: str, kind: str, help_: str, samples: Samples) -> None:
        _metric(lines, name, kind, help_, samples)

    kinds = [str(k) for k in Kind]
    metric("entries", "gauge", "Entries found by the last run, by kind and state.",
           [({"kind": k, "state": str(s)}, report.count(state=s, kind=Kind(k))) for k in kinds for s in State])
    metric("stale_entries", "gauge", "Stale entries left after the last run, by kind (0 when clean).",
           [({"kind": k}, sum(1 for e in report.stale_remaining if e.kind is Kind(k))) for k in kinds])
    metric("removed", "gauge", "Entries removed by the last run, by kind.",
           [({"kind": k}, report.count(action=Action.REMOVED, kind=Kind(k))) for k in kinds])
    metric("failures", "gauge", "Removals that failed in the last run.", [({}, len(whole.failures))])
    metric("orphaned_processes", "gauge", "Orphaned kvcached processes seen by the last run.", [({}, orphans)])
    metric("lock_busy", "gauge", _HELP["lock_busy"], [({}, 0)])  # this run held the lock (write_lock_busy)
    metric("timed_out", "gauge", "1 when the last run hit its time limit.", [({}, int(whole.timed_out))])
    if blind is not None:
        # 1 is an alert, not a state to live with: a blind run keeps what it cannot judge, forever (sight.py).
        metric("blind", "gauge", "1 when the last run could not read every process (no hostPID, hidepid, not "
               "root, a security module): what they may own was kept as unknown.", [({}, int(blind))])
    begun = whole.started if started is None else started
    metric("duration_seconds", "gauge", _HELP["duration_seconds"], [({}, round(whole.finished - begun, 6))])
    metric("last_run_timestamp_seconds", "gauge", _HELP["last_run_timestamp_seconds"],
           [({}, round(whole.finished, 3))])
    if every is not None:
        metric("every_seconds", "gauge", "gc --every's DURATION: the pause between the agent's runs (written by "
               "the agent's runs only).", [({}, every)])
    if success:
        last_success = whole.finished
    if last_success is not None:
        metric("last_success_timestamp_seconds", "gauge",
               "When a run last finished with no failures and no stale entries left.", [({}, round(last_success, 3))])
    engines = whole.part(Source.ENGINES)
    if engines is not None:
        lines.append(render_engines(engines).rstrip("\n"))
    if places is not None:
        lines.append(render_places(places).rstrip("\n"))
    return "\n".join(lines) + "\n"


def render_places(places: Sequence[PlaceResult]) -> str:
    """gc -A's metrics: places found, stale entries and bytes left by place kind, and the worst place's bytes.

    `places`: every place's result, the host's first (its report every
    source's). By kind, not by pod: a label per pod would be a series per pod
    that ever lived; kvctl_gc_engine_stale_bytes_max_place lets one alert
    catch the pod whose volume is filling (`kvctl inspect -A` names it).
    """
    from ..base.place import PlaceKind

    found = {k: 0 for k in PlaceKind}
    entries = {k: 0 for k in PlaceKind}
    held = {k: 0 for k in PlaceKind}
    worst = 0
    for r in places:
        left = r.report.stale_remaining if r.report is not None else []
        here = sum(e.bytes for e in left)
        found[r.place.kind] += 1
        entries[r.place.kind] += len(left)
        held[r.place.kind] += here
        if not r.place.is_host:
            worst = max(worst, here)
    lines: list[str] = []
    _metric(lines, "places", "gauge", "Places the last run judged (gc -A), by kind.",
            [({"place_kind": str(k)}, n) for k, n in found.items()])
    _metric(lines, "place_stale_entries", "gauge", "Stale entries left after the last run, by place kind.",
            [({"place_kind": str(k)}, n) for k, n in entries.items()])
    _metric(lines, "place_stale_bytes", "gauge",
            "Bytes the stale engine leftovers left after the last run hold, by place kind.",
            [({"place_kind": str(k)}, n) for k, n in held.items()])
    _metric(lines, "engine_stale_bytes_max_place", "gauge",
            "The most bytes stale engine leftovers left after the last run hold in one place other than the host's.",
            [({}, worst)])
    return "\n".join(lines) + "\n"


# Each place's series carry these labels (an empty one is no label to Prometheus): what names the place's pod,
# and `volume` and `device`, without which two volumes of one pod, or two places of no pod, would be one series.
PLACE_LABELS = ("kind", "pod_uid", "pod", "namespace", "container", "volume", "device")


def render_place_fill(places: Sequence[PlaceResult]) -> str:
    """Every place's size, use and stale bytes left (kvctl_place_*): one series per place this run found.

    The series of a place that is gone are not written again: the textfile and
    the endpoint's body are replaced whole by each run, so the cardinality is
    this node's places, never every pod that ever lived. Places that are one
    filesystem under the same labels (two PrivateTmp= directories of the root
    filesystem) are one series, their stale bytes summed. An unmeasured fill
    writes no size and no use, and a run that did not judge the engines'
    leftovers no stale bytes (no series is no false zero: render_engines).
    """
    from ..places.fill import measure

    rows: dict[tuple[str, ...], list[int | None]] = {}
    for r in places:
        fill = r.fill if r.fill is not None else measure(r.place)
        p = r.place
        labels = (str(p.kind), p.pod_uid or "", p.pod or "", p.namespace or "", p.container or "", p.volume or "",
                  fill.device or "")
        judged = r.report is not None and r.report.part(Source.ENGINES) is not None
        left = sum(e.bytes for e in r.report.stale_remaining) if r.report is not None and judged else None
        row = rows.setdefault(labels, [fill.capacity_bytes, fill.used_bytes, None])
        if left is not None:
            row[2] = (row[2] or 0) + left

    lines: list[str] = []
    for i, (name, help_) in enumerate((
            ("capacity_bytes", "The size of each place's filesystem (statvfs), by place."),
            ("used_bytes", "What each place's filesystem has in use (statvfs), by place."),
            ("stale_bytes", "Bytes the dead leftovers left in each place after the last run hold (written by "
             "runs that judged them)."))):
        samples = [({k: v for k, v in zip(PLACE_LABELS, labels) if v}, value)
                   for labels, row in rows.items() if (value := row[i]) is not None]
        if samples:
            _metric(lines, name, "gauge", help_, samples, prefix="kvctl_place")
    return "\n".join(lines) + "\n" if lines else ""


def render_engines(report: Report) -> str:
    """The engine leftovers' metrics: entries and bytes by engine and state, what was removed, what is left.

    Written only by runs that judged them (gc --engines). A plain run writes
    none of them, not zeros: zeros would tell an alert on
    kvctl_gc_engine_stale_bytes that the node is clean when nobody looked
    (alert on absent(kvctl_gc_engine_entries) where the engine pass must run).
    """
    lines: list[str] = []
    pairs = [(g, s) for g in Engine for s in State]
    _metric(lines, "engine_entries", "gauge", "Engine leftovers found by the last run, by engine and state.",
            [({"engine": str(g), "state": str(s)}, report.count(engine=g, state=s)) for g, s in pairs])
    _metric(lines, "engine_bytes", "gauge",
            "Bytes the engine leftovers found by the last run hold (allocated blocks), by engine and state.",
            [({"engine": str(g), "state": str(s)}, report.bytes(engine=g, state=s)) for g, s in pairs])
    _metric(lines, "engine_removed", "gauge", "Engine leftovers removed by the last run, by engine.",
            [({"engine": str(g)}, report.count(engine=g, action=Action.REMOVED)) for g in Engine])
    _metric(lines, "engine_removed_bytes", "gauge", "Bytes freed by the last run's removals, by engine.",
            [({"engine": str(g)}, report.bytes(engine=g, action=Action.REMOVED)) for g in Engine])
    left = report.stale_remaining
    _metric(lines, "engine_stale_entries", "gauge", "Stale engine leftovers left after the last run, by engine.",
            [({"engine": str(g)}, sum(1 for e in left if e.engine is g)) for g in Engine])
    _metric(lines, "engine_stale_bytes", "gauge", "Bytes the stale engine leftovers left after the last run hold.",
            [({"engine": str(g)}, sum(e.bytes for e in left if e.engine is g)) for g in Engine])
    return "\n".join(lines) + "\n"


_KINDS = {stat.S_IFLNK: "a symbolic link", stat.S_IFDIR: "a directory", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket"}


def refuse_non_file(path: str) -> None:
    """Raise MetricsError when something that is not a regular file sits at `path`; anything else is left to the write.

    gc asks this before any work: `--prometheus /dev/null` is a mistake in the
    command line, said before the run. A target that merely cannot be written
    (its directory missing, permissions, a read-only or full filesystem) is
    found by the write, after the run has done and reported its work.
    """
    try:
        st = os.lstat(path)
    except OSError:
        return
    _refuse(path, st)


def check_target(path: str) -> None:
    """Raise MetricsError unless `path` is absent or a regular file we may replace.

    The file is replaced by rename: where a device, a FIFO, a link or a
    directory sits (`--prometheus /dev/null`), renaming over it would destroy it.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise MetricsError(f"{path}: cannot write metrics ({e.strerror})") from None
    _refuse(path, st)


def _refuse(path: str, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        kind = _KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file")
        raise MetricsError(f"{path} is {kind}, not a regular file: metrics are not written over it; give a "
                           "regular file's path (node_exporter reads *.prom files in its textfile directory)")


def write_textfile(path: str, body: str) -> None:
    """Replace `path` with `body` atomically; readers see the old file or the new one, never a mix."""
    from ..base.files import replace_file

    check_target(path)
    try:
        replace_file(path, body, check=lambda: check_target(path))
    except FileNotFoundError:
        # The common case on a node without node_exporter (or with Debian's, which reads
        # /var/lib/prometheus/node-exporter): said as what it is, not as errno's words.
        directory = os.path.dirname(os.path.abspath(path)) or "."
        raise MetricsError(f"{path}: cannot write metrics: the directory {directory} does not exist (is "
                           "node_exporter's textfile collector set up here? --prometheus names a file in its "
                           "--collector.textfile.directory)") from None
    except OSError as e:  # a MetricsError from the check is no OSError: it goes on as it is
        why = e.strerror or errno.errorcode.get(e.errno or 0, str(e))
        raise MetricsError(f"{path}: cannot write metrics ({why})") from None


def _previous_text(path: str | None, sink: Sink | None) -> str:
    """The last run's metrics: the sink's once it has served a run (it gets each body first), else the textfile's.

    The textfile outlives the process, so a new loop's first run carries the
    last success of the one before it.
    """
    previous = sink.previous() if sink is not None else ""
    return previous or (_read_previous(path) if path else "")


def _put(path: str | None, sink: Sink | None, body: str) -> None:
    if sink is not None:  # first: a textfile that cannot be written must not leave the endpoint a run behind
        sink.publish(body)
    if path:
        write_textfile(path, body)


def write_report(path: str | None, report: Report, *, success: bool, orphans: int = 0,
                 started: float | None = None, sink: Sink | None = None,
                 blind: bool | None = None, gpu: Any = None, places: Sequence[PlaceResult] | None = None,
                 every: float | None = None, fills: Sequence[PlaceResult] = ()) -> None:
    """Render one run's metrics to the textfile `path` and/or `sink`, keeping the last success of failed runs.

    `gpu` (a gpu.GpuReport, from runs that judged engines) adds the GPU holders' metrics; `fills` (every
    place the run judged, with -A or without) each place's size and use (render_place_fill)."""
    last = _value_in(_previous_text(path, sink), f"{PREFIX}_last_success_timestamp_seconds")
    body = render(report, success=success, orphans=orphans, last_success=last, started=started, blind=blind,
                  places=places, every=every)
    if gpu is not None:
        from ..gpu.metrics import render_gpu

        body += render_gpu(gpu)
    if fills:
        body += render_place_fill(fills)
    _put(path, sink, body)


_RUN_METRICS = {f"{PREFIX}_{m}": m for m in ("lock_busy", "duration_seconds", "last_run_timestamp_seconds")}


def write_lock_busy(path: str | None, started: float, finished: float, *, sink: Sink | None = None) -> None:
    """A run that found the lock busy: say so, and keep every count the last real run wrote.

    Writing zeros would tell an alert on `kvctl_gc_stale_entries` that the node
    is clean while another run (or a stuck one) holds the lock.
    """
    values = {"lock_busy": 1.0, "duration_seconds": round(finished - started, 6),
              "last_run_timestamp_seconds": round(finished, 3)}
    seen: set[str] = set()
    lines: list[str] = []
    for line in _previous_text(path, sink).splitlines():
        m = _SAMPLE_RE.match(line)
        if m and m.group(1) in _RUN_METRICS and not m.group(2):
            short = _RUN_METRICS[m.group(1)]
            seen.add(short)
            line = f"{m.group(1)} {_number(values[short])}"
        lines.append(line)
    for short in ("lock_busy", "duration_seconds", "last_run_timestamp_seconds"):
        if short not in seen:
            full = f"{PREFIX}_{short}"
            lines += [f"# HELP {full} {_HELP[short]}", f"# TYPE {full} gauge", f"{full} {_number(values[short])}"]
    _put(path, sink, "\n".join(lines) + "\n")


_HELP = {"lock_busy": "1 when the last run found another gc holding the lock.",
         "duration_seconds": "Wall time of the last run, from start to finish.",
         "last_run_timestamp_seconds": "When the last run finished."}


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e15 else repr(float(value))
