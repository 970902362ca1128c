"""`kvctl doctor`'s checks as data: each check is a named function from a shared context to a result.

Node-state checks read the same plan gc would act on (one scan, one /proc pass
per run). Checks that need another interpreter (the compiled extension, the
installed vLLM) run it in a subprocess, so a crash or a noisy import there
cannot take down or pollute the caller.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from .. import settings
from . import naming
from .cleanup import Plan, plan
from .decide import Policy, State
from .detectdoc import (
    RAY_INSTALLED,
    SGLANG_PLATFORM,
    SGLANG_PLATFORM_COVERED,
    SGLANG_RUST_SERVER,
    DetectDocument,
    DocumentError,
    EngineSection,
    PatchReport,
    PatchStatus,
)
from .detectdoc import parse as parse_detect
from .enums import StrEnum
from .layout import SUN_PATH_MAX, Layout
from .mounts import mount_of
from .units import entries
from .view import NodeView, build_view

if TYPE_CHECKING:  # the engine pass is imported by the one check that asks for it
    from .engines import EnginePlan


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

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "group": str(self.group), "status": str(self.status),
                "summary": self.summary, "fix": self.fix, "details": dict(self.details)}


@dataclass
class Context:
    """What checks share: the layout, the environment, and one lazily built plan and view."""

    layout: Layout
    _: KW_ONLY  # the rest by keyword: proc_root and python are neighbouring strings
    policy: Policy = field(default_factory=Policy)
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    proc_root: str = "/proc"
    python: str = sys.executable
    timeout: float = 180.0  # detect imports every installed engine (vLLM and SGLang: over a minute on a busy node)
    kvctl: str = "kvctl"  # the command fixes name, with the run's options (`kvctl --root DIR`)
    all_places: bool = False  # doctor -A: the `pods` check looks in every place (kvcached.node.places)
    kubelet_dir: str | None = None

    @cached_property
    def plan(self) -> Plan:
        return plan(self.layout, self.policy, proc_root=self.proc_root)

    @cached_property
    def engine_plan(self) -> EnginePlan:
        """The engines' leftovers, judged from the plan's own /proc pass (as `kvctl gc --engines` would)."""
        from .engines import plan_engines
        from .names import rpc_dirs

        return plan_engines(self.layout, self.policy, facts=self.plan.facts, rpc_dirs=rpc_dirs(self.layout.root),
                            proc_root=self.proc_root)

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


# configuration --------------------------------------------------------------


def _longest_socket(layout: Layout, name: str) -> str:
    # Two-digit stages and ranks bound every shape we expect (PP, TP ≤ 99).
    return layout.seen_path(layout.socket_path(name, 99, 99))


def check_ipc_name(ctx: Context) -> list[CheckResult]:
    g = Group.CONFIGURATION
    raw = settings.IPC_NAME.raw(ctx.environ) or ""
    if not raw:
        return _r("ipc-name", g, Status.OK, f"{naming.ENV_NAME} unset: deployments use kvcached_<Tag>_<PGID>")
    clean = naming.sanitize(raw)
    if clean != raw:
        return _r(
            "ipc-name",
            g,
            Status.WARN,
            f"{naming.ENV_NAME}={raw!r} is used as {clean!r}: tools given the raw name will not find it",
            f"export {naming.ENV_NAME}={clean}",
            raw=raw,
            name=clean,
        )
    return _r("ipc-name", g, Status.OK, f"{naming.ENV_NAME}={clean}", name=clean)


def check_socket_paths(ctx: Context) -> list[CheckResult]:
    g = Group.CONFIGURATION
    names = {naming.ipc_name_from_env(ctx.environ, tag="proc")} | {d.name for d in ctx.view.deployments}
    too_long = []
    longest = ("", 0)
    for name in sorted(names):
        if not naming.is_valid_name(name):
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
            f"use a shorter {naming.ENV_NAME}",
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
        out += _r(
            "stale",
            g,
            Status.WARN,
            f"{entries(len(stale), 'stale')} of {len(deps)} dead deployment(s): {', '.join(deps)}",
            f"{ctx.kvctl} gc --yes",
            paths=[e.path for e in stale],
        )
    else:
        out += _r("stale", g, Status.OK, f"no stale entries ({len(found)} found)")
    if unknown:
        reasons = sorted({str(e.decision.reason) for e in unknown})
        out += _r(
            "unknown",
            g,
            Status.WARN,
            f"{entries(len(unknown))} of unknown liveness ({', '.join(reasons)}): kept",
            f"see why, as root for complete evidence: sudo {ctx.kvctl} inspect",
            paths=[e.path for e in unknown],
        )
    if foreign:
        out += _r(
            "foreign",
            g,
            Status.WARN,
            f"{entries(len(foreign))} not ours ({', '.join(sorted({str(e.decision.reason) for e in foreign}))}): "
            "never touched",
            f"see why: {ctx.kvctl} inspect",
            paths=[e.path for e in foreign],
        )
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
    """What the engines themselves left (vLLM, SGLang, NCCL, CUDA IPC): warn while dead ones hold memory."""
    from collections import Counter

    from .units import format_size

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


def check_vllm(ctx: Context) -> list[CheckResult]:
    g = Group.ENGINE
    try:
        doc = ctx.engines
    except DetectFailed as e:
        return _r("vllm", g, e.status, e.summary, e.fix, **e.details)
    section = doc.engines.get("vllm")
    if section is None:
        return _r("vllm", g, Status.SKIP, "vLLM is not installed here")
    return vllm_results(section, kvctl=ctx.kvctl) + ray_results(
        section.facts.get(RAY_INSTALLED) is True, ray_serves(ctx.view.facts.processes.values()), kvctl=ctx.kvctl
    )


# What kvcached does not cover under Ray (docs/VLLM.md, "Shapes").
RAY_NOT_COVERED = (
    "Ray-backed serves (--distributed-executor-backend ray, --data-parallel-backend ray) are not "
    "covered: their workers and engines are Ray actors outside the serve's process group, so no "
    "worker socket is served, no segment is claimed and no owner cleans up after them"
)
_RAY_ACTORS = ("RayWorkerProc", "EngineCoreActor", "DPMoEEngineCoreActor")


def ray_serves(processes: Any) -> list[int]:
    """PIDs of vLLM processes on this node that run on Ray (by command line or Ray actor title)."""
    out = []
    for p in processes:
        argv = p.cmdline
        title = argv[0] if argv else ""
        if title.startswith("ray::") and any(a in title for a in _RAY_ACTORS):
            out.append(p.pid)
            continue
        for i, arg in enumerate(argv[:-1]):
            if arg in ("--distributed-executor-backend", "--data-parallel-backend") and argv[i + 1] == "ray":
                out.append(p.pid)
                break
        else:
            if any(a in ("--distributed-executor-backend=ray", "--data-parallel-backend=ray") for a in argv):
                out.append(p.pid)
    return sorted(out)


def ray_results(installed: bool, pids: list[int], kvctl: str = "kvctl") -> list[CheckResult]:
    """Doctor lines about Ray: a warning naming the Ray-backed vLLM processes running here, else a note if installed.

    `kvctl`: the command the fix names, with the run's options (Context.kvctl).
    """
    g = Group.ENGINE
    if pids:
        return _r(
            "vllm-ray",
            g,
            Status.WARN,
            f"Ray-backed vLLM process(es) here (PID {', '.join(map(str, pids[:8]))}): " + RAY_NOT_COVERED,
            "serve with the default multiprocessing backends to have kvcached cover them; "
            f"meanwhile clean up by hand: {kvctl} gc --yes",
            pids=pids,
        )
    if installed:
        return _r("vllm-ray", g, Status.SKIP, "Ray is installed; none of its vLLM serves runs here. " + RAY_NOT_COVERED)
    return []


def vllm_results(section: EngineSection, kvctl: str = "kvctl") -> list[CheckResult]:
    """Doctor lines from the `vllm` section of kvcached.detect/1; fixes name `kvctl` (Context.kvctl)."""
    g = Group.ENGINE
    if section.error:
        return _r("vllm", g, Status.WARN, f"could not inspect the installed vLLM: {section.error}")
    # vLLM splits its allow-list on commas and keeps any spaces (vllm/envs.py).
    out, enable = _plugin_lines(
        section, "vllm", "vLLM", settings.VLLM_PLUGINS.name,
        "export ENABLE_KVCACHED=true (kvcached's vLLM plugin applies its patches in every vLLM process)",
        lambda text: [n for n in text.split(",") if n])
    return out + _patch_and_condition_lines(section, "vllm", "vLLM", enable, kvctl)


def _plugin_lines(section: EngineSection, engine: str, label: str, var: str, enable: str,
                  listed: Callable[[str], list[str]]) -> tuple[list[CheckResult], str]:
    """A section's `<engine>` line and, where the allow-list `var` leaves kvcached out, its `<engine>-plugins` line.

    Also returns the fix the section's later lines name: `enable`, or how to
    add kvcached to the allow-list, whose names `listed` reads as the engine does.
    """
    g, plugin = Group.ENGINE, section.plugin
    if not plugin.allowed:
        names = listed(plugin.allow_list or "")
        enable = (f"export {plugin.allow_list_var}={','.join(names + ['kvcached'])} (or unset "
                  f"{plugin.allow_list_var}): {label} loads only the plugins it lists")
    state = (f"enabled, but inactive: {var} excludes it" if plugin.enabled and not plugin.allowed
             else "enabled" if plugin.enabled else "not enabled in this environment")
    out = _r(engine, g, Status.OK if plugin.active else Status.WARN,
             f"{label} {section.version or '?'} installed; kvcached integration {state}",
             None if plugin.active else enable, detect=section.to_dict())
    if not plugin.allowed:
        out += _r(f"{engine}-plugins", g, Status.WARN,
                  f"{var}={plugin.allow_list!r} does not list kvcached: "
                  f"{label} never loads kvcached's plugin, so its patches are inactive", enable)
    return out, enable


def _patch_and_condition_lines(section: EngineSection, engine: str, label: str, enable: str,
                               kvctl: str) -> list[CheckResult]:
    """One line per patch (`<engine>-patch:<name>`) and per leak condition (`<engine>:<name>`) of a section."""
    out: list[CheckResult] = []
    for patch in section.patches:
        out += _patch_line(section, patch, enable, kvctl, engine, label)
    active = any(section.patch_active(p) for p in section.patches)
    g = Group.ENGINE
    for c in section.conditions:
        text = f"{label} {c.name}: " + {True: "present", False: "absent", None: "could not tell"}[c.present]
        text += f" ({c.detail})" if c.detail else ""
        if c.present is False:
            out += _r(f"{engine}:{c.name}", g, Status.OK, text)
        elif c.present and active:
            out += _r(f"{engine}:{c.name}", g, Status.OK, text + "; kvcached's patches work around it")
        else:
            out += _r(f"{engine}:{c.name}", g, Status.WARN,
                      text + ("; no kvcached patch is active" if c.present else ""),
                      f"{enable}; meanwhile: {kvctl} gc --yes")
    return out


def _patch_line(section: EngineSection, patch: PatchReport, enable: str, kvctl: str, engine: str = "vllm",
                label: str = "vLLM") -> list[CheckResult]:
    g, name, why = Group.ENGINE, f"{engine}-patch:{patch.name}", f" ({patch.reason})" if patch.reason else ""
    if section.patch_active(patch):
        return _r(name, g, Status.OK, f"kvcached patch {patch.name}: active{why}")
    if patch.status is PatchStatus.READY:
        return _r(name, g, Status.WARN, f"kvcached patch {patch.name}: inactive{why}", enable)
    if patch.status is PatchStatus.UNKNOWN_SHAPE:
        return _r(name, g, Status.WARN, f"kvcached patch {patch.name}: stands aside, unknown {label} shape{why}",
                  f"use a kvcached release that knows this {label}; meanwhile: {kvctl} gc --yes")
    words = {PatchStatus.NOT_NEEDED: "not needed", PatchStatus.DISABLED: "off",
             PatchStatus.NOT_COVERED: "not covered here"}
    return _r(name, g, Status.SKIP, f"kvcached patch {patch.name}: {words.get(patch.status, str(patch.status))}{why}")


def check_sglang(ctx: Context) -> list[CheckResult]:
    g = Group.ENGINE
    try:
        doc = ctx.engines
    except DetectFailed as e:
        return _r("sglang", g, e.status, e.summary, e.fix, **e.details)
    section = doc.engines.get("sglang")
    if section is None:
        return _r("sglang", g, Status.SKIP, "SGLang is not installed here")
    return sglang_results(section, kvctl=ctx.kvctl)


# What kvcached does not cover in SGLang (docs/SGLANG.md, "Shapes to stand aside from").
SGLANG_NOT_COVERED = (
    "kvcached stands aside (one log line in each process, nothing made, no owner cleanup) in SGLang serves on "
    "Ray (--use-ray), with the Rust server (SGLANG_RUST_SERVER), on the nodes after node 0 of a multi-node serve, "
    "and on devices other than CUDA and the CPU"
)


def sglang_results(section: EngineSection, kvctl: str = "kvctl") -> list[CheckResult]:
    """Doctor lines from the `sglang` section of kvcached.detect/1; fixes name `kvctl` (Context.kvctl)."""
    g = Group.ENGINE
    if section.error:
        return _r("sglang", g, Status.WARN, f"could not inspect the installed SGLang: {section.error}")
    # SGLang strips each name of its allow-list (sglang/srt/plugins/__init__.py).
    out, enable = _plugin_lines(
        section, "sglang", "SGLang", settings.SGLANG_PLUGINS.name,
        "export KVCACHED_ENABLE=1 (kvcached's SGLang plugin applies its patches in every SGLang process)",
        lambda text: [n.strip() for n in text.split(",") if n.strip()])
    return out + _patch_and_condition_lines(section, "sglang", "SGLang", enable, kvctl) + _sglang_shapes(section, kvctl)


def _sglang_shapes(section: EngineSection, kvctl: str) -> list[CheckResult]:
    facts = section.facts
    here = []
    if facts.get(SGLANG_RUST_SERVER) is True:
        here.append("SGLANG_RUST_SERVER is set in this environment")
    if facts.get(SGLANG_PLATFORM_COVERED) is False:
        here.append(f"SGLang's platform here is {facts.get(SGLANG_PLATFORM)!r}")
    if here:
        return _r("sglang-shapes", Group.ENGINE, Status.WARN, "; ".join(here) + ": " + SGLANG_NOT_COVERED,
                  f"serve without them to have kvcached cover the serve; meanwhile clean up by hand: {kvctl} gc --yes")
    ray = "; Ray is installed here" if facts.get(RAY_INSTALLED) is True else ""
    return _r("sglang-shapes", Group.ENGINE, Status.SKIP, SGLANG_NOT_COVERED + ray)


def check_pods(ctx: Context) -> list[CheckResult]:
    """With -A: warn for each place other than the host's whose dead leftovers `kvctl gc -A --engines` removes."""
    g = Group.NODE
    if not ctx.all_places:
        return _r("pods", g, Status.SKIP, "the pods' volumes and containers' shm were not looked at (run with -A)")
    from .places.doctor import dead_places
    from .units import format_size

    dead, n, errors = dead_places(ctx.layout, ctx.policy, ctx.plan.facts, host_plan=ctx.plan,
                                  kubelet_dir=ctx.kubelet_dir, proc_root=ctx.proc_root)
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


CHECKS: tuple[Check, ...] = (
    Check("shm", Group.ENVIRONMENT, "/dev/shm present, on tmpfs, with free space and inodes", check_shm),
    Check("tmp", Group.ENVIRONMENT, "/tmp sticky when world-writable", check_tmp),
    Check("proc", Group.ENVIRONMENT, "/proc readable, hidepid", check_proc),
    Check("privileges", Group.ENVIRONMENT, "who we run as and what we may clean", check_privileges),
    Check("ipc-name", Group.CONFIGURATION, "KVCACHED_IPC_NAME sanitised vs. raw", check_ipc_name),
    Check("socket-paths", Group.CONFIGURATION, "socket paths within 108 bytes", check_socket_paths),
    Check("extension", Group.CONFIGURATION, "compiled extension loadable (in a subprocess)", check_extension),
    Check("stale", Group.NODE, "stale, unknown and foreign entries (the scan gc uses)", check_stale),
    Check("orphans", Group.NODE, "orphaned workers", check_orphans),
    Check("namespaces", Group.NODE, "deployments in other mount namespaces", check_namespaces),
    Check("engine-leftovers", Group.NODE, "what vLLM, SGLang, NCCL and CUDA left that is provably dead",
          check_engine_leftovers),
    Check("pods", Group.NODE, "with -A: pod volumes and containers' shm holding dead leftovers", check_pods),
    Check("vllm", Group.ENGINE, "installed vLLM: shutdown conditions and kvcached patches", check_vllm),
    Check("sglang", Group.ENGINE, "installed SGLang: stop hazards, kvcached patches, shapes not covered",
          check_sglang),
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
