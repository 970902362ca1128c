"""`kvctl limit NAME SIZE`: set a deployment's KV-cache limit, live."""

from typing import Annotated

import typer

from ..documents import limit_document
from ..exitcodes import Exit
from ..params import NEGATIVE_OK, Globals, JsonLimit, KvctlCommand, OneName, globals_of, parse_size, typer_app
from ..render import Out, emit_json, note

app = typer_app()


def set_limit(run: Globals, name: str, total: int, json_out: bool, how: str) -> int:
    """Write `total` as the limit of segment `name` and report it (limit and limit-percent)."""
    from kvcached.node import format_size, read_segment, write_segment

    path = run.layout().segment_path(name)
    before = read_segment(path)
    after = write_segment(path, total=total)
    if after.total < after.used:
        note(
            f"warning: {name}: the new limit {format_size(after.total)} is below what is in use "
            f"({format_size(after.used)}); the pool frees blocks as requests finish"
        )
    if json_out:
        emit_json(limit_document(name, path, before, after))
    else:
        Out().line(
            f"{name}: limit {format_size(before.total)} -> {format_size(after.total)} ({how}); "
            f"used {format_size(after.used)}, prealloc {format_size(after.prealloc)}"
        )
    return Exit.OK


@app.command("limit", cls=KvctlCommand, context_settings=NEGATIVE_OK)
def limit(
    ctx: typer.Context,
    name: OneName,
    size: Annotated[
        int,
        typer.Argument(
            parser=parse_size, metavar="SIZE", help="New limit: 512M, 2G, 1.5GiB, 100_000 (bytes; binary units)."
        ),
    ],
    json_out: JsonLimit = False,
) -> int:
    """Set a deployment's KV-cache limit, live (refuses anything that is not a kvcached segment)."""
    return set_limit(globals_of(ctx), name, size, json_out, "set")
