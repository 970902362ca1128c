"""kvcached inside SGLang 0.5.23 (docs/SGLANG.md).

- `elastic`: the `sglang-elastic-kv` patch (`PATCHES`), on with ``KVCACHED_ELASTIC=1``.
- `elastic_pool`, `elastic_alloc`: SGLang's MHA/MLA pools and token allocators over reserved ranges (they import
  SGLang at import; nothing else here does).
- `elastic_step`: the step boundary's agreement on the limit across the TP group, and the segment it is read from.
"""
