"""`kvctl demo`: a real TP x PP deployment, stopped like vLLM 0.33, inspected, cleaned, shown clean."""

import sys
import time
from collections.abc import Callable
from typing import Annotated, Any

import typer

from ..documents import demo_document
from ..exitcodes import Exit
from ..params import JsonDemo, KvctlCommand, globals_of, typer_app
from ..render import Out, emit_json, render_report, render_view

app = typer_app()


class _Steps:
    """The numbered headings of the demo's story."""

    def __init__(self, out: Out) -> None:
        self.out = out
        self.n = 0

    def __call__(self, text: str) -> None:
        self.n += 1
        self.out.blank()
        self.out.line((f"[{self.n}] ", "bold cyan"), (text, "bold"))


def _on_event(out: Out, say: Callable[[str], None]) -> Callable[[dict[str, Any]], None]:
    """What to print for each event the running deployment reports."""

    def on_event(ev: dict[str, Any]) -> None:
        if ev.get("event") == "starting":
            tp, pp = ev["tp"], ev["pp"]
            say(f"Starting deployment {ev['name']}: API server, engine, {tp * pp} workers (TP={tp}, PP={pp})")
        elif ev.get("event") == "ready":
            answers = ", ".join(str(v) for v in ev["answers"].values())
            out.line(f"api PID {ev['api']}, engine PID {ev['engine']}, workers answering from PIDs {answers}", indent=4)
            say("Stopping it the way vLLM 0.33 does: SIGTERM to the process group, SIGKILL ~20 ms later")
        elif ev.get("event") == "stopped":
            alive = ev.get("alive") or []
            out.line("every process is gone; what they had not removed in those ~20 ms is left behind"
                     if not alive else f"still alive: {', '.join(map(str, alive))}", indent=4)

    return on_event


@app.command("demo", cls=KvctlCommand)
def demo(
    ctx: typer.Context,
    tp: Annotated[int, typer.Option("--tp", metavar="N", min=1, max=8, help="Tensor-parallel workers per stage.")] = 2,
    pp: Annotated[int, typer.Option("--pp", metavar="N", min=1, max=8, help="Pipeline stages.")] = 2,
    json_out: JsonDemo = False,
) -> int:
    """Start a real local TP x PP deployment, stop it like vLLM 0.33, inspect the leftovers, gc them, show it clean."""
    from kvcached.node import demo_name, run_demo

    run = globals_of(ctx)
    name = demo_name()
    out = Out(sys.stderr if json_out else None)
    say = _Steps(out)
    result = run_demo(run.layout(), name, tp, pp, on_event=_on_event(out, say))
    say(f"{run.prefix()} inspect --min-age 0 {name}")
    render_view(out, result.view, now=time.time(), hint=run.hinter(0))
    say(f"{run.prefix()} gc --yes --min-age 0 {name}")
    report = result.gc.report
    render_report(out, report, verbose=False)
    say(f"{run.prefix()} inspect {name}")
    if result.left:
        out.line(("still there: ", "red"), ", ".join(result.left), indent=4)
    else:
        out.line(("clean: ", "green"), f"no segment, socket or directory of {name} remains", indent=4)
    code = Exit.PARTIAL_FAILURE if report.failures else Exit.STALE_REMAIN if result.left else Exit.OK
    if json_out:
        emit_json(demo_document(run.root, name, result.view, report, result.left, code))
    return code
