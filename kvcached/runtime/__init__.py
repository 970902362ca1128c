"""kvcached runtime layer: the compiled page extension, the elastic KV pool.

Imported only inside engine processes. ``import kvcached`` and the core
modules never import this package, so ``kvctl`` never loads the extension or
torch. The names below are resolved lazily, so that ``import kvcached.runtime``
alone loads nothing compiled either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .pages import Pages, as_tensor
    from .pool import KVPool, PoolExhausted

__all__ = ["KVPool", "Pages", "PoolExhausted", "as_tensor"]

_HOMES = {
    "Pages": "pages",
    "as_tensor": "pages",
    "KVPool": "pool",
    "PoolExhausted": "pool",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f"{__name__}.{home}"), name)
