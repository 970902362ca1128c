"""What the vLLM patches share: vLLM's module names, readings of vLLM objects, the engine's name per DP rank.

Nothing here imports vLLM at import; `module()` does when a patch asks.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from ... import settings
from ...node import dp_rank_name, ipc_name_from_env

# The readers of an engine's shapes are the kit's (shared with SGLang's patches); the vLLM patches import them here.
from ..patchkit import argument as argument
from ..patchkit import params as params
from ..patchkit import source as source

PLUGIN_NAME = "kvcached"  # the entry point's name in group vllm.general_plugins
# The vLLM releases this kvcached was proven on: tests/vllm passes on each (.ci/run runs it on both venvs;
# docs/VLLM.md, "Versions"). scripts/install-vllm.sh's VERSIONS is the same list (tests/vllm/test_detect.py).
PROVEN_VERSIONS = ("0.33.0", "0.34.0")

M_UTILS = "vllm.v1.engine.utils"
M_CORE = "vllm.v1.engine.core"
M_EXECUTOR = "vllm.v1.executor.multiproc_executor"
M_UNIPROC = "vllm.v1.executor.uniproc_executor"
M_ABSTRACT = "vllm.v1.executor.abstract"
M_KV_MANAGER = "vllm.v1.core.kv_cache_manager"
M_LMCACHE = "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector"
M_ARGS = "vllm.engine.arg_utils"
# What elastic-kv changes beside them.
M_BLOCK_POOL = "vllm.v1.core.block_pool"
M_COORDINATOR = "vllm.v1.core.kv_cache_coordinator"
M_SCHEDULER = "vllm.v1.core.sched.scheduler"
M_WORKER_UTILS = "vllm.v1.worker.utils"
M_INTERFACE = "vllm.v1.kv_cache_interface"

ENGINE_ATTR = "_kvcached_engine"  # on an executor: its engine's EngineState


def module(name: str) -> Any:
    """The vLLM module `name`, imported now."""
    return importlib.import_module(name)


@contextmanager
def environ_set(name: str, value: str | None) -> Iterator[None]:
    """`name=value` in os.environ for the block (child processes started in it inherit it); None: unchanged."""
    if value is None:
        yield
        return
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def plugin_allowed(environ: Mapping[str, str] | None = None) -> bool:
    """False when `VLLM_PLUGINS` is set and does not list `kvcached`: vLLM then never calls our plugin.

    Parsed as vLLM 0.33 parses it (`envs.VLLM_PLUGINS`): split on `,`, names
    compared exactly, so `VLLM_PLUGINS=""` allows no plugin at all.
    """
    allow = settings.VLLM_PLUGINS.get(environ)
    return allow is None or PLUGIN_NAME in allow.split(",")


def not_covered(parallel_config: Any) -> str | None:
    """Why kvcached leaves this executor or worker alone (Ray, external launchers), or None when it covers it."""
    if getattr(parallel_config, "use_ray", False) is True:
        return "Ray executor: its workers are Ray actors outside the serve's process group"
    if getattr(parallel_config, "data_parallel_backend", "mp") == "ray":
        return "Ray data parallel: engines are Ray actors that no engine owner cleans up after"
    if getattr(parallel_config, "distributed_executor_backend", None) == "external_launcher":
        return "external launcher (torchrun): every process is its own engine of one TP group"
    return None


def engine_name(parallel_config: Any, environ: Mapping[str, str] | None = None) -> str:
    """The IPC name of this engine and its workers: the serve's name, plus `_dp<rank>` in a DP serve.

    vLLM resets a non-MoE DP rank's config to DP = 1 before its executor starts,
    so the config alone cannot tell rank 0 of a DP serve from a serve without
    DP: the engine owner marks a DP serve's engines with KVCACHED_DP_SERVE.
    """
    base = ipc_name_from_env(environ)
    size = getattr(parallel_config, "data_parallel_size", 1)
    index = getattr(parallel_config, "data_parallel_index", None)
    if not isinstance(index, int):
        index = getattr(parallel_config, "data_parallel_rank", 0)
    size = size if isinstance(size, int) else 1
    index = index if isinstance(index, int) else 0
    if settings.DP_SERVE.get(environ) or size > 1 or index > 0:
        return dp_rank_name(base, index)
    return base


# The shapes elastic KV's targets have had (elastic.py's probe, elastic_alloc.py's block pool), by the vLLM
# release that has it (docs/VLLM.md, "Versions"). The probe takes whichever the installed code has, by what it
# really has, never by its version string; a shape none of them matches stands aside naming what differs.
FREE_BLOCKS = {"vLLM 0.33": ["self", "ordered_blocks"],
               "vLLM 0.34": ["self", "ordered_blocks", "evict_first"]}
ALLOCATE_KV_CACHE = {"vLLM 0.33": ["kv_cache_config", "device", "layout", "kernel_block_sizes"],
                     "vLLM 0.34": ["kv_cache_config", "device", "layout", "kernel_block_sizes", "allocate"]}
# How a block tells that it is prefix-cached: a field (0.33: _block_hash under a property block_hash).
BLOCK_HASH_FIELD = {"vLLM 0.33": "_block_hash", "vLLM 0.34": "block_hash"}
BLOCK_FIELDS = ("block_id", "ref_cnt", "prev_free_block", "next_free_block", "is_null")
