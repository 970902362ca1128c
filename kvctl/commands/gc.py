"""`kvctl gc`: remove what every signal proves dead and older than --min-age; report the rest and why."""

from dataclasses import dataclass
from typing import Annotated, Any, Optional

import typer

from kvcached.node import Action, EngineKind, Kind, Source, StrEnum

from ..exitcodes import CATEGORY_EXIT, CliError, Exit, exit_of
from ..params import (
    AllPlaces,
    CheckHeartbeatOpt,
    Globals,
    HeartbeatOpt,
    JsonGc,
    KubeletDir,
    KvctlCommand,
    MaxAgeOpt,
    MetricsAddressOpt,
    MetricsPortOpt,
    MinAgeOpt,
    NoEventsOpt,
    globals_of,
    interactive,
    parse_duration,
    typer_app,
)
from ..render import Out, emit_json, log_line, note

app = typer_app()


class KindChoice(StrEnum):
    """Every value `--kind` takes: kvcached's kinds, then the engine leftovers' (kvcached.node.base.enums)."""

    SEGMENT = "segment"
    SOCKET = "socket"
    DIRECTORY = "directory"
    VLLM_SHM = "vllm-shm"
    VLLM_IPC = "vllm-ipc"
    SGLANG_SHM = "sglang-shm"
    SGLANG_IPC = "sglang-ipc"
    NCCL_SHM = "nccl-shm"
    CUDA_SHM = "cuda-shm"
    TORCH_SHM = "torch-shm"
    PYTHON_SEM = "python-sem"


# Each choice as the node layer's member (a test holds the choices to Kind and EngineKind).
NODE_KIND: dict[KindChoice, Kind | EngineKind] = {KindChoice(m.value): m for m in (*Kind, *EngineKind)}


def _asker(out: Out, run: Globals, all_places: bool) -> Any:
    """gc's question before it removes (on a terminal): the plan, one row per deployment, then yes or no."""

    def confirm(dry: list[Any]) -> bool:
        if not interactive():
            return False
        from ..render_sources import render_run

        preview, places = dry[0].report, dry[1:] if all_places else None
        render_run(out, preview, verbose=run.verbose > 0, grouped=True)
        gone = [e for e in preview.entries if e.action is Action.WOULD_REMOVE and e.engine is None]
        deps = len({e.candidate.deployment for e in gone})
        what = f"{len(gone)} stale entr{'y' if len(gone) == 1 else 'ies'} of {deps} deployment(s)"
        if Source.ENGINES in preview.sources:
            from kvcached.node import format_size

            n = preview.count(action=Action.WOULD_REMOVE, source=Source.ENGINES)
            what += f" and {n} engine leftover(s) ({format_size(preview.bytes(action=Action.WOULD_REMOVE))})"
        if places is not None:
            from kvcached.node import would_remove

            from ..render_places import render_places_preview

            render_places_preview(out, places, verbose=run.verbose > 0)
            what += f" here, and {would_remove(places)} entr(ies) in {len(places)} other place(s)"
        return typer.confirm(f"Remove {what}?", default=False, err=True)

    return confirm


def _confirm_kill(targets: list[Any]) -> bool:
    desc = ", ".join(f"PID {o.pid} ({d.name} {o.role.role})" for d, o in targets)
    return interactive() and typer.confirm(f"Terminate orphaned {desc}?", default=False, err=True)


def _run(opts: Any, out: Out, run: Globals, json_out: bool) -> Any:
    from kvcached.node import run_gc

    confirm = _asker(out, run, opts.all_places)
    if out.terminal and not json_out and not opts.dry_run and (opts.yes or not interactive()):
        from ..progress import Progress

        with Progress() as progress:
            return run_gc(opts, confirm=confirm, confirm_kill=_confirm_kill, progress=progress,
                          confirm_gpu_kill=_confirm_gpu_kill)
    return run_gc(opts, confirm=confirm, confirm_kill=_confirm_kill, confirm_gpu_kill=_confirm_gpu_kill)


def _confirm_gpu_kill(holders: list[Any]) -> bool:
    from ..render_gpu import confirm_text

    return interactive() and typer.confirm(confirm_text(holders), default=False, err=True)


def _orphan_lines(out: Out, run: Globals, result: Any, min_age: float) -> None:
    """What happened to orphans killed, or how to kill the ones found."""
    for k in result.killed:
        out.line(f"orphan PID {k.pid}: {k.outcome}" + (f" ({k.detail})" if k.detail else ""))
    if result.gpu is not None:
        from ..render_gpu import gc_lines

        gc_lines(out, result.gpu, result.killed, run.hinter(min_age))
    if result.orphans and not result.killed:
        hint = run.hinter(min_age)
        for d, o in result.orphans:
            how = f"{hint('gc --kill-orphans')} terminates it" if o.pid in result.killable else "not killable by kvctl"
            out.line(("hint: ", "yellow"), f"orphaned {o.role.role} PID {o.pid} of {d.name}: {o.orphan_reason}; {how}")


def _engine_hint(run: Globals, result: Any, min_age: float) -> None:
    """Plain gc, for a person at a terminal: how many names here are engines' (not judged), and the flag."""
    import os
    import sys

    from kvcached.node import engine_leftover_count, rpc_dirs

    if not sys.stderr.isatty():
        return  # cron's log would get the same line every run, live engines' buffers counted too
    ours = frozenset(os.path.basename(e.path) for e in result.report.entries if e.kind is Kind.SEGMENT)
    n = engine_leftover_count(run.root, rpc_dirs(run.root), ours)
    if n:
        note(f"gc: {n} entr{'y' if n == 1 else 'ies'} here carry an engine's name (vLLM, SGLang, NCCL, CUDA IPC), "
             f"not judged by plain gc: {run.hinter(min_age)('gc --engines')} removes the dead ones")


def _blind_line(result: Any) -> str | None:
    """What a blind run says (kvcached.node.clean.sight): each cause, and that it kept what it could not judge."""
    sight = result.sight
    if sight is None or not sight.blind:
        return None
    causes = ", ".join(str(r.cause) for r in sight.reasons)
    return (f"blind ({causes}): {sight.summary()}; what those processes may own is kept as unknown "
            f"(kvctl doctor sight names each fix)")


def _closing_lines(out: Out, run: Globals, result: Any, min_age: float, *, json_out: bool,
                   names: Optional[list[str]]) -> None:
    """After the report: whether the run was blind (stderr, every path), then orphans and the engine hint (text)."""
    if (blind := _blind_line(result)) is not None:
        log_line(f"kvctl gc: {blind}", "warning")  # cron's log and --json readers see it too
    if not json_out:
        _orphan_lines(out, run, result, min_age)
        if Source.ENGINES not in result.report.sources and not names:
            _engine_hint(run, result, min_age)


def _run_line(result: Any, code: int) -> tuple[str, str]:
    """--every's line for one run, and its log level."""
    from ..render_sources import run_line

    line = f"kvctl gc: {run_line(result.report)}"
    if result.all_places:
        from ..render_places import places_summary_line

        line += f"; {places_summary_line(result)}"
    blind = _blind_line(result)
    line += f"; {blind}" if blind else ""
    line += f"; metrics not written: {result.metrics_error}" if result.metrics_error else ""
    level = "error" if code in (Exit.ERROR, Exit.PARTIAL_FAILURE, Exit.METRICS_UNWRITTEN) \
        else "warning" if code or blind else "info"
    return f"{line} (exit {code})", level


def _one_run(opts: Any, run: Globals, json_out: bool) -> tuple[int, Any]:
    """One run of gc --every: its line (or JSON line), its exit code and result (None: it failed, said, and the
    loop goes on)."""
    from kvcached.node import KvcachedError, run_gc

    try:
        result = run_gc(opts)
    except KvcachedError as e:  # the lock busy, a metrics target that is no regular file, NAMEs matching nothing
        code = CATEGORY_EXIT[e.category]
        if json_out:
            from ..documents import error_document

            emit_json(error_document(code, str(e)), one_line=True)
        else:
            log_line(f"kvctl gc: {e}; nothing done this run (exit {int(code)})",
                     "warning" if code in (Exit.LOCK_BUSY, Exit.NOT_FOUND) else "error")
        return int(code), None
    code = exit_of(result.outcome, result.metrics_error)
    if json_out:
        from ..documents import gc_document

        emit_json(gc_document(run.root, result, code), one_line=True)
    else:
        log_line(*_run_line(result, int(code)))
    return int(code), result


@dataclass(frozen=True)
class LoopOpts:
    """What only --every takes: the heartbeat file, and the metrics endpoint's address."""

    heartbeat: str | None = None
    metrics_port: int | None = None
    metrics_address: str = "127.0.0.1"


def _loop_opts(every: float | None, max_age: float | None, loop: LoopOpts) -> LoopOpts:
    """`loop`, unless it was given without --every (or --max-age without --check-heartbeat): a usage error."""
    if every is None and (loop != LoopOpts() or max_age is not None):
        raise CliError("--heartbeat, --metrics-port and --metrics-address go with --every; --max-age with "
                       "--check-heartbeat", Exit.USAGE)
    return loop


def _every(every: float, opts: Any, run: Globals, json_out: bool, loop: LoopOpts, events: bool) -> int:
    """gc --every: refuse what could never act, then one run after another until SIGTERM or SIGINT; with -A the
    event path between them (kvctl/gcloop.py), unless --no-events."""
    from contextlib import ExitStack

    from kvcached import settings
    from kvcached.node import check_options

    from ..gcloop import Stop, heartbeat_after, react_between, run_every

    floor = settings.KVCTL_EVERY_MIN_S.get()
    if every < floor:
        raise CliError(f"--every {every:g}s: at least {floor:g}s (each run is a pass over /proc)", Exit.USAGE)
    if not opts.yes and not opts.dry_run:
        # Nobody can answer gc's question in a loop, and off a terminal it would never remove anything.
        raise CliError("--every runs unattended: give --yes (remove what is provably dead) or --dry-run "
                       "(only report)", Exit.USAGE)
    check_options(opts)
    if loop.heartbeat is not None:
        from kvcached.node import check_target

        check_target(loop.heartbeat)  # before any run: a probe must not be the first to find out
    with ExitStack() as stack:
        if loop.metrics_port is not None:
            from kvcached.node import MetricsServer

            server = stack.enter_context(MetricsServer(loop.metrics_address, loop.metrics_port))
            host, port = server.address
            log_line(f"kvctl gc: serving the last run's metrics on http://{host}:{port}/metrics", "info")
            opts = opts._replace(metrics_sink=server)
        stop = stack.enter_context(Stop())
        reactor = react_between(opts, stop, run.root, json_out, stack) if opts.all_places and events else None

        def once() -> int:
            code, result = _one_run(opts, run, json_out)
            if reactor is not None:
                reactor.after_round(result)
            return code

        return run_every(every, once, stop, after=heartbeat_after(loop.heartbeat),
                         between=None if reactor is None else reactor.between)


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether the option was given (on the line or by its environment variable), not left at its default."""
    # By the source's name: typer may bring its own copy of click, whose ParameterSource is another class.
    return getattr(ctx.get_parameter_source(name), "name", "DEFAULT") != "DEFAULT"


def _check_heartbeat(ctx: typer.Context, path: str, max_age: float | None) -> int:
    """gc --check-heartbeat: a liveness probe's question, answered from the file alone (no gc, no lock, no /proc)."""
    from kvcached.node import check

    given = [p for p in ctx.command.params if p.name not in ("check_heartbeat", "max_age")
             and not getattr(p, "hidden", False)  # the global options after the command's name
             and p.name is not None and _given(ctx, p.name)]
    if given:
        shown = " ".join(p.opts[-1] if p.opts and p.opts[-1].startswith("-") else "NAME" for p in given)
        raise CliError(f"--check-heartbeat only reads the heartbeat: it takes --max-age and no other gc option "
                       f"(given: {shown})", Exit.USAGE)
    if max_age is None:
        raise CliError("--check-heartbeat needs --max-age AGE (more than --every's DURATION x 1.1 plus its "
                       "--time-limit)", Exit.USAGE)
    verdict = check(path, max_age)
    if not verdict.fresh:
        raise CliError(verdict.reason, Exit.UNHEALTHY)
    Out().line(f"ok: {verdict.reason}")
    return int(Exit.OK)


def _declined(run: Globals, opts: Any, result: Any, min_age: float) -> None:
    """Nothing removed because nobody confirmed: how many stale entries remain, and the command that removes them."""
    again = ("gc -A" if opts.all_places else "gc") + (" --engines --yes" if opts.engine_pass else " --yes")
    stale = sum(len(r.report.stale_remaining) for r in result.places if r.report is not None)
    note(f"nothing removed: {stale} stale entr{'y remains' if stale == 1 else 'ies remain'}; "
         f"re-run with --yes to remove them ({run.hinter(min_age)(again)})")


def _show(out: Out, run: Globals, result: Any) -> None:
    """gc's report on stdout: a row per deployment (or engine) on a terminal (every entry with -v), else per entry.

    Off a terminal a run that acted also logs each summary on stderr (_log), which cron keeps while stdout goes
    to /dev/null; where stdout and stderr are one file (a journal, `2>&1`, a pod's log) the report leaves its
    summaries to those log lines, so that each is read once.
    """
    summary = out.terminal or result.dry_run or not _one_destination()
    if result.all_places:
        from ..render_places import render_places_report

        render_places_report(out, result, verbose=run.verbose > 0, terminal=out.terminal, summary=summary)
        return
    from ..render_sources import render_run

    render_run(out, result.report, verbose=run.verbose > 0, grouped=out.terminal, summary=summary)


def _one_destination() -> bool:
    """Whether stdout and stderr are the same open file (by identity: `2>&1`, systemd's journal stream)."""
    import os
    import sys

    try:
        a, b = os.fstat(sys.stdout.fileno()), os.fstat(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):  # not real files (a test's capture): two destinations
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _log(result: Any) -> None:
    """What cron must still see on stderr: every failure and each part's summary (-A: each place's too)."""
    from ..render_sources import log_run

    log_run(result.report)
    if result.all_places:
        from ..render_places import log_places

        log_places(result)


@app.command("gc", cls=KvctlCommand)
def gc(
    ctx: typer.Context,
    names: Annotated[
        Optional[list[str]],
        typer.Argument(metavar="NAME", help="Only deployments matching these names or globs (none matching: exit 6)."),
    ] = None,
    yes: Annotated[
        bool, typer.Option("--yes", "-y", metavar="", help="Remove without asking (cron, scripts).")
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", "-n", metavar="", help="Show what would be removed; remove nothing.")
    ] = False,
    min_age: MinAgeOpt = 60.0,
    kinds: Annotated[
        Optional[list[KindChoice]],
        typer.Option("--kind", metavar="KIND",
                     help="Only these kinds: segment, socket (with their directories), directory; or engine "
                     "leftovers: vllm-shm, vllm-ipc, sglang-shm, sglang-ipc, nccl-shm, cuda-shm (these imply "
                     "--engines)."),
    ] = None,
    engines: Annotated[
        bool,
        typer.Option("--engines", metavar="",
                     help="Also the engines' own leftovers (vLLM's psm_* buffers and ZMQ sockets, SGLang's, NCCL's, "
                     "CUDA IPC's): removed when provably dead, each on its own evidence. Takes no NAME."),
    ] = False,
    time_limit: Annotated[
        float,
        typer.Option("--time-limit", parser=parse_duration, metavar="DURATION", show_default="5m",
                     help="Bound for the whole run (0: none); what is left is reported kept."),
    ] = 300.0,
    prometheus: Annotated[
        Optional[str],
        typer.Option("--prometheus", metavar="FILE",
                     help="Write node_exporter textfile metrics to FILE (atomically; a regular file or absent)."),
    ] = None,
    kill_orphans: Annotated[
        bool,
        typer.Option("--kill-orphans", metavar="",
                     help="Terminate orphaned workers of deployments whose engine is confirmed gone; with "
                     "--engines also orphaned engine processes that hold a GPU (docs/GPU.md). Asks first "
                     "unless --yes."),
    ] = False,
    every: Annotated[
        Optional[float],
        typer.Option("--every", parser=parse_duration, metavar="DURATION",
                     help="Run again every DURATION (10% jitter; the first run at once) until SIGTERM or SIGINT, "
                     "one line per run; needs --yes or --dry-run; at least 10s."),
    ] = None,
    all_places: AllPlaces = False,
    kubelet_dir: KubeletDir = None,
    no_events: NoEventsOpt = False,
    heartbeat: HeartbeatOpt = None,
    check_heartbeat: CheckHeartbeatOpt = None,
    max_age: MaxAgeOpt = None,
    metrics_port: MetricsPortOpt = None,
    metrics_address: MetricsAddressOpt = "127.0.0.1",
    json_out: JsonGc = False,
) -> int:
    """Remove stale kvcached state: only what every signal proves dead and older than --min-age."""
    from kvcached.node import GcOptions

    if check_heartbeat is not None:
        return _check_heartbeat(ctx, check_heartbeat, max_age)
    loop = _loop_opts(every, max_age, LoopOpts(heartbeat, metrics_port, metrics_address))
    run = globals_of(ctx)
    out = Out()
    chosen = [NODE_KIND[k] for k in kinds or ()]
    opts = GcOptions(layout=run.layout(), names=tuple(names or ()), grace=min_age,
                     kinds=tuple(k for k in chosen if isinstance(k, Kind)), dry_run=dry_run, yes=yes,
                     time_limit=time_limit or None, kill_orphans=kill_orphans, prometheus=prometheus,
                     engines=engines, engine_kinds=tuple(k for k in chosen if isinstance(k, EngineKind)),
                     all_places=all_places, kubelet_dir=kubelet_dir, every=every,
                     grace_given=_given(ctx, "min_age"))
    if every is not None:
        return _every(every, opts, run, json_out, loop, not no_events)
    if no_events:
        raise CliError("--no-events goes with --every -A (the event path runs only between its rounds)", Exit.USAGE)
    result = _run(opts, out, run, json_out)
    code = exit_of(result.outcome, result.metrics_error)
    if kill_orphans and not dry_run and not yes and not result.killed and result.killable:
        note("orphans not terminated: confirm on a terminal or pass --yes")
    if result.declined:
        _declined(run, opts, result, min_age)
    if json_out:
        from ..documents import gc_document  # only for --json: a plain gc's start-up does not pay for it

        emit_json(gc_document(run.root, result, code))
    elif not (result.declined and interactive()):  # the prompt already showed the plan
        _show(out, run, result)
    if not out.terminal and not result.dry_run:
        _log(result)  # cron sends stdout to /dev/null: problems and the summary go to stderr
    _closing_lines(out, run, result, min_age, json_out=json_out, names=names)
    if result.metrics_error is not None:  # last: after the report, which stands whatever the metrics did
        log_line(f"kvctl gc: metrics not written (exit {int(code)}; the report above stands): "
                 f"{result.metrics_error}", "error")
    return code
