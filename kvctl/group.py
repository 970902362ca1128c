"""The kvctl group: the global options, every command loaded on first use, and the one exit-code mapping.

Built with typer's public API: a `typer.Typer` whose group class is
KvctlGroup and whose callback takes the global options. The commands are not
registered with it: KvctlGroup's `commands` mapping imports a command's
module (kvctl/commands/) the first time the command is asked for, so a run
builds only the command it runs (`kvctl --help` and the shell build all).
"""

import sys
from collections.abc import Iterator, MutableMapping
from typing import Annotated, Any, Optional

import typer
from typer.core import TyperGroup

from . import commands, helpfmt, typer_adapter
from .exitcodes import handle
from .params import HELP_OPTIONS, Globals, globals_of, interactive


class LazyCommands(MutableMapping[str, Any]):
    """kvctl's commands by name, each built (its module imported) when first looked up."""

    def __init__(self) -> None:
        self.built: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        if name not in self.built:
            if name not in commands.COMMANDS:
                raise KeyError(name)
            self.built[name] = commands.load(name)
        return self.built[name]

    def __setitem__(self, name: str, command: Any) -> None:
        self.built[name] = command

    def __delitem__(self, name: str) -> None:
        del self.built[name]

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys([*commands.COMMANDS, *self.built]))

    def __len__(self) -> int:
        return len(set(commands.COMMANDS) | set(self.built))

    def __contains__(self, name: object) -> bool:
        return name in commands.COMMANDS or name in self.built


class KvctlGroup(TyperGroup):
    """Our --help; commands from kvctl/commands/ on first use; every run through the one exception mapping."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands = LazyCommands()
        typer_adapter.light_coercion(self.params)

    def get_help_option(self, ctx: Any) -> Any:
        option = super().get_help_option(ctx)
        typer_adapter.light_coercion([option] if option is not None else [])
        return option

    def list_commands(self, ctx: Any) -> list[str]:
        return list(self.commands)

    def format_help(self, ctx: Any, formatter: Any) -> None:
        helpfmt.format_group(self, ctx, formatter)

    def main(  # type: ignore[override]
        self,
        args: Any = None,
        prog_name: Optional[str] = None,
        complete_var: Optional[str] = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        """Run kvctl: the exit code is returned (standalone_mode=False) or exits the process; also under CliRunner."""
        argv = list(args) if args is not None else sys.argv[1:]
        run = Globals(json="--json" in argv)
        try:
            rv = super().main(args=argv, prog_name=prog_name or "kvctl", complete_var=complete_var,
                              standalone_mode=False, obj=run, **extra)
            code = int(rv) if isinstance(rv, int) else 0
        except SystemExit:
            raise
        except BaseException as e:  # noqa: BLE001 - the one place exceptions become exit codes
            code = handle(_json_before_command(e, argv), verbose=run.verbose > 0, json_out=run.json)
        if standalone_mode:
            sys.exit(code)
        return code


def _json_before_command(exc: BaseException, argv: list[str]) -> BaseException:
    """`kvctl --json inspect`: say where --json goes, not that kvctl itself has no such option."""
    from .exitcodes import CliError, Exit
    from .typer_adapter import UsageError

    if not isinstance(exc, UsageError) or getattr(exc, "option_name", None) != "--json" \
            or exc.ctx is None or exc.ctx.parent is not None:
        return exc
    command = next((a for a in argv if a in commands.COMMANDS), "COMMAND")
    return CliError(f"usage error: --json goes after the command's name: kvctl {command} --json "
                    f"(see 'kvctl {command} --help')", Exit.USAGE)


def _version(value: bool) -> None:
    if value:
        import kvcached

        print(f"kvctl {kvcached.__version__}")
        raise typer.Exit(0)


def global_options(
    ctx: typer.Context,
    root: Annotated[
        Optional[str],
        typer.Option(
            "--root",
            envvar="KVCTL_ROOT",
            metavar="DIR",
            help="Re-base /tmp and /dev/shm under DIR (/proc stays real): tests, chroots, a pod's volumes.",
        ),
    ] = None,
    verbose: Annotated[
        int,
        typer.Option(
            "-v",
            "--verbose",
            count=True,
            metavar="",
            help="More detail (live entries gc kept, timings); tracebacks on errors. Repeatable.",
        ),
    ] = 0,
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, metavar="", help="Print the version and exit."),
    ] = False,
) -> int:
    """Global options go before or after the command: kvctl [--root DIR] [-v] COMMAND [ARGS] [--json]."""
    run = globals_of(ctx)
    run.verbose += verbose
    if root:
        run.root_arg = root
    if ctx.invoked_subcommand is not None:
        return 0  # the command checks --root once its own options (which may repeat it) are parsed
    # Upstream's bare `kvctl` opened its shell; off a terminal that would read
    # stdin as commands, so there it prints help instead.
    if not interactive():
        typer.echo(ctx.get_help())
        return 0
    from .commands.shell import run_shell

    run.resolve()
    return run_shell(ctx)


def build() -> typer.Typer:
    """kvctl's typer app: the group with its global options (the commands load on first use)."""
    app = typer.Typer(
        cls=KvctlGroup,
        name="kvctl",
        help="Find, explain and safely remove kvcached state (limit segments in /dev/shm, worker sockets in /tmp).",
        add_completion=False,
        pretty_exceptions_enable=False,
        context_settings=HELP_OPTIONS,
    )
    app.callback(invoke_without_command=True)(global_options)
    return app
