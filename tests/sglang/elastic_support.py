"""Driving SGLang 0.5.23's real KV pools, token allocators and RadixCache the way its scheduler does, on the CPU.

No model and no Scheduler (it needs one): a `Driver` plays the scheduler's
part of the loop over the real classes. Each step is SGLang's event-loop
iteration: the step boundary (`_ElasticIds.step`, what the patch runs before
`Scheduler.get_next_batch_to_run`), admission through the allocator's prefill
budget, a decode allocation for every running request after
`check_decode_capacity` (retracting the newest requests while it says no, as
`ScheduleBatch.retract_decode` does), then the frees of the requests that
finished (`process_batch_result`). With the radix cache on, a request first
matches and locks its cached prefix, and on finishing inserts its tokens and
frees the duplicates, as `RadixCache.cache_finished_req` does.

SGLang's stock classes go through the same driver (the `elastic` False
cases), so every claim about elastic memory is shown to fail without kvcached.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch

from tests.engines_common import PAGE, check_or_fail  # noqa: F401 - the elastic tests take both from here

LAYERS, HEADS, HEAD_DIM = 3, 8, 64  # fp16: 1 KiB per token per K (and per V) per layer
TOKEN_BYTES = 2 * LAYERS * HEADS * HEAD_DIM * 2  # K and V of every layer, one token
GROUP_TOKENS = PAGE // (HEADS * HEAD_DIM * 2)  # tokens whose K of one layer fill a page: 64
GROUP_BYTES = GROUP_TOKENS * TOKEN_BYTES  # what one group costs: a page per layer for K and for V


def mha_pool(elastic: bool, size: int, page_size: int = 1, **kw: Any) -> Any:
    """The elastic MHA pool, or SGLang's own."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from kvcached.integration.sglang.elastic_buffers import ElasticMHATokenToKVPool

    cls = ElasticMHATokenToKVPool if elastic else MHATokenToKVPool
    return cls(size=size, page_size=page_size, dtype=torch.float16, head_num=HEADS, head_dim=HEAD_DIM,
               layer_num=LAYERS, device="cpu", enable_memory_saver=False, enable_alt_stream=False, **kw)


def allocator(pool: Any, elastic: bool, size: int, page_size: int = 1) -> Any:
    """The elastic allocator over `pool`, or SGLang's own, built with the configurator's arguments."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator

    from kvcached.integration.sglang.elastic_alloc import ElasticPagedAllocator, ElasticTokenAllocator

    if page_size == 1:
        cls = ElasticTokenAllocator if elastic else TokenToKVPoolAllocator
        return cls(size, dtype=torch.float16, device="cpu", kvcache=pool, need_sort=False)
    cls = ElasticPagedAllocator if elastic else PagedTokenToKVPoolAllocator
    return cls(size, page_size=page_size, dtype=torch.float16, device="cpu", kvcache=pool, need_sort=False)


def radix_cache(alloc: Any, page_size: int = 1, disable: bool = False) -> Any:
    """SGLang's RadixCache over `alloc` (disabled: SGLang's --disable-radix-cache, nothing is kept)."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache

    return RadixCache(CacheInitParams(disable=disable, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
                                      page_size=page_size))


def mapped_bytes(pool: Any) -> int:
    """Memory the pool's KV buffers hold now: the extension's mapped pages, or SGLang's whole allocation."""
    buf = getattr(pool, "elastic", None)
    if buf is not None:
        return int(buf.mapped_bytes)
    return sum(t.untyped_storage().nbytes() for t in {id(t.untyped_storage()): t for t in pool.k_buffer}.values())


@dataclass
class Req:
    rid: int
    tokens: list[int]  # prompt, then generated
    prompt: int
    gen: int
    slots: list[Any] = field(default_factory=list)  # tensors of token slots this request owns
    prefix: Any = None  # slots of its cached prefix (radix cache)
    node: Any = None  # the locked tree node of that prefix
    done: int = 0  # tokens generated

    @property
    def own(self) -> int:
        return sum(len(s) for s in self.slots)

    def all_slots(self) -> Any:
        parts = ([self.prefix] if self.prefix is not None else []) + self.slots
        return torch.cat(parts) if parts else torch.empty((0,), dtype=torch.int64)


@dataclass
class Driver:
    """SGLang's scheduler loop over a real allocator and RadixCache, without a model."""

    alloc: Any
    cache: Any
    page_size: int = 1
    waiting: list[Req] = field(default_factory=list)
    running: list[Req] = field(default_factory=list)
    steps: int = 0
    retracted: int = 0
    aborted: int = 0  # requests that could not fit even alone (SGLang aborts them)
    refused: int = 0  # allocations that returned None (the scheduler had been told there was room: a bug)
    each: Any = None  # called after every step
    on_alloc: Any = None  # called after every allocation
    after_boundary: Any = None  # called right after the step boundary

    def add(self, reqs: list[Req]) -> None:
        self.waiting.extend(reqs)

    def idle(self) -> bool:
        return not self.waiting and not self.running

    def uncached(self) -> int:
        """Tokens running requests hold outside the tree: SGLang's `uncached` term."""
        return sum(r.own for r in self.running)

    def step(self) -> None:
        """One event-loop iteration."""
        if hasattr(self.alloc, "step"):
            self.alloc.step(self.idle, self.cache)
        if self.after_boundary is not None:
            self.after_boundary(self)
        self._admit()
        self._decode()
        for r in [r for r in self.running if r.done >= r.gen]:
            self._finish(r)
        self.steps += 1
        if self.each is not None:
            self.each(self)

    def run(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if self.idle():
                return
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps")

    def _got(self, out: Any) -> Any:
        if out is None:
            self.refused += 1
        elif self.on_alloc is not None:
            self.on_alloc(self)
        return out

    def _admit(self) -> None:
        budget = self.alloc.create_prefill_budget(self.cache)
        ps = self.page_size
        while self.waiting:
            r = self.waiting[0]
            self._match(r)
            need = len(r.tokens) - (0 if r.prefix is None else len(r.prefix))
            ok, _ = budget.check_prefill(extend_input_len=need, total_tokens=need + ps, max_new_tokens=0,
                                         input_tokens=len(r.tokens), swa_host_hit_length=0, chunk_limit=None)
            if not ok or need <= 0:
                self._unmatch(r)
                return
            self.alloc.evict_to_free_tokens(self.cache, -(-need // ps) * ps + ps)
            out = self._got(self._alloc_extend(r, need))
            if out is None:
                self._unmatch(r)
                return
            budget.reserve(need, 0)
            r.slots.append(out)
            self.running.append(self.waiting.pop(0))

    def _alloc_extend(self, r: Req, need: int) -> Any:
        if self.page_size == 1:
            return self.alloc.alloc(need)
        pre = 0 if r.prefix is None else len(r.prefix)
        last = int(r.prefix[-1]) if pre else -1
        t = torch.tensor
        return self.alloc.alloc_extend(t([pre]), t([pre]), t([pre + need]), t([pre + need]), t([last]), need)

    def _decode(self) -> None:
        while self.running:
            need = self._decode_need()
            if self.alloc.check_decode_capacity(num_tokens=need, tree_cache=self.cache):
                break
            if len(self.running) == 1:
                # Alone and still short: SGLang aborts it ("Out of memory even after retracting ...").
                self._retract(self.running[-1])
                self.waiting.pop(0)
                self.aborted += 1
                return
            self._retract(self.running[-1])
        if not self.running:
            return
        lens = [len(r.all_slots()) for r in self.running]
        if self.page_size == 1:
            out = self._got(self.alloc.alloc(len(self.running)))
        else:
            seq = torch.tensor([n + 1 for n in lens])
            last = torch.tensor([int(r.all_slots()[-1]) for r in self.running])
            out = self._got(self.alloc.alloc_decode(seq, seq, last))
        if out is None:
            return
        for i, r in enumerate(self.running):
            r.slots.append(out[i:i + 1])
            r.tokens.append(100000 + r.rid * 1000 + r.done)
            r.done += 1

    def _decode_need(self) -> int:
        if self.page_size == 1:
            return len(self.running)
        return sum(self.page_size for r in self.running if len(r.all_slots()) % self.page_size == 0)

    def _retract(self, r: Req) -> None:
        self.running.remove(r)
        if r.slots:
            self.alloc.free(torch.cat(r.slots))
        r.slots, r.done = [], 0
        del r.tokens[r.prompt:]
        self._unmatch(r)
        self.waiting.insert(0, r)
        self.retracted += 1

    def _match(self, r: Req) -> None:
        if self.cache is None or self.cache.disable or r.prefix is not None:
            return
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        hit = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(r.tokens[:-1])))
        if hit.device_prefix_len > 0:
            r.node = hit.last_device_node
            self.cache.inc_lock_ref(r.node)
            r.prefix = self.cache.path_device_indices(r.node)

    def _unmatch(self, r: Req) -> None:
        if r.node is not None:
            self.cache.dec_lock_ref(r.node)
        r.node = r.prefix = None

    def _finish(self, r: Req) -> None:
        self.running.remove(r)
        slots = r.all_slots()
        if self.cache is None or self.cache.disable:
            self.alloc.free(slots)
        else:
            from sglang.srt.mem_cache.base_prefix_cache import InsertParams
            from sglang.srt.mem_cache.radix_cache import RadixKey

            kept = len(r.tokens) - 1  # the last token's KV is never written (no step after it)
            pre = 0 if r.prefix is None else len(r.prefix)
            got = self.cache.insert(InsertParams(key=RadixKey(r.tokens[:kept]), value=slots[:kept]))
            self.alloc.free(slots[pre:got.prefix_len])  # already in the tree: ours are duplicates
            self.alloc.free(slots[kept:])
            if r.node is not None:
                self.cache.dec_lock_ref(r.node)
        r.slots, r.prefix, r.node = [], None, None


def burst(rnd: random.Random, first_rid: int, n: int, prompt: tuple[int, int], gen: tuple[int, int],
          shared: list[int] | None = None) -> list[Req]:
    """`n` requests with random prompt and output lengths (prompts start with `shared`, when given)."""
    out = []
    for i in range(n):
        rid = first_rid + i
        p = rnd.randint(*prompt)
        head = list(shared or [])
        tokens = head + [rid * 10000 + j for j in range(max(1, p - len(head)))]
        out.append(Req(rid, tokens, len(tokens), rnd.randint(*gen)))
    return out


def live_groups(driver: Driver, ids_per_group: int, page_size: int = 1) -> set[int]:
    """Groups holding a token a running request or the radix cache holds, and group 0 (the padding slot)."""
    held = {0}
    for r in driver.running:
        s = r.all_slots()
        if len(s):
            held |= set((s // page_size // ids_per_group).tolist())
    cache = driver.cache
    if cache is not None and not cache.disable:
        vals = cache.all_values_flatten()
        if len(vals):
            held |= set((vals // page_size // ids_per_group).tolist())
    return held
