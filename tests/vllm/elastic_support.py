"""Driving vLLM 0.33's real Scheduler, KVCacheManager and BlockPool without a model.

The model config comes from a config.json in a temporary directory, naming a
stand-in architecture registered in-process (vLLM inspects the class to fill
in its capabilities; its forward is never called). The KV cache config comes
from vLLM's own planner (`get_kv_cache_config_from_groups`), the KV cache
from the allocation vLLM's model runner calls. Each step builds the model
runner's output by hand, one sampled token per request that finished its
prompt, as vLLM's own scheduler tests do.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from vllm import ModelRegistry
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker import utils as worker_utils

from .. import conftest
from ..engines_common import PAGE, check_or_fail  # noqa: F401 - the elastic tests take both from here

ARCH = "KvcachedStandInForCausalLM"
BLOCK_SIZE = 16
EOS = 999


class KvcachedStandInForCausalLM(nn.Module):
    """A text-generation model class for vLLM's config checks; never instantiated."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def compute_logits(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def embed_input_ids(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


ModelRegistry.register_model(ARCH, KvcachedStandInForCausalLM)

#: Run a test with the elastic-kv patch on and off (the `elastic` fixture of conftest.py).
both = conftest.both("elastic")


def model_dir(root: str) -> str:
    """A directory holding a small Llama-shaped config.json (no weights: nothing loads them)."""
    path = os.path.join(root, "model")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": [ARCH], "model_type": "llama", "hidden_size": 64,
                   "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 4096,
                   "torch_dtype": "float16", "rms_norm_eps": 1e-5, "eos_token_id": EOS}, f)
    return path


def vllm_config(root: str, *, prefix_caching: bool = True, max_num_seqs: int = 16,
                max_batched: int = 512, tp: int = 1, layout: str = "LBHNC") -> VllmConfig:
    """A VllmConfig for the stand-in model on the CPU."""
    mc = ModelConfig(model=model_dir(root), skip_tokenizer_init=True, max_model_len=2048, dtype="float16")
    sc = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched, max_model_len=2048,
                         is_encoder_decoder=False, async_scheduling=False)
    cc = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=prefix_caching)
    pc = ParallelConfig(tensor_parallel_size=tp)
    vc = VllmConfig(model_config=mc, cache_config=cc, scheduler_config=sc, parallel_config=pc,
                    device_config=DeviceConfig(device="cpu"))
    vc.cache_config.kv_cache_layout = layout
    return vc


def spec(num_kv_heads: int = 2, head_size: int = 64) -> FullAttentionSpec:
    """A decoder layer's KV spec: 16 tokens x 2 heads x 64 x fp16 x (K, V) = 8 KiB per block."""
    return FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=num_kv_heads, head_size=head_size,
                             dtype=torch.float16)


def kv_cache_config(vc: VllmConfig, num_blocks: int, layers: int = 2, groups: list[KVCacheGroupSpec] | None = None
                    ) -> Any:
    """vLLM's own plan for `num_blocks` blocks of the given groups (default: `layers` full-attention layers)."""
    if groups is None:
        groups = [KVCacheGroupSpec(layer_names=[f"model.layers.{i}.attn" for i in range(layers)],
                                   kv_cache_spec=spec())]
    per_block = sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in groups)
    cfg = get_kv_cache_config_from_groups(vc, groups, num_blocks * per_block)
    cfg.kv_cache_layout = vc.cache_config.kv_cache_layout
    return cfg


def allocate(cfg: Any, vc: VllmConfig) -> dict[str, torch.Tensor]:
    """What the model runner does with the config: vLLM's allocate_kv_cache, as patched or not."""
    return worker_utils.allocate_kv_cache(cfg, torch.device("cpu"), KVCacheLayout[cfg.kv_cache_layout], None)


def scheduler(vc: VllmConfig, cfg: Any) -> Scheduler:
    """The real Scheduler (its KVCacheManager, coordinator and BlockPool) for `cfg`."""
    vc.cache_config.num_gpu_blocks = cfg.num_blocks
    return Scheduler(vllm_config=vc, kv_cache_config=cfg, structured_output_manager=StructuredOutputManager(vc),
                     block_size=BLOCK_SIZE, hash_block_size=BLOCK_SIZE, log_stats=True)


_hasher = None


def request(rid: str, prompt: list[int], max_tokens: int) -> Request:
    """A request with prefix-cache hashes, finishing after `max_tokens` generated tokens or at `EOS`."""
    global _hasher
    if _hasher is None:
        from vllm.utils.hashing import sha256

        init_none_hash(sha256)
        _hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop_token_ids=[EOS])
    return Request(rid, prompt, params, None, block_hasher=_hasher)


def model_runner_output(ids: list[str], sampled: list[list[int]]) -> Any:
    """The model runner's output for a batch, built with the installed vLLM's own fields.

    0.33's ModelRunnerOutput takes `req_id_to_index`; 0.34 dropped the field.
    """
    from dataclasses import fields

    kw: dict[str, Any] = {"req_ids": ids, "sampled_token_ids": sampled}
    if "req_id_to_index" in {f.name for f in fields(ModelRunnerOutput)}:
        kw["req_id_to_index"] = {r: i for i, r in enumerate(ids)}
    return ModelRunnerOutput(**kw)


@dataclass
class Driver:
    """Runs the scheduler step by step with hand-made model output."""

    sched: Scheduler
    finished: list[str] = field(default_factory=list)
    preempted: int = 0
    steps: int = 0

    def add(self, reqs: Iterable[Request]) -> None:
        for r in reqs:
            self.sched.add_request(r)

    def step(self) -> Any:
        """schedule(), a token for every request past its prompt, update_from_output()."""
        out = self.sched.schedule()
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = self.sched.requests[rid]
            sampled.append([7] if req.num_computed_tokens >= req.num_prompt_tokens else [])
        self.preempted += len(getattr(out, "preempted_req_ids", ()) or ())
        mro = model_runner_output(ids, sampled)
        results = self.sched.update_from_output(out, mro)
        for eco in results.values():
            self.finished += [o.request_id for o in eco.outputs if o.finish_reason is not None]
        self.steps += 1
        return out

    def run(self, max_steps: int = 500, each: Any = None) -> None:
        """Step until nothing is left (calling `each(driver)` after every step)."""
        for _ in range(max_steps):
            if not self.sched.has_requests():
                return
            self.step()
            if each is not None:
                each(self)
        raise AssertionError(f"requests still unfinished after {max_steps} steps")
