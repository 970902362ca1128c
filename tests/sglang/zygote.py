"""A Python that imported SGLang's main-process modules once and forks the SGLang tests' processes from it.

SGLang's main imports its engine, tokenizer manager and server modules: about
20 CPU seconds, as much as one scheduler's start. The mains of
tests/sglang/test_stop_paths.py and tests/sglang/test_launch.py are forked from this process instead (each in
its own session, as a serve started from a shell is), so that what each test
pays for is its schedulers' spawn, which is SGLang's own and stays real. A
forked main is an SGLang main whose modules were imported before its plugins
loaded, as in an offline script that imports `sglang` and then builds an
`Engine`; the plugin loads in each main, never here.

The tests that ran a snippet in a fresh interpreter (`python -c CODE`) for a
clean process (plugins, signal handlers, SGLang's IPC names) fork it from here
too (tests/sglang/serves.py's `Forked`): a forked child has every SGLang
module imported, and nothing else of a test's done in it, as a fresh one has
once its imports ran. It runs CODE as a new `__main__`, as `-c` does, with its
request's PYTHONPATH entries on sys.path.

Line protocol, one JSON object per line:
  stdin:  {"key": K, "module": M, "argv": [...], "env": {...}, "cwd": DIR, "log": PATH}
          (M: the driver whose main() the forked main runs, tests.sglang.serve_driver
          or tests.sglang.launch_driver), or "code": CODE instead of "module";
          "err": PATH, when there, takes stderr apart from the log (stdout)
  stdout: {"key": K, "pid": PID} once forked, {"key": K, "status": S} once it
          exited (S as subprocess reports it: negative for a signal).
The zygote exits when its stdin closes; the mains it forked are the tests'.
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import sys
import tempfile
import types

# What SGLang's main imports (tests/sglang/serve_driver.py), before any plugin loads; then what the `python -c`
# children add (SGLang's KV pools, allocators, radix cache and configurator; torch.distributed). Never kvcached:
# it reads its environment when imported, and each child has its own.
MODULES = ("sglang.srt.entrypoints.engine", "sglang.srt.managers.tokenizer_manager", "sglang.srt.server_args",
           "sglang.srt.utils.watchdog", "sglang.srt.utils.network", "sglang.srt.plugins", "zmq", "asyncio", "psutil",
           "setproctitle", "tests.sglang.serve_driver", "tests.sglang.launch_driver",
           "sglang.srt.mem_cache.memory_pool", "sglang.srt.mem_cache.allocator", "sglang.srt.mem_cache.radix_cache",
           "sglang.srt.mem_cache.kv_cache_configurator", "torch.distributed")


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
    for target, path in ((1, req["log"]), (2, req.get("err", req["log"]))):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, target)
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
    # Where a fresh interpreter of this environment would look first: its PYTHONPATH (a test's plugin directory).
    fresh = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[1:1] = fresh


def run_code(code: str) -> None:
    """`code` as `python -c` runs it: in a new `__main__` module, with no file of its own."""
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    exec(compile(code, "<string>", "exec"), main.__dict__)  # noqa: S102 - the test's own snippet


if __name__ == "__main__":
    import importlib

    for name in MODULES:
        importlib.import_module(name)
    # What Python's gc docs advise before fork() without exec(): what the imports made is never traversed again.
    # A forked child's last collection at exit would otherwise walk (and copy-on-write) this whole heap: seconds.
    gc.freeze()
    _say({"ready": True})
    request = serve_requests()
    if request is not None:
        become_main(request)
        # Then the interpreter exits as a main does: threads joined, atexit handlers run.
        if "code" in request:
            run_code(request["code"])
        else:
            importlib.import_module(request["module"]).main()
