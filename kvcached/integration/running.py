"""What every integration shares in one process: the engines it runs and the worker listener it serves.

At the bottom of the integration's import graph (standard library only), so
that the patches, the elastic buffer and the block pool reach this state
without importing one another. The typed views are `engine_claim.current_engine`
and `engine_claim.claimed_segment` (engines), `current_worker_listener` here.
"""

from __future__ import annotations

import threading
from typing import Any

_lock = threading.Lock()
_engines: list[Any] = []  # EngineState objects, oldest first: in-process engines may come and go
_listener: Any = None  # the WorkerListener this process serves (a worker, or the engine at TP=1)


def add_engine(engine: Any) -> None:
    """Record an engine this process now runs."""
    with _lock:
        _engines.append(engine)


def remove_engine(engine: Any) -> None:
    """Forget an engine that gave back what it held (no error when unknown)."""
    with _lock:
        if engine in _engines:
            _engines.remove(engine)


def latest_engine() -> Any:
    """The engine started last and not yet shut down, or None."""
    with _lock:
        return _engines[-1] if _engines else None


def set_worker_listener(listener: Any) -> None:
    """`listener` is the one this process serves from now on."""
    global _listener
    with _lock:
        _listener = listener


def clear_worker_listener(listener: Any) -> None:
    """`listener` stopped: forget it, unless another has taken its place meanwhile."""
    global _listener
    with _lock:
        if _listener is listener:
            _listener = None


def current_worker_listener() -> Any:
    """The WorkerListener this process serves, if any (the runtime registers its commands on it)."""
    return _listener
