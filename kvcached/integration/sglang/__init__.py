"""kvcached in SGLang serves: the `sglang.srt.plugins` entry point, its patches (one registry), and `detect`.

The same file names as `vllm/` for the same roles (docs/ARCHITECTURE.md's table says which file each engine
has for each role, and why a cell is empty).

- `plugin`: the entry point (`kvcached = kvcached.integration.sglang.plugin:register`); applies each patch
  in the SGLang processes that import what it hooks.
- `patches`: the registry. Each patch module exports `PATCHES` (a tuple of `patchkit.Patch`); the registry
  takes every module's tuple, so a new module is one import there.
- `common`: SGLang's module names, readings of SGLang objects, this process's ranks and IPC name, its
  scheduler's `EngineState`, the shapes kvcached stands aside from.
- `worker_listener`: each scheduler serves its worker socket.
- `claim`: the scheduler's claim (segment, usage, giving back on ShutdownReq and at exit).
- `owner`: the owner side (main's `kill_process_tree` and `Engine.shutdown` clean up after confirmed exits).
- `elastic`: the `sglang-elastic-kv` patch, on with ``KVCACHED_ELASTIC=1``; `elastic_buffers` and
  `elastic_alloc` are SGLang's MHA/MLA pools laid over reserved ranges and its token allocators over the
  elastic core (they import SGLang at import, and are imported only once the patch applies),
  `elastic_ranks` what the TP ranks agree on at each step boundary (vLLM has no counterpart: its one
  scheduler maps every worker's pages itself).
- `detect`: the `sglang` section of kvcached.detect/1, read by `kvctl doctor`.

Importing `plugin`, `patches`, `common`, `worker_listener`, `claim`, `owner`, `elastic`, `elastic_ranks` or
`detect` imports neither SGLang nor torch; the patches import SGLang when applied or probed. docs/SGLANG.md is
the reference: patches, targets, probes, stop paths, elastic KV.
"""
