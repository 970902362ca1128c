"""Two TP ranks of one SGLang serve, elastic: real processes, a real gloo group, identical page sets at every step.

Each rank is a process of its own with SGLang's real pool, allocator and
RadixCache, running the same requests (SGLang broadcasts them to every TP
rank; here both ranks draw the same seeded trace). Only rank 0 can read the
segment: rank 1's way to it fails if it is ever taken. Rank 0 lowers the
limit with the real `kvctl limit` mid-run; the step boundary broadcasts the
limit, the clock and rank 0's idleness on the gloo group, so both ranks map,
drain and unmap the same groups at the same step. Each rank is `python -c`
forked from the zygote (tests/sglang/zygote.py), which imported SGLang once.
"""

from __future__ import annotations

import json
import textwrap

import pytest

pytest.importorskip("kvcached.runtime._kvpages", reason="kvcached.runtime._kvpages is not built (pip install -e .)")
pytestmark = [pytest.mark.sglang, pytest.mark.ext]

from . import elastic_support as es  # noqa: E402
from .serves import Forked  # noqa: E402

RANK = textwrap.dedent("""
    import json, os, random, subprocess, sys

    rank, world, rdv, out, seg, name, root, kvctl = sys.argv[1:9]
    rank, world = int(rank), int(world)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=world)
    group = dist.new_group(ranks=list(range(world)), backend="gloo")

    from kvcached.integration.sglang.elastic_ranks import limit_source
    from tests.sglang import elastic_support as es


    class TP:  # what the allocator uses of SGLang's GroupCoordinator, over the real gloo group
        cpu_group, ranks, rank_in_group, world_size = group, list(range(world)), rank, world


    def no_way_to_it():
        raise AssertionError("rank %d looked for the segment" % rank)


    size = 4096
    pool = es.mha_pool(True, size)
    alloc = es.allocator(pool, True, size)
    driver = es.Driver(alloc, es.radix_cache(alloc))
    alloc.attach(TP(), limit_source(seg) if rank == 0 else limit_source(locate=no_way_to_it))
    steps = []
    driver.after_boundary = lambda d: steps.append(
        [alloc.stats().mapped_groups, pool.elastic.pages.mapped_pages(), alloc.max_groups])
    rnd = random.Random(21)
    shared = list(range(64))
    driver.add(es.burst(rnd, 0, 10, (150, 300), (40, 120), shared=shared))
    for _ in range(30):
        driver.step()
    if rank == 0:  # an operator lowers the limit while requests run
        r = subprocess.run([kvctl, "--root", root, "limit", name, str(10 * es.GROUP_BYTES), "--json"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
    driver.add(es.burst(rnd, 100, 10, (150, 300), (40, 120), shared=shared))
    driver.run(max_steps=4000)
    for _ in range(5):
        driver.step()
    json.dump({"steps": steps, "reads_segment": alloc.agreement.source is not None, "refused": driver.refused,
               "retracted": driver.retracted, "live": sorted(es.live_groups(driver, es.GROUP_TOKENS))}, open(out, "w"))
    dist.destroy_process_group()
""")


def test_two_tp_ranks_keep_identical_page_sets(layout, uniq, zygote, sgl_scratch, tmp_path) -> None:
    from kvcached.node.in_engine.startup import claim_segment

    from ..conftest import KVCTL

    lease, _, _ = claim_segment(layout, uniq, 64 * es.GROUP_BYTES)
    env = {"KVCACHED_PAGE_SIZE": str(es.PAGE), "KVCACHED_ELASTIC_RELEASE_DELAY_S": "0",
           "KVCACHED_ELASTIC_RESERVE_PAGES": "0", "KVCACHED_ROOT": layout.root, "KVCACHED_IPC_NAME": uniq}
    rdv = str(tmp_path / "rendezvous")
    outs = [str(tmp_path / f"rank{r}.json") for r in range(2)]
    procs = [Forked(zygote, RANK, sgl_scratch, args=[str(r), "2", rdv, outs[r], layout.segment_path(uniq), uniq,
                                                     layout.root, KVCTL], extra=env, timeout=900) for r in range(2)]
    try:
        done = [p.result() for p in procs]
    finally:
        for p in procs:
            p.close()
        lease.release()
    for r, p in enumerate(done):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    rank0, rank1 = (json.load(open(o)) for o in outs)
    assert rank0["reads_segment"] and not rank1["reads_segment"]
    assert rank0["refused"] == rank1["refused"] == 0 and rank0["retracted"] == rank1["retracted"]
    assert len(rank0["steps"]) == len(rank1["steps"]) > 60
    for i, (a, b) in enumerate(zip(rank0["steps"], rank1["steps"])):
        assert a == b, f"step {i}: rank 0 maps groups {a[0]} (pages {a[1]}), rank 1 {b[0]} (pages {b[1]})"
    limits = [s[2] for s in rank0["steps"]]
    assert limits[0] == 64 and limits[-1] == 10, limits
    peak = max(len(s[0]) for s in rank0["steps"])
    # Grew past the later limit, then shrank to what the radix cache still holds (and group 0), under the limit.
    final = rank0["steps"][-1][0]
    assert peak > 10 and final == rank0["live"] == rank1["live"] and len(final) <= 10, (peak, final, rank0["live"])
