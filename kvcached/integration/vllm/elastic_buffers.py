"""The `elastic-kv` patch's worker side: vLLM's KV cache laid over an elastic buffer, and where its blocks lie.

vLLM lays its KV cache out in one backing buffer per worker
(`v1/worker/utils.py:allocate_kv_cache`, `v1/kv_cache_interface.py`): every
`KVCacheTensor` places its layers in it, block `b` of layer `l` at
`offset + l * layer_stride + b * block_stride`. `footprint` turns that into a
`Footprint` (kvcached.runtime.kvplan): which byte runs each block occupies.
`allocate_kv_cache` (the patched allocation, `elastic.py`) makes that buffer a
`KVBuffer` (a reserved range, block 0's pages mapped), lets vLLM's own
`create_kv_cache_views` lay every layer over it, and serves the engine's
commands for it on this worker's listener; for a config it cannot describe
it keeps vLLM's allocation and tells the engine why (`refusals`).
vLLM is imported inside the functions that need it.

The vLLM version's shape of this role lives here: a release that lays its
KV cache out differently changes `footprint` and `pad_layer_regions`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ... import settings
from ...runtime.kvplan import Footprint
from .. import running

log = logging.getLogger(__name__)

MARK = "_kvcached_elastic"  # set on the KVCacheConfig objects the engine sends its workers (elastic.prepare_engine)
_MAX_RUNS_PER_BLOCK = 4096


def spec_of(cfg: Any, layer: str) -> tuple[int, Any]:
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
        _, spec = spec_of(cfg, t.layers[0])
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
        _, spec = spec_of(cfg, t.layers[0])
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


# -- the allocation -----------------------------------------------------------------

refusals: list[str] = []  # why this process's worker fell back to vLLM's allocation


def allocate_kv_cache(plain: Any, kv_cache_config: Any, device: Any, layout: Any,
                      kernel_block_sizes: list[int] | None = None, **more: Any) -> dict[str, Any]:
    """vLLM's allocate_kv_cache (`plain`), over an elastic buffer when the engine asked for one.

    `more`: what later releases add (0.34's `allocate`, the backing allocator
    of its extensible KV cache), passed to `plain` as given.
    """
    if not getattr(kv_cache_config, MARK, False):
        return plain(kv_cache_config, device, layout, kernel_block_sizes, **more)
    why = unsupported(kv_cache_config)
    if why is None and more.get("allocate") is not None:
        why = "vLLM's extensible KV cache allocates this buffer itself (allocate=)"
    if why is None and str(device).split(":")[0] not in ("cpu", "cuda"):
        why = f"device {device} has no page backend"
    if why is None:
        try:
            return _allocate_elastic(kv_cache_config, device, layout, kernel_block_sizes)
        except Exception as e:  # never fail a worker's start for it: fall back, and say so
            log.exception("kvcached: elastic KV buffer failed")
            why = f"{type(e).__name__}: {e}"
    _refuse(why)
    return plain(kv_cache_config, device, layout, kernel_block_sizes, **more)


def _allocate_elastic(cfg: Any, device: Any, layout: Any, kernel_block_sizes: list[int] | None) -> dict[str, Any]:
    from vllm.v1.kv_cache_interface import create_kv_cache_views

    from kvcached.runtime.kvbuffer import KVBuffer, set_local_buffer

    page = settings.PAGE_SIZE.get()
    # The worker's own copy of the config: the model runner keeps it, so it describes the views made here.
    pad_layer_regions(cfg, page)
    buf = KVBuffer(footprint(cfg, layout), page, device=str(device))
    raw = buf.tensor()
    kv_caches: dict[str, Any] = {}
    for t in cfg.kv_cache_tensors:
        gid, spec = spec_of(cfg, t.layers[0])
        kernel = kernel_block_sizes[gid] if kernel_block_sizes is not None and gid < len(kernel_block_sizes) \
            else None
        views = create_kv_cache_views(raw, spec, cfg.num_blocks_of(t), layout, t, kernel_block_size=kernel)
        kv_caches.update(zip(t.layers, views))
    set_local_buffer(buf)
    listener = running.current_worker_listener()
    if listener is not None:
        buf.register(listener)
    log.info("kvcached: KV cache of %d bytes is elastic: %d pages of %d bytes reserved, %d mapped",
             cfg.kv_cache_tensors[0].size, buf.plan.num_pages, buf.page_size, buf.pages.num_mapped)
    return kv_caches


def _refuse(why: str) -> None:
    from kvcached.runtime.ipc.protocol import CMD_INFO
    from kvcached.runtime.kvbuffer import set_local_buffer

    log.warning("kvcached: this KV cache stays fully allocated, not elastic: %s", why)
    refusals.append(why)
    set_local_buffer(None)
    listener = running.current_worker_listener()
    if listener is not None:
        listener.register(CMD_INFO, lambda _a: {"elastic": False, "why": why})
