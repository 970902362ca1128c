"""SGLang 0.5.23's token allocators, elastic, driven with its real RadixCache the way its scheduler drives them.

Pages are the extension's real memfd pages, "mapped memory" is the
extension's own count, and the limit is a real segment on a private node
root, lowered with the real `kvctl limit`. Each claim about memory runs with
SGLang's own pool and allocator too, where it must fail.

Geometry: 3 layers, 8 KV heads x 64 x fp16 (1 KiB per token for K, and for V,
per layer), 64 KiB pages: 64 tokens make a group, which costs 6 pages (K and
V of every layer), 384 KiB per rank.
"""

from __future__ import annotations

import json
import random
import subprocess

import pytest

pytest.importorskip("kvcached.runtime._kvpages", reason="kvcached.runtime._kvpages is not built (pip install -e .)")
pytestmark = [pytest.mark.sglang, pytest.mark.ext, pytest.mark.usefixtures("sgl", "elastic_env")]

from ..conftest import KVCTL  # noqa: E402
from . import elastic_support as es  # noqa: E402

SIZE = 4096  # tokens: 64 groups
both = pytest.mark.parametrize("elastic", [True, False], ids=["elastic", "sglang"])
pages = pytest.mark.parametrize("page_size", [1, 16], ids=["token", "paged"])


@pytest.fixture
def segment(layout, elastic_env):
    """The deployment's segment, claimed as TP rank 0's scheduler claims it; (path, set_limit)."""
    from kvcached.node.in_engine.startup import claim_segment

    leases = []

    def claim(limit: int):
        lease, _, _ = claim_segment(layout, elastic_env, limit)
        leases.append(lease)
        return layout.segment_path(elastic_env)

    yield claim
    for lease in leases:
        lease.release()


def kvctl_limit(layout, name: str, size: int) -> None:
    """`kvctl limit NAME SIZE` from another process, as an operator runs it."""
    r = subprocess.run([KVCTL, "--root", layout.root, "limit", name, str(size), "--json"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr + r.stdout


def build(elastic: bool, page_size: int = 1, radix: bool = False, size: int = SIZE):
    pool = es.mha_pool(elastic, size, page_size)
    alloc = es.allocator(pool, elastic, size, page_size)
    cache = es.radix_cache(alloc, page_size, disable=not radix)
    return pool, alloc, es.Driver(alloc, cache, page_size)


def bursts(driver: es.Driver, seed: int, n: int = 3, gap: int = 12, **kw) -> None:
    """Bursts of requests, each run to the end, with idle steps between them."""
    rnd = random.Random(seed)
    rid = 0
    for _ in range(n):
        reqs = es.burst(rnd, rid, rnd.randint(6, 12), kw.get("prompt", (60, 300)), kw.get("gen", (10, 60)),
                        kw.get("shared"))
        rid += len(reqs)
        driver.add(reqs)
        driver.run()
        for _ in range(gap):
            driver.step()


@both
@pages
def test_mapped_memory_follows_the_tokens_in_use_on_a_bursty_trace(elastic: bool, page_size: int) -> None:
    pool, alloc, d = build(elastic, page_size)
    ids = es.GROUP_TOKENS // page_size
    seen: list[tuple[int, int]] = []

    def at_boundary(d: es.Driver) -> None:
        live = es.live_groups(d, ids, page_size)
        seen.append((len(live), es.mapped_bytes(pool)))
        if elastic:
            mapped = set(pool.elastic.mapped_groups())
            assert live <= mapped, f"step {d.steps}: groups {live - mapped} hold tokens but are not mapped"

    d.after_boundary = at_boundary
    bursts(d, seed=7)
    assert d.refused == 0, "an allocation failed after the allocator's capacity hooks said it fits"

    def follows() -> None:
        for step, (live, mapped) in enumerate(seen):
            # No release delay, no reserve: right after the boundary only the groups in use stay mapped.
            assert mapped == live * es.GROUP_BYTES, f"step {step}: {mapped} bytes mapped for {live} groups in use"
        assert max(live for live, _ in seen) > 8 and seen[-1] == (1, es.GROUP_BYTES)

    es.check_or_fail(elastic, follows)


@both
@pages
def test_the_limit_is_never_exceeded(segment, elastic: bool, page_size: int) -> None:
    limit = 10 * es.GROUP_BYTES
    segment(limit)
    pool, alloc, d = build(elastic, page_size)
    peak = [0]

    def each(d: es.Driver) -> None:  # after every allocation and every step
        peak[0] = max(peak[0], es.mapped_bytes(pool))

    d.each = d.on_alloc = each
    # Far more than 10 groups' worth at once: the scheduler waits and retracts, as in front of a full pool.
    rnd = random.Random(3)
    d.add(es.burst(rnd, 0, 30, (100, 400), (20, 80)))
    d.run(max_steps=5000)
    assert d.refused == 0 and d.retracted > 0
    es.check_or_fail(elastic, lambda: _at_most(peak[0], limit))


def _at_most(got: int, limit: int) -> None:
    assert got <= limit, f"{got} bytes mapped, over the limit of {limit}"


@both
def test_lowering_the_limit_mid_run_shrinks_the_mapping_and_the_allocator_reports_no_room(
        layout, elastic_env, segment, elastic: bool) -> None:
    segment(64 * es.GROUP_BYTES)
    pool, alloc, d = build(elastic, radix=True)
    rnd = random.Random(11)
    d.add(es.burst(rnd, 0, 12, (150, 250), (150, 200), shared=list(range(50))))
    for _ in range(30):
        d.step()
    assert es.mapped_bytes(pool) > 16 * es.GROUP_BYTES and d.running
    low = 8 * es.GROUP_BYTES
    kvctl_limit(layout, elastic_env, low)
    d.step()
    if elastic:
        st = alloc.stats()
        assert st.max_groups == 8 and st.draining, st
        room = alloc.schedulable_size()
        assert room <= 8 * es.GROUP_TOKENS, f"{room} tokens of room under a limit of 8 groups"
        # Past the room, SGLang's answer when full: None, no error, nothing changed.
        before = (alloc.available_size(), pool.elastic.mapped_groups())
        assert alloc.alloc(room + 1) is None
        assert (alloc.available_size(), pool.elastic.mapped_groups()) == before
        assert not alloc.check_decode_capacity(num_tokens=room + 1, tree_cache=d.cache)
    after: list[int] = []
    d.after_boundary = lambda d: after.append(es.mapped_bytes(pool))
    d.run(max_steps=5000)
    assert d.refused == 0 and d.aborted == 0

    def shrinks() -> None:
        assert after[-1] <= low, f"{after[-1]} bytes still mapped under a limit of {low}"
        over = [i for i, m in enumerate(after) if m > low]
        # Once under the limit, the mapping stays there.
        assert not over or all(m <= low for m in after[over[-1] + 1:])

    es.check_or_fail(elastic, shrinks)


@both
def test_the_accounting_identity_holds_after_every_step(layout, elastic_env, segment, elastic: bool) -> None:
    """available + evictable + protected + session_held + uncached = total, checked by SGLang's own checker.

    The real `SchedulerInvariantChecker._check_pool_invariant`, fed what the
    scheduler feeds it for a plain pool (pool_stats_observer: the allocator's
    available_size(), the tree's evictable size; the tree's protected size;
    the requests' private tokens as uncached; no sessions), after every step:
    with the radix cache sharing prefixes, evicting, and the limit lowered
    mid-run (groups drained, parked slots counted as available).
    """
    from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker

    segment(64 * es.GROUP_BYTES)
    pool, alloc, d = build(elastic, radix=True)
    checks = [0]

    def identity(d: es.Driver) -> None:
        leak, msg = SchedulerInvariantChecker._check_pool_invariant(
            "full", alloc.available_size(), d.cache.evictable_size(), d.cache.protected_size(), 0, SIZE,
            d.uncached())
        assert not leak, f"step {d.steps}: {msg}"
        checks[0] += 1

    d.each = d.after_boundary = identity
    rnd = random.Random(5)
    shared = list(range(120))
    d.add(es.burst(rnd, 0, 10, (150, 300), (20, 100), shared=shared))
    for _ in range(25):
        d.step()
    kvctl_limit(layout, elastic_env, 10 * es.GROUP_BYTES)  # a request needs at most 400 of its 640 tokens
    d.add(es.burst(rnd, 100, 10, (150, 300), (20, 100), shared=shared))
    d.run(max_steps=5000)
    for _ in range(5):
        d.step()
    assert d.refused == 0 and checks[0] > 100 and d.cache.evictable_size() > 0
    if elastic:
        assert es.mapped_bytes(pool) <= 10 * es.GROUP_BYTES


def test_usage_is_published_to_the_segment(segment) -> None:
    from kvcached.node.state.segment import read_segment

    path = segment(64 * es.GROUP_BYTES)
    pool, alloc, d = build(True)
    d.add(es.burst(random.Random(2), 0, 8, (100, 200), (10, 20)))
    d.step()
    info = read_segment(path)
    assert info.used + info.prealloc == len(pool.elastic.mapped_groups()) * es.GROUP_BYTES and info.used > 0
    d.run()
    d.step()
    info = read_segment(path)
    assert (info.used, info.prealloc) == (es.GROUP_BYTES, 0)  # group 0 (the padding slot) alone


def test_a_claimed_segment_is_read_through_the_engine_state(layout, elastic_env) -> None:
    """The serve side claims the segment on TP rank 0; the allocator finds it there and takes over the usage."""
    from kvcached.integration import engine_claim
    from kvcached.integration.limits import Limit
    from kvcached.node.state.segment import read_segment

    engine = engine_claim.EngineState(layout, elastic_env + "-claimed")  # not the name the environment gives
    assert engine.claim(Limit(8 * es.GROUP_BYTES, "test")) is not None
    engine_claim.register(engine)
    try:
        pool, alloc, d = build(True)
        d.add(es.burst(random.Random(4), 0, 6, (200, 300), (10, 20)))
        d.step()
        assert alloc.agreement.source.path == engine.segment.path and alloc.stats().max_groups == 8
        assert engine._deferred and read_segment(engine.segment.path).used > 0
        d.run()
    finally:
        engine.release()


def test_free_groups_stay_mapped_while_busy_and_go_when_idle(monkeypatch) -> None:
    """The reserve and the release delay: a swing of a few groups is not unmapped and mapped again every step."""
    monkeypatch.setenv("KVCACHED_ELASTIC_RESERVE_PAGES", "2")
    monkeypatch.setenv("KVCACHED_ELASTIC_RELEASE_DELAY_S", "3600")
    pool, alloc, d = build(True)
    g = es.GROUP_TOKENS
    slots = alloc.alloc(10 * g)
    alloc.step(lambda: False)
    alloc.free(slots[:8 * g])
    alloc.step(lambda: False)
    alloc.step(lambda: False)
    assert len(pool.elastic.mapped_groups()) == 11  # nothing due while busy: the delay has not passed
    alloc.step(lambda: True)
    # Idle: every free group goes but the lowest two (the reserve); groups 9 and 10 still hold tokens.
    free_groups = set(range(11)) - {0, 8, 9, 10}
    assert set(pool.elastic.mapped_groups()) == {0, 8, 9, 10} | set(sorted(free_groups)[:2])


def test_an_allocator_for_a_pool_that_is_not_elastic_is_sglangs_own() -> None:
    import torch
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator

    from kvcached.integration.sglang.elastic_alloc import ElasticPagedAllocator, ElasticTokenAllocator

    stock = es.mha_pool(False, 1024)
    assert type(es.allocator(stock, True, 1024)) is TokenToKVPoolAllocator
    assert type(es.allocator(es.mha_pool(False, 1024, 16), True, 1024, 16)) is PagedTokenToKVPoolAllocator
    # PD disaggregation's need_sort stages frees where the census cannot see them: SGLang's own, pool not taken.
    ours = es.mha_pool(True, 1024)
    staged = ElasticTokenAllocator(1024, dtype=torch.float16, device="cpu", kvcache=ours, need_sort=True)
    assert type(staged) is TokenToKVPoolAllocator and not ours.adopted
    taken = ElasticPagedAllocator(1024, page_size=1, dtype=torch.float16, device="cpu", kvcache=ours,
                                  need_sort=False)
    assert type(taken) is ElasticPagedAllocator and ours.adopted
    # One allocator per pool: a second one is SGLang's, and would be mapped whole by settle().
    assert type(ElasticTokenAllocator(1024, torch.float16, "cpu", ours, False)) is TokenToKVPoolAllocator


def test_stats_are_json_ready() -> None:
    from dataclasses import asdict

    _, alloc, _ = build(True)
    assert json.loads(json.dumps(asdict(alloc.stats())))["mapped_groups"] == [0]
