"""The `elastic-kv` patch: elastic KV memory inside vLLM 0.33 and 0.34 (on with ``KVCACHED_ELASTIC=1``).

Off, nothing here is applied and vLLM allocates its KV cache as it always
does. On, four points change, each found by its shape (docs/VLLM.md):

1. Engine, `Executor.initialize_from_config`: before the workers allocate,
   the engine decides whether it can reach their buffers (in-process worker
   of the ``uni`` executor, or ``mp`` workers serving our listener: the
   `worker-listener` patch, which this one requires) and marks the KV cache
   configs it sends them. A worker makes an elastic buffer only for a marked
   config, so no worker ever waits for an engine that will not map its pages.
2. Worker, `vllm.v1.worker.utils.allocate_kv_cache` (and the names the model
   runners imported it under): for a marked config whose layout we can
   describe, the one backing buffer becomes a `KVBuffer` (a reserved range,
   block 0's pages mapped) and vLLM's own `create_kv_cache_views` lays every
   layer over it, so each layer's tensor is a view of the range
   (`elastic_buffers`). Anything else falls back to vLLM's allocation and
   tells the engine why.
3. Engine, `KVCacheManager.__init__` and the `BlockPool` name its
   coordinator builds with: the manager's block pool is an
   `ElasticBlockPool`, once every worker agreed on the page size. If every
   worker refused, the plain pool is kept; a mix, or a worker that cannot be
   reached, fails the engine's start.
4. Engine, `Scheduler.schedule` / `update_from_output` / `finish_requests`:
   each step starts by following the limit and ends by releasing what its
   frees left empty; the batches in flight are tracked so that memory a
   running batch may still write is never unmapped under it.

The limit is the deployment's segment: the one the engine claimed
(`engine-state`), else ``layout_from_env().segment_path(ipc_name_from_env())``,
picked up once someone creates it; until it exists the pool is limited only
by vLLM's own KV capacity.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import sys
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ... import settings
from ..patchkit import Changes, Patch, original, require, require_fields, which_field, which_params
from .common import (
    ALLOCATE_KV_CACHE,
    BLOCK_FIELDS,
    BLOCK_HASH_FIELD,
    FREE_BLOCKS,
    M_ABSTRACT,
    M_BLOCK_POOL,
    M_COORDINATOR,
    M_INTERFACE,
    M_KV_MANAGER,
    M_SCHEDULER,
    M_WORKER_UTILS,
    argument,
    params,
)
from .elastic_buffers import MARK, allocate_kv_cache, refusals

log = logging.getLogger(__name__)

# Modules that bind allocate_kv_cache by name at import (patched when already imported; those imported later
# bind the patched name). 0.33's model runner was gpu_model_runner; 0.34 has only the gpu/ and cpu/ runners.
ALLOCATE_USERS = ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.attn_utils", "vllm.v1.worker.cpu.attn_utils")


def switch() -> str | None:
    """Why the patch is off (KVCACHED_ELASTIC unset), or None when it is on."""
    return None if settings.ELASTIC.get() else f"elastic KV memory is off (set {settings.ELASTIC.name}=1)"


# -- worker: the allocation (elastic_buffers) ---------------------------------------


def _allocate(wrapped: Any, _instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    return allocate_kv_cache(wrapped, *args, **kwargs)


# -- engine: the decision, the pool, the steps ---------------------------------------


@dataclass(frozen=True)
class WorkerReach:
    """How this engine reaches its workers' buffers, decided before they allocate."""

    mode: str  # "local": the worker is in this process; "sockets": workers serve listeners
    tp_size: int = 1
    pp_size: int = 1
    segment_path: str | None = None


_engine: WorkerReach | None = None
_tls = threading.local()


def prepare_engine(kv_cache_configs: Sequence[Any], mode: str, tp_size: int = 1, pp_size: int = 1,
                   segment_path: str | None = None) -> WorkerReach:
    """Mark the configs the workers will allocate and remember how to reach them (the executor seam)."""
    global _engine
    if mode not in ("local", "sockets"):
        raise ValueError(f"unknown mode {mode!r}")
    if segment_path is None:
        from ...node import ipc_name_from_env
        from ..engine_elastic import segment_to_follow

        # The segment this engine claimed when its executor started (engine-state),
        # else the deployment's by name, picked up once someone creates it.
        segment_path = segment_to_follow(ipc_name_from_env())
    for cfg in kv_cache_configs:
        setattr(cfg, MARK, True)
    _engine = WorkerReach(mode, tp_size, pp_size, segment_path)
    return _engine


def forget_engine() -> None:
    """Drop the plan (tests; an engine that did not go elastic)."""
    global _engine
    _engine = None


def _executor_mode(executor: Any) -> tuple[str | None, str]:
    """("local" | "sockets" | None, why) for this executor."""
    parallel = executor.vllm_config.parallel_config
    if int(getattr(parallel, "data_parallel_size", 1) or 1) > 1:
        return None, "data parallelism (worker sockets are named per deployment, not per DP rank)"
    kind = type(executor).__name__
    if kind == "UniProcExecutor":
        return "local", ""
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    if isinstance(executor, MultiprocExecutor):
        return "sockets", ""  # its workers serve our listener: this patch requires worker-listener
    return None, f"the {kind} executor (elastic KV needs the uni or mp executor)"


def _make_setup(num_blocks: int) -> Any:
    """Link to every worker and agree the page geometry; None when every worker kept vLLM's allocation."""
    from kvcached.runtime.kvbuffer import LocalLink, SocketLink, local_buffer
    from kvcached.runtime.pool import MapError

    from ..engine_elastic import release_settings
    from .elastic_alloc import ElasticSetup

    plan = _engine
    assert plan is not None
    link: Any
    if plan.mode == "local":
        buf = local_buffer()
        if buf is None:
            log.warning("kvcached: the worker kept vLLM's allocation (%s); the block pool is not elastic",
                        refusals[-1] if refusals else "no elastic buffer in this process")
            return None
        link = LocalLink(buf)
    else:
        from ...node import ipc_name_from_env
        from .. import layout_from_env

        link = SocketLink(layout_from_env(), ipc_name_from_env(), plan.tp_size, plan.pp_size,
                          page_size=settings.PAGE_SIZE.get())
    try:
        agreed = link.setup(num_blocks)
    except MapError as e:
        if plan.mode == "sockets" and "not elastic" in str(e) and _all_refused(link):
            log.warning("kvcached: every worker kept vLLM's allocation; the block pool is not elastic: %s", e)
            return None
        raise
    release = release_settings()
    return ElasticSetup(link, agreed, plan.segment_path, release.reserve, release.delay_s)


def _all_refused(link: Any) -> bool:
    from kvcached.runtime.ipc.client import Client
    from kvcached.runtime.ipc.protocol import CMD_INFO

    return all(not Client(p, 10.0).call(CMD_INFO).get("elastic") for p in link.paths)


def _block_pool(wrapped: Any, _instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What KVCacheCoordinator builds its BlockPool with: elastic for the engine's KV cache manager."""
    if getattr(_tls, "building", False) and _engine is not None:
        _tls.building = False  # one pool per manager; connectors' own pools stay plain
        num_blocks = kwargs.get("num_gpu_blocks", args[0] if args else None)
        setup = _make_setup(int(num_blocks)) if num_blocks is not None else None
        if setup is not None:
            from .elastic_alloc import ElasticBlockPool

            return ElasticBlockPool(*args, elastic=setup, **kwargs)
    return wrapped(*args, **kwargs)


def elastic_pool(scheduler: Any) -> Any:
    """The scheduler's ElasticBlockPool, or None."""
    manager = getattr(scheduler, "kv_cache_manager", None)
    pool = getattr(manager, "block_pool", None)
    return pool if hasattr(pool, "begin_step") else None


# -- the patch: probe, install ---------------------------------------------------------




def probe() -> dict[str, Any]:
    """The modules the patch changes, when the installed vLLM is a shape we know; raises ShapeError otherwise."""
    mods = {m: importlib.import_module(m) for m in (M_BLOCK_POOL, M_COORDINATOR, M_KV_MANAGER, M_SCHEDULER,
                                                   M_ABSTRACT, M_WORKER_UTILS, M_INTERFACE)}
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

    bp = mods[M_BLOCK_POOL].BlockPool
    for name in ("get_num_free_blocks", "get_new_blocks", "free_blocks", "evict_blocks", "reset_prefix_cache",
                 "_maybe_evict_cached_block", "_notify_reuse", "get_usage"):
        require(callable(getattr(bp, name, None)), f"BlockPool.{name} is missing")
    which_params(bp.free_blocks, "BlockPool.free_blocks", FREE_BLOCKS)
    init_src = inspect.getsource(bp.__init__)
    for needle in ("self._reuse_watchers", "FreeKVCacheBlockQueue("):
        require(needle in init_src, f"BlockPool.__init__ no longer has {needle}")
    for name in ("popleft", "popleft_n", "remove", "append", "append_n", "prepend_n"):
        require(callable(getattr(FreeKVCacheBlockQueue, name, None)), f"FreeKVCacheBlockQueue.{name} is missing")
    require_fields(KVCacheBlock, "KVCacheBlock", BLOCK_FIELDS)
    which_field(KVCacheBlock, "KVCacheBlock", BLOCK_HASH_FIELD)
    require(original(getattr(mods[M_COORDINATOR], "BlockPool", None)) is bp,
             "kv_cache_coordinator no longer builds its pool through the name BlockPool")
    manager = mods[M_KV_MANAGER].KVCacheManager
    require("get_kv_cache_coordinator(" in inspect.getsource(original(manager.__init__)),
             "KVCacheManager.__init__ no longer calls get_kv_cache_coordinator(")
    sched = mods[M_SCHEDULER].Scheduler
    which_params(sched.update_from_output, "Scheduler.update_from_output",
                 {"vLLM 0.33": ["self", "scheduler_output", "model_runner_output"]}, prefix=True)
    for name in ("schedule", "finish_requests", "has_requests"):
        require(callable(getattr(sched, name, None)), f"Scheduler.{name} is missing")
    which_params(mods[M_ABSTRACT].Executor.initialize_from_config, "Executor.initialize_from_config",
                 {"vLLM 0.33": ["self", "kv_cache_configs"]})
    which_params(mods[M_WORKER_UTILS].allocate_kv_cache, "vllm.v1.worker.utils.allocate_kv_cache", ALLOCATE_KV_CACHE)
    iface = mods[M_INTERFACE]
    which_params(iface.create_kv_cache_views, "create_kv_cache_views",
                 {"vLLM 0.33": ["raw", "spec", "num_blocks", "layout", "kv_cache_tensor"]}, prefix=True)
    require("fixed_strides" in params(iface.compute_layout_strides),
             "compute_layout_strides has no parameter fixed_strides")
    return mods


def _manager_init(wrapped: Any, _manager: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    _tls.building = True
    try:
        wrapped(*args, **kwargs)
    finally:
        _tls.building = False


# The step hooks. A serve pays them every scheduler step, so after the first step
# they sit on the scheduler itself (`_bind_steps`): wrapt's proxy per call there is a
# measurable share of a step (bench_elastic.py; bench/README.md).

STEP_METHODS = ("schedule", "update_from_output")
STEP_MARK = "_kvcached_step"  # on the hooks bound on a scheduler
_handles: dict[str, tuple[Any, Any]] = {}  # step method -> (the class, this patch's wrapper on it), while applied
_bound: weakref.WeakSet[Any] = weakref.WeakSet()  # schedulers carrying the step hooks themselves


def _scheduled(pool: Any, schedule: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    pool.begin_step()
    out = schedule(*args, **kwargs)
    pool.inflight.issue(out)
    return out


def _updated(scheduler: Any, pool: Any, update: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # The first parameter (probe() checked the signature): binding it through inspect, as the
    # start-up hooks do, would cost a visible share of a step (bench_elastic.py; bench/README.md).
    pool.inflight.complete(args[0] if args else kwargs.get("scheduler_output"))
    out = update(*args, **kwargs)
    # What this output freed: released beyond the reserve, unmapped once no batch runs;
    # all of it at once when nothing is left to schedule (no later step would).
    pool.end_step(idle=not scheduler.has_requests())
    return out


def _bind_steps(scheduler: Any, pool: Any) -> bool:
    """Put the step hooks on `scheduler` itself, over what this patch wraps; False when that would skip code.

    Bound only while `scheduler`'s class reaches both methods through this
    patch's own wrappers (no subclass override in between, nothing bound on
    the instance). Each bound hook checks, per call, that the wrapper is still
    the Scheduler's attribute: wrapped again or replaced since, the hooks step
    aside and the call goes through the class as before. Undoing the patch
    removes them from every scheduler (`_unbind_all`).
    """
    cls, own = type(scheduler), vars(scheduler)
    if any(name not in _handles or name in own or inspect.getattr_static(cls, name, None) is not _handles[name][1]
           for name in STEP_METHODS):
        return False
    (owner_cls, h_schedule), (_, h_update) = _handles["schedule"], _handles["update_from_output"]
    owner = vars(owner_cls)
    inner_schedule = h_schedule.__wrapped__.__get__(scheduler, cls)  # what lies under our wrapper, bound
    inner_update = h_update.__wrapped__.__get__(scheduler, cls)

    # _scheduled and _updated, written out: a frame and its argument packing per call are a
    # measurable part of what a step pays here (bench_elastic.py, "scheduler step").
    inflight = pool.inflight

    def schedule(*args: Any, **kwargs: Any) -> Any:
        if owner.get("schedule") is not h_schedule:
            _unbind(scheduler)
            return scheduler.schedule(*args, **kwargs)
        pool.begin_step()
        out = inner_schedule(*args, **kwargs)
        inflight.issue(out)
        return out

    def update_from_output(*args: Any, **kwargs: Any) -> Any:
        if owner.get("update_from_output") is not h_update:
            _unbind(scheduler)
            return scheduler.update_from_output(*args, **kwargs)
        inflight.complete(args[0] if args else kwargs.get("scheduler_output"))
        out = inner_update(*args, **kwargs)
        pool.end_step(idle=not scheduler.has_requests())
        return out

    for fn in (schedule, update_from_output):
        setattr(fn, STEP_MARK, True)
        own[fn.__name__] = fn
    _bound.add(scheduler)
    return True


def _unbind(scheduler: Any) -> None:
    own = vars(scheduler)
    for name in STEP_METHODS:
        if getattr(own.get(name), STEP_MARK, False):
            del own[name]
    _bound.discard(scheduler)


def _unbind_all() -> None:
    """The patch is undone: every scheduler goes back to its class's methods."""
    for scheduler in list(_bound):
        _unbind(scheduler)
    _handles.clear()


def _schedule(wrapped: Any, scheduler: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    pool = elastic_pool(scheduler)
    if pool is None:
        return wrapped(*args, **kwargs)
    if _bind_steps(scheduler, pool):
        return scheduler.schedule(*args, **kwargs)
    return _scheduled(pool, wrapped, args, kwargs)


def _update_from_output(wrapped: Any, scheduler: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    pool = elastic_pool(scheduler)
    if pool is None:
        return wrapped(*args, **kwargs)
    if _bind_steps(scheduler, pool):
        return scheduler.update_from_output(*args, **kwargs)
    return _updated(scheduler, pool, wrapped, args, kwargs)


def _finish_requests(wrapped: Any, scheduler: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    out = wrapped(*args, **kwargs)
    pool = elastic_pool(scheduler)
    if pool is not None and not scheduler.has_requests():
        pool.end_step(idle=True)  # aborted while nothing else runs: no step will come
    return out


def _initialize_from_config(wrapped: Any, executor: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    try:
        mode, why = _executor_mode(executor)
        if mode is None:
            log.warning("kvcached: elastic KV is off for this engine: %s", why)
            forget_engine()
        else:
            parallel = executor.vllm_config.parallel_config
            prepare_engine(argument(wrapped, args, kwargs, "kv_cache_configs"), mode,
                           int(parallel.tensor_parallel_size), int(parallel.pipeline_parallel_size))
    except Exception as e:  # deciding must never stop the engine: it keeps vLLM's allocation
        log.warning("kvcached: elastic KV is off for this engine: %s", e)
        forget_engine()
    return wrapped(*args, **kwargs)


def install(changes: Changes, mods: dict[str, Any]) -> None:
    """Wrap the allocation (and its bindings), the pool's name, the manager, the scheduler and the executor."""
    utils = mods[M_WORKER_UTILS]
    plain = utils.allocate_kv_cache
    changes.wrap(utils, "allocate_kv_cache", _allocate)
    for name in ALLOCATE_USERS:
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "allocate_kv_cache", None) is plain:
            changes.wrap(mod, "allocate_kv_cache", _allocate)
    changes.wrap(mods[M_COORDINATOR], "BlockPool", _block_pool)
    changes.wrap(mods[M_KV_MANAGER].KVCacheManager, "__init__", _manager_init)
    sched = mods[M_SCHEDULER].Scheduler
    for name, hook in zip(STEP_METHODS, (_schedule, _update_from_output)):
        _handles[name] = (sched, changes.wrap(sched, name, hook))
    changes.wrap(sched, "finish_requests", _finish_requests)
    changes.wrap(mods[M_ABSTRACT].Executor, "initialize_from_config", _initialize_from_config)
    changes.on_undo(forget_engine)
    changes.on_undo(_unbind_all)


PATCH = Patch(
    name="elastic-kv",
    does="KV cache tensors over reserved ranges, pages mapped for the blocks vLLM's block pool hands out, "
         "under the segment's limit",
    targets=(
        f"{M_ABSTRACT}:Executor.initialize_from_config",
        f"{M_WORKER_UTILS}:allocate_kv_cache",
        f"{M_KV_MANAGER}:KVCacheManager.__init__",
        f"{M_COORDINATOR}:BlockPool",
        f"{M_SCHEDULER}:Scheduler.schedule",
        f"{M_SCHEDULER}:Scheduler.update_from_output",
        f"{M_SCHEDULER}:Scheduler.finish_requests",
    ),
    probe=probe,
    install=install,
    requires=("worker-listener",),
    switch=switch,
)

PATCHES: tuple[Patch, ...] = (PATCH,)
