"""The limit an engine claims its segment with: `KVCACHED_LIMIT`, or a share of the device's memory.

- `KVCACHED_LIMIT=40G` (any size `kvctl limit` takes: `512M`, `1.5GiB`, bytes),
- `KVCACHED_LIMIT=80%`: that share of one device's total memory,
- unset: vLLM's own share, `--gpu-memory-utilization` (default 0.9), of one
  device's total memory: the most this engine may take on its GPU.

A `KVCACHED_LIMIT` that does not parse is warned about once and the default
used (settings.LIMIT): the default is the share vLLM itself would take without
kvcached. No vLLM or torch import here: the caller passes the device's memory in
(`device_memory`, from the engine's platform).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .. import settings
from ..node import BadValue, MappedReader, format_size

ENV_LIMIT = settings.LIMIT.name


@dataclass(frozen=True)
class Limit:
    """A limit in bytes and where it came from (for the log line an operator reads)."""

    total: int
    source: str


def resolve_limit(device_total: Callable[[], int | None], utilization: float,
                  environ: Mapping[str, str] | None = None) -> Limit:
    """The limit this engine claims with; raises BadValue when a share of device memory is wanted but unknown.

    `device_total` is called only when a share of device memory is wanted, and
    may return None when the memory is unknown (then a share cannot be used).
    """
    asked = settings.LIMIT.get(environ)
    raw = (settings.LIMIT.raw(environ) or "").strip()
    if asked is not None and asked.bytes is not None:
        return Limit(asked.bytes, f"{ENV_LIMIT}={raw}")
    share = asked.share if asked is not None and asked.share is not None else utilization
    if not 0 < share <= 1:
        raise BadValue(f"gpu_memory_utilization {utilization!r} is not a share in (0, 1]")
    total = device_total()
    if total is None or total <= 0:
        raise BadValue(f"cannot take {share:.0%} of device memory: the device's memory is unknown; "
                       f"set {ENV_LIMIT} to a size, e.g. {ENV_LIMIT}=40G")
    why = f"{ENV_LIMIT}={raw}" if asked is not None else "gpu_memory_utilization"
    return Limit(int(total * share), f"{share:.0%} of {format_size(total)} device memory ({why})")


def device_memory(platform_total: Callable[[], int]) -> int | None:
    """One device's total memory: what the engine's platform says (`platform_total`), else the host's.

    The platform's answer fails where there is no GPU platform (an engine's
    CPU backend, the tests): its KV cache then lives in host memory, so the
    host's memory is the device's. None when neither can be read.
    """
    try:
        return int(platform_total())
    except Exception:
        pass
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:
        return None


def limit_mapper() -> Callable[[int], MappedReader] | None:
    """What an engine's `LimitWatch` maps its segment with: the extension's MappedWord, or None without it.

    The per-step limit read is then a load, not a pread, a system call less at every
    scheduler step (bench_sglang.py, bench_elastic.py; bench/README.md).
    """
    try:
        from ..runtime._kvpages import MappedWord
    except ImportError:  # the extension is optional (built where a compiler is): pread then
        return None
    return MappedWord
