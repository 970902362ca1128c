"""The evidence across namespaces: what a file in a place can be proven by, from the same one /proc pass.

- Identity, not paths: mapped or held means some process on the node maps or
  holds a file with the entry's (st_dev, st_ino) (facts key by identity
  already; a path in /proc/<pid>/maps means nothing across namespaces).
- A PID in a file's name is a PID in its creator's PID namespace. The
  creator candidates of a file in a place are the processes that see the
  place's filesystem in their own mount namespace (Places.viewers); the
  name's PID is matched against each one's PID in its innermost PID
  namespace (NSpid's last field), with the start-time rule as everywhere. A
  host process whose host PID equals the name's is no evidence for a file in
  a pod's volume, and a filesystem no process sees has no live creator.
- kvcached's default names carry a process group id, which is the
  creator's PGID in its namespace too (NSpgid): the place's facts answer
  `by_pgid` with the viewers whose innermost PGID it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from ..clean.facts import Facts, ProcessInfo, _read
from ..clean.leftovers.evidence import EngineEvidence, Proc
from ..state.lease import LockEntry
from .discover import Place, Places


def creators(facts: Facts, places: Places, pids_in_names: Iterable[int], only: Place | None = None
             ) -> dict[int, dict[int, tuple[Proc, ...]]]:
    """device -> {PID as its innermost namespace names it -> the viewers that have it}, for the names' PIDs only.

    One read of every process's NSpid (Facts.namespace_pids, shared with the
    host's evidence), then one pass over each place's viewers (`only`: that
    place's alone).
    """
    wanted = set(pids_in_names)
    out: dict[int, dict[int, tuple[Proc, ...]]] = {}
    if not wanted:
        return out
    nspids = facts.namespace_pids()
    for place in places.others if only is None else [only]:
        assert place.dev is not None
        found: dict[int, list[Proc]] = {}
        for pid in places.viewers.get(place.dev, ()):
            if pid == place.holder:
                continue  # a sandbox's pause/infra process creates nothing there (sandbox.py)
            info = facts.processes.get(pid)
            inner = nspids.get(pid, (pid,))[-1]
            if info is not None and inner in wanted:
                found.setdefault(inner, []).append(Proc(pid, info.start_time))
        out[place.dev] = {k: tuple(v) for k, v in found.items()}
    return out


def for_place(base: EngineEvidence, place: Place, by_place: Mapping[int, Mapping[int, tuple[Proc, ...]]]
              ) -> EngineEvidence:
    """The engine evidence for one place: the node's users by identity, the place's own creator candidates."""
    if place.is_host:
        return base
    assert place.dev is not None
    note = place.holder_note if place.holder is None else None
    return dataclasses.replace(base, by_any_pid=dict(by_place.get(place.dev, {})), creator_note=note)


def _inner_pgid(raw: bytes) -> int | None:
    at = raw.find(b"\nNSpgid:")
    if at < 0:
        return None
    end = raw.find(b"\n", at + 8)
    fields = raw[at + 8:end if end >= 0 else len(raw)].split()
    try:
        return int(fields[-1]) if fields else None
    except ValueError:
        return None


@dataclasses.dataclass(kw_only=True)
class PlaceFacts(Facts):
    """The node's facts as one place sees them: process groups by the PGID its processes know.

    Everything else is the node's: the lazy reads (maps, locks) are asked of
    the node's facts, so a run reads each once however many places it judges,
    and the PGIDs (one status read per viewer) only when a decision asks.
    """

    node: Facts
    viewers: tuple[int, ...] = ()
    _pgids: dict[int, list[ProcessInfo]] | None = dataclasses.field(default=None, repr=False, compare=False)

    def by_pgid(self, pgid: int) -> list[ProcessInfo]:
        if self._pgids is None:
            self._pgids = _inner_groups(self.node, self.viewers)
        return self._pgids.get(pgid, [])

    def mapped(self) -> dict[tuple[int, int], list[int]]:
        return self.node.mapped()

    @property
    def locks(self) -> dict[tuple[int, int], list[LockEntry]]:
        return self.node.locks


def _inner_groups(facts: Facts, pids: Iterable[int]) -> dict[int, list[ProcessInfo]]:
    """The processes `pids` by the PGID their innermost PID namespace gives them (NSpgid)."""
    groups: dict[int, list[ProcessInfo]] = {}
    for pid in pids:
        info = facts.processes.get(pid)
        if info is None:
            continue
        try:
            inner = _inner_pgid(_read(f"{facts.proc_root}/{pid}/status", whole=True))
        except OSError:
            inner = None
        groups.setdefault(info.pgid if inner is None else inner, []).append(info)
    return groups


def place_facts(facts: Facts, places: Places, place: Place) -> Facts:
    """Facts for judging kvcached's own entries in `place` (the host's as they are)."""
    if place.is_host:
        return facts
    assert place.dev is not None
    shared = {f.name: getattr(facts, f.name) for f in dataclasses.fields(Facts)
              if f.init and not f.name.startswith("_") and f.name not in ("lock_table", "mapped_files")}
    viewers = tuple(p for p in places.viewers.get(place.dev, ()) if p != place.holder)
    return PlaceFacts(**shared, node=facts, viewers=viewers)
