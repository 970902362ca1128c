"""The `sglang-listener` patch: each SGLang scheduler serves its worker socket for its life.

SGLang runs one scheduler per (PP, TP) rank of each DP rank, and each holds
its own KV pool: a scheduler is both what vLLM calls an engine and a worker,
so it serves the socket vLLM's `WorkerProc` serves (`vllm/worker_listener.py`).
Right after `configure_scheduler_process` (this process's ranks are
published, the Scheduler and its KV pool not yet built) every scheduler
serves `[pp<k>/]w<r>.sock` of its DP rank's IPC name (`<name>_dp<d>` with DP
ranks), `r` its index among its DP rank's TP ranks, through its
`EngineState` (`kvcached.integration.engine_claim`), which stops it when the
scheduler gives back what it holds (`claim.py`'s `sglang-scheduler-stop`).
"""

from __future__ import annotations

import logging
from typing import Any

from ..patchkit import Changes, Patch
from .common import CONFIGURE, SCHEDULER, probe_configure, scheduler_engine

log = logging.getLogger(__name__)


def _serve(wrapped: Any, _instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    try:
        engine = scheduler_engine()
        if engine is not None:
            ranks = SCHEDULER["ranks"]
            engine.serve(ranks.local_tp_rank, ranks.pp_rank)
    except Exception as e:
        log.warning("kvcached: scheduler socket not served: %s", e)
    return result


def install_listener(changes: Changes, mod: Any) -> None:
    """Serve the scheduler's socket once configure_scheduler_process has published its ranks."""
    changes.wrap(mod, "configure_scheduler_process", _serve)


LISTENER = Patch(
    name="sglang-listener",
    does="every scheduler serves [pp<k>/]w<r>.sock of its DP rank's name, from configure_scheduler_process on",
    targets=(CONFIGURE,),
    probe=probe_configure,
    install=install_listener,
)

PATCHES = (LISTENER,)
