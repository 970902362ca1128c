"""Text output for GPU holders: inspect's section, gc's lines on the orphans it ended or could end."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .render import Cell, Out

TITLE = "GPU holders"
_STYLE = {"orphan": "red", "serving": "green", "foreign": "", "unknown": "yellow"}


def gpu_memory(n: int | None) -> str:
    """A holder's GPU memory for a person: GiB/MiB, or `?` when nobody could say."""
    if n is None:
        return "?"
    from kvcached.node import format_size

    return format_size(n)


def render_gpu_holders(out: Out, report: Any, hint: Callable[[str], str]) -> None:
    """inspect's section: one row per holder, then what gc would do about the orphans."""
    if not report.holders:
        return
    out.line((TITLE, "bold"))
    rows: list[list[Cell]] = []
    for h in report.holders:
        devs = ", ".join(sorted({u.device.name for u in h.devices}))
        state = str(h.state) + (f" ({h.proc_state})" if h.proc_state in ("D", "T") else "")
        rows.append([str(h.pid), h.title, h.serve or "-", devs, gpu_memory(h.gpu_memory_bytes),
                     (state, _STYLE.get(str(h.state), "")), h.reason])
    out.table(["PID", "TITLE", "SERVE", "DEVICES", "GPU MEMORY", "STATE", "REASON"], rows, fold=(3, 6))
    if report.memory_note:
        out.line(("note: ", "yellow"), report.memory_note)
    orphans = report.orphans
    if orphans:
        out.line(f"{len(orphans)} orphaned GPU holder(s): {hint('gc --engines --kill-orphans')} terminates them")
    for h in report.stuck:
        out.line(("warning: ", "yellow"), f"PID {h.pid} is in uninterruptible sleep (D): no signal ends it while "
                 "the device holds it; the node needs a reset")
    out.blank()


def confirm_text(holders: Sequence[Any]) -> str:
    """gc's question before it ends orphaned GPU holders."""
    desc = ", ".join(f"PID {h.pid} ({h.title}, {gpu_memory(h.gpu_memory_bytes)})" for h in holders)
    return f"Terminate orphaned GPU holder(s) {desc}?"


def gc_lines(out: Out, report: Any, killed: Sequence[Any], hint: Callable[[str], str]) -> None:
    """gc's lines for GPU orphans: what became of each one ended, or how to end the ones found."""
    done = {k.pid for k in killed}
    for h in report.orphans:
        if h.pid not in done:
            out.line(("hint: ", "yellow"), f"orphaned GPU holder PID {h.pid} ({h.title}, "
                     f"{gpu_memory(h.gpu_memory_bytes)}): {h.reason}; {hint('gc --engines --kill-orphans')} "
                     "terminates it")
