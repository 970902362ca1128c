"""What kvcached finds in the installed vLLM: its shutdown conditions, each patch's status, the `vllm` section.

The section goes into kvcached.detect/1 (`python -m kvcached.integration.detect
--json`, read by `kvctl doctor`), with everything doctor says about vLLM: how
to turn kvcached on here, and the Ray hazard with the processes that show it.
Building it imports vLLM; importing this module does not.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from collections.abc import Mapping

from ... import settings
from ...node import Condition, EngineSection, Hazard, Plugin, ProcessMatch
from .. import enabled
from ..patchkit import is_ours
from .common import M_ARGS, M_CORE, M_LMCACHE, PLUGIN_NAME, PROVEN_VERSIONS, module, plugin_allowed, source


def _shutdown_timeout() -> Condition:
    name = "shutdown-timeout-zero"
    try:
        args = module(M_ARGS).EngineArgs
        field = next((f for f in dataclasses.fields(args) if f.name == "shutdown_timeout"), None)
        if field is None or field.default is dataclasses.MISSING:
            return Condition(name=name, present=None, detail="EngineArgs has no shutdown_timeout default")
        zero = field.default == 0
        return Condition(name=name, present=zero,
                         detail=f"EngineArgs.shutdown_timeout defaults to {field.default!r}"
                         + ("; engines are SIGKILLed almost at once after SIGTERM" if zero else ""))
    except Exception as e:
        return Condition(name=name, present=None, detail=f"cannot inspect: {type(e).__name__}: {e}")


_DFL_RE = re.compile(r"signal\.signal\(\s*signal\.SIGTERM\s*,\s*signal\.SIG_DFL\s*\)")
_TEARDOWN_RE = re.compile(r"engine_core\.shutdown\(\s*\)")


def _sigterm_reset() -> Condition:
    name = "sigterm-reset-before-teardown"
    try:
        src = source(module(M_CORE).EngineCoreProc.run_engine_core)
        if src is None:
            return Condition(name=name, present=None, detail="no source for EngineCoreProc.run_engine_core")
        dfl, teardown = _DFL_RE.search(src), _TEARDOWN_RE.search(src)
        if teardown is None:
            return Condition(name=name, present=None,
                             detail="EngineCoreProc.run_engine_core no longer calls engine_core.shutdown()")
        present = dfl is not None and dfl.start() < teardown.start()
        return Condition(name=name, present=present,
                         detail="EngineCoreProc.run_engine_core restores SIG_DFL for SIGTERM before "
                         "engine_core.shutdown(): a second SIGTERM kills EngineCore mid-teardown"
                         if present else "SIGTERM keeps a handler during EngineCore teardown")
    except Exception as e:
        return Condition(name=name, present=None, detail=f"cannot inspect: {type(e).__name__}: {e}")


def _lmcache() -> Condition:
    name = "lmcache-no-shutdown-forwarding"
    try:
        own = module(M_LMCACHE).LMCacheConnectorV1.__dict__.get("shutdown")
        present = own is None or is_ours(own)  # our own override does not count: it is the fix
        return Condition(name=name, present=present,
                         detail="LMCacheConnectorV1 inherits the base no-op shutdown(): the LMCache engine is "
                         "never stopped" if present else "LMCacheConnectorV1 defines shutdown()")
    except Exception as e:
        return Condition(name=name, present=None, detail=f"cannot inspect: {type(e).__name__}: {e}")


def conditions() -> tuple[Condition, ...]:
    """The shutdown behaviours of the installed vLLM that leak state (docs/VLLM.md, "Conditions")."""
    return (_shutdown_timeout(), _sigterm_reset(), _lmcache())


LABEL = "vLLM"
RAY_INSTALLED = "ray_installed"  # a fact of the section
ENABLE_FIX = "export ENABLE_KVCACHED=true (kvcached's vLLM plugin applies its patches in every vLLM process)"


def plugin(environ: Mapping[str, str] | None = None) -> Plugin:
    """Whether vLLM processes started with `environ` (default: ours) load kvcached, and what to do if not."""
    allow, var = settings.VLLM_PLUGINS.get(environ), settings.VLLM_PLUGINS.name
    # vLLM splits its allow-list on commas and keeps any spaces (vllm/envs.py).
    return Plugin.of(enabled=enabled(environ), allowed=plugin_allowed(environ), allow_list_var=var, allow_list=allow,
                     listed=[n for n in (allow or "").split(",") if n],
                     label=LABEL, enable=ENABLE_FIX, name=PLUGIN_NAME)


# What kvcached does not cover under Ray (docs/VLLM.md, "Shapes").
RAY_NOT_COVERED = (
    "Ray-backed serves (--distributed-executor-backend ray, --data-parallel-backend ray) are not "
    "covered: their workers and engines are Ray actors outside the serve's process group, so no "
    "worker socket is served, no segment is claimed and no owner cleans up after them"
)
# A Ray-backed serve on this node: its command line, or a Ray actor's title (`ray::Class.method`).
RAY_PROCESSES = ProcessMatch(
    label="Ray-backed vLLM",
    argv0_prefixes=tuple(f"ray::{actor}" for actor in ("RayWorkerProc", "EngineCoreActor", "DPMoEEngineCoreActor")),
    options=(("--distributed-executor-backend", "ray"), ("--data-parallel-backend", "ray")),
)


def ray_hazard(installed: bool) -> Hazard:
    """Ray-backed serves: shown when one runs on the node (whatever this interpreter has), noted when Ray is here."""
    return Hazard(name="ray", present=False, summary=RAY_NOT_COVERED,
                  detail="Ray is installed here" if installed else "",
                  fix="serve with the default multiprocessing backends to have kvcached cover them",
                  processes=RAY_PROCESSES, report_absent=installed)


def _ray_installed() -> bool:
    try:
        return importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):
        return False


def section() -> EngineSection:
    """The `vllm` section: version, plugin, patches, conditions, hazards, facts. Imports vLLM; never raises."""
    ray = _ray_installed()
    # The hazard stands even where vLLM does not import: a Ray-backed serve may run here from another install.
    base = EngineSection(version=None, error=None, plugin=plugin(), facts={RAY_INSTALLED: ray}, label=LABEL,
                         hazards=(ray_hazard(ray),), proven=PROVEN_VERSIONS)
    try:
        version = getattr(module("vllm"), "__version__", None)
    except Exception as e:
        return dataclasses.replace(base, error=f"vLLM not importable: {type(e).__name__}: {e}")
    from .patches import REGISTRY

    return dataclasses.replace(base, version=version if isinstance(version, str) else None,
                               patches=REGISTRY.report(), conditions=conditions())
