"""Engine side: vLLM's real Scheduler, KVCacheManager and BlockPool, elastic, with TP = 1.

The KV cache is allocated by vLLM's (elastic) allocation in this process, as
the ``uni`` executor's worker does, so the pages are real memfd pages and the
"mapped memory" measured is the extension's own count of mapped pages. The
limit is a real segment claimed on a private node root, changed with the real
`kvctl limit`. Every test runs with the patch off too, where its claim must
fail: without kvcached, vLLM holds its whole allocation from the start.

Geometry: 2 layers, 8 KiB per layer per block, 64 KiB pages, so 8 blocks per
page and 128 KiB of memory per page (one physical page in each layer).
"""

from __future__ import annotations

import json
import subprocess
from collections import deque

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed here (run scripts/install-vllm.sh in this venv)")
pytest.importorskip("kvcached.runtime._kvpages", reason="kvcached.runtime._kvpages is not built (pip install -e .)")
pytestmark = [pytest.mark.vllm, pytest.mark.ext]

from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kvcached.integration.vllm import elastic as vllm_elastic  # noqa: E402
from kvcached.node.in_engine.startup import claim_segment  # noqa: E402
from kvcached.node.state.segment import read_segment  # noqa: E402
from kvcached.runtime import kvbuffer  # noqa: E402
from kvcached.runtime.pool import MapError  # noqa: E402

from ..conftest import KVCTL  # noqa: E402
from . import elastic_support as es  # noqa: E402

PAGE = es.PAGE
BPP = 8                     # blocks per page
PB = 2 * PAGE               # bytes per page per rank (2 layers)
NUM_BLOCKS = 256            # 32 pages; vLLM's full allocation: 4 MiB


class Serve:
    """One TP = 1 engine: its segment, its KV cache (as the worker allocates it) and its scheduler."""

    def __init__(self, tmp_path, layout, name: str, limit: int, *, prefix_caching: bool = False,
                 scheduler_cls=None) -> None:
        self.layout, self.name = layout, name
        self.lease, _, _ = claim_segment(layout, name, limit)  # what the engine's start-up does (issue 12)
        self.segment = layout.segment_path(name)
        self.vc = es.vllm_config(str(tmp_path), prefix_caching=prefix_caching)
        self.cfg = es.kv_cache_config(self.vc, NUM_BLOCKS)
        vllm_elastic.prepare_engine([self.cfg], "local")  # the executor hook, as for the uni executor
        self.kv = es.allocate(self.cfg, self.vc)
        self.buf = kvbuffer.local_buffer()
        if scheduler_cls is None:
            self.sched = es.scheduler(self.vc, self.cfg)
        else:
            self.vc.cache_config.num_gpu_blocks = self.cfg.num_blocks
            self.sched = scheduler_cls(vllm_config=self.vc, kv_cache_config=self.cfg,
                                       structured_output_manager=StructuredOutputManager(self.vc),
                                       block_size=es.BLOCK_SIZE, hash_block_size=es.BLOCK_SIZE, log_stats=True)
        self.pool = self.sched.kv_cache_manager.block_pool
        self.driver = es.Driver(self.sched)

    def mapped_bytes(self) -> int:
        """Memory the KV cache holds now: the extension's mapped pages, or vLLM's whole allocation."""
        if self.buf is None:
            return sum({v.untyped_storage().data_ptr(): v.untyped_storage().nbytes()
                        for v in self.kv.values()}.values())
        return self.buf.mapped_bytes

    def held_pages(self) -> set[int]:
        """Pages holding a block vLLM uses (allocated, or kept for the prefix cache), and page 0."""
        return {0} | {b.block_id // BPP for b in self.pool.blocks
                      if not b.is_null and (b.ref_cnt > 0 or b.block_hash is not None)}

    def limit(self, size: str) -> None:
        """`kvctl limit NAME SIZE` from another process, as an operator runs it."""
        r = subprocess.run([KVCTL, "--root", self.layout.root, "limit", self.name, size,
                            "--json"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr + r.stdout

    def close(self) -> None:
        self.lease.release()


@pytest.fixture
def serve(tmp_path, layout, uniq, elastic):
    made: list[Serve] = []

    def make(limit: int = 64 * PB, **kw) -> Serve:
        s = Serve(tmp_path, layout, uniq, limit, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def burst(prefix: str, n: int, prompt: int, gen: int, start: int = 0) -> list:
    return [es.request(f"{prefix}{i}", list(range(start + 1000 * i, start + 1000 * i + prompt)), gen)
            for i in range(n)]


@es.both
def test_mapped_memory_follows_the_blocks_in_use(serve, elastic) -> None:
    s = serve()

    def check() -> None:
        seen = []

        def each(d) -> None:
            held = s.held_pages()
            mapped = set(s.buf.mapped_groups()) if s.buf else set(range(NUM_BLOCKS // BPP))
            assert held <= mapped, f"step {d.steps}: pages {held - mapped} hold blocks but are not mapped"
            assert s.mapped_bytes() <= (len(held) + 1) * PB, f"step {d.steps}: {s.mapped_bytes()} bytes mapped " \
                                                            f"for {len(held)} pages in use"
            seen.append(len(held))

        # Waves of requests of different lengths: memory grows and shrinks with them.
        for wave in range(3):
            s.driver.add(burst(f"w{wave}-", 4 + 2 * wave, 40 + 30 * wave, 20, start=10**5 * wave))
            for _ in range(8):
                s.driver.step()
                each(s.driver)
        s.driver.run(each=each)
        assert max(seen) >= 6 and min(seen[-3:]) == 1  # it grew, and came back down

    es.check_or_fail(elastic, check)


@es.both
def test_the_limit_is_never_exceeded_and_requests_wait_for_memory(serve, elastic) -> None:
    s = serve(limit=6 * PB)                    # 48 blocks; each request needs 7 blocks at its end
    s.driver.add(burst("r", 12, 90, 20))

    def check() -> None:
        most = 0

        def each(d) -> None:
            nonlocal most
            info = read_segment(s.segment)
            assert s.mapped_bytes() <= info.total, f"step {d.steps}: {s.mapped_bytes()} > limit {info.total}"
            assert info.used + info.prealloc <= info.total
            most = max(most, len(s.sched.running))

        s.driver.run(each=each)
        assert sorted(s.driver.finished) == sorted(f"r{i}" for i in range(12))  # all served, none failed
        assert most < 12                                                        # some had to wait

    es.check_or_fail(elastic, check)


@es.both
def test_lowering_the_limit_shrinks_the_mapping_raising_it_lets_waiting_requests_in(serve, elastic) -> None:
    s = serve(limit=32 * PB)
    s.driver.add(burst("r", 8, 150, 60))

    def check() -> None:
        while s.mapped_bytes() < 12 * PB:
            s.driver.step()
        s.limit(f"{6 * PB}")
        s.driver.step()
        # Within one step: nothing more is mapped, and what can go went.
        assert getattr(s.pool, "max_pages", None) == 6
        assert s.mapped_bytes() <= max(6, len(s.held_pages()) + 1) * PB
        for _ in range(40):
            s.driver.step()
            if s.mapped_bytes() <= 6 * PB:
                break
        assert s.mapped_bytes() <= 6 * PB, "the mapping never came under the lowered limit"
        assert s.driver.preempted > 0 or s.sched.waiting, "nothing waited or was preempted"
        # Below what one request needs: each running request is preempted when it needs its next
        # block (at most a block's worth of steps), then everything waits, and nothing fails.
        s.limit(f"{1 * PB}")
        for _ in range(es.BLOCK_SIZE + 2):
            s.driver.step()
        assert not s.sched.running and s.sched.waiting and s.mapped_bytes() == PB
        s.limit(f"{32 * PB}")
        s.driver.step()
        assert s.sched.running, "raising the limit did not let the waiting requests in"
        s.driver.run()
        assert len(s.driver.finished) == 8

    es.check_or_fail(elastic, check)


@es.both
def test_finished_requests_give_their_pages_back(serve, elastic) -> None:
    s = serve()
    s.driver.add(burst("r", 6, 120, 30))

    def check() -> None:
        peak = 0

        def each(d) -> None:
            nonlocal peak
            peak = max(peak, read_segment(s.segment).used)

        s.driver.run(each=each)
        info = read_segment(s.segment)
        assert peak >= 6 * PB
        # Page 0 (vLLM's null block) and one reserve page stay; everything else went back.
        assert s.mapped_bytes() == 2 * PB
        assert (info.used, info.prealloc) == (PB, PB)
        listed = subprocess.run([KVCTL, "--root", s.layout.root, "list", "--json"],
                                capture_output=True, text=True, timeout=60)
        row = next(r for r in json.loads(listed.stdout) if r["ipc"] == s.name)
        assert row["used_bytes"] == PB

    es.check_or_fail(elastic, check)


def cached_tokens(out, rid: str) -> int:
    """Prompt tokens a newly scheduled request found in the prefix cache."""
    return next(r.num_computed_tokens for r in out.scheduled_new_reqs if r.req_id == rid)


@es.both
def test_prefix_cache_hits_still_hit_and_evicting_frees_pages(serve, elastic) -> None:
    s = serve(prefix_caching=True)
    prompt = list(range(5000, 5000 + 16 * 10 + 5))    # 10 full blocks and a bit

    def check() -> None:
        s.driver.add([es.request("a", prompt, 4)])
        s.driver.run()
        cached = s.held_pages()
        assert len(cached) > 1                       # finished, its full blocks kept for the cache
        assert s.mapped_bytes() <= (len(cached) + 1) * PB
        s.driver.add([es.request("b", prompt + [1, 2, 3], 4)])
        hit = cached_tokens(s.driver.step(), "b")
        assert hit == 16 * 10, f"the prefix cache hit {hit} tokens, not 160"
        s.driver.run()
        # The operator takes the memory back: the pages that hold only cached blocks are evicted
        # and unmapped, page 0 (vLLM's null block and 7 of a's blocks) stays.
        s.limit(f"{1 * PB}")
        s.driver.add([es.request("c", [1, 2, 3], 2)])
        s.driver.run()
        assert s.mapped_bytes() == PB
        # No prefix-cache entry is left pointing into memory that is gone.
        assert s.held_pages() <= set(s.buf.mapped_groups())
        s.limit(f"{8 * PB}")
        s.driver.add([es.request("d", prompt + [9], 2)])
        hit = cached_tokens(s.driver.step(), "d")
        assert hit < 16 * 10, f"{hit} tokens hit: blocks evicted with their pages should miss"

    es.check_or_fail(elastic, check)


def test_batches_in_flight_keep_their_pages_mapped(serve, monkeypatch) -> None:
    """Async scheduling: a batch is scheduled before the previous one's output is processed.

    Blocks freed while a batch that may write them still runs must stay
    mapped until that batch's output is back. Checked with `InFlight` as it
    is, then with it blinded, where the same trace must catch the violation.
    """
    from kvcached.integration.vllm import elastic_alloc

    def run(s) -> list[str]:
        problems: list[str] = []
        inflight: deque = deque()

        def check(when: str) -> None:
            mapped = set(s.buf.mapped_groups())
            for _out, blocks in inflight:
                lost = {b // BPP for b in blocks} - mapped
                if lost:
                    problems.append(f"{when}: pages {sorted(lost)} of a running batch were unmapped")

        # Requests end at an EOS the scheduler cannot foresee (at max_tokens it would not schedule
        # them again), so a batch in flight may still hold a request that has just finished.
        s.driver.add(burst("r", 6, 50, 40))
        ends = {f"r{i}": 3 + 2 * i for i in range(6)}
        made: dict[str, int] = {}
        for _ in range(200):
            if s.sched.has_requests():
                out = s.sched.schedule()
                blocks = [b for rid in out.num_scheduled_tokens
                          for ids in s.sched.kv_cache_manager.get_block_ids(rid) for b in ids]
                inflight.append((out, blocks))
            if len(inflight) == 2 or (inflight and not s.sched.has_requests()):
                out, _ = inflight.popleft()
                ids = list(out.num_scheduled_tokens)
                tokens = []
                for rid in ids:
                    made[rid] = made.get(rid, 0) + 1
                    tokens.append([es.EOS if made[rid] >= ends[rid] else 7])
                mro = es.model_runner_output(ids, tokens)
                s.sched.update_from_output(out, mro)
                check("after an output")
            if not inflight and not s.sched.has_requests():
                break
        assert not s.sched.has_requests()
        return problems

    s = serve(scheduler_cls=AsyncScheduler)
    assert run(s) == []
    assert s.mapped_bytes() <= 2 * PB
    s.close()
    vllm_elastic.forget_engine()
    monkeypatch.setattr(elastic_alloc.InFlight, "finished_through", lambda self: self.issued)
    s2 = serve(scheduler_cls=AsyncScheduler)
    assert run(s2), "with in-flight batches ignored the trace should unmap pages under a running batch"


@es.both
def test_a_failed_mapping_fails_the_step_loudly_and_changes_nothing(serve, elastic, monkeypatch) -> None:
    s = serve()
    s.driver.add(burst("r", 2, 20, 4))
    s.driver.step()

    def check() -> None:
        assert s.buf is not None, "no elastic buffer: nothing is mapped on demand"
        before = (s.buf.mapped_groups(), s.buf.pages.mapped_pages(), s.pool.mapped_pages())

        def dead(groups):
            raise OSError(5, "Input/output error")  # as a backend that lost its device would

        monkeypatch.setattr(s.buf, "map_groups", dead)
        s.driver.add(burst("big", 1, 600, 4, start=50_000))
        with pytest.raises(MapError, match="Input/output error"):
            s.driver.step()
        assert (s.buf.mapped_groups(), s.buf.pages.mapped_pages(), s.pool.mapped_pages()) == before

    es.check_or_fail(elastic, check)


@es.both
def test_free_pages_stay_a_while_under_load_and_go_at_once_when_idle(serve, elastic, monkeypatch) -> None:
    """The release delay: a load that swings does not unmap and map the same pages step after step."""
    monkeypatch.setenv("KVCACHED_ELASTIC_RELEASE_DELAY_S", "5")
    s = serve()
    now = [1000.0]
    s.pool.clock = lambda: now[0]  # the pool's clock, stepped by hand

    def check() -> None:
        s.driver.add([es.request("long", list(range(20)), 300)] + burst("b", 6, 120, 4, start=10_000))
        while not all(f"b{i}" in s.driver.finished for i in range(6)):
            s.driver.step()
        s.driver.step()
        held = len(s.held_pages())
        assert s.mapped_bytes() > (held + 1) * PB, "the burst's pages went at once, under load"
        now[0] += 2            # pages are judged every delay/4 while busy: now seen free
        s.driver.step()
        assert s.mapped_bytes() > (held + 1) * PB, "released before they stayed free for the delay"
        now[0] += 5
        s.driver.step()
        assert s.mapped_bytes() <= (held + 1) * PB, "the burst's pages stayed past the delay"
        s.driver.run()  # the long request ends: nothing left to run, so nothing waits for the delay
        assert s.mapped_bytes() == 2 * PB

    es.check_or_fail(elastic, check)


def test_in_flight_batches_close_when_their_output_returns_or_they_are_dropped() -> None:
    import gc

    from kvcached.integration.vllm.elastic_alloc import InFlight

    class Batch:
        pass

    inflight = InFlight()
    a, b, c = Batch(), Batch(), Batch()
    for batch in (a, b, c):
        inflight.issue(batch)
    assert inflight.finished_through() == 0
    inflight.complete(b)                 # out of order: a still runs
    assert inflight.finished_through() == 0
    inflight.complete(a)
    assert inflight.finished_through() == 2
    del c, batch                         # an engine reset dropped it without an output
    gc.collect()
    assert inflight.finished_through() == 3 == inflight.issued


def test_the_pool_maps_under_the_engines_claimed_segment_and_alone_publishes_usage(tmp_path, layout, uniq,
                                                                                    elastic) -> None:
    """With engine-state on too (issue 12), the elastic pool takes its limit from the segment the engine
    claimed, and from then on the engine's whole-cache figures no longer overwrite the pool's."""
    from kvcached.integration.engine_claim import EngineState, register
    from kvcached.integration.limits import Limit

    name = f"{uniq}claimed"  # not the name the environment gives: only the claim says which segment
    engine = EngineState(layout, name)
    register(engine)
    try:
        assert engine.claim(Limit(64 * PB, "test")) is not None
        vc = es.vllm_config(str(tmp_path))
        cfg = es.kv_cache_config(vc, NUM_BLOCKS)
        engine.track_kv_cache(NUM_BLOCKS * 1 << 20)  # what engine-state publishes: the whole cache, preallocated
        assert read_segment(layout.segment_path(name)).prealloc == NUM_BLOCKS * 1 << 20
        plan = vllm_elastic.prepare_engine([cfg], "local")
        assert plan.segment_path == layout.segment_path(name)
        es.allocate(cfg, vc)
        sched = es.scheduler(vc, cfg)
        pool = sched.kv_cache_manager.block_pool
        assert pool.segment_path == layout.segment_path(name)
        mapped = pool.mapped_count * pool.page_bytes
        assert read_segment(layout.segment_path(name)).prealloc + read_segment(layout.segment_path(name)).used \
            == mapped < NUM_BLOCKS * 1 << 20
        engine.publish_usage()
        engine.publish(0, NUM_BLOCKS * 1 << 20)
        info = read_segment(layout.segment_path(name))
        assert info.used + info.prealloc == mapped, "the engine's figures overwrote the pool's"
    finally:
        engine.release()


def test_step_hooks_bound_on_the_scheduler_run_every_step_and_follow_the_patch(serve, elastic) -> None:
    """After its first step a scheduler carries the step hooks itself (wrapt's wrapper costs per step).

    They must still run at every step; when someone wraps the Scheduler's
    method over ours, that wrapper must run and ours with it (the bound hooks
    step aside); once the patch is undone, the scheduler runs vLLM's own
    methods and the pool is no longer called.
    """
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvcached.integration.vllm.patches import REGISTRY

    s = serve()
    calls: list[str] = []
    begin, end = s.pool.begin_step, s.pool.end_step
    s.pool.begin_step = lambda: (calls.append("begin"), begin())[1]
    s.pool.end_step = lambda idle=False: (calls.append("end"), end(idle))[1]
    s.driver.add(burst("r", 4, 40, 30))
    s.driver.step()
    assert all(getattr(vars(s.sched).get(name), vllm_elastic.STEP_MARK, False) for name in vllm_elastic.STEP_METHODS)
    for _ in range(3):
        s.driver.step()
    assert calls == ["begin", "end"] * 4

    ours = Scheduler.__dict__["schedule"]
    seen: list[int] = []

    def theirs(self, *args, **kwargs):
        seen.append(1)
        return ours.__get__(self, type(self))(*args, **kwargs)

    Scheduler.schedule = theirs
    try:
        calls.clear()
        for _ in range(2):
            s.driver.step()
        assert seen == [1, 1] and calls == ["begin", "end"] * 2
        assert "schedule" not in vars(s.sched) and "update_from_output" not in vars(s.sched)
    finally:
        Scheduler.schedule = ours

    s.driver.step()  # ours is the attribute again: bound again
    assert getattr(vars(s.sched).get("schedule"), vllm_elastic.STEP_MARK, False)
    REGISTRY.revert()
    assert not any(name in vars(s.sched) for name in vllm_elastic.STEP_METHODS)
    calls.clear()
    s.driver.run()
    assert calls == [] and s.driver.finished


@es.both
def test_a_deferred_free_across_pools_never_frees_a_page_another_pool_uses(serve, elastic, monkeypatch) -> None:
    """vLLM's deferred frees carry blocks of several pools (`KVCacheBlock.pool`, a weak reference in 0.34).

    BlockPool.free_blocks hands each block to its own pool. A second pool (a
    connector's, HiSparse's host pool) numbers its blocks from 0 too, so its
    blocks share ids with ours: freed through our pool, they must go home and
    leave our pages alone; ours, freed through the other pool, must come to
    us (through our override, with 0.34's `evict_first` passed along) and
    release the pages they empty.
    """
    from vllm.v1.core.block_pool import BlockPool

    from kvcached.integration.patchkit import params

    monkeypatch.setenv("KVCACHED_ELASTIC_RESERVE_PAGES", "0")  # a page emptied is a page released
    s = serve()
    other = BlockPool(NUM_BLOCKS, enable_caching=False, hash_block_size=es.BLOCK_SIZE)
    extra = {"evict_first": True} if "evict_first" in params(BlockPool.free_blocks) else {}

    def pages(blocks) -> set[int]:
        return {b.block_id // BPP for b in blocks}

    def mapped() -> set[int]:
        return set(s.buf.mapped_groups()) if s.buf else set(range(NUM_BLOCKS // BPP))

    def end_step() -> None:
        if elastic:  # vLLM's own pool has no steps: it never releases anything
            s.pool.end_step(idle=True)

    def check() -> None:
        ours = s.pool.get_new_blocks(3 * BPP)
        theirs = other.get_new_blocks(4 * BPP)
        first, rest = ours[:BPP], ours[BPP:]
        assert pages(theirs) >= pages(ours), "the other pool's blocks must share our blocks' ids"
        s.pool.free_blocks(theirs + first)  # a deferred free: the other pool's blocks and one page of ours
        end_step()
        assert other.get_num_free_blocks() == NUM_BLOCKS - 1, "the other pool's blocks did not go home"
        assert pages(rest) <= mapped(), f"pages {pages(rest) - mapped()} were released while our blocks use them"
        assert not pages(first) & mapped(), "the page our deferred free emptied stayed mapped"
        theirs = other.get_new_blocks(BPP)
        other.free_blocks(rest + theirs, **extra)  # ours, freed through the other pool
        end_step()
        assert other.get_num_free_blocks() == NUM_BLOCKS - 1
        assert mapped() <= {0}, f"pages {mapped() - {0}} stayed mapped after their blocks came back through " \
                                "the other pool"

    es.check_or_fail(elastic, check)
