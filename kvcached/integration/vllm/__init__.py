"""kvcached inside vLLM 0.33: the plugin vLLM loads, the patches it applies, and what `detect` reports.

The same file names as `sglang/` for the same roles (docs/ARCHITECTURE.md's table says which file each engine
has for each role, and why a cell is empty).

- `plugin`: the `vllm.general_plugins` entry point (`register`), and kvcached's logs in vLLM's stream.
- `patches`: the registry of the five patches below (`REGISTRY`: apply, revert, report).
- `worker_listener`, `claim`, `owner`, `elastic`: one patch each, as SGLang's modules of the same names
  (each module exports `PATCHES`); `lmcache_shutdown`, the fifth, is vLLM's alone (its LMCache connector's
  shutdown is a no-op).
- `elastic_buffers`: the worker side of `elastic`: vLLM's KV cache laid over an elastic buffer, and where each
  block's bytes lie in it.
- `elastic_alloc`: `ElasticBlockPool`, a subclass of vLLM's BlockPool (the one module here that imports vLLM at
  import): the block pool over the elastic core.
- `detect`: vLLM's shutdown conditions and the `vllm` section of kvcached.detect/1.
- `common`: vLLM's module names and the small readings of its objects the patches share.

docs/VLLM.md says what each patch hooks, how it recognises the shape, and what breaks first. A vLLM release
whose shapes differ changes the module of the role that moved (its probe and wrappers) and `common`'s module
names.
"""
