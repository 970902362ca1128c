"""SGLang 0.5.23's MHA and MLA pools over a reserved range: SGLang's shapes, kvcached's pages, data that reads back.

The pages are the extension's real memfd pages; "data lands in the mapped
pages" is read straight from the range's bytes (`Pages.buffer`), not through
the pool's tensors.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("kvcached.runtime._kvpages", reason="kvcached.runtime._kvpages is not built (pip install -e .)")
pytestmark = [pytest.mark.sglang, pytest.mark.ext, pytest.mark.usefixtures("sgl", "elastic_env")]

from . import elastic_support as es  # noqa: E402


def test_aligned_rows_fill_whole_physical_pages_and_whole_sglang_pages() -> None:
    from kvcached.integration.sglang.elastic_buffers import aligned_rows

    for rows, row_bytes, ps, page in [(4097, 1024, 1, es.PAGE), (4112, 1024, 16, es.PAGE), (33, 1152, 1, 2 << 20),
                                      (129, 96, 64, es.PAGE)]:
        n = aligned_rows(rows, row_bytes, ps, page)
        assert n >= rows and n % ps == 0 and (n * row_bytes) % page == 0
        # The smallest such: one step less is too short or misaligned.
        step = math.lcm(ps, page // math.gcd(page, row_bytes))
        assert n - step < rows


def test_plan_layout_starts_every_part_on_a_page_and_groups_own_their_pages() -> None:
    from kvcached.integration.sglang.elastic_buffers import plan_layout
    from kvcached.runtime.kvplan import PagePlan, min_blocks_per_page

    lay = plan_layout(4097, 1, es.LAYERS, [1024, 1024], es.PAGE)
    assert lay.part_offsets == (0, lay.padded[0] * 1024) and lay.layer_bytes % es.PAGE == 0
    g = min_blocks_per_page(lay.footprint, es.PAGE)
    assert g == es.PAGE // 1024  # 64 tokens of one layer's K fill a page
    plan = PagePlan(lay.footprint, es.PAGE, g)
    pages = [set(plan.pages_of(i)) for i in range(plan.num_groups)]
    assert all(len(p) == 2 * es.LAYERS for p in pages)  # K and V of every layer
    assert all(not (a & b) for i, a in enumerate(pages) for b in pages[i + 1:])  # no page shared


def test_mha_pool_keeps_sglangs_shapes_and_fused_halves_over_the_range() -> None:
    import torch

    pool = es.mha_pool(True, size=4096, page_size=16)
    buf = pool.elastic
    assert buf is not None and pool.elastic_why is None
    lo, hi = buf.pages.address, buf.pages.address + buf.pages.size
    for k, v in zip(pool.k_buffer, pool.v_buffer):
        assert k.shape == v.shape == (4096 + 16, es.HEADS, es.HEAD_DIM) and k.dtype == torch.float16
        assert lo <= k.data_ptr() < hi and lo <= v.data_ptr() < hi
        # K and V: halves of one tensor, V a whole number of SGLang pages (and of physical pages) past K.
        assert k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
        delta = v.data_ptr() - k.data_ptr()
        assert delta % (16 * k.stride(0) * 2) == 0 and delta % es.PAGE == 0
        assert k.is_contiguous() and v.is_contiguous()
    # SGLang's own bookkeeping over the same tensors: pointers and strides for its copy kernels.
    assert pool.k_data_ptrs.tolist() == [k.data_ptr() for k in pool.k_buffer]
    assert pool.get_kv_size_bytes() == es.mha_pool(False, size=4096, page_size=16).get_kv_size_bytes()
    # Only the group of id 0 (SGLang's padding page) is mapped at the start.
    assert buf.mapped_groups() == [0] and buf.mapped_bytes == 2 * es.LAYERS * es.PAGE


def _range_bytes(pool, layer: int, slot: int, half: int) -> bytes:
    """The bytes of `slot`'s K (half 0) or V (half 1) in `layer`, read from the range itself."""
    lay = pool.elastic_layout
    row = es.HEADS * es.HEAD_DIM * 2
    at = layer * lay.layer_bytes + lay.part_offsets[half] + slot * row
    return bytes(pool.elastic.pages.buffer()[at:at + row])


def test_kv_written_with_set_kv_buffer_lands_in_mapped_pages_and_reads_back_after_remapping() -> None:
    import torch

    pool = es.mha_pool(True, size=4096)
    alloc = es.allocator(pool, True, 4096)
    g = alloc.ids_per_group
    slots = alloc.alloc(3 * g)  # ids 1..3g: groups 0..3 mapped
    assert pool.elastic.mapped_groups() == [0, 1, 2, 3]
    a, b = slots[g + 5:g + 9], slots[2 * g + 1:2 * g + 3]  # in groups 1 and 2
    k = torch.randn(4, es.HEADS, es.HEAD_DIM, dtype=torch.float16)
    v = torch.randn(4, es.HEADS, es.HEAD_DIM, dtype=torch.float16)
    pool.set_kv_buffer(None, a, k, v, layer_id_override=2)
    pool.set_kv_buffer(None, b, k[:2] * 2, v[:2] * 2, layer_id_override=0)
    assert torch.equal(pool.get_key_buffer(2)[a], k) and torch.equal(pool.get_value_buffer(2)[a], v)
    assert _range_bytes(pool, 2, int(a[1]), 0) == k[1].numpy().tobytes()
    assert _range_bytes(pool, 2, int(a[3]), 1) == v[3].numpy().tobytes()
    # Free group 1's tokens: the boundary unmaps it (its neighbour keeps its data).
    alloc.free(slots[g - 1:2 * g - 1])
    alloc.step(lambda: True)
    assert 1 not in pool.elastic.mapped_groups() and 2 in pool.elastic.mapped_groups()
    assert torch.equal(pool.get_key_buffer(0)[b], k[:2] * 2)
    # Mapped again for the next tokens: fresh pages (zeros), which take writes and read them back.
    again = alloc.alloc(len(alloc.free_pages) + g)  # the rest of group 3, then a group mapped anew: group 1
    assert 1 in pool.elastic.mapped_groups() and set(slots[g - 1:2 * g - 1].tolist()) <= set(again.tolist())
    assert not pool.get_key_buffer(2)[a].any() and not pool.get_value_buffer(2)[a].any()
    pool.set_kv_buffer(None, a, v, k, layer_id_override=2)
    assert torch.equal(pool.get_key_buffer(2)[a], v) and torch.equal(pool.get_value_buffer(2)[a], k)
    assert _range_bytes(pool, 2, int(a[0]), 0) == v[0].numpy().tobytes()
    assert torch.equal(pool.get_value_buffer(0)[b], v[:2] * 2)


def test_mla_pool_latent_buffers_over_the_range_read_back_after_remapping() -> None:
    import torch
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    from kvcached.integration.sglang.elastic_buffers import ElasticMLATokenToKVPool

    kw = dict(size=2048, page_size=1, dtype=torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64, layer_num=2,
              device="cpu", enable_memory_saver=False)
    pool = ElasticMLATokenToKVPool(**kw)
    plain = MLATokenToKVPool(**kw)
    assert [tuple(b.shape) for b in pool.kv_buffer] == [tuple(b.shape) for b in plain.kv_buffer] == [(2049, 1, 576)] * 2
    buf = pool.elastic
    assert buf is not None and all(buf.pages.address <= b.data_ptr() < buf.pages.address + buf.pages.size
                                   for b in pool.kv_buffer)
    alloc = es.allocator(pool, True, 2048)
    slots = alloc.alloc(1500)
    row = torch.randn(3, 1, 576, dtype=torch.bfloat16)
    loc = slots[1200:1203]
    # SGLang's MLA writer is a Triton kernel (no CPU launch here): the same scatter, through the pool's buffer.
    pool.get_key_buffer(1)[loc] = row
    assert torch.equal(pool.get_key_buffer(1)[loc], row)
    assert torch.equal(pool.get_value_buffer(1)[loc], row[..., :512])
    alloc.free(slots)
    alloc.step(lambda: True)
    assert buf.mapped_groups() == [0]
    again = alloc.alloc(1500)
    assert not pool.get_key_buffer(1)[again].any()
    pool.get_key_buffer(1)[loc] = -row
    assert torch.equal(pool.get_key_buffer(1)[loc], -row)


def test_a_layout_other_than_nhd_keeps_sglangs_own_buffers() -> None:
    pool = es.mha_pool(True, size=1024, kv_cache_layout="page_major")
    assert pool.elastic is None and "page_major" in pool.elastic_why
    assert pool.k_buffer[0].shape == (1025, es.HEADS, es.HEAD_DIM)


def test_a_pool_no_elastic_allocator_takes_is_mapped_whole_after_configuring() -> None:
    """What `settle` does after the configurator: a pool of ours handed to SGLang's allocator maps everything."""
    from kvcached.integration.sglang.elastic_buffers import building, settle

    with building() as made:
        pool = es.mha_pool(True, size=1024)
        stock = es.allocator(pool, False, 1024)
    assert made == [pool] and pool.elastic is not None
    settle(made, stock)
    assert pool.elastic is None and "TokenToKVPoolAllocator" in pool.elastic_why
    buf = pool._kept
    assert buf.mapped_groups() == list(range(buf.plan.num_groups))
    # Every slot SGLang's allocator can hand out is writable now.
    import torch

    slots = stock.alloc(1024)
    pool.set_kv_buffer(None, slots, torch.ones(1024, es.HEADS, es.HEAD_DIM, dtype=torch.float16),
                       torch.ones(1024, es.HEADS, es.HEAD_DIM, dtype=torch.float16), layer_id_override=0)
    assert bool(pool.get_key_buffer(0)[slots].eq(1).all())
