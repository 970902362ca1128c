"""Output: one layout for both terminals and pipes; colour only on a terminal without NO_COLOR.

Lines and tables are laid out here as plain text (so pipes, cron mail and
tests see exactly what a terminal shows, minus colour); on a terminal the same
cells are printed through rich with styles. Every string that came from the
node (names, paths, command lines) goes through `safe`, so a file named with
terminal escape sequences cannot drive the operator's terminal.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Sequence
from itertools import repeat
from typing import IO, TYPE_CHECKING, Any, Union

from kvcached.node import Action, Kind, State

if TYPE_CHECKING:
    from kvcached.node import Entry, NodeView, Report

Cell = Union[str, tuple[str, str]]  # text, or (text, style)

# The colour of each state, action and doctor status, by its value (what JSON documents carry too).
STATE_STYLE = {"live": "green", "stale": "red", "unknown": "yellow", "young": "cyan", "foreign": "magenta",
               "ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim",
               "removed": "red", "would_remove": "red", "kept": "dim", "failed": "bold red"}


def safe(text: object) -> str:
    """Neutralise control and format characters (ESC, CR, bidi overrides) and undecodable bytes as escapes."""
    s = str(text)
    if s.isprintable():
        return s
    import unicodedata  # only for the rare name that is not printable as it is

    out = []
    for ch in s:
        o = ord(ch)
        if 0xDC80 <= o <= 0xDCFF:  # surrogateescape'd byte from a non-UTF-8 file name
            out.append(f"\\x{o - 0xDC00:02x}")
        elif ch == " " or (unicodedata.category(ch) not in ("Cc", "Cf", "Cs", "Zl", "Zp", "Co", "Cn")):
            out.append(ch)
        elif o < 0x100:
            out.append(f"\\x{o:02x}")
        else:
            out.append(f"\\u{o:04x}")
    return "".join(out)


def styled_default(stream: IO[str]) -> bool:
    """Colour only on a terminal, and never with NO_COLOR set or TERM=dumb (https://no-color.org)."""
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def error_line(message: str) -> None:
    """One line on stderr: `kvctl: <message>`."""
    text = " ".join(safe(message).split("\\x0a"))
    print(f"kvctl: {text}", file=sys.stderr, flush=True)


def note(message: str) -> None:
    """A message for the operator (stderr, so stdout stays data)."""
    print(safe(message), file=sys.stderr, flush=True)


def emit_json(obj: Any, stream: IO[str] | None = None, *, one_line: bool = False) -> None:
    """One JSON document on stdout (machine output); `one_line`: compact even on a terminal (a line per run)."""
    import json

    stream = stream or sys.stdout
    # Indented for a person at a terminal; compact for scripts, because only the
    # compact form takes the C encoder (far faster on a full node; bench/README.md),
    # and a report's entries their own encoder (documents.EntryRows).
    if stream.isatty() and not one_line:
        text = json.dumps(obj, indent=2, default=str)
    else:
        from .documents import json_text

        text = json_text(obj)
    stream.write(text + "\n")
    stream.flush()


def is_terminal(stream: IO[str]) -> bool:
    """A terminal, whatever NO_COLOR says: live views redraw in place on one, colour or not."""
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False


class Out:
    """Text output to one stream.

    On a terminal, tables fit its width (rich tables: columns fold, none is
    lost) and `styled` adds colour (not with NO_COLOR); elsewhere every line is
    plain text with aligned columns, the same layout pipes, logs and tests see.
    """

    def __init__(self, stream: IO[str] | None = None, styled: bool | None = None,
                 terminal: bool | None = None, width: int | None = None) -> None:
        self.stream = stream or sys.stdout
        self.styled = styled_default(self.stream) if styled is None else styled
        self.terminal = is_terminal(self.stream) if terminal is None else terminal
        self.width = width  # None: the terminal's
        self._console: Any = None

    @property
    def console(self) -> Any:
        if self._console is None:
            from rich.console import Console

            self._console = Console(file=self.stream, highlight=False, markup=False, emoji=False,
                                    soft_wrap=not self.terminal, force_terminal=(self.styled or self.terminal) or None,
                                    no_color=not self.styled, width=self.width)
        return self._console

    def line(self, *cells: Cell, indent: int = 0) -> None:
        parts = [(safe(c), "") if isinstance(c, str) else (safe(c[0]), c[1]) for c in cells]
        self._write([(" " * indent, "")] + parts)

    def blank(self) -> None:
        self._write([])

    def table(self, headers: Sequence[str], rows: Sequence[Sequence[Cell]], indent: int = 2,
              fold: Sequence[int] = ()) -> None:
        """Aligned columns; on a terminal a rich table as wide as the terminal, columns in `fold` wrapping."""
        if self.terminal:
            cooked = [[(safe(c), "") if isinstance(c, str) else (safe(c[0]), c[1]) for c in row] for row in rows]
            self._rich_table(headers, cooked, indent, set(fold) or {len(headers) - 1})
            return
        self._aligned(headers, rows, indent)

    def _aligned(self, headers: Sequence[str], rows: Sequence[Sequence[Cell]], indent: int) -> None:
        """`table` off a terminal: every cell padded to its column's width but the last, no trailing blanks.

        Made a column at a time, since gc writes a row per entry: a column is made safe (one printable as
        a whole is printable cell by cell), padded and joined by C-level maps, not by Python code per cell.
        A short row is filled with empty cells: the blanks they add trail, and go with the others.
        """
        n = len(headers)
        lengths = [len(row) for row in rows]
        if any(k != n for k in lengths):
            rows = [[*row, *[""] * (n - len(row))] for row in rows]
        columns: list[Sequence[str]] = []
        styles: list[Iterable[str]] = []
        for column in zip(*rows):
            texts: Sequence[Any] = column
            plain = set(map(type, column)) == {str}
            if not plain:  # styled cells (text, style)
                texts = [c if isinstance(c, str) else str(c[0]) for c in column]
            columns.append(texts if "".join(texts).isprintable() else [safe(c) for c in texts])
            styles.append(repeat("") if plain else [c[1] if isinstance(c, tuple) else "" for c in column])
        widths = [max(len(h), *map(len, texts)) for h, texts in zip(headers, columns)] or list(map(len, headers))
        pad = " " * indent
        padded = [list(map(str.ljust, texts, repeat(w))) for texts, w in zip(columns[:-1], widths)] + columns[-1:]
        header = "  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()
        if self.styled:
            self._write([(pad, ""), (header, "bold")])
            for r, (k, cells, looks) in enumerate(zip(lengths, zip(*padded), zip(*styles))):
                segs: list[tuple[str, str]] = [(pad, "")]
                for i in range(k):  # a short row as it was given: its own last cell unpadded
                    segs += [("  ", "")] if i else []
                    segs.append((cells[i] if i < k - 1 else columns[i][r], looks[i]))
                self._write(segs)
            return
        lines = [(pad + header).rstrip()]
        lines += map(str.rstrip, map(pad.__add__, map("  ".join, zip(*padded))))
        self.stream.write("\n".join(lines) + "\n")

    def _rich_table(self, headers: Sequence[str], rows: list[list[tuple[str, str]]], indent: int,
                    fold: set[int]) -> None:
        from rich.padding import Padding
        from rich.table import Table

        t = Table(box=None, show_header=True, header_style="bold" if self.styled else None, pad_edge=False,
                  padding=(0, 2, 0, 0), expand=False)
        for i, h in enumerate(headers):
            # Short columns never wrap (a count split over two lines reads as two numbers);
            # the long ones (names, paths, details) fold to fit the width.
            t.add_column(h, no_wrap=i not in fold, overflow="fold" if i in fold else "ellipsis",
                         min_width=len(h))
        for row in rows:
            t.add_row(*[self._text(text, style) for text, style in row])
        self.console.print(Padding(t, (0, 0, 0, indent)) if indent else t)

    def _text(self, text: str, style: str) -> Any:
        from rich.text import Text

        return Text(text, style=(style or "") if self.styled else "")

    def _write(self, segs: list[tuple[str, str]]) -> None:
        if not self.styled and not self.terminal:
            self.stream.write("".join(t for t, _ in segs).rstrip() + "\n")
            return
        from rich.text import Text

        text = Text()
        for t, style in segs:
            text.append(t, style=(style or "") if self.styled else "")
        self.console.print(text)

    def flush(self) -> None:
        self.stream.flush()


def state_cell(state: str) -> Cell:
    """A state, action or check status, in its colour."""
    return (str(state), STATE_STYLE.get(state, ""))


def size_cells(r: dict[str, Any]) -> list[Cell]:
    """LIMIT, USED, PREALLOC, FREE of a `list` row; a negative value is shown as the impossible value it is."""
    from kvcached.node import format_size

    def cell(v: int | None) -> Cell:
        return (f"{v}!", "bold red") if v is not None and v < 0 else format_size(v)

    return [cell(r["limit_bytes"]), cell(r["used_bytes"]), cell(r["prealloc_bytes"]), cell(r["free_bytes"])]


# shapes shared by several commands ------------------------------------------

def pids(values: Any) -> str:
    """`1,2,3,4,+5`: a short PID list for tables."""
    items = list(values)
    return ",".join(map(str, items[:4])) + (f",+{len(items) - 4}" if len(items) > 4 else "")


def _entry_label(e: Entry, base: str | None) -> str:
    path = e.path
    if base and path.startswith(base + "/"):
        path = path[len(base) + 1:]
    return path + ("/" if e.kind is Kind.DIRECTORY else "")


def render_view(out: Out, view: NodeView, *, now: float, hint: Callable[[str], str] = lambda c: f"kvctl {c}") -> None:
    """inspect's text; `hint` turns a command into the line to print (with the run's --root, --min-age)."""
    from kvcached.node import format_duration, format_size

    if not view.deployments and not view.unowned:
        out.line(f"No kvcached state under {view.layout.root}.")
    serves = view.serves()
    for d in (d for ranks in serves.values() for d in ranks):
        ranks = serves[d.serve]
        if len(ranks) > 1 and d is ranks[0]:
            out.line(("Serve ", "bold"), (d.serve, "bold"), f"  data parallel: {len(ranks)} ranks here "
                     f"({', '.join(r.name for r in ranks)})")
        orphan_note = f", {len(d.orphans)} orphaned" if d.orphans else ""
        out.line(("Deployment ", "bold"), (d.name, "bold"), "  ", state_cell(d.state),
                 f"  ({len(d.processes)} process{'es' if len(d.processes) != 1 else ''}{orphan_note})")
        seg = d.segment_entry()
        if seg is not None:
            if d.segment:
                nums = (f"limit {format_size(d.segment.total)}  used {format_size(d.segment.used)}  "
                        f"prealloc {format_size(d.segment.prealloc)}")
            else:
                nums = d.segment_error or f"not read ({seg.state}: {seg.decision.reason})"
            out.line(f"segment {seg.path}  {nums}  age {format_duration(now - seg.candidate.mtime)}  "
                     f"uid {seg.candidate.uid}", indent=2)
        sock_root = next((e for e in d.entries if e.kind is Kind.DIRECTORY and e.candidate.stage is None), None)
        rows = []
        for e in d.entries:
            base = sock_root.path if sock_root is not None and e is not sock_root else None
            rows.append([str(e.kind), _entry_label(e, base), state_cell(e.state), str(e.decision.reason),
                         pids(d.pids_of(e)) or "-", e.decision.detail])
        out.table(["KIND", "ENTRY", "STATE", "REASON", "PIDS", "DETAIL"], rows)
        if d.processes:
            prows = []
            for p in d.processes:
                stage = "" if p.role.stage is None else f" PP{p.role.stage}"
                rank = "-" if p.role.rank is None else f"TP{p.role.rank}{stage}"
                status: Cell = ("orphaned: " + p.orphan_reason, "bold yellow") if p.orphaned else "running"
                prows.append([str(p.pid), str(p.role.role), p.role.title, rank, str(p.info.ppid), p.via, status])
            out.table(["PID", "ROLE", "TITLE", "RANK", "PPID", "TIED BY", "STATUS"], prows)
        else:
            out.line("no processes of this deployment are alive", indent=2)
        out.blank()
    if view.unowned:
        out.line(("Not part of any deployment", "bold"))
        out.table(
            ["KIND", "PATH", "STATE", "REASON", "DETAIL"],
            [
                [str(e.kind), e.path, state_cell(e.state), str(e.decision.reason), e.decision.detail]
                for e in view.unowned
            ],
        )
        out.blank()
    if view.orphans:
        killable = {p.pid for _, p in view.killable_orphans()}
        orphan_pids = ", ".join(str(p.pid) for _, p in view.orphans)
        out.line(
            ("hint: ", "yellow"),
            f"orphaned process(es) {orphan_pids}"
            + (
                f": {hint('gc --kill-orphans')} terminates them"
                if killable
                else ": not killable by kvctl (engine alive or /proc incomplete)"
            ),
        )
    for ns in view.namespaces:
        names = f" ({', '.join(ns.names)})" if ns.names else ""
        out.line(
            ("note: ", "yellow"),
            f"kvcached processes in another mount namespace{names}: PIDs {pids(ns.pids)}; "
            f"their /tmp or /dev/shm is not this one: {hint(f'inspect --pid {ns.hint_pid}')}",
        )
    if view.incomplete:
        out.line(
            ("note: ", "yellow"),
            f"could not fully read PIDs {pids(view.incomplete)}: state they could own is kept as unknown",
        )
    for err in view.errors:
        out.line(("error: ", "red"), err)
    if view.deployments:
        from collections import Counter

        by_state = Counter(str(d.state) for d in view.deployments)
        stale = sum(1 for d in view.deployments for e in d.entries if e.state is State.STALE)
        stale += sum(1 for e in view.unowned if e.state is State.STALE)
        line = f"{len(view.deployments)} deployment(s): " + ", ".join(f"{n} {s}" for s, n in sorted(by_state.items()))
        out.line(
            line
            + (f"; {stale} stale entr{'y' if stale == 1 else 'ies'}: {hint('gc --yes')} removes them" if stale else "")
        )


_VERBS = {Action.REMOVED: "Removed", Action.WOULD_REMOVE: "Would remove", Action.KEPT: "Kept", Action.FAILED: "FAILED"}


def render_report(out: Out, report: Report, *, verbose: bool, by_deployment: bool = False,
                  summary: bool = True) -> None:
    """gc's and delete's report: a row per entry (live ones only with -v), or one per deployment; then the summary."""
    if by_deployment and not verbose:
        render_by_deployment(out, report)
    else:
        rows: list[list[Any]] = []
        # A row's parts from its decision, action and note, made once per decision (entries share them).
        parts: dict[tuple[int, Action, str], tuple[Cell, Cell, str, str]] = {}
        for e in report.entries:
            d, action = e.decision, e.action
            if action is Action.KEPT and d.state is State.LIVE and not verbose:
                continue
            key = (id(d), action, e.note)  # the decisions live as long as the entries that hold them
            part = parts.get(key)
            if part is None:
                verb: Cell = (_VERBS[action], STATE_STYLE.get(action._value_, ""))
                part = parts[key] = (verb, state_cell(d.state._value_), d.reason._value_,
                                     d.detail + (f"; {e.note}" if e.note else ""))
            rows.append([part[0], e.candidate.kind._value_, e.path, part[1], part[2], part[3]])
        if rows:
            out.table(["ACTION", "KIND", "PATH", "STATE", "REASON", "DETAIL"], rows, indent=0, fold=(2, 5))
    if summary:
        out.line(summary_line(report) + (f" [{report.summary()['seconds']}s]" if verbose else ""))
    for err in report.errors:
        out.line(("error: ", "red"), err)


def render_by_deployment(out: Out, report: Report) -> None:
    """One row per deployment: what is (or would be) removed, kept and why, failed. Fits a screen at any node size."""
    from collections import Counter

    acted: dict[str, Counter[Action]] = {}
    why: dict[str, Counter[str]] = {}
    for e in report.entries:
        dep = e.candidate.deployment or "(none)"
        acted.setdefault(dep, Counter())[e.action] += 1
        if e.action is Action.KEPT:
            why.setdefault(dep, Counter())[f"{e.state}: {e.decision.reason}"] += 1
    verb = "WOULD REMOVE" if report.dry_run else "REMOVED"
    rows: list[list[Cell]] = []
    for dep in sorted(acted):
        c = acted[dep]
        gone = c[Action.WOULD_REMOVE] + c[Action.REMOVED]
        kept = ", ".join(f"{n} {w}" for w, n in sorted(why.get(dep, Counter()).items()))
        rows.append(
            [
                dep,
                (str(gone), "red") if gone else "0",
                str(c[Action.KEPT]),
                (str(c[Action.FAILED]), "bold red") if c[Action.FAILED] else "0",
                kept or "-",
            ]
        )
    if rows:
        out.table(["DEPLOYMENT", verb, "KEPT", "FAILED", "KEPT BECAUSE"], rows, indent=0, fold=(0, 4))


def summary_line(report: Report) -> str:
    """`gc: removed 3, kept 2 (2 live), 1 failed; time limit reached`."""
    s = report.summary()
    acts, states = s["actions"], s["states"]
    assert isinstance(acts, dict) and isinstance(states, dict)
    kept_bits = ", ".join(f"{states[k]} {k}" for k in ("live", "unknown", "young", "foreign") if states[k])
    verb = "would remove" if report.dry_run else "removed"
    count = acts["would_remove"] if report.dry_run else acts["removed"]
    line = f"gc: {verb} {count}, kept {acts['kept']}" + (f" ({kept_bits})" if kept_bits else "")
    line += f", {acts['failed']} failed" if acts["failed"] else ""
    stale_kept = sum(1 for e in report.stale_remaining if e.action is not Action.FAILED)
    line += f", {stale_kept} stale kept" if stale_kept and not report.dry_run else ""
    return line + ("; time limit reached" if report.timed_out else "")


# Problems for a log ------------------------------------------------------------

# sd-daemon(3) priorities: journald reads a "<N>" prefix on a line of a unit's stderr.
_PRIORITY = {"error": 3, "warning": 4, "info": 6}


def _journald() -> bool:
    """stderr goes straight to journald (JOURNAL_STREAM names that very stream), so it timestamps lines itself."""
    value = os.environ.get("JOURNAL_STREAM", "")
    try:
        dev, ino = (int(x) for x in value.split(":"))
        st = os.fstat(sys.stderr.fileno())
    except (ValueError, OSError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def log_line(message: str, level: str = "info") -> None:
    """One line for cron's log or journald on stderr: a timestamp (cron) or a priority prefix (journald)."""
    text = safe(message)
    if _journald():
        print(f"<{_PRIORITY[level]}>{text}", file=sys.stderr, flush=True)
    else:
        import time as _time

        stamp = _time.strftime("%Y-%m-%dT%H:%M:%S%z")
        print(f"{stamp} {text}", file=sys.stderr, flush=True)


def log_report(report: Report, command: str = "kvctl gc") -> None:
    """What cron (stdout to /dev/null) must still see: every failure, a time limit, and the summary."""
    for e in report.failures:
        log_line(f"{command}: FAILED {e.kind} {e.path}: {e.note or e.decision.detail}", "error")
    if report.timed_out:
        left = sum(1 for e in report.entries if e.note == "time limit reached")
        log_line(f"{command}: time limit reached; {left} entries not reached (kept)", "warning")
    for err in report.errors:
        log_line(f"{command}: error: {err}", "warning")
    level = "error" if report.failures else "warning" if report.stale_remaining else "info"
    log_line(f"{command}: {summary_line(report)[4:]}", level)
