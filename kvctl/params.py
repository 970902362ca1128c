"""What kvctl's commands share: the run's global options, the command class, options, parsers.

Every command module builds its command with typer's public API (`typer_app()`
and `@app.command(NAME, cls=KvctlCommand)`); the group (group.py) loads a
module only when its command is asked for. The global options `--root DIR`
and `-v` are options of the group; KvctlCommand also accepts them after the
command's name (`kvctl gc --dry-run -v`), as hidden options that write into
the same `Globals`, the context object of the run.

Annotations here and in kvctl/commands/ are evaluated when the module loads
(no `from __future__ import annotations`): typer reads them at run time.
"""

import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer
from typer.core import TyperCommand

from . import helpfmt, typer_adapter
from .exitcodes import CliError, Exit

if TYPE_CHECKING:
    from kvcached.node import Layout, NodeView, Plan

HELP_OPTIONS = {"help_option_names": ["-h", "--help"]}
# A negative size must reach the size parser ("must not be negative"), not read as an option.
NEGATIVE_OK = {"ignore_unknown_options": True, **HELP_OPTIONS}


class Globals:
    """The run's global options (`kvctl --root DIR -v gc`), whether given before or after the command.

    A plain class: every kvctl run makes one, and a dataclass costs a cold start its generated
    methods (bench/bench_cli_start.py).
    """

    __slots__ = ("root", "verbose", "json", "root_arg")

    def __init__(self, *, root: str = "/", verbose: int = 0, json: bool = False,
                 root_arg: Optional[str] = None) -> None:
        self.root = root            # the node root, resolved (realpath) once the command's options are parsed
        self.verbose = verbose
        self.json = json            # --json anywhere on the line: errors are JSON objects on stdout too
        self.root_arg = root_arg    # --root (or KVCTL_ROOT) as given

    def resolve(self) -> None:
        """Check and resolve --root; a bad one is a usage error."""
        if self.root_arg is None:
            return
        if not os.path.isdir(self.root_arg):
            what = "not a directory" if os.path.lexists(self.root_arg) else "the directory does not exist"
            raise CliError(f"--root {self.root_arg}: {what}", Exit.USAGE)
        # realpath, not abspath: through a symlinked root every path we print and
        # act on is the one the kernel resolves, and listings compare identities.
        self.root = os.path.realpath(self.root_arg)
        self.root_arg = None

    def prefix(self) -> str:
        """`kvctl` with this run's global options (`kvctl --root DIR`)."""
        if self.root == "/":
            return "kvctl"
        import shlex

        return f"kvctl --root {shlex.quote(self.root)}"

    def hinter(self, min_age: Optional[float] = None) -> Callable[[str], str]:
        """Command lines for hints, with this run's options: pasted as printed, they act on the same node."""
        from kvcached.node import DEFAULT_GRACE

        age = f" --min-age {min_age:g}" if min_age is not None and min_age != DEFAULT_GRACE else ""

        def hint(command: str) -> str:
            return f"{self.prefix()} {command}{age if command.split()[0] in ('gc', 'inspect', 'delete') else ''}"

        return hint

    def layout(self) -> "Layout":
        """The node this run looks at."""
        from kvcached.node import Layout

        return Layout(self.root)

    def plan(self, names: Sequence[str] = (), grace: Optional[float] = None,
             layout: Optional["Layout"] = None) -> "Plan":
        """The plan of `kvcached.node` every command shows (grace None: the default grace age)."""
        from kvcached.node import make_plan

        return make_plan(layout or self.layout(), names, grace)

    def view(self, names: Sequence[str] = (), grace: Optional[float] = None, *, namespaces: bool = False,
             layout: Optional["Layout"] = None) -> "NodeView":
        """The node grouped into deployments (inspect, list, watch, top)."""
        from kvcached.node import build_view

        return build_view(self.plan(names, grace, layout=layout), namespaces=namespaces)


def globals_of(ctx: typer.Context) -> Globals:
    """The Globals of the run `ctx` belongs to (the group's context object)."""
    obj = ctx.find_root().obj
    if not isinstance(obj, Globals):  # a context made without kvctl's group: give it the defaults
        obj = ctx.find_root().obj = Globals()
    return obj


def interactive() -> bool:
    """A person at a terminal: stdin and stdout are both terminals."""
    return sys.stdin.isatty() and sys.stdout.isatty()


def _after_root(ctx: typer.Context, value: Optional[str]) -> None:
    if value is not None:
        globals_of(ctx).root_arg = value


def _after_verbose(ctx: typer.Context, value: int) -> None:
    globals_of(ctx).verbose += value or 0


def _after_command(
    root: Annotated[Optional[str], typer.Option("--root", metavar="DIR", hidden=True, expose_value=False,
                                                callback=_after_root)] = None,
    verbose: Annotated[int, typer.Option("-v", "--verbose", count=True, hidden=True, expose_value=False,
                                         callback=_after_verbose)] = 0,
) -> None:
    """The global options as a command accepts them after its name."""


def after_command_options() -> list[Any]:
    """--root and -v as hidden options of a command, built by typer like any other option."""
    app = typer.Typer(add_completion=False)
    app.command()(_after_command)
    return list(typer.main.get_command(app).params)


class KvctlCommand(TyperCommand):
    """Every command: our own --help (real metavars, examples, exit codes) and the global options after its name."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.params.extend(after_command_options())
        typer_adapter.light_coercion(self.params)

    def get_help_option(self, ctx: Any) -> Any:
        option = super().get_help_option(ctx)
        typer_adapter.light_coercion([option] if option is not None else [])
        return option

    def format_help(self, ctx: Any, formatter: Any) -> None:
        helpfmt.format_command(self, ctx, formatter, self.name or "")

    def invoke(self, ctx: Any) -> Any:
        globals_of(ctx).resolve()  # every option is parsed now, the ones after the name included
        return super().invoke(ctx)


def typer_app() -> typer.Typer:
    """The typer app of one command module (kvctl/commands/<name>.py)."""
    return typer.Typer(add_completion=False, pretty_exceptions_enable=False, context_settings=HELP_OPTIONS)


def parser(fn: Callable[[str], Any]) -> Callable[[str], Any]:
    """A typer `parser` from a kvcached.node.base.units parser: its BadValue becomes a usage error naming the option."""

    def parse(raw: str) -> Any:
        from kvcached.node import BadValue

        if not isinstance(raw, str):
            return raw
        try:
            return fn(raw)
        except BadValue as e:
            raise typer.BadParameter(str(e)) from None

    return parse


def _duration(raw: str) -> float:
    from kvcached.node import parse_duration

    return parse_duration(raw)


def _size(raw: str) -> int:
    from kvcached.node import parse_size

    return parse_size(raw)


def _percent(raw: str) -> float:
    from kvcached.node import parse_percent

    return parse_percent(raw)


def _interval(raw: str) -> float:
    from kvcached.node import parse_interval

    return parse_interval(raw)


# kvcached.node.base.units is imported by the parse, not here: most runs parse no value.
parse_duration = parser(_duration)
parse_size = parser(_size)
parse_percent = parser(_percent)
parse_interval = parser(_interval)


# What shell completion offers for a value, by its metavar (scripts/gen_completions.py writes it into
# kvctl/completion_table.py): the IPC names on the node, or doctor's checks and groups.
COMPLETES = {"NAME": "names", "CHECK": "checks"}


# The --json flag of each command, its help naming the schema file of this install.
JsonList = Annotated[bool, typer.Option("--json", metavar="", help=helpfmt.json_help("list"))]
JsonLimit = Annotated[bool, typer.Option("--json", metavar="", help=helpfmt.json_help("limit"))]
JsonGc = Annotated[bool, typer.Option("--json", metavar="", help=helpfmt.json_help("gc"))]
JsonInspect = Annotated[bool, typer.Option("--json", metavar="", help=helpfmt.json_help("inspect"))]
JsonDoctor = Annotated[bool, typer.Option("--json", metavar="", help=helpfmt.json_help("doctor"))]
JsonDemo = Annotated[bool, typer.Option("--json", metavar="", help=helpfmt.json_help("demo"))]

AllPlaces = Annotated[
    bool,
    typer.Option("-A", "--all-namespaces", metavar="",
                 help="Every place on the node, pods included: each /dev/shm and /tmp some process sees in its own "
                 "mount namespace, the pods' memory-backed emptyDir volumes, the container runtimes' sandbox shm "
                 "(docs/PLACES.md)."),
]
KubeletDir = Annotated[
    Optional[str],
    typer.Option("--kubelet-dir", metavar="DIR", show_default="/var/lib/kubelet",
                 help="With -A: the kubelet's directory, where pods/<uid>/volumes are (default: KVCTL_KUBELET_DIR)."),
]
OneName = Annotated[str, typer.Argument(metavar="NAME", help="IPC name of the deployment.")]
NamesArg = Annotated[Optional[list[str]], typer.Argument(metavar="NAME", help="IPC names or globs (default: all).")]
MinAgeOpt = Annotated[
    float,
    typer.Option("--min-age", parser=parse_duration, metavar="AGE", show_default="60s",
                 help="Grace age: what changed more recently is young, never removed (0, 90, 90s, 10m, 2h, 1d)."),
]
CountOpt = Annotated[
    int, typer.Option("--count", metavar="N", min=0, help="Stop after N refreshes (0: until q or Ctrl-C).")
]
_INTERVAL_HELP = ("Seconds between refreshes (above 0, at most a day: 2, 0.5, 10s, 1m). "
                  "-r/--refresh as in upstream's kvtop.")
Interval2 = Annotated[float, typer.Option("-n", "--interval", "-r", "--refresh", metavar="SEC", parser=parse_interval,
                                          show_default="2", help=_INTERVAL_HELP)]
Interval1 = Annotated[float, typer.Option("-n", "--interval", "-r", "--refresh", metavar="SEC", parser=parse_interval,
                                          show_default="1", help=_INTERVAL_HELP)]


# What only gc's agent loop (--every) and its probe take: gc's options, kept here so that its signature reads.
HeartbeatOpt = Annotated[
    Optional[str],
    typer.Option("--heartbeat", metavar="FILE",
                 help="With --every: after every run, rewrite FILE (atomically) with when it finished and its "
                 "exit code, for --check-heartbeat."),
]
CheckHeartbeatOpt = Annotated[
    Optional[str],
    typer.Option("--check-heartbeat", metavar="FILE",
                 help="Run no gc: exit 0 when the last run recorded in FILE (by --heartbeat) finished at most "
                 "--max-age ago, 8 when longer or when FILE holds no heartbeat (a liveness probe)."),
]
MaxAgeOpt = Annotated[
    Optional[float],
    typer.Option("--max-age", parser=parse_duration, metavar="AGE",
                 help="With --check-heartbeat: the oldest last run that passes; give more than --every's "
                 "DURATION x 1.1 plus its --time-limit."),
]
MetricsPortOpt = Annotated[
    Optional[int],
    typer.Option("--metrics-port", metavar="PORT", min=1, max=65535,
                 help="With --every: serve the last run's metrics (the --prometheus text) over HTTP at "
                 "/metrics on PORT, for Prometheus to scrape (default: no endpoint)."),
]
NoEventsOpt = Annotated[
    bool,
    typer.Option("--no-events", metavar="",
                 help="With --every -A: only rounds; no judging, between them, of the places whose processes "
                 "exited or that got new files (the event path, docs/PLACES.md §5)."),
]
MetricsAddressOpt = Annotated[
    str,
    typer.Option("--metrics-address", metavar="ADDRESS", show_default="127.0.0.1",
                 help="With --metrics-port: the address to listen on (0.0.0.0: every interface, as a pod "
                 "needs)."),
]
