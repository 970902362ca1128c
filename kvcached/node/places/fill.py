"""How full a place is, and what fills it: its filesystem's size and use (statvfs), its entries' bytes by kind.

A place's fill is what makes the next start there fail ("No space left on
device", an NCCL error, a DataLoader "Bus error") long before anything is
stale: the Kubernetes metrics of memory-backed volumes leave it out. The
measure is one open and one fstatvfs of the place's directory, checked to be
the filesystem the place was found on; what fills it comes from the entries
a run judged there, so it costs no scan of its own (docs/PLACES.md §6).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from ..base.enums import Action, State
from ..base.layout import Layout
from ..base.place import HOST, Place, dev_text

if TYPE_CHECKING:
    from ..clean.facts import Facts
    from ..clean.report import Entry

# How many of a place's biggest entries its fill names (inspect -A, doctor capacity).
LARGEST = 5


class Fill(NamedTuple):
    """A place's filesystem as statvfs sees it: size and use in bytes (None: unknown, with `error` saying why)."""

    capacity_bytes: int | None
    used_bytes: int | None
    device: str | None = None  # major:minor of the filesystem measured
    error: str | None = None

    @property
    def percent(self) -> float | None:
        """Use as a percentage of the size; None without a size (a tmpfs mounted with size=0 has none)."""
        if not self.capacity_bytes or self.used_bytes is None:
            return None
        return 100.0 * self.used_bytes / self.capacity_bytes


def measured_dir(place: Place) -> str:
    """The directory whose filesystem is the place's: the host's /dev/shm (under --root), else the place's own."""
    if place.is_host:
        return os.path.join(place.path, "dev/shm")
    return place.path


def measure(place: Place) -> Fill:
    """Size and use of the place's filesystem, reached without following a link at its last component.

    A place other than the host's must still be on the device it was found
    on (a volume unmounted since, a link swapped in): otherwise nothing is
    measured, rather than another filesystem's numbers under its name.
    """
    path = measured_dir(place)
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except OSError as e:
        return Fill(None, None, error=f"{path}: {e.strerror}")
    try:
        st = os.fstat(fd)
        if place.dev is not None and st.st_dev != place.dev:
            return Fill(None, None, dev_text(st.st_dev), f"{path}: no longer the filesystem found there")
        vfs = os.fstatvfs(fd)
    except OSError as e:
        return Fill(None, None, error=f"{path}: {e.strerror}")
    finally:
        os.close(fd)
    if vfs.f_blocks == 0:  # tmpfs with size=0: no limit, so no percentage; what it holds is still known
        return Fill(None, None, dev_text(st.st_dev), f"{path}: its filesystem reports no size")
    unit = vfs.f_frsize or vfs.f_bsize
    return Fill(vfs.f_blocks * unit, (vfs.f_blocks - vfs.f_bfree) * unit, dev_text(st.st_dev))


def place_fills(facts: Facts, host: Layout, *, every_place: bool = False,
                kubelet_dir: str | None = None) -> list[tuple[Place, Fill]]:
    """Each place with its fill, the host's first (with `every_place`, every place discover finds): kvtop, watch."""
    if not every_place:
        place = HOST._replace(path=host.root)
        return [(place, measure(place))]
    from .discover import discover

    return [(p, measure(p)) for p in discover(facts, host, kubelet_dir=kubelet_dir).all()]


class KindBytes(NamedTuple):
    """One kind of entry in a place: how many, and the bytes held by the live, the stale and the rest (kept)."""

    kind: str
    entries: int
    live_bytes: int
    stale_bytes: int
    kept_bytes: int  # young, unknown or foreign: kept, neither proven alive nor dead

    def to_dict(self) -> dict[str, Any]:
        return self._asdict()


class BigEntry(NamedTuple):
    """One of the largest entries of a place, and the processes that keep it (mapping or holding it)."""

    path: str
    kind: str
    state: str
    bytes: int
    pids: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {**self._asdict(), "pids": list(self.pids)}


class WhatFills(NamedTuple):
    """A place's fill and what it is made of."""

    fill: Fill
    by_kind: tuple[KindBytes, ...]  # largest first
    largest: tuple[BigEntry, ...]
    unattributed_bytes: int | None  # used, but by no entry a family names (other programs' files, tmpfs's own)

    @property
    def stale_bytes(self) -> int:
        return sum(k.stale_bytes for k in self.by_kind)

    def to_dict(self) -> dict[str, Any]:
        """The `capacity_bytes`, `used_bytes`, ... of a place in a document's `places` (kvctl/schemas/place.json)."""
        f = self.fill
        pct = f.percent
        return {"capacity_bytes": f.capacity_bytes, "used_bytes": f.used_bytes,
                "used_percent": None if pct is None else round(pct, 2), "capacity_error": f.error,
                "fills": {"by_kind": [k.to_dict() for k in self.by_kind],
                          "largest": [h.to_dict() for h in self.largest],
                          "unattributed_bytes": self.unattributed_bytes}}


def what_fills(fill: Fill, entries: Iterable[Entry[Any]]) -> WhatFills:
    """`fill` with the bytes of the entries still there (not those a run removed), by kind and the largest."""
    held = [e for e in entries if e.action is not Action.REMOVED and e.bytes > 0]
    kinds: dict[str, list[int]] = {}
    for e in held:
        row = kinds.setdefault(str(e.kind), [0, 0, 0, 0])
        row[0] += 1
        row[1 if e.state is State.LIVE else 2 if e.state is State.STALE else 3] += e.bytes
    by_kind = sorted((KindBytes(k, *v) for k, v in kinds.items()),
                     key=lambda k: (-(k.live_bytes + k.stale_bytes + k.kept_bytes), k.kind))
    top = sorted(held, key=lambda e: (-e.bytes, e.path))[:LARGEST]
    largest = tuple(BigEntry(e.path, str(e.kind), str(e.state), e.bytes, tuple(e.decision.pids)) for e in top)
    counted = sum(e.bytes for e in held)
    rest = None if fill.used_bytes is None else max(0, fill.used_bytes - counted)
    return WhatFills(fill, tuple(by_kind), largest, rest)


def fill_summary(w: WhatFills, *, kinds: int = 3) -> str:
    """`live vllm-shm 40M, stale nccl-shm 9.2M; 1.1M in files no family names`: what fills a place, in a line."""
    from ..base.units import format_size

    parts = []
    for k in w.by_kind[:kinds]:
        words = [f"{what} {format_size(n)}" for what, n in
                 (("live", k.live_bytes), ("stale", k.stale_bytes), ("kept", k.kept_bytes)) if n]
        parts.append(f"{k.kind} ({', '.join(words)})")
    text = ", ".join(parts) if parts else "no entry of a known family"
    if w.unattributed_bytes:
        text += f"; {format_size(w.unattributed_bytes)} in files no family names"
    return text


def largest_summary(holders: Sequence[BigEntry], *, n: int = 3) -> str:
    """`/dev/shm/psm_0a1b2c3d 160M (live, PID 41)`: the biggest entries of a place, in a line."""
    from ..base.units import format_size

    out = []
    for h in holders[:n]:
        who = f", PID {', '.join(map(str, h.pids[:4]))}" if h.pids else ""
        out.append(f"{h.path} {format_size(h.bytes)} ({h.state}{who})")
    return "; ".join(out)
