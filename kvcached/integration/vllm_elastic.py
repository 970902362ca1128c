"""Elastic KV memory inside vLLM 0.33: the `elastic-kv` patch (on with ``KVCACHED_ELASTIC=1``).

Off, nothing here is applied and vLLM allocates its KV cache as it always
does. On, four points change, each found by its shape (docs/VLLM.md):

1. Engine, `Executor.initialize_from_config`: before the workers allocate,
   the engine decides whether it can reach their buffers (in-process worker
   of the ``uni`` executor, or ``mp`` workers serving our listener) and marks
   the KV cache configs it sends them. A worker makes an elastic buffer only
   for a marked config, so no worker ever waits for an engine that will not
   map its pages.
2. Worker, `vllm.v1.worker.utils.allocate_kv_cache` (and the names the model
   runners imported it under): for a marked config whose layout we can
   describe, the one backing buffer becomes a `KVBuffer` (a reserved range,
   block 0's pages mapped) and vLLM's own `create_kv_cache_views` lays every
   layer over it, so each layer's tensor is a view of the range. Anything
   else falls back to vLLM's allocation and tells the engine why.
3. Engine, `KVCacheManager.__init__` and the `BlockPool` name its
   coordinator builds with: the manager's block pool is an
   `ElasticBlockPool`, once every worker agreed on the page size. If every
   worker refused, the plain pool is kept; a mix, or a worker that cannot be
   reached, fails the engine's start.
4. Engine, `Scheduler.schedule` / `update_from_output` / `finish_requests`:
   each step starts by following the limit and ends by releasing what its
   frees left empty; the batches in flight are tracked so that memory a
   running batch may still write is never unmapped under it.

The limit is the deployment's segment (``layout_from_env().segment_path(
ipc_name_from_env())``), created and held by the engine's start-up
(`kvcached.node.startup.claim_segment`); until it exists the pool is limited only
by vLLM's own KV capacity.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvcached import settings
from kvcached.runtime.kvplan import Footprint

log = logging.getLogger("kvcached.integration.vllm.elastic")

ENV_ELASTIC = settings.ELASTIC.name
MARK = "_kvcached_elastic"  # set on the KVCacheConfig objects the engine sends its workers
_MAX_RUNS_PER_BLOCK = 4096

M_BLOCK_POOL = "vllm.v1.core.block_pool"
M_COORDINATOR = "vllm.v1.core.kv_cache_coordinator"
M_MANAGER = "vllm.v1.core.kv_cache_manager"
M_SCHEDULER = "vllm.v1.core.sched.scheduler"
M_EXECUTOR = "vllm.v1.executor.abstract"
M_WORKER_UTILS = "vllm.v1.worker.utils"
M_INTERFACE = "vllm.v1.kv_cache_interface"
# Modules that bind allocate_kv_cache by name at import (patched when already imported).
ALLOCATE_USERS = ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.attn_utils")


class ShapeError(Exception):
    """The installed vLLM does not have the shape this patch expects."""


def elastic_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """True when ``KVCACHED_ELASTIC`` is on."""
    return settings.ELASTIC.get(environ)


def reserve_pages(environ: Mapping[str, str] | None = None) -> int:
    """Free pages kept mapped for the next requests (``KVCACHED_ELASTIC_RESERVE_PAGES``, default 1)."""
    return settings.ELASTIC_RESERVE_PAGES.get(environ)


def release_delay(environ: Mapping[str, str] | None = None) -> float:
    """Seconds a free page stays mapped while requests run (``KVCACHED_ELASTIC_RELEASE_DELAY_S``, 1)."""
    return settings.ELASTIC_RELEASE_DELAY_S.get(environ)


def page_size(environ: Mapping[str, str] | None = None) -> int:
    """Physical page size (``KVCACHED_PAGE_SIZE`` bytes; default 2 MiB, the CUDA granularity).

    Smaller pages only work on the CPU backend (tests, small models): every
    engine and worker process of a deployment must see the same value.
    """
    return settings.PAGE_SIZE.get(environ)


# -- the layout of vLLM's KV cache buffer ------------------------------------------


def _spec_of(cfg: Any, layer: str) -> tuple[int, Any]:
    """(group id, spec) of `layer`, as vLLM's allocate_kv_cache finds them."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    for gid, group in enumerate(cfg.kv_cache_groups):
        if layer in group.layer_names:
            spec = group.kv_cache_spec
            if isinstance(spec, UniformTypeKVCacheSpecs):
                spec = spec.kv_cache_specs[layer]
            return gid, spec
    raise ValueError(f"layer {layer} is in no KV cache group")


def unsupported(cfg: Any) -> str | None:
    """Why `cfg` cannot be made elastic, or None."""
    tensors = cfg.kv_cache_tensors
    if not tensors:
        return "the model has no KV cache"
    if len({t.size for t in tensors}) != 1:
        return "the KV cache tensors do not share one backing allocation"
    for t in tensors:
        if getattr(t, "host_resident", False):
            return "a KV cache tensor lives in host memory (HiSparse)"
        _, spec = _spec_of(cfg, t.layers[0])
        if not getattr(spec, "has_layer_views", True):
            return f"{type(spec).__name__} lays its own pages out (no per-layer views)"
    return None


def pad_layer_regions(cfg: Any, page: int) -> bool:
    """Start every layer's region on a page boundary (in place); True when the layout changed.

    In layer-outer layouts (LBHNC, vLLM's default) each layer owns a region of
    ``num_blocks`` pages, so with a block count that is not a multiple of a
    page's worth, every layer's region starts mid-page and each group of
    blocks would need two physical pages per layer instead of one. Padding
    each region to whole pages costs only address space. Only the uniform
    case (every tensor one region size, offsets whole regions, which is what
    vLLM plans for uniform page sizes and aliased groups) is rewritten; other
    layouts keep vLLM's offsets and their groups share boundary pages.
    """
    from dataclasses import replace

    tensors = cfg.kv_cache_tensors
    strides = {t.layer_stride for t in tensors}
    if len(strides) != 1:
        return False
    region = strides.pop()
    padded = -(-region // page) * page
    outer = all(region >= cfg.num_blocks_of(t) * t.block_stride for t in tensors)
    if padded == region or not outer or any(t.offset % region or t.size % region for t in tensors):
        return False
    cfg.kv_cache_tensors = [replace(t, layer_stride=padded, offset=t.offset // region * padded,
                                    size=t.size // region * padded) for t in tensors]
    return True


def _block_runs(shape: Sequence[int], strides: Sequence[int]) -> list[tuple[int, int]]:
    """(offset, length) runs of one block's bytes, from its inner dims' sizes and byte strides."""
    dims = sorted((st, sz) for sz, st in zip(shape, strides) if sz > 1)
    length, i = 1, 0
    while i < len(dims) and dims[i][0] == length:
        length *= dims[i][1]
        i += 1
    count = 1
    for _, sz in dims[i:]:
        count *= sz
    if count > _MAX_RUNS_PER_BLOCK:
        # Too scattered to list: the hull, a superset, is still correct to map.
        return [(0, sum((sz - 1) * st for st, sz in dims) + 1)]
    offsets = [0]
    for st, sz in dims[i:]:
        offsets = [o + k * st for o in offsets for k in range(sz)]
    return [(o, length) for o in offsets]


def footprint(cfg: Any, layout: Any) -> Footprint:
    """Where each block's bytes lie in the backing buffer of `cfg`, laid out as `layout`."""
    from vllm.v1.kv_cache_interface import compute_layer_kv_cache_shape_bytes, compute_layout_strides

    runs: list[tuple[int, int, int]] = []
    for t in cfg.kv_cache_tensors:
        _, spec = _spec_of(cfg, t.layers[0])
        nb = cfg.num_blocks_of(t)
        n_layers = len(t.layers)
        inner = compute_layer_kv_cache_shape_bytes(spec, nb)[1:]
        strides = compute_layout_strides(spec, nb, n_layers, layout,
                                         fixed_strides=(t.layer_stride, t.block_stride, None, None, None))
        block_stride = strides[1]
        per_block = _block_runs(inner, strides[2:])
        for layer in range(n_layers):
            base = t.offset + layer * strides[0]
            runs.extend((block_stride, base + o, n) for o, n in per_block)
    return Footprint.build(cfg.kv_cache_tensors[0].size, cfg.num_blocks, runs)


# -- worker: the allocation -------------------------------------------------------

_originals: dict[str, Any] = {}
_refusals: list[str] = []  # why this process's worker fell back to vLLM's allocation


def allocate_kv_cache(kv_cache_config: Any, device: Any, layout: Any,
                      kernel_block_sizes: list[int] | None = None) -> dict[str, Any]:
    """vLLM's allocate_kv_cache, over an elastic buffer when the engine asked for one."""
    original = _originals["allocate_kv_cache"]
    if not getattr(kv_cache_config, MARK, False):
        return original(kv_cache_config, device, layout, kernel_block_sizes)
    why = unsupported(kv_cache_config)
    if why is None and str(device).split(":")[0] not in ("cpu", "cuda"):
        why = f"device {device} has no page backend"
    if why is None:
        try:
            return _allocate_elastic(kv_cache_config, device, layout, kernel_block_sizes)
        except Exception as e:  # never fail a worker's start for it: fall back, and say so
            log.exception("kvcached: elastic KV buffer failed")
            why = f"{type(e).__name__}: {e}"
    _refuse(why)
    return original(kv_cache_config, device, layout, kernel_block_sizes)


def _allocate_elastic(cfg: Any, device: Any, layout: Any, kernel_block_sizes: list[int] | None) -> dict[str, Any]:
    from vllm.v1.kv_cache_interface import create_kv_cache_views

    from kvcached.runtime.kvbuffer import KVBuffer, set_local_buffer

    # The worker's own copy of the config: the model runner keeps it, so it describes the views made here.
    pad_layer_regions(cfg, page_size())
    buf = KVBuffer(footprint(cfg, layout), page_size(), device=str(device))
    raw = buf.tensor()
    kv_caches: dict[str, Any] = {}
    for t in cfg.kv_cache_tensors:
        gid, spec = _spec_of(cfg, t.layers[0])
        kernel = kernel_block_sizes[gid] if kernel_block_sizes is not None and gid < len(kernel_block_sizes) \
            else None
        views = create_kv_cache_views(raw, spec, cfg.num_blocks_of(t), layout, t, kernel_block_size=kernel)
        kv_caches.update(zip(t.layers, views))
    set_local_buffer(buf)
    listener = _worker_listener()
    if listener is not None:
        buf.register(listener)
    log.info("kvcached: KV cache of %d bytes is elastic: %d pages of %d bytes reserved, %d mapped",
             cfg.kv_cache_tensors[0].size, buf.plan.num_pages, buf.page_size, buf.pages.num_mapped)
    return kv_caches


def _refuse(why: str) -> None:
    from kvcached.runtime.kvbuffer import CMD_INFO, set_local_buffer

    log.warning("kvcached: this KV cache stays fully allocated, not elastic: %s", why)
    _refusals.append(why)
    set_local_buffer(None)
    listener = _worker_listener()
    if listener is not None:
        listener.register(CMD_INFO, lambda _a: {"elastic": False, "why": why})


def _worker_listener() -> Any:
    from .vllm_patches import current_worker_listener

    return current_worker_listener()


# -- engine: the decision, the pool, the steps ---------------------------------------


@dataclass(frozen=True)
class EnginePlan:
    """How this engine reaches its workers' buffers, decided before they allocate."""

    mode: str  # "local": the worker is in this process; "sockets": workers serve listeners
    tp_size: int = 1
    pp_size: int = 1
    segment_path: str | None = None


_engine: EnginePlan | None = None
_tls = threading.local()


def prepare_engine(kv_cache_configs: Sequence[Any], mode: str, tp_size: int = 1, pp_size: int = 1,
                   segment_path: str | None = None) -> EnginePlan:
    """Mark the configs the workers will allocate and remember how to reach them (the executor seam)."""
    global _engine
    if mode not in ("local", "sockets"):
        raise ValueError(f"unknown mode {mode!r}")
    if segment_path is None:
        from .engine_state import claimed_segment

        # The segment this engine claimed when its executor started (engine-state),
        # else the deployment's by name, picked up once someone creates it.
        claimed = claimed_segment()
        if claimed is not None:
            segment_path = claimed.path
        else:
            from ..node.naming import ipc_name_from_env
            from . import layout_from_env

            segment_path = layout_from_env().segment_path(ipc_name_from_env())
    for cfg in kv_cache_configs:
        setattr(cfg, MARK, True)
    _engine = EnginePlan(mode, tp_size, pp_size, segment_path)
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
        from . import vllm_patches

        if "worker-listener" not in vllm_patches.applied():
            return None, "the worker-listener patch is not applied, so the workers cannot be reached"
        return "sockets", ""
    return None, f"the {kind} executor (elastic KV needs the uni or mp executor)"


def _make_setup(num_blocks: int) -> Any:
    """Link to every worker and agree the page geometry; None when every worker kept vLLM's allocation."""
    from kvcached.runtime.kvbuffer import LocalLink, SocketLink, local_buffer
    from kvcached.runtime.pool import MapError

    from .vllm_blockpool import ElasticSetup

    plan = _engine
    assert plan is not None
    link: Any
    if plan.mode == "local":
        buf = local_buffer()
        if buf is None:
            log.warning("kvcached: the worker kept vLLM's allocation (%s); the block pool is not elastic",
                        _refusals[-1] if _refusals else "no elastic buffer in this process")
            return None
        link = LocalLink(buf)
    else:
        from ..node.naming import ipc_name_from_env
        from . import layout_from_env

        link = SocketLink(layout_from_env(), ipc_name_from_env(), plan.tp_size, plan.pp_size,
                          page_size=page_size())
    try:
        agreed = link.setup(num_blocks)
    except MapError as e:
        if plan.mode == "sockets" and "not elastic" in str(e) and _all_refused(link):
            log.warning("kvcached: every worker kept vLLM's allocation; the block pool is not elastic: %s", e)
            return None
        raise
    return ElasticSetup(link, agreed, plan.segment_path, reserve_pages(), release_delay())


def _all_refused(link: Any) -> bool:
    from kvcached.runtime.ipc.client import Client
    from kvcached.runtime.kvbuffer import CMD_INFO

    return all(not Client(p, 10.0).call(CMD_INFO).get("elastic") for p in link.paths)


def _block_pool_factory(*args: Any, **kwargs: Any) -> Any:
    """What KVCacheCoordinator builds its BlockPool with: elastic for the engine's KV cache manager."""
    plain = _originals["BlockPool"]
    if getattr(_tls, "building", False) and _engine is not None:
        _tls.building = False  # one pool per manager; connectors' own pools stay plain
        num_blocks = kwargs.get("num_gpu_blocks", args[0] if args else None)
        setup = _make_setup(int(num_blocks)) if num_blocks is not None else None
        if setup is not None:
            from .vllm_blockpool import ElasticBlockPool

            return ElasticBlockPool(*args, elastic=setup, **kwargs)
    return plain(*args, **kwargs)


def elastic_pool(scheduler: Any) -> Any:
    """The scheduler's ElasticBlockPool, or None."""
    manager = getattr(scheduler, "kv_cache_manager", None)
    pool = getattr(manager, "block_pool", None)
    return pool if hasattr(pool, "begin_step") else None


# -- the patch: probe, apply, undo --------------------------------------------------


def _params(fn: Any) -> list[str]:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def _require(cond: bool, why: str) -> None:
    if not cond:
        raise ShapeError(why)


def probe() -> tuple[dict[str, Any], str]:
    """The objects the patch changes; raises ShapeError when the installed vLLM is not the shape we know."""
    mods = {m: importlib.import_module(m) for m in (M_BLOCK_POOL, M_COORDINATOR, M_MANAGER, M_SCHEDULER,
                                                   M_EXECUTOR, M_WORKER_UTILS, M_INTERFACE)}
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

    bp = mods[M_BLOCK_POOL].BlockPool
    for name in ("get_num_free_blocks", "get_new_blocks", "free_blocks", "evict_blocks", "reset_prefix_cache",
                 "_maybe_evict_cached_block", "_notify_reuse", "get_usage"):
        _require(callable(getattr(bp, name, None)), f"BlockPool.{name} is missing")
    init_src = inspect.getsource(bp.__init__)
    _require("self._reuse_watchers" in init_src and "FreeKVCacheBlockQueue(" in init_src,
             "BlockPool.__init__ no longer builds a FreeKVCacheBlockQueue and _reuse_watchers")
    for name in ("popleft", "popleft_n", "remove", "append", "append_n", "prepend_n"):
        _require(callable(getattr(FreeKVCacheBlockQueue, name, None)), f"FreeKVCacheBlockQueue.{name} is missing")
    fields = getattr(KVCacheBlock, "__dataclass_fields__", {})
    _require({"block_id", "ref_cnt", "_block_hash", "prev_free_block", "is_null"} <= set(fields),
             "KVCacheBlock no longer has block_id, ref_cnt, _block_hash, prev_free_block, is_null")
    coord = mods[M_COORDINATOR]
    _require(getattr(coord, "BlockPool", None) in (bp, _block_pool_factory),
             "kv_cache_coordinator no longer builds its pool through the name BlockPool")
    manager = mods[M_MANAGER].KVCacheManager
    _require("get_kv_cache_coordinator(" in inspect.getsource(_unwrapped(manager.__init__)),
             "KVCacheManager.__init__ no longer builds its coordinator")
    sched = mods[M_SCHEDULER].Scheduler
    _require(_params(_unwrapped(sched.update_from_output))[:3] == ["self", "scheduler_output",
                                                                   "model_runner_output"],
             "Scheduler.update_from_output(scheduler_output, model_runner_output) changed")
    for name in ("schedule", "finish_requests", "has_requests"):
        _require(callable(getattr(sched, name, None)), f"Scheduler.{name} is missing")
    execu = mods[M_EXECUTOR].Executor
    _require(_params(_unwrapped(execu.initialize_from_config)) == ["self", "kv_cache_configs"],
             "Executor.initialize_from_config(kv_cache_configs) changed")
    alloc = _unwrapped(mods[M_WORKER_UTILS].allocate_kv_cache)
    _require(_params(alloc) == ["kv_cache_config", "device", "layout", "kernel_block_sizes"],
             "vllm.v1.worker.utils.allocate_kv_cache(kv_cache_config, device, layout, kernel_block_sizes) changed")
    iface = mods[M_INTERFACE]
    _require(_params(iface.create_kv_cache_views)[:5] == ["raw", "spec", "num_blocks", "layout", "kv_cache_tensor"],
             "create_kv_cache_views(raw, spec, num_blocks, layout, kv_cache_tensor, ...) changed")
    _require("fixed_strides" in _params(iface.compute_layout_strides),
             "compute_layout_strides(..., fixed_strides) changed")
    return mods, ("KV cache tensors over reserved ranges, pages mapped for the blocks vLLM's block pool "
                  "hands out, under the segment's limit")


_WRAPPED = "__kvcached_elastic_original__"


def _unwrapped(fn: Any) -> Any:
    while fn is not None and hasattr(fn, _WRAPPED):
        fn = getattr(fn, _WRAPPED)
    return fn


def _mark(fn: Callable[..., Any], original: Any) -> Callable[..., Any]:
    setattr(fn, _WRAPPED, original)
    return fn


def apply() -> Callable[[], None]:
    """Install the patch; returns its undo."""
    mods, _ = probe()
    coord, utils = mods[M_COORDINATOR], mods[M_WORKER_UTILS]
    manager = mods[M_MANAGER].KVCacheManager
    sched = mods[M_SCHEDULER].Scheduler
    execu = mods[M_EXECUTOR].Executor
    undo: list[Callable[[], None]] = []

    def swap(owner: Any, name: str, new: Any) -> None:
        old = getattr(owner, name)
        setattr(owner, name, new)
        undo.append(lambda: setattr(owner, name, old))

    orig_alloc = utils.allocate_kv_cache
    _originals["allocate_kv_cache"] = orig_alloc
    _originals["BlockPool"] = coord.BlockPool
    swap(utils, "allocate_kv_cache", _mark(allocate_kv_cache, orig_alloc))
    for name in ALLOCATE_USERS:
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "allocate_kv_cache", None) is orig_alloc:
            swap(mod, "allocate_kv_cache", allocate_kv_cache)
    swap(coord, "BlockPool", _block_pool_factory)

    orig_init = manager.__init__

    def manager_init(self: Any, *args: Any, **kwargs: Any) -> None:
        _tls.building = True
        try:
            orig_init(self, *args, **kwargs)
        finally:
            _tls.building = False

    swap(manager, "__init__", _mark(manager_init, orig_init))

    orig_schedule, orig_update = sched.schedule, sched.update_from_output

    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        pool = elastic_pool(self)
        if pool is None:
            return orig_schedule(self, *args, **kwargs)
        pool.begin_step()
        out = orig_schedule(self, *args, **kwargs)
        pool.inflight.issue(out)
        return out

    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any, *args: Any,
                           **kwargs: Any) -> Any:
        pool = elastic_pool(self)
        if pool is None:
            return orig_update(self, scheduler_output, model_runner_output, *args, **kwargs)
        pool.inflight.complete(scheduler_output)
        out = orig_update(self, scheduler_output, model_runner_output, *args, **kwargs)
        # What this output freed: released beyond the reserve, unmapped once no batch runs;
        # all of it at once when nothing is left to schedule (no later step would).
        pool.end_step(idle=not self.has_requests())
        return out

    orig_finish = sched.finish_requests

    def finish_requests(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig_finish(self, *args, **kwargs)
        pool = elastic_pool(self)
        if pool is not None and not self.has_requests():
            pool.end_step(idle=True)  # aborted while nothing else runs: no step will come
        return out

    swap(sched, "schedule", _mark(schedule, orig_schedule))
    swap(sched, "update_from_output", _mark(update_from_output, orig_update))
    swap(sched, "finish_requests", _mark(finish_requests, orig_finish))

    orig_ifc = execu.initialize_from_config

    def initialize_from_config(self: Any, kv_cache_configs: list[Any]) -> Any:
        try:
            mode, why = _executor_mode(self)
            if mode is None:
                log.warning("kvcached: elastic KV is off for this engine: %s", why)
                forget_engine()
            else:
                parallel = self.vllm_config.parallel_config
                prepare_engine(kv_cache_configs, mode, int(parallel.tensor_parallel_size),
                               int(parallel.pipeline_parallel_size))
        except Exception as e:  # deciding must never stop the engine: it keeps vLLM's allocation
            log.warning("kvcached: elastic KV is off for this engine: %s", e)
            forget_engine()
        return orig_ifc(self, kv_cache_configs)

    swap(execu, "initialize_from_config", _mark(initialize_from_config, orig_ifc))

    def revert() -> None:
        for u in reversed(undo):
            u()
        forget_engine()

    return revert
