"""The page commands a worker serves on its listener: one server, and one set of checks, for every worker.

The engine owner changes its workers' KV caches with upstream's commands and
byte offsets (`protocol.CMD_MAP`, ``offset = index * unit``). The harness's
workers (`kvcached.runtime.pool.attach_worker`) and the engines' workers
(`kvcached.runtime.kvbuffer.KVBuffer.register`: vLLM's worker listener,
SGLang's scheduler) serve them through this one `PageServer`, so the harness
runs the path the engines run. Offsets are checked before the KV cache sees
them: a list of ints, each non-negative, a whole number of units, naming an
index inside what is served. A bad request is refused with nothing changed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ..elastic import PageLink
from .listener import WorkerListener
from .protocol import CMD_CREATE, CMD_CREATED, CMD_MAP, CMD_MAPPED, CMD_UNMAP

#: How a worker whose owner creates its KV cache makes it: (the create command's args, what is served now) -> target.
Create = Callable[[dict[str, Any], "ServedPages | None"], "ServedPages"]


class ServedPages(PageLink, Protocol):
    """What a page server changes: the one link (map, unmap by index), and what its checks and replies read."""

    @property
    def unit(self) -> int:
        """Bytes one index stands for in an offset."""

    @property
    def extent(self) -> int:
        """How many indices an offset may name (0 to extent - 1)."""

    @property
    def mapped_bytes(self) -> int:
        """Physical memory mapped now."""

    def mapped_indices(self) -> list[int]:
        """Indices mapped now, ascending."""


class PageServer:
    """Serve a worker's page commands on `listener`, over `target`.

    `create`: the owner creates the target (the harness's workers,
    ``create_kv_tensors``); until then there is none and the page commands
    are refused. Without it the target is the worker's own, made before.
    """

    def __init__(self, listener: WorkerListener, target: ServedPages | None = None, *,
                 create: Create | None = None) -> None:
        self._target = target
        self._lock = threading.Lock()
        if create is not None:
            listener.register(CMD_CREATE, lambda a: self._create(create, a))
        listener.register(CMD_CREATED, lambda _a: {"created": self._target is not None})
        listener.register(CMD_MAP, self.map)
        listener.register(CMD_UNMAP, self.unmap)
        listener.register(CMD_MAPPED, self.mapped)

    @property
    def target(self) -> ServedPages | None:
        """What this server changes, once there is one."""
        return self._target

    def _create(self, create: Create, args: dict[str, Any]) -> dict[str, Any]:
        with self._lock:  # two owners' creates at once must not both make one
            self._target = create(args, self._target)
        return {"created": True}

    def _served(self) -> ServedPages:
        target = self._target
        if target is None:
            raise ValueError("KV tensors are not created yet")
        return target

    def map(self, args: dict[str, Any]) -> dict[str, Any]:
        """``map_to_kv_tensors``: map what `args["offsets"]` name, all or nothing."""
        target = self._served()
        target.map(indices_of(args.get("offsets"), target.unit, target.extent))
        return {"mapped_bytes": target.mapped_bytes}

    def unmap(self, args: dict[str, Any]) -> dict[str, Any]:
        """``unmap_from_kv_tensors``: unmap what `args["offsets"]` name."""
        target = self._served()
        target.unmap(indices_of(args.get("offsets"), target.unit, target.extent))
        return {"mapped_bytes": target.mapped_bytes}

    def mapped(self, _args: dict[str, Any]) -> dict[str, Any]:
        """``kv_pages_mapped``: the indices mapped, and their memory."""
        target = self._target
        if target is None:
            return {"pages": [], "mapped_bytes": 0}
        return {"pages": target.mapped_indices(), "mapped_bytes": target.mapped_bytes}


def indices_of(offsets: object, unit: int, extent: int) -> Sequence[int]:
    """The indices byte `offsets` name; ValueError unless each is a non-negative multiple of `unit` below `extent`."""
    if not isinstance(offsets, list) or not all(isinstance(o, int) and o >= 0 for o in offsets):
        raise ValueError("offsets must be a list of non-negative ints")
    if any(o % unit for o in offsets):
        raise ValueError(f"offsets must be multiples of the page size {unit}")
    indices = [o // unit for o in offsets]
    past = [o for o, i in zip(offsets, indices) if i >= extent]
    if past:
        raise ValueError(f"offsets {past[:4]} lie past the {extent} pages served ({extent * unit} bytes)")
    return indices
