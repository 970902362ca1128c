"""`kvctl top` (also `kvctl kvtop` and the `kvtop` program): a live view of every deployment."""

from collections.abc import Sequence

import typer

from ..params import CountOpt, Globals, Interval1, KvctlCommand, NamesArg, globals_of, typer_app

app = typer_app()


def show(run: Globals, names: Sequence[str], interval: float, count: int) -> int:
    """The live view of `names` (all when empty), every `interval` seconds, `count` times (0: until q)."""
    from ..live import draw_top, loop

    return loop(interval, count, draw_top(names, lambda n: run.view(n), run.root))


@app.command("top", cls=KvctlCommand)
def top(ctx: typer.Context, names: NamesArg = None, interval: Interval1 = 1.0, count: CountOpt = 0) -> int:
    """A live view of every deployment: limit, usage, sockets, processes, orphans (q quits). Also `kvtop`."""
    return show(globals_of(ctx), names or (), interval, count)
