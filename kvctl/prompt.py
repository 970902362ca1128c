"""The prompt of `kvctl shell` (and of bare `kvctl` on a terminal): kvctl's commands, one line at a time.

Upstream's kvctl had such a shell. Each line runs as `kvctl <line>` with the
shell's own global options, through the same group; unknown input is an
error, never a system shell call (upstream's `!cmd` is gone on purpose).
Reads commands from stdin when it is not a terminal, and exits with the last
command's code.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable, Sequence

from .render import error_line, note

USAGE = 2


def run(commands: Sequence[str], run_line: Callable[[list[str]], int],
        complete_names: Callable[[], set[str]]) -> int:
    """The prompt loop: `commands` are what may be typed, `run_line(words)` runs one."""
    interactive = sys.stdin.isatty()
    if interactive:
        _setup_readline(list(commands), complete_names)
        note("kvctl shell: type a command (help for the list, exit or Ctrl-D to leave)")
    code = 0
    while True:
        try:
            line = input("kvctl> " if interactive else "")
        except EOFError:
            return code
        except KeyboardInterrupt:
            if interactive:
                print(file=sys.stderr)
                continue
            raise
        try:
            words = shlex.split(line)
        except ValueError as e:
            error_line(f"cannot parse input: {e}")
            code = USAGE
            continue
        if not words:
            continue
        if words[0] in ("exit", "quit"):
            return code
        if words[0] == "help":
            note("commands: " + ", ".join(commands) + "; exit")
            code = 0
            continue
        if words[0] not in commands:
            error_line(f"unknown command {words[0]!r} (commands: {', '.join(commands)}, help, exit)")
            code = USAGE
            continue
        code = run_line(words)


def _setup_readline(commands: list[str], complete_names: Callable[[], set[str]]) -> None:
    try:
        import readline
    except ImportError:
        return
    words_first = commands + ["help", "exit"]

    def complete(text: str, state: int) -> str | None:
        buf = readline.get_line_buffer()
        if not buf[:readline.get_begidx()].strip():
            words = [c for c in words_first if c.startswith(text)]
        else:
            try:
                names = complete_names()
            except OSError:
                names = set()
            words = sorted(n for n in names if n.startswith(text))
        return words[state] if state < len(words) else None

    readline.set_completer(complete)
    readline.set_completer_delims(" \t")
    readline.parse_and_bind("tab: complete")
