"""A Python that imported SGLang's main-process modules once and forks the stop-path tests' SGLang mains.

SGLang's main imports its engine, tokenizer manager and server modules: about
20 CPU seconds, as much as one scheduler's start. The mains of
tests/sglang/test_stop_paths.py and tests/sglang/test_launch.py are forked from this process instead (each in
its own session, as a serve started from a shell is), so that what each test
pays for is its schedulers' spawn, which is SGLang's own and stays real. A
forked main is an SGLang main whose modules were imported before its plugins
loaded, as in an offline script that imports `sglang` and then builds an
`Engine`; the plugin loads in each main, never here.

Line protocol, one JSON object per line:
  stdin:  {"key": K, "module": M, "argv": [...], "env": {...}, "cwd": DIR, "log": PATH}
          (M: the driver whose main() the forked main runs, tests.sglang.serve_driver
          or tests.sglang.launch_driver)
  stdout: {"key": K, "pid": PID} once forked, {"key": K, "status": S} once it
          exited (S as subprocess reports it: negative for a signal).
The zygote exits when its stdin closes; the mains it forked are the tests'.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import tempfile

# What SGLang's main imports (tests/sglang/serve_driver.py), before any plugin loads.
MODULES = ("sglang.srt.entrypoints.engine", "sglang.srt.managers.tokenizer_manager", "sglang.srt.server_args",
           "sglang.srt.utils.watchdog", "sglang.srt.utils.network", "sglang.srt.plugins", "zmq", "asyncio", "psutil",
           "setproctitle", "tests.sglang.serve_driver", "tests.sglang.launch_driver")


def _say(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _status(raw: int) -> int:
    return -os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)


def serve_requests() -> dict | None:
    """Fork a main per request until stdin closes (None); in a forked main, its request."""
    started: dict[int, str] = {}
    buf = b""
    while True:
        ready, _, _ = select.select([sys.stdin.buffer], [], [], 0.05)
        while started:
            try:
                pid, raw = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            _say({"key": started.pop(pid), "status": _status(raw)})
        if not ready:
            continue
        chunk = os.read(sys.stdin.fileno(), 65536)
        if not chunk:
            return None
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            pid = os.fork()
            if pid == 0:
                return req
            started[pid] = req["key"]
            _say({"key": req["key"], "pid": pid})


def become_main(req: dict) -> None:
    """In the forked child: its own session, environment, directory and log, then SGLang's main."""
    os.setsid()
    fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGUSR1, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own: Ctrl-C is a KeyboardInterrupt
    os.environ.clear()
    os.environ.update(req["env"])
    tempfile.tempdir = None  # tempfile's directory is looked up again, from this environment's TMPDIR
    os.chdir(req["cwd"])
    sys.argv = req["argv"]


if __name__ == "__main__":
    import importlib

    for name in MODULES:
        importlib.import_module(name)
    _say({"ready": True})
    request = serve_requests()
    if request is not None:
        become_main(request)
        # Then the interpreter exits as a main does: threads joined, atexit handlers run.
        importlib.import_module(request["module"]).main()
