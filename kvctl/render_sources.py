"""One report's text, section by section: each source its table, summary line and log lines.

A report (kvcached.node.clean.report) holds every source a run judged, each in one
part; gc's output, --every's line and cron's log walk those parts, and each
source's section is rendered by its own helpers: kvcached's by render.py
(render_report, summary_line, log_report), the engines' leftovers here, with
the same cells and colours (render.Out, state_cell) and the columns engine
entries add (ENGINE, BYTES: the memory an entry really holds). inspect's
section on the engines' leftovers is here too (render_engine_view).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvcached.node import Action, Source, State

from .render import STATE_STYLE, Cell, Out, log_line, log_report, pids, render_report, state_cell, summary_line

if TYPE_CHECKING:
    from kvcached.node import Entry, Report

_VERBS = {Action.REMOVED: "Removed", Action.WOULD_REMOVE: "Would remove", Action.KEPT: "Kept", Action.FAILED: "FAILED"}
TITLE = ("Engine leftovers (vLLM, SGLang, NCCL, CUDA IPC, torch, Python's semaphores: not kvcached's; each on "
         "its own evidence)")


def _size(n: int) -> str:
    from kvcached.node import format_size

    return format_size(n)


def _kept_bits(counts: Counter[State]) -> str:
    return ", ".join(f"{counts[s]} {s}" for s in (State.LIVE, State.UNKNOWN, State.YOUNG, State.FOREIGN)
                     if counts[s])


def render_run(out: Out, report: Report, *, verbose: bool, grouped: bool = False, summary: bool = True) -> None:
    """gc's report: each source's table (a row per entry, or with `grouped` per deployment or engine) and summary
    (`summary=False`: the tables only, where each summary is said once, as its log line)."""
    for source in report.sources:
        part = report.part(source)
        assert part is not None
        if source is Source.KVCACHED:
            render_report(out, part, verbose=verbose, by_deployment=grouped, summary=summary)
        else:
            render_engine_report(out, part, verbose=verbose, by_engine=grouped, summary=summary)


def run_line(report: Report) -> str:
    """One line for the whole run (--every): each source's summary, kvcached's first."""
    bits = []
    for source in report.sources:
        part = report.part(source)
        assert part is not None
        bits.append(summary_line(part)[4:] if source is Source.KVCACHED else engine_summary_line(part))
    return "; ".join(bits)


def log_run(report: Report, command: str = "kvctl gc") -> None:
    """What cron must still see of every source: failures, a time limit, errors, and each summary."""
    for source in report.sources:
        part = report.part(source)
        assert part is not None
        if source is Source.KVCACHED:
            log_report(part, command)
        else:
            log_engine_report(part, command)


def render_engine_view(out: Out, entries: Sequence[Entry[Any]], hint: Callable[[str], str]) -> None:
    """inspect's section: one row per engine leftover, then what gc --engines would free."""
    if not entries:
        return
    out.line((TITLE, "bold"))
    rows: list[list[Cell]] = [
        [str(e.engine), str(e.kind), e.path, state_cell(e.state), str(e.decision.reason), _size(e.bytes),
         pids(e.decision.pids) or "-", e.decision.detail] for e in entries]
    out.table(["ENGINE", "KIND", "PATH", "STATE", "REASON", "BYTES", "PIDS", "DETAIL"], rows, fold=(2, 7))
    stale = [e for e in entries if e.state is State.STALE]
    by_state = Counter(e.state for e in entries)
    line = f"{len(entries)} engine leftover(s): " + ", ".join(f"{n} {s}" for s, n in sorted(by_state.items()))
    if stale:
        line += f"; {hint('gc --engines --yes')} removes the stale, {_size(sum(e.bytes for e in stale))} in all"
    out.line(line)
    out.blank()


def render_engine_report(out: Out, report: Report, *, verbose: bool, by_engine: bool = False,
                         summary: bool = True) -> None:
    """gc --engines' part of the report: a row per entry (live ones only with -v) or per engine; its summary."""
    if by_engine and not verbose:
        _by_engine(out, report)
    else:
        rows: list[list[Any]] = []
        for e in report.entries:
            if e.action is Action.KEPT and e.state is State.LIVE and not verbose:
                continue
            detail = e.decision.detail + (f"; {e.note}" if e.note else "")
            rows.append([(_VERBS[e.action], STATE_STYLE.get(e.action, "")), str(e.engine), str(e.kind), e.path,
                         state_cell(e.state), str(e.decision.reason), _size(e.bytes), detail])
        if rows:
            out.table(["ACTION", "ENGINE", "KIND", "PATH", "STATE", "REASON", "BYTES", "DETAIL"], rows, indent=0,
                      fold=(3, 7))
    if summary:
        out.line("gc: " + engine_summary_line(report))


def _by_engine(out: Out, report: Report) -> None:
    verb = "WOULD REMOVE" if report.dry_run else "REMOVED"
    rows: list[list[Cell]] = []
    for engine in sorted({e.candidate.engine for e in report.entries}):
        mine = [e for e in report.entries if e.engine is engine]
        gone = [e for e in mine if e.action in (Action.REMOVED, Action.WOULD_REMOVE)]
        kept = Counter(f"{e.state}: {e.decision.reason}" for e in mine if e.action is Action.KEPT)
        failed = sum(e.action is Action.FAILED for e in mine)
        rows.append([str(engine), (str(len(gone)), "red") if gone else "0", _size(sum(e.bytes for e in gone)),
                     str(sum(kept.values())), (str(failed), "bold red") if failed else "0",
                     ", ".join(f"{n} {w}" for w, n in sorted(kept.items())) or "-"])
    if rows:
        out.table(["ENGINE", verb, "BYTES", "KEPT", "FAILED", "KEPT BECAUSE"], rows, indent=0, fold=(5,))


def engine_summary_line(report: Report) -> str:
    """`engine leftovers: removed 3 (1.2G), kept 4 (2 live, 2 unknown)`: the memory the removed ones held."""
    gone = Action.WOULD_REMOVE if report.dry_run else Action.REMOVED
    kept = Counter(e.state for e in report.entries if e.action is Action.KEPT)
    bits = _kept_bits(kept)
    n = report.count(action=gone)
    line = (f"engine leftovers: {'would remove' if report.dry_run else 'removed'} {n}"
            + (f" ({_size(report.bytes(action=gone))})" if n else "")
            + f", kept {sum(kept.values())}" + (f" ({bits})" if bits else ""))
    failed = report.count(action=Action.FAILED)
    line += f", {failed} failed" if failed else ""
    stale_kept = sum(1 for e in report.stale_remaining if e.action is not Action.FAILED)
    line += f", {stale_kept} stale kept" if stale_kept and not report.dry_run else ""
    return line + ("; time limit reached" if report.timed_out else "")


def log_engine_report(report: Report, command: str = "kvctl gc") -> None:
    """What cron must still see of the engine pass: every failure, and its summary (render.log_report's twin)."""
    for e in report.failures:
        log_line(f"{command}: FAILED {e.kind} {e.path}: {e.note or e.decision.detail}", "error")
    level = "error" if report.failures else "warning" if report.stale_remaining else "info"
    log_line(f"{command}: {engine_summary_line(report)}", level)
