"""`kvctl inspect`: every deployment, its entries and processes, why each entry is live or stale; engine leftovers."""

import time
from typing import Annotated, Any, Optional

import typer

from ..documents import inspect_document
from ..exitcodes import CliError, Exit
from ..params import AllPlaces, JsonInspect, KubeletDir, KvctlCommand, MinAgeOpt, NamesArg, globals_of, typer_app
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
    all_places: AllPlaces = False,
    kubelet_dir: KubeletDir = None,
    json_out: JsonInspect = False,
) -> int:
    """Every deployment: its segment, sockets, processes, orphans, and why each entry is live or stale."""
    from kvcached.node import layout_for_pid

    run = globals_of(ctx)
    layout = run.layout()
    if pid is not None:
        if pid <= 0:
            raise CliError(f"--pid {pid}: not a process id", Exit.USAGE)
        if all_places:
            raise CliError("--pid and -A: -A already looks in every process's mount namespace", Exit.USAGE)
        layout = layout_for_pid(pid, run.root)
    if all_places:
        return _all_places(run, names or [], min_age, kubelet_dir, json_out)
    view = run.view(names or (), min_age, namespaces=True, layout=layout)
    if names and not view.deployments:
        raise CliError(f"no deployment matches {' '.join(names)}", Exit.NOT_FOUND)
    from kvcached.node import find_holders, prepare

    prepare(view.facts)  # the engine pass's read of the maps also finds GPU mappings
    engines = [] if names else _engine_state(view, min_age)  # they belong to no deployment a NAME selects
    gpu = find_holders(view.facts)
    if json_out:
        emit_json(inspect_document(view, pid, engines, gpu))
        return Exit.OK
    out = Out()
    render_view(out, view, now=time.time(), hint=run.hinter(min_age))
    if engines:
        from ..render_sources import render_engine_view

        out.blank()
        render_engine_view(out, engines, hint=run.hinter(min_age))
    if gpu.holders:
        from ..render_gpu import render_gpu_holders

        out.blank()
        render_gpu_holders(out, gpu, hint=run.hinter(min_age))
    return Exit.OK


def _all_places(run: Any, names: list[str], min_age: float, kubelet_dir: Optional[str], json_out: bool) -> int:
    """inspect -A: the host, then every other place, each with its deployments and engine leftovers."""
    from kvcached.node import build_view, find_holders, plan_places, prepare, view_places

    p = run.plan(names, min_age)
    view = build_view(p, namespaces=False)
    prepare(p.facts)  # the places' one read of the maps also finds GPU mappings
    pp = plan_places(p.layout, p.policy, p.facts, engines=not names, kubelet_dir=kubelet_dir, host_plan=p,
                     now=p.now, names=names)
    places = view_places(pp, view)
    if names and not any(pv.view is not None and pv.view.deployments for pv in places):
        raise CliError(f"no deployment matches {' '.join(names)} in any place", Exit.NOT_FOUND)
    gpu = find_holders(p.facts)
    if json_out:
        emit_json(inspect_document(view, None, places[0].engine_entries(), gpu=gpu, places=places))
        return Exit.OK
    from ..render_places import render_places_view

    out = Out()
    render_places_view(out, places, now=time.time(), hint=run.hinter(min_age))
    if gpu.holders:
        from ..render_gpu import render_gpu_holders

        out.blank()
        render_gpu_holders(out, gpu, hint=run.hinter(min_age))
    return Exit.OK


def _engine_state(view: Any, min_age: float) -> list[Any]:
    """The engines' leftovers on the same node, judged from the view's own /proc pass, as gc --engines would act."""
    from kvcached.node import Policy, plan_engines, preview, rpc_dirs

    layout = view.layout
    return preview(plan_engines(layout, Policy(grace=min_age), facts=view.facts, rpc_dirs=rpc_dirs(layout.root)))
