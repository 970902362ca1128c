"""What kvcached finds in the installed vLLM: its shutdown conditions, each patch's status, the `vllm` section.

The section goes into kvcached.detect/1 (`python -m kvcached.integration.detect
--json`, read by `kvctl doctor`). Building it imports vLLM; importing this
module does not.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re

from ... import settings
from ...node.detectdoc import RAY_INSTALLED, Condition, EngineSection, Plugin
from .. import enabled
from ..patchkit import is_ours
from .common import M_ARGS, M_CORE, M_LMCACHE, module, plugin_allowed, source


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


def _ray_installed() -> bool:
    try:
        return importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):
        return False


def section() -> EngineSection:
    """The `vllm` section: version, plugin, patches, conditions, facts. Imports vLLM; never raises."""
    plugin = Plugin(enabled=enabled(), allowed=plugin_allowed(), allow_list_var=settings.VLLM_PLUGINS.name,
                    allow_list=settings.VLLM_PLUGINS.get())
    facts: dict[str, bool | str | None] = {RAY_INSTALLED: _ray_installed()}
    try:
        version = getattr(module("vllm"), "__version__", None)
    except Exception as e:
        return EngineSection(version=None, error=f"vLLM not importable: {type(e).__name__}: {e}", plugin=plugin,
                             facts=facts)
    from .patches import REGISTRY

    return EngineSection(version=version if isinstance(version, str) else None, error=None, plugin=plugin,
                         patches=REGISTRY.report(), conditions=conditions(), facts=facts)
