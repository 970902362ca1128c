"""The `sglang-elastic-kv` patch: elastic KV memory inside SGLang 0.5.23 (on with ``KVCACHED_ELASTIC=1``).

Off, nothing here is applied and SGLang allocates its KV cache as it always
does. On, four points change, each found by its shape (docs/SGLANG.md):

1. `KVCacheConfigurator.configure`: when the configurator builds a plain
   pool (no draft worker, sliding window, hybrid linear attention, KV
   sharding, post-capture backing, pipeline or decode-context parallelism,
   DP attention, unified memory, HiSparse, page-major layout or PD
   disaggregation: each of those stands aside with one log line), the two
   platform hooks below answer for the duration of the call; afterwards an
   elastic pool that no elastic allocator took (built inside a composite, or
   for a shape the checks missed) has its whole range mapped (`settle`), so
   no allocator of SGLang's can ever write where nothing is mapped.
2. `SRTPlatform.get_kv_pool_cls`: for kinds ``mha`` and ``mla``, where the
   platform itself answers None, the elastic pool classes (`elastic_buffers`).
3. `SRTPlatform.get_paged_allocator_cls`, and the name `TokenToKVPoolAllocator`
   the configurator builds page size 1 with: the elastic allocators
   (`elastic_alloc`), which build SGLang's own class for a pool that is not
   elastic.
4. `Scheduler.get_next_batch_to_run`: before each pick, on every TP rank in
   the same order, the allocator's step boundary (`_ElasticIds.step`): the
   limit agreed across the TP group (`elastic_ranks`), released groups unmapped.

The limit is the deployment's segment: the one TP rank 0 claimed (the
serve side's `sglang-segment`), else
``layout_from_env().segment_path(<name>[_dp<rank>])``, picked up once it
exists (`engine_elastic.segment_to_follow`); until then the pool is limited
by SGLang's own capacity only.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from typing import Any

from ... import settings
from ..patchkit import Changes, NotCovered, Patch, original, params, require, source
from .common import M_ALLOCATOR, M_BUDGET, M_CONFIGURATOR, M_PLATFORM, M_POOL, M_SCHEDULER

log = logging.getLogger(__name__)

#: The serve side's patch that claims the segment on TP rank 0 (the limit is read from it).
SEGMENT_PATCH = "sglang-segment"


def switch() -> str | None:
    """Why the patch is off (KVCACHED_ELASTIC unset), or None when it is on."""
    return None if settings.ELASTIC.get() else f"elastic KV memory is off (set {settings.ELASTIC.name}=1)"


def _source(fn: Any) -> str:
    """The engine's own source of `fn`, or "" (a probe then finds none of what it looks for)."""
    return source(fn) or ""


def _probe_allocators(alloc: Any, budget: Any) -> None:
    token, paged, base = alloc.TokenToKVPoolAllocator, alloc.PagedTokenToKVPoolAllocator, \
        alloc.BaseTokenToKVPoolAllocator
    require(params(token.__init__) == ["self", "size", "dtype", "device", "kvcache", "need_sort"],
             "TokenToKVPoolAllocator(size, dtype, device, kvcache, need_sort) changed")
    require(params(paged.__init__) == ["self", "size", "page_size", "dtype", "device", "kvcache", "need_sort"],
             "PagedTokenToKVPoolAllocator(size, page_size, dtype, device, kvcache, need_sort) changed")
    require(params(paged.alloc_extend)[:7] == ["self", "prefix_lens", "prefix_lens_cpu", "seq_lens",
                                                "seq_lens_cpu", "last_loc", "extend_num_tokens"],
             "PagedTokenToKVPoolAllocator.alloc_extend(prefix_lens, ..., extend_num_tokens) changed")
    require(params(paged.alloc_decode) == ["self", "seq_lens", "seq_lens_cpu", "last_loc"],
             "PagedTokenToKVPoolAllocator.alloc_decode(seq_lens, seq_lens_cpu, last_loc) changed")
    for cls in (token, paged):
        for name in ("alloc", "free", "available_size", "clear", "get_all_free_pages"):
            require(callable(getattr(cls, name, None)), f"{cls.__name__}.{name} is missing")
        require("self.free_pages = " in _source(cls.clear), f"{cls.__name__}.clear no longer sets free_pages")
    for name in ("create_prefill_budget", "check_decode_capacity", "evict_to_free_tokens"):
        require(callable(getattr(base, name, None)), f"the allocator's capacity hook {name} is missing")
    require("available_size()" in _source(budget.PrefillBudget._available_and_evictable),
             "PrefillBudget._available_and_evictable no longer reads the allocator's available_size()")


def probe() -> dict[str, Any]:
    """The modules the patch changes, when the installed SGLang is the shape we know; raises otherwise."""
    mods = {m: importlib.import_module(m) for m in (M_PLATFORM, M_CONFIGURATOR, M_SCHEDULER, M_POOL, M_ALLOCATOR,
                                                   M_BUDGET)}
    platform_cls = mods[M_PLATFORM].SRTPlatform
    require(params(platform_cls.get_kv_pool_cls) == ["self", "kind"],
             "SRTPlatform.get_kv_pool_cls(*, kind) changed")
    require(params(platform_cls.get_paged_allocator_cls) == ["self"],
             "SRTPlatform.get_paged_allocator_cls() changed")
    from sglang.srt.platforms import current_platform

    # The base SRTPlatform is what SGLang runs on when no device platform activates (a CPU machine).
    if not (current_platform.is_cpu() or current_platform.is_cuda() or type(current_platform) is platform_cls):
        raise NotCovered(f"the {type(current_platform).__name__} platform (elastic KV covers CPU and CUDA)")
    for name in ("get_kv_pool_cls", "get_paged_allocator_cls"):
        if original(inspect.getattr_static(type(current_platform), name)) is not \
                original(inspect.getattr_static(platform_cls, name)):
            raise NotCovered(f"{type(current_platform).__name__} answers {name} itself (a platform plugin)")
    cfg = mods[M_CONFIGURATOR]
    require(original(getattr(cfg, "TokenToKVPoolAllocator", None)) is mods[M_ALLOCATOR].TokenToKVPoolAllocator,
             "kv_cache_configurator no longer builds page size 1 through the name TokenToKVPoolAllocator")
    conf = cfg.KVCacheConfigurator
    require(params(conf.configure) == ["self", "pre_model_load_memory"],
             "KVCacheConfigurator.configure(*, pre_model_load_memory) changed")
    build = _source(conf._build_token_to_kv_pool_allocator)
    require("TokenToKVPoolAllocator(" in build and "get_paged_allocator_cls()" in build,
             "KVCacheConfigurator._build_token_to_kv_pool_allocator no longer builds through the platform hook "
             "and TokenToKVPoolAllocator")
    require("get_kv_pool_cls(kind=kind)" in _source(conf._resolve_kv_pool_class),
             "KVCacheConfigurator._resolve_kv_pool_class no longer asks the platform hook")
    pool = mods[M_POOL]
    require("self._create_buffers_normal()" in _source(pool.MHATokenToKVPool._create_buffers)
             and callable(getattr(pool.MHATokenToKVPool, "_kv_buffer_shapes", None)),
             "MHATokenToKVPool._create_buffers no longer calls _create_buffers_normal")
    require("self.kv_buffer = [" in _source(pool.MLATokenToKVPool._create_buffers),
             "MLATokenToKVPool._create_buffers no longer makes one kv_buffer per layer")
    _probe_allocators(mods[M_ALLOCATOR], mods[M_BUDGET])
    sched = mods[M_SCHEDULER].Scheduler
    require(params(sched.get_next_batch_to_run) == ["self", "running_batch", "last_batch"],
             "Scheduler.get_next_batch_to_run(running_batch, last_batch) changed")
    require(callable(getattr(sched, "is_fully_idle", None)), "Scheduler.is_fully_idle is missing")
    return mods


# -- the configurator: which shapes go elastic ----------------------------------------------


def not_plain(configurator: Any) -> str | None:
    """Why the pool `configurator` builds must stay SGLang's, or None for a plain MHA/MLA pool."""
    checks = (
        ("is_draft_worker", "a speculative draft worker's pool (it shares the target's allocator)"),
        ("is_hybrid_swa", "a hybrid sliding-window model"),
        ("post_capture_kv_active", "post-capture KV backing (SGLang's own VMM)"),
    )
    for attr, why in checks:
        if getattr(configurator, attr, False):
            return why
    if getattr(configurator, "mambaish_config", None) is not None:
        return "a hybrid linear-attention (Mamba-like) model"
    if int(getattr(configurator, "kv_shard_size", 1) or 1) > 1:
        return "KV cache sharding (--enable-kv-cache-sharding)"
    try:
        from sglang.srt.runtime_context import get_disagg, get_memory, get_parallel

        par, mem = get_parallel(), get_memory()
        facts = (
            (int(par.pp_size) > 1, "pipeline parallelism (each stage holds its own layers)"),
            (bool(par.attn_dp_enabled), "DP attention (each DP rank runs its own batch)"),
            (bool(par.dcp_enabled), "decode context parallelism"),
            (bool(mem.enable_unified_memory), "the unified memory pool"),
            (bool(mem.enable_hisparse), "HiSparse"),
            (bool(mem.enable_page_major_kv_layout), "the page-major KV layout"),
            (get_disagg().disaggregation_mode in ("prefill", "decode"), "PD disaggregation"),
        )
    except Exception as e:  # a context we cannot read is a shape we do not know
        return f"SGLang's runtime context cannot be read ({type(e).__name__}: {e})"
    for cond, why in facts:
        if cond:
            return why
    return None


_classes: dict[str, Any] = {}  # filled at install: the elastic classes, imported with SGLang


def _configure(wrapped: Any, configurator: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    why = not_plain(configurator)
    if why is not None:
        log.info("kvcached: this SGLang KV pool stays SGLang's, not elastic: %s", why)
        return wrapped(*args, **kwargs)
    pool = importlib.import_module(".elastic_buffers", __package__)
    with pool.building() as made:
        result = wrapped(*args, **kwargs)
    pool.settle(made, getattr(result, "token_to_kv_pool_allocator", None))
    return result


def _kv_pool_cls(wrapped: Any, _platform: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    got = wrapped(*args, **kwargs)
    if got is not None or not _classes["in_building"]():
        return got
    return _classes["pools"].get(kwargs.get("kind"))


def _paged_allocator_cls(wrapped: Any, _platform: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    got = wrapped(*args, **kwargs)
    return _classes["paged"] if got is None and _classes["in_building"]() else got


def _token_allocator(wrapped: Any, _module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if _classes["in_building"]():
        return _classes["token"](*args, **kwargs)  # SGLang's own class for a pool that is not elastic
    return wrapped(*args, **kwargs)


def _next_batch(wrapped: Any, scheduler: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    alloc = getattr(scheduler, "token_to_kv_pool_allocator", None)
    if isinstance(alloc, _classes["ids"]):
        if alloc.agreement is None:
            group = scheduler.tp_group if int(getattr(scheduler, "tp_size", 1) or 1) > 1 else None
            alloc.attach(group, overlap=bool(getattr(scheduler, "enable_overlap", False)))
        alloc.step(scheduler.is_fully_idle, scheduler.tree_cache)
    return wrapped(*args, **kwargs)


def install(changes: Changes, mods: dict[str, Any]) -> None:
    """Wrap the configurator, the platform's two hooks, the page-size-1 allocator's name and the scheduler's pick."""
    pool = importlib.import_module(".elastic_buffers", __package__)
    alloc = importlib.import_module(".elastic_alloc", __package__)
    _classes.update(pools=pool.POOL_CLASSES, in_building=pool.in_building, paged=alloc.ElasticPagedAllocator,
                    token=alloc.ElasticTokenAllocator, ids=alloc._ElasticIds)
    changes.on_undo(_classes.clear)
    cfg = mods[M_CONFIGURATOR]
    changes.wrap(cfg.KVCacheConfigurator, "configure", _configure)
    platform_cls = mods[M_PLATFORM].SRTPlatform
    changes.wrap(platform_cls, "get_kv_pool_cls", _kv_pool_cls)
    changes.wrap(platform_cls, "get_paged_allocator_cls", _paged_allocator_cls)
    changes.wrap(cfg, "TokenToKVPoolAllocator", _token_allocator)
    changes.wrap(mods[M_SCHEDULER].Scheduler, "get_next_batch_to_run", _next_batch)


PATCH = Patch(
    name="sglang-elastic-kv",
    does="SGLang's MHA/MLA KV buffers over reserved ranges, pages mapped for the ids its allocator hands out, "
         "under the segment's limit agreed across the TP group",
    targets=(
        f"{M_CONFIGURATOR}:KVCacheConfigurator.configure",
        f"{M_PLATFORM}:SRTPlatform.get_kv_pool_cls",
        f"{M_PLATFORM}:SRTPlatform.get_paged_allocator_cls",
        f"{M_CONFIGURATOR}:TokenToKVPoolAllocator",
        f"{M_SCHEDULER}:Scheduler.get_next_batch_to_run",
    ),
    probe=probe,
    install=install,
    requires=(SEGMENT_PATCH,),
    switch=switch,
)

#: The patches of elastic KV for SGLang, for the plugin's registry (`patches.py`).
PATCHES: tuple[Patch, ...] = (PATCH,)
