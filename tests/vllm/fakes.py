"""The parts of a vLLM 0.33 serve that need a GPU or a model, replaced; everything else is vLLM's own.

What runs for real: the clients (`SyncMPClient`, `InprocClient`),
`launch_core_engines`, `CoreEngineProcManager`, `EngineCoreProc.run_engine_core`
with its signal handling, `EngineCoreProc.__init__` with vLLM's handshakes and
IO threads, the busy loop, `EngineCore.shutdown`, the executors
(`UniProcExecutor`, `MultiprocExecutor` with its message queues, worker
processes, death pipes and termination), `WorkerProc` and its
`worker_main`/`worker_busy_loop`, and `Executor.initialize_from_config`.

What is replaced, and why:

- `ServeConfig` stands for `VllmConfig`, which cannot be built here (no device
  to infer, no model to read). Its parallel and cache configs are vLLM's own
  classes; the model, scheduler and device parts are plain values.
- `FakeWorker` is the `worker_cls` (vLLM's own extension point, so spawned
  workers load it too): no device, no model; it answers the RPCs the executor
  makes at start-up.
- `engine_core_init` replaces `EngineCore.__init__`, whose real body profiles
  a model to size the KV cache: it builds the real executor, hands it a KV
  cache config as `_initialize_kv_caches` would, and sets up an idle scheduler.
- On a platform that is not a GPU platform vLLM's `current_platform` is
  `UnspecifiedPlatform`, whose `update_block_size_for_backend` needs an
  attention backend: `install()` makes it a no-op in each process that loads
  this module (spawned workers import it through `worker_cls`).
"""

from __future__ import annotations

import os
import queue
import time
from collections import deque
from types import SimpleNamespace
from typing import Any

from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from vllm.v1.worker.worker_base import WorkerBase

WORKER_CLS = f"{__name__}.FakeWorker"
# Bytes of the KV cache each rank "allocates": what the engine publishes as its prealloc.
KV_BYTES = 64 << 20
# How long the stand-in engine's teardown takes (see _slow_teardown).
TEARDOWN_S = 1.0


def defaults_of(cls: type, **values: Any) -> SimpleNamespace:
    """Every field of vLLM's config dataclass `cls` at vLLM's own default, then `values`.

    The stand-in follows the installed release: a field it adds comes with
    its default, as in a VllmConfig that never set it.
    """
    import dataclasses

    fields: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.default_factory is not dataclasses.MISSING:
            fields[f.name] = f.default_factory()
        elif f.default is not dataclasses.MISSING:
            # pydantic dataclasses keep a FieldInfo as the default of a constrained field
            fields[f.name] = getattr(f.default, "default", f.default)
    fields.update(values)
    return SimpleNamespace(**fields)


class ServeConfig:
    """Stands for VllmConfig: real parallel and cache configs, plain model/scheduler/device values."""

    def __init__(self, tp: int = 1, pp: int = 1, dp: int = 1, *, shutdown_timeout: int = 0,
                 backend: str | None = None, worker_start: str | None = None) -> None:
        kw: dict[str, Any] = {}
        if backend is not None:
            kw["distributed_executor_backend"] = backend
        self.parallel_config = ParallelConfig(
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            data_parallel_size=dp,
            data_parallel_size_local=dp,
            worker_cls=WORKER_CLS,
            **kw,
        )
        self.cache_config = CacheConfig()
        self.cache_config.block_size = 16
        # vLLM's own fields at their defaults (the handshake and the busy loop read more of them with each
        # release: 0.34's checkpoint_prepare_on_startup), then what a real config would derive.
        self.model_config = defaults_of(
            ModelConfig,
            max_model_len=2048,
            dtype="float16",
            is_moe=False,
            multimodal_config=None,
            runner_type="generate",
            is_diffusion=False,
            supports_multimodal_inputs=False,
        )
        self.scheduler_config = defaults_of(
            SchedulerConfig, async_scheduling=False, max_num_seqs=8, max_num_batched_tokens=2048,
            enable_chunked_prefill=False,
        )
        self.device_config = SimpleNamespace(device="cpu")
        self.watchdog_config = SimpleNamespace(dump_dir=None, enable=False)
        self.load_config = self.lora_config = self.speculative_config = None
        self.observability_config = SimpleNamespace(otlp_traces_endpoint=None)
        self.kv_transfer_config = self.weight_transfer_config = None
        self.logging_config = None
        self.shutdown_timeout = shutdown_timeout
        self.instance_id = "kvcached-test"
        # "spawn": the engine starts its workers by multiprocessing spawn, as vLLM
        # forces once CUDA is initialised in the engine (_maybe_force_spawn).
        self.worker_start = worker_start

    @property
    def needs_dp_coordinator(self) -> bool:
        # VllmConfig's own rule for a non-MoE model with internal load balancing.
        return self.parallel_config.data_parallel_size > 1 and not self.parallel_config.data_parallel_external_lb

    def __post_init__(self) -> None:
        """VllmConfig re-validates itself after the handshake; nothing here depends on it."""

    def enable_trace_function_call_for_thread(self) -> None:
        pass


def kv_cache_config(num_blocks: int = 64) -> KVCacheConfig:
    """A KV cache config of vLLM's own classes: one full-attention group over `KV_BYTES`."""
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=__import__("torch").float16)
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(size=KV_BYTES, layers=["layer.0"], layer_stride=KV_BYTES, block_stride=KV_BYTES // num_blocks)
        ],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
    )


class FakeWorker(WorkerBase):
    """A worker without a device or a model: answers the executor's start-up and shutdown RPCs."""

    def __init__(
        self,
        vllm_config: Any,
        local_rank: int,
        rank: int,
        distributed_init_method: str,
        is_driver_worker: bool = False,
        **_kw: Any,
    ) -> None:
        self.vllm_config = vllm_config
        self.parallel_config = vllm_config.parallel_config
        self.local_rank, self.rank = local_rank, rank
        self.is_driver_worker = is_driver_worker
        self.kv_cache_config: Any = None

    def init_device(self) -> None:
        pass

    def load_model(self) -> None:
        pass

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        self.kv_cache_config = kv_cache_config

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


class IdleScheduler:
    """The scheduler of an engine that never gets a request, over vLLM's real KV cache manager (block pool)."""

    connector = ec_connector = None

    def __init__(self, kv_config: KVCacheConfig, max_model_len: int) -> None:
        from vllm.v1.core.kv_cache_manager import KVCacheManager

        self.kv_cache_manager = KVCacheManager(
            kv_config, max_model_len=max_model_len, scheduler_block_size=16, hash_block_size=16, enable_caching=False
        )
        self.held: list[Any] = []

    def has_requests(self) -> bool:
        return False

    def has_unfinished_requests(self) -> bool:
        return False

    def get_num_unfinished_requests(self) -> int:
        return 0

    def finish_requests(self, *_a: Any) -> list[Any]:
        return []

    def get_kv_event_publisher_config(self) -> None:
        return None

    def get_kv_connector(self) -> None:
        return None

    def get_request_counts(self) -> tuple[int, int]:
        return 0, 0

    def get_kv_cache_usage(self) -> float:
        return self.kv_cache_manager.usage

    def shutdown(self) -> None:
        pass


def engine_core_init(
    self: Any,
    vllm_config: Any,
    executor_class: type,
    log_stats: bool,
    executor_fail_callback: Any = None,
    include_finished_set: bool = False,
) -> None:
    """In place of EngineCore.__init__: the real executor, no model; KV cache sized as if profiled."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    if vllm_config.worker_start is not None:
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = vllm_config.worker_start
    self.vllm_config = vllm_config
    self.log_stats = log_stats
    self._weight_version = "default"
    self.model_executor = executor_class(vllm_config)
    if executor_fail_callback is not None:
        self.model_executor.register_failure_callback(executor_fail_callback)
    # What _initialize_kv_caches ends with: every worker gets its KV cache config.
    world = vllm_config.parallel_config.world_size
    self.model_executor.initialize_from_config([kv_cache_config() for _ in range(world)])
    self.structured_output_manager = SimpleNamespace(clear_backend=_slow_teardown)
    self.scheduler = IdleScheduler(kv_cache_config(), vllm_config.model_config.max_model_len)
    self.use_spec_decode = False
    self.check_for_draft_tokens = False
    self.batch_queue_size = 1
    self.batch_queue: deque[Any] | None = None
    self.is_mm_encoder_only = False
    self.is_pooling_model = False
    self.request_block_hasher = None
    self.step_fn = lambda: ({}, False)
    self.async_scheduling = False
    self.aborts_queue = queue.Queue()
    self._idle_state_callbacks: list[Any] = []
    self.mm_receiver_cache = None
    self._pooler_config_logged = False
    self.available_gpu_memory_for_kv_cache = KV_BYTES
    self.prefix_hash_config = None  # 0.34: what frontends hash prompts with; None without prefix caching
    from vllm.v1.engine.core import EngineCoreProc

    if isinstance(self, EngineCoreProc):
        check_ready_response(self)


class StandInOutOfDate(AssertionError):
    """The installed vLLM's start-up reads something the stand-in engine does not have."""


def check_ready_response(engine: Any) -> None:
    """Build the installed vLLM's own READY response from the stand-in engine, as its input thread will.

    EngineCoreProc's input thread sends it first, and a thread that dies of
    an AttributeError only leaves "Input socket thread died during startup"
    behind. Built here, in the engine's start-up, a release that reads more
    of the engine stops every serve at one place, with what it read.
    """
    import msgspec
    from vllm import __version__
    from vllm.v1.engine.core import EngineCoreProc

    make = getattr(EngineCoreProc, "_make_ready_response", None)
    if make is None:
        return
    try:
        msgspec.msgpack.encode(make(engine))
    except Exception as e:
        raise StandInOutOfDate(
            f"vLLM {__version__}'s EngineCoreProc._make_ready_response fails on the stand-in engine "
            f"({type(e).__name__}: {e}): give tests/vllm/fakes.py's engine_core_init what it reads") from e


def _slow_teardown() -> None:
    # EngineCore.shutdown()'s first step. A real engine's teardown (CUDA, NCCL,
    # the model) takes seconds; vLLM's shutdown(timeout=0) SIGKILLs it within
    # milliseconds of its SIGTERM. Being as slow keeps that race the way it is.
    time.sleep(TEARDOWN_S)


def take_blocks(self: Any, n: int) -> float:
    """An engine utility (client.call_utility): hold `n` blocks of the real block pool, as running requests do."""
    pool = self.scheduler.kv_cache_manager.block_pool
    if n >= 0:
        self.scheduler.held += pool.get_new_blocks(n)
    else:
        pool.free_blocks(self.scheduler.held[n:])
        del self.scheduler.held[n:]
    return self.scheduler.kv_cache_manager.usage


def install() -> None:
    """Make this process's vLLM run without a GPU platform (see the module docstring)."""
    from vllm.platforms import current_platform

    type(current_platform).update_block_size_for_backend = classmethod(lambda cls, cfg: None)


def install_engine() -> None:
    """In this (serve) process: engines built from here have no model (fork: the engine inherits this)."""
    from vllm.v1.engine.core import EngineCore

    EngineCore.__init__ = engine_core_init  # type: ignore[method-assign]
    EngineCore.kvcached_test_take_blocks = take_blocks  # type: ignore[attr-defined]


install()
