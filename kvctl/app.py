"""kvctl: find, explain and safely remove kvcached state on a node.

Thin commands over the kvcached core library: each parses its options, calls
one or two library operations, renders, and returns an exit code (exitcodes.py).
The library is imported inside the commands, so `--help` and completion stay
light; nothing here imports torch, vLLM or the compiled extension except
`limit-percent`, which needs torch to read GPU memory.
"""



import os
import sys
import time
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Annotated, Any, Callable, List, Optional, Sequence

import typer
from typer.core import TyperGroup

from . import render
from .exitcodes import CliError, Exit, handle
from .render import Out, emit_json, note, state_cell

if TYPE_CHECKING:
    from kvcached.cleanup import Entry, Plan, Report
    from kvcached.inspect import DeploymentView, NodeView
    from kvcached.layout import Layout


@dataclass
class Globals:
    """Options given before the command (`kvctl --root DIR -v gc`)."""

    root: str = "/"
    verbose: int = 0
    json: bool = False  # --json anywhere on the line: errors are JSON objects on stdout too


G = Globals()


class KvctlGroup(TyperGroup):
    """Runs every command through the one exception → exit code mapping (also under CliRunner)."""

    def main(self, args: Any = None, prog_name: str | None = None,  # type: ignore[override]
             complete_var: str | None = None, standalone_mode: bool = True, **extra: Any) -> Any:
        global G
        argv = list(args) if args is not None else sys.argv[1:]
        G = Globals(json="--json" in argv)
        if os.environ.get(complete_var or "_KVCTL_COMPLETE"):
            from typer._completion_classes import completion_init

            completion_init()  # typer's bash/zsh/fish protocol, as in the committed scripts
        from .coerce import install

        install(self)
        try:
            rv = super().main(args=args, prog_name=prog_name or "kvctl", complete_var=complete_var,
                              standalone_mode=False, **extra)
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
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout (schema in docs/KVCTL.md).")]


def _version(value: bool) -> None:
    if value:
        import kvcached

        print(f"kvctl {kvcached.__version__}")
        raise typer.Exit(0)


@app.callback()
def _global(
    root: Annotated[Optional[str], typer.Option(
        "--root", envvar="KVCTL_ROOT", metavar="DIR",
        help="Re-base /tmp and /dev/shm under DIR (/proc stays real). Env: KVCTL_ROOT.")] = None,
    verbose: Annotated[int, typer.Option("-v", "--verbose", count=True,
                                         help="More detail; tracebacks on errors.")] = 0,
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """Global options go before the command: kvctl [--root DIR] [-v] COMMAND [ARGS] [--json]."""
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
        from kvcached.units import BadValue

        if not isinstance(raw, str):
            return raw
        try:
            return fn(raw)
        except BadValue as e:
            raise typer.BadParameter(str(e)) from None
    return parse


def _duration(raw: str) -> float:
    from kvcached.units import parse_duration

    return parse_duration(raw)


def _size(raw: str) -> int:
    from kvcached.units import parse_size

    return parse_size(raw)


def _percent(raw: str) -> float:
    from kvcached.units import parse_percent

    return parse_percent(raw)


def complete_names(ctx: typer.Context, incomplete: str) -> List[str]:
    """IPC names present on the node (a fast scan: no /proc pass), for shell completion."""
    try:
        from kvcached.layout import Layout
        from kvcached.scan import scan

        root = ctx.find_root().params.get("root") or os.environ.get("KVCTL_ROOT") or "/"
        names = {c.deployment for c in scan(Layout(root)).candidates if c.deployment and c.hash_ok}
        return sorted(n for n in names if n.startswith(incomplete))
    except Exception:  # completion must never print a traceback into the shell
        return []


def complete_checks(incomplete: str) -> List[str]:
    from kvcached.diagnostics import CHECKS, Group

    words = [c.name for c in CHECKS] + [str(g) for g in Group]
    return [w for w in words if w.startswith(incomplete)]


class KindChoice(str, Enum):
    segment = "segment"
    socket = "socket"
    directory = "directory"


def _layout() -> "Layout":
    from kvcached.layout import Layout

    return Layout(G.root)


def _plan(layout: "Layout", names: List[str] | None, grace: float | None = None,
          kinds: List[KindChoice] | None = None, extra: Sequence[str] = ()) -> "Plan":
    from kvcached.cleanup import plan
    from kvcached.decide import DEFAULT_GRACE, Policy
    from kvcached.scan import Kind

    names = names or []
    exact = [n for n in names if not any(ch in n for ch in "*?[")] + list(extra)
    return plan(layout, Policy(grace=DEFAULT_GRACE if grace is None else grace), names=exact, globs=names,
                kinds=[Kind(k.value) for k in kinds or []])


def _interactive() -> bool:
    return sys.stdin.isatty() and sys.stdout.isatty()


# rendering of shared shapes ---------------------------------------------------------

# commands ------------------------------------------------------------------------

@app.command("list")
def list_cmd(
    names: Annotated[Optional[List[str]], typer.Argument(metavar="NAME", autocompletion=complete_names,
                                                         help="IPC names or globs (default: all).")] = None,
    json_out: JsonOpt = False,
) -> int:
    """List limit segments with their limit, usage and state (live / stale / unknown)."""
    from kvcached.inspect import build_view
    from kvcached.units import format_duration

    view = build_view(_plan(_layout(), names), namespaces=False)
    rows = [_list_row(d) for d in view.deployments if d.segment_entry() is not None]
    if names and not rows:
        raise CliError(f"no segment matches {' '.join(names)}", Exit.NOT_FOUND)
    if json_out:
        # Upstream's shape: a JSON array of {"ipc", "limit_bytes", "used_bytes"},
        # ours added to each element (kvctl/schemas/list.json).
        emit_json(rows)
        return Exit.OK
    out = Out()
    if not rows:
        out.line(f"No kvcached segments under {os.path.join(G.root, 'dev/shm')}.")
        return Exit.OK
    now = time.time()
    out.table(["NAME", "STATE", "LIMIT", "USED", "PREALLOC", "FREE", "AGE", "PIDS"],
              [[r["ipc"], state_cell(r["state"]), *_size_cells(r), format_duration(now - r["mtime"]),
                render.pids(r["pids"]) or "-"] for r in rows], indent=0)
    for r in rows:
        if r["problems"]:
            note(f"{r['ipc']}: {'; '.join(r['problems'])}")
        if r["error"]:
            note(f"{r['ipc']}: {r['error']}")
    return Exit.OK


def _list_row(d: "DeploymentView") -> dict[str, Any]:
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


def _size_cells(r: dict[str, Any]) -> list[render.Cell]:
    """LIMIT, USED, PREALLOC, FREE; a negative value is shown as the impossible value it is."""
    from kvcached.units import format_size

    def cell(v: int | None) -> render.Cell:
        return (f"{v}!", "bold red") if v is not None and v < 0 else format_size(v)

    return [cell(r["limit_bytes"]), cell(r["used_bytes"]), cell(r["prealloc_bytes"]), cell(r["free_bytes"])]


def _set_limit(name: str, total: int, json_out: bool, how: str) -> int:
    from kvcached.segment import read_segment, write_segment
    from kvcached.units import format_size

    path = _layout().segment_path(name)
    before = read_segment(path)
    after = write_segment(path, total=total)
    if after.total < after.used:
        note(f"warning: {name}: the new limit {format_size(after.total)} is below what is in use "
             f"({format_size(after.used)}); the pool frees blocks as requests finish")
    if json_out:
        emit_json({"schema": "kvctl.limit/1", "name": name, "path": path, "previous": before.total,
                   **after.to_dict()})
    else:
        Out().line(f"{name}: limit {format_size(before.total)} -> {format_size(after.total)} ({how}); "
                   f"used {format_size(after.used)}, prealloc {format_size(after.prealloc)}")
    return Exit.OK


# A negative size must reach the size parser ("must not be negative"), not read as an option.
NEGATIVE_OK = {"ignore_unknown_options": True, "help_option_names": ["-h", "--help"]}


@app.command(context_settings=NEGATIVE_OK)
def limit(
    name: Annotated[str, typer.Argument(autocompletion=complete_names, help="IPC name of the deployment.")],
    size: Annotated[int, typer.Argument(parser=_parser(_size), metavar="SIZE",
                                        help="New limit: 512M, 2G, 1.5GiB, 100_000 (bytes).")],
    json_out: JsonOpt = False,
) -> int:
    """Set a deployment's KV-cache limit (refuses anything that is not a kvcached segment)."""
    return _set_limit(name, size, json_out, "set")


@app.command("limit-percent", context_settings=NEGATIVE_OK)
def limit_percent(
    name: Annotated[str, typer.Argument(autocompletion=complete_names, help="IPC name of the deployment.")],
    percent: Annotated[float, typer.Argument(parser=_parser(_percent), metavar="PCT",
                                             help="Percentage of the GPU's total memory, in (0, 100].")],
    device: Annotated[int, typer.Option("--device", help="CUDA device index.")] = 0,
    json_out: JsonOpt = False,
) -> int:
    """Set a deployment's limit to a percentage of GPU memory (loads PyTorch, only here)."""
    _layout().segment_path(name)  # validate the name before paying for torch
    try:
        import torch  # type: ignore[import-not-found]
    except ImportError:
        raise CliError("limit-percent needs PyTorch to read GPU memory, and it is not installed "
                       "(use 'kvctl limit NAME SIZE' instead)", Exit.ERROR) from None
    if not torch.cuda.is_available() or device >= torch.cuda.device_count():
        raise CliError(f"no GPU {device} visible to PyTorch (torch.cuda.is_available() is "
                       f"{torch.cuda.is_available()}); use 'kvctl limit NAME SIZE' instead", Exit.ERROR)
    total_mem = torch.cuda.get_device_properties(device).total_memory
    return _set_limit(name, int(total_mem * percent / 100), json_out, f"{percent:g}% of GPU {device}")


def _loop(interval: float, count: int, draw: Callable[[Out], None]) -> int:
    """Redraw every `interval` seconds: a rich Live view on a terminal, timestamped snapshots elsewhere."""
    if count < 0:
        raise CliError("--count must be 0 (forever) or more", Exit.USAGE)
    out = Out()
    n = 0
    if out.styled:
        from rich.live import Live

        with Live(_captured(draw), console=out.console, auto_refresh=False) as live:
            while True:
                n += 1
                if count and n >= count:
                    return Exit.OK
                time.sleep(interval)
                live.update(_captured(draw), refresh=True)
    while True:
        out.line(time.strftime("%Y-%m-%d %H:%M:%S"))
        draw(out)
        out.blank()
        out.flush()
        n += 1
        if count and n >= count:
            return Exit.OK
        time.sleep(interval)


def _captured(draw: Callable[[Out], None]) -> Any:
    import io

    from rich.text import Text

    buf = io.StringIO()
    draw(Out(buf, styled=True))
    return Text.from_ansi(buf.getvalue())


def _draw_list(out: Out) -> None:
    from kvcached.inspect import build_view

    view = build_view(_plan(_layout(), None), namespaces=False)
    rows = [[r["ipc"], state_cell(r["state"]), *_size_cells(r)[:3]]
            for r in (_list_row(d) for d in view.deployments if d.segment_entry() is not None)]
    if rows:
        out.table(["NAME", "STATE", "LIMIT", "USED", "PREALLOC"], rows, indent=0)
    else:
        out.line("No kvcached segments.")


def _draw_top(out: Out) -> None:
    from kvcached.inspect import build_view
    from kvcached.units import format_size

    view = build_view(_plan(_layout(), None), namespaces=False)
    out.line(("kvtop", "bold"), f"  {time.strftime('%H:%M:%S')}  root {G.root}  "
             f"{len(view.deployments)} deployment(s), {len(view.orphans)} orphaned process(es)")
    rows = []
    for d in view.deployments:
        i = d.segment
        pct = f"{100 * i.used / i.total:.0f}%" if i and i.total else "-"
        bar = ""
        if i and i.total:
            filled = min(20, round(20 * (i.used + i.prealloc) / i.total))
            bar = "#" * filled + "." * (20 - filled)
        socks = sum(1 for e in d.entries if str(e.kind) == "socket")
        rows.append([d.name, state_cell(d.state), format_size(i.total if i else None), format_size(i.used if i else None),
                     format_size(i.prealloc if i else None), pct, bar or "-", str(socks), str(len(d.processes)),
                     (str(len(d.orphans)), "bold yellow") if d.orphans else "0"])
    out.table(["NAME", "STATE", "LIMIT", "USED", "PREALLOC", "USE%", "USAGE", "SOCKETS", "PROCS", "ORPHANS"], rows,
              indent=0)


def _interval(raw: str) -> float:
    from kvcached.units import parse_interval

    return parse_interval(raw)


IntervalOpt = Annotated[float, typer.Option("-n", "--interval", metavar="SEC", parser=_parser(_interval),
                                            help="Seconds between refreshes (above 0, at most a day; 2, 0.5, 10s, 1m).")]
CountOpt = Annotated[int, typer.Option("--count", metavar="N", help="Stop after N refreshes (0: until Ctrl-C).")]


@app.command()
def watch(interval: IntervalOpt = 2.0, count: CountOpt = 0) -> int:
    """Print the segment list every SEC seconds (Ctrl-C to stop)."""
    return _loop(interval, count, _draw_list)


@app.command()
def top(interval: IntervalOpt = 1.0, count: CountOpt = 0) -> int:
    """A live view of every deployment's usage, processes and orphans (also installed as kvtop)."""
    return _loop(interval, count, _draw_top)


@app.command()
def delete(
    name: Annotated[str, typer.Argument(autocompletion=complete_names, help="IPC name of the deployment.")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask before removing an entry of unknown or young state.")] = False,
    min_age: Annotated[float, typer.Option("--min-age", parser=_parser(_duration), metavar="AGE", show_default="60s",
                                           help="Grace age: entries changed more recently are young "
                                                "(0, 90, 90s, 10m, 2h, 1d).")] = 60.0,
    json_out: JsonOpt = False,
) -> int:
    """Remove one deployment's segment and stale sockets, with the same decision gc uses (never a live one)."""
    from dataclasses import replace

    from kvcached.cleanup import execute
    from kvcached.decide import State

    layout = _layout()
    layout.segment_path(name)  # InvalidName → usage
    p = _plan(layout, [name], grace=min_age)
    entries = p.entries()
    if not entries:
        raise CliError(f"{name}: no such deployment (no segment or socket directory under {G.root})", Exit.NOT_FOUND)
    states = {d.state for _, d in entries}
    live = [(c, d) for c, d in entries if d.state is State.LIVE]
    if live and any(str(c.kind) == "segment" for c, _ in live):
        c, d = next((c, d) for c, d in live if str(c.kind) == "segment")
        who = f" (PID {render.pids(d.pids)})" if d.pids else ""
        raise CliError(f"{name} is live{who}: {d.detail}; refusing to delete", Exit.REFUSED)
    foreign = [(c, d) for c, d in entries if d.state is State.FOREIGN and str(c.kind) == "segment"]
    if foreign:
        c, d = foreign[0]
        raise CliError(f"{c.path}: not ours to delete ({d.detail})", Exit.REFUSED)
    doubtful = [(c, d) for c, d in entries if d.state in (State.UNKNOWN, State.YOUNG)]
    if doubtful:
        what = "; ".join(f"{c.path}: {d.state} ({d.detail})" for c, d in doubtful[:3])
        if not yes:
            if not _interactive():
                raise CliError(f"{name}: liveness not proven dead ({what}); re-run with --yes to delete anyway",
                               Exit.REFUSED)
            if not typer.confirm(f"{what}\nDelete anyway?", default=False, err=True):
                raise CliError("nothing deleted", Exit.REFUSED)
        # The operator vouched for these: act on them as stale, through the same guarded removal.
        p.decisions.update({c.path: replace(d, state=State.STALE, detail=d.detail + "; deleted on request")
                            for c, d in doubtful})
    report = execute(p, dry_run=False)
    code = Exit.PARTIAL_FAILURE if report.failures else Exit.STALE_REMAIN if report.stale_remaining else Exit.OK
    if json_out:
        emit_json({"schema": "kvctl.delete/1", "root": G.root, "dry_run": False,
                   "entries": [e.to_dict() for e in report.entries], "summary": report.summary(),
                   "errors": report.errors, "exit_code": int(code)})
    else:
        render.render_report(Out(), report, verbose=G.verbose > 0)
        if State.LIVE in states:
            note(f"kept live sockets of {name}: a process still serves them")
    return code


@app.command()
def inspect(
    names: Annotated[Optional[List[str]], typer.Argument(metavar="NAME", autocompletion=complete_names,
                                                         help="IPC names or globs (default: all).")] = None,
    pid: Annotated[Optional[int], typer.Option("--pid", metavar="PID",
                                               help="Inspect the node as PID sees it (its mount namespace).")] = None,
    min_age: Annotated[float, typer.Option("--min-age", parser=_parser(_duration), metavar="AGE", show_default="60s",
                                           help="Grace age used to judge staleness (0, 90, 90s, 10m, 2h, 1d).")] = 60.0,
    json_out: JsonOpt = False,
) -> int:
    """Show every deployment: its segment, sockets, processes, orphans, and why each entry is live or stale."""
    from kvcached.inspect import build_view, layout_for_pid

    layout = _layout()
    if pid is not None:
        if pid <= 0:
            raise CliError(f"--pid {pid}: not a process id", Exit.USAGE)
        layout = layout_for_pid(pid, G.root)
    view = build_view(_plan(layout, names, grace=min_age))
    if names and not view.deployments:
        raise CliError(f"no deployment matches {' '.join(names)}", Exit.NOT_FOUND)
    if json_out:
        doc = view.to_dict()
        doc["pid"] = pid
        emit_json(doc)
        return Exit.OK
    render.render_view(Out(), view, now=time.time())
    return Exit.OK


@app.command()
def gc(
    names: Annotated[Optional[List[str]], typer.Argument(metavar="NAME", autocompletion=complete_names,
                                                         help="Only deployments matching these names or globs.")] = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Remove without asking (cron, scripts).")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", "-n", help="Show what would be removed; remove nothing.")] = False,
    min_age: Annotated[float, typer.Option("--min-age", parser=_parser(_duration), metavar="AGE", show_default="60s",
                                           help="Grace age: never remove what changed more recently "
                                                "(0, 90, 90s, 10m, 2h, 1d).")] = 60.0,
    kinds: Annotated[Optional[List[KindChoice]], typer.Option("--kind", help="Only this kind (repeatable).")] = None,
    time_limit: Annotated[float, typer.Option("--time-limit", parser=_parser(_duration), metavar="DURATION", show_default="5m",
                                              help="Bound for the whole run (0: none); what is left is reported kept.")] = 300.0,
    prometheus: Annotated[Optional[str], typer.Option("--prometheus", metavar="FILE",
                                                      help="Write node_exporter textfile metrics to FILE (atomically).")] = None,
    kill_orphans: Annotated[bool, typer.Option("--kill-orphans",
                                               help="Terminate orphaned workers of deployments whose engine is "
                                                    "confirmed gone (asks first unless --yes).")] = False,
    json_out: JsonOpt = False,
) -> int:
    """Remove stale kvcached state: only what every signal proves dead and older than --min-age."""
    from kvcached.cleanup import execute

    started = time.monotonic()
    wall_start = time.time()
    layout = _layout()
    if prometheus:
        from kvcached.metrics import check_target

        check_target(prometheus)  # before any work: a bad target must not cost a run
    lock = None
    if not dry_run:  # a dry run changes nothing, so it neither needs nor blocks the lock
        from kvcached.gclock import GcLock, LockBusy

        lock = GcLock(layout)
        try:
            lock.acquire()
        except LockBusy:
            if prometheus:
                from kvcached import metrics

                metrics.write_lock_busy(prometheus, wall_start, time.time())
            raise
    try:
        p = _plan(layout, names, grace=min_age, kinds=kinds)
        if names and not p.matched:
            raise CliError(f"no deployment matches {' '.join(names)} under {G.root}", Exit.NOT_FOUND)
        view = _orphan_view(p)
        killed: List[Any] = []
        if kill_orphans and not dry_run:
            targets = view.killable_orphans()
            if targets:
                desc = ", ".join(f"PID {o.pid} ({d.name} {o.role.role})" for d, o in targets)
                go = yes or (_interactive() and typer.confirm(f"Terminate orphaned {desc}?", default=False, err=True))
                if go:
                    from kvcached.orphans import terminate

                    killed = terminate([o.info for _, o in targets], grace=5.0)
                    # Their segment may be named only by the processes just killed: name it explicitly.
                    orphaned = sorted({d.name for d, _ in targets})
                    p = _plan(layout, names, grace=min_age, kinds=kinds, extra=orphaned)
                    view = _orphan_view(p)
                else:
                    note("orphans not terminated: confirm on a terminal or pass --yes")
        effective_dry = dry_run
        shown = False  # the plan was already shown at the prompt
        stale = [c for c, d in p.entries() if str(d.state) == "stale"]
        if not dry_run and not yes and stale:
            if _interactive():
                shown = True
                from kvcached.cleanup import execute as preview

                render.render_report(Out(), preview(p, dry_run=True), verbose=G.verbose > 0)
                effective_dry = not typer.confirm(f"Remove {len(stale)} stale entr{'y' if len(stale) == 1 else 'ies'}?",
                                                  default=False, err=True)
            else:
                effective_dry = True
            if effective_dry:
                note(f"nothing removed: {len(stale)} stale entr{'y' if len(stale) == 1 else 'ies'} remain; "
                     "re-run with --yes to remove them")
        # The bound covers the whole run: planning and killing count against it. 0 means no bound.
        remaining = max(1e-9, time_limit - (time.monotonic() - started)) if time_limit else None
        report = execute(p, dry_run=effective_dry, time_limit=remaining)
    finally:
        if lock is not None:
            lock.release()
    kill_failed = [k for k in killed if str(k.outcome) == "failed"]
    if report.failures or kill_failed:
        code = Exit.PARTIAL_FAILURE
    elif report.stale_remaining:
        code = Exit.STALE_REMAIN
    else:
        code = Exit.OK
    orphans = [(d, o) for d, o in view.orphans]
    if prometheus:
        from kvcached import metrics

        metrics.write_report(prometheus, report, success=code is Exit.OK and not effective_dry, orphans=len(orphans),
                             started=wall_start)
    if json_out:
        emit_json({"schema": "kvctl.gc/1", "root": G.root, "dry_run": effective_dry,
                   "entries": [e.to_dict() for e in report.entries], "summary": report.summary(),
                   "orphans": [{"deployment": d.name, **o.to_dict()} for d, o in orphans],
                   "killed": [k.to_dict() for k in killed], "errors": report.errors, "exit_code": int(code)})
        return code
    out = Out()
    if not (shown and effective_dry):
        render.render_report(out, report, verbose=G.verbose > 0)
    for k in killed:
        out.line(f"orphan PID {k.pid}: {k.outcome}" + (f" ({k.detail})" if k.detail else ""))
    if orphans and not killed:
        killable = {o.pid for _, o in view.killable_orphans()}
        for d, o in orphans:
            hint = "kvctl gc --kill-orphans terminates it" if o.pid in killable else "not killable by kvctl"
            out.line(("hint: ", "yellow"), f"orphaned {o.role.role} PID {o.pid} of {d.name}: {o.orphan_reason}; {hint}")
    return code


class _NoView:
    """What gc reports about orphans when the node has no kvcached state at all."""

    orphans: List[Any] = []

    def killable_orphans(self) -> List[Any]:
        return []


def _orphan_view(p: "Plan") -> Any:
    # Grouping (and its import) only when there is something to group: cron on a clean node stays fast.
    if not p.roots:
        return _NoView()
    from kvcached.inspect import build_view

    return build_view(p, read_segments=False, namespaces=False)


@app.command()
def doctor(
    checks: Annotated[Optional[List[str]], typer.Argument(metavar="CHECK", autocompletion=complete_checks,
                                                          help="Checks or groups to run (default: all).")] = None,
    strict: Annotated[bool, typer.Option("--strict", help="Warnings fail too.")] = False,
    json_out: JsonOpt = False,
) -> int:
    """Diagnose the node: environment, configuration, node state, serving engine; one line and a fix per check."""
    from kvcached import diagnostics as dx

    try:
        selected = dx.select(checks or [])
    except KeyError as e:
        raise CliError(f"unknown check {e.args[0]!r} (checks: {', '.join(dx.CHECK_NAMES)}; groups: "
                       f"{', '.join(str(g) for g in dx.Group)})", Exit.USAGE) from None
    results = dx.run_checks(dx.Context(_layout()), selected)
    ok = dx.healthy(results, strict=strict)
    code = Exit.OK if ok else Exit.UNHEALTHY
    if json_out:
        counts = {str(s): sum(r.status is s for r in results) for s in dx.Status}
        emit_json({"schema": "kvctl.doctor/1", "root": G.root, "healthy": ok, "strict": strict,
                   "checks": [r.to_dict() for r in results], "summary": counts, "exit_code": int(code)})
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
    out.line(f"doctor: {counts[dx.Status.OK]} ok, {counts[dx.Status.WARN]} warn, {counts[dx.Status.FAIL]} fail"
             + (f", {counts[dx.Status.SKIP]} skipped" if counts[dx.Status.SKIP] else "")
             + ("" if ok else " (unhealthy" + (", --strict" if strict else "") + ")"))
    return code


@app.command()
def demo(
    tp: Annotated[int, typer.Option("--tp", min=1, max=8, help="Tensor-parallel workers per stage.")] = 2,
    pp: Annotated[int, typer.Option("--pp", min=1, max=8, help="Pipeline stages.")] = 2,
    json_out: JsonOpt = False,
) -> int:
    """Start a real local TP x PP deployment, stop it like vLLM 0.33, inspect the leftovers, gc them, show it clean."""
    import uuid

    from kvcached.cleanup import plan, run_cleanup
    from kvcached.decide import Policy
    from kvcached.gclock import GcLock
    from kvcached.harness import start_deployment
    from kvcached.inspect import build_view
    from kvcached.ipc.client import ping

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
    dep = start_deployment(name, tp, pp, layout=layout, owner_cleanup=False, pool=True)
    try:
        answers = [ping(layout.socket_path(name, r, s))["pid"] for (s, r) in sorted(dep.worker_pids)]
        out.line(f"api PID {dep.api_pid}, engine PID {dep.engine_pid}, workers answering from PIDs "
                 f"{', '.join(map(str, answers))}", indent=4)
        say("Stopping it the way vLLM 0.33 does: SIGTERM to the process group, SIGKILL ~20 ms later")
        dep.stop_like_vllm()
    finally:
        dep.kill()
    out.line("every process is gone; nobody removed the state they made", indent=4)
    say(f"kvctl inspect --min-age 0 {name}")
    view = build_view(plan(layout, Policy(grace=0), names=[name], globs=[name]))
    render.render_view(out, view, now=time.time())
    say(f"kvctl gc --yes --min-age 0 {name}")
    with GcLock(layout):
        report = run_cleanup(layout, Policy(grace=0), names=[name], globs=[name])
    render.render_report(out, report, verbose=False)
    after = plan(layout, Policy(grace=0), names=[name], globs=[name])
    left = [c.path for c, _ in after.entries()]
    say(f"kvctl inspect {name}")
    if left:
        out.line(("still there: ", "red"), ", ".join(left), indent=4)
    else:
        out.line(("clean: ", "green"), f"no segment, socket or directory of {name} remains", indent=4)
    code = Exit.PARTIAL_FAILURE if report.failures else Exit.STALE_REMAIN if left else Exit.OK
    if json_out:
        emit_json({"schema": "kvctl.demo/1", "root": G.root, "name": name, "inspect": view.to_dict(),
                   "gc": {"entries": [e.to_dict() for e in report.entries], "summary": report.summary()},
                   "left": left, "clean": not left, "exit_code": int(code)})
    return code


@app.command()
def shell() -> int:
    """An interactive prompt for kvctl commands, with TAB completion of commands and live IPC names."""
    import shlex

    commands = sorted({_cmd_name(c) for c in app.registered_commands} - {"shell"})
    interactive = sys.stdin.isatty()
    if interactive:
        _setup_readline(commands)
        note("kvctl shell: type a command (help for the list, exit or Ctrl-D to leave)")
    code = int(Exit.OK)
    root_args = ["--root", G.root] + ["-v"] * G.verbose
    while True:
        try:
            line = input("kvctl> " if interactive else "")
        except EOFError:
            return code
        except KeyboardInterrupt:
            if interactive:
                print(file=sys.stderr)
                continue
            raise
        try:
            words = shlex.split(line)
        except ValueError as e:
            render.error_line(f"cannot parse input: {e}")
            code = Exit.USAGE
            continue
        if not words:
            continue
        if words[0] in ("exit", "quit"):
            return code
        if words[0] == "help":
            note("commands: " + ", ".join(c for c in commands if c not in ("help", "exit")))
            code = Exit.OK
            continue
        if words[0] not in commands:
            render.error_line(f"unknown command {words[0]!r} (commands: {', '.join(commands)}, help, exit)")
            code = Exit.USAGE
            continue
        verbose = G.verbose
        code = typer.main.get_command(app).main(args=root_args + words, prog_name="kvctl", standalone_mode=False)
        G.verbose = verbose


def _cmd_name(info: Any) -> str:
    return info.name or info.callback.__name__.replace("_", "-")


def _setup_readline(commands: List[str]) -> None:
    try:
        import readline
    except ImportError:
        return
    root = G.root

    def complete(text: str, state: int) -> str | None:
        buf = readline.get_line_buffer()
        if not buf[:readline.get_begidx()].strip():
            words = [c for c in commands if c.startswith(text)]
        else:
            from kvcached.layout import Layout
            from kvcached.scan import scan

            try:
                names = {c.deployment for c in scan(Layout(root)).candidates if c.deployment and c.hash_ok}
            except OSError:
                names = set()
            words = sorted(n for n in names if n.startswith(text))
        return words[state] if state < len(words) else None

    commands = commands + ["help", "exit"]
    readline.set_completer(complete)
    readline.set_completer_delims(" \t")
    readline.parse_and_bind("tab: complete")


def main() -> None:
    """The `kvctl` entry point."""
    app()


def kvtop_main() -> None:
    """The `kvtop` entry point: `kvctl [--root DIR] [-v] top [-n SEC] [--count N]`."""
    argv = sys.argv[1:]
    globals_: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--root" and i + 1 < len(argv):
            globals_ += argv[i:i + 2]
            i += 2
            continue
        (globals_ if arg.startswith("--root=") or arg in ("-v", "--verbose") else rest).append(arg)
        i += 1
    typer.main.get_command(app).main(args=[*globals_, "top", *rest], prog_name="kvtop")
