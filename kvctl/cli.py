"""kvctl's entry points: `kvctl` and `kvtop`.

This module imports nothing but the standard library when it loads: a shell's
TAB press runs kvctl with `_KVCTL_COMPLETE` set, and that request is answered
(kvctl/completion.py) before typer, rich or the node layer are imported. Any
other run builds the group (kvctl/group.py: the global options, the commands
of kvctl/commands/ loaded on first use) and runs it.
"""

from __future__ import annotations

import os
import sys
from functools import cache
from typing import Any


@cache
def app() -> Any:
    """kvctl's typer app (a `typer.Typer`: what typer's CliRunner and scripts/gen_completions.py take)."""
    from .group import build

    return build()


def group() -> Any:
    """kvctl's click group, built by typer from `app()`."""
    import typer

    return typer.main.get_command(app())


def _completing(prog: str) -> None:
    instruction = os.environ.get(f"_{prog.upper()}_COMPLETE")
    if instruction:
        from .completion import answer

        sys.exit(answer(prog, instruction))


def main() -> None:
    """The `kvctl` entry point."""
    _completing("kvctl")
    group().main(args=sys.argv[1:], prog_name="kvctl")


def kvtop_main() -> None:
    """The `kvtop` entry point: `kvctl kvtop` under its own name, with its own completion."""
    _completing("kvtop")
    group().main(args=["kvtop", *sys.argv[1:]], prog_name="kvtop")
