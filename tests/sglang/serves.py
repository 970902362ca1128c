"""Whole SGLang serves for the stop-path tests: mains forked from the zygote, schedulers spawned by SGLang.

A `Spec` says what to start (tests/sglang/serve_driver.py's MODE and shape)
and which kvcached patches are reverted in it (the cases that show what SGLang
leaves without them). Each serve has a node root of its own (KVCACHED_ROOT),
so its kvcached state is what is under it, and its own session.

`Serves` starts serves ahead of the tests that take them: while one test
stops its serve, the next ones' schedulers are already importing SGLang (a
spawned scheduler takes about 20 CPU seconds to start, all of it SGLang's
imports). Every serve is still its own: one per test, started once, stopped
by that test, SIGKILLed with its session at the end whatever happened.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from kvcached.node.state.gclock import LOCK_NAME
from tests.sglang.cpu_env import REPO, child_env
from tests.waiting import wait_for, wait_notified

READY_TIMEOUT = 420.0  # the schedulers of several serves import SGLang at once on a busy 2-core machine
CLEANUP = ("sglang-scheduler-stop", "sglang-owner-cleanup")  # every patch that gives state back; the rest makes it
OWNER = ("sglang-owner-cleanup",)
GC_LOCK = f"tmp/{LOCK_NAME}"  # the node's gc lock, which the claiming scheduler's start-up sweep takes; it stays


@dataclass(frozen=True)
class Spec:
    """One serve: the driver's mode and shape, kvcached on or off, the patches reverted in it."""

    mode: str = "serve"  # serve (the HTTP server's main) / offline (an Engine script)
    tp: int = 1
    dp: int = 1
    dp_attention: bool = False
    detokenizer: bool = False
    off: tuple[str, ...] = ()
    tag: str = ""  # tells apart two serves of one shape
    watchdog_s: float | None = None  # main's SubprocessWatchdog interval; None: the driver's 0.2 s

    def argv(self, report: str) -> list[str]:
        out = ["serve_driver", report, self.mode, "--tp", str(self.tp), "--dp", str(self.dp)]
        out += ["--watchdog-interval", str(self.watchdog_s)] if self.watchdog_s is not None else []
        return out + ["--dp-attention"] * self.dp_attention + ["--detokenizer"] * self.detokenizer

    @property
    def key(self) -> str:
        parts = [self.mode, f"tp{self.tp}", f"dp{self.dp}", "attn" * self.dp_attention, "detok" * self.detokenizer,
                 ("off-" + "+".join(self.off)) if self.off else "",
                 f"watchdog{self.watchdog_s:g}s" if self.watchdog_s is not None else "", self.tag]
        return "-".join(p for p in parts if p)


class Zygote:
    """The zygote process (tests/sglang/zygote.py) and what it reported, read by a thread."""

    def __init__(self, scratch: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.sglang.zygote"], env=child_env(scratch),
                                     cwd=scratch, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(os.path.join(scratch, "zygote.log"), "ab"))
        self.events: dict[str, dict] = {}
        self.ready = False
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self._cond:
                if msg.get("ready"):
                    self.ready = True
                else:
                    self.events.setdefault(msg["key"], {}).update(msg)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def _wait(self, what: str, cond, timeout: float):  # noqa: ANN001, ANN202
        def met() -> bool:
            if cond():
                return True
            if self.proc.poll() is not None:
                raise AssertionError(f"zygote: {what}: the zygote exited (rc {self.proc.poll()})")
            return False

        with self._cond:
            wait_notified(self._cond, met, timeout, explain=lambda: f"zygote: {what}")

    def fork(self, key: str, argv: list[str], env: dict[str, str], cwd: str, log: str,
             module: str = "tests.sglang.serve_driver", *, code: str | None = None, err: str | None = None) -> int:
        """Fork a main running `module`'s main() (or `code` as __main__) with `argv`, in its own session; its PID."""
        self._wait("start", lambda: self.ready, READY_TIMEOUT)
        assert self.proc.stdin is not None
        req = {"key": key, "argv": argv, "env": env, "cwd": cwd, "log": log}
        req.update({"code": code} if code is not None else {"module": module})
        if err is not None:
            req["err"] = err
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        self._wait(f"fork of {key}", lambda: "pid" in self.events.get(key, {}), 60)
        return int(self.events[key]["pid"])

    def status(self, key: str, timeout: float) -> int | None:
        """The main's exit status once it exited, waiting up to `timeout`; None if it still runs."""
        try:
            self._wait(f"exit of {key}", lambda: "status" in self.events.get(key, {}), timeout)
        except AssertionError:
            return None
        return int(self.events[key]["status"])

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Forked:
    """`python -c CODE` in this venv, forked from the zygote instead (its own session): read as cpu_env's Child is.

    Its stdout and stderr go to files of its own, removed once read.
    """

    count = 0

    def __init__(self, zygote: Zygote, code: str, scratch: str, *, args: Sequence[str] = (),
                 extra: Mapping[str, str] | None = None, timeout: float = 400.0) -> None:
        Forked.count += 1
        self.zygote, self.key, self.timeout = zygote, f"code-{Forked.count}", timeout
        self._dir = Path(tempfile.mkdtemp(prefix="fork", dir=scratch))
        self.out_path, self.err_path = self._dir / "out", self._dir / "err"
        self.pid = zygote.fork(self.key, ["-c", *args], child_env(scratch, extra), scratch, str(self.out_path),
                               code=textwrap.dedent(code), err=str(self.err_path))
        self._done: subprocess.CompletedProcess[str] | None = None

    def stdout(self) -> str:
        """What it printed so far."""
        return self.out_path.read_text() if self.out_path.exists() else ""

    def wait(self, timeout: float | None = None) -> int:
        """Its exit status (negative: the signal that ended it), waiting up to `timeout` (default: its own)."""
        limit = self.timeout if timeout is None else timeout
        status = self.zygote.status(self.key, limit)
        assert status is not None, f"{self.key} still runs after {limit:g}s:\n{self.stdout()[-3000:]}"
        return status

    def result(self) -> subprocess.CompletedProcess[str]:
        """What it printed and its exit status, once it exited (up to its timeout; then it is killed)."""
        if self._done is None:
            try:
                status = self.wait()
                self._done = subprocess.CompletedProcess(["-c"], status, self.stdout(), self.err_path.read_text())
            finally:
                self.close()
        return self._done

    def close(self) -> None:
        """Kill its session if anything of it still runs (a test that failed before reading it); reaped, removed."""
        for p in _session(self.pid):
            try:
                p.kill()
            except psutil.Error:
                pass
        # A zombie is gone: whoever adopted an orphan reaps it in its own time.
        wait_for(lambda: all(gone(p.pid) for p in _session(self.pid)), timeout=30, interval=0.05)
        self.zygote.status(self.key, 30)
        shutil.rmtree(self._dir, ignore_errors=True)


@dataclass
class Serve:
    """A running serve: its main, its node root, the reports its main writes."""

    spec: Spec
    root: Path
    zygote: Zygote
    pid: int = 0
    log: Path = field(default=Path())
    reports: dict[str, dict] = field(default_factory=dict)

    @property
    def report_base(self) -> Path:
        return self.root.parent / "report"

    def report(self, name: str = "ready", timeout: float = READY_TIMEOUT) -> dict:
        """The report the main writes at `name` (ready: the schedulers answered); fails with the log if it exits."""
        if name in self.reports:
            return self.reports[name]
        path = Path(f"{self.report_base}.{name}")
        try:
            wait_for(lambda: path.exists() or self.zygote.status(self.spec.key, 0) is not None, timeout=timeout,
                     interval=0.2, explain=self.tail)
            if not path.exists():
                raise AssertionError(f"{self.spec.key}: main exited {self.zygote.status(self.spec.key, 0)} before "
                                     f"its {name} report:\n{self.tail()}")
        except AssertionError:
            # At once, not at the module's end: a DP serve whose main is gone leaves its data_parallel_controller
            # polling for a ready message that never comes, on a whole core, while the next tests run.
            self.kill()
            raise
        self.reports[name] = json.loads(path.read_text())
        return self.reports[name]

    def wait(self, timeout: float = 120.0) -> int:
        """The main's exit status (negative: the signal that ended it)."""
        status = self.zygote.status(self.spec.key, timeout)
        assert status is not None, f"{self.spec.key}: main still runs after {timeout:g}s:\n{self.tail()}"
        return status

    def state(self) -> list[str]:
        """Every path kvcached could have left: under this serve's /dev/shm and /tmp, but the node's gc lock."""
        out = []
        for top in ("dev/shm", "tmp"):
            for dirpath, dirs, files in os.walk(self.root / top):
                out += [os.path.relpath(os.path.join(dirpath, n), self.root) for n in dirs + files]
        return sorted(p for p in out if p != GC_LOCK)

    def children(self) -> list[int]:
        """PIDs of every SGLang process main started (schedulers, DP controller, detokenizer), and a DP controller's."""
        r = self.report()
        return sorted(set(r["all_child_pids"]) | set(r["children"]))

    def tail(self) -> str:
        try:
            return self.log.read_text()[-6000:]
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL the serve's session: SGLang never leaves its launcher's process group."""
        if not self.pid:
            return
        for p in _session(self.pid):
            try:
                p.kill()
            except psutil.Error:
                pass


def _session(sid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid:
                out.append(p)
        except (OSError, psutil.Error):
            continue
    return out


def gone(pid: int) -> bool:
    """Dead: no such process, or a zombie (SGLang's own test of "released", _still_holding_resources)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class Serves:
    """Serves in the order the tests take them, each started before its test asks for it (`ahead` at a time)."""

    def __init__(self, zygote: Zygote, base: Path, order: Sequence[Spec], *, ahead: int = 2,
                 env: dict[str, str] | None = None) -> None:
        self.zygote = zygote
        self.base = base
        self.order = list(order)
        self.ahead = ahead
        self.env = env or {}
        self.started: dict[str, Serve] = {}

    def _start(self, spec: Spec) -> Serve:
        if spec.key in self.started:
            return self.started[spec.key]
        # Short paths: the deepest socket, tmp/kvcached-tp-<name>_dp<d>-<hash>/pp<k>/w<r>.sock, must fit 107 bytes.
        home = self.base / f"s{len(self.started)}"
        home.mkdir()
        (home / "key").write_text(spec.key + "\n")
        root = home / "r"
        for d in ("dev/shm", "tmp"):
            (root / d).mkdir(parents=True)
        serve = Serve(spec, root, self.zygote, log=home / "main.log")
        env = child_env(str(home), {"KVCACHED_ROOT": str(root), "KVCACHED_ENABLE": "1", "KVCACHED_LIMIT": "64M",
                                    "KVCACHED_OWNER_EXIT_WAIT_S": "10", "PYTHONPATH": str(REPO), **self.env})
        if spec.off:
            env["KVTEST_SGLANG_OFF"] = ",".join(spec.off)
        serve.pid = self.zygote.fork(spec.key, spec.argv(str(serve.report_base)), env, str(home), str(serve.log))
        self.started[spec.key] = serve
        return serve

    def get(self, spec: Spec) -> Serve:
        """`spec`'s serve (started now unless it already was), and the next ones of the order started."""
        serve = self._start(spec)
        if spec in self.order:
            for nxt in self.order[self.order.index(spec) + 1:][: self.ahead]:
                self._start(nxt)
        return serve

    def close(self) -> None:
        for serve in self.started.values():
            serve.kill()
        for serve in self.started.values():
            wait_for(lambda s=serve: not _session(s.pid), timeout=30, interval=0.1)
        if not os.environ.get("KVTEST_SGLANG_KEEP"):  # set it to read the serves' logs after a failure
            shutil.rmtree(self.base, ignore_errors=True)


def sigterm_group(serve: Serve) -> None:
    """What `kill -TERM -<pgid>` (systemd, docker stop, a pod's end) sends a whole serve."""
    os.killpg(serve.pid, signal.SIGTERM)
