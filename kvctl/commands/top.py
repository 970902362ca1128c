"""`kvctl top` (also `kvctl kvtop` and the `kvtop` program): a live view of every deployment and place."""

from collections.abc import Sequence
from typing import Optional

import typer

from ..params import (
    AllPlaces,
    CountOpt,
    Globals,
    Interval1,
    KubeletDir,
    KvctlCommand,
    NamesArg,
    globals_of,
    typer_app,
)

app = typer_app()


def show(run: Globals, names: Sequence[str], interval: float, count: int, all_places: bool = False,
         kubelet_dir: Optional[str] = None) -> int:
    """The live view of `names` (all when empty) and of the places' fill (-A: every place), every `interval`
    seconds, `count` times (0: until q)."""
    from ..live import draw_top, loop, places_of

    places = places_of(run.root, every_place=all_places, kubelet_dir=kubelet_dir)
    return loop(interval, count, draw_top(names, lambda n: run.view(n), run.root, places))


@app.command("top", cls=KvctlCommand)
def top(ctx: typer.Context, names: NamesArg = None, interval: Interval1 = 1.0, count: CountOpt = 0,
        all_places: AllPlaces = False, kubelet_dir: KubeletDir = None) -> int:
    """A live view of every deployment (limit, usage, sockets, processes, orphans) and of each place's fill
    (q quits). Also `kvtop`."""
    return show(globals_of(ctx), names or (), interval, count, all_places, kubelet_dir)
