"""The scheduler's claim: rank 0 claims its DP rank's segment, publishes its KV pool, and every scheduler gives back.

SGLang runs one scheduler process per (PP, TP) rank of each DP rank, and each
builds its own KV pool: a scheduler is both what vLLM calls an engine and a
worker (its socket: `worker_listener.py`). So:

- `sglang-segment`: right after `configure_scheduler_process` (this
  process's ranks are published, the Scheduler and its KV pool not yet
  built), TP rank 0 of PP stage 0 of each DP rank claims the DP rank's
  segment (`KVCACHED_LIMIT`, else SGLang's `mem_fraction_static` of one
  device) and holds its lease for life; once the Scheduler is built
  (`Scheduler.get_init_info`, its ready message) it publishes the KV pool's
  bytes and follows the allocator's usage;
- `sglang-scheduler-stop`: on the graceful path (`ShutdownReq` reaches
  `Scheduler.handle_shutdown`) and at the process's normal exit (`atexit`),
  the scheduler gives back what it holds: the socket, the lease, the segment.

What a scheduler holds is `kvcached.integration.engine_claim.EngineState`
(made once per process: `common.scheduler_engine`). A scheduler dies at once
on a process-group SIGTERM and is SIGKILLed on every other stop path: the
owner (`owner.py`) removes what it left.
"""

from __future__ import annotations

import atexit
import logging
import re
import weakref
from typing import Any

from ..patchkit import Changes, Patch, ShapeError, argument, params, source
from .common import CONFIGURE, M_SCHEDULER, SCHEDULER, module, probe_configure, scheduler_engine

log = logging.getLogger(__name__)

_GB = 1 << 30  # SGLang's GB: its pools' `mem_usage` is in these


def scheduler_limit(server_args: Any, gpu_id: int) -> Any:
    """The limit rank 0 claims with: KVCACHED_LIMIT, else SGLang's `mem_fraction_static` of one device."""
    from ..limits import device_memory, resolve_limit

    def platform_total() -> int:
        from sglang.srt.platforms import current_platform

        return int(current_platform.get_device_total_memory(gpu_id))

    share = getattr(server_args, "mem_fraction_static", None)
    share = share if isinstance(share, float) and 0 < share <= 1 else 0.9
    return resolve_limit(lambda: device_memory(platform_total), share)


def _claim(wrapped: Any, _instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    try:
        engine = scheduler_engine()
        if engine is not None and SCHEDULER["ranks"].claims:
            gpu = argument(wrapped, args, kwargs, "gpu_id")
            engine.claim(scheduler_limit(argument(wrapped, args, kwargs, "server_args"),
                                         gpu if isinstance(gpu, int) else 0))
    except Exception as e:
        log.warning("kvcached: scheduler claimed no segment: %s", e)
    return result


def kv_bytes(allocator: Any) -> int:
    """Bytes of the KV pool behind SGLang's token allocator (its `mem_usage`, in SGLang's GB); 0 when unknown."""
    try:
        usage = allocator.get_kvcache().mem_usage
        return int(float(usage) * _GB)
    except Exception:
        return 0


def _ready(wrapped: Any, scheduler: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    try:
        engine = SCHEDULER.get("engine")
        allocator = getattr(scheduler, "token_to_kv_pool_allocator", None)
        total = getattr(scheduler, "max_total_num_tokens", None)
        if engine is not None and engine.segment is not None and allocator is not None and total:
            engine.track_kv_cache(kv_bytes(allocator))
            ref = weakref.ref(allocator)
            engine.follow_usage(lambda: 1.0 - ref().available_size() / total)  # type: ignore[union-attr]
    except Exception as e:
        log.warning("kvcached: KV pool usage not followed: %s", e)
    return result


def probe_ready() -> Any:
    """SGLang's Scheduler, when its ready message comes from `get_init_info(self)`."""
    cls = getattr(module(M_SCHEDULER), "Scheduler", None)
    if cls is None:
        raise ShapeError("sglang.srt.managers.scheduler has no Scheduler")
    if params(getattr(cls, "get_init_info", None)) != ["self"]:
        raise ShapeError("Scheduler.get_init_info() is missing or takes arguments")
    if "get_init_info()" not in (source(module(M_SCHEDULER).run_scheduler_process) or ""):
        raise ShapeError("run_scheduler_process no longer sends scheduler.get_init_info() as its ready message")
    return cls


def probe_segment() -> tuple[Any, Any]:
    """(the scheduler module, its Scheduler) when both hooks of the segment have their known shapes."""
    return probe_configure(), probe_ready()


def install_segment(changes: Changes, found: tuple[Any, Any]) -> None:
    """Claim at configure_scheduler_process (rank 0), follow the pool from the ready message on."""
    mod, cls = found
    changes.wrap(mod, "configure_scheduler_process", _claim)
    changes.wrap(cls, "get_init_info", _ready)


def give_back() -> None:
    """Stop serving, drop the lease, remove the segment (rank 0) unless another holds it. Idempotent; never raises."""
    engine = SCHEDULER.get("engine")
    if engine is not None:
        engine.release()


def _shutdown(wrapped: Any, _scheduler: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    give_back()  # the loop breaks at its next turn; the scheduler serves nothing more
    return result


_SETS_EXIT = re.compile(r"self\.gracefully_exit\s*=\s*True")


def probe_stop() -> Any:
    """SGLang's Scheduler, when `handle_shutdown(self, recv_req)` is what ends its event loop."""
    cls = getattr(module(M_SCHEDULER), "Scheduler", None)
    if cls is None:
        raise ShapeError("sglang.srt.managers.scheduler has no Scheduler")
    handler = getattr(cls, "handle_shutdown", None)
    if params(handler) != ["self", "recv_req"]:
        raise ShapeError("Scheduler.handle_shutdown(recv_req) is missing or changed")
    if not _SETS_EXIT.search(source(handler) or ""):
        raise ShapeError("Scheduler.handle_shutdown no longer sets gracefully_exit")
    return cls


def install_stop(changes: Changes, cls: Any) -> None:
    """Give back on ShutdownReq and at the process's normal exit."""
    changes.wrap(cls, "handle_shutdown", _shutdown)
    atexit.register(give_back)
    changes.on_undo(lambda: atexit.unregister(give_back))


SEGMENT = Patch(
    name="sglang-segment",
    does="TP rank 0 of PP stage 0 of each DP rank claims its segment and publishes its KV pool's usage",
    targets=(CONFIGURE, f"{M_SCHEDULER}:Scheduler.get_init_info"),
    probe=probe_segment,
    install=install_segment,
)
STOP = Patch(
    name="sglang-scheduler-stop",
    does="a scheduler gives back its socket, lease and segment on ShutdownReq and at its normal exit",
    targets=(f"{M_SCHEDULER}:Scheduler.handle_shutdown",),
    probe=probe_stop,
    install=install_stop,
)

PATCHES = (SEGMENT, STOP)
