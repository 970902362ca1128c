"""`kvctl watch`: the list table, redrawn."""

import typer

from ..params import CountOpt, Interval2, KvctlCommand, NamesArg, globals_of, typer_app

app = typer_app()


@app.command("watch", cls=KvctlCommand)
def watch(ctx: typer.Context, names: NamesArg = None, interval: Interval2 = 2.0, count: CountOpt = 0) -> int:
    """The list table every SEC seconds: redrawn in place on a terminal (q quits), snapshots elsewhere."""
    from ..live import draw_list, loop

    run = globals_of(ctx)
    return loop(interval, count, draw_list(names or (), lambda n: run.view(n)))
