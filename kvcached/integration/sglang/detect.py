"""What kvcached finds in the installed SGLang: its stop hazards, each patch's status, the `sglang` section.

The section goes into kvcached.detect/1 (`python -m kvcached.integration.detect
--json`, read by `kvctl doctor`), with everything doctor says about SGLang: how
to turn kvcached on here, and the shapes kvcached stands aside from. Building
it imports SGLang's scheduler and engine modules (what the patches probe);
importing this module does not.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from collections.abc import Callable, Mapping

from ... import settings
from ...node import Condition, EngineSection, Hazard, Plugin
from .. import enabled
from ..patchkit import source
from .common import (
    COVERED_DEVICES,
    M_COMMON,
    M_ENGINE,
    M_SCHEDULER,
    M_TOKENIZER,
    PLUGIN_NAME,
    module,
    plugin_allowed,
)

LABEL = "SGLang"
ENABLE_FIX = "export ENABLE_KVCACHED=true (kvcached's SGLang plugin applies its patches in every SGLang process)"
# Facts of the sglang section: the shapes hazard is judged from the first four, the rest are SGLang's stop timings.
RAY_INSTALLED = "ray_installed"  # Ray-backed serves (--use-ray) are not covered
RUST_SERVER = "rust_server"  # SGLANG_RUST_SERVER is set: serves started so are not covered
PLATFORM = "platform"  # SGLang's platform here, by its device name ("unknown": none detected)
PLATFORM_COVERED = "platform_covered"  # CUDA or the CPU; null when no platform was detected
EXIT_WAIT = "scheduler_exit_timeout_s"  # how long main waits for schedulers after ShutdownReq before SIGKILL
KILL_WAITS = "kill_tree_waits"  # kill_process_tree waits for the processes it SIGKILLed

_SIGTERM = re.compile(r"signal\.SIGTERM")
_SELF_KILL = re.compile(r"parent_pid\s*==\s*os\.getpid\(\)\s*:\s*\n\s*itself\.kill\(\)")
_KILL_SELF_CALL = re.compile(r"kill_process_tree\(\s*os\.getpid\(\)\s*\)")
_KILL_CHILDREN = re.compile(r"kill_process_tree\(\s*os\.getpid\(\),\s*include_parent=False")


def _condition(name: str, read: Callable[[], tuple[bool | None, str]]) -> Condition:
    try:
        present, detail = read()
        return Condition(name=name, present=present, detail=detail)
    except Exception as e:
        return Condition(name=name, present=None, detail=f"cannot inspect: {type(e).__name__}: {e}")


def _scheduler_sigterm() -> tuple[bool | None, str]:
    mod = module(M_SCHEDULER)
    src = "".join(source(getattr(mod, f, None)) or "" for f in ("run_scheduler_process", "configure_scheduler_process"))
    if not src:
        return None, "no source for run_scheduler_process"
    if _SIGTERM.search(src):
        return False, "SGLang's scheduler installs a SIGTERM handler"
    return True, ("schedulers install no SIGTERM handler: a process-group SIGTERM (systemd, docker stop, a pod's "
                  "end) kills them at once, and they give back nothing themselves")


def _kill_self() -> tuple[bool | None, str]:
    src = source(getattr(module(M_COMMON), "kill_process_tree", None))
    if src is None:
        return None, "no source for kill_process_tree"
    if not _SELF_KILL.search(src):
        return False, "kill_process_tree no longer SIGKILLs its caller"
    crash = source(getattr(getattr(module(M_TOKENIZER), "SignalHandler", None), "running_phase_sigquit_handler",
                           None)) or ""
    where = "main's SIGQUIT handler (a crashed scheduler) calls it" if _KILL_SELF_CALL.search(crash) else \
        "its callers decide"
    return True, ("kill_process_tree(os.getpid()) SIGKILLs the children, then main itself: nothing in main runs "
                  f"afterwards ({where})")


def _offline_shutdown() -> tuple[bool | None, str]:
    src = source(getattr(getattr(module(M_ENGINE), "Engine", None), "shutdown", None))
    if src is None:
        return None, "no source for Engine.shutdown"
    present = bool(_KILL_CHILDREN.search(src)) and "ShutdownReq" not in src
    return present, ("the offline Engine.shutdown() SIGKILLs the schedulers without a ShutdownReq: they give back "
                     "nothing themselves" if present else "Engine.shutdown asks the schedulers to stop first")


def conditions() -> tuple[Condition, ...]:
    """The stop paths of the installed SGLang that leave kvcached state behind (docs/SGLANG.md, "Stop paths")."""
    return (_condition("scheduler-sigterm-default", _scheduler_sigterm),
            _condition("kill-tree-kills-main", _kill_self),
            _condition("offline-shutdown-sigkills", _offline_shutdown))


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def facts() -> dict[str, bool | str | None]:
    """What doctor reports beside the patches: shapes kvcached does not cover, SGLang's stop timings."""
    out: dict[str, bool | str | None] = {RAY_INSTALLED: _installed("ray")}
    try:
        out[RUST_SERVER] = bool(module("sglang.srt.environ").envs.SGLANG_RUST_SERVER.get())
    except Exception:
        out[RUST_SERVER] = None
    try:
        from sglang.srt.platforms import current_platform

        name = str(getattr(current_platform, "device_name", None) or type(current_platform).__name__)
        out[PLATFORM] = name
        # "unknown": no device platform detected (SGLang's base platform); the serve's --device decides.
        out[PLATFORM_COVERED] = None if name == "unknown" else name in COVERED_DEVICES
    except Exception:
        out[PLATFORM] = out[PLATFORM_COVERED] = None
    try:
        out[EXIT_WAIT] = str(module(M_TOKENIZER)._SCHEDULER_EXIT_TIMEOUT_SECS)
    except Exception:
        out[EXIT_WAIT] = None
    out[KILL_WAITS] = "wait_timeout" in (source(getattr(module(M_COMMON), "kill_process_tree", None)) or "")
    return out


# What kvcached does not cover in SGLang (docs/SGLANG.md, "Shapes to stand aside from").
NOT_COVERED = (
    "kvcached stands aside (one log line in each process, nothing made, no owner cleanup) in SGLang serves on "
    "Ray (--use-ray), with the Rust server (SGLANG_RUST_SERVER), on the nodes after node 0 of a multi-node serve, "
    "and on devices other than CUDA and the CPU"
)


def shapes_hazard(facts: Mapping[str, bool | str | None]) -> Hazard:
    """The shapes kvcached stands aside from: present when this environment is one (by `facts`), else a note."""
    here = []
    if facts.get(RUST_SERVER) is True:
        here.append("SGLANG_RUST_SERVER is set in this environment")
    if facts.get(PLATFORM_COVERED) is False:
        here.append(f"SGLang's platform here is {facts.get(PLATFORM)!r}")
    note = "Ray is installed here" if facts.get(RAY_INSTALLED) is True else ""
    return Hazard(name="shapes", present=bool(here), summary=NOT_COVERED, detail="; ".join(here) or note,
                  fix="serve without them to have kvcached cover the serve", report_absent=True)


def plugin(environ: Mapping[str, str] | None = None) -> Plugin:
    """Whether SGLang processes started with `environ` (default: ours) load kvcached, and what to do if not."""
    allow, var = settings.SGLANG_PLUGINS.get(environ), settings.SGLANG_PLUGINS.name
    # SGLang strips each name of its allow-list (sglang/srt/plugins/__init__.py).
    return Plugin.of(enabled=enabled(environ), allowed=plugin_allowed(environ), allow_list_var=var, allow_list=allow,
                     listed=[n.strip() for n in (allow or "").split(",") if n.strip()],
                     label=LABEL, enable=ENABLE_FIX, name=PLUGIN_NAME)


def section() -> EngineSection:
    """The `sglang` section: version, plugin, patches, conditions, hazards, facts. Imports SGLang; never raises."""
    try:
        version: str | None = importlib.metadata.version("sglang")
        module(M_SCHEDULER)
        module(M_ENGINE)
    except Exception as e:
        return EngineSection(version=None, error=f"SGLang not importable: {type(e).__name__}: {e}", plugin=plugin(),
                             label=LABEL)
    from .patches import REGISTRY

    found = facts()
    return EngineSection(version=version, error=None, plugin=plugin(), patches=REGISTRY.report(),
                         conditions=conditions(), facts=found, label=LABEL, hazards=(shapes_hazard(found),))
