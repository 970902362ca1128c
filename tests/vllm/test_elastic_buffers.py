"""Worker side: vLLM's own KV cache allocation, patched, lays every layer over an elastic buffer.

The configs come from vLLM's planner for the specs the common decoder models
use (full attention, sliding window beside it, MLA) in each layout vLLM 0.33
knows how to express; the views come from vLLM's `create_kv_cache_views`.
The checks are taken against the views vLLM made, not against our own
arithmetic: each block's bytes, by the view's strides, lie in the pages of
its group, and writing every block of the mapped groups reads back.
Each case also runs with the patch off, where the checks must fail.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed here (run scripts/install-vllm.sh in this venv)")
pytest.importorskip("kvcached.runtime._kvpages", reason="kvcached.runtime._kvpages is not built (pip install -e .)")
pytestmark = [pytest.mark.vllm, pytest.mark.ext]

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from kvcached.integration.vllm import elastic as vllm_elastic  # noqa: E402
from kvcached.runtime import kvbuffer  # noqa: E402

from . import elastic_support as es  # noqa: E402

PAGE = es.PAGE


def full_groups(layers: int = 3) -> list[KVCacheGroupSpec]:
    return [KVCacheGroupSpec([f"model.layers.{i}.attn" for i in range(layers)], es.spec())]


def hybrid_groups() -> list[KVCacheGroupSpec]:
    """Gemma-like: full-attention layers and sliding-window layers, one page size, aliased groups."""
    sw = SlidingWindowSpec(block_size=es.BLOCK_SIZE, num_kv_heads=2, head_size=64, dtype=torch.float16,
                           sliding_window=64)
    return [KVCacheGroupSpec(["model.layers.0.attn", "model.layers.2.attn"], es.spec()),
            KVCacheGroupSpec(["model.layers.1.attn", "model.layers.3.attn"], sw)]


def mla_groups() -> list[KVCacheGroupSpec]:
    """DeepSeek-like latent cache: one 576-wide row per token, not a divisor of the page."""
    mla = MLAAttentionSpec(block_size=es.BLOCK_SIZE, num_kv_heads=1, head_size=576, dtype=torch.float16)
    return [KVCacheGroupSpec([f"model.layers.{i}.attn" for i in range(3)], mla)]


CASES = [
    ("full", "LBHNC", full_groups), ("full", "LBNHC", full_groups), ("full", "BLHNC", full_groups),
    ("full", "LHBNC", full_groups), ("hybrid", "BLHNC", hybrid_groups), ("hybrid", "LBHNC", hybrid_groups),
    ("mla", "LBHNC", mla_groups),
]


def allocate(tmp_path, layout: str, groups, num_blocks: int = 101):
    vc = es.vllm_config(str(tmp_path), layout=layout)
    cfg = es.kv_cache_config(vc, num_blocks, groups=groups())
    vllm_elastic.prepare_engine([cfg], "local", segment_path=str(tmp_path / "seg"))
    return cfg, es.allocate(cfg, vc)


def element_pages_and_groups(view: torch.Tensor, num_blocks: int, base: int, bpp: int):
    """For every element of the view (from its own strides): the page it lies in, and its block's group."""
    idx = torch.zeros(view.shape, dtype=torch.int64)
    for d, (n, stride) in enumerate(zip(view.shape, view.stride())):
        shape = [1] * view.dim()
        shape[d] = n
        idx = idx + (torch.arange(n, dtype=torch.int64) * stride).view(shape)
    pages = (view.data_ptr() - base + idx * view.element_size()) // PAGE
    ratio = view.shape[0] // num_blocks  # kernel blocks per manager block
    groups = (torch.arange(view.shape[0]) // ratio // bpp).view(-1, *[1] * (view.dim() - 1)).expand(view.shape)
    return pages, groups


def check_views_over_the_buffer(cfg, kv) -> kvbuffer.KVBuffer:
    buf = kvbuffer.local_buffer()
    assert buf is not None, "no elastic buffer in this process"
    base = buf.pages.address
    for name, view in kv.items():
        ptr = view.untyped_storage().data_ptr()  # never a tensor in an assert: its repr reads unmapped pages
        assert ptr == base, f"{name} is not a view of the reserved range"
    return buf


def check_blocks_in_their_pages(cfg, kv) -> None:
    buf = check_views_over_the_buffer(cfg, kv)
    plan, base = buf.plan, buf.pages.address
    allowed = torch.zeros(plan.num_groups, plan.num_pages, dtype=torch.bool)
    for g in range(plan.num_groups):
        allowed[g, plan.pages_of(g)] = True
    for name, view in kv.items():
        pages, groups = element_pages_and_groups(view, cfg.num_blocks, base, plan.blocks_per_page)
        inside = bool(((pages >= 0) & (pages < plan.num_pages)).all())
        assert inside, f"{name} reaches outside the reserved range"
        ok = bool(allowed[groups.reshape(-1), pages.reshape(-1)].all())
        assert ok, f"{name}: a block's bytes lie outside its group's pages"


@es.both
@pytest.mark.parametrize("kind,kv_layout,groups", CASES, ids=[f"{k}-{lay}" for k, lay, _ in CASES])
def test_layers_are_views_whose_blocks_lie_in_their_pages(elastic, tmp_path, kind, kv_layout, groups) -> None:
    cfg, kv = allocate(tmp_path, kv_layout, groups)
    if not elastic:
        with pytest.raises(AssertionError, match="no elastic buffer"):
            check_blocks_in_their_pages(cfg, kv)
        return
    check_blocks_in_their_pages(cfg, kv)


@es.both
@pytest.mark.parametrize("kind,kv_layout,groups", CASES[:1] + CASES[4:], ids=["full-LBHNC", "hybrid-BLHNC",
                                                                           "hybrid-LBHNC", "mla-LBHNC"])
def test_mapped_blocks_take_writes_and_only_their_pages_cost_memory(elastic, tmp_path, kind, kv_layout,
                                                                   groups) -> None:
    cfg, kv = allocate(tmp_path, kv_layout, groups)

    def check() -> None:
        buf = check_views_over_the_buffer(cfg, kv)
        link = kvbuffer.LocalLink(buf)
        agreed = link.setup(cfg.num_blocks)
        groups_on = [1, agreed.num_groups - 1]  # one inside, the (short) last one
        link.map(groups_on)
        want = set(buf.plan.pages_of(0)).union(*(buf.plan.pages_of(g) for g in groups_on))
        assert buf.pages.mapped_pages() == sorted(want)
        blocks = [b for g in [0, *groups_on] for b in buf.plan.block_range(g)]
        # One layer at a time: the groups of a hybrid model alias the same bytes.
        for i, view in enumerate(kv.values()):
            ratio = view.shape[0] // cfg.num_blocks
            for b in blocks:
                view[b * ratio:(b + 1) * ratio].fill_(i + b % 7 + 1)
            for b in blocks:
                same = bool((view[b * ratio:(b + 1) * ratio] == i + b % 7 + 1).all())
                assert same, (i, b)
        link.unmap(groups_on)
        assert buf.pages.mapped_pages() == buf.plan.pages_of(0)

    es.check_or_fail(elastic, check)


@es.both
def test_layer_regions_are_padded_so_groups_own_their_pages(elastic, tmp_path) -> None:
    """101 blocks of 8 KiB: each layer's region ends mid-page in vLLM's plan; padded, no page is shared."""
    cfg, kv = allocate(tmp_path, "LBHNC", full_groups)

    def check() -> None:
        buf = check_views_over_the_buffer(cfg, kv)
        plan = buf.plan
        owner: dict[int, int] = {}
        for g in range(plan.num_groups):
            for p in plan.pages_of(g):
                assert owner.setdefault(p, g) == g, f"page {p} serves groups {owner[p]} and {g}"
        assert all(t.layer_stride % PAGE == 0 for t in cfg.kv_cache_tensors)

    es.check_or_fail(elastic, check)


def test_a_config_the_engine_did_not_mark_keeps_vllms_allocation(elastic, tmp_path) -> None:
    vc = es.vllm_config(str(tmp_path))
    cfg = es.kv_cache_config(vc, 64)
    kv = es.allocate(cfg, vc)  # no prepare_engine: no engine will map these pages
    assert kvbuffer.local_buffer() is None
    zeroed = all(bool((v == 0).all()) for v in kv.values())
    assert zeroed  # vLLM's zeroed allocation, all of it usable


def test_a_layout_without_views_falls_back_and_says_why(elastic, tmp_path, caplog) -> None:
    vc = es.vllm_config(str(tmp_path))
    cfg = es.kv_cache_config(vc, 64)
    cfg.kv_cache_tensors[0].host_resident = True  # as HiSparse host pools are
    cfg.hisparse_host_num_blocks = cfg.num_blocks
    vllm_elastic.prepare_engine([cfg], "local", segment_path=str(tmp_path / "seg"))
    with caplog.at_level("WARNING", logger="kvcached.integration.vllm.elastic_buffers"):
        kv = es.allocate(cfg, vc)
    assert kvbuffer.local_buffer() is None and kv
    assert "not elastic: a KV cache tensor lives in host memory" in caplog.text


def test_off_by_default_nothing_is_patched(monkeypatch) -> None:
    from vllm.v1.core import kv_cache_coordinator
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.worker import utils

    from kvcached.integration.patchkit import PatchStatus, is_ours
    from kvcached.integration.vllm.patches import REGISTRY

    monkeypatch.delenv("KVCACHED_ELASTIC", raising=False)
    REGISTRY.revert()
    try:
        # Switched off: not even what it requires is applied.
        assert REGISTRY.apply(("elastic-kv",)) == {"elastic-kv": PatchStatus.DISABLED}
        assert kv_cache_coordinator.BlockPool is BlockPool
        assert not is_ours(utils.allocate_kv_cache)
        status = {p.name: p for p in REGISTRY.report()}["elastic-kv"]
        assert status.status is PatchStatus.DISABLED and "KVCACHED_ELASTIC=1" in status.reason
    finally:
        REGISTRY.revert()


def test_page_size_env(monkeypatch, caplog) -> None:
    from kvcached import settings

    monkeypatch.setenv("KVCACHED_PAGE_SIZE", "65536")
    assert settings.PAGE_SIZE.get() == 65536
    monkeypatch.setenv("KVCACHED_PAGE_SIZE", "64k")  # not a number of bytes: warned about, the default used
    assert settings.PAGE_SIZE.get() == 2 << 20 and "KVCACHED_PAGE_SIZE='64k'" in caplog.text
    monkeypatch.delenv("KVCACHED_PAGE_SIZE")
    assert settings.PAGE_SIZE.get() == 2 << 20


def test_model_runners_that_imported_the_allocation_first_get_it_too(monkeypatch) -> None:
    """vLLM's model runners bind allocate_kv_cache at import: patching the utils module alone would miss them.

    Which modules bind it moved between releases (0.33's gpu_model_runner is
    gone in 0.34, which has cpu/attn_utils): every one of the patch's list
    that this vLLM has, and at least one.
    """
    import importlib
    import importlib.util

    from vllm.v1.worker import utils

    from kvcached.integration.patchkit import PatchStatus, key_of
    from kvcached.integration.vllm.elastic import ALLOCATE_USERS
    from kvcached.integration.vllm.patches import REGISTRY

    users = [importlib.import_module(m) for m in ALLOCATE_USERS if importlib.util.find_spec(m) is not None]
    assert users, f"none of {ALLOCATE_USERS} is in this vLLM: its model runners bind allocate_kv_cache elsewhere"
    monkeypatch.setenv("KVCACHED_ELASTIC", "1")
    REGISTRY.revert()
    original = utils.allocate_kv_cache
    assert all(m.allocate_kv_cache is original for m in users)  # imported before the patch, as in a worker
    try:
        assert REGISTRY.apply(("elastic-kv",))["elastic-kv"] is PatchStatus.APPLIED
        for m in users:
            assert key_of(m.allocate_kv_cache) == key_of(utils.allocate_kv_cache) == "elastic-kv", m.__name__
            assert m.allocate_kv_cache.__wrapped__ is original
    finally:
        REGISTRY.revert()
    assert all(m.allocate_kv_cache is original for m in users) and utils.allocate_kv_cache is original
