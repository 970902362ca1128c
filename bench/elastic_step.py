"""vLLM's real Scheduler (0.33, 0.34), no model, over kvcached's elastic pool and over vLLM's own: a step's CPU time.

Used by bench_elastic.py (its first figure). Both schedulers are built as vLLM builds one
(VllmConfig with its SchedulerConfig and CacheConfig, the KV cache config
from vLLM's own planner for Llama-3-8B-shaped full-attention layers, the
Scheduler with its KVCacheManager, coordinator and BlockPool). The elastic one
is built under the `elastic-kv` patch, over a KV buffer of memfd pages in this
process (as the ``uni`` executor's worker allocates it) and a limit segment it
reads every step. vLLM's side calls vLLM's own methods (the functions under
the patch's wrappers), so it costs what a serve without kvcached pays.

The load is stationary: 48 requests run; each step one finishes (its
`max_tokens` reached) and one arrives, its prompt 128-512 tokens behind a
32-token system prompt all share (prefix-cache hits: cached blocks touched);
the model runner's output is one sampled token per running request.
"""

from __future__ import annotations

import cProfile
import gc
import inspect
import os
import pstats
import random
import tempfile
import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

LIVE = 48              # requests running in every step
SYSTEM = 32            # tokens of the shared system prompt (2 blocks)
PROMPT = (128, 512)    # tokens of each request's own prompt
NUM_BLOCKS = 4096      # 16 tokens each: 64k tokens of KV cache
LAYERS = 2             # the scheduler sees one group whatever the count; two keep the mapped memory small


def _spec() -> Any:
    """A Llama-3-8B attention layer: 16-token blocks of 8 KV heads x 128 x fp16 (64 KiB per layer-block)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.float16)


def _prompt(i: int) -> list[int]:
    rnd = random.Random(i)
    return list(range(1, SYSTEM + 1)) + [rnd.randrange(900) for _ in range(rnd.randint(*PROMPT))]


@dataclass
class Side:
    """One scheduler, driven a step at a time; the CPU time it spent and the schedule it ran."""

    name: str
    sched: Any
    arrived: int = 0
    cpu: list[float] = field(default_factory=list)    # seconds per round
    tokens: list[int] = field(default_factory=list)   # tokens scheduled, per measured step
    running: list[int] = field(default_factory=list)  # requests scheduled, per measured step

    def arrive(self) -> None:
        """One new request: the same prompt and length on both sides for the same arrival number."""
        from tests.vllm import elastic_support as es

        i = self.arrived
        self.arrived += 1
        self.sched.add_request(es.request(f"r{i}", _prompt(i), LIVE))

    def steps(self, n: int, record: bool = True) -> float:
        """`n` steps; the thread's CPU seconds in schedule() and update_from_output(), nothing else.

        The next step's request arrives between the two calls (as the engine
        core adds requests while the model runs), so that three clock reads
        time a step.
        """
        from tests.vllm.elastic_support import model_runner_output

        clock = time.thread_time
        sched, requests = self.sched, self.sched.requests
        if not self.arrived:
            self.arrive()
        spent = 0.0
        t0 = clock()
        for _ in range(n):
            out = sched.schedule()  # looked up at every call, as the engine core does
            t1 = clock()
            ids = list(out.num_scheduled_tokens)
            sampled = [[7] if requests[r].num_computed_tokens >= requests[r].num_prompt_tokens else [] for r in ids]
            mro = model_runner_output(ids, sampled)
            if record:
                self.tokens.append(out.total_num_scheduled_tokens)
                self.running.append(len(ids))
            self.arrive()
            t2 = clock()
            sched.update_from_output(out, mro)
            t3 = clock()
            spent += (t1 - t0) + (t3 - t2)
            t0 = t3
        return spent


def _vllm_own(sched: Any) -> None:
    """Make `sched` run vLLM's own step methods (the functions under the patch's wrappers) at its attribute names."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvcached.integration.patchkit import original

    for name in ("schedule", "update_from_output", "finish_requests"):  # finish_requests: what vLLM's own call
        setattr(sched, name, types.MethodType(original(inspect.getattr_static(Scheduler, name)), sched))


@contextmanager
def sides() -> Iterator[tuple[Side, Side, Any]]:
    """(vLLM's side, the elastic side, the elastic pool), the patch applied for as long as they live."""
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    from kvcached.integration.patchkit import PatchStatus
    from kvcached.integration.vllm import elastic as vllm_elastic
    from kvcached.integration.vllm.patches import REGISTRY
    from kvcached.node.state.segment import create_segment
    from kvcached.runtime import kvbuffer
    from tests.vllm import elastic_support as es

    os.environ["KVCACHED_ELASTIC"] = "1"
    assert REGISTRY.apply(("elastic-kv",))["elastic-kv"] is PatchStatus.APPLIED
    groups = [KVCacheGroupSpec([f"model.layers.{i}.attn" for i in range(LAYERS)], _spec())]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            seg = os.path.join(tmp, "seg")
            create_segment(seg, 1 << 40)
            vc = es.vllm_config(tmp, max_num_seqs=64, max_batched=2048)
            plain = es.scheduler(vc, es.kv_cache_config(vc, NUM_BLOCKS, groups=groups))
            assert type(plain.kv_cache_manager.block_pool).__name__ == "BlockPool"
            _vllm_own(plain)
            vc = es.vllm_config(tmp, max_num_seqs=64, max_batched=2048)
            cfg = es.kv_cache_config(vc, NUM_BLOCKS, groups=groups)
            vllm_elastic.prepare_engine([cfg], "local", segment_path=seg)
            es.allocate(cfg, vc)  # the worker's allocation: the elastic KV buffer of this process
            sched = es.scheduler(vc, cfg)
            pool = vllm_elastic.elastic_pool(sched)
            assert pool is not None and pool.segment_path == seg
            yield Side("vLLM", plain), Side("elastic", sched), pool
    finally:
        REGISTRY.revert()
        vllm_elastic.forget_engine()
        kvbuffer.set_local_buffer(None)


def warm(a: Side, b: Side) -> None:
    """Bring both to the stationary load (LIVE requests running), and well past it; then freeze what is old.

    gc.freeze: a full collection walks every object vLLM and torch created at
    import, tens of milliseconds that would land on whichever side allocates
    when it comes; new objects are still collected as in a serve.
    """
    for side in (a, b):
        side.steps(4 * LIVE, record=False)
    gc.collect()
    gc.freeze()


def interleaved(a: Side, b: Side, rounds: int, steps: int) -> list[float]:
    """Rounds of `steps` steps on each side, a step at a time (A B, then B A); the ratio b/a of each round.

    Alternating single steps puts a noisy moment of a shared machine (another
    process's burst, its cache misses) on both sides alike; longer blocks of
    steps per side let it land on one.
    """
    ratios = []
    for _ in range(rounds):
        spent = {a.name: 0.0, b.name: 0.0}
        for k in range(steps):
            for side in ((a, b) if k % 2 == 0 else (b, a)):
                spent[side.name] += side.steps(1)
        for side in (a, b):
            side.cpu.append(spent[side.name])
        ratios.append(spent[b.name] / spent[a.name])
    return ratios


def counting(pool: Any) -> dict[str, int]:
    """Count the pool's map and unmap calls from now on (pages, per rank)."""
    counts = {"mapped": 0, "unmapped": 0}
    link = pool.link
    for name, key in (("map", "mapped"), ("unmap", "unmapped")):
        def call(pages: Any, _fn: Callable[..., Any] = getattr(link, name), _key: str = key) -> Any:
            counts[_key] += len(pages)
            return _fn(pages)
        setattr(link, name, call)
    return counts


# Where kvcached's share of an elastic step goes, by function (the rest of kvcached's functions: "other").
GROUPS = {
    "limit read (once per step)": ("read", "_open_checked", "close"),
    "step hooks (wrappers, begin/end_step, in-flight batches)": (
        "schedule", "update_from_output", "_scheduled", "_updated", "_bind_steps",
        "_schedule", "_update_from_output", "_finish_requests", "elastic_pool", "begin_step", "end_step",
        "issue", "complete", "_set_limit", "set_limit", "limit", "max_pages", "mapped_count", "kept"),
    "page judgement, usage published": ("_trim", "_review", "due_for_release", "_page_state", "_publish", "publish",
                                        "usage", "write_segment", "_recount", "_blocks_in_pages", "_blocks_of",
                                        "_flock", "release"),
    "map / unmap on the workers": ("_grow", "grow", "release_finished", "unmap_released", "finished_through", "map",
                                   "unmap", "_map", "map_groups", "unmap_groups", "_apply", "_map_locked",
                                   "_acquire", "_release"),
    "pool overrides on vLLM's per-block paths": ("get_new_blocks", "free_blocks", "get_num_free_blocks"),
}
# vLLM's own work, reached through our wrappers and overrides: not kvcached's cost.
VLLM_WORK = {"schedule", "update_from_output", "finish_requests", "get_new_blocks", "free_blocks",
             "reset_prefix_cache"}


def _split(stats: pstats.Stats, steps: int) -> list[tuple[str, float]]:
    """kvcached's functions' own time, plus what they spend in code not ours (builtins, vLLM's helpers but
    its own step work), by group; us per step."""
    raw: dict[tuple[str, int, str], Any] = stats.stats  # type: ignore[attr-defined]
    ours = {k for k in raw if f"{os.sep}kvcached{os.sep}" in k[0]}
    group_of = {k: next((g for g, names in GROUPS.items() if k[2] in names), "other kvcached") for k in ours}
    spent = dict.fromkeys([*GROUPS, "has_requests (vLLM's, asked by the step hook)", "other kvcached"], 0.0)
    for k in ours:
        spent[group_of[k]] += raw[k][2]
    for callee, (_cc, _nc, _tt, _ct, callers) in raw.items():
        if callee in ours or (callee[2] in VLLM_WORK and callee[0] != "~"):
            continue
        for caller, (_c, _n, _t, ct) in callers.items():
            if caller in ours:
                label = "has_requests (vLLM's, asked by the step hook)" if callee[2] == "has_requests" \
                    else group_of[caller]
                spent[label] += ct
    return [(label, t / steps * 1e6) for label, t in spent.items()]


def profile_split(a: Side, b: Side, steps: int) -> tuple[float, float, list[tuple[str, float]]]:
    """cProfile (thread CPU time) over `steps` steps of each: (vLLM us/step, elastic us/step, kvcached's parts).

    The profiler adds about a microsecond to every call it sees, on both
    sides alike, so the figures are larger than unprofiled ones; the split
    says where kvcached's share goes.
    """
    totals = []
    for side in (a, b):  # the split is read from the last profile: the elastic side's
        prof = cProfile.Profile(time.thread_time)
        prof.enable()
        totals.append(side.steps(steps, record=False) / steps * 1e6)
        prof.disable()
    return totals[0], totals[1], _split(pstats.Stats(prof), steps)
