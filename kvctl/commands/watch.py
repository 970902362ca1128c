"""`kvctl watch`: the list table and the places' fill, redrawn."""

import typer

from ..params import AllPlaces, CountOpt, Interval2, KubeletDir, KvctlCommand, NamesArg, globals_of, typer_app

app = typer_app()


@app.command("watch", cls=KvctlCommand)
def watch(ctx: typer.Context, names: NamesArg = None, interval: Interval2 = 2.0, count: CountOpt = 0,
          all_places: AllPlaces = False, kubelet_dir: KubeletDir = None) -> int:
    """The list table and each place's fill every SEC seconds: redrawn in place on a terminal (q quits),
    snapshots elsewhere."""
    from ..live import draw_list, loop, places_of

    run = globals_of(ctx)
    places = places_of(run.root, every_place=all_places, kubelet_dir=kubelet_dir)
    return loop(interval, count, draw_list(names or (), lambda n: run.view(n), places))
