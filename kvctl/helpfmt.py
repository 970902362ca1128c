"""`--help` that teaches: real names for values, two or three examples, the exit codes.

Written by hand rather than through typer's rich help: that one prints Python
types (`<list[str]>`, `<bool>`) where an operator wants `NAME...` and `SIZE`,
and importing rich for every `--help` (and every completion) costs start-up.
The text is plain, wrapped to the terminal by click's formatter.
"""

from __future__ import annotations

import os
from typing import Any

SCHEMAS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "schemas")

GLOBAL = "Global options --root DIR and -v may also come after the command. More: kvctl --help, docs/KVCTL.md."

# Each command's examples (`kvctl` for the group), the one source of the Examples of its --help and so of
# docs/KVCTL.md, which shows that help (scripts/gen_completions.py writes it; a test fails when it is stale).
EXAMPLES: dict[str, tuple[str, ...]] = {
    "kvctl": ("kvctl inspect", "kvctl gc --dry-run", "kvctl gc --yes", "kvctl doctor"),
    "list": ("kvctl list", "kvctl list 'kvcached_vLLM_*' --json | jq '.[].ipc'"),
    "limit": ("kvctl limit kvcached_vLLM_4242 40G", "kvctl limit my-serve 512M --json"),
    "limit-percent": ("kvctl limit-percent my-serve 30", "kvctl limit-percent my-serve 12.5 --device 1"),
    "watch": ("kvctl watch", "kvctl watch my-serve -n 5", "kvctl watch -A   (every pod's /dev/shm filling, live)"),
    "top": ("kvctl top", "kvctl top -r 0.5 my-serve", "kvtop --count 1   (one snapshot, e.g. into a log)",
            "kvtop -A   (every place's fill)"),
    "kvtop": ("kvctl kvtop", "kvctl kvtop -r 2 my-serve"),
    "delete": ("kvctl delete kvcached_vLLM_4242", "kvctl delete my-serve --yes --min-age 0"),
    "inspect": ("kvctl inspect", "kvctl inspect my-serve --json", "kvctl inspect --pid 41237   (a container's view)"),
    "gc": ("kvctl gc --dry-run", "kvctl gc --yes --engines --prometheus /var/lib/node_exporter/textfile/kvctl.prom",
           "kvctl gc --yes --engines --every 10m --json   (a node agent: a JSON line per run until SIGTERM)",
           "kvctl gc --yes --min-age 0 my-serve   (an entrypoint: go on after 0, 3 or 6; docs/KVCTL.md)",
           "kvctl gc --check-heartbeat /run/kvctl/heartbeat --max-age 20m   (the agent's liveness probe)"),
    "doctor": ("kvctl doctor", "kvctl doctor node engine --strict", "kvctl doctor --json"),
    "demo": ("kvctl demo", "kvctl --root /tmp/kvdemo demo --tp 1 --pp 1"),
    "shell": ("kvctl shell", "printf 'list\\ngc --dry-run\\n' | kvctl shell"),
}

# Each command's exit codes, one (code, when) pair each: `--help` joins them into one line, docs/KVCTL.md
# shows that help, and a test holds every code to kvctl/exitcodes.py. A pair without a code (None) is a
# rule that names no single code.
EXITS: dict[str, tuple[tuple[int | None, str], ...]] = {
    "kvctl": ((0, "ok"), (1, "error"), (2, "usage"), (3, "stale entries remain"), (4, "partial failure"),
              (5, "gc lock busy"), (6, "not found"), (7, "refused"), (8, "unhealthy"), (9, "metrics not written"),
              (130, "interrupted")),
    "list": ((0, "ok"), (6, "NAME matches nothing")),
    "limit": ((0, "set"), (2, "bad SIZE or NAME"), (6, "no such segment"), (7, "not a kvcached segment")),
    "limit-percent": ((0, "set"), (1, "no torch or no such GPU"), (2, "bad PCT or NAME"), (6, "no such segment"),
                      (7, "not a segment")),
    "watch": ((0, "after --count refreshes or q"), (2, "bad interval"), (130, "Ctrl-C")),
    "top": ((0, "after --count refreshes or q"), (2, "bad interval"), (130, "Ctrl-C")),
    "kvtop": ((0, "after --count refreshes or q"), (2, "bad interval"), (130, "Ctrl-C")),
    "delete": ((0, "removed"), (3, "stale entries remain"), (4, "a removal failed"), (6, "no such deployment"),
               (7, "refused (live, not ours, or not proven dead without --yes)")),
    "inspect": ((0, "ok"), (6, "NAME or --pid matches nothing")),
    "gc": ((0, "nothing stale remains"), (1, "error (the lock file, or a --prometheus FILE that is no regular "
           "file: before any work)"), (2, "usage"),
           (3, "stale entries remain (dry run, not confirmed, time limit)"),
           (4, "a removal or kill failed"), (5, "another gc holds the lock"), (6, "NAME matches nothing"),
           (9, "done and reported, but the --prometheus FILE could not be written (in place of 0 or 3)"),
           (None, "with --every: the last run's code on SIGTERM or SIGINT"),
           (8, "--check-heartbeat: the last run is older than --max-age, or no heartbeat")),
    "doctor": ((0, "healthy (warnings allowed)"), (8, "a check failed (--strict: or warned)")),
    "demo": ((0, "the deployment's state was found and removed"), (3, "something remained"),
             (4, "a removal failed")),
    "shell": ((None, "the exit code of the last command"),),
}


def exits_line(command: str) -> str:
    """A command's exit codes as its --help prints them: `0 ok; 6 NAME matches nothing`."""
    return "; ".join(when if code is None else f"{code} {when}" for code, when in EXITS[command])


def json_help(command: str) -> str:
    """The --json option's help, naming the schema file that exists in this install."""
    return f"Print one JSON document on stdout (schema: {os.path.join(SCHEMAS, command + '.json')})."


def _param_label(p: Any) -> str:
    if p.param_type_name == "argument":
        name = p.metavar or p.name.upper()
        return f"{name}..." if p.nargs != 1 and not name.endswith("...") else name
    longs = [o for o in p.opts if o.startswith("--")]
    shorts = [o for o in p.opts if not o.startswith("--")]
    label = ", ".join(shorts + longs + list(p.secondary_opts))
    if not (p.is_flag or p.count):
        label += f" {p.metavar or 'VALUE'}"
        if getattr(p, "multiple", False):
            label += " (repeatable)"
    return label if shorts else "    " + label


def _param_help(p: Any) -> str:
    text = (getattr(p, "help", None) or "").strip()
    if isinstance(p.show_default, str):
        text += f" [default: {p.show_default}]"
    envvar = getattr(p, "envvar", None)
    if envvar and getattr(p, "show_envvar", False):
        text += f" [env: {envvar}]"
    return text


def format_command(cmd: Any, ctx: Any, formatter: Any, name: str) -> None:
    """The whole --help of one command, into click's formatter."""
    # `kvtop` is the kvtop command under its own program name: not "kvtop kvtop".
    path = ctx.info_name if ctx.parent is not None and ctx.parent.info_name == ctx.info_name else ctx.command_path
    formatter.write_usage(path, " ".join(cmd.collect_usage_pieces(ctx)))
    if cmd.help:
        formatter.write_paragraph()
        formatter.write_text(cmd.help.strip())
    params = [p for p in cmd.get_params(ctx) if not getattr(p, "hidden", False)]
    args = [(_param_label(p), _param_help(p)) for p in params if p.param_type_name == "argument"]
    opts = [(_param_label(p), _param_help(p)) for p in params if p.param_type_name == "option"]
    if args:
        with formatter.section("Arguments"):
            formatter.write_dl(args)
    if opts:
        with formatter.section("Options"):
            formatter.write_dl(opts)
    examples = EXAMPLES.get(name, ())
    if examples:
        with formatter.section("Examples"):
            for line in examples:
                formatter.write_text(line)
    if name in EXITS:
        with formatter.section("Exit codes"):
            formatter.write_text(exits_line(name))
    formatter.write_paragraph()
    formatter.write_text(GLOBAL)


def format_group(group: Any, ctx: Any, formatter: Any) -> None:
    """`kvctl --help`: what kvctl is, its global options, every command in one line."""
    formatter.write_usage(ctx.command_path, "[--root DIR] [-v] COMMAND [ARGS]... [--json]")
    if group.help:
        formatter.write_paragraph()
        formatter.write_text(group.help.strip())
    opts = [(_param_label(p), _param_help(p)) for p in group.get_params(ctx) if not getattr(p, "hidden", False)]
    with formatter.section("Global options (before or after the command)"):
        formatter.write_dl(opts)
    rows = []
    for sub in group.list_commands(ctx):
        cmd = group.get_command(ctx, sub)
        if cmd is not None and not cmd.hidden:
            rows.append((sub, (cmd.short_help or (cmd.help or "").split("\n")[0]).strip()))
    with formatter.section("Commands"):
        formatter.write_dl(rows)
    with formatter.section("Examples"):
        for line in EXAMPLES["kvctl"]:
            formatter.write_text(line)
    with formatter.section("Exit codes"):
        codes = ", ".join(f"{code} {when}" for code, when in EXITS["kvctl"])
        formatter.write_text(f"{codes} (README.md: exit codes)")
    formatter.write_paragraph()
    formatter.write_text("'kvctl COMMAND --help' for a command's options. Run without a command on a terminal: "
                         "the interactive shell.")
