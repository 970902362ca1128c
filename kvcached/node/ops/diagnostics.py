"""`kvctl doctor`'s checks as data: each check is a named function from a shared context to a result.

Node-state checks read the same plan gc would act on (one scan, one /proc pass
per run). Checks that need another interpreter (the compiled extension, the
installed engines) run it in a subprocess, so a crash or a noisy import there
cannot take down or pollute the caller.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Protocol

from ... import settings
from ..base import name_rules
from ..base.enums import StrEnum
from ..base.layout import SUN_PATH_MAX, Layout
from ..base.mounts import mount_of
from ..base.units import entries
from ..clean.cleanup import Plan, plan
from ..clean.decide import Policy, State
from .detectdoc import DetectDocument, DocumentError, EngineSection, Hazard, PatchReport, PatchStatus
from .detectdoc import parse as parse_detect
from .host_hazards import Finding, HostConfig
from .view import NodeView, build_view

if TYPE_CHECKING:  # the engine pass is imported by the one check that asks for it
    from ..clean.leftovers.act import EnginePlan
    from ..places.run import PlacesPlan
    from .rounds import PlaceResult
    from .serves import Serve


class Status(StrEnum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"


class Group(StrEnum):
    ENVIRONMENT = "environment"
    CONFIGURATION = "configuration"
    NODE = "node"
    ENGINE = "engine"


@dataclass(frozen=True)
class CheckResult:
    name: str
    group: Group
    status: Status
    summary: str
    fix: str | None = None
    details: Mapping[str, Any] = field(default_factory=dict)
    under: str | None = None  # the line this one is listed under (its engine's), which says the fix they share

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (doctor.json's check)."""
        return {"name": self.name, "group": str(self.group), "status": str(self.status),
                "summary": self.summary, "fix": self.fix, "details": dict(self.details), "under": self.under}


@dataclass
class Context:
    """What checks share: the layout, the environment, and one lazily built plan and view."""

    layout: Layout
    _: KW_ONLY  # the rest by keyword: proc_root and python are neighbouring strings
    policy: Policy = field(default_factory=Policy)
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    proc_root: str = "/proc"
    python: str = sys.executable
    timeout: float = 180.0  # detect imports every installed engine (two of them: over a minute on a busy node)
    kvctl: str = "kvctl"  # the command fixes name, with the run's options (`kvctl --root DIR`)
    all_places: bool = False  # doctor -A: the `pods` check looks in every place (kvcached.node.places)
    kubelet_dir: str | None = None
    host: HostConfig | None = None  # where the host's configuration is read; None: under the layout's root

    @property
    def host_config(self) -> HostConfig:
        return self.host if self.host is not None else HostConfig(root=self.layout.root)

    @cached_property
    def plan(self) -> Plan:
        return plan(self.layout, self.policy, proc_root=self.proc_root)

    @cached_property
    def engine_plan(self) -> EnginePlan:
        """The engines' leftovers, judged from the plan's own /proc pass (as `kvctl gc --engines` would)."""
        from ..clean.leftovers.act import plan_engines
        from ..clean.present import rpc_dirs

        return plan_engines(self.layout, self.policy, facts=self.plan.facts, rpc_dirs=rpc_dirs(self.layout.root),
                            proc_root=self.proc_root)

    @cached_property
    def places_plan(self) -> PlacesPlan:
        """Every place's plans from the plan's own /proc pass, the host's first (doctor -A: `pods`, `capacity`)."""
        from ..places.run import plan_places

        return plan_places(self.layout, self.policy, self.plan.facts, kvcached=True, engines=True,
                           kubelet_dir=self.kubelet_dir, host_plan=self.plan, proc_root=self.proc_root)

    @cached_property
    def place_results(self) -> list[PlaceResult]:
        """Every place doctor looks at (with -A; the host's alone without), each with its fill measured."""
        from ..base.place import HOST
        from ..places.fill import measure
        from ..places.run import PlacePlan
        from .rounds import PlaceResult

        plans = (self.places_plan.plans if self.all_places
                 else [PlacePlan(HOST._replace(path=self.layout.root), self.plan, self.engine_plan)])
        return [PlaceResult(p, fill=measure(p.place)) for p in plans]

    @cached_property
    def serves(self) -> list[Serve]:
        """The running serves of this root, from the plan's /proc pass (serves.find_serves)."""
        from .serves import find_serves

        return find_serves(self.plan.facts, root=self.layout.root)

    @cached_property
    def view(self) -> NodeView:
        return build_view(self.plan, read_segments=False)

    @cached_property
    def engines(self) -> DetectDocument:
        """What the integrations of `python` report (run once per run); raises DetectFailed."""
        return detect_engines(self)


@dataclass(frozen=True)
class Check:
    name: str
    group: Group
    description: str
    run: Callable[[Context], list[CheckResult]]


def _r(check: str, group: Group, status: Status, summary: str, fix: str | None = None,
       **details: Any) -> list[CheckResult]:
    return [CheckResult(check, group, status, summary, fix, details)]


# environment ----------------------------------------------------------------

def check_shm(ctx: Context) -> list[CheckResult]:
    g, d = Group.ENVIRONMENT, ctx.layout.shm_dir
    try:
        st = os.stat(d)
    except OSError as e:
        return _r(
            "shm-present",
            g,
            Status.FAIL,
            f"{d}: {e.strerror}",
            "mount a tmpfs there: mount -t tmpfs -o mode=1777 tmpfs /dev/shm",
        )
    if not stat.S_ISDIR(st.st_mode):
        return _r(
            "shm-present", g, Status.FAIL, f"{d} is not a directory", "mount -t tmpfs -o mode=1777 tmpfs /dev/shm"
        )
    out = _r("shm-present", g, Status.OK, f"{d} present")
    mount = mount_of(d, ctx.proc_root)
    if mount is None:
        out += _r(
            "shm-tmpfs",
            g,
            Status.WARN,
            f"cannot tell what filesystem holds {d}",
            "check /proc/self/mountinfo is readable",
        )
    elif mount.fstype == "tmpfs":
        out += _r("shm-tmpfs", g, Status.OK, f"{d} is on tmpfs (mounted at {mount.point})")
    else:
        out += _r(
            "shm-tmpfs",
            g,
            Status.WARN,
            f"{d} is on {mount.fstype} (mounted at {mount.point}), not tmpfs: segments survive reboots there",
            "mount -t tmpfs -o mode=1777 tmpfs /dev/shm",
            fstype=mount.fstype,
        )
    try:
        vfs = os.statvfs(d)
    except OSError as e:
        return out + _r("shm-space", g, Status.WARN, f"statvfs {d}: {e.strerror}")
    free, inodes = vfs.f_bavail * vfs.f_frsize, vfs.f_favail
    details: dict[str, Any] = {"free_bytes": free, "free_inodes": inodes}
    if free < 4096 or (vfs.f_files and inodes == 0):
        out += _r(
            "shm-space",
            g,
            Status.FAIL,
            f"{d} is full ({free} bytes, {inodes} inodes free): new segments cannot be created",
            f"remove stale state: {ctx.kvctl} gc --yes",
            **details,
        )
    elif free < (1 << 20) or (vfs.f_files and inodes < 100):
        out += _r(
            "shm-space",
            g,
            Status.WARN,
            f"{d} is nearly full ({free >> 10} KiB, {inodes} inodes free)",
            f"remove stale state: {ctx.kvctl} gc --yes",
            **details,
        )
    else:
        out += _r(
            "shm-space",
            g,
            Status.OK,
            f"{d}: {free >> 20} MiB and {inodes if vfs.f_files else 'unlimited'} inodes free",
            **details,
        )
    return out


def check_tmp(ctx: Context) -> list[CheckResult]:
    d = ctx.layout.tmp_dir
    try:
        st = os.stat(d)
    except OSError as e:
        return _r(
            "tmp-sticky", Group.ENVIRONMENT, Status.FAIL, f"{d}: {e.strerror}", f"create it: install -d -m 1777 {d}"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o002 and not mode & stat.S_ISVTX:
        return _r(
            "tmp-sticky",
            Group.ENVIRONMENT,
            Status.FAIL,
            f"{d} is world-writable without the sticky bit (mode {mode:o}): "
            "anyone can remove or replace worker sockets",
            f"chmod +t {d}",
            mode=f"{mode:o}",
        )
    return _r("tmp-sticky", Group.ENVIRONMENT, Status.OK, f"{d} mode {mode:o}", mode=f"{mode:o}")


def check_proc(ctx: Context) -> list[CheckResult]:
    facts = ctx.plan.facts
    g = Group.ENVIRONMENT
    if facts.errors:
        return _r(
            "proc-readable",
            g,
            Status.FAIL,
            f"/proc cannot be read: {facts.errors[0]}",
            "run kvctl where /proc is mounted (host PID namespace, or hostPID: true in Kubernetes)",
        )
    if facts.hidepid:
        return _r(
            "proc-readable",
            g,
            Status.WARN,
            "/proc is mounted with hidepid: other users' processes are invisible, their state stays unknown",
            "run kvctl as root or as a member of the /proc gid= group",
        )
    incomplete = ctx.view.incomplete
    if incomplete:
        return _r(
            "proc-readable",
            g,
            Status.WARN,
            f"{len(incomplete)} engine-like process(es) could not be fully read (e.g. PID {incomplete[0]}): "
            "state they could own stays unknown",
            f"run kvctl as root (sudo {ctx.kvctl} doctor)",
            pids=incomplete,
        )
    return _r("proc-readable", g, Status.OK, f"/proc readable ({len(facts.processes)} processes)")


def check_privileges(ctx: Context) -> list[CheckResult]:
    uid = ctx.policy.effective_uid
    if uid == 0:
        return _r(
            "privileges",
            Group.ENVIRONMENT,
            Status.OK,
            "running as root: every user's state can be judged and cleaned",
            uid=uid,
        )
    others = sorted(
        {
            e.candidate.uid
            for e in ctx.view.unowned + [x for d in ctx.view.deployments for x in d.entries]
            if e.candidate.uid != uid
        }
    )
    if others:
        return _r(
            "privileges",
            Group.ENVIRONMENT,
            Status.WARN,
            f"running as uid {uid}: entries of uid {', '.join(map(str, others))} are reported but never removed",
            f"run as root to clean them: sudo {ctx.kvctl} gc",
            uid=uid,
        )
    return _r("privileges", Group.ENVIRONMENT, Status.OK, f"running as uid {uid}; all entries found are ours", uid=uid)


def check_sight(ctx: Context) -> list[CheckResult]:
    """Whether this kvctl reads every process's fds, maps and status; fail with the fix for each cause (sight.py)."""
    from ..clean.sight import assess

    sight = assess(ctx.proc_root, ctx.plan.facts)
    creds = sight.credentials
    who: dict[str, Any] = {"uid": creds.uid, "cap_sys_ptrace": creds.ptrace, "lsm": creds.lsm} if creds else {}
    if not sight.blind:
        return _r("sight", Group.ENVIRONMENT, Status.OK,
                  f"kvctl reads every process it judges ({len(ctx.plan.facts.processes)} processes)", **who)
    return [CheckResult("sight", Group.ENVIRONMENT, Status.FAIL, r.detail, r.fix,
                        {"cause": str(r.cause), "pids": list(r.pids), **who}) for r in sight.reasons]


def _finding(name: str, f: Finding, group: Group = Group.ENVIRONMENT) -> list[CheckResult]:
    return _r(name, group, Status(f.status), f.summary, f.fix, **f.details)


def _serves(ctx: Context) -> dict[int, list[int]]:
    """uid -> PIDs of kvcached deployments' processes and engine processes (API servers, engines, workers)."""
    from ..clean.roles import Role, classify_process
    from .host_hazards import serve_uids

    procs = {p.info.pid: p.info for d in ctx.view.deployments for p in d.processes}
    procs.update({p.pid: p for p in ctx.plan.facts.processes.values() if classify_process(p).role is not Role.OTHER})
    return serve_uids(procs.values())


def check_logind(ctx: Context) -> list[CheckResult]:
    from .host_hazards import check_remove_ipc

    return _finding("logind-removeipc", check_remove_ipc(ctx.host_config, _serves(ctx)))


def check_tmpfiles(ctx: Context) -> list[CheckResult]:
    from .host_hazards import check_tmpfiles as tmpfiles

    names = {d.name for d in ctx.view.deployments} | {name_rules.ipc_name_from_env(ctx.environ, tag="proc")}
    return _finding("tmpfiles-age", tmpfiles(ctx.host_config, {n for n in names if name_rules.is_valid_name(n)}))


def check_upstream_limits(ctx: Context) -> list[CheckResult]:
    from .host_hazards import check_upstream_limits as upstream

    return _finding("upstream-limits", upstream(ctx.python, ctx.environ, ctx.timeout), Group.CONFIGURATION)


# configuration --------------------------------------------------------------


def _longest_socket(layout: Layout, name: str) -> str:
    # Two-digit stages and ranks bound every shape we expect (PP, TP ≤ 99).
    return layout.seen_path(layout.socket_path(name, 99, 99))


def check_ipc_name(ctx: Context) -> list[CheckResult]:
    g = Group.CONFIGURATION
    raw = settings.IPC_NAME.raw(ctx.environ) or ""
    if not raw:
        return _r("ipc-name", g, Status.OK, f"{name_rules.ENV_NAME} unset: deployments use kvcached_<Tag>_<PGID>")
    clean = name_rules.sanitize(raw)
    if clean != raw:
        return _r(
            "ipc-name",
            g,
            Status.WARN,
            f"{name_rules.ENV_NAME}={raw!r} is used as {clean!r}: tools given the raw name will not find it",
            f"export {name_rules.ENV_NAME}={clean}",
            raw=raw,
            name=clean,
        )
    return _r("ipc-name", g, Status.OK, f"{name_rules.ENV_NAME}={clean}", name=clean)


def check_socket_paths(ctx: Context) -> list[CheckResult]:
    g = Group.CONFIGURATION
    names = {name_rules.ipc_name_from_env(ctx.environ, tag="proc")} | {d.name for d in ctx.view.deployments}
    too_long = []
    longest = ("", 0)
    for name in sorted(names):
        if not name_rules.is_valid_name(name):
            continue
        path = _longest_socket(ctx.layout, name)
        n = len(os.fsencode(path))
        longest = max(longest, (path, n), key=lambda t: t[1])
        if n >= SUN_PATH_MAX:
            too_long.append(name)
    if too_long:
        return _r(
            "socket-paths",
            g,
            Status.FAIL,
            f"socket paths of {', '.join(too_long)} exceed {SUN_PATH_MAX - 1} bytes: workers cannot bind",
            f"use a shorter {name_rules.ENV_NAME}",
            names=too_long,
        )
    return _r("socket-paths", g, Status.OK, f"socket paths fit in {SUN_PATH_MAX - 1} bytes (longest {longest[1]})")


_EXT_PROBE = (
    "import importlib.util, sys\n"
    "if importlib.util.find_spec('kvcached.runtime._kvpages') is None:\n"
    "    print('missing'); sys.exit(3)\n"
    "import kvcached.runtime._kvpages\n"
)


def _probe(ctx: Context, code: str) -> subprocess.CompletedProcess[str]:
    """Run `code` in the serve's interpreter and environment, leaving no bytecode beside its install."""
    return subprocess.run(
        [ctx.python, "-c", code],
        capture_output=True,
        text=True,
        timeout=ctx.timeout,
        env={**ctx.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        stdin=subprocess.DEVNULL,
    )


def check_extension(ctx: Context) -> list[CheckResult]:
    g = Group.CONFIGURATION
    try:
        r = _probe(ctx, _EXT_PROBE)
    except (OSError, subprocess.TimeoutExpired) as e:
        return _r("extension", g, Status.FAIL, f"could not run {ctx.python}: {e}")
    if r.returncode == 0:
        return _r("extension", g, Status.OK, "compiled extension kvcached.runtime._kvpages loads")
    if r.returncode == 3:
        return _r(
            "extension",
            g,
            Status.WARN,
            "compiled extension kvcached.runtime._kvpages is not built: engines cannot use this install",
            "build it: pip install -e . (needs a C++ compiler)",
        )
    last = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
    return _r(
        "extension",
        g,
        Status.FAIL,
        f"kvcached.runtime._kvpages does not load: {last}",
        "rebuild it: pip install --force-reinstall --no-deps -e .",
        stderr=r.stderr[-2000:],
    )


# node state -----------------------------------------------------------------


def check_stale(ctx: Context) -> list[CheckResult]:
    g = Group.NODE
    found = [e for d in ctx.view.deployments for e in d.entries] + ctx.view.unowned
    stale = [e for e in found if e.state is State.STALE]
    unknown = [e for e in found if e.state is State.UNKNOWN]
    foreign = [e for e in found if e.state is State.FOREIGN]
    out: list[CheckResult] = []
    if stale:
        deps = sorted({e.candidate.deployment or "?" for e in stale})
        out += _r("stale", g, Status.WARN,
                  f"{entries(len(stale), 'stale')} of {len(deps)} dead deployment(s): {', '.join(deps)}",
                  f"{ctx.kvctl} gc --yes", paths=[e.path for e in stale])
    else:
        out += _r("stale", g, Status.OK, f"no stale entries ({len(found)} found)")
    if unknown:
        reasons = sorted({str(e.decision.reason) for e in unknown})
        out += _r("unknown", g, Status.WARN,
                  f"{entries(len(unknown))} of unknown liveness ({', '.join(reasons)}): kept",
                  f"see why, as root for complete evidence: sudo {ctx.kvctl} inspect", paths=[e.path for e in unknown])
    if foreign:
        reasons = sorted({str(e.decision.reason) for e in foreign})
        out += _r("foreign", g, Status.WARN, f"{entries(len(foreign))} not ours ({', '.join(reasons)}): never touched",
                  f"see why: {ctx.kvctl} inspect", paths=[e.path for e in foreign])
    return out


def check_orphans(ctx: Context) -> list[CheckResult]:
    orphans = ctx.view.orphans
    if not orphans:
        return _r("orphans", Group.NODE, Status.OK, "no orphaned kvcached processes")
    desc = ", ".join(f"PID {p.pid} ({d.name} {p.role.role})" for d, p in orphans[:5])
    return _r(
        "orphans",
        Group.NODE,
        Status.WARN,
        f"{len(orphans)} orphaned process(es): {desc}",
        f"{ctx.kvctl} gc --kill-orphans",
        pids=[p.pid for _, p in orphans],
    )


def check_gpu_orphans(ctx: Context) -> list[CheckResult]:
    """Orphaned engine processes holding a GPU (kvcached.node.gpu)."""
    from ..gpu.doctor import gpu_orphan_findings

    return [CheckResult("gpu-orphans", Group.NODE, Status(status), summary, fix, details)
            for status, summary, fix, details in gpu_orphan_findings(ctx.plan.facts, ctx.kvctl)]


def check_namespaces(ctx: Context) -> list[CheckResult]:
    ns = ctx.view.namespaces
    if not ns:
        return _r("namespaces", Group.NODE, Status.OK, "no kvcached processes in other mount namespaces")
    first = ns[0]
    return _r(
        "namespaces",
        Group.NODE,
        Status.WARN,
        f"{len(ns)} other mount namespace(s) run kvcached-like processes with their own /tmp or /dev/shm "
        f"(e.g. PID {first.hint_pid})",
        f"{ctx.kvctl} inspect --pid {first.hint_pid}",
        namespaces=[n.to_dict() for n in ns],
    )


def check_engine_leftovers(ctx: Context) -> list[CheckResult]:
    """What the engines themselves left (kvcached.node.clean.leftovers' families): warn while dead ones hold memory."""
    from collections import Counter

    from ..base.units import format_size

    found = ctx.engine_plan.entries()
    stale = [c for c, d in found if d.state is State.STALE]
    if not stale:
        kept = Counter(str(d.state) for _, d in found)
        return _r("engine-leftovers", Group.NODE, Status.OK, "no dead engine leftovers"
                  + (f" ({', '.join(f'{n} {s}' for s, n in sorted(kept.items()))}: kept)" if found else ""))
    held = sum(c.allocated for c in stale)
    by_engine = ", ".join(f"{n} {e}" for e, n in sorted(Counter(str(c.engine) for c in stale).items()))
    return _r("engine-leftovers", Group.NODE, Status.WARN,
              f"{entries(len(stale), 'dead')} left by the engines ({by_engine}) holding {format_size(held)}",
              f"{ctx.kvctl} gc --engines --yes", paths=[c.path for c in stale], bytes=held)


# serving engine ---------------------------------------------------------------

# The integrations' one entry for doctor (docs/VLLM.md, "kvctl doctor"): it prints kvcached.detect/1.
DETECT_ARGV = ("-m", "kvcached.integration.detect", "--json")


class DetectFailed(Exception):
    """The integrations' detect gave no usable document: the doctor line to show instead."""

    def __init__(self, status: Status, summary: str, fix: str | None = None, **details: Any) -> None:
        super().__init__(summary)
        self.status, self.summary, self.fix, self.details = status, summary, fix, details


def detect_engines(ctx: Context) -> DetectDocument:
    """Run `python -m kvcached.integration.detect --json` in the serve's interpreter; its document, read strictly.

    Raises DetectFailed: a warning when it could not run or exited non-zero
    (the engine's import broke: nothing is known), a failure when it printed a
    document that is not kvcached.detect/1 (the kvcached there does not keep
    the contract this doctor reads).
    """
    try:
        r = subprocess.run([ctx.python, *DETECT_ARGV], capture_output=True, text=True, timeout=ctx.timeout,
                           env={**ctx.environ, "PYTHONDONTWRITEBYTECODE": "1"}, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise DetectFailed(Status.WARN, f"could not inspect the installed engines: {e}") from None
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
        raise DetectFailed(Status.WARN, f"could not inspect the installed engines: {last}", stderr=r.stderr[-2000:])
    fix = (f"install the same kvcached in {ctx.python} as this kvctl's "
           "(pip install --force-reinstall --no-deps kvcached, or pip install -e . in a checkout)")
    try:
        return parse_detect(json.loads(r.stdout))
    except json.JSONDecodeError as e:
        raise DetectFailed(Status.FAIL, f"kvcached.integration.detect printed no JSON document ({e})", fix,
                           stdout=r.stdout[-2000:]) from None
    except DocumentError as e:
        raise DetectFailed(Status.FAIL, f"kvcached.integration.detect printed a malformed document: {e}", fix,
                           stdout=r.stdout[-2000:]) from None


def check_engines(ctx: Context) -> list[CheckResult]:
    """The running serves, from what each of their processes published (serves.py); when none runs, each
    installed engine as this shell's environment has it (kvcached.detect/1), said to be the shell's."""
    from .serves import find_serves, serve_lines

    g = Group.ENGINE
    serves = find_serves(ctx.plan.facts, root=ctx.layout.root)
    if serves:  # the serves' own word; the shell's environment is no evidence of theirs
        return [CheckResult(s.name, g, Status(s.status), s.summary, s.fix, s.details, s.under)
                for s in serve_lines(serves, kvctl=ctx.kvctl)]
    where = "" if ctx.layout.root == "/" else f" with KVCACHED_ROOT={ctx.layout.root}"
    shell = _r("engines", g, Status.SKIP, f"no serve of an engine kvcached integrates with runs{where}: the lines "
               f"below are this shell's environment ({ctx.python}), not a serve's; run {ctx.kvctl} doctor engine "
               "again once it runs")
    try:
        doc = ctx.engines
    except DetectFailed as e:  # one line: this shell's interpreter could not answer at all
        return _r("engines", g, e.status, e.summary, e.fix, **e.details)
    if not doc.engines:
        return _r("engines", g, Status.SKIP, "no engine kvcached integrates with is installed here")
    # The /proc pass only where a hazard names processes to look for.
    wanted = any(h.processes for s in doc.engines.values() for h in s.hazards)
    processes = list(ctx.plan.facts.processes.values()) if wanted else []
    out: list[CheckResult] = shell
    for name, section in doc.engines.items():
        out += engine_results(name, section, processes, kvctl=ctx.kvctl)
    return out


class _Process(Protocol):
    """What hazards are judged by: a process's id and command line (facts.ProcessInfo has them)."""

    @property
    def pid(self) -> int: ...
    @property
    def cmdline(self) -> Sequence[str]: ...


def engine_results(name: str, section: EngineSection, processes: Iterable[_Process] = (),
                   kvctl: str = "kvctl") -> list[CheckResult]:
    """Doctor lines from the section `name` of kvcached.detect/1, judging its hazards against the node's `processes`.

    The engine's line comes first and every other line is listed under it
    (`under`); what makes kvcached active is said once, on the engine's line
    (or on `<name>-plugins` when the allow-list is what keeps it out), not on
    each patch it would make active. Fixes name `kvctl` (Context.kvctl).
    """
    label = section.label or name
    hazards = [line for h in section.hazards for line in _hazard_lines(name, label, h, processes, kvctl)]
    if section.error:
        return [CheckResult(name, Group.ENGINE, Status.WARN,
                            f"could not inspect the installed {label}: {section.error}"), *hazards]
    out = _plugin_lines(name, label, section) + _proven_lines(name, label, section)
    out += [_patch_line(name, label, section, patch, kvctl) for patch in section.patches]
    return out + _condition_lines(name, label, section, kvctl) + hazards


def _plugin_lines(name: str, label: str, section: EngineSection) -> list[CheckResult]:
    """The engine's line and, where its allow-list leaves kvcached out, `<name>-plugins`: the one that says the fix."""
    g, plugin = Group.ENGINE, section.plugin
    fix = None if plugin.active else plugin.fix or f"turn kvcached's {label} integration on in this environment"
    state = (f"enabled, but inactive: {plugin.allow_list_var} excludes it" if plugin.enabled and not plugin.allowed
             else "enabled" if plugin.enabled else "not enabled in this environment")
    out = [CheckResult(name, g, Status.OK if plugin.active else Status.WARN,
                       f"{label} {section.version or '?'} installed; kvcached integration {state}",
                       fix if plugin.allowed else None, {"detect": section.to_dict()})]
    if not plugin.allowed:
        out.append(CheckResult(f"{name}-plugins", g, Status.WARN,
                               f"{plugin.allow_list_var}={plugin.allow_list!r} does not list kvcached: "
                               f"{label} never loads kvcached's plugin, so its patches are inactive", fix, under=name))
    return out


def _proven_lines(name: str, label: str, section: EngineSection) -> list[CheckResult]:
    """`<name>-proven`: whether the installed version is one this kvcached was proven on (none: not said)."""
    if not section.proven:
        return []
    proven = ", ".join(section.proven)
    version = section.version or "?"
    if not section.unproven:
        return [CheckResult(f"{name}-proven", Group.ENGINE, Status.OK,
                            f"{label} {version} is proven: this kvcached was proven on {label} {proven}",
                            under=name)]
    return [CheckResult(f"{name}-proven", Group.ENGINE, Status.WARN,
                        f"{label} {version} is unproven: this kvcached was proven on {label} {proven} only; "
                        "the patches' shape checks below are all that is known here",
                        f"install one of {label} {proven}, or a kvcached proven on {label} {version}", under=name)]


def _patch_line(name: str, label: str, section: EngineSection, patch: PatchReport, kvctl: str) -> CheckResult:
    g, line, why = Group.ENGINE, f"{name}-patch:{patch.name}", f" ({patch.reason})" if patch.reason else ""
    if section.patch_active(patch):
        return CheckResult(line, g, Status.OK, f"kvcached patch {patch.name}: active{why}", under=name)
    if patch.status is PatchStatus.READY:  # what would make it active is the engine's fix, said once above
        return CheckResult(line, g, Status.WARN, f"kvcached patch {patch.name}: inactive{why}", under=name)
    if patch.status is PatchStatus.UNKNOWN_SHAPE:
        return CheckResult(line, g, Status.WARN,
                           f"kvcached patch {patch.name}: stands aside, unknown {label} shape{why}",
                           f"use a kvcached release that knows this {label}; meanwhile: {kvctl} gc --yes", under=name)
    words = {PatchStatus.NOT_NEEDED: "not needed", PatchStatus.DISABLED: "off",
             PatchStatus.NOT_COVERED: "not covered here"}
    return CheckResult(line, g, Status.SKIP,
                       f"kvcached patch {patch.name}: {words.get(patch.status, str(patch.status))}{why}", under=name)


def _condition_lines(name: str, label: str, section: EngineSection, kvctl: str) -> list[CheckResult]:
    """A line per leak condition (`<name>:<condition>`): ok when absent or worked around by an active patch."""
    active = any(section.patch_active(p) for p in section.patches)
    out = []
    for c in section.conditions:
        text = f"{label} {c.name}: " + {True: "present", False: "absent", None: "could not tell"}[c.present]
        text += f" ({c.detail})" if c.detail else ""
        line = f"{name}:{c.name}"
        if c.present is False:
            out.append(CheckResult(line, Group.ENGINE, Status.OK, text, under=name))
        elif c.present and active:
            out.append(CheckResult(line, Group.ENGINE, Status.OK, text + "; kvcached's patches work around it",
                                   under=name))
        else:
            out.append(CheckResult(line, Group.ENGINE, Status.WARN,
                                   text + ("; no kvcached patch is active" if c.present else ""),
                                   f"until kvcached's patches are active, clean up by hand: {kvctl} gc --yes",
                                   under=name))
    return out


def _hazard_lines(name: str, label: str, hazard: Hazard, processes: Iterable[_Process],
                  kvctl: str) -> list[CheckResult]:
    """`<name>-<hazard>`: a warning when this environment is such a serve or node processes show one, else a note."""
    line, match = f"{name}-{hazard.name}", hazard.processes
    pids = sorted(p.pid for p in processes if match.matches(p.cmdline)) if match else []
    if hazard.present or pids:
        why = [hazard.detail] if hazard.present and hazard.detail else []
        if match and pids:
            why.append(f"{match.label} process(es) here (PID {', '.join(map(str, pids[:8]))})")
        fix = f"{hazard.fix}; meanwhile clean up by hand: {kvctl} gc --yes" if hazard.fix else f"{kvctl} gc --yes"
        summary = ("; ".join(why) + ": " if why else "") + hazard.summary
        return [CheckResult(line, Group.ENGINE, Status.WARN, summary, fix, {"pids": pids} if pids else {}, under=name)]
    if not hazard.report_absent:
        return []
    note = (f"; {hazard.detail}" if hazard.detail else "") + (f"; no {match.label} process runs here" if match else "")
    return [CheckResult(line, Group.ENGINE, Status.SKIP, hazard.summary + note, under=name)]


def check_pods(ctx: Context) -> list[CheckResult]:
    """With -A: warn for each place other than the host's whose dead leftovers `kvctl gc -A --engines` removes."""
    g = Group.NODE
    if not ctx.all_places:
        return _r("pods", g, Status.SKIP, "the pods' volumes and containers' shm were not looked at (run with -A)")
    from ..base.units import format_size
    from ..places.doctor import dead_places

    dead, n, errors = dead_places(ctx.layout, ctx.policy, ctx.plan.facts, pp=ctx.places_plan)
    out: list[CheckResult] = []
    for d in dead:
        out += _r("pods", g, Status.WARN,
                  f"{d.place.label}: {entries(d.entries, 'dead')} holding {format_size(d.bytes)}; the next start "
                  "there may fail on a full /dev/shm",
                  f"{ctx.kvctl} gc -A --engines --yes (removes only what is provably dead)",
                  place=d.place.to_dict(), stale_entries=d.entries, stale_bytes=d.bytes)
    if out:
        return out
    unread = f"; could not read: {'; '.join(errors[:3])}" if errors else ""
    return _r("pods", g, Status.OK, f"{n} place(s) besides the host's, none with dead leftovers{unread}",
              places=n, errors=errors)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def check_events(ctx: Context) -> list[CheckResult]:
    """Whether gc --every -A's event path can run here (ops/events.py): pidfds, inotify, the open-files limit."""
    import errno as errno_
    import os as os_
    import resource

    from ..base.inotify import Inotify

    g = Group.ENVIRONMENT
    out: list[CheckResult] = []
    try:
        os_.close(os_.pidfd_open(os_.getpid()))
    except (AttributeError, OSError) as e:
        why = "no os.pidfd_open in this Python" if isinstance(e, AttributeError) else \
            ("the kernel has no pidfd_open (below 5.3)" if e.errno == errno_.ENOSYS else f"pidfd_open: {e.strerror}")
        out += _r("events", g, Status.WARN, f"{why}: gc --every -A sees exits only at its rounds",
                  "a kernel of 5.3 or later; where a seccomp profile refuses pidfd_open, allow it (the DaemonSet's "
                  "RuntimeDefault allows it on containerd and CRI-O)", pidfd=False)
    watches = _read_int("/proc/sys/fs/inotify/max_user_watches")
    try:
        with Inotify() as ino:
            ino.add(ctx.layout.shm_dir)
    except OSError as e:
        out += _r("events", g, Status.WARN, f"inotify: {e.strerror}: gc --every -A sees new files only at its "
                  "rounds", "raise fs.inotify.max_user_instances and fs.inotify.max_user_watches (sysctl)",
                  inotify=False, max_user_watches=watches)
    processes = len(ctx.plan.facts.processes)
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < processes + 64:
        out += _r("events", g, Status.WARN, f"the open-files limit ({soft}) is below one pidfd for each of the "
                  f"{processes} processes: places beyond it see exits only at gc --every's rounds",
                  "raise the limit (LimitNOFILE=, ulimit -n) above the node's processes", nofile=soft,
                  processes=processes)
    if out:
        return out
    return _r("events", g, Status.OK, "pidfds and inotify available: gc --every -A judges a place again when its "
              f"processes exit or it gets new files (open-files limit {soft}, {processes} processes)",
              pidfd=True, inotify=True, nofile=soft, max_user_watches=watches)


def check_capacity(ctx: Context) -> list[CheckResult]:
    """How full each place is (the host's; with -A every place): warn and fail at KVCTL_CAPACITY_WARN and _FAIL."""
    from ..places.doctor import capacity_findings

    found = capacity_findings(ctx.place_results, warn=settings.KVCTL_CAPACITY_WARN.get(ctx.environ),
                              fail=settings.KVCTL_CAPACITY_FAIL.get(ctx.environ), kvctl=ctx.kvctl)
    return [CheckResult("capacity", Group.NODE, Status(status), summary, fix, details)
            for status, summary, fix, details in found]


def check_small_shm(ctx: Context) -> list[CheckResult]:
    """Each tensor- or pipeline-parallel serve whose ranks see a /dev/shm smaller than it needs (small_shm.py)."""
    from .small_shm import parallel_needs, small_shm_findings

    needs = parallel_needs(ctx.plan.facts, ctx.serves)
    if not needs:
        return _r("small-shm", Group.NODE, Status.OK, "no tensor- or pipeline-parallel serve runs here")
    place_of: dict[str, str] = {}
    for r in ctx.place_results if ctx.all_places else []:
        if r.fill is not None and r.fill.device is not None:
            place_of.setdefault(r.fill.device, r.place.label)
    try:
        st = os.stat(ctx.layout.shm_dir)
        place_of.setdefault(f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}", f"the host's {ctx.layout.shm_dir}")
    except OSError:
        pass
    return [CheckResult("small-shm", Group.NODE, Status(status), summary, fix, details)
            for status, summary, fix, details in small_shm_findings(needs, place_of)]


CHECKS: tuple[Check, ...] = (
    Check("shm", Group.ENVIRONMENT, "/dev/shm present, on tmpfs, with free space and inodes", check_shm),
    Check("tmp", Group.ENVIRONMENT, "/tmp sticky when world-writable", check_tmp),
    Check("proc", Group.ENVIRONMENT, "/proc readable, hidepid", check_proc),
    Check("privileges", Group.ENVIRONMENT, "who we run as and what we may clean", check_privileges),
    Check("sight", Group.ENVIRONMENT, "every process's fds, maps and status readable: hostPID, hidepid, "
          "CAP_SYS_PTRACE, security modules", check_sight),
    Check("events", Group.ENVIRONMENT, "pidfds, inotify and the open-files limit gc --every -A's event path "
          "needs", check_events),
    Check("logind", Group.ENVIRONMENT, "systemd-logind RemoveIPC=yes and serves of users without lingering",
          check_logind),
    Check("tmpfiles", Group.ENVIRONMENT, "systemd-tmpfiles rules that age kvcached's paths in /dev/shm or /tmp",
          check_tmpfiles),
    Check("upstream-limits", Group.CONFIGURATION, "upstream kvcached's in-process revisioned limits next to "
          "kvctl limit", check_upstream_limits),
    Check("ipc-name", Group.CONFIGURATION, "KVCACHED_IPC_NAME sanitised vs. raw", check_ipc_name),
    Check("socket-paths", Group.CONFIGURATION, "socket paths within 108 bytes", check_socket_paths),
    Check("extension", Group.CONFIGURATION, "compiled extension loadable (in a subprocess)", check_extension),
    Check("stale", Group.NODE, "stale, unknown and foreign entries (the scan gc uses)", check_stale),
    Check("orphans", Group.NODE, "orphaned workers", check_orphans),
    Check("gpu-orphans", Group.NODE, "engine processes holding a GPU after their serve is gone", check_gpu_orphans),
    Check("namespaces", Group.NODE, "deployments in other mount namespaces", check_namespaces),
    Check("engine-leftovers", Group.NODE, "what the engines, NCCL and CUDA IPC left that is provably dead",
          check_engine_leftovers),
    Check("pods", Group.NODE, "with -A: pod volumes and containers' shm holding dead leftovers", check_pods),
    Check("capacity", Group.NODE, "how full each place is (with -A every pod's) and what fills it",
          check_capacity),
    Check("small-shm", Group.NODE, "a /dev/shm smaller than the tensor- or pipeline-parallel serve that uses it "
          "needs (Docker's 64 MiB default)", check_small_shm),
    Check("engines", Group.ENGINE, "the running serves: kvcached active in each, the patches each applied (as "
          "they publish it); with none running, the installed engines as this shell has them", check_engines),
)
CHECK_NAMES = tuple(c.name for c in CHECKS)


def select(names: list[str] | tuple[str, ...] = ()) -> list[Check]:
    """Checks by name or group name; all when `names` is empty. Raise KeyError naming an unknown one."""
    if not names:
        return list(CHECKS)
    out: list[Check] = []
    for n in names:
        hits = [c for c in CHECKS if n in (c.name, str(c.group))]
        if not hits:
            raise KeyError(n)
        out += [c for c in hits if c not in out]
    return out


def run_checks(ctx: Context, checks: list[Check]) -> list[CheckResult]:
    """Run checks in order; a check that raises becomes a `fail` result naming the error."""
    out: list[CheckResult] = []
    for check in checks:
        try:
            out += check.run(ctx)
        except Exception as e:  # one broken check must not hide the others
            out += _r(check.name, check.group, Status.FAIL, f"check failed: {type(e).__name__}: {e}")
    return out


def healthy(results: list[CheckResult], *, strict: bool = False) -> bool:
    bad = {Status.FAIL, Status.WARN} if strict else {Status.FAIL}
    return not any(r.status in bad for r in results)
