"""An SGLang serve for the stop-path tests: SGLang's own main-side launch and stop code, model-free schedulers.

Run as `python -m tests.sglang.serve_driver REPORT MODE [--tp N] [--dp N] [--dp-attention] [--detokenizer]
[--watchdog-interval S]`
in the environment of tests/sglang/cpu_env.py, with kvcached enabled or not.
`KVTEST_SGLANG_OFF=patch,...` reverts those kvcached patches in every process
of the serve once they are applied (the kit's own undo): the cases that show
what SGLang leaves without them.

Main does what SGLang's main does, with SGLang's own code wherever it runs
without a model:

- `load_plugins()` first (as `sglang serve`, `python -m sglang.launch_server`
  and `Engine.__init__` do), SGLang's `configure_logger` (its main logs at
  `log_level`, INFO here: the drain's "Gracefully exiting" and the owner's
  removals show in main's log), `_set_envs_and_config` (spawn, the
  launch-phase SIGQUIT handler), `publish`, `PortArgs`;
- the real `Engine._launch_scheduler_processes` with `stand_in_scheduler` as
  its `run_scheduler_process_func` (SGLang's override point), then
  `wait_for_ready()`; with `--detokenizer`, the real
  `Engine._launch_detokenizer_subprocesses` and `run_detokenizer_process`;
- MODE `serve`: what the HTTP server's main has after its first request. A
  `SubprocessWatchdog` over its children (polling every `--watchdog-interval`
  seconds, 0.2 unless told); SGLang's `SignalHandler` on an
  asyncio loop for SIGTERM and SIGQUIT (as `auto_create_handle_loop` installs
  them); the real `TokenizerManager.sigterm_watchdog` coroutine (drain,
  `ShutdownReq` over a ZMQ socket made as `TokenizerManager.init_ipc_channels`
  makes it, on a `zmq.asyncio` context, the 15 s wait for schedulers by
  title, `kill_process_tree`, exit); and `launch_server.py`'s
  `finally: kill_process_tree(os.getpid(), include_parent=False)` around the
  loop, where Ctrl-C lands. The TokenizerManager itself needs a tokenizer: a
  stand-in object carries the attributes those methods read, and SGLang's own
  methods run on it.
- MODE `offline`: an `Engine` script. On SIGUSR1, the real `Engine.shutdown`
  on an Engine whose subprocesses are the ones launched here.

The stand-in scheduler runs SGLang's real `run_scheduler_process`
(load_plugins, publish, configure_scheduler_process, the ready message from
`get_init_info`, the except that SIGQUITs the parent, the finally) with one
thing replaced: the `Scheduler` class, by `ModelFreeScheduler`, a subclass
whose constructor builds no model (a real CPU KV pool and token allocator
instead) and whose event loop only takes control requests off SGLang's ZMQ
socket, as `event_loop_normal` does, handing `ShutdownReq` to the real
`handle_shutdown`. SIGUSR1 makes its event loop raise, as a crashing
scheduler's does.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

OFF_VAR = "KVTEST_SGLANG_OFF"


def revert_off() -> list[str]:
    """Undo the kvcached patches KVTEST_SGLANG_OFF names in this process (those applied so far); their names."""
    names = [n for n in os.environ.get(OFF_VAR, "").split(",") if n]
    if names:
        from kvcached.integration.sglang.patches import REGISTRY

        REGISTRY.revert(names)
    return names


def applied() -> list[str]:
    """The kvcached SGLang patches applied in this process."""
    if "kvcached.integration.sglang.patches" not in sys.modules:
        return []
    from kvcached.integration.sglang.patches import REGISTRY

    return list(REGISTRY.applied())


def stand_in_scheduler(*args) -> None:  # noqa: ANN002 - SGLang's run_scheduler_process arguments
    """SGLang's run_scheduler_process with a model-free Scheduler class."""
    from sglang.srt.managers import scheduler as sched
    from sglang.srt.plugins import load_plugins

    load_plugins()  # what run_scheduler_process does first (a no-op when it does it again)
    revert_off()
    sched.Scheduler = model_free_scheduler_class()
    sched.run_scheduler_process(*args)


def model_free_scheduler_class() -> type:
    """ModelFreeScheduler, a subclass of the real Scheduler (defined here: SGLang is imported by now)."""
    import threading

    import setproctitle
    import torch
    import zmq
    from sglang.srt.managers.io_struct import ShutdownReq, sock_recv
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.utils.network import get_zmq_socket

    crash = threading.Event()
    signal.signal(signal.SIGUSR1, lambda *_: crash.set())

    class ModelFreeScheduler(Scheduler):
        """What a Scheduler has once built, without a model: a CPU KV pool, its allocator, its control socket."""

        def __init__(self, server_args, port_args) -> None:  # noqa: ANN001 - SGLang's types
            self.server_args = server_args
            self.gracefully_exit = False
            self.enable_hierarchical_cache = False
            self.page_size = 1
            self.max_total_num_tokens = 64
            self.max_req_input_len = 32
            self.startup_time = 0.0
            pool = MHATokenToKVPool(size=64, page_size=1, dtype=torch.float16, head_num=2, head_dim=8, layer_num=2,
                                    device="cpu", enable_memory_saver=False, enable_alt_stream=False)
            self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(64, dtype=torch.float16, device="cpu",
                                                                     kvcache=pool, need_sort=False)
            self.metrics_reporter = type("Reporter", (), {"_shutdown_fpm": lambda self: None})()
            self.async_d2h_worker = None
            parallel = get_parallel()
            _write(f"{os.environ['KVTEST_REPORT']}.sched-{os.getpid()}", {
                "pid": os.getpid(), "tp_rank": parallel.tp_rank, "pp_rank": parallel.pp_rank,
                "dp_rank": parallel.dp_rank, "title": setproctitle.getproctitle(), "applied": applied()})
            self.recv_from_tokenizer = None
            if parallel.pp_rank == 0 and parallel.attn_tp_rank == 0:  # init_ipc_channels' rank zero
                self.recv_from_tokenizer = get_zmq_socket(zmq.Context(1), zmq.PULL,
                                                          port_args.scheduler_input_ipc_name, False)

        def run_event_loop(self) -> None:
            while not self.gracefully_exit:
                if crash.is_set():
                    raise RuntimeError("kvtest: the scheduler fails on purpose")
                if self.recv_from_tokenizer is None or not self.recv_from_tokenizer.poll(100):
                    time.sleep(0.1 if self.recv_from_tokenizer is None else 0)
                    continue
                req = sock_recv(self.recv_from_tokenizer)
                if isinstance(req, ShutdownReq):
                    self.handle_shutdown(req)

        def release_host_resources(self) -> None:
            pass  # no model, no host buffers

    return ModelFreeScheduler


def stand_in_detokenizer(server_args, port_args) -> None:  # noqa: ANN001
    """SGLang's run_detokenizer_process (title, parent-death signal, plugins), idle where its loop would run."""
    import setproctitle
    from sglang.srt.plugins import load_plugins
    from sglang.srt.utils import kill_itself_when_parent_died

    kill_itself_when_parent_died()
    setproctitle.setproctitle("sglang::detokenizer")
    load_plugins()
    _write(f"{os.environ['KVTEST_REPORT']}.detok-{os.getpid()}", {"pid": os.getpid()})  # titled by now
    signal.pause()


class TokenizerSide:
    """What SignalHandler and TokenizerManager.sigterm_watchdog use of a TokenizerManager; SGLang's own methods."""

    def __init__(self, port_args, watchdog) -> None:  # noqa: ANN001
        import zmq
        import zmq.asyncio
        from sglang.srt.managers.tokenizer_manager import ServerStatus, TokenizerManager
        from sglang.srt.utils.network import get_zmq_socket

        self.gracefully_exit = False
        self.rid_to_state: dict = {}
        self.server_status = ServerStatus.Up
        self._subprocess_watchdog = watchdog
        self._server_stop_hook = None
        self.asyncio_tasks: set = set()
        self.tokenizer_ipc_name = None
        # On a zmq.asyncio context, as init_ipc_channels makes it: the drain's synchronous send_pyobj then only
        # tries, and queues a future when no scheduler is connected. On a plain context that send blocks main's
        # one thread for good once every scheduler died before the drain sent ShutdownReq (issue 37).
        self.send_to_scheduler = get_zmq_socket(zmq.asyncio.Context(2), zmq.PUSH, port_args.scheduler_input_ipc_name,
                                                True)
        self.dispatch = TokenizerManager._dispatch_to_scheduler
        self.watchdog_coro = TokenizerManager.sigterm_watchdog
        self.force_exit_handler = lambda: None

    def _dispatch_to_scheduler(self, obj) -> None:  # noqa: ANN001
        self.dispatch(self, obj)

    def dump_requests_before_crash(self) -> None:
        pass  # no requests were served


def _write(path: str, obj: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def _read(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _state(root: str) -> list[str]:
    """Every path under the test root's /dev/shm and /tmp (what kvcached made there), but the node's gc lock."""
    from kvcached.node.state.gclock import LOCK_NAME

    out = []
    for top in ("dev/shm", "tmp"):
        for dirpath, dirs, files in os.walk(os.path.join(root, top)):
            out += [os.path.relpath(os.path.join(dirpath, n), root) for n in dirs + files]
    # The start-up sweep (the claiming scheduler's) takes the gc lock at <root>/tmp; it stays, as kvctl gc's does.
    return sorted(p for p in out if p != f"tmp/{LOCK_NAME}")


def free_dp_attention_port(attempts: int = 200) -> int:
    """An HTTP port for ServerArgs whose derived DP-attention TCP ports are all free now.

    With DP attention SGLang's main and schedulers talk over TCP on ports
    derived from the HTTP port (`port + ZMQ_TCP_PORT_DELTA` and the six after
    it; 30233-30239 for the default 30000), which two suites on one machine, or
    two serves of one, would share. The span is drawn below 22000, where
    SGLang's own free-port draw for its NCCL port (22000-29999) never lands.
    """
    import random
    import socket

    from sglang.srt.server_args import ZMQ_TCP_PORT_DELTA

    for port in random.sample(range(10000, 21000), attempts):
        span = range(port + ZMQ_TCP_PORT_DELTA, port + ZMQ_TCP_PORT_DELTA + 8)
        try:
            for p in span:
                with socket.socket() as s:
                    s.bind(("0.0.0.0", p))
        except OSError:
            continue
        return port
    raise RuntimeError("kvtest: no free span of ports for a DP-attention serve")


def _launch(args: argparse.Namespace):  # noqa: ANN202 - SGLang's own types
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.entrypoints.engine import Engine, _set_envs_and_config
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import PortArgs, ServerArgs
    from sglang.srt.utils import configure_logger

    off = revert_off()  # the engine's patches applied when its module was imported, just now
    # load_balance_method: what "auto" resolves to outside PD disaggregation; resolution stops early for a
    # model_path of "dummy" (arg_groups/pipeline.py), before handle_load_balance_method, and the DP controller
    # refuses "auto".
    server_args = ServerArgs(model_path="dummy", device="cpu", tp_size=args.tp, dp_size=args.dp,
                             enable_dp_attention=args.dp_attention, log_level="info", skip_tokenizer_init=True,
                             load_balance_method="round_robin",
                             **({"port": free_dp_attention_port()} if args.dp_attention else {}))
    configure_logger(server_args)  # what Engine._launch_subprocesses does first
    server_args.resolve_once()
    _set_envs_and_config(server_args)
    publish(server_args, role="tokenizer")
    port_args = PortArgs.init_new(server_args)
    result, procs = Engine._launch_scheduler_processes(server_args, port_args, stand_in_scheduler)
    result.wait_for_ready()
    children = list(procs)
    if args.detokenizer:
        detok, _ = Engine._launch_detokenizer_subprocesses(server_args, port_args, stand_in_detokenizer)
        children += detok
        # Ready once it carries its title (the test reads it): SGLang's main does not wait for it.
        while not all(os.path.exists(f"{os.environ['KVTEST_REPORT']}.detok-{p.pid}") for p in detok):
            if any(p.exitcode is not None for p in detok):
                raise RuntimeError("kvtest: the detokenizer exited during its start")
            time.sleep(0.05)
    return result, procs, children, port_args, off


def main() -> None:
    """Launch, report, then stop the way the test makes the serve stop."""
    ap = argparse.ArgumentParser()
    ap.add_argument("report")
    ap.add_argument("mode", choices=["serve", "offline"])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--dp-attention", action="store_true")
    ap.add_argument("--detokenizer", action="store_true")
    ap.add_argument("--watchdog-interval", type=float, default=0.2)
    args = ap.parse_args()
    root = os.environ["KVCACHED_ROOT"]

    os.environ["KVTEST_REPORT"] = args.report  # the schedulers, spawned with this environment, report there too
    result, procs, children, port_args, off = _launch(args)
    sched = [_read(f"{args.report}.sched-{pid}") for pid in result.all_child_pids
             if os.path.exists(f"{args.report}.sched-{pid}")]
    report = {"main": os.getpid(), "pgid": os.getpgrp(), "procs": [p.pid for p in procs],
              "children": [p.pid for p in children], "all_child_pids": list(result.all_child_pids),
              "infos": result.scheduler_infos, "applied": applied(), "off": off, "sched": sched}

    def write(name: str, extra: dict) -> None:
        _write(f"{args.report}.{name}", report | extra)

    if args.mode == "offline":
        from sglang.srt.entrypoints.engine import Engine

        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        write("ready", {"state": _state(root)})
        signal.sigwait({signal.SIGUSR1})
        engine = Engine.__new__(Engine)  # what Engine.__init__ leaves for shutdown() to read
        engine.tokenizer_manager = None
        engine.shutdown()
        write("done", {"state": _state(root)})
        return
    serve(args, children, port_args, lambda extra: write("ready", extra | {"state": _state(root)}))


def serve(args: argparse.Namespace, children: list, port_args, ready) -> None:  # noqa: ANN001
    """The HTTP server's main after its first request, until a signal ends it."""
    import asyncio

    from sglang.srt.managers.tokenizer_manager import SignalHandler
    from sglang.srt.utils import kill_process_tree
    from sglang.srt.utils.watchdog import SubprocessWatchdog

    watchdog = SubprocessWatchdog(children, [f"child{i}" for i in range(len(children))],
                                  interval=args.watchdog_interval)
    watchdog.start()
    tm = TokenizerSide(port_args, watchdog)
    loop = asyncio.new_event_loop()
    handler = SignalHandler(tm)
    loop.add_signal_handler(signal.SIGTERM, handler.sigterm_handler)
    loop.add_signal_handler(signal.SIGQUIT, handler.running_phase_sigquit_handler)
    loop.create_task(tm.watchdog_coro(tm))
    ready({})
    try:
        loop.run_forever()
    finally:
        kill_process_tree(os.getpid(), include_parent=False)  # launch_server.py's own finally


if __name__ == "__main__":
    main()
