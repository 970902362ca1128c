"""The `engine-state` patch: a vLLM engine claims its segment, publishes its KV cache, and gives both back.

The engine's executor (`UniProcExecutor` or `MultiprocExecutor`) claims the
deployment's segment when it starts (and at TP=1 serves `w0.sock`, the model
running in the engine's process), `Executor.initialize_from_config` publishes
the KV cache it allocated, `KVCacheManager.__init__` makes the engine follow
vLLM's usage, and the executor's shutdown gives everything back; a
`MultiprocExecutor` also removes the sockets of workers it killed. What the
engine holds is `kvcached.integration.engine_claim.EngineState`.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any

from ..patchkit import Changes, Patch, ShapeError
from .common import (
    ENGINE_ATTR,
    M_ABSTRACT,
    M_EXECUTOR,
    M_KV_MANAGER,
    M_UNIPROC,
    engine_name,
    module,
    not_covered,
    params,
)

log = logging.getLogger(__name__)

WORKERS_ATTR = "_kvcached_workers"  # on a MultiprocExecutor: the EngineOwner of its worker processes


@dataclass(frozen=True)
class ClaimTargets:
    """The classes this patch wraps."""

    uni: Any  # UniProcExecutor
    mp: Any  # MultiprocExecutor
    base: Any  # Executor
    kv_manager: Any  # KVCacheManager


def probe() -> ClaimTargets:
    """vLLM's executors and KV cache manager, when their shapes are the ones this patch knows."""
    uni = getattr(module(M_UNIPROC), "UniProcExecutor", None)
    mp = getattr(module(M_EXECUTOR), "MultiprocExecutor", None)
    base = getattr(module(M_ABSTRACT), "Executor", None)
    kv_manager = getattr(module(M_KV_MANAGER), "KVCacheManager", None)
    if uni is None or mp is None or base is None or kv_manager is None:
        raise ShapeError("UniProcExecutor, MultiprocExecutor, Executor or KVCacheManager is missing")
    for cls in (uni, mp):
        for method in ("_init_executor", "shutdown"):
            if params(cls.__dict__.get(method)) != ["self"]:
                raise ShapeError(f"{cls.__name__}.{method}() is missing or takes arguments")
    if params(base.__dict__.get("initialize_from_config")) != ["self", "kv_cache_configs"]:
        raise ShapeError("Executor.initialize_from_config(kv_cache_configs) is missing or changed")
    if "initialize_from_config" in uni.__dict__ or "initialize_from_config" in mp.__dict__:
        raise ShapeError("an executor overrides initialize_from_config")
    if not isinstance(getattr(kv_manager, "usage", None), property):
        raise ShapeError("KVCacheManager.usage is no longer a property")
    return ClaimTargets(uni, mp, base, kv_manager)


def _platform_total() -> int:
    """One device's total memory as vLLM's platform reads it: NVML on CUDA, so the engine process gets no context."""
    from vllm.platforms import current_platform

    return int(current_platform.get_device_total_memory(0))


def engine_limit(vllm_config: Any) -> Any:
    """The limit this engine claims with (KVCACHED_LIMIT, else vLLM's memory share of one device)."""
    from ..limits import device_memory, resolve_limit

    share = getattr(getattr(vllm_config, "cache_config", None), "gpu_memory_utilization", 0.9)
    share = share if isinstance(share, float) and 0 < share <= 1 else 0.9
    return resolve_limit(lambda: device_memory(_platform_total), share)


def start_engine(executor: Any, *, serve: bool) -> Any:
    """After the executor started: the engine's name, its TP=1 socket, its segment; the EngineState, never raises."""
    try:
        from .. import layout_from_env
        from ..engine_claim import EngineState, register

        parallel = executor.parallel_config
        why = not_covered(parallel)
        if why is not None:
            log.info("kvcached: %s not covered: %s", type(executor).__name__, why)
            return None
        engine = EngineState(layout_from_env(), engine_name(parallel))
        executor.__dict__[ENGINE_ATTR] = engine
        register(engine)
        if serve:
            engine.serve(0, 0)
        # Workers of a DP replica that spans nodes run headless on the other
        # nodes (node_rank_within_dp > 0); the segment is the head engine's.
        if getattr(parallel, "node_rank_within_dp", 0) == 0:
            engine.claim(engine_limit(executor.vllm_config))
        return engine
    except Exception as e:
        log.warning("kvcached: engine state not set up: %s", e)
        return None


def stop_engine(executor: Any) -> None:
    """Give back what the engine holds: its socket, its lease, its segment. Never raises."""
    engine = executor.__dict__.get(ENGINE_ATTR)
    if engine is not None:
        engine.release()


def _kv_bytes(kv_cache_configs: Any) -> int:
    """KV cache bytes one rank allocates: its tensors' sizes (the largest rank's, should ranks differ)."""
    try:
        return max((sum(int(t.size) for t in cfg.kv_cache_tensors) for cfg in kv_cache_configs), default=0)
    except (TypeError, AttributeError):
        return 0


def _uni_init(wrapped: Any, executor: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    wrapped(*args, **kwargs)
    start_engine(executor, serve=True)  # TP=1: the model runs here, so this process serves w0.sock


def _uni_shutdown(wrapped: Any, executor: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    engine = executor.__dict__.get(ENGINE_ATTR)
    if engine is not None:
        engine.stop_serving()  # first, like a worker: whatever kills us next, the node is gone
    try:
        return wrapped(*args, **kwargs)
    finally:
        stop_engine(executor)


def _mp_init(wrapped: Any, executor: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    wrapped(*args, **kwargs)
    engine = start_engine(executor, serve=False)
    try:
        if engine is not None:
            from ..engine_owner import EngineOwner

            procs = [w.proc for w in getattr(executor, "workers", None) or []]
            tp = executor.parallel_config.tensor_parallel_size
            pp = executor.parallel_config.pipeline_parallel_size
            executor.__dict__[WORKERS_ATTR] = EngineOwner(procs, engine.layout, [engine.name], tp, pp,
                                                          segments=False)
    except Exception as e:
        log.warning("kvcached: worker cleanup not set up: %s", e)


def _mp_shutdown(wrapped: Any, executor: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    owner = executor.__dict__.get(WORKERS_ATTR)
    if owner is not None and not owner.captured:
        # A headless node's executor never runs initialize_from_config: capture
        # now, but only while every worker still runs (their nodes are theirs).
        try:
            if all(p.exitcode is None for p in owner.processes):
                owner.capture()
        except Exception as e:
            log.warning("kvcached: worker capture failed: %s", e)
    try:
        return wrapped(*args, **kwargs)
    finally:
        if owner is not None:
            owner.after_shutdown()
        stop_engine(executor)


def _initialize_from_config(wrapped: Any, executor: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    try:
        configs = args[0] if args else kwargs.get("kv_cache_configs")
        engine = executor.__dict__.get(ENGINE_ATTR)
        if engine is not None:
            engine.track_kv_cache(_kv_bytes(configs))
        owner = executor.__dict__.get(WORKERS_ATTR)
        if owner is not None:
            owner.capture()  # every worker ran this RPC: each is in its busy loop, its socket bound
    except Exception as e:
        log.warning("kvcached: KV cache not tracked: %s", e)
    return result


def _kv_manager_init(wrapped: Any, manager: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    wrapped(*args, **kwargs)
    try:
        from ..engine_claim import current_engine

        engine = current_engine()
        if engine is not None:
            ref = weakref.ref(manager)
            engine.follow_usage(lambda: ref().usage)  # type: ignore[union-attr]
    except Exception as e:
        log.warning("kvcached: KV cache usage not followed: %s", e)


def install(changes: Changes, found: ClaimTargets) -> None:
    """Wrap both executors' start and shutdown, the KV cache's initialisation, and the KV cache manager."""
    changes.wrap(found.uni, "_init_executor", _uni_init)
    changes.wrap(found.uni, "shutdown", _uni_shutdown)
    changes.wrap(found.mp, "_init_executor", _mp_init)
    changes.wrap(found.mp, "shutdown", _mp_shutdown)
    changes.wrap(found.base, "initialize_from_config", _initialize_from_config)
    changes.wrap(found.kv_manager, "__init__", _kv_manager_init)


PATCH = Patch(
    name="engine-state",
    does="the engine claims its segment when its executor starts (and serves w0.sock at TP=1), publishes its "
         "KV cache, and gives both back in the executor's shutdown",
    targets=(f"{M_UNIPROC}:UniProcExecutor._init_executor", f"{M_UNIPROC}:UniProcExecutor.shutdown",
             f"{M_EXECUTOR}:MultiprocExecutor._init_executor", f"{M_EXECUTOR}:MultiprocExecutor.shutdown",
             f"{M_ABSTRACT}:Executor.initialize_from_config", f"{M_KV_MANAGER}:KVCacheManager.__init__"),
    probe=probe,
    install=install,
)

PATCHES: tuple[Patch, ...] = (PATCH,)
