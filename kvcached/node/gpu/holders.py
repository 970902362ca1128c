"""GPU holders: processes with a descriptor or a mapping of a GPU device, named, judged and sized.

Built from the /proc pass's own reads (facts.py): the character devices it
found among the descriptors (each stat'ed there, through the descriptor, for
the device number it refers to) and the maps it reads for the engine pass (one
read serves both: Facts.also_map). A mapping is matched by the identity
(st_dev, st_ino) of a device node known to be a GPU's: one some process holds
open, or one in the device directories (/dev, /dev/dri, and a container's
through /proc/<pid>/root).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..clean.facts import Facts, ProcessInfo, _status_nspids
from ..clean.roles import Role, RoleInfo, classify_process
from .devices import Device, DeviceTable, Vendor, device_table
from .judge import HolderState, Parent, engine_child, engine_family, judge
from .nvml import GpuMemory

DEVICE_DIRS = ("/dev", "/dev/dri")
NOT_KILLABLE_STATES = ("D",)


@dataclass(frozen=True)
class DeviceUse:
    """One GPU device a process uses, and how we saw it (an open descriptor or a mapping)."""

    device: Device
    path: str
    via: str  # "fd" or "map"

    def to_dict(self) -> dict[str, Any]:
        d = self.device
        return {"path": self.path, "name": d.name, "driver": d.driver, "gpu": d.gpu,
                "rdev": f"{d.major}:{d.minor}", "via": self.via}


@dataclass(frozen=True)
class GpuHolder:
    """A process that holds a GPU, its serve, what it holds, and whether kvctl may end it."""

    info: ProcessInfo
    role: RoleInfo
    serve: str | None
    devices: tuple[DeviceUse, ...]
    gpu_memory_bytes: int | None
    memory_by_gpu: Mapping[str, int]
    state: HolderState
    reason: str
    proc_state: str | None   # /proc/<pid>/stat's letter when judged: D uninterruptible, T stopped

    @property
    def pid(self) -> int:
        return self.info.pid

    @property
    def title(self) -> str:
        return self.role.title or self.info.comm

    @property
    def gpus(self) -> list[str]:
        """The GPUs it holds, by label (NVIDIA index, else the node's name); control nodes left out."""
        labels = {u.device.label for u in self.devices if u.device.gpu is not None or u.device.vendor is not
                  Vendor.NVIDIA}
        return sorted(labels)

    def to_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "start_time": self.info.start_time, "ppid": self.info.ppid, "uid": self.info.uid,
                "title": self.title, "role": str(self.role.role), "serve": self.serve,
                "devices": [u.to_dict() for u in self.devices], "gpus": self.gpus,
                "gpu_memory_bytes": self.gpu_memory_bytes, "state": str(self.state), "reason": self.reason,
                "proc_state": self.proc_state}


@dataclass(frozen=True)
class GpuReport:
    """Every GPU holder one pass found, and what it could not say."""

    holders: tuple[GpuHolder, ...] = ()
    memory_note: str | None = None   # why GPU memory is unknown (said once for the run)
    errors: tuple[str, ...] = ()
    complete: bool = True            # /proc fully readable: no holder hidden from us

    def with_state(self, state: HolderState) -> list[GpuHolder]:
        return [h for h in self.holders if h.state is state]

    @property
    def orphans(self) -> list[GpuHolder]:
        return self.with_state(HolderState.ORPHAN)

    @property
    def stuck(self) -> list[GpuHolder]:
        """Holders in uninterruptible sleep: no signal ends them while the device holds them."""
        return [h for h in self.holders if h.proc_state in NOT_KILLABLE_STATES]

    def orphan_bytes_by_gpu(self) -> dict[str, int]:
        """Bytes orphans hold, by GPU label (NVML's figures; AMD's from fdinfo under the node's name)."""
        out: dict[str, int] = {}
        for h in self.orphans:
            for gpu, n in h.memory_by_gpu.items():
                out[gpu] = out.get(gpu, 0) + n
        return out

    def to_list(self) -> list[dict[str, Any]]:
        return [h.to_dict() for h in self.holders]


def _device_uses(facts: Facts, table: DeviceTable, known: dict[tuple[int, int], Device]
                 ) -> dict[int, dict[tuple[str, str], tuple[DeviceUse, str]]]:
    """pid -> its GPU descriptors, from the character devices the /proc pass stat'ed through each descriptor.

    Decided by the device number; the path (a readlink, for the report) only
    names it. Records each GPU node's identity in `known`, so that a mapping
    of it is found in maps.
    """
    out: dict[int, dict[tuple[str, str], tuple[DeviceUse, str]]] = {}
    named: dict[int, Device | None] = {}  # every process holds /dev/null and a tty: one lookup per number
    for pid, p in facts.processes.items():
        for fd, rdev, st_dev, st_ino in p.char_devices:
            if rdev not in named:
                named[rdev] = table.device(rdev)
            if (dev := named[rdev]) is None:
                continue
            try:
                target = os.readlink(f"{facts.proc_root}/{pid}/fd/{fd}")
            except OSError:
                continue  # closed, or the process gone, since the pass: it holds nothing there now
            known[(st_dev, st_ino)] = dev
            path = target.removesuffix(" (deleted)")
            out.setdefault(pid, {}).setdefault((dev.name, path), (DeviceUse(dev, path, "fd"), fd))
    return out


def _dir_nodes(dirs: Iterable[str], table: DeviceTable, known: dict[tuple[int, int], Device]) -> set[int]:
    """GPU nodes in the device directories into `known`; the st_dev of each directory (where its nodes live)."""
    devs: set[int] = set()
    for d in dirs:
        try:
            devs.add(os.stat(d).st_dev)
            names = os.listdir(d)
        except OSError:
            continue
        for name in names:
            try:
                st = os.lstat(f"{d}/{name}")
            except OSError:
                continue
            if stat.S_ISCHR(st.st_mode) and (dev := table.device(st.st_rdev)) is not None:
                known.setdefault((st.st_dev, st.st_ino), dev)
    return devs


def namespace_dirs(facts: Facts, dirs: Sequence[str]) -> list[str]:
    """The device directories as each other mount namespace sees them (one process of each)."""
    seen: dict[str, int] = {}
    for p in facts.processes.values():
        if p.mnt_ns is not None and p.mnt_ns != facts.my_mnt_ns:
            seen.setdefault(p.mnt_ns, p.pid)
    return [f"{facts.proc_root}/{pid}/root{d}" for pid in seen.values() for d in dirs]


def prepare(facts: Facts, dirs: Sequence[str] = DEVICE_DIRS) -> None:
    """Ask the run's next read of every maps file to collect mappings of the device directories' nodes too."""
    devs: set[int] = set()
    for d in (*dirs, *namespace_dirs(facts, dirs)):
        try:
            devs.add(os.stat(d).st_dev)
        except OSError:
            continue
    facts.also_map(devs)


def _proc_state(proc_root: str, pid: int) -> str | None:
    try:
        with open(f"{proc_root}/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    rest = raw[raw.rindex(b")") + 2:].split()
    return rest[0].decode() if rest else None


class _Roles:
    """Roles and parents of the holders and their ancestors, computed on first use (not for every process)."""

    def __init__(self, facts: Facts) -> None:
        self.facts = facts
        self._roles: dict[int, RoleInfo] = {}
        self._judged: dict[int, tuple[HolderState, str]] = {}
        self._children: dict[int, list[ProcessInfo]] | None = None
        self._parents: dict[int, Parent] = {}

    def role(self, pid: int) -> RoleInfo:
        r = self._roles.get(pid)
        if r is None:
            r = self._roles[pid] = classify_process(self.facts.processes[pid])
            if r.role is Role.OTHER:
                r = self._sglang_main(pid, r)
                self._roles[pid] = r
        return r

    def _sglang_main(self, pid: int, r: RoleInfo) -> RoleInfo:
        """SGLang's main keeps its command line: it is the parent of `sglang::` processes in its group."""
        if self._children is None:
            self._children = {}
            for c in self.facts.processes.values():
                self._children.setdefault(c.ppid, []).append(c)
        p = self.facts.processes[pid]
        for child in self._children.get(pid, ()):
            # The title alone, not a full classification of every child: a launcher may have hundreds.
            title = child.cmdline[0] if child.cmdline and child.cmdline[0].startswith("sglang::") else child.comm
            if child.pgid == p.pgid and title.startswith("sglang::"):
                return RoleInfo(role=Role.API, title="sglang main")
        return r

    def parent(self, child: ProcessInfo) -> Parent | None:
        info = self.facts.processes.get(child.ppid)
        if info is None:
            return None
        if info.pid in self._parents:
            return self._parents[info.pid]
        try:
            with open(f"{self.facts.proc_root}/{info.pid}/status", "rb") as f:
                ns_init = _status_nspids(f.read(), info.pid)[-1] == 1
        except OSError:
            ns_init = info.pid == 1
        self._parents[info.pid] = Parent(info, self.role(info.pid), ns_init or info.pid == 1)
        return self._parents[info.pid]

    def judged(self, pid: int) -> tuple[HolderState, str]:
        """The rule for `pid`; a serving engine child whose engine is itself an orphan is one too."""
        if pid in self._judged:
            return self._judged[pid]
        self._judged[pid] = (HolderState.UNKNOWN, "a parent loop")  # a cycle cannot recurse forever
        info = self.facts.processes[pid]
        parent = self.parent(info) if engine_child(self.role(pid)) else None  # the rule asks only of them
        state, why = judge(info, self.role(pid), parent, view_complete=not self.facts.hidepid)
        if state is HolderState.SERVING and parent is not None and engine_family(self.role(pid)) \
                and engine_family(parent.role) and parent.info.pid != pid:
            up, _ = self.judged(parent.info.pid)
            if up is HolderState.ORPHAN and parent.role.role is not Role.API:
                state, why = HolderState.ORPHAN, f"its engine {_who(parent)} is an orphan"
        self._judged[pid] = (state, why)
        return state, why

    def serve(self, pid: int, state: HolderState) -> str | None:
        """The serve a holder belongs to: the top of its chain of serve processes, by title and PID."""
        if state is HolderState.FOREIGN:
            return None
        top = self.facts.processes[pid]
        seen = {pid}
        while (up := self.facts.processes.get(top.ppid)) is not None and up.pid not in seen \
                and engine_family(self.role(up.pid)):
            seen.add(up.pid)
            top = up
        if state is HolderState.ORPHAN and not engine_family(self.role(top.pid)) or \
                state is HolderState.ORPHAN and top.pid == pid:
            return f"gone (process group {top.pgid})"
        return f"{self.role(top.pid).title} (PID {top.pid})"


def _who(p: Parent) -> str:
    return f"PID {p.info.pid} ({p.role.title or p.info.comm})"


def mapped_uses(facts: Facts, known: Mapping[tuple[int, int], Device],
                uses: dict[int, dict[tuple[str, str], tuple[DeviceUse, str]]], devs: Iterable[int] = ()) -> None:
    """Add to `uses` each mapping of a node in `known` (by its identity) that any process's maps shows."""
    for ident, pids in facts.map_users({*devs, *(i[0] for i in known)}).items():
        dev = known.get(ident)
        if dev is None:
            continue
        for pid in pids:
            uses.setdefault(pid, {}).setdefault((dev.name, f"map:{dev.name}"), (DeviceUse(dev, dev.name, "map"), ""))


def find_holders(facts: Facts, *, table: DeviceTable | None = None, dirs: Sequence[str] = DEVICE_DIRS,
                 memory: bool = True, nvml: Any = None, maps: bool | None = True) -> GpuReport:
    """Every GPU holder the /proc pass can show, judged by the orphan rule, with its GPU memory where known.

    `nvml`: a callable returning nvml.GpuMemory (default: nvml.query, imported only when a holder
    uses an NVIDIA device). `maps`: True reads every maps file where the run has not (inspect, doctor);
    None uses the maps only when the run already read them (gc: reading them costs more than the
    rest of gc --engines, and a holder seen only through a mapping is then not ended, never wrongly ended).
    """
    table = table or device_table(facts.proc_root)
    known: dict[tuple[int, int], Device] = {}
    uses = _device_uses(facts, table, known)
    devs = _dir_nodes((*dirs, *namespace_dirs(facts, dirs)), table, known)
    # Mappings are looked for on the device directories' filesystems only (devtmpfs, a container's /dev tmpfs),
    # where every mapping is a device's: a node elsewhere (a test's tmp dir on the root filesystem) is found by
    # its descriptors, and looking for it in maps would match every shared library mapped from that filesystem.
    if maps or (maps is None and facts.maps_read(devs)):
        mapped_uses(facts, {i: d for i, d in known.items() if i[0] in devs}, uses, devs)
    mem = GpuMemory(note="GPU memory not asked for") if not memory else None
    if mem is None and any(u.device.vendor is Vendor.NVIDIA for per in uses.values() for u, _ in per.values()):
        if nvml is None:
            from .nvml import query as nvml
        mem = nvml()
    roles = _Roles(facts)
    holders = []
    for pid in sorted(uses):
        if pid not in facts.processes:
            continue
        state, why = roles.judged(pid)
        per = sorted(uses[pid].values(), key=lambda x: (x[0].device.major, x[0].device.minor, x[0].path))
        holders.append(_holder(facts, roles, pid, state, why, per, mem))
    note = mem.note if mem is not None and mem.note != "GPU memory not asked for" else None
    return GpuReport(tuple(holders), note, tuple(facts.errors), complete=not facts.hidepid)


def _holder(facts: Facts, roles: _Roles, pid: int, state: HolderState, why: str,
            per: list[tuple[DeviceUse, str]], mem: GpuMemory | None) -> GpuHolder:
    from .fdinfo import drm_memory

    by_gpu: dict[str, int] = {}
    total: int | None = None
    if mem is not None and mem.known and any(u.device.vendor is Vendor.NVIDIA for u, _ in per):
        by_gpu = {str(g): n for g, n in mem.per_gpu(pid).items()}
        total = mem.of(pid)
    drm_fds = [fd for u, fd in per if fd and u.device.vendor is not Vendor.NVIDIA]
    if drm_fds and (vram := drm_memory(facts.proc_root, pid, drm_fds)) is not None:
        name = next(u.device.name for u, fd in per if fd in drm_fds)
        by_gpu[name] = by_gpu.get(name, 0) + vram
        total = (total or 0) + vram
    info = facts.processes[pid]
    return GpuHolder(info, roles.role(pid), roles.serve(pid, state), tuple(u for u, _ in per),
                     total, by_gpu, state, why, info.proc_state or None)
