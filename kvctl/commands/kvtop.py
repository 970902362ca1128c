"""`kvctl kvtop`: upstream's name for `top` (the `kvtop` program runs it under its own name)."""

import typer

from ..params import AllPlaces, CountOpt, Interval1, KubeletDir, KvctlCommand, NamesArg, globals_of, typer_app
from .top import show

app = typer_app()


@app.command("kvtop", cls=KvctlCommand)
def kvtop(ctx: typer.Context, names: NamesArg = None, interval: Interval1 = 1.0, count: CountOpt = 0,
          all_places: AllPlaces = False, kubelet_dir: KubeletDir = None) -> int:
    """Upstream's name for top: the same live view."""
    return show(globals_of(ctx), names or (), interval, count, all_places, kubelet_dir)
