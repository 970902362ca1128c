"""`kvctl doctor`: why state leaks on this node, one line and a fix per check."""

from typing import Annotated, Any, Optional

import typer

from ..documents import doctor_document
from ..exitcodes import CliError, Exit
from ..params import AllPlaces, JsonDoctor, KubeletDir, KvctlCommand, globals_of, typer_app
from ..render import Out, emit_json, state_cell

app = typer_app()


def _render(out: Out, results: list[Any], *, ok: bool, strict: bool) -> None:
    """A line per check under its group's heading, its fix below a warning or failure, then the counts.

    A line with `under` (an engine's patches, conditions, hazards) is indented
    below the line it names; a run of such lines sharing a fix shows it once,
    after the last of them.
    """
    from kvcached.node import Status

    bad = (Status.WARN, Status.FAIL)
    group = None
    width = max((len(r.name) + (2 if r.under else 0) for r in results), default=0)
    for i, r in enumerate(results):
        if r.group is not group:
            group = r.group
            out.line((str(group), "bold"))
        pad = 2 if r.under else 0
        out.line(state_cell(r.status), " " * (5 - len(r.status)), r.name.ljust(width - pad), "  ", r.summary,
                 indent=2 + pad)
        after = results[i + 1] if i + 1 < len(results) else None
        shared = (after is not None and r.under and after.under == r.under and after.fix == r.fix
                  and after.status in bad)
        if r.fix and r.status in bad and not shared:
            out.line(" " * (7 + width), ("fix: ", "bold"), r.fix, indent=2)
    counts = {s: sum(r.status is s for r in results) for s in Status}
    out.line(
        f"doctor: {counts[Status.OK]} ok, {counts[Status.WARN]} warn, {counts[Status.FAIL]} fail"
        + (f", {counts[Status.SKIP]} skipped" if counts[Status.SKIP] else "")
        + ("" if ok else " (unhealthy" + (", --strict" if strict else "") + ")")
    )


@app.command("doctor", cls=KvctlCommand)
def doctor(
    ctx: typer.Context,
    checks: Annotated[
        Optional[list[str]],
        typer.Argument(metavar="CHECK", help="Checks or groups to run (default: all)."),
    ] = None,
    strict: Annotated[bool, typer.Option("--strict", metavar="", help="Warnings fail too.")] = False,
    all_places: AllPlaces = False,
    kubelet_dir: KubeletDir = None,
    json_out: JsonDoctor = False,
) -> int:
    """Diagnose the node: environment, configuration, node state, serving engine; one line and a fix per check."""
    from kvcached.node import diagnostics as dx

    run = globals_of(ctx)
    try:
        selected = dx.select(checks or [])
    except KeyError as e:
        raise CliError(
            f"unknown check {e.args[0]!r} (checks: {', '.join(dx.CHECK_NAMES)}; groups: "
            f"{', '.join(dx.Group)})",
            Exit.USAGE,
        ) from None
    where = dx.Context(run.layout(), kvctl=run.prefix(), all_places=all_places, kubelet_dir=kubelet_dir)
    results = dx.run_checks(where, selected)
    ok = dx.healthy(results, strict=strict)
    code = Exit.OK if ok else Exit.UNHEALTHY
    if json_out:
        emit_json(doctor_document(run.root, results, healthy=ok, strict=strict, code=code))
        return code
    _render(Out(), results, ok=ok, strict=strict)
    return code
