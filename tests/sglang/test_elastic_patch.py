"""The `sglang-elastic-kv` patch on SGLang 0.5.23's real KV cache configurator: off it changes nothing, on it builds
the elastic pool and allocator, and a shape it does not cover stands aside with a log line.

SGLang's configure runs in a child (tests/sglang/elastic_patch_driver.py says what it stands in for), since the
runtime context it reads is process-wide: forked from the zygote (tests/sglang/zygote.py), which imported SGLang once.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

pytest.importorskip("kvcached.runtime._kvpages", reason="kvcached.runtime._kvpages is not built (pip install -e .)")
pytestmark = [pytest.mark.sglang, pytest.mark.ext]

from . import elastic_support as es  # noqa: E402
from .cpu_env import last_json  # noqa: E402
from .serves import Forked  # noqa: E402


@pytest.fixture(scope="module")
def report(zygote, sgl_scratch, tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("elastic-patch-root"))
    proc = Forked(zygote, "import runpy; runpy.run_module('tests.sglang.elastic_patch_driver', run_name='__main__')",
                  sgl_scratch, extra={"KVCACHED_PAGE_SIZE": str(es.PAGE), "KVCACHED_ROOT": root,
                                      "KVCACHED_IPC_NAME": "elastic-patch-test"}, timeout=600).result()
    assert proc.returncode == 0, proc.stderr[-6000:]
    return last_json(proc)


@pytest.mark.parametrize("page_size", ["1", "16"])
def test_with_the_switch_off_sglang_builds_exactly_what_it_builds_without_kvcached(report, page_size) -> None:
    r = report[page_size]
    assert r["off_status"] == {"sglang-elastic-kv": "DISABLED"}
    # The same classes and behaviour as with no registry at all, and not one attribute of SGLang's replaced.
    assert r["off"] == r["bare"] and r["off"]["pool"] == "MHATokenToKVPool"
    assert r["off"]["allocator"] == ("TokenToKVPoolAllocator" if page_size == "1" else "PagedTokenToKVPoolAllocator")
    assert r["off_targets"] == r["bare_targets"] == r["reverted_targets"]


@pytest.mark.parametrize("page_size", ["1", "16"])
def test_with_the_switch_on_sglangs_configure_builds_the_elastic_pool_and_allocator(report, page_size) -> None:
    r = report[page_size]
    assert r["on_status"] == {"sglang-segment": "APPLIED", "sglang-elastic-kv": "APPLIED"}
    on = r["on"]
    assert on["pool"] == "ElasticMHATokenToKVPool" and on["elastic"]
    assert on["allocator"] == ("ElasticTokenAllocator" if page_size == "1" else "ElasticPagedAllocator")
    # Group 0 (the padding slot) at the start, one more once the first ids are handed out (16-token pages: 4 per group).
    assert on["mapped_groups"] == (1 if page_size == "1" else 2) < on["groups"]
    # SGLang's accounting sees the same pool as without kvcached.
    assert (on["available"], on["allocated"]) == (r["bare"]["available"], r["bare"]["allocated"])


@pytest.mark.parametrize("page_size", ["1", "16"])
def test_a_shape_the_patch_does_not_cover_stays_sglangs_with_one_log_line(report, page_size) -> None:
    r = report[page_size]
    assert r["post_capture"] == r["bare"]
    assert r["post_capture_log"] == ["kvcached: this SGLang KV pool stays SGLang's, not elastic: post-capture KV "
                                     "backing (SGLang's own VMM)"]


@pytest.mark.usefixtures("sgl")
def test_every_other_pool_kind_has_its_reason(caplog) -> None:
    """What `not_plain` answers for each configurator shape that is not a plain pool (read before any context)."""
    from kvcached.integration.sglang.elastic import not_plain

    plain = dict(is_draft_worker=False, is_hybrid_swa=False, post_capture_kv_active=False, mambaish_config=None,
                 kv_shard_size=1)
    cases = {"is_draft_worker": (True, "draft worker"), "is_hybrid_swa": (True, "sliding-window"),
             "post_capture_kv_active": (True, "post-capture"), "mambaish_config": (object(), "Mamba"),
             "kv_shard_size": (2, "sharding")}
    for field, (value, words) in cases.items():
        why = not_plain(SimpleNamespace(**{**plain, field: value}))
        assert why is not None and words in why, (field, why)
    # With no runtime context published (not inside a scheduler), nothing can be judged: it stands aside too.
    why = not_plain(SimpleNamespace(**plain))
    assert why is not None and "runtime context" in why


@pytest.mark.usefixtures("sgl", "elastic_env")
def test_an_mla_dsa_pool_keeps_sglangs_own_buffers(caplog) -> None:
    import torch
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    from kvcached.integration.sglang.elastic_buffers import ElasticMLATokenToKVPool

    assert issubclass(ElasticMLATokenToKVPool, MLATokenToKVPool)
    with caplog.at_level(logging.WARNING, logger="kvcached"):
        pool = ElasticMLATokenToKVPool(size=256, page_size=1, dtype=torch.bfloat16, kv_lora_rank=16,
                                       qk_rope_head_dim=4, layer_num=2, device="cpu", enable_memory_saver=False,
                                       use_dsa=True)
    assert pool.elastic is None and "DSA" in pool.elastic_why
    assert any("not elastic" in m and "DSA" in m for m in caplog.messages)
