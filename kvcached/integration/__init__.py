"""Engine integrations (vLLM first). Runtime layer: loaded only inside engine processes.

Importing this package imports no engine: `vllm_plugin.register` is what vLLM
calls, and `vllm_patches.detect()` imports vLLM only when it is called.
"""

from __future__ import annotations

from collections.abc import Mapping

from .. import settings
from ..node.layout import Layout

ENV_ROOT = settings.ROOT.name
PLUGIN_NAME = "kvcached"  # the entry point's name in group vllm.general_plugins
ENV_VLLM_PLUGINS = settings.VLLM_PLUGINS.name


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """True when kvcached is switched on: upstream's `ENABLE_KVCACHED=true`, our `KVCACHED_ENABLE=1`,
    or `KVCACHED_ELASTIC=1` (elastic KV memory needs the other patches: the worker listener)."""
    return any(s.get(environ) for s in (settings.ENABLE_KVCACHED, settings.ENABLE, settings.ELASTIC))


def plugin_allowed(environ: Mapping[str, str] | None = None) -> bool:
    """False when `VLLM_PLUGINS` is set and does not list `kvcached`: vLLM then never calls our plugin.

    Parsed as vLLM 0.33 parses it (`envs.VLLM_PLUGINS`): split on `,`, names
    compared exactly, so `VLLM_PLUGINS=""` allows no plugin at all.
    """
    allow = settings.VLLM_PLUGINS.get(environ)
    return allow is None or PLUGIN_NAME in allow.split(",")


def layout_from_env(environ: Mapping[str, str] | None = None) -> Layout:
    """The node layout engine processes use: `/`, or `KVCACHED_ROOT` (tests, chroots); raises SettingError
    for a relative `KVCACHED_ROOT` (settings.ROOT says why it is strict)."""
    return Layout(root=settings.ROOT.get(environ))
