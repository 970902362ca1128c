"""Shell completion, answered before typer, rich or the node layer are imported.

Every TAB press re-runs kvctl (or kvtop) with `_KVCTL_COMPLETE` (`_KVTOP_COMPLETE`)
set to `complete_bash`, `complete_zsh` or `complete_fish`, the words typed so
far in the environment, exactly as the scripts in completions/ pass them:
bash sets COMP_WORDS and COMP_CWORD; zsh and fish set _TYPER_COMPLETE_ARGS, and
fish _TYPER_COMPLETE_FISH_ACTION (`get-args`, or `is-args`: exit 0 when there
is something to offer). `source_<shell>` prints the script itself. These are
the protocol of typer's scripts, which kvctl shipped first: scripts already
installed on nodes keep working.

The answers come from kvctl/completion_table.py (commands, options, their
help, choices, doctor's checks), which scripts/gen_completions.py writes
from the real commands together with completions/, and from the IPC names on
the node (`kvcached.node.clean.present`: two directory listings, no /proc pass). The
words are resolved the way click resolves them: options before the command
belong to kvctl, an option that takes a value completes that value, else the
next argument, else options (after `-`) or commands.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from typing import Any

SHELLS = ("bash", "zsh", "fish")

# The scripts in completions/ (scripts/gen_completions.py writes them; `source_<shell>` prints them).
SCRIPTS = {
    "bash": """\
_{prog}_completion() {{
    local IFS=$'\\n'
    COMPREPLY=( $( env COMP_WORDS="${{COMP_WORDS[*]}}" COMP_CWORD=$COMP_CWORD {var}=complete_bash $1 ) )
    return 0
}}

complete -o default -F _{prog}_completion {prog}
""",
    "zsh": """\
_{prog}_completion() {{
  eval $(env _TYPER_COMPLETE_ARGS="${{words[1,$CURRENT]}}" {var}=complete_zsh {prog})
}}

compdef _{prog}_completion {prog}
""",
    "fish": """\
complete --command {prog} --no-files --arguments \
"(env {var}=complete_fish _TYPER_COMPLETE_FISH_ACTION=get-args _TYPER_COMPLETE_ARGS=(commandline -cp) {prog})" \
--condition \
"env {var}=complete_fish _TYPER_COMPLETE_FISH_ACTION=is-args _TYPER_COMPLETE_ARGS=(commandline -cp) {prog}"
""",
}

Item = tuple[str, str]  # (value, help)


def split(line: str) -> list[str]:
    """Words as a shell splits them, a quote left open at the end included."""
    lex = shlex.shlex(line, posix=True)
    lex.whitespace_split = True
    lex.commenters = ""
    out: list[str] = []
    try:
        out.extend(lex)
    except ValueError:  # an unfinished quote or escape: the word so far
        out.append(lex.token)
    return out


def request(shell: str, environ: dict[str, str] | os._Environ[str]) -> tuple[list[str], str]:
    """(complete words after the program, the word being completed) from the shell's environment."""
    if shell == "bash":
        words = split(environ.get("COMP_WORDS", ""))
        cword = int(environ.get("COMP_CWORD", "0") or 0)
        return words[1:cword], words[cword] if cword < len(words) else ""
    line = environ.get("_TYPER_COMPLETE_ARGS", "")
    words = split(line)[1:]
    if words and not line.endswith(" "):
        return words[:-1], words[-1]
    return words, ""


class _Walk:
    """The words typed so far, read the way click reads them: which command, which options, which arguments."""

    def __init__(self, table: Any, prog: str, args: list[str]) -> None:
        self.table = table
        self.spec: dict[str, Any] = table.SPECS[prog]
        self.group = "commands" in self.spec
        self.used: set[str] = set()
        self.positional = 0
        self.roots: list[str] = []
        self._read(args)

    def option(self, name: str) -> dict[str, Any] | None:
        return next((o for o in self.spec["options"] if name in o["names"]), None)

    def _read(self, args: list[str]) -> None:
        i, dashdash = 0, False
        while i < len(args):
            word = args[i]
            i += 1
            if word == "--" and not dashdash:
                dashdash = True
            elif word.startswith("-") and word != "-" and not dashdash:
                i += self._read_option(word, args[i] if i < len(args) else None)
            elif self.group:
                if word not in self.spec["commands"]:
                    return  # click stops at an unknown command: the group completes
                self.spec, self.group, self.used = self.table.SPECS[word], False, set()
            else:
                self.positional += 1

    def _read_option(self, word: str, following: str | None) -> int:
        """Record option `word`; how many of the following words it consumed as its value (0 or 1)."""
        name, eq, value = word.partition("=") if word.startswith("--") else (word, "", "")
        opt = self.option(name)
        if opt is None and not word.startswith("--") and len(word) > 2:
            # A cluster of short options (-vv), or one with its value attached (-n0.5).
            opt = self.option(word[:2])
            if opt is not None and not opt["value"]:
                for ch in word[2:]:
                    self._read_option("-" + ch, None)
            elif opt is not None:
                eq, value = "=", word[2:]
        if opt is None:
            return 0
        self.used.add(opt["names"][0])
        if not opt["value"]:
            return 0
        if eq:
            self._value(opt, value)
            return 0
        if following is not None:
            self._value(opt, following)
            return 1
        return 0

    def _value(self, opt: dict[str, Any], value: str) -> None:
        if opt["names"][0] == "--root":
            self.roots.append(value)


def _values(kind: Any, incomplete: str, walk: _Walk, environ: Any) -> list[Item]:
    if kind == "names":
        root = (walk.roots or [environ.get("KVCTL_ROOT") or "/"])[-1]
        try:
            from kvcached.node import deployment_names

            found = deployment_names(root)
        except Exception:  # completion must never print a traceback into the shell
            return []
        return [(n, "") for n in sorted(found) if n.startswith(incomplete)]
    if kind == "checks":
        return [(c, "") for c in walk.table.CHECKS if c.startswith(incomplete)]
    return [(c, "") for c in kind or () if c.startswith(incomplete)]


def _option_names(walk: _Walk, incomplete: str) -> list[Item]:
    if not incomplete or incomplete[0].isalnum():
        return []
    return [(n, o["help"]) for o in walk.spec["options"]
            if not o["hidden"] and (o["multiple"] or o["names"][0] not in walk.used)
            for n in o["names"] if n.startswith(incomplete)]


def completions(table: Any, prog: str, args: list[str], incomplete: str,
                environ: dict[str, str] | os._Environ[str]) -> list[Item]:
    """What to offer for `incomplete` after `args` (the words after the program), as click would."""
    args = list(args)
    if incomplete == "=":
        incomplete = ""
    elif "=" in incomplete and incomplete.startswith("-"):
        name, _, incomplete = incomplete.partition("=")
        args.append(name)
    walk = _Walk(table, prog, args)
    if "--" not in args and incomplete.startswith("-"):
        return _commands(walk, incomplete) + _option_names(walk, incomplete)
    if args and args[-1].startswith("-"):
        opt = walk.option(args[-1])
        if opt is not None and opt["value"]:
            return _values(opt["complete"], incomplete, walk, environ)
    for n, arg in enumerate(walk.spec["arguments"]):
        if arg["nargs"] == -1 or walk.positional <= n:
            return _values(arg["complete"], incomplete, walk, environ)
    return _commands(walk, incomplete) + _option_names(walk, incomplete)


def _commands(walk: _Walk, incomplete: str) -> list[Item]:
    if not walk.group:
        return []
    return [(c, walk.table.SPECS[c]["help"]) for c in walk.spec["commands"] if c.startswith(incomplete)]


def _zsh_escape(text: str) -> str:
    return (text.replace('"', '""').replace("'", "''").replace("$", "\\$").replace("`", "\\`")
            .replace(":", r"\\:"))


def render(shell: str, items: list[Item]) -> str:
    """The answer in the form the shell's script reads."""
    if shell == "bash":
        return "\n".join(value for value, _ in items)
    if shell == "zsh":
        if not items:
            return "_files"
        body = "\n".join(f'"{_zsh_escape(v)}":"{_zsh_escape(h)}"' if h else f'"{_zsh_escape(v)}"' for v, h in items)
        return f"_arguments '*: :(({body}))'"
    return "\n".join(f"{v}\t{_one_line(h)}" if h else v for v, h in items)


def _one_line(text: str) -> str:
    return re.sub(r"\s", " ", text)


def answer(prog: str, instruction: str, environ: dict[str, str] | os._Environ[str] | None = None) -> int:
    """Answer one completion request (the value of `_KVCTL_COMPLETE`); the exit status for the shell."""
    environ = os.environ if environ is None else environ
    verb, _, shell = instruction.partition("_")
    if shell not in SHELLS or verb not in ("source", "complete"):
        print(f"{prog}: completion instruction {instruction!r} not supported (shells: {', '.join(SHELLS)})",
              file=sys.stderr)
        return 1
    var = f"_{prog.upper()}_COMPLETE"
    if verb == "source":
        sys.stdout.write(SCRIPTS[shell].format(prog=prog, var=var))
        return 0
    from . import completion_table

    args, incomplete = request(shell, environ)
    items = completions(completion_table, prog, args, incomplete, environ)
    if shell == "fish" and environ.get("_TYPER_COMPLETE_FISH_ACTION") == "is-args":
        return 0 if items else 1
    sys.stdout.write(render(shell, items) + "\n")
    return 0
