"""`kvctl list`: upstream's segment list, with each segment's state."""

import time

import typer

from ..documents import list_document
from ..exitcodes import CliError, Exit
from ..params import JsonList, KvctlCommand, NamesArg, globals_of, typer_app
from ..render import Out, emit_json, note, pids, size_cells, state_cell

app = typer_app()


@app.command("list", cls=KvctlCommand)
def list_(ctx: typer.Context, names: NamesArg = None, json_out: JsonList = False) -> int:
    """List limit segments: limit, used, prealloc, free, age, processes, and whether they are live or stale."""
    from kvcached.node import format_duration

    run = globals_of(ctx)
    rows = list_document(run.view(names or ()))
    if names and not rows:
        raise CliError(f"no segment matches {' '.join(names)}", Exit.NOT_FOUND)
    if json_out:
        emit_json(rows)
        return Exit.OK
    out = Out()
    if not rows:
        out.line(f"No kvcached segments under {run.layout().shm_dir}.")
        return Exit.OK
    now = time.time()
    out.table(
        ["NAME", "STATE", "LIMIT", "USED", "PREALLOC", "FREE", "AGE", "PIDS"],
        [[r["ipc"], state_cell(r["state"]), *size_cells(r), format_duration(now - r["mtime"]), pids(r["pids"]) or "-"]
         for r in rows],
        indent=0,
        fold=(0,),
    )
    for r in rows:
        for problem in r["problems"] + ([r["error"]] if r["error"] else []):
            note(f"{r['ipc']}: {problem}")
    return Exit.OK
