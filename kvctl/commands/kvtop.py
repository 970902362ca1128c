"""`kvctl kvtop`: upstream's name for `top` (the `kvtop` program runs it under its own name)."""

import typer

from ..params import CountOpt, Interval1, KvctlCommand, NamesArg, globals_of, typer_app
from .top import show

app = typer_app()


@app.command("kvtop", cls=KvctlCommand)
def kvtop(ctx: typer.Context, names: NamesArg = None, interval: Interval1 = 1.0, count: CountOpt = 0) -> int:
    """Upstream's name for top: the same live view."""
    return show(globals_of(ctx), names or (), interval, count)
