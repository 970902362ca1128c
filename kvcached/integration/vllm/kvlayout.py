"""Where vLLM 0.33's KV cache puts each block's bytes, for the `elastic-kv` patch to map pages under them.

vLLM lays its KV cache out in one backing buffer per worker
(`v1/worker/utils.py:allocate_kv_cache`, `v1/kv_cache_interface.py`): every
`KVCacheTensor` places its layers in it, block `b` of layer `l` at
`offset + l * layer_stride + b * block_stride`. `footprint` turns that into a
`Footprint` (kvcached.runtime.kvplan): which byte runs each block occupies.
vLLM is imported inside the functions that need it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...runtime.kvplan import Footprint

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
