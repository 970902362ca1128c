"""kvctl's exit codes, and the one place that maps an exception to a code and a one-line message."""

from __future__ import annotations

import errno
import sys
from enum import IntEnum


class Exit(IntEnum):
    """Documented in docs/KVCTL.md; scripts and alerting rely on these numbers."""

    OK = 0               # success; for gc: nothing stale remains
    ERROR = 1            # an operation failed (I/O error, unexpected state); see the message
    USAGE = 2            # bad command line: unknown option, bad size/duration/percentage/name
    STALE_REMAIN = 3     # gc/delete: stale entries remain (dry run, not confirmed, time limit)
    PARTIAL_FAILURE = 4  # gc/delete: some removals or kills failed; the rest were done
    LOCK_BUSY = 5        # gc: another gc holds the node's lock
    NOT_FOUND = 6        # the named deployment, segment or process does not exist
    REFUSED = 7          # the target is live, not ours, or not a kvcached segment: nothing done
    UNHEALTHY = 8        # doctor: a check failed (or warned, with --strict)
    INTERRUPTED = 130    # Ctrl-C


class CliError(Exception):
    """A failure a command reports as one line with its own exit code."""

    def __init__(self, message: str, code: Exit = Exit.ERROR) -> None:
        super().__init__(message)
        self.code = code


def _code_for_library(exc: BaseException) -> Exit | None:
    # Imported here so that `kvctl --help` does not pay for the library.
    from kvcached.node.errors import InvalidName, KvcachedError, NotASegment, PathTooLong, SegmentMissing
    from kvcached.node.gclock import LockBusy
    from kvcached.node.gcrun import NoMatch, Refused
    from kvcached.node.units import BadValue
    from kvcached.node.view import ProcessNotFound

    for types, code in (((BadValue, InvalidName, PathTooLong), Exit.USAGE),
                        ((SegmentMissing, ProcessNotFound, NoMatch), Exit.NOT_FOUND),
                        ((NotASegment, Refused), Exit.REFUSED), ((LockBusy,), Exit.LOCK_BUSY),
                        ((KvcachedError,), Exit.ERROR)):
        if isinstance(exc, types):
            return code
    return None


def describe(exc: BaseException) -> tuple[Exit, str | None]:
    """(exit code, one-line message or None for silence) for any exception that reached the top."""
    from typer import exceptions as typer_exc
    from typer._click import exceptions as click_exc

    if isinstance(exc, CliError):
        return exc.code, str(exc)
    if isinstance(exc, (KeyboardInterrupt, typer_exc.Abort)):
        return Exit.INTERRUPTED, "interrupted"
    if isinstance(exc, typer_exc.Exit):
        return Exit(exc.exit_code) if exc.exit_code in Exit._value2member_map_ else Exit.ERROR, None
    if isinstance(exc, click_exc.UsageError):
        where = exc.ctx.command_path if exc.ctx is not None else "kvctl"
        return Exit.USAGE, f"usage error: {exc.format_message()} (see '{where} --help')"
    if isinstance(exc, click_exc.ClickException):
        return Exit.ERROR, exc.format_message()
    if isinstance(exc, BrokenPipeError) or (isinstance(exc, OSError) and exc.errno == errno.EPIPE):
        return Exit.ERROR, None  # the reader went away (`kvctl list | head`): nothing to say to it
    code = _code_for_library(exc)
    if code is not None:
        return code, str(exc)
    if isinstance(exc, OSError):
        where = f"{exc.filename}: " if exc.filename else ""
        return Exit.ERROR, f"{where}{exc.strerror or exc}"
    return Exit.ERROR, f"internal error: {type(exc).__name__}: {exc} (run 'kvctl -v ...' for the traceback)"


def error_document(code: Exit, message: str | None) -> dict[str, object]:
    """What `--json` prints on stdout when a command fails (kvctl/schemas/error.json)."""
    return {"schema": "kvctl.error/1", "error": {"code": int(code), "name": code.name.lower(),
                                                 "message": message or code.name.lower().replace("_", " ")},
            "exit_code": int(code)}


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
        from .render import emit_json

        try:
            emit_json(error_document(code, message))
        except (BrokenPipeError, OSError):
            pass  # the reader went away
    return int(code)
