"""SGLang 0.5.23's KV pools, token allocators and RadixCache, built on the CPU as its scheduler builds them."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.usefixtures("sgl")]

LAYERS, HEADS, HEAD_DIM = 3, 2, 8


def _mha(size: int = 64, page_size: int = 1, **kw):
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(size=size, page_size=page_size, dtype=torch.float16, head_num=HEADS, head_dim=HEAD_DIM,
                            layer_num=LAYERS, device="cpu", enable_memory_saver=False, enable_alt_stream=False, **kw)


def test_mha_pool_has_one_k_and_one_v_buffer_per_layer_over_one_allocation() -> None:
    """k_buffer/v_buffer per layer, [size + page_size, heads, head_dim]: the two halves of one tensor per layer."""
    import torch

    pool = _mha(size=64, page_size=4)
    assert len(pool.k_buffer) == len(pool.v_buffer) == LAYERS
    for k, v in zip(pool.k_buffer, pool.v_buffer):
        assert k.shape == v.shape == (64 + 4, HEADS, HEAD_DIM)
        assert k.dtype == v.dtype == torch.float16 and k.device.type == "cpu"
        # One (2, rows, H, D) allocation per layer: V starts one padded half after K.
        assert k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
        assert v.data_ptr() - k.data_ptr() == 68 * HEADS * HEAD_DIM * 2
    assert pool.get_kv_size_bytes() == (LAYERS * 68 * HEADS * HEAD_DIM * 2, LAYERS * 68 * HEADS * HEAD_DIM * 2)


def test_mha_pool_writes_and_reads_back_by_slot() -> None:
    """set_kv_buffer scatters a token's K and V into its slots; get_key_buffer/get_value_buffer read the same memory."""
    import torch

    pool = _mha()
    loc = torch.tensor([5, 9], dtype=torch.int64)
    k = torch.randn(2, HEADS, HEAD_DIM, dtype=torch.float16)
    v = torch.randn(2, HEADS, HEAD_DIM, dtype=torch.float16)
    pool.set_kv_buffer(None, loc, k, v, layer_id_override=1)
    assert torch.equal(pool.get_key_buffer(1)[loc], k) and torch.equal(pool.get_value_buffer(1)[loc], v)
    assert not pool.get_key_buffer(0).any() and not pool.get_key_buffer(2).any()


def test_mla_pool_has_one_latent_buffer_per_layer() -> None:
    """MLA keeps one kv_buffer per layer, [size + page_size, 1, kv_lora_rank + qk_rope_head_dim]."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    pool = MLATokenToKVPool(size=32, page_size=1, dtype=torch.bfloat16, kv_lora_rank=16, qk_rope_head_dim=4,
                            layer_num=LAYERS, device="cpu", enable_memory_saver=False)
    assert [tuple(b.shape) for b in pool.kv_buffer] == [(33, 1, 20)] * LAYERS
    assert pool.kv_buffer[0].dtype == torch.bfloat16


def test_token_allocator_hands_out_slots_from_one_and_takes_them_back() -> None:
    """Slot 0 is never handed out (padding writes land there); alloc past the free count returns None, not an error."""
    import torch
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator

    pool = _mha(size=16)
    alloc = TokenToKVPoolAllocator(16, dtype=torch.float16, device="cpu", kvcache=pool, need_sort=True)
    assert alloc.available_size() == 16 and alloc.page_size == 1 and alloc.get_kvcache() is pool
    got = alloc.alloc(10)
    assert got.tolist() == list(range(1, 11)) and alloc.available_size() == 6
    assert alloc.alloc(7) is None and alloc.available_size() == 6
    alloc.free(got[:4])
    # need_sort: freed slots wait in release_pages until a shortfall merges and sorts them back.
    assert alloc.available_size() == 10 and len(alloc.release_pages) == 4
    again = alloc.alloc(8)
    assert sorted(again.tolist()) == [1, 2, 3, 4, 11, 12, 13, 14]


def test_paged_allocator_hands_out_whole_pages_with_the_native_kernels() -> None:
    """On the CPU the paged allocator runs its torch-native extend/decode paths; every page it hands out is whole."""
    import torch
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

    pool = _mha(size=32, page_size=4)
    alloc = PagedTokenToKVPoolAllocator(32, page_size=4, dtype=torch.float16, device="cpu", kvcache=pool,
                                        need_sort=False)
    assert alloc.use_triton_kernels is False and alloc.num_pages == 8 and alloc.available_size() == 32
    got = alloc.alloc(8)
    assert got.tolist() == list(range(4, 12))  # page 0 is the padding page
    # Two requests extend from nothing: 6 and 3 tokens take 2 + 1 new pages.
    seq = torch.tensor([6, 3])
    out = alloc.alloc_extend(torch.tensor([0, 0]), torch.tensor([0, 0]), seq, seq, torch.tensor([-1, -1]), 9)
    assert alloc.available_size() == 32 - 8 - 12
    pages = {i // 4 for i in out.tolist()}
    assert len(pages) == 3 and not pages & {1, 2}
    # A decode step: request 0 at length 7 stays in its page, request 1 at length 5 opens a new one.
    last = torch.tensor([out[5].item(), out[8].item()])
    dec = alloc.alloc_decode(torch.tensor([7, 5]), torch.tensor([7, 5]), last)
    assert dec[0].item() == last[0].item() + 1 and dec[1].item() % 4 == 0
    assert alloc.available_size() == 32 - 8 - 12 - 4
    alloc.free(torch.cat((got, out, dec)))
    assert alloc.available_size() == 32


def test_radix_cache_keeps_available_plus_evictable_plus_protected_equal_to_total() -> None:
    """The scheduler's idle invariant on the real RadixCache and allocator: insert, lock, unlock, evict."""
    import torch
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    total = 32
    alloc = TokenToKVPoolAllocator(total, dtype=torch.float16, device="cpu", kvcache=_mha(size=total), need_sort=False)
    cache = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
                                       page_size=1))

    def accounted() -> int:
        return alloc.available_size() + cache.evictable_size() + cache.protected_size()

    tokens = [7, 8, 9, 10, 11, 12]
    slots = alloc.alloc(len(tokens))
    assert accounted() == total - len(tokens)  # held by a running request: neither free nor cached
    cache.insert(InsertParams(key=RadixKey(tokens), value=slots))
    assert cache.evictable_size() == 6 and accounted() == total
    hit = cache.match_prefix(MatchPrefixParams(key=RadixKey([7, 8, 9, 99])))
    assert hit.device_prefix_len == 3
    cache.inc_lock_ref(hit.last_device_node)
    assert cache.protected_size() == 3 and cache.evictable_size() == 3 and accounted() == total
    # Eviction takes only unlocked leaves and gives their slots back to the allocator.
    assert cache.evict(EvictParams(num_tokens=6)).num_tokens_evicted == 3
    assert alloc.available_size() == total - 3 and accounted() == total
    cache.dec_lock_ref(hit.last_device_node)
    assert cache.evict(EvictParams(num_tokens=6)).num_tokens_evicted == 3
    assert alloc.available_size() == total and cache.evictable_size() == cache.protected_size() == 0
