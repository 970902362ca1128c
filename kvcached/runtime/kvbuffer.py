"""A worker's elastic KV cache buffer, and the engine's link to every worker's.

`KVBuffer` is what replaces an engine's one big KV cache allocation in a
worker: a reserved virtual range (`Pages`) as large as the allocation, with
physical pages mapped only for the groups of blocks (logical pages) the
engine's block pool has handed out. A `PagePlan` says which physical pages a
group needs; neighbouring groups may share a page, so the buffer counts
references per physical page and maps or unmaps a page only on the first or
last reference. The pages of block 0 (vLLM's null block, and the slot that
warm-up runs write) are mapped from the start.

The engine reaches the buffers through a link (`kvcached.runtime.elastic.PageLink`,
groups as its indices): `LocalLink` when the worker runs in the engine's own
process (TP = PP = 1), `SocketLink` when workers are processes serving the
worker listener (one request per worker per change, the commands of
`kvcached.runtime.pool`, offsets in units of the nominal page size:
``offset = group * page_size``). A worker serves them through the page server
every worker serves (`KVBuffer.register`, `kvcached.runtime.ipc.page_server`),
over its `LocalLink`. Both links are all or nothing: a change that fails on
one worker is undone on those that made it, and the error reaches the engine
as `MapError`, which vLLM reports as an engine failure.

CPU pages read as zeros when mapped. CUDA pages come with whatever the
device held, so the buffer zeroes newly mapped CUDA pages before it
answers: an engine allocates its KV cache zeroed, and attention kernels
multiply masked slots by zero, which NaN bytes would survive.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvcached.node import IpcError, Layout
from kvcached.runtime.ipc.client import Client
from kvcached.runtime.ipc.listener import WorkerListener
from kvcached.runtime.ipc.page_server import PageServer
from kvcached.runtime.ipc.protocol import CMD_CONFIGURE, CMD_INFO

from .kvplan import Footprint, PagePlan, agree_blocks_per_page, min_blocks_per_page
from .pages import DEFAULT_PAGE_SIZE, Pages, PartialUnmapError, as_tensor
from .pool import BroadcastMapper, MapError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class KVBuffer:
    """One worker's KV cache: a reserved range, physical pages mapped per group of blocks."""

    def __init__(self, footprint: Footprint, page_size: int = DEFAULT_PAGE_SIZE, *,
                 device: str = "cpu") -> None:
        self.footprint = footprint
        self.page_size = page_size
        self.min_blocks_per_page = min_blocks_per_page(footprint, page_size)
        self.plan = PagePlan(footprint, page_size, self.min_blocks_per_page)
        self.configured = False
        self._lock = threading.Lock()
        self._refs = [0] * self.plan.num_pages
        self._groups: set[int] = set()
        self.pages = Pages(self.plan.num_pages, page_size, device=device)
        self.device = self.pages.device
        self._flat: torch.Tensor | None = None
        self._zero_stream: Any = None
        # Block 0 from the start: the null block, and slot 0 that warm-up runs write.
        self._pinned = self.plan.pages_of_blocks(range(0, 1))
        self._acquire(self._pinned)

    def tensor(self) -> torch.Tensor:
        """The buffer as a flat int8 tensor of exactly `footprint.size` bytes (zero-copy)."""
        import torch

        if self._flat is None:
            self._flat = as_tensor(self.pages, dtype=torch.int8)
        return self._flat[: self.footprint.size]

    # -- engine commands ---------------------------------------------------------

    def info(self) -> dict[str, Any]:
        """What the engine needs to agree on a group size with the other workers."""
        return {"elastic": True, "num_blocks": self.footprint.num_blocks, "page_size": self.page_size,
                "min_blocks_per_page": self.min_blocks_per_page, "device": self.device}

    def configure(self, blocks_per_page: int) -> dict[str, Any]:
        """Adopt the engine's group size and map group 0; returns the cost of one group, in pages."""
        with self._lock:
            if self.configured and blocks_per_page != self.plan.blocks_per_page:
                raise ValueError(f"already configured with {self.plan.blocks_per_page} blocks per page")
            if not self.configured:
                if self._groups:
                    raise ValueError("groups are mapped before the group size was agreed")
                self.plan = PagePlan(self.footprint, self.page_size, blocks_per_page)
                self._map_locked([0])
                self._release(self._pinned)  # group 0 holds block 0 now
                self._pinned = []
                self.configured = True
            return {"pages_per_group": self.plan.max_pages_per_group(), "num_groups": self.plan.num_groups,
                    "mapped_groups": sorted(self._groups)}

    def map_groups(self, groups: Sequence[int]) -> None:
        """Map every physical page `groups` need, all or nothing."""
        with self._lock:
            self._require_configured()
            self._map_locked(groups)

    def unmap_groups(self, groups: Sequence[int]) -> None:
        """Drop `groups`; their pages no other mapped group shares are unmapped."""
        with self._lock:
            self._require_configured()
            bad = [g for g in groups if g not in self._groups]
            if bad or len(set(groups)) != len(groups):
                raise ValueError(f"groups {bad[:8] or list(groups)[:8]} are not mapped (or repeated)")
            pages = [p for g in groups for p in self.plan.pages_of(g)]
            self._groups.difference_update(groups)
            self._release(pages)

    def mapped_groups(self) -> list[int]:
        """Groups mapped now, ascending."""
        with self._lock:
            return sorted(self._groups)

    @property
    def mapped_bytes(self) -> int:
        """Physical memory mapped now."""
        return self.pages.mapped_bytes

    # -- reference-counted physical pages (lock held) ------------------------------

    def _map_locked(self, groups: Sequence[int]) -> None:
        if len(set(groups)) != len(groups) or self._groups.intersection(groups):
            raise ValueError(f"groups {list(groups)[:8]} are mapped already (or repeated)")
        pages = [p for g in groups for p in self.plan.pages_of(g)]
        self._acquire(pages)
        self._groups.update(groups)

    def _acquire(self, pages: Sequence[int]) -> None:
        refs = self._refs
        fresh = sorted({p for p in pages if refs[p] == 0})
        if fresh:
            self.pages.map(fresh)  # all or nothing
            if self.device.startswith("cuda"):
                try:
                    self._zero(fresh)
                except BaseException:
                    self.pages.unmap(fresh)
                    raise
        for p in pages:
            refs[p] += 1

    def _release(self, pages: Sequence[int]) -> None:
        refs = self._refs
        for p in pages:
            refs[p] -= 1
        dead = sorted({p for p in pages if refs[p] == 0})
        if dead:
            try:
                self.pages.unmap(dead)
            except PartialUnmapError as e:
                # Those still mapped keep a reference so that the books match the range.
                for p in e.failed:
                    refs[p] = 1
                raise MapError(f"unmapping pages {sorted(e.failed)[:8]} failed: {e}") from e

    def _zero(self, pages: Sequence[int]) -> None:
        import torch

        flat = as_tensor(self.pages) if self._flat is None else self._flat
        if self._zero_stream is None:
            self._zero_stream = torch.cuda.Stream(device=flat.device)
        ps = self.page_size
        with torch.cuda.stream(self._zero_stream):
            for p in pages:
                flat[p * ps:(p + 1) * ps].zero_()
        self._zero_stream.synchronize()

    def _require_configured(self) -> None:
        if not self.configured:
            raise ValueError("the engine has not configured this KV buffer yet")

    # -- the worker listener ---------------------------------------------------------

    def register(self, listener: WorkerListener) -> PageServer:
        """Serve the engine's commands for this buffer on `listener`: its own two, and the page server's."""
        listener.register(CMD_INFO, lambda _a: self.info())
        listener.register(CMD_CONFIGURE, lambda a: self.configure(_int(a, "blocks_per_page")))
        return PageServer(listener, LocalLink(self))


def _int(args: dict[str, Any], key: str) -> int:
    value = args.get(key)
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{key} must be a positive int")
    return value


# -- this process's buffer (the engine finds it when its worker runs in-process) ----

_local: KVBuffer | None = None
_local_lock = threading.Lock()


def set_local_buffer(buf: KVBuffer | None) -> None:
    """Record the buffer this process's worker allocated last (vLLM allocates again after profiling)."""
    global _local
    with _local_lock:
        _local = buf


def local_buffer() -> KVBuffer | None:
    """The buffer this process's worker allocated, if any."""
    return _local


# -- the engine's side ------------------------------------------------------------


@dataclass(frozen=True)
class LinkSetup:
    """What the engine and every worker agreed: the group size, and what one group costs a rank."""

    blocks_per_page: int
    pages_per_group: int  # physical pages, the most any worker maps for one group
    page_size: int
    num_groups: int
    mapped_groups: tuple[int, ...]  # mapped at setup (group 0)

    @property
    def group_bytes(self) -> int:
        """Memory one group costs the rank that holds the most of it."""
        return self.pages_per_group * self.page_size


def _agree(infos: list[dict[str, Any]], num_blocks: int, where: list[str]) -> int:
    for w, info in zip(where, infos):
        if not info.get("elastic"):
            raise MapError(f"{w}: the KV cache there is not elastic ({info.get('why', 'no reason given')})")
        if info.get("num_blocks") != num_blocks:
            raise MapError(f"{w}: the KV buffer has {info.get('num_blocks')} blocks, the engine {num_blocks}")
    return agree_blocks_per_page([int(i["min_blocks_per_page"]) for i in infos])


class LocalLink:
    """The worker is in this process: change its buffer directly."""

    def __init__(self, buf: KVBuffer) -> None:
        self.buf = buf

    def setup(self, num_blocks: int) -> LinkSetup:
        """Configure the buffer with its own group size."""
        g = _agree([self.buf.info()], num_blocks, ["this process"])
        try:
            r = self.buf.configure(g)
        except ValueError as e:
            raise MapError(str(e)) from e
        return LinkSetup(g, r["pages_per_group"], self.buf.page_size, r["num_groups"],
                         tuple(r["mapped_groups"]))

    def map(self, groups: Sequence[int]) -> None:
        """Map `groups`, all or nothing."""
        self._apply(self.buf.map_groups, groups)

    def unmap(self, groups: Sequence[int]) -> None:
        """Unmap `groups`."""
        self._apply(self.buf.unmap_groups, groups)

    def _apply(self, act: Any, groups: Sequence[int]) -> None:
        try:
            act(list(groups))
        except MapError:
            raise
        except (OSError, RuntimeError, ValueError, IndexError) as e:
            raise MapError(f"{act.__name__} {list(groups)[:8]}: {e}") from e

    def mapped(self) -> dict[str, list[int]]:
        """{"local": mapped groups}."""
        return {"local": self.buf.mapped_groups()}

    # What the worker's page server reads (kvcached.runtime.ipc.page_server.ServedPages): a group is an index.

    @property
    def unit(self) -> int:
        """Bytes one group stands for in an offset: the nominal page size (``offset = group * page_size``)."""
        return self.buf.page_size

    @property
    def extent(self) -> int:
        """Groups the buffer has."""
        return self.buf.plan.num_groups

    @property
    def mapped_bytes(self) -> int:
        """Physical memory the buffer maps now."""
        return self.buf.mapped_bytes

    def mapped_indices(self) -> list[int]:
        """Groups mapped now."""
        return self.buf.mapped_groups()


class SocketLink:
    """Workers in other processes (TP × PP of them): their listeners apply the changes."""

    def __init__(self, layout: Layout, name: str, tp_size: int, pp_size: int = 1, *,
                 page_size: int = DEFAULT_PAGE_SIZE, timeout: float = 30.0) -> None:
        self.broadcast = BroadcastMapper(layout, name, tp_size, pp_size, page_size=page_size, timeout=timeout)
        self.paths = self.broadcast.paths
        self.timeout = timeout

    def _call_all(self, command: str, **args: Any) -> list[dict[str, Any]]:
        try:
            return [Client(p, self.timeout).call(command, **args) for p in self.paths]
        except IpcError as e:
            raise MapError(f"{command}: {e}") from e

    def setup(self, num_blocks: int) -> LinkSetup:
        """Agree a group size with every worker, configure them all, map group 0 everywhere."""
        infos = self._call_all(CMD_INFO)
        g = _agree(infos, num_blocks, self.paths)
        sizes = {int(i["page_size"]) for i in infos}
        if sizes != {self.broadcast.page_size}:
            raise MapError(f"workers use page sizes {sorted(sizes)}, the engine {self.broadcast.page_size}")
        replies = self._call_all(CMD_CONFIGURE, blocks_per_page=g)
        mapped = {tuple(r["mapped_groups"]) for r in replies}
        if len(mapped) != 1:
            raise MapError(f"workers disagree on the groups mapped at setup: {sorted(mapped)}")
        return LinkSetup(g, max(int(r["pages_per_group"]) for r in replies), self.broadcast.page_size,
                         int(replies[0]["num_groups"]), mapped.pop())

    def map(self, groups: Sequence[int]) -> None:
        """Map on every worker; on a failure, unmap from those that already did."""
        self.broadcast.map(groups)

    def unmap(self, groups: Sequence[int]) -> None:
        """Unmap on every worker; on a failure, map back on those that already did."""
        self.broadcast.unmap(groups)

    def mapped(self) -> dict[str, list[int]]:
        """Each worker's mapped groups, by socket path."""
        try:
            return self.broadcast.mapped_pages()
        except IpcError as e:
            raise MapError(str(e)) from e
