"""Elastic KV inside SGLang 0.5.23: token allocator cost, and mapped memory on a bursty trace, side by side.

    python bench/bench_sglang.py [--rounds 15] [--steps 1500]

1. SGLang's TokenToKVPoolAllocator (page size 1, SGLang's default) against
   kvcached's ElasticTokenAllocator, each over its own pool, on the same
   stationary load driven as SGLang's scheduler drives it: every running
   request gets one slot per decode step (one alloc for the batch), the oldest
   finishes (its slots freed in one call) and a new one arrives (its prompt's
   slots in one alloc); the elastic allocator's step boundary (limit read
   from a real segment, page judgement, publish) runs before each step and is
   counted in. Only the allocator's calls are timed (perf_counter_ns around
   each); the bookkeeping around them is the same for both. Steady state: the
   working set is mapped before timing; whatever map/unmap the load's swings
   still cause is counted. In each round the two are driven in lockstep, one
   step of each in turn (a noisy moment of a shared machine falls on both),
   and the median of the per-round ratios is the figure (best-to-best beside
   it). Target: <= 1.3x per token allocated + freed.
2. The elastic pool, allocator and SGLang's real RadixCache driven by the
   tests' model-less scheduler loop (tests/sglang/elastic_support.py) on
   bursts of requests with idle gaps: the peak memory mapped against the peak
   KV in use (slots held by requests: SGLang's total minus available), and
   against SGLang's full preallocation. The radix cache is disabled
   (--disable-radix-cache): with it on, finished prompts stay cached until the
   pool is full, and what is "in use" then grows to the whole pool, mapped
   alike. Target: peak mapped <= 1.2x peak in use.

Geometry: 4 layers of 8 KV heads x 64 x fp16 (1 KiB per token for K and for V
per layer), 2 MiB pages, so 2,048 tokens per group; 65,536 tokens per pool.
Release delay and reserve are kvcached's defaults.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # tests.sglang.elastic_support: the model-less SGLang driver the tests use

os.environ.setdefault("KVCACHED_PAGE_SIZE", str(2 << 20))
SIZE, LAYERS, HEADS, HEAD_DIM = 65536, 4, 8, 64
TOKEN_BYTES = 2 * LAYERS * HEADS * HEAD_DIM * 2


def _pool(elastic: bool, size: int = SIZE) -> Any:
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from kvcached.integration.sglang.elastic_buffers import ElasticMHATokenToKVPool

    cls = ElasticMHATokenToKVPool if elastic else MHATokenToKVPool
    return cls(size=size, page_size=1, dtype=torch.float16, head_num=HEADS, head_dim=HEAD_DIM, layer_num=LAYERS,
               device="cpu", enable_memory_saver=False, enable_alt_stream=False)


def _allocator(elastic: bool, seg: str | None, size: int = SIZE) -> tuple[Any, Any]:
    import torch
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator

    from kvcached.integration.sglang.elastic_alloc import ElasticTokenAllocator
    from kvcached.integration.sglang.elastic_ranks import limit_source

    pool = _pool(elastic, size)
    cls = ElasticTokenAllocator if elastic else TokenToKVPoolAllocator
    alloc = cls(size, dtype=torch.float16, device="cpu", kvcache=pool, need_sort=False)
    if elastic:
        alloc.attach(None, limit_source(seg))
    return pool, alloc


def _script(steps: int, live: int = 48, seed: int = 1) -> list[int]:
    """Prompt lengths: one per request, `live` running at the start, then one arriving per step."""
    rnd = random.Random(seed)
    return [rnd.randint(64, 640) for _ in range(live + steps)]


def _steps(alloc: Any, prompts: list[int], steps: int, live: int = 48) -> Iterator[tuple[int, int, int]]:
    """The load, one scheduler step per item: (ns in the allocator's calls, tokens allocated + freed, free-list
    length before the free); the first item is the prompts of the requests running at the start, the last frees
    every slot (neither timed)."""
    import torch

    clock = time.perf_counter_ns
    boundary = getattr(alloc, "step", None)
    running: list[list[Any]] = [[alloc.alloc(n)] for n in prompts[:live]]
    yield 0, 0, 0
    for s in range(steps):
        spent = 0
        if boundary is not None:
            t0 = clock()
            boundary()
            spent += clock() - t0
        t0 = clock()
        out = alloc.alloc(len(running))
        spent += clock() - t0
        for i, parts in enumerate(running):
            parts.append(out[i:i + 1])
        moved = len(running)
        slots = torch.cat(running.pop(0))
        free_len = len(alloc.free_pages)
        t0 = clock()
        alloc.free(slots)
        spent += clock() - t0
        moved += len(slots)
        n = prompts[live + s]
        t0 = clock()
        out = alloc.alloc(n)
        spent += clock() - t0
        running.append([out])
        yield spent, moved + n, free_len
    for parts in running:
        alloc.free(torch.cat(parts))


def _lockstep(allocs: dict[str, Any], prompts: list[int], steps: int) -> dict[str, tuple[float, int, int]]:
    """One round: the allocators driven by the same load in lockstep, one step of each in turn, so that a noisy
    moment of the machine falls on all of them alike. Per allocator: (ns per token, mean free-list length, tokens
    allocated + freed)."""
    runs = {name: _steps(a, prompts, steps) for name, a in allocs.items()}
    spent = dict.fromkeys(runs, 0)
    moved = dict.fromkeys(runs, 0)
    free_len = dict.fromkeys(runs, 0)
    for _ in range(steps + 1):
        for name, it in runs.items():
            ns, n, length = next(it)
            spent[name] += ns
            moved[name] += n
            free_len[name] += length
    for it in runs.values():
        for _ in it:  # the last item frees every slot
            pass
    return {name: (spent[name] / moved[name], free_len[name] // steps, moved[name]) for name in runs}


def bench_alloc(rounds: int, steps: int) -> float:
    from kvcached.node.state.segment import create_segment

    prompts = _script(steps)
    with tempfile.TemporaryDirectory() as tmp:
        seg = os.path.join(tmp, "seg")
        create_segment(seg, 1 << 40)
        pool, elastic = _allocator(True, seg)
        _lockstep({"elastic": elastic}, prompts, steps)  # warm: the working set gets mapped here
        # SGLang's allocator twice: over the same pool size, and over a pool of exactly what kvcached mapped (the
        # same free-list length: what the elastic machinery adds, and nothing else).
        fitted = len(pool.elastic.mapped_groups()) * elastic.ids_per_group
        same, fitted_alloc = _allocator(False, None)[1], _allocator(False, None, fitted)[1]
        pair = {"fitted": fitted_alloc, "elastic": elastic}
        _lockstep(pair, prompts, steps)
        _lockstep({"same": same}, prompts, steps)
        times: dict[str, list[float]] = {"same": [], "fitted": [], "elastic": []}
        lens: dict[str, int] = {}
        moved = 0
        for _ in range(rounds):
            # SGLang over the whole pool on its own: its free() concatenates 47,000 ids a step, and driven in the
            # same lockstep it would take the caches from the pair the target is judged on.
            got = _lockstep(pair, prompts, steps) | _lockstep({"same": same}, prompts, steps)
            for name, (per_token, length, _) in got.items():
                times[name].append(per_token)
                lens[name] = length
            moved = got["elastic"][2]
        groups = len(pool.elastic.mapped_groups())
        elastic.agreement.source.close()
    e = times["elastic"]
    ratio = {k: statistics.median(b / a for a, b in zip(times[k], e)) for k in ("same", "fitted")}
    print(f"token allocator, stationary load: 48 requests decoding, one finishing and one arriving per step, "
          f"{steps} steps ({moved / steps:.0f} tokens allocated + freed per step), {rounds} rounds, wall clock "
          f"in the allocator's calls")
    for k, label in (("same", f"SGLang, pool of {SIZE} tokens"), ("fitted", f"SGLang, pool of {fitted} tokens")):
        t = times[k]
        print(f"  {label:34s}  {min(t):8.1f} ns/token best, {statistics.median(t):.1f} median "
              f"(free list {lens[k]} ids on average)")
    label = f"kvcached elastic, pool of {SIZE} tokens"
    print(f"  {label:34s}  {min(e):8.1f} ns/token best, {statistics.median(e):.1f} "
          f"median (free list {lens['elastic']} ids; step boundary included; {groups} groups mapped)")
    print("  free() concatenates the free list: SGLang's holds every free slot of the pool, the elastic one only "
          "those of mapped groups")
    print(f"  ratio elastic / SGLang: {ratio['same']:.2f}x against the same pool, {ratio['fitted']:.2f}x against "
          f"a pool of what kvcached maps (median of paired rounds; "
          f"{'within' if ratio['fitted'] <= 1.3 else 'OVER'} the 1.3x target, judged on the latter)")
    return ratio["fitted"]


def bench_trace(seed: int = 3) -> float:
    from kvcached.node.state.segment import create_segment
    from tests.sglang import elastic_support as es

    rnd = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        seg = os.path.join(tmp, "seg")
        create_segment(seg, 1 << 40)
        pool, alloc = _allocator(True, seg)
        driver = es.Driver(alloc, es.radix_cache(alloc, disable=True))
        full = LAYERS * 2 * (SIZE + 1) * HEADS * HEAD_DIM * 2  # what SGLang's own pool allocates
        peak = {"used": 0, "mapped": 0}
        sums = {"used": 0, "mapped": 0, "n": 0}

        def sample(d: Any) -> None:
            used = (SIZE - alloc.available_size()) * TOKEN_BYTES
            mapped = pool.elastic.mapped_bytes
            peak["used"], peak["mapped"] = max(peak["used"], used), max(peak["mapped"], mapped)

        def each(d: Any) -> None:
            sample(d)
            sums["used"] += (SIZE - alloc.available_size()) * TOKEN_BYTES
            sums["mapped"] += pool.elastic.mapped_bytes
            sums["n"] += 1

        driver.on_alloc, driver.each = sample, each
        rid = 0
        for _ in range(6):
            reqs = es.burst(rnd, rid, rnd.randint(8, 40), (64, 900), (16, 200))
            rid += len(reqs)
            driver.add(reqs)
            driver.run(max_steps=5000)
            for _ in range(rnd.randint(20, 60)):  # an idle gap
                driver.step()
        steps = driver.steps
        alloc.agreement.source.close()
    ratio = peak["mapped"] / peak["used"]
    mib = 1 << 20
    print(f"bursty trace: 6 bursts of 8-40 requests (64-900 prompt, 16-200 output tokens), idle gaps, radix cache "
          f"off; {steps} steps, {alloc.ids_per_group} tokens per group")
    print(f"  peak KV in use (requests' slots)    {peak['used'] / mib:8.1f} MiB")
    print(f"  peak mapped, kvcached               {peak['mapped'] / mib:8.1f} MiB  ({ratio:.2f}x the peak in use; "
          f"{'within' if ratio <= 1.2 else 'OVER'} the 1.2x target)")
    print(f"  SGLang's full preallocation         {full / mib:8.1f} MiB  ({full / peak['used']:.2f}x the peak in use)")
    print(f"  mean over steps: in use {sums['used'] / sums['n'] / mib:.1f} MiB, "
          f"mapped {sums['mapped'] / sums['n'] / mib:.1f} MiB")
    return ratio


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=1500)
    args = ap.parse_args(argv)
    import importlib.util
    import logging

    if importlib.util.find_spec("sglang") is None:
        print("SGLang 0.5.23 is not installed in this venv (scripts/install-sglang.sh): nothing measured")
        return 1
    logging.disable(logging.WARNING)  # SGLang's import chatter; the figures are printed below
    bench_alloc(args.rounds, args.steps)
    bench_trace()
    return 0


if __name__ == "__main__":
    sys.exit(main())
