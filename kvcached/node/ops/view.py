"""Group a cleanup plan's entries and the node's processes into deployments (what `kvctl inspect` shows).

Read-only: it takes no lock and removes nothing. The entries carry the same
decisions gc would act on, with `would_remove` for stale ones.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..base.enums import Category
from ..base.errors import KvcachedError, SegmentBusy
from ..base.layout import Layout
from ..base.name_rules import default_name_pgid, split_dp_rank
from ..clean.cleanup import Plan, preview
from ..clean.decide import State
from ..clean.facts import START_SLACK, Facts, ProcessInfo
from ..clean.report import Entry
from ..clean.roles import Role, RoleInfo, classify_process, tie_sglang_mains
from ..clean.scan import Candidate, FileType, Kind
from ..state.segment import SegmentInfo, read_segment


class ProcessNotFound(KvcachedError):
    """`--pid` names no process."""

    category = Category.NOT_FOUND


class NamespaceUnreachable(KvcachedError):
    """A process exists but its mount namespace cannot be entered through /proc/PID/root."""


def layout_for_pid(pid: int, root: str = "/", proc_root: str = "/proc") -> Layout:
    """The node as process `pid` sees it (its mount namespace), optionally re-based under `root` inside it."""
    base = f"{proc_root}/{pid}"
    if pid <= 0 or not os.path.isdir(base):
        raise ProcessNotFound(f"--pid {pid}: no such process")
    try:
        os.listdir(f"{base}/root/")
    except OSError as e:
        raise NamespaceUnreachable(f"--pid {pid}: cannot enter its mount namespace through {base}/root "
                                   f"({e.strerror}); run as root or as the process's user") from None
    if root == "/":
        return Layout.for_pid(pid, proc_root)
    return Layout(f"{base}/root{root}", seen_root=root)


@dataclass(frozen=True)
class ProcessView:
    """One process of a deployment, its role, and whether it lost the parent that owns it."""

    info: ProcessInfo
    role: RoleInfo
    via: str                  # how it is tied to the deployment: ipc_name, pgid, serves
    orphaned: bool = False
    orphan_reason: str = ""

    @property
    def pid(self) -> int:
        return self.info.pid

    def to_dict(self) -> dict[str, Any]:
        p = self.info
        return {"pid": p.pid, "start_time": p.start_time, "ppid": p.ppid, "pgid": p.pgid, "uid": p.uid,
                "role": str(self.role.role), "title": self.role.title, "rank": self.role.rank,
                "stage": self.role.stage, "via": self.via, "orphaned": self.orphaned,
                "orphan_reason": self.orphan_reason or None, "cmdline": list(p.cmdline)}


@dataclass(frozen=True)
class DeploymentView:
    """Everything on the node that belongs to one IPC name."""

    name: str
    state: State
    entries: tuple[Entry, ...]
    processes: tuple[ProcessView, ...]
    segment: SegmentInfo | None = None
    segment_error: str | None = None
    served_by: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # socket path -> listening PIDs

    @property
    def serve(self) -> str:
        """The serve this deployment belongs to: its name without a `_dp<rank>` suffix (one serve, several DP ranks)."""
        return split_dp_rank(self.name)[0]

    @property
    def dp_rank(self) -> int | None:
        """The data-parallel rank this deployment is, None outside a DP serve."""
        return split_dp_rank(self.name)[1]

    def pids_of(self, e: Entry) -> tuple[int, ...]:
        """The PIDs behind an entry: its decision's evidence, else the processes listening on a socket."""
        return e.decision.pids or self.served_by.get(e.path, ())

    @property
    def orphans(self) -> list[ProcessView]:
        return [p for p in self.processes if p.orphaned]

    @property
    def engine_gone(self) -> bool:
        """No engine process of this deployment is alive."""
        return not any(p.role.role is Role.ENGINE for p in self.processes)

    def segment_entry(self) -> Entry | None:
        return next((e for e in self.entries if e.kind is Kind.SEGMENT), None)

    def to_dict(self) -> dict[str, Any]:
        seg = self.segment_entry()
        return {
            "name": self.name, "state": str(self.state), "serve": self.serve, "dp_rank": self.dp_rank,
            "segment": None if seg is None else {
                "path": seg.path, **(self.segment.to_dict() if self.segment else
                                     {"limit": None, "used": None, "prealloc": None}),
                "mtime": seg.candidate.mtime, "uid": seg.candidate.uid, "error": self.segment_error},
            "entries": [{**e.to_dict(), "served_by": list(self.served_by.get(e.path, ()))} for e in self.entries],
            "processes": [p.to_dict() for p in self.processes],
            "orphans": [p.pid for p in self.orphans],
        }


@dataclass(frozen=True)
class Namespace:
    """Another mount namespace whose /tmp or /dev/shm differs from ours and that runs kvcached-like processes."""

    mnt_ns: str
    pids: tuple[int, ...]
    hint_pid: int
    names: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"mnt_ns": self.mnt_ns, "pids": list(self.pids), "names": list(self.names),
                "hint": f"kvctl inspect --pid {self.hint_pid}"}


@dataclass
class NodeView:
    """The whole node as one run saw it."""

    layout: Layout
    deployments: list[DeploymentView]
    unowned: list[Entry]                 # entries tied to no deployment name (foreign directories)
    namespaces: list[Namespace]
    errors: list[str]
    facts: Facts
    incomplete: list[int] = field(default_factory=list)  # pids whose /proc we could not fully read

    @property
    def orphans(self) -> list[tuple[DeploymentView, ProcessView]]:
        return [(d, p) for d in self.deployments for p in d.orphans]

    def serves(self) -> dict[str, list[DeploymentView]]:
        """Deployments by serve: the DP ranks of one serve (`<serve>_dp<r>`) together, in rank order."""
        out: dict[str, list[DeploymentView]] = {}
        for d in self.deployments:
            out.setdefault(d.serve, []).append(d)
        for ranks in out.values():
            ranks.sort(key=lambda d: (d.dp_rank is not None, d.dp_rank or 0, d.name))
        return out

    def killable_orphans(self) -> list[tuple[DeploymentView, ProcessView]]:
        """Orphans of deployments whose engine is confirmed gone: no engine or API process alive, /proc complete."""
        if self.incomplete or self.facts.hidepid:
            return []
        return [(d, p) for d, p in self.orphans if d.engine_gone and p.role.role is Role.WORKER]

    def to_dict(self) -> dict[str, Any]:
        """The node as `kvctl inspect --json` shows it (kvctl/documents.py adds the schema name)."""
        return {
            "root": self.layout.root,
            "deployments": [d.to_dict() for d in self.deployments],
            "serves": [{"name": name, "state": str(_summary_state([e for d in ranks for e in d.entries],
                                                                   [p for d in ranks for p in d.processes])),
                        "deployments": [d.name for d in ranks],
                        "dp_ranks": [d.dp_rank for d in ranks if d.dp_rank is not None]}
                       for name, ranks in self.serves().items()],
            "unowned": [e.to_dict() for e in self.unowned],
            "other_namespaces": [n.to_dict() for n in self.namespaces],
            "errors": list(self.errors),
            "incomplete_pids": list(self.incomplete),
        }


def _newest_change(cands: list[Candidate]) -> float:
    return max((c.mtime for c in cands), default=0.0)


def _members(name: str, entries: list[Entry], facts: Facts, roles: dict[int, RoleInfo]) -> dict[int, str]:
    """pid → how it is tied to deployment `name`.

    The name (its environment), a socket it serves, a file it holds or maps,
    then the serving processes (API server, engine, workers, by title) in the
    process group of any of those: a vLLM serve is one group, and the engine
    that writes upstream's segment between its writes holds nothing.
    """
    out: dict[int, str] = {}
    for p in facts.by_ipc_name(name):
        out.setdefault(p.pid, "ipc_name")
    for e in entries:
        pids = e.decision.pids
        if e.kind is Kind.SOCKET:
            pids = pids or facts.serving_pids(e.candidate.ident)
        elif e.kind is Kind.SEGMENT:
            pids = pids or tuple(p.pid for p in facts.holders_of_file(e.candidate.ident))
        for pid in pids:
            if pid in facts.processes:
                out.setdefault(pid, "serves" if e.kind is Kind.SOCKET else "holds")
    pgid = default_name_pgid(name)
    if pgid is not None:
        # A reused PGID is a newer group: only processes that started before the
        # state last changed can be this deployment's.
        newest = _newest_change([e.candidate for e in entries])
        for p in facts.by_pgid(pgid):
            if not entries or p.start_time <= newest + START_SLACK:
                out.setdefault(p.pid, "pgid")
    for pgid in sorted({facts.processes[pid].pgid for pid in out}):
        for p in facts.by_pgid(pgid):
            if roles[p.pid].role is not Role.OTHER:
                out.setdefault(p.pid, "group")
    return out


def _orphan(p: ProcessView, members: dict[int, ProcessView], facts: Facts) -> tuple[bool, str]:
    """A worker whose engine is gone and that was reparented, or an engine whose API server is gone."""
    info = p.info
    roles = {m.role.role for m in members.values()}
    parent = facts.processes.get(info.ppid)
    who = f"PID {info.ppid} ({parent.comm})" if parent else f"PID {info.ppid}"
    # Reparenting is the kernel's own record that the parent exited: a worker whose
    # parent is still a process of the deployment is not orphaned, whatever we
    # failed to recognise about that parent.
    if p.role.role is Role.WORKER and Role.ENGINE not in roles and info.ppid not in members:
        return True, f"its engine is gone; reparented to {who}"
    if (p.role.role is Role.ENGINE and Role.API not in roles and info.ppid not in members
            and info.pgid != info.pid and info.pgid not in facts.processes):
        return True, f"its API server (process group leader {info.pgid}) is gone; reparented to {who}"
    return False, ""


def _summary_state(entries: list[Entry], procs: list[ProcessView]) -> State:
    states = {e.state for e in entries}
    for s in (State.LIVE, State.UNKNOWN, State.YOUNG, State.STALE, State.FOREIGN):
        if s in states:
            return s
    return State.LIVE if procs else State.STALE


def _namespaces(layout: Layout, facts: Facts, roles: dict[int, RoleInfo]) -> list[Namespace]:
    """Mount namespaces with kvcached-like processes whose /tmp or /dev/shm is not the one we scanned."""
    mine: dict[str, tuple[int, int] | None] = {}
    for d in (layout.tmp_dir, layout.shm_dir):
        try:
            st = os.stat(d)
            mine[d] = (st.st_dev, st.st_ino)
        except OSError:
            mine[d] = None
    by_ns: dict[str, list[ProcessInfo]] = {}
    for p in facts.processes.values():
        if p.mnt_ns is None or p.mnt_ns == facts.my_mnt_ns:
            continue
        relevant = p.ipc_name is not None or roles[p.pid].role is not Role.OTHER or \
            any(k in " ".join(p.cmdline[:3]).lower() for k in ("kvcached", "vllm", "sglang"))
        if relevant:
            by_ns.setdefault(p.mnt_ns, []).append(p)
    out = []
    for ns, procs in sorted(by_ns.items()):
        rep = procs[0]
        same = True
        for d, ident in mine.items():
            try:
                st = os.stat(f"{facts.proc_root}/{rep.pid}/root{layout.seen_path(d)}")
                same &= ident == (st.st_dev, st.st_ino)
            except OSError:
                same = False
        if same:
            continue  # a private namespace that still shares our /tmp and /dev/shm: already scanned
        names = sorted({p.ipc_name for p in procs if p.ipc_name})
        out.append(Namespace(ns, tuple(sorted(p.pid for p in procs)), rep.pid, tuple(names)))
    return out


# One wait for the whole view, not one per segment: a segment another process
# keeps locked (a stuck writer, or a planted lock) must not hold a command up,
# and a thousand of them must not hold it up a thousand times.
SEGMENT_WAIT = 0.5


def build_view(p: Plan, *, read_segments: bool = True, namespaces: bool = True) -> NodeView:
    """Group a plan into deployments with their processes, orphans and other namespaces."""
    import time

    facts = p.facts
    read_until = time.monotonic() + SEGMENT_WAIT
    roles = {pid: classify_process(info) for pid, info in facts.processes.items()}
    tie_sglang_mains(roles, facts)
    grouped: dict[str, list[Entry]] = {}
    unowned: list[Entry] = []
    for e in preview(p):
        if e.candidate.deployment is None or not e.candidate.hash_ok:
            unowned.append(e)  # a directory whose hash does not match its name belongs to no deployment
        else:
            grouped.setdefault(e.candidate.deployment, []).append(e)
    deployments = []
    for name in sorted(grouped):
        entries = grouped[name]
        tied = _members(name, entries, facts, roles)
        members = {pid: ProcessView(facts.processes[pid], roles[pid], via) for pid, via in tied.items()}
        procs = []
        for pid in sorted(members):
            orphaned, why = _orphan(members[pid], members, facts)
            procs.append(ProcessView(members[pid].info, members[pid].role, members[pid].via, orphaned, why))
        seg_info, seg_err = None, None
        seg = next((e for e in entries if e.kind is Kind.SEGMENT), None)
        if read_segments and seg is not None and seg.candidate.ftype is FileType.REGULAR \
                and seg.state is not State.FOREIGN:
            try:
                seg_info = read_segment(seg.path, timeout=max(0.0, read_until - time.monotonic()))
            except SegmentBusy:
                seg_err = "locked by another process: values unknown"
            except (KvcachedError, OSError) as err:
                seg_err = str(err)
        served = {e.path: pids for e in entries if e.kind is Kind.SOCKET
                  and (pids := facts.serving_pids(e.candidate.ident))}
        deployments.append(DeploymentView(name, _summary_state(entries, procs), tuple(entries), tuple(procs),
                                          seg_info, seg_err, served))
    ns = _namespaces(p.layout, facts, roles) if namespaces else []
    incomplete = sorted(facts.blind_spots(p.policy.effective_uid))
    return NodeView(p.layout, deployments, unowned, ns, list(p.errors), facts, incomplete)

