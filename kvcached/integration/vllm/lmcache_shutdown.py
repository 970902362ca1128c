"""The `lmcache-shutdown` patch: `LMCacheConnectorV1.shutdown()` forwards to the LMCache engine it wraps.

vLLM 0.33's connector inherits the base class's no-op `shutdown()`, so the
wrapped LMCache engine is never stopped and its threads keep EngineCore alive
until it is force-killed (docs/NODE.md §4). Where vLLM's connector defines
`shutdown()` itself (the direction of vLLM PR #62821), the patch is not needed.
"""

from __future__ import annotations

import logging
from typing import Any

from ..patchkit import Changes, NotNeeded, Patch, ShapeError, is_ours
from .common import M_LMCACHE, module, source

log = logging.getLogger(__name__)

_DONE = "_kvcached_lmcache_shutdown_done"  # on a connector: forwarded already


def probe() -> Any:
    """vLLM's LMCacheConnectorV1, when it inherits the no-op shutdown and keeps its engine in `_lmcache_engine`."""
    cls = module(M_LMCACHE).LMCacheConnectorV1
    own = cls.__dict__.get("shutdown")
    if own is not None and not is_ours(own):
        raise NotNeeded("vLLM's LMCacheConnectorV1 defines shutdown() itself (it forwards)")
    if "self._lmcache_engine" not in (source(cls.__init__) or ""):
        raise ShapeError("LMCacheConnectorV1.__init__ no longer assigns self._lmcache_engine")
    if not callable(getattr(cls, "shutdown", None)):
        raise ShapeError("LMCacheConnectorV1 has no inherited shutdown() to override")
    return cls


def _shutdown(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # ensure_kv_transfer_shutdown() calls this once per worker, but other
    # teardown paths may too: forward exactly once.
    if instance.__dict__.get(_DONE):
        return None
    instance.__dict__[_DONE] = True
    forward_shutdown(instance)
    return wrapped(*args, **kwargs)


def install(changes: Changes, cls: Any) -> None:
    """Override the inherited shutdown() on LMCacheConnectorV1 (undo removes the override)."""
    changes.wrap(cls, "shutdown", _shutdown)


def forward_shutdown(connector: Any) -> None:
    """Stop the LMCache engine or adapter `connector` wraps: its shutdown(), else close(); logged, never raises."""
    engine = getattr(connector, "_lmcache_engine", None)
    if engine is None:
        log.info("kvcached: LMCacheConnectorV1.shutdown(): no LMCache engine to stop")
        return
    kind = type(engine).__qualname__
    # LMCache's own adapter has shutdown(); vLLM's native adapter (use_native=True)
    # has none in 0.33, so take whatever cleanup it offers, and say so when none.
    for method in ("shutdown", "close"):
        fn = getattr(engine, method, None)
        if callable(fn):
            log.info("kvcached: forwarding LMCacheConnectorV1.shutdown() to %s.%s()", kind, method)
            try:
                fn()
            except Exception as e:  # a failing LMCache teardown must not stop the worker's
                log.warning("kvcached: %s.%s() failed: %s", kind, method, e)
            return
    log.warning("kvcached: the LMCache adapter %s offers no shutdown() or close(); LMCache threads may keep "
                "EngineCore alive until it is force-killed", kind)


PATCH = Patch(
    name="lmcache-shutdown",
    does="adds LMCacheConnectorV1.shutdown() forwarding to the wrapped LMCache engine/adapter",
    targets=(f"{M_LMCACHE}:LMCacheConnectorV1.shutdown",),
    probe=probe,
    install=install,
)

PATCHES: tuple[Patch, ...] = (PATCH,)
