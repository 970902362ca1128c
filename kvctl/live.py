"""`watch`, `top` and `kvtop`: a view redrawn every few seconds.

On a terminal the view redraws in place (rich Live), with or without colour,
and `q` quits; elsewhere (a pipe, a log) each refresh is a timestamped
snapshot. The views read the node through the same plan every command uses.
"""

from __future__ import annotations

import io
import os
import select
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvcached.node import Kind

from .render import Out, size_cells, state_cell

Draw = Callable[[Out], None]


class _Keys:
    """Single keys from a terminal's stdin, without echo or Enter (cbreak); restored on exit."""

    def __init__(self) -> None:
        self.fd = -1
        self.saved: Any = None

    def __enter__(self) -> _Keys:
        try:
            if sys.stdin.isatty():
                import termios
                import tty

                self.fd = sys.stdin.fileno()
                self.saved = termios.tcgetattr(self.fd)
                tty.setcbreak(self.fd)
        except (OSError, ValueError, ImportError):
            self.fd = -1
        return self

    def wait(self, seconds: float) -> bool:
        """Sleep up to `seconds`; True when `q` (or Q) was pressed meanwhile."""
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self.fd < 0:
                time.sleep(left)
                return False
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready and os.read(self.fd, 1) in (b"q", b"Q"):
                return True

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0 and self.saved is not None:
            import termios

            termios.tcsetattr(self.fd, termios.TCSADRAIN, self.saved)


def loop(interval: float, count: int, draw: Draw) -> int:
    """Redraw every `interval` seconds until `count` refreshes (0: forever), `q`, or Ctrl-C."""
    out = Out()
    n = 0
    if out.terminal:
        from rich.live import Live

        with _Keys() as keys, Live(_captured(draw, out), console=out.console, auto_refresh=False) as live:
            while True:
                n += 1
                if count and n >= count:
                    return 0
                if keys.wait(interval):
                    return 0
                live.update(_captured(draw, out), refresh=True)
    while True:
        out.line(time.strftime("%Y-%m-%d %H:%M:%S"))
        draw(out)
        out.blank()
        out.flush()
        n += 1
        if count and n >= count:
            return 0
        time.sleep(interval)


def _captured(draw: Draw, out: Out) -> Any:
    """One frame: what `draw` prints, as a renderable for Live (width-aware tables included)."""
    from rich.console import Group
    from rich.text import Text

    buf = io.StringIO()
    draw(Out(buf, styled=out.styled, terminal=True, width=out.console.width))
    return Group(Text.from_ansi(buf.getvalue()), Text("q: quit", style="dim" if out.styled else ""))


# How a frame finds the places to show: (the frame's view) -> [(Place, Fill)], the host's first; None: none shown.
Places = Callable[[Any], Sequence[tuple[Any, Any]]]


def places_of(root: str, *, every_place: bool, kubelet_dir: str | None) -> Places:
    """The frame's places: the host's /dev/shm, or with -A every place, from the view's own /proc pass."""
    from kvcached.node import Layout, place_fills

    def find(view: Any) -> Sequence[tuple[Any, Any]]:
        return place_fills(view.facts, Layout(root=root), every_place=every_place, kubelet_dir=kubelet_dir)
    return find


def draw_places(out: Out, fills: Sequence[tuple[Any, Any]]) -> None:
    """Each place's fill: how full, of what size, with a bar; coloured at doctor capacity's thresholds."""
    from kvcached import settings
    from kvcached.node import format_size

    warn, fail = settings.KVCTL_CAPACITY_WARN.get(), settings.KVCTL_CAPACITY_FAIL.get()
    rows = []
    for place, fill in fills:
        pct = fill.percent
        if pct is None:
            rows.append([place.label, "-", "-", "-", "-", fill.error or ""])
            continue
        style = "bold red" if pct >= fail else "yellow" if pct >= warn else ""
        filled = min(10, round(pct / 10))
        rows.append([place.label, (f"{pct:.0f}%", style), format_size(fill.used_bytes),
                     format_size(fill.capacity_bytes), "#" * filled + "." * (10 - filled), ""])
    out.table(["PLACE", "USE%", "USED", "SIZE", "FILL", "NOTE"], rows, indent=0, fold=(0, 5))


def draw_list(names: Sequence[str], plan_view: Callable[[Sequence[str]], Any], places: Places | None = None) -> Draw:
    """The `watch` frame: the list table of the deployments matching `names` (all when empty), then the places."""
    from .documents import list_document

    def draw(out: Out) -> None:
        view = plan_view(names)
        rows = [[r["ipc"], state_cell(r["state"]), *size_cells(r)[:3]] for r in list_document(view)]
        if rows:
            out.table(["NAME", "STATE", "LIMIT", "USED", "PREALLOC"], rows, indent=0, fold=(0,))
        else:
            out.line("No kvcached segments.")
        if places is not None:
            out.blank()
            draw_places(out, places(view))
    return draw


def draw_top(names: Sequence[str], plan_view: Callable[[Sequence[str]], Any], root: str,
             places: Places | None = None) -> Draw:
    """The `top` frame: every deployment's usage, sockets, processes and orphans; then the places' fill."""
    from kvcached.node import format_size

    def draw(out: Out) -> None:
        view = plan_view(names)
        out.line(("kvtop", "bold"), f"  {time.strftime('%H:%M:%S')}  root {root}  "
                 f"{len(view.deployments)} deployment(s), {len(view.orphans)} orphaned process(es)")
        rows = []
        for d in view.deployments:
            i = d.segment
            ok = i is not None and i.total > 0 and i.valid
            pct = f"{100 * i.used / i.total:.0f}%" if ok else "-"
            bar = "-"
            if ok:
                # Ten cells: the whole row fits 80 columns beside a name that folds.
                filled = min(10, round(10 * (i.used + i.prealloc) / i.total))
                bar = "#" * filled + "." * (10 - filled)
            socks = sum(1 for e in d.entries if e.kind is Kind.SOCKET)
            rows.append([d.name, state_cell(d.state), format_size(i.total if i else None),
                         format_size(i.used if i else None), format_size(i.prealloc if i else None), pct, bar,
                         str(socks), str(len(d.processes)),
                         (str(len(d.orphans)), "bold yellow") if d.orphans else "0"])
        out.table(["NAME", "STATE", "LIMIT", "USED", "PREALLOC", "USE%", "USAGE", "SOCKETS", "PROCS", "ORPHANS"],
                  rows, indent=0, fold=(0,))
        if places is not None:
            out.blank()
            draw_places(out, places(view))
    return draw
