"""The demo behind `kvctl demo`: a real deployment, killed like vLLM 0.33, inspected, cleaned, checked clean.

The deployment is the runtime's harness, run as its own process (`python -m
kvcached.runtime.harness --role demo`): the node layer never imports the
runtime. The harness reports each step as a JSON line on its stdout; the
caller sees every event as it comes (`on_event`: first `starting`, once the
node's directories are found, then the harness's own), then gets what inspect
saw, what gc did and what was left, to render as it likes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..base.errors import KvcachedError
from ..base.layout import Layout
from .gcrun import GcOptions, GcResult, make_plan, run_gc
from .view import NodeView, build_view

Event = dict[str, Any]


class DemoFailed(KvcachedError):
    """The demo could not run: its directories are missing, or the deployment did not start or stop."""


@dataclass(kw_only=True)
class DemoResult:
    """What the demo found after the crash and what cleaning it did."""

    name: str
    events: dict[str, Event]          # the harness's last event of each kind (`ready`, `stopped`)
    view: NodeView                    # inspect, right after the crash
    gc: GcResult                      # gc --yes --min-age 0 NAME
    left: list[str] = field(default_factory=list)  # paths of the deployment still there afterwards


def demo_name() -> str:
    """A name no other demo on this node uses."""
    return f"kvctl-demo-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def run_harness(name: str, tp: int, pp: int, root: str, on_event: Callable[[Event], None]) -> dict[str, Event]:
    """Run the harness's demo role and hand each JSON line it prints to `on_event`; its events by kind.

    When the harness fails, the events hold an `error` entry with the last line of its stderr.
    """
    cmd = [sys.executable, "-m", "kvcached.runtime.harness", "--role", "demo", "--name", name,
           "--tp", str(tp), "--pp", str(pp), "--root", root]
    events: dict[str, Event] = {}
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                          text=True) as p:
        assert p.stdout is not None and p.stderr is not None
        for line in p.stdout:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            events[ev.get("event", "?")] = ev
            on_event(ev)
        err = p.stderr.read().strip()
    if p.returncode != 0:
        events["error"] = {"event": "error", "message": (err.splitlines() or [f"exit {p.returncode}"])[-1]}
    return events


def run_demo(layout: Layout, name: str, tp: int, pp: int, *, on_event: Callable[[Event], None]) -> DemoResult:
    """Start the deployment, stop it like vLLM 0.33, inspect what is left, gc it, and look again."""
    for d in (layout.tmp_dir, layout.shm_dir):
        if not os.path.isdir(d):
            raise DemoFailed(f"{d}: no such directory (the demo writes its state there)")
    on_event({"event": "starting", "name": name, "tp": tp, "pp": pp})
    events = run_harness(name, tp, pp, layout.root, on_event)
    if "stopped" not in events:
        why = events.get("error", {}).get("message", "no report")
        raise DemoFailed(f"the demo deployment did not start or stop: {why}")
    view = build_view(make_plan(layout, [name], 0.0))
    result = run_gc(GcOptions(layout=layout, names=(name,), grace=0.0, yes=True))
    left = [c.path for c, _ in make_plan(layout, [name], 0.0).entries()]
    return DemoResult(name=name, events=events, view=view, gc=result, left=left)
