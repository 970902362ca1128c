"""kvcached inside vLLM 0.33: the plugin vLLM loads, the patches it applies, and what `detect` reports.

- `plugin`: the `vllm.general_plugins` entry point (`register`), and kvcached's logs in vLLM's stream.
- `patches`: the registry of the five patches below (`REGISTRY`: apply, revert, report).
- `claim`, `worker_listener`, `owner`, `lmcache_shutdown`, `elastic`: one patch each (each module exports
  `PATCHES`, as SGLang's do; `claim`, `owner` and `elastic` have SGLang's twins of the same name).
- `kvlayout`: where vLLM's KV cache puts each block's bytes (what `elastic` maps).
- `elastic_alloc`: `ElasticBlockPool`, a subclass of vLLM's BlockPool (the one module here that imports vLLM at import).
- `detect`: vLLM's shutdown conditions and the `vllm` section of kvcached.detect/1.
- `common`: vLLM's module names and the small readings of its objects the patches share.

docs/VLLM.md says what each patch hooks, how it recognises the shape, and what breaks first.
"""
