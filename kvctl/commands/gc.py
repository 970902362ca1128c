"""`kvctl gc`: remove what every signal proves dead and older than --min-age; report the rest and why."""

from typing import Annotated, Any, Optional

import typer

from kvcached.node.enums import Action, Kind

from ..documents import gc_document
from ..exitcodes import exit_of
from ..params import (
    Globals,
    JsonGc,
    KvctlCommand,
    MinAgeOpt,
    globals_of,
    interactive,
    parse_duration,
    typer_app,
)
from ..render import Out, emit_json, log_report, note, render_report

app = typer_app()


def _asker(out: Out, run: Globals) -> Any:
    """gc's question before it removes (on a terminal): the plan, one row per deployment, then yes or no."""

    def confirm(plan: Any, preview: Any) -> bool:
        if not interactive():
            return False
        render_report(out, preview, verbose=run.verbose > 0, by_deployment=True)
        gone = [e for e in preview.entries if e.action is Action.WOULD_REMOVE]
        deps = len({e.candidate.deployment for e in gone})
        return typer.confirm(f"Remove {len(gone)} stale entr{'y' if len(gone) == 1 else 'ies'} of {deps} "
                             f"deployment(s)?", default=False, err=True)

    return confirm


def _confirm_kill(targets: list[Any]) -> bool:
    desc = ", ".join(f"PID {o.pid} ({d.name} {o.role.role})" for d, o in targets)
    return interactive() and typer.confirm(f"Terminate orphaned {desc}?", default=False, err=True)


def _run(opts: Any, out: Out, run: Globals, json_out: bool) -> Any:
    from kvcached.node.gcrun import run_gc

    confirm = _asker(out, run)
    if out.terminal and not json_out and not opts.dry_run and (opts.yes or not interactive()):
        from ..progress import Progress

        with Progress() as progress:
            return run_gc(opts, confirm=confirm, confirm_kill=_confirm_kill, progress=progress)
    return run_gc(opts, confirm=confirm, confirm_kill=_confirm_kill)


def _orphan_lines(out: Out, run: Globals, result: Any, min_age: float) -> None:
    """What happened to orphans killed, or how to kill the ones found."""
    for k in result.killed:
        out.line(f"orphan PID {k.pid}: {k.outcome}" + (f" ({k.detail})" if k.detail else ""))
    if result.orphans and not result.killed:
        hint = run.hinter(min_age)
        for d, o in result.orphans:
            how = f"{hint('gc --kill-orphans')} terminates it" if o.pid in result.killable else "not killable by kvctl"
            out.line(("hint: ", "yellow"), f"orphaned {o.role.role} PID {o.pid} of {d.name}: {o.orphan_reason}; {how}")


@app.command("gc", cls=KvctlCommand)
def gc(
    ctx: typer.Context,
    names: Annotated[
        Optional[list[str]],
        typer.Argument(metavar="NAME", help="Only deployments matching these names or globs (none matching: exit 6)."),
    ] = None,
    yes: Annotated[
        bool, typer.Option("--yes", "-y", metavar="", help="Remove without asking (cron, scripts).")
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", "-n", metavar="", help="Show what would be removed; remove nothing.")
    ] = False,
    min_age: MinAgeOpt = 60.0,
    kinds: Annotated[
        Optional[list[Kind]],
        typer.Option("--kind", metavar="KIND", help="Only segment, socket (with their directories) or directory."),
    ] = None,
    time_limit: Annotated[
        float,
        typer.Option("--time-limit", parser=parse_duration, metavar="DURATION", show_default="5m",
                     help="Bound for the whole run (0: none); what is left is reported kept."),
    ] = 300.0,
    prometheus: Annotated[
        Optional[str],
        typer.Option("--prometheus", metavar="FILE",
                     help="Write node_exporter textfile metrics to FILE (atomically; a regular file or absent)."),
    ] = None,
    kill_orphans: Annotated[
        bool,
        typer.Option("--kill-orphans", metavar="",
                     help="Terminate orphaned workers of deployments whose engine is confirmed gone "
                     "(asks first unless --yes)."),
    ] = False,
    json_out: JsonGc = False,
) -> int:
    """Remove stale kvcached state: only what every signal proves dead and older than --min-age."""
    from kvcached.node.gcrun import GcOptions

    run = globals_of(ctx)
    out = Out()
    opts = GcOptions(layout=run.layout(), names=tuple(names or ()), grace=min_age,
                     kinds=tuple(kinds or ()), dry_run=dry_run, yes=yes,
                     time_limit=time_limit or None, kill_orphans=kill_orphans, prometheus=prometheus)
    result = _run(opts, out, run, json_out)
    code = exit_of(result.outcome)
    if kill_orphans and not dry_run and not yes and not result.killed and result.killable:
        note("orphans not terminated: confirm on a terminal or pass --yes")
    if result.declined:
        stale = len(result.report.stale_remaining)
        note(f"nothing removed: {stale} stale entr{'y' if stale == 1 else 'ies'} remain; "
             f"re-run with --yes to remove them ({run.hinter(min_age)('gc --yes')})")
    if json_out:
        emit_json(gc_document(run.root, result, code))
    elif not (result.declined and interactive()):  # the prompt already showed the plan
        # A row per deployment on a terminal (every entry with -v), a row per entry elsewhere.
        render_report(out, result.report, verbose=run.verbose > 0, by_deployment=out.terminal)
    if not out.terminal and not result.dry_run:
        log_report(result.report)  # cron sends stdout to /dev/null: problems and the summary go to stderr
    if not json_out:
        _orphan_lines(out, run, result, min_age)
    return code
