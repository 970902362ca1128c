"""Issue 11: kvctl for operators. Upstream's command surface, cron and systemd seeing failures, progress and
prompts that fit a screen, help that teaches, and a dependency range that is tested.

Terminal behaviour is tested on a real pseudo-terminal (pty) of a chosen size.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from kvcached.node.state.segment import create_segment, write_segment

from ..fs.helpers import backdate, stale_socket
from ..waiting import wait_for_state, wait_until
from .conftest import KVCTL, REPO, kvctl
from .test_commands import COMMANDS


def on_pty(args: list[str], *, cols: int = 80, rows: int = 40, keys: bytes = b"", key_after: str = "",
           env: dict[str, str] | None = None, timeout: float = 60.0, prog: str = KVCTL) -> tuple[int, str]:
    """Run `prog args` on a pseudo-terminal of `cols` x `rows`; type `keys` once `key_after` shows. (code, output)."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: a terminal on stdin, stdout and stderr
        full = {k: v for k, v in os.environ.items() if k not in ("KVCTL_ROOT", "NO_COLOR")}
        full.update({"TERM": "xterm-256color", "COLUMNS": str(cols), "LINES": str(rows), **(env or {})})
        os.execve(prog, [prog, *args], full)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    out = b""
    sent = not keys
    status = None

    def finished() -> bool:
        """One turn of the terminal: read what it printed, type the keys once, reap the program once it exited."""
        nonlocal out, sent, status
        ready, _, _ = select.select([fd], [], [], 0.1)  # the wait's own pause, while nothing is printed
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            out += chunk
        if not sent and key_after.encode() in out:
            wait_for_state(pid, "S")  # asleep, reading its terminal: what we type now is read
            os.write(fd, keys)
            sent = True
        done, st = os.waitpid(pid, os.WNOHANG)
        if not done:
            return False
        status = st
        try:
            while select.select([fd], [], [], 0.2)[0]:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                out += chunk
        except OSError:
            pass
        return True

    wait_until(finished, timeout, interval=0)
    os.close(fd)
    if status is None:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise AssertionError(f"{args} did not finish on the terminal: {out[-2000:]!r}")
    return os.waitstatus_to_exitcode(status), out.decode(errors="replace")


def plain(text: str) -> str:
    """What a person reads: escape sequences removed, a cursor moved to another line taken as a line break."""
    text = re.sub(r"\x1b\[[0-9]*[AB]", "\n", text)
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r", "", text)


def dead(layout, name: str, ranks: int = 1) -> None:
    create_segment(layout.segment_path(name), 1 << 30)
    for r in range(ranks):
        stale_socket(layout.socket_path(name, r))
        backdate(layout.socket_path(name, r))
    os.chmod(layout.socket_dir(name), 0o700)
    backdate(layout.socket_dir(name))
    backdate(layout.segment_path(name))


def lock_env(layout) -> dict[str, str]:
    return {"KVCTL_LOCK": os.path.join(layout.root, "gc.lock")}


# §1 upstream's command surface ---------------------------------------------------------

def test_list_shows_a_segment_held_open_that_nothing_else_names(layout, uniq) -> None:
    name = f"{uniq}held"
    path = layout.segment_path(name)
    with open(path, "wb") as f:  # upstream's: no mark, no socket directory, no name in any environment
        f.write((2 << 30).to_bytes(8, "little") + bytes(16))
    backdate(path)
    holder = subprocess.Popen([sys.executable, "-c", "import sys; f = open(sys.argv[1], 'rb'); print('open', "
                               "flush=True); sys.stdin.read()", path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        rows = kvctl("--root", layout.root, "list", "--json").json("list")
        assert [(r["ipc"], r["state"], r["reason"], r["limit_bytes"]) for r in rows] == \
            [(name, "live", "held_open", 2 << 30)]
        assert holder.pid in rows[0]["pids"]
    finally:
        holder.kill()
        holder.wait()


def test_kvtop_top_and_watch_take_names_and_refresh(layout, uniq) -> None:
    for n in ("a", "b"):
        create_segment(layout.segment_path(f"{uniq}{n}"), 1 << 30)
    for args in (["kvtop", "-r", "0.1", "--count", "2", f"{uniq}a"], ["top", "--refresh", "0.1", "--count", "1",
                                                                      f"{uniq}a"],
                 ["watch", f"{uniq}a", "-n", "0.1", "--count", "2"]):
        r = kvctl("--root", layout.root, *args)
        assert r.code == 0, (args, r.stderr)
        assert f"{uniq}a" in r.stdout and f"{uniq}b" not in r.stdout, args
    r = subprocess.run([os.path.join(os.path.dirname(KVCTL), "kvtop"), "--root", layout.root, "-r", "0.1", "--count",
                        "1", f"{uniq}b"], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 0 and f"{uniq}b" in r.stdout and f"{uniq}a" not in r.stdout, r.stderr


@pytest.mark.parametrize("cmd", [["top"], ["kvtop"], ["watch"]])
def test_q_quits_the_live_view_and_no_color_still_redraws(layout, cmd) -> None:
    create_segment(layout.segment_path("qview"), 1 << 30)
    code, out = on_pty(["--root", layout.root, *cmd, "-n", "0.2"], keys=b"q", key_after="q: quit",
                       env={"NO_COLOR": "1"})
    assert code == 0, out
    assert "qview" in plain(out)
    assert re.search(r"\x1b\[\d*[AK]", out), "the view must redraw in place (cursor movement)"
    assert not re.search(r"\x1b\[(3[0-7]|9[0-7]|38;)", out), "NO_COLOR: no colour"


def test_the_shell_knows_kvtop_and_bare_kvctl_opens_it_on_a_terminal(layout) -> None:
    r = kvctl("--root", layout.root, "shell", input="kvtop --count 1\nexit\n")
    assert r.code == 0 and "kvtop" in r.stdout, r.stderr
    code, out = on_pty(["--root", layout.root], keys=b"list\nexit\n", key_after="kvctl>")
    assert code == 0 and "No kvcached segments" in plain(out), out


def test_limit_warns_below_what_is_in_use(layout, uniq) -> None:
    name = f"{uniq}w"
    write_segment(create_segment(layout.segment_path(name), 4 << 30) and layout.segment_path(name), used=3 << 30)
    r = kvctl("--root", layout.root, "limit", name, "1G")
    assert r.code == 0 and "below what is in use" in r.stderr


# §2 cron and systemd ---------------------------------------------------------------------

STAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d{4} kvctl gc: ", re.M)


def test_cron_log_sees_failures_and_the_summary(layout, uniq) -> None:
    """README's cron line (stdout to /dev/null): exit 4 and its FAILED row reach stderr, timestamped."""
    if shutil.which("chattr") is None:
        pytest.skip("chattr (e2fsprogs) is not installed: cannot make an unlink fail as root")
    name = f"{uniq}f"
    dead(layout, name)
    sdir = layout.socket_dir(name)
    if subprocess.run(["chattr", "+i", sdir], capture_output=True).returncode != 0:
        pytest.skip(f"{layout.root} is on a filesystem without the immutable attribute")
    try:
        p = subprocess.run(f"{KVCTL} --root {layout.root} gc --yes >/dev/null", shell=True, capture_output=True,
                           text=True, env={**os.environ, **lock_env(layout)}, timeout=60)
    finally:
        subprocess.run(["chattr", "-i", sdir], check=True)
    assert p.returncode == 4, p.stderr
    assert STAMP.search(p.stderr) and "FAILED socket" in p.stderr and "failed" in p.stderr.splitlines()[-1], p.stderr


def test_cron_log_sees_the_time_limit(layout, uniq) -> None:
    for i in range(20):
        dead(layout, f"{uniq}t{i}")
    p = subprocess.run(f"{KVCTL} --root {layout.root} gc --yes --time-limit 0.000001 >/dev/null", shell=True,
                       capture_output=True, text=True, env={**os.environ, **lock_env(layout)}, timeout=60)
    assert p.returncode == 3
    assert STAMP.search(p.stderr) and "time limit reached" in p.stderr, p.stderr


def test_under_journald_lines_carry_a_priority_not_a_timestamp(layout, uniq, tmp_path) -> None:
    dead(layout, f"{uniq}j")
    log = tmp_path / "journal"
    with open(log, "w") as err:
        st = os.fstat(err.fileno())
        env = {**os.environ, **lock_env(layout), "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        r = subprocess.run([KVCTL, "--root", layout.root, "gc", "--yes"], stdout=subprocess.DEVNULL, stderr=err,
                           env=env, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 0
    assert log.read_text().splitlines()[-1].startswith("<6>kvctl gc: removed 3")


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_shipped_systemd_units_verify(tmp_path) -> None:
    """contrib/systemd as shipped; only ExecStart's path points at this install (verify checks it exists)."""
    for unit in ("kvctl-gc.service", "kvctl-gc.timer"):
        text = (REPO / "contrib" / "systemd" / unit).read_text()
        (tmp_path / unit).write_text(text.replace("/usr/local/bin/kvctl", KVCTL))
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(tmp_path / "kvctl-gc.service"),
                        str(tmp_path / "kvctl-gc.timer")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr.strip() == "" and r.stdout.strip() == "", r.stderr + r.stdout
    service = (REPO / "contrib" / "systemd" / "kvctl-gc.service").read_text()
    assert re.search(r"^Documentation=(https?|file|man|info):", service, re.M)
    args = re.search(r"^ExecStart=\S+ (.*)$", service, re.M).group(1).split()
    assert args[:2] == ["gc", "--yes"]


def test_shipped_cron_file_runs_what_readme_says(layout) -> None:
    lines = [ln for ln in (REPO / "contrib" / "cron" / "kvctl-gc").read_text().splitlines()
             if ln.strip() and not ln.startswith("#") and "=" not in ln.split()[0]]
    assert len(lines) == 1
    fields = lines[0].split(None, 6)
    assert len(fields) == 7 and fields[5] == "root" and fields[6].startswith("kvctl gc --yes")
    assert lines[0] in (REPO / "README.md").read_text()
    cmd = fields[6].split(">")[0].split()[1:]
    prom = os.path.join(layout.root, "kvctl.prom")
    cmd = [prom if a.endswith(".prom") else a for a in cmd]
    assert kvctl("--root", layout.root, *cmd, env=lock_env(layout)).code == 0
    assert os.path.exists(prom)


# §3 progress and prompts that fit a screen ------------------------------------------------

def test_gc_on_a_terminal_shows_deployments_not_every_entry(layout, uniq) -> None:
    for i in range(30):
        dead(layout, f"{uniq}p{i}", ranks=3)
    code, out = on_pty(["--root", layout.root, "gc"], keys=b"n\n", key_after="Remove",
                       env=lock_env(layout))
    text = plain(out)
    assert code == 3, text
    assert "Remove 150 stale entries of 30 deployment(s)?" in text
    assert "DEPLOYMENT" in text and "w2.sock" not in text, "the prompt shows one row per deployment"
    code, out = on_pty(["--root", layout.root, "gc", "--yes"], env=lock_env(layout))
    text = plain(out)
    assert code == 0 and "DEPLOYMENT" in text and "REMOVED" in text and "w2.sock" not in text, text
    assert "gc: removed 150" in text


def test_gc_verbose_lists_every_entry(layout, uniq) -> None:
    dead(layout, f"{uniq}v", ranks=2)
    code, out = on_pty(["--root", layout.root, "gc", "--yes", "-v"], env=lock_env(layout), cols=250)
    assert code == 0 and "w1.sock" in plain(out)


def test_top_keeps_its_orphans_column_at_80_columns(layout, uniq) -> None:
    create_segment(layout.segment_path(f"{uniq}{'n' * 40}"), 1 << 30)
    code, out = on_pty(["--root", layout.root, "top", "--count", "1"], cols=80)
    text = plain(out)
    assert code == 0 and "ORPHANS" in text, text
    assert max(len(line) for line in text.splitlines()) <= 80, text
    assert "0%" in text and "." * 10 in text  # usage and its bar are whole, the name folds


# §4 help that teaches ---------------------------------------------------------------------

@pytest.mark.parametrize("cmd", COMMANDS + ["kvtop"])
def test_help_names_values_and_ends_with_examples_and_exit_codes(cmd: str) -> None:
    r = kvctl(cmd, "--help", env={"COLUMNS": "200"})
    assert r.code == 0
    assert not re.search(r"<(bool|int|float|str|list\[)", r.stdout), r.stdout
    assert "Examples:" in r.stdout and "Exit codes:" in r.stdout
    for path in re.findall(r"schema: (\S+\.json)", r.stdout):
        assert os.path.exists(path), path


def test_top_level_help_and_bare_kvctl_off_a_terminal() -> None:
    r = kvctl()
    assert r.code == 0 and "Commands:" in r.stdout and "usage error" not in r.stderr
    assert not re.search(r"<(bool|int|str)>", r.stdout)


def test_top_level_help_names_the_root_variable_once() -> None:
    r = kvctl("--help", env={"COLUMNS": "200"})
    assert r.code == 0 and r.stdout.count("KVCTL_ROOT") == 1 and "[env: KVCTL_ROOT]" in r.stdout, r.stdout


def test_verbose_works_after_the_command(layout) -> None:
    r = kvctl("--root", layout.root, "gc", "--dry-run", "-v")
    assert r.code == 0 and re.search(r"\[\d+\.\d+s\]", r.stdout), r.stdout + r.stderr
    r = kvctl("gc", "--dry-run", "--root", layout.root)
    assert r.code == 0


def test_hints_carry_the_runs_options(layout, uniq) -> None:
    dead(layout, f"{uniq}h")
    r = kvctl("--root", layout.root, "inspect", "--min-age", "0")
    hint = f"kvctl --root {layout.root} gc --yes --min-age 0 removes them"
    assert hint in r.stdout, r.stdout
    # Pasted as printed, it acts on the same node.
    cmd = hint.removesuffix(" removes them").split()[1:]
    assert kvctl(*cmd, env=lock_env(layout)).code == 0
    assert not os.listdir(layout.shm_dir)


def test_kvtop_completion() -> None:
    env = {**os.environ, "_KVTOP_COMPLETE": "complete_bash", "COMP_WORDS": "kvtop --c", "COMP_CWORD": "1"}
    r = subprocess.run([os.path.join(os.path.dirname(KVCTL), "kvtop")], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.stdout.split() == ["--count"]
    assert "--long-option root --require-parameter --force-files" in (REPO / "completions" / "kvctl.fish").read_text()
    assert "--long-option prometheus" in (REPO / "completions" / "kvctl.fish").read_text()


# §5 dependencies that stay working --------------------------------------------------------

def _typer_range() -> tuple[str, str]:
    text = (REPO / "pyproject.toml").read_text()
    m = re.search(r'"typer>=([0-9.]+),<([0-9.]+)"', text)
    assert m, "pyproject gives typer the tested range"
    return m.group(1), m.group(2)


def test_the_lowest_typer_of_the_range_works(tmp_path, layout, uniq) -> None:
    """The typer range in pyproject is the one tested: `make test` installs its highest, this runs kvctl on
    its lowest, installed with what pip resolves for it (click, before typer carried its own) into a target
    directory that comes first on the path."""
    low, _ = _typer_range()
    pin = f"{low}.0" if low.count(".") == 1 else low
    # `make test` installs it into the venv beforehand (the Makefile's typer-lowest), so the suite reaches no
    # index; a bare pytest without that directory installs it here.
    target = Path(sys.prefix) / "typer-lowest"
    if not (target / ".done").exists() or not (target / f"typer-{pin}.dist-info").is_dir():
        target = tmp_path / "typer"
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                            "--target", str(target), f"typer=={pin}"], capture_output=True, text=True, timeout=300)
        if r.returncode != 0 and ("Could not find" in r.stderr or "No matching distribution" in r.stderr
                                  or "Network" in r.stderr or "connection" in r.stderr.lower()):
            pytest.skip(f"typer {low} cannot be downloaded here: {r.stderr.strip().splitlines()[-1]}")
        assert r.returncode == 0, r.stderr
    env = {"PYTHONPATH": str(target)}
    probe = ("import json, typer, kvctl.cli, kvctl.typer_adapter as a; kvctl.cli.group()\n"
             "print(json.dumps([typer.__version__, typer.__file__, a.RuntimeParam is None]))")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env={**os.environ, **env})
    version, where, unadapted = json.loads(r.stdout)
    assert version.startswith(low) and where.startswith(str(target)), (version, where, r.stderr)
    assert unadapted  # the lowest has no pydantic coercion layer: the adapter installs nothing there
    name = f"{uniq}low"
    dead(layout, name)
    root = layout.root
    assert kvctl("--help", env=env).code == 0 and "Exit codes:" in kvctl("gc", "--help", env=env).stdout
    assert kvctl("--root", root, "gc", "--dry-run", "--json", env=env).json("gc")["exit_code"] == 3
    r = kvctl("--root", root, "limit", "x", "-1G", env=env)
    assert r.code == 2 and "must not be negative" in r.stderr and "Traceback" not in r.stderr
    r = kvctl("--root", root, "gc", "--kind", "bogus", env=env)
    assert r.code == 2 and "'bogus' is not one of" in r.stderr and "Traceback" not in r.stderr
    r = kvctl("--root", root, "list", "nope", "--json", env=env)
    assert r.code == 6 and r.json("error")["error"]["name"] == "not_found"
    assert kvctl("inspect", name, "--min-age", "0", "--json", "--root", root, env=env).json("inspect")["deployments"]
    r = kvctl("--root", root, "gc", "--yes", "--min-age", "0", "-v", env={**env, **lock_env(layout)})
    assert r.code == 0 and "removed 3" in r.stdout and not os.listdir(layout.shm_dir), r.stdout + r.stderr
    comp = {**os.environ, **env, "_KVCTL_COMPLETE": "complete_bash", "COMP_WORDS": "kvctl gc --dry", "COMP_CWORD": "2"}
    assert subprocess.run([KVCTL], capture_output=True, text=True, env=comp).stdout.split() == ["--dry-run"]


def test_make_demo_installs_only_what_the_demo_needs() -> None:
    r = subprocess.run(["make", "-n", "-B", "demo"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "pip" in r.stdout, r.stderr
    assert "[test]" not in r.stdout and "install-vllm" not in r.stdout, r.stdout
