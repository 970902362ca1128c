"""kvctl's exit codes, the two tables that map the node layer's outcomes and error categories to them,
and the one place that maps an exception to a code and a one-line message."""

from __future__ import annotations

import errno
import sys
from enum import IntEnum

from kvcached.node import Category, Outcome


class Exit(IntEnum):
    """Documented in README.md ("Exit codes"); scripts and alerting rely on these numbers."""

    OK = 0               # success; for gc: nothing stale remains
    ERROR = 1            # an operation failed (I/O error, unexpected state); see the message
    USAGE = 2            # bad command line: unknown option, bad size/duration/percentage/name
    STALE_REMAIN = 3     # gc/delete: stale entries remain (dry run, not confirmed, time limit)
    PARTIAL_FAILURE = 4  # gc/delete: some removals or kills failed; the rest were done
    LOCK_BUSY = 5        # gc: another gc holds the node's lock
    NOT_FOUND = 6        # the named deployment, segment or process does not exist
    REFUSED = 7          # the target is live, not ours, or not a kvcached segment: nothing done
    UNHEALTHY = 8        # doctor: a check failed (or warned, with --strict); gc --check-heartbeat: late
    METRICS_UNWRITTEN = 9  # gc: the run's work was done and reported, but its --prometheus file was not written
    INTERRUPTED = 130    # Ctrl-C


# How a gc or delete run ended -> its code. Total over Outcome (a test holds it so).
OUTCOME_EXIT: dict[Outcome, Exit] = {
    Outcome.CLEAN: Exit.OK,
    Outcome.STALE_REMAIN: Exit.STALE_REMAIN,
    Outcome.PARTIAL_FAILURE: Exit.PARTIAL_FAILURE,
}

# What kind of failure a kvcached error is -> its code. Total over Category (a test holds it so).
CATEGORY_EXIT: dict[Category, Exit] = {
    Category.FAILED: Exit.ERROR,
    Category.BAD_INPUT: Exit.USAGE,
    Category.NOT_FOUND: Exit.NOT_FOUND,
    Category.REFUSED: Exit.REFUSED,
    Category.BUSY: Exit.LOCK_BUSY,
}


def exit_of(outcome: Outcome, metrics_error: str | None = None) -> Exit:
    """The exit code of a gc or delete run that ended with `outcome` (and, for gc, its metrics write).

    Metrics are a report, not a condition: a textfile that could not be
    written turns a clean run (0) or one that left stale entries (3) into 9,
    after the run did and reported its work; a failure of the work itself (4)
    keeps its own code, the metrics line said beside it.
    """
    code = OUTCOME_EXIT[outcome]
    if metrics_error is not None and code in (Exit.OK, Exit.STALE_REMAIN):
        return Exit.METRICS_UNWRITTEN
    return code


class CliError(Exception):
    """A failure a command reports as one line with its own exit code."""

    def __init__(self, message: str, code: Exit = Exit.ERROR) -> None:
        super().__init__(message)
        self.code = code


def describe(exc: BaseException) -> tuple[Exit, str | None]:
    """(exit code, one-line message or None for silence) for any exception that reached the top."""
    import typer

    from kvcached.node import KvcachedError

    from .typer_adapter import ClickException, UsageError

    if isinstance(exc, CliError):
        return exc.code, str(exc)
    if isinstance(exc, KvcachedError):
        return CATEGORY_EXIT[exc.category], str(exc)
    if isinstance(exc, (KeyboardInterrupt, typer.Abort)):
        return Exit.INTERRUPTED, "interrupted"
    if isinstance(exc, typer.Exit):
        return Exit(exc.exit_code) if exc.exit_code in Exit._value2member_map_ else Exit.ERROR, None
    if isinstance(exc, UsageError):
        where = exc.ctx.command_path if exc.ctx is not None else "kvctl"
        return Exit.USAGE, f"usage error: {exc.format_message()} (see '{where} --help')"
    if isinstance(exc, ClickException):
        return Exit.ERROR, exc.format_message()
    if isinstance(exc, BrokenPipeError) or (isinstance(exc, OSError) and exc.errno == errno.EPIPE):
        return Exit.ERROR, None  # the reader went away (`kvctl list | head`): nothing to say to it
    if isinstance(exc, OSError):
        where = f"{exc.filename}: " if exc.filename else ""
        return Exit.ERROR, f"{where}{exc.strerror or exc}"
    return Exit.ERROR, f"internal error: {type(exc).__name__}: {exc} (run 'kvctl -v ...' for the traceback)"


def handle(exc: BaseException, *, verbose: bool, json_out: bool = False) -> int:
    """Report `exc` on stderr (traceback only when verbose), and on stdout as JSON with --json; return its code."""
    code, message = describe(exc)
    if verbose and code not in (Exit.OK, Exit.INTERRUPTED) and not isinstance(exc, CliError):
        import traceback

        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    if message:
        from .render import error_line

        error_line(message)
    if json_out and code is not Exit.OK and message is not None:
        from .documents import error_document
        from .render import emit_json

        try:
            emit_json(error_document(code, message))
        except (BrokenPipeError, OSError):
            pass  # the reader went away
    return int(code)
