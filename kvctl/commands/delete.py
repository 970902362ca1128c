"""`kvctl delete NAME`: remove one deployment's state, deciding as gc does (never a live one)."""

from typing import Annotated, Any

import typer

from kvcached.node import State

from ..documents import delete_document
from ..exitcodes import exit_of
from ..params import JsonGc, KvctlCommand, MinAgeOpt, OneName, globals_of, interactive, typer_app
from ..render import Out, emit_json, note, render_report

app = typer_app()


def _ask(doubtful: list[tuple[Any, Any]]) -> bool:
    """On a terminal: may entries of unknown or young state go too?"""
    if not interactive():
        return False
    what = "\n".join(f"  {c.path}: {d.state} ({d.detail})" for c, d in doubtful[:10])
    return typer.confirm(f"{what}\nDelete anyway?", default=False, err=True)


@app.command("delete", cls=KvctlCommand)
def delete(
    ctx: typer.Context,
    name: OneName,
    yes: Annotated[
        bool, typer.Option("--yes", "-y", metavar="", help="Also remove entries of unknown or young state.")
    ] = False,
    min_age: MinAgeOpt = 60.0,
    json_out: JsonGc = False,
) -> int:
    """Remove one deployment's segment and stale sockets, deciding as gc does (never a live one)."""
    from kvcached.node import outcome_of, run_delete

    run = globals_of(ctx)
    report = run_delete(run.layout(), name, grace=min_age, vouch=yes, confirm=_ask)
    code = exit_of(outcome_of(report))
    if json_out:
        emit_json(delete_document(run.root, report, code))
        return code
    render_report(Out(), report, verbose=run.verbose > 0)
    if any(e.state is State.LIVE for e in report.entries):
        note(f"kept live sockets of {name}: a process still serves them")
    return code
