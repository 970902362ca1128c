"""SGLang's MHA and MLA KV pools with their buffers laid over one reserved range (memfd pages on the CPU, VMM on CUDA).

The `sglang-elastic-kv` patch hands these classes to SGLang's KV cache
configurator through the platform hook `get_kv_pool_cls`. Being subclasses of
SGLang's pools, this module imports SGLang at import.

Only the buffers change. Every layer keeps the shape, dtype and layout
SGLang's own `_create_buffers_normal` gives it (docs/SGLANG.md, "The KV
pool"): an MHA layer whose K and V rows match is one ``(2, rows, H, D)``
tensor whose halves are K and V (kernels with a single pool base reach V at a
whole number of SGLang pages past K), an MLA layer one ``(rows, 1, dim)``
latent buffer. What differs is where they live: each layer's region of the
range starts on a page boundary and each half is padded (address space only)
so that it ends on one, so that a group of consecutive SGLang pages (ids)
owns whole physical pages in every layer (`kvcached.runtime.kvplan`). The
`KVBuffer` maps the group holding id 0 (SGLang's padding slot, which dummy
writes hit) from the start; the elastic allocator maps the others as it
hands their ids out.

A pool whose buffers cannot be laid out that way (quantized, HND or AITER
layouts, post-capture VMM backing, SGLang's memory saver or a custom memory
pool, a device without a page backend) makes SGLang's own buffers, logged,
and its allocator stays SGLang's.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

from ... import settings
from ...runtime.kvbuffer import KVBuffer
from ...runtime.kvplan import Footprint

log = logging.getLogger(__name__)


def aligned_rows(rows: int, row_bytes: int, page_size: int, page: int) -> int:
    """`rows` rounded up so that the rows fill whole physical pages and whole SGLang pages."""
    step = math.lcm(page_size, page // math.gcd(page, row_bytes))
    return -(-rows // step) * step


@dataclass(frozen=True)
class PoolLayout:
    """Where each layer's parts (K and V, or MHA's latent) lie in the range, and what an id's bytes are."""

    rows: int  # SGLang's rows per part: size + page_size
    page_size: int  # tokens per SGLang page: one allocator id
    padded: tuple[int, ...]  # rows reserved per part (a multiple of both page sizes)
    part_offsets: tuple[int, ...]  # byte offset of each part in a layer's region
    layer_bytes: int
    layer_num: int
    footprint: Footprint

    @property
    def num_ids(self) -> int:
        """SGLang pages (ids) the rows hold, id 0 included."""
        return -(-self.rows // self.page_size)


def plan_layout(rows: int, page_size: int, layer_num: int, part_row_bytes: Sequence[int], page: int) -> PoolLayout:
    """The layout of `layer_num` layers, each with parts of `part_row_bytes` bytes per row, over pages of `page`."""
    padded = tuple(aligned_rows(rows, rb, page_size, page) for rb in part_row_bytes)
    offsets, at = [], 0
    for n, rb in zip(padded, part_row_bytes):
        offsets.append(at)
        at += n * rb
    layer_bytes = at
    num_ids = -(-rows // page_size)
    runs = [(page_size * rb, layer * layer_bytes + off, page_size * rb)
            for layer in range(layer_num) for off, rb in zip(offsets, part_row_bytes)]
    fp = Footprint.build(layer_num * layer_bytes, num_ids, runs)
    return PoolLayout(rows, page_size, padded, tuple(offsets), layer_bytes, layer_num, fp)


# -- which pools the configurator builds while a plain shape is configured -------------

_local = threading.local()


@contextmanager
def building() -> Iterator[list[Any]]:
    """While SGLang configures a plain pool: the elastic pools made meanwhile are listed, for `settle`."""
    made: list[Any] = []
    outer = getattr(_local, "made", None)
    _local.made = made
    try:
        yield made
    finally:
        _local.made = outer


def in_building() -> bool:
    """Inside `building()`: the platform hooks answer with the elastic classes."""
    return getattr(_local, "made", None) is not None


def settle(made: Sequence[Any], allocator: Any) -> None:
    """After the configurator: an elastic pool that `allocator` did not adopt gets every page mapped (stands aside).

    Only the elastic allocator maps pages on demand; a pool of ours built
    inside a composite (a hybrid or sliding-window pool) or handed to
    another allocator would otherwise be written where nothing is mapped.
    """
    for pool in made:
        if pool.elastic is not None and not pool.adopted:
            pool.stand_aside(f"its allocator is SGLang's {type(allocator).__name__}, which maps no pages")


# -- the pools ---------------------------------------------------------------------------


class _ElasticBuffers:
    """What the MHA and MLA pools share: the reserved range, and standing aside when it cannot be used."""

    elastic: KVBuffer | None = None  # the range while the pool is elastic
    elastic_layout: PoolLayout | None = None
    elastic_why: str | None = None  # why the pool is not (or no longer) elastic
    _kept: KVBuffer | None = None  # a range fully mapped after standing aside: its views live on
    adopted = False  # an elastic allocator maps this pool's pages (set by that allocator)

    def _elastic_unfit(self: Any) -> str | None:
        device = str(self.device).split(":")[0]
        if device not in ("cpu", "cuda"):
            return f"device {self.device} has no page backend"
        if getattr(self.memory_saver_adapter, "enabled", False):
            return "SGLang's memory saver owns the KV cache memory (--enable-memory-saver)"
        if getattr(self, "enable_custom_mem_pool", False) or getattr(self, "custom_mem_pool", None) is not None:
            return "the KV cache lives in a custom memory pool (SGLANG_MOONCAKE_CUSTOM_MEM_POOL)"
        if self.layer_num <= 0:
            return "the pool has no layers"
        return None

    def _reserve(self: Any, part_row_bytes: Sequence[int]) -> tuple[Any, PoolLayout]:
        """Reserve the range for this pool's rows and parts; returns the flat int8 tensor over it, and the layout."""
        page = settings.PAGE_SIZE.get()
        layout = plan_layout(self.size + self.page_size, self.page_size, self.layer_num, part_row_bytes, page)
        buf = KVBuffer(layout.footprint, page, device=str(self.device))
        buf.configure(buf.min_blocks_per_page)  # maps the group of id 0: SGLang's padding slot
        self.elastic, self.elastic_layout = buf, layout
        made = getattr(_local, "made", None)
        if made is not None:
            made.append(self)
        log.info("kvcached: SGLang KV pool of %d tokens x %d layers is elastic: %d pages of %d bytes reserved, "
                 "%d ids per group, %d mapped", self.size, self.layer_num, buf.plan.num_pages, page,
                 buf.plan.blocks_per_page, buf.pages.num_mapped)
        return buf.tensor(), layout

    def _view(self: Any, raw: Any, offset: int, shape: tuple[int, ...]) -> Any:
        """The store-dtype tensor of `shape` starting `offset` bytes into the range."""
        nbytes = math.prod(shape) * self.store_dtype.itemsize
        return raw[offset:offset + nbytes].view(self.store_dtype).view(*shape)

    def _part(self: Any, raw: Any, layer: int, part: int, inner: tuple[int, ...]) -> Any:
        """Part `part` of `layer`: its reserved rows of `inner`-shaped rows."""
        layout = self.elastic_layout
        offset = layer * layout.layer_bytes + layout.part_offsets[part]
        return self._view(raw, offset, (layout.padded[part], *inner))

    def stand_aside(self: Any, why: str) -> None:
        """Map every page of the range for good: the pool keeps its buffers but is no longer elastic."""
        buf = self.elastic
        if buf is None:
            return
        missing = sorted(set(range(buf.plan.num_groups)) - set(buf.mapped_groups()))
        if missing:
            buf.map_groups(missing)
        self._kept, self.elastic, self.elastic_why = buf, None, why
        log.warning("kvcached: SGLang KV pool is not elastic, its whole range is mapped: %s", why)

    def _refuse(self: Any, why: str) -> None:
        self.elastic_why = why
        log.warning("kvcached: SGLang KV pool keeps SGLang's own buffers, not elastic: %s", why)


class ElasticMHATokenToKVPool(_ElasticBuffers, MHATokenToKVPool):
    """SGLang's MHA pool whose K and V buffers are views over a reserved range, mapped by the elastic allocator."""

    def _create_buffers_normal(self) -> None:
        """SGLang's plain (unquantized, not post-capture) buffers, over the range when the layout is NHD."""
        why = self._elastic_unfit()
        if why is None and (self.kv_cache_layout != "nhd" or getattr(self, "use_hnd", False)):
            why = f"the {self.kv_cache_layout} KV layout (elastic KV lays out NHD rows only)"
        if why is None:
            try:
                self._create_elastic()
                return
            except Exception as e:  # never fail the engine for it: SGLang's own buffers, and say why
                log.exception("kvcached: elastic KV buffers failed")
                self.elastic = self.elastic_layout = None
                why = f"{type(e).__name__}: {e}"
        self._refuse(why)
        super()._create_buffers_normal()

    def _create_elastic(self) -> None:
        k_shape, v_shape = self._kv_buffer_shapes()
        itemsize = self.store_dtype.itemsize
        rows = k_shape[0]
        if k_shape == v_shape:
            # K and V as the two halves of one (2, padded, H, D) tensor per layer, as SGLang makes them.
            row = math.prod(k_shape[1:]) * itemsize
            raw, layout = self._reserve([row, row])
            padded = layout.padded[0]
            fused = [self._view(raw, layer * layout.layer_bytes, (2, padded, *k_shape[1:]))
                     for layer in range(self.layer_num)]
            self.k_buffer = [f[0, :rows] for f in fused]
            self.v_buffer = [f[1, :rows] for f in fused]
            return
        raw, _ = self._reserve([math.prod(k_shape[1:]) * itemsize, math.prod(v_shape[1:]) * itemsize])
        self.k_buffer = [self._part(raw, layer, 0, k_shape[1:])[:rows] for layer in range(self.layer_num)]
        self.v_buffer = [self._part(raw, layer, 1, v_shape[1:])[:rows] for layer in range(self.layer_num)]


class ElasticMLATokenToKVPool(_ElasticBuffers, MLATokenToKVPool):
    """SGLang's MLA pool whose latent buffers are views over a reserved range, mapped by the elastic allocator."""

    def _create_buffers(self) -> None:
        """SGLang's per-layer latent buffers, over the range (plain MLA only: DSA's packed fp8 stands aside)."""
        why = self._elastic_unfit()
        if why is None and (self.use_dsa or self.dsa_kv_cache_store_fp8):
            why = "a DSA pool (its indexer buffers are laid out apart)"
        if why is None:
            try:
                rows = self.size + self.page_size
                raw, _ = self._reserve([self.kv_cache_dim * self.store_dtype.itemsize])
                self.kv_buffer = [self._part(raw, layer, 0, (1, self.kv_cache_dim))[:rows]
                                  for layer in range(self.layer_num)]
                return
            except Exception as e:  # SGLang's own buffers, and say why
                log.exception("kvcached: elastic KV buffers failed")
                self.elastic = self.elastic_layout = None
                why = f"{type(e).__name__}: {e}"
        self._refuse(why)
        super()._create_buffers()


#: The class the platform hook answers with, by SGLang's pool kind.
POOL_CLASSES: dict[str, type] = {"mha": ElasticMHATokenToKVPool, "mla": ElasticMLATokenToKVPool}
