"""kvctl's commands, one module each: parse, call one kvcached.node operation, render, return an exit code.

COMMANDS names every command (in the order `kvctl --help` lists them) and the
module that holds it; `load` imports that module only when its command is
asked for. Each module defines `app`, a typer app with its one command.
"""

from __future__ import annotations

import importlib
from typing import Any

COMMANDS: dict[str, str] = {
    "list": "list",
    "limit": "limit",
    "limit-percent": "limit_percent",
    "watch": "watch",
    "top": "top",
    "kvtop": "kvtop",
    "delete": "delete",
    "inspect": "inspect",
    "gc": "gc",
    "doctor": "doctor",
    "demo": "demo",
    "shell": "shell",
}


def load(name: str) -> Any:
    """The click command `name` (KeyError when kvctl has no such command), built by typer from its module."""
    import typer

    module = importlib.import_module(f"{__name__}.{COMMANDS[name]}")
    return typer.main.get_command(module.app)
