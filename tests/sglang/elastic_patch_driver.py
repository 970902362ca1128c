"""SGLang's real `KVCacheConfigurator.configure` with the `sglang-elastic-kv` patch off and on, in a child process.

Run as `python -m tests.sglang.elastic_patch_driver` (tests/sglang/cpu_env.py's
environment); prints one JSON report. SGLang's runtime context is published with
SGLang's own test helper (`RuntimeContext.override_server_args`: real
`ServerArgs` with a dummy model path that is never read), once per page size,
as a scheduler has it published before it builds its model runner.

What runs is SGLang's own `configure` and its own
`_resolve_kv_pool_class` and `_build_token_to_kv_pool_allocator`, over a
stand-in configurator: sizing the pool from free device memory and reading a
model's geometry (`_resolve_memory_pool_config`, `_derive_pool_sizes`, and
the model-dependent half of `_init_pools`) need a model, so the stand-in gives
fixed sizes and builds the MHA pool with the class SGLang's resolver returns.
Each scenario builds with no patch at all, then with the registry applied
(switch off, then on), and reports the classes and the mapping it got.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from types import SimpleNamespace
from typing import Any

SIZE, HEADS, HEAD_DIM, LAYERS = 4096, 8, 64, 3


class Lines(logging.Handler):
    """kvcached's log records, kept for the report."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def stand_in(page_size: int, **shape: Any) -> Any:
    """A configurator (a real KVCacheConfigurator subclass) whose model-dependent steps give fixed sizes.

    `shape` overrides the fields SGLang's configure and allocator builder read.
    """
    import torch
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    sizes = SimpleNamespace(max_total_num_tokens=SIZE, max_running_requests=64, full_max_total_num_tokens=None,
                            swa_max_total_num_tokens=None)

    class StandIn(KVCacheConfigurator):
        def _resolve_memory_pool_config(self, pre_model_load_memory: int) -> Any:
            return "memory-pool-config"  # SGLang measures free device memory here

        def _derive_pool_sizes(self, *, config: Any) -> Any:
            return sizes

        def _init_pools(self, *, sizes: Any, req_to_token_pool: Any, token_to_kv_pool_allocator: Any) -> Any:
            # SGLang's resolver and allocator builder; the pool's geometry is fixed here, not read from a model.
            pool_cls = self._resolve_kv_pool_class(kind="mha", default=MHATokenToKVPool)
            pool = pool_cls(size=SIZE, page_size=page_size, dtype=torch.float16, head_num=HEADS, head_dim=HEAD_DIM,
                            layer_num=LAYERS, device="cpu", enable_memory_saver=False, enable_alt_stream=False)
            alloc = self._build_token_to_kv_pool_allocator(
                sizes=sizes, token_to_kv_pool=pool, is_dsv4_model=False, req_to_token_pool=None,
                token_to_kv_pool_allocator=token_to_kv_pool_allocator)
            return SimpleNamespace(req_to_token_pool=None, token_to_kv_pool=pool, token_to_kv_pool_allocator=alloc,
                                   unified_memory_pool=None)

    cfg = object.__new__(StandIn)  # its __post_init__ reads a model config
    fields = dict(device="cpu", gpu_id=0, kv_cache_dtype=torch.float16, page_size=page_size, is_draft_worker=False,
                  is_hybrid_swa=False, post_capture_kv_active=False, hybrid_gdn_config=None, mambaish_config=None,
                  kv_shard_size=1, kv_shard_spec=None, spec_algorithm=SpeculativeAlgorithm.NONE,
                  use_mla_backend=False, req_to_token_pool=None, token_to_kv_pool_allocator=None,
                  memory_pool_config=None)
    for k, v in {**fields, **shape}.items():
        setattr(cfg, k, v)
    return cfg


def configure(page_size: int, **shape: Any) -> dict[str, Any]:
    """SGLang's configure over the stand-in: which pool and allocator classes it built, and what is mapped."""
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator

    result = KVCacheConfigurator.configure(stand_in(page_size, **shape), pre_model_load_memory=0)
    pool, alloc = result.token_to_kv_pool, result.token_to_kv_pool_allocator
    buf = getattr(pool, "elastic", None) or getattr(pool, "_kept", None)
    slots = alloc.alloc(4 * page_size)
    return {"pool": type(pool).__name__, "allocator": type(alloc).__name__,
            "elastic": getattr(pool, "elastic", None) is not None, "why": getattr(pool, "elastic_why", None),
            "mapped_groups": None if buf is None else len(buf.mapped_groups()),
            "groups": None if buf is None else buf.plan.num_groups,
            "available": alloc.available_size(), "allocated": None if slots is None else len(slots)}


def targets() -> dict[str, int]:
    """The identity of every attribute the patch wraps (same ids: nothing changed)."""
    import importlib
    import inspect

    from kvcached.integration.sglang.elastic import PATCH

    out = {}
    for t in PATCH.targets:
        mod_name, qual = t.split(":")
        obj: Any = importlib.import_module(mod_name)
        *outer, name = qual.split(".")
        for part in outer:
            obj = getattr(obj, part)
        out[t] = id(inspect.getattr_static(obj, name))
    return out


def scenarios(page_size: int) -> dict[str, Any]:
    """No patch; the registry applied with the switch off; on; on for a shape that stands aside; reverted."""
    from kvcached.integration.sglang.patches import REGISTRY

    handler = Lines()
    logging.getLogger("kvcached").addHandler(handler)
    report: dict[str, Any] = {"bare": configure(page_size), "bare_targets": targets()}
    os.environ.pop("KVCACHED_ELASTIC", None)
    report["off_status"] = {n: st.name for n, st in REGISTRY.apply(("sglang-elastic-kv",)).items()}
    report["off"], report["off_targets"] = configure(page_size), targets()
    REGISTRY.revert()
    os.environ["KVCACHED_ELASTIC"] = "1"
    report["on_status"] = {n: st.name for n, st in REGISTRY.apply(("sglang-elastic-kv",)).items()}
    report["on"] = configure(page_size)
    handler.lines.clear()
    report["post_capture"] = configure(page_size, post_capture_kv_active=True)
    report["post_capture_log"] = list(handler.lines)
    REGISTRY.revert()
    os.environ.pop("KVCACHED_ELASTIC", None)
    report["reverted_targets"] = targets()
    logging.getLogger("kvcached").removeHandler(handler)
    return report


def main() -> int:
    logging.getLogger("kvcached").setLevel(logging.INFO)
    from sglang.srt.runtime_context import get_context

    report = {}
    for page_size in (1, 16):
        # SGLang's own way to publish a runtime context without a launch (a dummy model path, never read).
        with get_context().override_server_args(page_size=page_size, device="cpu"):
            report[str(page_size)] = scenarios(page_size)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
