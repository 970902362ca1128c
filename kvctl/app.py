"""kvctl: find, explain and safely remove kvcached state on a node.

Thin commands over the kvcached core library: each parses its options, calls
one or two library operations, renders, and returns an exit code (exitcodes.py).
The library is imported inside the commands, so `--help` and completion stay
light; nothing here imports torch, vLLM, the compiled extension or kvcached's
runtime, except `limit-percent`, which needs torch to read GPU memory.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer
from typer.core import TyperCommand, TyperGroup

from . import helpfmt, render
from .exitcodes import CliError, Exit, handle
from .render import Out, emit_json, note, state_cell

if TYPE_CHECKING:
    from kvcached.node.cleanup import Entry, Plan, Report
    from kvcached.node.layout import Layout
    from kvcached.node.view import NodeView


@dataclass
class Globals:
    """Options given before (or after) the command (`kvctl --root DIR -v gc`)."""

    root: str = "/"
    verbose: int = 0
    json: bool = False  # --json anywhere on the line: errors are JSON objects on stdout too

    def prefix(self) -> str:
        """`kvctl` with this run's global options (`kvctl --root DIR`)."""
        return " ".join(["kvctl"] + (["--root", _quote(self.root)] if self.root != "/" else []))

    def hinter(self, min_age: float | None = None) -> Callable[[str], str]:
        """Command lines for hints, with this run's options: pasted as printed, they act on the same node."""
        from kvcached.node.decide import DEFAULT_GRACE

        age = f" --min-age {min_age:g}" if min_age is not None and min_age != DEFAULT_GRACE else ""

        def hint(command: str) -> str:
            return f"{self.prefix()} {command}{age if command.split()[0] in ('gc', 'inspect', 'delete') else ''}"

        return hint


G = Globals()


def _quote(text: str) -> str:
    import shlex

    return shlex.quote(text)


_VERBOSE = re.compile(r"-v+\Z")


def hoist_globals(argv: list[str]) -> list[str]:
    """Move -v/--verbose and --root DIR given after the command to before it, where typer reads them."""
    head: list[str] = []
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "--":
        head.append(argv[i])
        if argv[i] == "--root" and i + 1 < len(argv):
            head.append(argv[i + 1])
            i += 1
        i += 1
    if i >= len(argv):
        return argv
    moved, rest = [], [argv[i]]
    j = i + 1
    while j < len(argv):
        a = argv[j]
        if a == "--":
            rest += argv[j:]
            break
        if a == "--verbose" or _VERBOSE.match(a):
            moved.append(a)
        elif a == "--root" and j + 1 < len(argv):
            moved += argv[j : j + 2]
            j += 1
        elif a.startswith("--root="):
            moved.append(a)
        else:
            rest.append(a)
        j += 1
    return head + moved + rest


def _has_command(argv: list[str]) -> bool:
    """A command word, or an option that answers by itself (--help, --version)."""
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("-h", "--help", "--version") or not a.startswith("-"):
            return True
        i += 2 if a == "--root" else 1
    return False


class KvctlCommand(TyperCommand):
    """Every command: our own --help (real metavars, examples, exit codes)."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        helpfmt.format_command(self, ctx, formatter, self.name or "")


class KvctlGroup(TyperGroup):
    """Runs every command through the one exception → exit code mapping (also under CliRunner)."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        helpfmt.format_group(self, ctx, formatter)

    def main(  # type: ignore[override]
        self,
        args: Any = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        global G
        argv = list(args) if args is not None else sys.argv[1:]
        completing = bool(os.environ.get(complete_var or "_KVCTL_COMPLETE"))
        if completing:
            from typer._completion_classes import completion_init

            completion_init()  # typer's bash/zsh/fish protocol, as in the committed scripts
        else:
            argv = hoist_globals(argv)
            if not _has_command(argv):
                # Upstream's bare `kvctl` opened its shell; off a terminal that would read
                # stdin as commands, so there it prints help instead.
                argv += ["shell"] if sys.stdin.isatty() and sys.stdout.isatty() else ["--help"]
        G = Globals(json="--json" in argv)
        from .coerce import install

        install(self)
        try:
            rv = super().main(
                args=argv, prog_name=prog_name or "kvctl", complete_var=complete_var, standalone_mode=False, **extra
            )
            code = int(rv) if isinstance(rv, int) else 0
        except SystemExit:
            raise
        except BaseException as e:  # noqa: BLE001 - the one place exceptions become exit codes
            code = handle(e, verbose=G.verbose > 0, json_out=G.json)
        if standalone_mode:
            sys.exit(code)
        return code


app = typer.Typer(
    cls=KvctlGroup,
    name="kvctl",
    help="Find, explain and safely remove kvcached state (limit segments in /dev/shm, worker sockets in /tmp).",
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def command(name: str | None = None, **kw: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """app.command with our help formatter."""
    return app.command(name, cls=KvctlCommand, **kw)


# The --json flag of each command, its help naming the schema file of this install.
JsonList = Annotated[bool, typer.Option("--json", metavar="", help=helpfmt.json_help("list"))]
JsonLimit = Annotated[bool, typer.Option("--json", metavar="", help=helpfmt.json_help("limit"))]
JsonGc = Annotated[bool, typer.Option("--json", metavar="", help=helpfmt.json_help("gc"))]
JsonInspect = Annotated[bool, typer.Option("--json", metavar="", help=helpfmt.json_help("inspect"))]
JsonDoctor = Annotated[bool, typer.Option("--json", metavar="", help=helpfmt.json_help("doctor"))]
JsonDemo = Annotated[bool, typer.Option("--json", metavar="", help=helpfmt.json_help("demo"))]


def _version(value: bool) -> None:
    if value:
        import kvcached

        print(f"kvctl {kvcached.__version__}")
        raise typer.Exit(0)


@app.callback()
def _global(
    root: Annotated[
        Optional[str],
        typer.Option(
            "--root",
            envvar="KVCTL_ROOT",
            metavar="DIR",
            help="Re-base /tmp and /dev/shm under DIR (/proc stays real): tests, chroots, a pod's volumes. "
            "Env: KVCTL_ROOT.",
        ),
    ] = None,
    verbose: Annotated[
        int,
        typer.Option(
            "-v",
            "--verbose",
            count=True,
            metavar="",
            help="More detail (live entries gc kept, timings); tracebacks on errors. Repeatable.",
        ),
    ] = 0,
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, metavar="", help="Print the version and exit."),
    ] = False,
) -> None:
    """Global options go before or after the command: kvctl [--root DIR] [-v] COMMAND [ARGS] [--json]."""
    G.verbose = verbose
    if root:
        if not os.path.isdir(root):
            raise CliError(f"--root {root}: not a directory", Exit.USAGE)
        # realpath, not abspath: through a symlinked root every path we print and
        # act on is the one the kernel resolves, and listings compare identities.
        G.root = os.path.realpath(root)


# parsing helpers ----------------------------------------------------------------


def _parser(fn: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(raw: str) -> Any:
        from kvcached.node.units import BadValue

        if not isinstance(raw, str):
            return raw
        try:
            return fn(raw)
        except BadValue as e:
            raise typer.BadParameter(str(e)) from None

    return parse


def _duration(raw: str) -> float:
    from kvcached.node.units import parse_duration

    return parse_duration(raw)


def _size(raw: str) -> int:
    from kvcached.node.units import parse_size

    return parse_size(raw)


def _percent(raw: str) -> float:
    from kvcached.node.units import parse_percent

    return parse_percent(raw)


def _interval(raw: str) -> float:
    from kvcached.node.units import parse_interval

    return parse_interval(raw)


def _node_names(root: str) -> set[str]:
    from kvcached.node.layout import Layout
    from kvcached.node.scan import scan

    return {c.deployment for c in scan(Layout(root)).candidates if c.deployment and c.hash_ok}


def complete_names(ctx: typer.Context, incomplete: str) -> list[str]:
    """IPC names present on the node (a fast scan: no /proc pass), for shell completion."""
    try:
        root = ctx.find_root().params.get("root") or os.environ.get("KVCTL_ROOT") or "/"
        return sorted(n for n in _node_names(root) if n.startswith(incomplete))
    except Exception:  # completion must never print a traceback into the shell
        return []


def complete_checks(incomplete: str) -> list[str]:
    from kvcached.node.diagnostics import CHECKS, Group

    words = [c.name for c in CHECKS] + [str(g) for g in Group]
    return [w for w in words if w.startswith(incomplete)]


class KindChoice(str, Enum):
    segment = "segment"
    socket = "socket"
    directory = "directory"


def _layout() -> Layout:
    from kvcached.node.layout import Layout

    return Layout(G.root)


def _plan(
    layout: Layout, names: Sequence[str] | None, grace: float | None = None, kinds: Sequence[KindChoice] | None = None
) -> Plan:
    from kvcached.node.decide import DEFAULT_GRACE
    from kvcached.node.gcrun import make_plan
    from kvcached.node.scan import Kind

    return make_plan(
        layout, names or (), DEFAULT_GRACE if grace is None else grace, [Kind(k.value) for k in kinds or []]
    )


def _view(
    names: Sequence[str] | None, grace: float | None = None, *, namespaces: bool = False, layout: Layout | None = None
) -> NodeView:
    from kvcached.node.view import build_view

    return build_view(_plan(layout or _layout(), names, grace), namespaces=namespaces)


def _interactive() -> bool:
    return sys.stdin.isatty() and sys.stdout.isatty()


OneName = Annotated[
    str, typer.Argument(metavar="NAME", autocompletion=complete_names, help="IPC name of the deployment.")
]
NamesArg = Annotated[
    Optional[list[str]],
    typer.Argument(metavar="NAME", autocompletion=complete_names, help="IPC names or globs (default: all)."),
]
MinAgeOpt = Annotated[
    float,
    typer.Option(
        "--min-age",
        parser=_parser(_duration),
        metavar="AGE",
        show_default="60s",
        help="Grace age: what changed more recently is young, never removed (0, 90, 90s, 10m, 2h, 1d).",
    ),
]
# A negative size must reach the size parser ("must not be negative"), not read as an option.
NEGATIVE_OK = {"ignore_unknown_options": True, "help_option_names": ["-h", "--help"]}


# commands ------------------------------------------------------------------------


@command("list")
def list_cmd(names: NamesArg = None, json_out: JsonList = False) -> int:
    """List limit segments: limit, used, prealloc, free, age, processes, and whether they are live or stale."""
    from kvcached.node.units import format_duration

    from .listing import list_rows, size_cells

    rows = list_rows(_view(names))
    if names and not rows:
        raise CliError(f"no segment matches {' '.join(names)}", Exit.NOT_FOUND)
    if json_out:
        # Upstream's shape: a JSON array of {"ipc", "limit_bytes", "used_bytes"}, ours added.
        emit_json(rows)
        return Exit.OK
    out = Out()
    if not rows:
        out.line(f"No kvcached segments under {os.path.join(G.root, 'dev/shm')}.")
        return Exit.OK
    now = time.time()
    out.table(
        ["NAME", "STATE", "LIMIT", "USED", "PREALLOC", "FREE", "AGE", "PIDS"],
        [
            [
                r["ipc"],
                state_cell(r["state"]),
                *size_cells(r),
                format_duration(now - r["mtime"]),
                render.pids(r["pids"]) or "-",
            ]
            for r in rows
        ],
        indent=0,
        fold=(0,),
    )
    for r in rows:
        for problem in r["problems"] + ([r["error"]] if r["error"] else []):
            note(f"{r['ipc']}: {problem}")
    return Exit.OK


def _set_limit(name: str, total: int, json_out: bool, how: str) -> int:
    from kvcached.node.segment import read_segment, write_segment
    from kvcached.node.units import format_size

    path = _layout().segment_path(name)
    before = read_segment(path)
    after = write_segment(path, total=total)
    if after.total < after.used:
        note(
            f"warning: {name}: the new limit {format_size(after.total)} is below what is in use "
            f"({format_size(after.used)}); the pool frees blocks as requests finish"
        )
    if json_out:
        emit_json({"schema": "kvctl.limit/1", "name": name, "path": path, "previous": before.total, **after.to_dict()})
    else:
        Out().line(
            f"{name}: limit {format_size(before.total)} -> {format_size(after.total)} ({how}); "
            f"used {format_size(after.used)}, prealloc {format_size(after.prealloc)}"
        )
    return Exit.OK


@command(context_settings=NEGATIVE_OK)
def limit(
    name: OneName,
    size: Annotated[
        int,
        typer.Argument(
            parser=_parser(_size), metavar="SIZE", help="New limit: 512M, 2G, 1.5GiB, 100_000 (bytes; binary units)."
        ),
    ],
    json_out: JsonLimit = False,
) -> int:
    """Set a deployment's KV-cache limit, live (refuses anything that is not a kvcached segment)."""
    return _set_limit(name, size, json_out, "set")


@command("limit-percent", context_settings=NEGATIVE_OK)
def limit_percent(
    name: OneName,
    percent: Annotated[
        float,
        typer.Argument(
            parser=_parser(_percent), metavar="PCT", help="Percentage of the GPU's total memory, in (0, 100]."
        ),
    ],
    device: Annotated[int, typer.Option("--device", metavar="N", help="CUDA device index.")] = 0,
    json_out: JsonLimit = False,
) -> int:
    """Set a deployment's limit to a percentage of GPU memory (loads PyTorch, only here)."""
    _layout().segment_path(name)  # validate the name before paying for torch
    try:
        import torch
    except ImportError:
        raise CliError(
            "limit-percent needs PyTorch to read GPU memory, and it is not installed "
            "(use 'kvctl limit NAME SIZE' instead)",
            Exit.ERROR,
        ) from None
    if not torch.cuda.is_available() or device >= torch.cuda.device_count():
        raise CliError(
            f"no GPU {device} visible to PyTorch (torch.cuda.is_available() is "
            f"{torch.cuda.is_available()}); use 'kvctl limit NAME SIZE' instead",
            Exit.ERROR,
        )
    total_mem = torch.cuda.get_device_properties(device).total_memory
    return _set_limit(name, int(total_mem * percent / 100), json_out, f"{percent:g}% of GPU {device}")


CountOpt = Annotated[
    int, typer.Option("--count", metavar="N", min=0, help="Stop after N refreshes (0: until q or Ctrl-C).")
]


_INTERVAL_HELP = ("Seconds between refreshes (above 0, at most a day: 2, 0.5, 10s, 1m). "
                  "-r/--refresh as in upstream's kvtop.")
Interval2 = Annotated[float, typer.Option("-n", "--interval", "-r", "--refresh", metavar="SEC",
                                          parser=_parser(_interval), show_default="2", help=_INTERVAL_HELP)]
Interval1 = Annotated[float, typer.Option("-n", "--interval", "-r", "--refresh", metavar="SEC",
                                          parser=_parser(_interval), show_default="1", help=_INTERVAL_HELP)]


@command()
def watch(names: NamesArg = None, interval: Interval2 = 2.0, count: CountOpt = 0) -> int:
    """The list table every SEC seconds: redrawn in place on a terminal (q quits), snapshots elsewhere."""
    from .live import draw_list, loop

    return loop(interval, count, draw_list(names or (), lambda n: _view(n)))


def _top(names: Sequence[str], interval: float, count: int) -> int:
    from .live import draw_top, loop

    return loop(interval, count, draw_top(names, lambda n: _view(n), G.root))


@command()
def top(names: NamesArg = None, interval: Interval1 = 1.0, count: CountOpt = 0) -> int:
    """A live view of every deployment: limit, usage, sockets, processes, orphans (q quits). Also `kvtop`."""
    return _top(names or (), interval, count)


@command("kvtop")
def kvtop_cmd(names: NamesArg = None, interval: Interval1 = 1.0, count: CountOpt = 0) -> int:
    """Upstream's name for top: the same live view."""
    return _top(names or (), interval, count)


@command()
def delete(
    name: OneName,
    yes: Annotated[
        bool, typer.Option("--yes", "-y", metavar="", help="Also remove entries of unknown or young state.")
    ] = False,
    min_age: MinAgeOpt = 60.0,
    json_out: JsonGc = False,
) -> int:
    """Remove one deployment's segment and stale sockets, deciding as gc does (never a live one)."""
    from kvcached.node.gcrun import outcome_of, run_delete

    def ask(doubtful: list[tuple[Any, Any]]) -> bool:
        if not _interactive():
            return False
        what = "\n".join(f"  {c.path}: {d.state} ({d.detail})" for c, d in doubtful[:10])
        return typer.confirm(f"{what}\nDelete anyway?", default=False, err=True)

    report = run_delete(_layout(), name, grace=min_age, vouch=yes, confirm=ask)
    code = _exit(outcome_of(report))
    if json_out:
        emit_json(
            {
                "schema": "kvctl.delete/1",
                "root": G.root,
                "dry_run": False,
                "entries": [e.to_dict() for e in report.entries],
                "summary": report.summary(),
                "errors": report.errors,
                "exit_code": int(code),
            }
        )
        return code
    render.render_report(Out(), report, verbose=G.verbose > 0)
    if any(str(e.state) == "live" for e in report.entries):
        note(f"kept live sockets of {name}: a process still serves them")
    return code


@command()
def inspect(
    names: NamesArg = None,
    pid: Annotated[
        Optional[int],
        typer.Option("--pid", metavar="PID", help="Inspect the node as PID sees it (its mount namespace)."),
    ] = None,
    min_age: MinAgeOpt = 60.0,
    json_out: JsonInspect = False,
) -> int:
    """Every deployment: its segment, sockets, processes, orphans, and why each entry is live or stale."""
    from kvcached.node.view import layout_for_pid

    layout = _layout()
    if pid is not None:
        if pid <= 0:
            raise CliError(f"--pid {pid}: not a process id", Exit.USAGE)
        layout = layout_for_pid(pid, G.root)
    view = _view(names, min_age, namespaces=True, layout=layout)
    if names and not view.deployments:
        raise CliError(f"no deployment matches {' '.join(names)}", Exit.NOT_FOUND)
    if json_out:
        doc = view.to_dict()
        doc["pid"] = pid
        emit_json(doc)
        return Exit.OK
    render.render_view(Out(), view, now=time.time(), hint=G.hinter(min_age))
    return Exit.OK


def _exit(outcome: Any) -> Exit:
    return {"clean": Exit.OK, "stale_remain": Exit.STALE_REMAIN, "partial_failure": Exit.PARTIAL_FAILURE}[str(outcome)]


class _Progress:
    """A transient count of entries on stderr while gc removes (a terminal only; rich)."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self.bar = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=True,
        )
        self.task = self.bar.add_task("gc: starting")
        self.seen = self.removed = 0

    def __call__(self, e: Entry) -> None:
        self.seen += 1
        self.removed += str(e.action) in ("removed", "would_remove")
        if self.seen % 64 == 0:
            self.bar.update(self.task, description=f"gc: {self.seen} entries, {self.removed} removed")

    def __enter__(self) -> _Progress:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()


@command()
def gc(
    names: Annotated[
        Optional[list[str]],
        typer.Argument(
            metavar="NAME",
            autocompletion=complete_names,
            help="Only deployments matching these names or globs (none matching: exit 6).",
        ),
    ] = None,
    yes: Annotated[
        bool, typer.Option("--yes", "-y", metavar="", help="Remove without asking (cron, scripts).")
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", "-n", metavar="", help="Show what would be removed; remove nothing.")
    ] = False,
    min_age: MinAgeOpt = 60.0,
    kinds: Annotated[
        Optional[list[KindChoice]],
        typer.Option("--kind", metavar="KIND", help="Only segment, socket (with their directories) or directory."),
    ] = None,
    time_limit: Annotated[
        float,
        typer.Option(
            "--time-limit",
            parser=_parser(_duration),
            metavar="DURATION",
            show_default="5m",
            help="Bound for the whole run (0: none); what is left is reported kept.",
        ),
    ] = 300.0,
    prometheus: Annotated[
        Optional[str],
        typer.Option(
            "--prometheus",
            metavar="FILE",
            help="Write node_exporter textfile metrics to FILE (atomically; a regular file or absent).",
        ),
    ] = None,
    kill_orphans: Annotated[
        bool,
        typer.Option(
            "--kill-orphans",
            metavar="",
            help="Terminate orphaned workers of deployments whose engine is confirmed gone (asks first unless --yes).",
        ),
    ] = False,
    json_out: JsonGc = False,
) -> int:
    """Remove stale kvcached state: only what every signal proves dead and older than --min-age."""
    from kvcached.node.gcrun import GcOptions, run_gc
    from kvcached.node.scan import Kind

    out = Out()
    terminal = out.terminal and not json_out
    hint = G.hinter(min_age)

    def confirm(p: Plan, preview: Report) -> bool:
        if not _interactive():
            return False
        render.render_report(out, preview, verbose=G.verbose > 0, by_deployment=True)
        stale = sum(1 for e in preview.entries if str(e.action) == "would_remove")
        deps = len({e.candidate.deployment for e in preview.entries if str(e.action) == "would_remove"})
        return typer.confirm(
            f"Remove {stale} stale entr{'y' if stale == 1 else 'ies'} of {deps} deployment(s)?", default=False, err=True
        )

    def confirm_kill(targets: list[Any]) -> bool:
        desc = ", ".join(f"PID {o.pid} ({d.name} {o.role.role})" for d, o in targets)
        return _interactive() and typer.confirm(f"Terminate orphaned {desc}?", default=False, err=True)

    opts = GcOptions(
        _layout(),
        tuple(names or ()),
        min_age,
        tuple(Kind(k.value) for k in kinds or ()),
        dry_run,
        yes,
        time_limit or None,
        kill_orphans,
        prometheus,
    )
    if terminal and not dry_run and (yes or not _interactive()):
        with _Progress() as progress:
            result = run_gc(opts, confirm=confirm, confirm_kill=confirm_kill, progress=progress)
    else:
        result = run_gc(opts, confirm=confirm, confirm_kill=confirm_kill)
    report, code = result.report, _exit(result.outcome)
    if kill_orphans and not dry_run and not yes and not result.killed and result.killable:
        note("orphans not terminated: confirm on a terminal or pass --yes")
    if result.declined:
        stale = len(report.stale_remaining)
        note(
            f"nothing removed: {stale} stale entr{'y' if stale == 1 else 'ies'} remain; "
            f"re-run with --yes to remove them ({hint('gc --yes')})"
        )
    if json_out:
        emit_json(
            {
                "schema": "kvctl.gc/1",
                "root": G.root,
                "dry_run": result.dry_run,
                "entries": [e.to_dict() for e in report.entries],
                "summary": report.summary(),
                "orphans": [{"deployment": d.name, **o.to_dict()} for d, o in result.orphans],
                "killed": [k.to_dict() for k in result.killed],
                "errors": report.errors,
                "exit_code": int(code),
            }
        )
    elif not (result.declined and _interactive()):  # the prompt already showed the plan
        render.render_report(out, report, verbose=G.verbose > 0, by_deployment=terminal)
    if not out.terminal and not result.dry_run:
        render.log_report(report)  # cron sends stdout to /dev/null: problems and the summary go to stderr
    if not json_out:
        for k in result.killed:
            out.line(f"orphan PID {k.pid}: {k.outcome}" + (f" ({k.detail})" if k.detail else ""))
        if result.orphans and not result.killed:
            for d, o in result.orphans:
                how = (
                    f"{hint('gc --kill-orphans')} terminates it"
                    if o.pid in result.killable
                    else "not killable by kvctl"
                )
                out.line(
                    ("hint: ", "yellow"), f"orphaned {o.role.role} PID {o.pid} of {d.name}: {o.orphan_reason}; {how}"
                )
    return code


@command()
def doctor(
    checks: Annotated[
        Optional[list[str]],
        typer.Argument(metavar="CHECK", autocompletion=complete_checks, help="Checks or groups to run (default: all)."),
    ] = None,
    strict: Annotated[bool, typer.Option("--strict", metavar="", help="Warnings fail too.")] = False,
    json_out: JsonDoctor = False,
) -> int:
    """Diagnose the node: environment, configuration, node state, serving engine; one line and a fix per check."""
    from kvcached.node import diagnostics as dx

    try:
        selected = dx.select(checks or [])
    except KeyError as e:
        raise CliError(
            f"unknown check {e.args[0]!r} (checks: {', '.join(dx.CHECK_NAMES)}; groups: "
            f"{', '.join(str(g) for g in dx.Group)})",
            Exit.USAGE,
        ) from None
    results = dx.run_checks(dx.Context(_layout(), kvctl=G.prefix()), selected)
    ok = dx.healthy(results, strict=strict)
    code = Exit.OK if ok else Exit.UNHEALTHY
    if json_out:
        counts = {str(s): sum(r.status is s for r in results) for s in dx.Status}
        emit_json(
            {
                "schema": "kvctl.doctor/1",
                "root": G.root,
                "healthy": ok,
                "strict": strict,
                "checks": [r.to_dict() for r in results],
                "summary": counts,
                "exit_code": int(code),
            }
        )
        return code
    out = Out()
    group = None
    width = max((len(r.name) for r in results), default=0)
    for r in results:
        if r.group != group:
            group = r.group
            out.line((str(group), "bold"))
        out.line(state_cell(r.status), " " * (5 - len(str(r.status))), r.name.ljust(width), "  ", r.summary, indent=2)
        if r.fix and r.status in (dx.Status.WARN, dx.Status.FAIL):
            out.line(" " * (7 + width), ("fix: ", "bold"), r.fix, indent=2)
    counts = {s: sum(r.status is s for r in results) for s in dx.Status}
    out.line(
        f"doctor: {counts[dx.Status.OK]} ok, {counts[dx.Status.WARN]} warn, {counts[dx.Status.FAIL]} fail"
        + (f", {counts[dx.Status.SKIP]} skipped" if counts[dx.Status.SKIP] else "")
        + ("" if ok else " (unhealthy" + (", --strict" if strict else "") + ")")
    )
    return code


@command()
def demo(
    tp: Annotated[int, typer.Option("--tp", metavar="N", min=1, max=8, help="Tensor-parallel workers per stage.")] = 2,
    pp: Annotated[int, typer.Option("--pp", metavar="N", min=1, max=8, help="Pipeline stages.")] = 2,
    json_out: JsonDemo = False,
) -> int:
    """Start a real local TP x PP deployment, stop it like vLLM 0.33, inspect the leftovers, gc them, show it clean."""
    import uuid

    from kvcached.node.gcrun import GcOptions, make_plan, run_gc
    from kvcached.node.view import build_view

    layout = _layout()
    for d in (layout.tmp_dir, layout.shm_dir):
        if not os.path.isdir(d):
            raise CliError(f"{d}: no such directory (the demo writes its state there)", Exit.ERROR)
    name = f"kvctl-demo-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    out = Out(sys.stderr if json_out else None)
    step = 0

    def say(text: str) -> None:
        nonlocal step
        step += 1
        out.blank()
        out.line((f"[{step}] ", "bold cyan"), (text, "bold"))

    say(f"Starting deployment {name}: API server, engine, {tp * pp} workers (TP={tp}, PP={pp})")
    # The runtime runs as its own process (kvctl never imports it); it reports each step as a JSON line.
    events = _harness_demo(name, tp, pp, layout.root, lambda ev: _demo_event(out, say, ev))
    if "stopped" not in events:
        raise CliError(f"the demo deployment did not start or stop: {events.get('error', 'no report')}", Exit.ERROR)
    say(f"{G.prefix()} inspect --min-age 0 {name}")
    view = build_view(make_plan(layout, [name], 0.0))
    render.render_view(out, view, now=time.time(), hint=G.hinter(0))
    say(f"{G.prefix()} gc --yes --min-age 0 {name}")
    result = run_gc(GcOptions(layout, (name,), 0.0, yes=True))
    render.render_report(out, result.report, verbose=False)
    left = [c.path for c, _ in make_plan(layout, [name], 0.0).entries()]
    say(f"{G.prefix()} inspect {name}")
    if left:
        out.line(("still there: ", "red"), ", ".join(left), indent=4)
    else:
        out.line(("clean: ", "green"), f"no segment, socket or directory of {name} remains", indent=4)
    code = Exit.PARTIAL_FAILURE if result.report.failures else Exit.STALE_REMAIN if left else Exit.OK
    if json_out:
        emit_json(
            {
                "schema": "kvctl.demo/1",
                "root": G.root,
                "name": name,
                "inspect": view.to_dict(),
                "gc": {"entries": [e.to_dict() for e in result.report.entries], "summary": result.report.summary()},
                "left": left,
                "clean": not left,
                "exit_code": int(code),
            }
        )
    return code


def _harness_demo(name: str, tp: int, pp: int, root: str, on_event: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Run `python -m kvcached.runtime.harness --role demo` and hand each JSON line it prints to `on_event`."""
    import json
    import subprocess

    cmd = [
        sys.executable,
        "-m",
        "kvcached.runtime.harness",
        "--role",
        "demo",
        "--name",
        name,
        "--tp",
        str(tp),
        "--pp",
        str(pp),
        "--root",
        root,
    ]
    events: dict[str, Any] = {}
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True
    ) as p:
        assert p.stdout is not None and p.stderr is not None
        for line in p.stdout:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            events[ev.get("event", "?")] = ev
            on_event(ev)
        err = p.stderr.read().strip()
    if p.returncode != 0:
        events["error"] = (err.splitlines() or [f"exit {p.returncode}"])[-1]
    return events


def _demo_event(out: Out, say: Callable[[str], None], ev: dict[str, Any]) -> None:
    if ev.get("event") == "ready":
        answers = ", ".join(str(v) for v in ev["answers"].values())
        out.line(f"api PID {ev['api']}, engine PID {ev['engine']}, workers answering from PIDs {answers}", indent=4)
        say("Stopping it the way vLLM 0.33 does: SIGTERM to the process group, SIGKILL ~20 ms later")
    elif ev.get("event") == "stopped":
        alive = ev.get("alive") or []
        out.line(
            "every process is gone; what they had not removed in those ~20 ms is left behind"
            if not alive
            else f"still alive: {', '.join(map(str, alive))}",
            indent=4,
        )


def _commands() -> list[str]:
    return sorted(_name(c) for c in app.registered_commands)


@command()
def shell() -> int:
    """An interactive prompt for kvctl commands (what bare `kvctl` opens on a terminal)."""
    from .shell import run

    root_args = ["--root", G.root] + ["-v"] * G.verbose

    def run_line(words: list[str]) -> int:
        verbose = G.verbose
        try:
            return int(
                typer.main.get_command(app).main(args=root_args + words, prog_name="kvctl", standalone_mode=False)
            )
        finally:
            G.verbose = verbose

    return run([c for c in _commands() if c != "shell"], run_line, lambda: _node_names(G.root))


def _just(name: str) -> typer.Typer | None:
    """`app` with only the command `name` (and the global options); None when there is no such command.

    Building the click command of every command (signatures, annotations, one
    parameter object each) is a third of a cold start; a run uses one. Help of
    kvctl itself, completion, the shell and a typo take the whole app.
    """
    info = next((c for c in app.registered_commands if _name(c) == name), None)
    if info is None:
        return None
    one = typer.Typer(
        cls=KvctlGroup,
        name="kvctl",
        add_completion=False,
        pretty_exceptions_enable=False,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    one.registered_callback = app.registered_callback
    one.registered_commands = [info]
    return one


def _name(info: Any) -> str:
    return info.name or info.callback.__name__.replace("_", "-")


def main() -> None:
    """The `kvctl` entry point."""
    argv = hoist_globals(sys.argv[1:])
    word = next((a for i, a in enumerate(argv) if not a.startswith("-") and (i == 0 or argv[i - 1] != "--root")), None)
    one = None if word is None or os.environ.get("_KVCTL_COMPLETE") else _just(word)
    (one or app)()


def kvtop_main() -> None:
    """The `kvtop` entry point: `kvctl kvtop` under its own name, with its own completion."""
    group = typer.main.get_command(app)
    if os.environ.get("_KVTOP_COMPLETE"):
        # Completion resolves words against a command: here the kvtop command itself.
        from typer._completion_classes import completion_init

        completion_init()
        group.commands["kvtop"].main(prog_name="kvtop", complete_var="_KVTOP_COMPLETE")  # type: ignore[attr-defined]
        return
    group.main(args=["kvtop", *sys.argv[1:]], prog_name="kvtop")
