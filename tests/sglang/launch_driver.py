"""An SGLang main process for the tests: SGLang's own launcher, with a stand-in for the model's scheduler.

Run as `python -m tests.sglang.launch_driver REPORT SCENARIO [OPTIONS]` in the
environment of tests/sglang/cpu_env.py. It does what `Engine._launch_subprocesses`
does up to the schedulers (`_set_envs_and_config`, `publish`, `PortArgs`), then
calls the real `Engine._launch_scheduler_processes` with `stand_in_scheduler`
as its `run_scheduler_process_func` (SGLang's override point for that function)
and writes what it saw to REPORT as JSON, before it stops the way SCENARIO says.

The stand-in does what `run_scheduler_process` does before it builds a
`Scheduler` (load_plugins, publish with the spawn ranks, the real
`configure_scheduler_process`: process title, "kill myself when my parent
dies"), then sends the ready message `_wait_for_scheduler_ready` waits for
and idles where the event loop would run; a model is what it leaves out.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import sys
import time


def stand_in_scheduler(server_args, port_args, gpu_id, tp_rank, pp_rank, dp_rank, pipe_writer,  # noqa: ANN001
                       *display_ranks) -> None:
    """Everything `run_scheduler_process` does around a Scheduler, without the model."""
    import psutil
    import setproctitle
    from sglang.srt.managers import scheduler
    from sglang.srt.managers.scheduler import resolve_spawn_dp_rank
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, spawn_world_rank

    with open("/proc/self/cmdline", "rb") as f:  # before configure_scheduler_process retitles the process
        cmdline = f.read().decode().split("\0")
    load_plugins()
    dp_rank = resolve_spawn_dp_rank(dp_rank)
    publish(server_args, role="scheduler", ranks=SpawnRanks(
        world_rank=spawn_world_rank(server_args, tp_rank=tp_rank, pp_rank=pp_rank), dp_rank=dp_rank, gpu_id=gpu_id))
    # Through the module, as run_scheduler_process calls it: what plugins hooked there applies.
    scheduler.configure_scheduler_process(server_args, gpu_id, *display_ranks)
    parallel = get_parallel()
    pipe_writer.send({
        "status": "ready", "max_total_num_tokens": 64, "max_req_input_len": 32,
        "pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgrp(), "title": setproctitle.getproctitle(),
        "cmdline": cmdline, "title_cmdline": psutil.Process().cmdline()[0],
        "tp_rank": tp_rank, "pp_rank": pp_rank, "dp_rank": dp_rank,
        "published": {"tp_rank": parallel.tp_rank, "pp_rank": parallel.pp_rank, "dp_rank": parallel.dp_rank,
                      "tp_size": parallel.tp_size, "pp_size": parallel.pp_size},
        "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
    })
    while True:
        time.sleep(1)


def _launch(args: argparse.Namespace):  # noqa: ANN202 - SGLang's own types
    from sglang.srt.plugins import load_plugins

    load_plugins()  # what `sglang serve` and `python -m sglang.launch_server` do first (kvcached's, when enabled)
    from sglang.srt.entrypoints.engine import Engine, _set_envs_and_config
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import PortArgs, ServerArgs

    server_args = ServerArgs(model_path="dummy", device="cpu", tp_size=args.tp, pp_size=args.pp, dp_size=args.dp,
                             log_level="error")
    server_args.resolve_once()
    _set_envs_and_config(server_args)
    publish(server_args, role="tokenizer")
    port_args = PortArgs.init_new(server_args)
    result, procs = Engine._launch_scheduler_processes(server_args, port_args, stand_in_scheduler)
    result.wait_for_ready()
    return result, procs


def _tree() -> list[dict]:
    import psutil

    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            entry = {"pid": p.pid, "status": p.status()}
        except psutil.NoSuchProcess:
            continue
        try:
            entry["title"] = " ".join(p.cmdline())
        except psutil.Error:  # a zombie has no command line left
            entry["title"] = None
        out.append(entry)
    return out


def _state() -> list[str] | None:
    """Every path under KVCACHED_ROOT's /dev/shm and /tmp (what kvcached made there); None without a root."""
    root = os.environ.get("KVCACHED_ROOT")
    if not root:
        return None
    from kvcached.node.state.gclock import LOCK_NAME

    out = []
    for top in ("dev/shm", "tmp"):
        for dirpath, dirs, files in os.walk(os.path.join(root, top)):
            out += [os.path.relpath(os.path.join(dirpath, n), root) for n in dirs + files]
    # The start-up sweep (the claiming scheduler's) takes the gc lock at <root>/tmp; it stays, as kvctl gc's does.
    return sorted(p for p in out if p != f"tmp/{LOCK_NAME}")


def main() -> None:
    """Launch, report, then stop as the scenario says."""
    ap = argparse.ArgumentParser()
    ap.add_argument("report")
    ap.add_argument("scenario", choices=["report", "kill-tree", "kill-tree-and-self", "wait"])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1)
    args = ap.parse_args()

    result, procs = _launch(args)
    report = {
        "main": {"pid": os.getpid(), "pgid": os.getpgrp(), "start_method": multiprocessing.get_start_method(),
                 "sigquit": str(signal.getsignal(signal.SIGQUIT))},
        "infos": result.scheduler_infos, "all_child_pids": result.all_child_pids,
        "procs": [p.pid for p in procs], "tree": _tree(), "state": _state(),
    }

    def write(extra: dict) -> None:
        tmp = args.report + ".tmp"
        with open(tmp, "w") as f:
            json.dump(report | extra, f)
        os.replace(tmp, args.report)

    if args.scenario == "kill-tree":
        from sglang.srt.utils import kill_process_tree

        started = time.monotonic()
        kill_process_tree(os.getpid(), include_parent=False)
        write({"after": _tree(), "kill_seconds": time.monotonic() - started, "state_after": _state()})
        return
    write({})
    if args.scenario == "kill-tree-and-self":
        from sglang.srt.utils import kill_process_tree

        kill_process_tree(os.getpid())
        print("still running after kill_process_tree(include_parent=True)", flush=True)
        sys.exit(3)
    if args.scenario == "wait":
        signal.pause()


if __name__ == "__main__":
    main()
