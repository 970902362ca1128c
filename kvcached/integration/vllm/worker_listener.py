"""The `worker-listener` patch: each vLLM worker process serves kvcached's IPC socket for its life.

After `WorkerProc.__init__` (vLLM's parallel groups are up, so the TP rank and
PP stage are known) the worker starts a `WorkerListener` at
`[pp<k>/]w<r>.sock`; a spawned worker, which loads the plugin inside that very
`__init__`, starts it from `worker_busy_loop` instead, before the first RPC.
`WorkerProc.shutdown` stops it first, before vLLM's own teardown, which the
parent's SIGKILL races.
"""

from __future__ import annotations

import logging
from typing import Any

from .. import running
from ..patchkit import Changes, Patch, ShapeError
from .common import M_EXECUTOR, argument, engine_name, module, not_covered, params

log = logging.getLogger(__name__)

LISTENER_ATTR = "_kvcached_listener"  # on a WorkerProc: the listener it serves
_TRIED = "_kvcached_listener_tried"  # on a WorkerProc: a start was attempted (at most one per worker)


def probe() -> Any:
    """vLLM's WorkerProc, when its __init__, shutdown and busy loop have the shapes this patch knows."""
    cls = getattr(module(M_EXECUTOR), "WorkerProc", None)
    if cls is None:
        raise ShapeError("vllm.v1.executor.multiproc_executor has no WorkerProc")
    if not {"vllm_config", "rank", "local_rank"} <= set(params(cls.__init__)):
        raise ShapeError("WorkerProc.__init__ no longer takes vllm_config, local_rank and rank")
    if params(getattr(cls, "shutdown", None)) != ["self"]:
        raise ShapeError("WorkerProc.shutdown() is missing or takes arguments")
    if params(getattr(cls, "worker_busy_loop", None)) != ["self"]:
        raise ShapeError("WorkerProc.worker_busy_loop() is missing or takes arguments")
    return cls


def worker_ranks(parallel_config: Any, rank: int) -> tuple[int, int]:
    """(TP rank, PP stage) of global worker `rank`: from vLLM's groups when up, else from the rank layout."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return get_tp_group().rank_in_group, get_pp_group().rank_in_group
    except Exception:
        pass
    # vLLM orders world ranks as DP × PP × PCP × TP (TP fastest).
    tp = int(getattr(parallel_config, "tensor_parallel_size", 1) or 1)
    pcp = int(getattr(parallel_config, "prefill_context_parallel_size", 1) or 1)
    pp = int(getattr(parallel_config, "pipeline_parallel_size", 1) or 1)
    return rank % tp, (rank // (tp * pcp)) % pp


def start_worker_listener(worker: Any, vllm_config: Any, rank: int) -> Any:
    """Start this worker's listener (once per worker; never raises); returns it or None."""
    if worker.__dict__.get(_TRIED):
        return worker.__dict__.get(LISTENER_ATTR)
    worker.__dict__[_TRIED] = True
    try:
        from ...runtime.ipc.listener import WorkerListener
        from .. import layout_from_env

        parallel = getattr(vllm_config, "parallel_config", None)
        why = not_covered(parallel)
        if why is not None:
            log.info("kvcached: worker rank %d serves no socket: %s", rank, why)
            return None
        tp_rank, stage = worker_ranks(parallel, rank)
        listener = WorkerListener(layout_from_env(), engine_name(parallel), tp_rank, stage)
        # Recorded before it binds: a SIGTERM landing in start() raises SystemExit
        # through here, and the worker's shutdown must still find what to stop.
        worker.__dict__[LISTENER_ATTR] = listener
        running.set_worker_listener(listener)
        listener.start()
        log.info("kvcached: worker rank %d (TP %d, PP %d) serves %s", rank, tp_rank, stage, listener.path)
        return listener
    except Exception as e:
        log.warning("kvcached: worker IPC listener not started: %s", e)
        stop_worker_listener(worker)
        return None


def stop_worker_listener(worker: Any) -> None:
    """Stop the worker's listener: close, unlink its node, remove emptied directories. Never raises."""
    listener = getattr(worker, "__dict__", {}).pop(LISTENER_ATTR, None)
    if listener is None:
        return
    try:
        listener.stop()
    except Exception as e:
        log.warning("kvcached: worker IPC listener stop failed: %s", e)
    running.clear_worker_listener(listener)


def _init(wrapped: Any, worker: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    wrapped(*args, **kwargs)
    # After the original: vLLM's TP/PP groups are initialised, so the ranks are known.
    start_worker_listener(worker, argument(wrapped, args, kwargs, "vllm_config"),
                          int(argument(wrapped, args, kwargs, "rank") or 0))


def _busy_loop(wrapped: Any, worker: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # A spawned worker loads plugins inside WorkerProc.__init__ (in
    # WorkerWrapperBase.init_worker), too late to wrap that very call: start
    # the listener here instead, before the first RPC (the KV cache's).
    if not worker.__dict__.get(_TRIED):
        start_worker_listener(worker, getattr(getattr(worker, "worker", None), "vllm_config", None),
                              int(getattr(worker, "rank", 0) or 0))
    return wrapped(*args, **kwargs)


def _shutdown(wrapped: Any, worker: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # First, before vLLM's own teardown: the parent's SIGKILL races this.
    stop_worker_listener(worker)
    return wrapped(*args, **kwargs)


def install(changes: Changes, cls: Any) -> None:
    """Wrap WorkerProc's __init__, worker_busy_loop and shutdown."""
    changes.wrap(cls, "__init__", _init)
    changes.wrap(cls, "worker_busy_loop", _busy_loop)
    changes.wrap(cls, "shutdown", _shutdown)


PATCH = Patch(
    name="worker-listener",
    does="starts the worker's IPC listener with WorkerProc and stops it in WorkerProc.shutdown()",
    targets=(f"{M_EXECUTOR}:WorkerProc.__init__", f"{M_EXECUTOR}:WorkerProc.worker_busy_loop",
             f"{M_EXECUTOR}:WorkerProc.shutdown"),
    probe=probe,
    install=install,
)

PATCHES: tuple[Patch, ...] = (PATCH,)
