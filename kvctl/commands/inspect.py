"""`kvctl inspect`: every deployment, its entries and processes, and why each entry is live or stale."""

import time
from typing import Annotated, Optional

import typer

from ..documents import inspect_document
from ..exitcodes import CliError, Exit
from ..params import JsonInspect, KvctlCommand, MinAgeOpt, NamesArg, globals_of, typer_app
from ..render import Out, emit_json, render_view

app = typer_app()


@app.command("inspect", cls=KvctlCommand)
def inspect(
    ctx: typer.Context,
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

    run = globals_of(ctx)
    layout = run.layout()
    if pid is not None:
        if pid <= 0:
            raise CliError(f"--pid {pid}: not a process id", Exit.USAGE)
        layout = layout_for_pid(pid, run.root)
    view = run.view(names or (), min_age, namespaces=True, layout=layout)
    if names and not view.deployments:
        raise CliError(f"no deployment matches {' '.join(names)}", Exit.NOT_FOUND)
    if json_out:
        emit_json(inspect_document(view, pid))
        return Exit.OK
    render_view(Out(), view, now=time.time(), hint=run.hinter(min_age))
    return Exit.OK
