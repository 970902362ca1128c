"""The running vLLM and SGLang serves, and what each of their processes published about kvcached (doctor engine).

A serve is a tree of engine processes (roles.py: vLLM's API server,
EngineCore and workers; SGLang's main, schedulers, detokenizer and DP
controller), found by title in the /proc pass doctor already made, and
named by its top process. What kvcached did in each process is read from
the record that process publishes (kvcached.node.base.published: a sealed
memfd kvctl reads through /proc/PID/fd), never from kvctl's own
environment: that the shell kvctl runs in has kvcached switched on says
nothing of a serve started elsewhere. The serve's environment at its start
(/proc/PID/environ) is read only to say why a serve published nothing.

A serve belongs to the node root kvctl was given: the root its processes'
records name (KVCACHED_ROOT); a serve that published nothing belongs to `/`.
So `kvctl --root DIR doctor engine` answers for the serves started with
KVCACHED_ROOT=DIR, and a plain `kvctl doctor engine` for the node's.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ... import settings
from ..base.published import LINK, MAX_BYTES, Published, RecordError
from ..clean.roles import Role, RoleInfo, classify_process, tie_sglang_mains
from .detectdoc import PatchStatus

if TYPE_CHECKING:
    from ..clean.facts import Facts

# The switch a serve's processes need, the same for both engines (docs/INTEGRATION.md).
SWITCH = "ENABLE_KVCACHED=true"
_ALLOW_LISTS: dict[str, settings.Setting[str | None]] = {"vllm": settings.VLLM_PLUGINS,
                                                         "sglang": settings.SGLANG_PLUGINS}
_SWITCHES: tuple[settings.Setting[bool], ...] = (settings.ENABLE_KVCACHED, settings.ENABLE, settings.ELASTIC)
_STOOD_ASIDE = frozenset({PatchStatus.UNKNOWN_SHAPE, PatchStatus.NOT_COVERED})  # leave a serve uncovered


@dataclass(frozen=True)
class ServeProcess:
    """One process of a serve and what it published (None: nothing; `unread` says when it could not be read)."""

    pid: int
    role: str
    title: str
    record: Published | None = None
    unread: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "role": self.role, "title": self.title, "unread": self.unread,
                "published": self.record.to_dict() if self.record is not None else None}


@dataclass(frozen=True)
class Serve:
    """A running serve: its engine, its top process, and each of its processes."""

    engine: str  # "vllm" or "sglang"
    pid: int
    title: str
    processes: tuple[ServeProcess, ...]
    environ: Mapping[str, str] | None = None  # the switches in the top process's environment at start; None: unread

    @property
    def label(self) -> str:
        return next((p.record.label for p in self.processes if p.record), {"vllm": "vLLM", "sglang": "SGLang"}[
            self.engine])

    @property
    def version(self) -> str | None:
        return next((p.record.engine_version for p in self.processes if p.record), None)

    def applied(self) -> list[str]:
        """Every patch some process applied, in the order the processes name them."""
        return list(dict.fromkeys(a for p in self.processes if p.record for a in p.record.applied))

    def stood_aside(self) -> dict[str, dict[str, list[int]]]:
        """Each patch that stood aside -> how (an unknown shape, not covered) -> the PIDs where it did."""
        out: dict[str, dict[str, list[int]]] = {}
        for p in self.processes:
            for name, status in (p.record.statuses if p.record else {}).items():
                if status in _STOOD_ASIDE:
                    out.setdefault(name, {}).setdefault(status, []).append(p.pid)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"engine": self.engine, "pid": self.pid, "title": self.title, "applied": self.applied(),
                "stood_aside": self.stood_aside(), "processes": [p.to_dict() for p in self.processes]}


def _engine_of(role: RoleInfo) -> str | None:
    """Which engine a process of this role belongs to, by its title; None for our harness and the rest."""
    if role.role is Role.OTHER or role.title.startswith("harness"):
        return None
    if role.title.startswith(("VLLM::", "VllmWorker", "EngineCore", "vllm")):
        return "vllm"
    if role.title.startswith("sglang"):
        return "sglang"
    return None


def find_serves(facts: Facts, *, root: str = "/") -> list[Serve]:
    """The serves running on the node whose kvcached state lives under `root`, each with what it published."""
    roles = {pid: classify_process(info) for pid, info in facts.processes.items()}
    tie_sglang_mains(roles, facts)
    engines = {pid: e for pid, r in roles.items() if (e := _engine_of(r)) is not None}
    trees: dict[int, list[int]] = {}
    for pid in sorted(engines):
        top, seen = pid, {pid}
        while (up := facts.processes[top].ppid) in engines and engines[up] == engines[pid] and up not in seen:
            seen.add(up)
            top = up
        trees.setdefault(top, []).append(pid)
    own = facts.namespace_pids()
    out = []
    want = _norm(root)
    for top, pids in sorted(trees.items()):
        processes = tuple(_process(pid, roles[pid], facts.proc_root, own.get(pid, (pid,))[-1]) for pid in pids)
        roots = {_norm(p.record.root) for p in processes if p.record}
        if (roots and want not in roots) or (not roots and want != "/"):
            continue
        out.append(Serve(engines[top], top, roles[top].title, processes, _switches(facts.proc_root, top)))
    return out


def _norm(path: str) -> str:
    return os.path.realpath(path) if os.path.isabs(path) else path


def _process(pid: int, role: RoleInfo, proc_root: str, own_pid: int) -> ServeProcess:
    record, unread = read_record(pid, proc_root, own_pid)
    return ServeProcess(pid=pid, role=str(role.role), title=role.title, record=record, unread=unread)


def read_record(pid: int, proc_root: str = "/proc", own_pid: int | None = None) -> tuple[Published | None, str | None]:
    """(the record process `pid` publishes, why it could not be read): (None, None) when it publishes none.

    Each descriptor is looked at by its link (readlink: no open), and the
    memfd is then opened through an O_PATH descriptor of its own, checked to
    be a regular file of that name: a descriptor reused between the two
    (for a FIFO, a device) is never opened for reading. A record whose pid is
    not the process's own (`own_pid`, its PID in its own namespace) is one a
    forked child inherited before it replaced it: not this process's word.
    """
    fd_dir = f"{proc_root}/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except PermissionError:
        return None, "its descriptors cannot be read (permission denied: run kvctl as root)"
    except OSError as e:
        return None, f"its descriptors cannot be read ({e.strerror})"
    best: Published | None = None
    why = None
    for name in names:
        try:
            if os.readlink(f"{fd_dir}/{name}") != LINK:
                continue
        except OSError:  # closed since the listing (the listing's own descriptor, when we read ourselves)
            continue
        try:
            got = _read_memfd(f"{fd_dir}/{name}")
        except (OSError, RecordError) as e:
            why = f"its record could not be read ({e})"
            continue
        if own_pid is not None and got.pid != own_pid:
            continue
        if best is None or got.seq > best.seq:
            best = got
    return best, None if best is not None else why


def _read_memfd(link: str) -> Published:
    path = os.open(link, os.O_PATH | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(path).st_mode) or os.readlink(f"/proc/self/fd/{path}") != LINK:
            raise RecordError("the descriptor changed while it was read")
        fd = os.open(f"/proc/self/fd/{path}", os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    finally:
        os.close(path)
    try:
        chunks, size = [], 0
        while size <= MAX_BYTES and (chunk := os.read(fd, MAX_BYTES + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    return Published.decode(b"".join(chunks))


def _switches(proc_root: str, pid: int) -> dict[str, str] | None:
    """The kvcached switches and allow-lists in `pid`'s environment at its start (None when unreadable)."""
    names = {s.name for s in _SWITCHES} | {s.name for s in _ALLOW_LISTS.values()}
    try:
        with open(f"{proc_root}/{pid}/environ", "rb") as f:
            raw = f.read(1 << 20)
    except OSError:
        return None
    out = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key.decode(errors="replace") in names:
            out[key.decode()] = value.decode(errors="replace")
    return out


@dataclass(frozen=True)
class ServeLine:
    """One doctor line about a serve (diagnostics.py makes it a CheckResult of the engine group)."""

    name: str
    status: str  # ok / warn
    summary: str
    fix: str | None = None
    details: Mapping[str, Any] = field(default_factory=dict)
    under: str | None = None


def serve_lines(serves: Sequence[Serve], *, kvctl: str = "kvctl") -> list[ServeLine]:
    """Per serve: one line (kvcached active in its processes, the patches applied), then a line per patch that
    stood aside in it."""
    out: list[ServeLine] = []
    for s in serves:
        name = f"{s.engine}-serve"
        out.append(_serve_line(s, name))
        for patch, how in s.stood_aside().items():
            for status, pids in how.items():
                shape = status == PatchStatus.UNKNOWN_SHAPE
                why = f"this {s.label}'s shape is not the one it knows" if shape else \
                    "not covered here (a backend or launcher kvcached leaves alone)"
                fix = f"use a kvcached release that knows this {s.label}; meanwhile: {kvctl} gc --yes" if shape \
                    else f"{kvctl} gc --yes cleans up after it"
                out.append(ServeLine(f"{name}:{s.pid}-patch:{patch}", "warn",
                                     f"kvcached patch {patch} stands aside ({status}) in PID "
                                     f"{', '.join(map(str, pids))} of {s.label} serve PID {s.pid}: {why}", fix,
                                     under=name))
    return out


def _serve_line(s: Serve, name: str) -> ServeLine:
    n = len(s.processes)
    who = f"{s.label}{' ' + s.version if s.version else ''} serve PID {s.pid} ({s.title}, {n} process" \
          f"{'' if n == 1 else 'es'})"
    on = [p for p in s.processes if p.record is not None]
    unread = [p for p in s.processes if p.record is None and p.unread]
    details = {"serve": s.to_dict()}
    fix = f"export {SWITCH} in the serve's environment and restart it (both engines' switch)"
    if len(on) == n:
        applied = ", ".join(s.applied()) or "none yet"
        return ServeLine(name, "ok", f"{who}: kvcached active in every process; patches applied: {applied}",
                         details=details)
    if unread and not on:
        return ServeLine(name, "warn", f"{who}: what kvcached did there cannot be read: {unread[0].unread}",
                         "run kvctl doctor engine as root (or as the serve's user)", details=details)
    if on:
        off = [p for p in s.processes if p.record is None]
        listed = ", ".join(f"PID {p.pid} ({p.title})" for p in off[:4]) + (" ..." if len(off) > 4 else "")
        return ServeLine(name, "warn", f"{who}: kvcached active in {len(on)} of {n} processes, not in {listed}; "
                         f"patches applied: {', '.join(s.applied()) or 'none yet'}", fix, details=details)
    why, fix = _silent(s, fix)
    return ServeLine(name, "warn", f"{who}: kvcached not active: none of its processes published what kvcached "
                     f"did in it ({why})", fix, details=details)


def _silent(s: Serve, fix: str) -> tuple[str, str]:
    """(why a serve published nothing, the fix), from its environment at its start: the switch, the allow-list."""
    if s.environ is None:
        return "its environment cannot be read", fix
    switched = any(st.get(s.environ) for st in _SWITCHES)
    allow = _ALLOW_LISTS[s.engine]
    raw = allow.raw(s.environ)
    # vLLM reads an empty list as "no plugin"; SGLang as "every plugin" (each engine's common.plugin_allowed).
    if raw is not None and (s.engine == "vllm" or raw.strip(" ,")) \
            and "kvcached" not in {x.strip() for x in raw.split(",")}:
        listed = ",".join([x.strip() for x in raw.split(",") if x.strip()] + ["kvcached"])
        return (f"{allow.name}={raw!r} in its environment leaves kvcached's plugin out",
                f"export {allow.name}={listed}{'' if switched else ' ' + SWITCH} in the serve's environment and "
                "restart it (both engines' switch)")
    if not switched:
        return "kvcached was not switched on in its environment", fix
    return ("switched on in its environment, yet its plugin published nothing: its kvcached may be older than "
            "this kvctl's", "install this kvctl's kvcached in the serve's environment, restart it, and read its log")
