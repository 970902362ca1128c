"""`kvctl shell` (and bare `kvctl` on a terminal): kvctl's commands at a prompt."""

import typer

from ..params import KvctlCommand, globals_of, typer_app

app = typer_app()


def run_shell(ctx: typer.Context) -> int:
    """The prompt: each line runs as `kvctl <line>` through the same group, with this run's global options."""
    from kvcached.node import deployment_names

    from ..prompt import run

    g = globals_of(ctx)
    group = ctx.find_root().command
    root_args = ["--root", g.root] + ["-v"] * g.verbose

    def run_line(words: list[str]) -> int:
        return int(group.main(args=root_args + words, prog_name="kvctl", standalone_mode=False))

    commands = sorted(c for c in group.list_commands(ctx) if c != "shell")  # type: ignore[attr-defined]
    return run(commands, run_line, lambda: deployment_names(g.root))


@app.command("shell", cls=KvctlCommand)
def shell(ctx: typer.Context) -> int:
    """An interactive prompt for kvctl commands (what bare `kvctl` opens on a terminal)."""
    return run_shell(ctx)
