"""What both engines' elastic KV takes from its deployment, independent of any engine's classes.

The elastic core (`kvcached.runtime.elastic`) knows no engine and reads no
setting; each engine's adapter over it (`vllm/elastic_alloc.py`'s block pool,
`sglang/elastic_alloc.py`'s allocators) is built from what is here:

- the segment it follows: the one this process's engine claimed
  (`engine_claim`), else the deployment's by name, picked up once someone
  creates it; and the engine's usage handed over to the pool, which knows
  the mapped pages;
- the `SegmentLimit` it reads that segment through, mapped by the extension
  where it is built;
- the release settings, in seconds (SGLang's allocator counts nanoseconds:
  it converts at its edge).

No engine, no torch and not the extension at import.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from .. import settings
from ..runtime.elastic import SegmentLimit
from .limits import limit_mapper

log = logging.getLogger(__name__)


def segment_to_follow(name: str) -> str:
    """The segment an elastic pool follows: the one this process's engine claimed, else deployment `name`'s."""
    from . import layout_from_env
    from .engine_claim import claimed_segment

    claimed = claimed_segment()
    return claimed.path if claimed is not None else layout_from_env().segment_path(name)


def take_over_usage() -> None:
    """From now on the elastic pool publishes used/prealloc: the engine's own (whole-cache) figures would contradict
    it. Never raises."""
    try:
        from .engine_claim import current_engine

        engine = current_engine()
        if engine is not None:
            engine.defer_usage()
    except Exception as e:  # the figures are informational: never fail the engine for them
        log.debug("kvcached: engine usage not handed over: %s", e)


def segment_limit(path: str | None, *, locate: Callable[[], str | None] | None = None, fallback: str,
                  logger: logging.Logger) -> SegmentLimit:
    """The limit an engine's pool reads once per step: the core's `SegmentLimit`, through the extension's mapping.

    `fallback` says in the warning what the pool does while no segment can be read.
    """
    return SegmentLimit(path, locate=locate, mapper=limit_mapper(), logger=logger, fallback=fallback)


@dataclass(frozen=True)
class ReleaseSettings:
    """When an engine's pool gives free pages back (settings ELASTIC_RESERVE_PAGES, ELASTIC_RELEASE_DELAY_S)."""

    reserve: int  # free pages (SGLang: groups) kept mapped for the next requests
    delay_s: float  # seconds a free page stays mapped while requests run


def release_settings() -> ReleaseSettings:
    """The release settings now (read at each pool's start)."""
    return ReleaseSettings(max(0, settings.ELASTIC_RESERVE_PAGES.get()),
                           max(0.0, settings.ELASTIC_RELEASE_DELAY_S.get()))
