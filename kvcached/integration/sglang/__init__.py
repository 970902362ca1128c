"""kvcached in SGLang serves: the `sglang.srt.plugins` entry point, its patches (one registry), and `detect`.

- `plugin`: the entry point (`kvcached = kvcached.integration.sglang.plugin:register`); applies each patch
  in the SGLang processes that import what it hooks.
- `patches`: the registry. Each patch module exports `PATCHES` (a tuple of `patchkit.Patch`); the registry
  takes every module's tuple, so a new module is one import there.
- `common`: SGLang's module names, readings of SGLang objects, this process's ranks and IPC name, the shapes
  kvcached stands aside from.
- `claim`: the scheduler side (worker socket, segment, usage, giving both back on ShutdownReq).
- `owner`: the owner side (main's `kill_process_tree` and `Engine.shutdown` clean up after confirmed exits).
- `elastic`: the `sglang-elastic-kv` patch, on with ``KVCACHED_ELASTIC=1``; `elastic_pool` and `elastic_alloc`
  are SGLang's MHA/MLA pools and token allocators over reserved ranges (they import SGLang at import, and are
  imported only once the patch applies), `elastic_step` the step boundary's agreement on the limit across the
  TP group.
- `detect`: the `sglang` section of kvcached.detect/1, read by `kvctl doctor`.

Importing `plugin`, `patches`, `common`, `claim`, `owner`, `elastic`, `elastic_step` or `detect` imports
neither SGLang nor torch; the patches import SGLang when applied or probed. docs/SGLANG.md is the reference:
patches, targets, probes, stop paths, elastic KV.
"""
